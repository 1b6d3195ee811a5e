// silu as csrc/cpu/vec_math.h's silu_scalar (sign split, clamp): one definition for the
// element-wise kernel and the fused SwiGLU epilogue, so fused equals unfused bitwise.
#pragma once

namespace minfer::cuda {

__device__ __forceinline__ float silu_f(float x) {
    const float e = expf(-fabsf(x));
    const float num = x >= 0.0f ? x : (x < -200.0f ? -200.0f : x) * e;
    return num / (1.0f + e);
}

}  // namespace minfer::cuda
