// NeoX RoPE of one (token, head) row element, shared by the plain kernel, the fused
// rope + KV store kernel and the q|k|v matvec's tail (k_matvec.cu): one definition with
// every float operation spelled out, so all three give the same bits wherever inlined.
#pragma once
#include <cstdint>

namespace minfer::cuda {

// The angle of rotated pair k at position p, in double as the CPU computes it.
__device__ __forceinline__ void rope_cs(int64_t k, int64_t n_rot, int32_t p, float freq_base, float& c, float& s) {
    const double inv = pow((double)freq_base, -2.0 * (double)k / (double)n_rot);
    const double th = (double)p * inv;
    c = (float)cos(th);
    s = (float)sin(th);
}

// The rotation of one pair (x0, x1) by the angle (c, s).
__device__ __forceinline__ void rope_rot(float x0, float x1, float c, float s, float& y0, float& y1) {
    y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Element k of the row with pair k's angle (c, s) given (k < n_rot/2: writes k and
// k + n_rot/2; else a pass-through dim). The row is read through L2 (__ldcg): the matvec
// tail reads rows other blocks wrote during its launch.
__device__ __forceinline__ void rope_apply(const float* __restrict__ xr, int64_t k, int64_t half, int64_t n_rot,
                                           float c, float s, int64_t& i0, float& y0, int64_t& i1, float& y1) {
    if (k < half) {
        i0 = k;
        i1 = k + half;
        rope_rot(__ldcg(xr + k), __ldcg(xr + k + half), c, s, y0, y1);
    } else {
        i0 = i1 = n_rot + (k - half);
        y0 = y1 = __ldcg(xr + i0);
    }
}

__device__ __forceinline__ void rope_elem(const float* __restrict__ xr, int64_t k, int64_t half, int64_t n_rot,
                                          int32_t p, float freq_base, int64_t& i0, float& y0, int64_t& i1,
                                          float& y1) {
    float c = 0.0f, s = 0.0f;
    if (k < half) rope_cs(k, n_rot, p, freq_base, c, s);
    rope_apply(xr, k, half, n_rot, c, s, i0, y0, i1, y1);
}

}  // namespace minfer::cuda
