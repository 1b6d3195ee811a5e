// NeoX RoPE of one (token, head) row element, shared by the plain kernel, the fused
// rope + KV store kernel and the q|k|v matvec's tail (k_matvec.cu): one definition with
// every float operation spelled out, so all three give the same bits wherever inlined.
#pragma once
#include <cstdint>

namespace minfer::cuda {

// Element k of the row: a rotated pair (k < n_rot/2: writes k and k + n_rot/2) or a
// pass-through dim. Angles in double as the CPU computes them. The row is read through
// L2 (__ldcg): the matvec tail reads rows other blocks wrote during its launch.
__device__ __forceinline__ void rope_elem(const float* __restrict__ xr, int64_t k, int64_t half, int64_t n_rot,
                                          int32_t p, float freq_base, int64_t& i0, float& y0, int64_t& i1,
                                          float& y1) {
    if (k < half) {
        const double inv = pow((double)freq_base, -2.0 * (double)k / (double)n_rot);
        const double th = (double)p * inv;
        const float c = (float)cos(th), s = (float)sin(th);
        const float x0 = __ldcg(xr + k), x1 = __ldcg(xr + k + half);
        i0 = k;
        y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        i1 = k + half;
        y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    } else {
        i0 = i1 = n_rot + (k - half);
        y0 = y1 = __ldcg(xr + i0);
    }
}

}  // namespace minfer::cuda
