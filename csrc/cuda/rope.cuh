// RoPE of one (token, head) row element, shared by the plain kernel, the fused
// rope + KV store kernel and the q|k|v matvec's tail (k_matvec.cu): one definition with
// every float operation spelled out, so all three give the same bits wherever inlined.
// Both styles of plan.h's ROPE: NeoX (pair k is elements k, k + n_rot/2) and normal
// (elements 2k, 2k + 1), with the angle scalings of RopeCfg (kernels.h).
#pragma once
#include <cstdint>

#include "cuda/kernels.h"

namespace minfer::cuda {

// The angle of rotated pair k at position p, in double as the CPU computes it (cpu/ops.cpp
// rope_f32: base^(-2k/n_rot), times freq_scale, over factors[k], times p; cos and sin
// rounded to float, then times attn_factor in float). A scale or attention factor of 1
// and no factors leave the plain angle's bits: x * 1 is exact.
__device__ __forceinline__ void rope_cs(int64_t k, int64_t n_rot, int32_t p, const RopeCfg& r, float& c, float& s) {
    double inv = pow((double)r.base, -2.0 * (double)k / (double)n_rot);
    inv *= (double)r.scale;
    if (r.factors) inv /= (double)r.factors[k];
    const double th = (double)p * inv;
    c = __fmul_rn((float)cos(th), r.attn);
    s = __fmul_rn((float)sin(th), r.attn);
}

// The same angle from a table of every pair's angle by position (rows positions of
// n_rot / 2 pairs, filled by rope_cs) when it holds p: the same values.
__device__ __forceinline__ void rope_cs_at(const float2* table, int64_t rows, int64_t k, int64_t n_rot, int32_t p,
                                           const RopeCfg& r, float& c, float& s) {
    if (table && p >= 0 && p < rows) {
        const float2 v = table[(int64_t)p * (n_rot / 2) + k];
        c = v.x;
        s = v.y;
    } else {
        rope_cs(k, n_rot, p, r, c, s);
    }
}

// The rotation of one pair (x0, x1) by the angle (c, s).
__device__ __forceinline__ void rope_rot(float x0, float x1, float c, float s, float& y0, float& y1) {
    y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// The two elements of rotated pair k (k < n_rot/2) in a row of the given style.
__device__ __forceinline__ void rope_pair_at(int style, int64_t k, int64_t half, int64_t& i0, int64_t& i1) {
    i0 = style ? 2 * k : k;
    i1 = style ? 2 * k + 1 : k + half;
}

// Work item k of a row whose element i is at(i), with pair k's angle (c, s) given:
// k < n_rot/2 writes pair k, else it is pass-through dim n_rot + (k - n_rot/2).
template <class At>
__device__ __forceinline__ void rope_apply_at(At&& at, int style, int64_t k, int64_t half, int64_t n_rot, float c,
                                              float s, int64_t& i0, float& y0, int64_t& i1, float& y1) {
    if (k < half) {
        rope_pair_at(style, k, half, i0, i1);
        rope_rot(at(i0), at(i1), c, s, y0, y1);
    } else {
        i0 = i1 = n_rot + (k - half);
        y0 = y1 = at(i0);
    }
}

// The same of row xr, read through L2 (__ldcg): the matvec tail reads rows other blocks
// wrote during its launch.
__device__ __forceinline__ void rope_apply(const float* __restrict__ xr, int style, int64_t k, int64_t half,
                                           int64_t n_rot, float c, float s, int64_t& i0, float& y0, int64_t& i1,
                                           float& y1) {
    rope_apply_at([&](int64_t i) { return __ldcg(xr + i); }, style, k, half, n_rot, c, s, i0, y0, i1, y1);
}

__device__ __forceinline__ void rope_elem(const float* __restrict__ xr, int64_t k, int64_t half, int64_t n_rot,
                                          int32_t p, const RopeCfg& r, int64_t& i0, float& y0, int64_t& i1,
                                          float& y1) {
    float c = 0.0f, s = 0.0f;
    if (k < half) rope_cs(k, n_rot, p, r, c, s);
    rope_apply(xr, r.style, k, half, n_rot, c, s, i0, y0, i1, y1);
}

}  // namespace minfer::cuda
