// Device-side decoding of GGML blocks, 32 elements ("a chunk") at a time: the unit
// every CUDA matmul, dequantization and row gather works in. K-quant superblocks are
// 8 chunks. Formulas follow ggml's dequantize_row_* exactly (d * sc * q - dmin * m),
// so the f16 prefill operand and the decode dot product decode identically.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "common/ggml_types.h"
#include "cuda/layout.h"

namespace minfer::cuda {

__device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ uint16_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ void ld_bytes32_a16(const uint8_t* p, uint8_t q[32]) {
    reinterpret_cast<uint4*>(q)[0] = reinterpret_cast<const uint4*>(p)[0];
    reinterpret_cast<uint4*>(q)[1] = reinterpret_cast<const uint4*>(p)[1];
}

// 32 bytes from two 16-byte-aligned halves (the packed K-quant layout's units).
__device__ __forceinline__ void ld_halves32(const uint8_t* p0, const uint8_t* p1, uint8_t q[32]) {
    reinterpret_cast<uint4*>(q)[0] = *reinterpret_cast<const uint4*>(p0);
    reinterpret_cast<uint4*>(q)[1] = *reinterpret_cast<const uint4*>(p1);
}

// A K-quant sub-block's 6-bit scale and min from the 12 scale bytes as three
// little-endian words (no byte array, so
// nothing lands in local memory).
__device__ __forceinline__ void k4_scale_min_w(int j, uint32_t w0, uint32_t w1, uint32_t w2, int& d, int& m) {
    auto B = [](uint32_t w, int b) { return (int)((w >> (8 * b)) & 0xFF); };
    if (j < 4) {
        d = B(w0, j) & 63;
        m = B(w1, j) & 63;
    } else {
        d = (B(w2, j - 4) & 0xF) | ((B(w0, j - 4) >> 6) << 4);
        m = (B(w2, j - 4) >> 4) | ((B(w1, j - 4) >> 6) << 4);
    }
}

// Sub-blocks 2p and 2p + 1's scales and mins at once, without branches (the matvec's
// lanes have different p): each pair sits in one 16-bit half of the scale words.
__device__ __forceinline__ void k4_scale_min_pair(int p, uint32_t w0, uint32_t w1, uint32_t w2, int& d0, int& m0,
                                                  int& d1, int& m1) {
    const int sh = 16 * (p & 1);
    const uint32_t a0 = w0 >> sh, a1 = w1 >> sh, a2 = w2 >> sh;
    uint32_t d, m;
    if (p >= 2) {
        d = (a2 & 0x0F0Fu) | ((a0 >> 2) & 0x3030u);
        m = ((a2 >> 4) & 0x0F0Fu) | ((a1 >> 2) & 0x3030u);
    } else {
        d = a0 & 0x3F3Fu;
        m = a1 & 0x3F3Fu;
    }
    d0 = (int)(d & 0xFF);
    d1 = (int)((d >> 8) & 0xFF);
    m0 = (int)(m & 0xFF);
    m1 = (int)((m >> 8) & 0xFF);
}

// The same from a lane's constants (K4Sel, chosen once: the staged matvec's lanes keep
// one p for every row). Both halves of the branch above in one expression: for p < 2 the
// masks take w0 / w1's low 6 bits and nothing of w2; for p >= 2 their top two bits and
// w2's nibbles.
struct K4Sel {
    uint32_t sh, s01, k01, k2;  // 16 (p & 1), sh + 2 (p >> 1), masks
};
__device__ __forceinline__ void k4_scale_min_sel(const K4Sel& s, uint32_t w0, uint32_t w1, uint32_t w2, int& d0,
                                                 int& m0, int& d1, int& m1) {
    const uint32_t t = w2 >> s.sh;
    const uint32_t d = ((w0 >> s.s01) & s.k01) | (t & s.k2);
    const uint32_t m = ((w1 >> s.s01) & s.k01) | ((t >> 4) & s.k2);
    d0 = (int)(d & 0xFF);
    d1 = (int)(d >> 8);
    m0 = (int)(m & 0xFF);
    m1 = (int)(m >> 8);
}
// Overloads for UnitK45: p (decided per unit) or a lane's K4Sel.
__device__ __forceinline__ void k4_scale_min(int p, uint32_t w0, uint32_t w1, uint32_t w2, int& d0, int& m0, int& d1,
                                             int& m1) {
    k4_scale_min_pair(p, w0, w1, w2, d0, m0, d1, m1);
}
__device__ __forceinline__ void k4_scale_min(const K4Sel& s, uint32_t w0, uint32_t w1, uint32_t w2, int& d0, int& m0,
                                             int& d1, int& m1) {
    k4_scale_min_sel(s, w0, w1, w2, d0, m0, d1, m1);
}

// A decoded chunk's 32 floats as f16 in four 16-byte stores (the prefill GEMM's weight
// conversion, the MoE tile's shared memory).
__device__ __forceinline__ void store_half32(const float v[32], uint4* dst) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        uint4 u;
        __half2* h = reinterpret_cast<__half2*>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[8 * q + 2 * i], v[8 * q + 2 * i + 1]);
        dst[q] = u;
    }
}

// Decode chunk c (elements 32c .. 32c+31) of a device row of type T (cuda/layout.h:
// packed for the legacy types, Q4_K and Q6_K; nb = chunks per row) into v.
template <int T>
__device__ __forceinline__ void deq32(const uint8_t* __restrict__ row, int c, int nb, float v[32]);

template <>
__device__ __forceinline__ void deq32<T_F32>(const uint8_t* __restrict__ row, int c, int, float v[32]) {
    const float4* p = reinterpret_cast<const float4*>(row) + c * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float4 t = p[i];
        v[4 * i] = t.x; v[4 * i + 1] = t.y; v[4 * i + 2] = t.z; v[4 * i + 3] = t.w;
    }
}

template <>
__device__ __forceinline__ void deq32<T_F16>(const uint8_t* __restrict__ row, int c, int, float v[32]) {
    const uint4* p = reinterpret_cast<const uint4*>(row) + c * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint4 t = p[i];
        const __half2* h = reinterpret_cast<const __half2*>(&t);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float2 f = __half22float2(h[j]);
            v[8 * i + 2 * j] = f.x; v[8 * i + 2 * j + 1] = f.y;
        }
    }
}

// The 16 quant bytes of a packed 4/5-bit block.
__device__ __forceinline__ void ld_qs16(const uint8_t* __restrict__ row, int c, uint8_t q[16]) {
    *reinterpret_cast<uint4*>(q) = *reinterpret_cast<const uint4*>(row + 16 * c);
}

template <>
__device__ __forceinline__ void deq32<T_Q4_0>(const uint8_t* __restrict__ row, int c, int nb, float v[32]) {
    const float d = h2f(ld16(row + 16 * nb + 2 * c));
    uint8_t q[16];
    ld_qs16(row, c, q);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        v[j] = (float)((int)(q[j] & 0xF) - 8) * d;
        v[j + 16] = (float)((int)(q[j] >> 4) - 8) * d;
    }
}

template <>
__device__ __forceinline__ void deq32<T_Q4_1>(const uint8_t* __restrict__ row, int c, int nb, float v[32]) {
    const uint32_t dm = ld32(row + 16 * nb + 4 * c);
    const float d = h2f(dm & 0xFFFF), m = h2f(dm >> 16);
    uint8_t q[16];
    ld_qs16(row, c, q);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        v[j] = (float)(q[j] & 0xF) * d + m;
        v[j + 16] = (float)(q[j] >> 4) * d + m;
    }
}

template <>
__device__ __forceinline__ void deq32<T_Q5_0>(const uint8_t* __restrict__ row, int c, int nb, float v[32]) {
    const float d = h2f(ld16(row + 20 * nb + 2 * c));
    const uint32_t qh = ld32(row + 16 * nb + 4 * c);
    uint8_t q[16];
    ld_qs16(row, c, q);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int h0 = ((qh >> j) << 4) & 0x10;
        const int h1 = (qh >> (j + 12)) & 0x10;
        v[j] = (float)(((q[j] & 0xF) | h0) - 16) * d;
        v[j + 16] = (float)(((q[j] >> 4) | h1) - 16) * d;
    }
}

template <>
__device__ __forceinline__ void deq32<T_Q5_1>(const uint8_t* __restrict__ row, int c, int nb, float v[32]) {
    const uint32_t dm = ld32(row + 20 * nb + 4 * c);
    const float d = h2f(dm & 0xFFFF), m = h2f(dm >> 16);
    const uint32_t qh = ld32(row + 16 * nb + 4 * c);
    uint8_t q[16];
    ld_qs16(row, c, q);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int h0 = ((qh >> j) << 4) & 0x10;
        const int h1 = (qh >> (j + 12)) & 0x10;
        v[j] = (float)((q[j] & 0xF) | h0) * d + m;
        v[j + 16] = (float)((q[j] >> 4) | h1) * d + m;
    }
}

template <>
__device__ __forceinline__ void deq32<T_Q8_0>(const uint8_t* __restrict__ row, int c, int nb, float v[32]) {
    const float d = h2f(ld16(row + 32 * nb + 2 * c));
    int8_t q[32];
    ld_bytes32_a16(row + 32 * c, reinterpret_cast<uint8_t*>(q));
#pragma unroll
    for (int j = 0; j < 32; ++j) v[j] = (float)q[j] * d;
}

template <>
__device__ __forceinline__ void deq32<T_Q4_K>(const uint8_t* __restrict__ row, int c, int nb, float v[32]) {
    const int ns = nb / 8, sb = c >> 3, j = c & 7, u = 4 * sb + (j >> 1);
    const uint8_t* b = row + q4k_hdr(sb);
    const uint32_t dd = ld32(b);
    const float d = h2f(dd & 0xFFFF), dmin = h2f(dd >> 16);
    int s, m;
    k4_scale_min_w(j, ld32(b + 4), ld32(b + 8), ld32(b + 12), s, m);
    const float d1 = d * (float)s, m1 = dmin * (float)m;
    uint8_t q[32];
    ld_halves32(row + q4k_qs(ns, u, 0), row + q4k_qs(ns, u, 1), q);
    const int sh = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = d1 * (float)((q[l] >> sh) & 0xF) - m1;
}

template <>
__device__ __forceinline__ void deq32<T_Q5_K>(const uint8_t* __restrict__ row, int c, int, float v[32]) {
    const uint8_t* b = row + (size_t)(c >> 3) * 176;
    const int j = c & 7;
    const uint32_t dd = ld32(b);
    const float d = h2f(dd & 0xFFFF), dmin = h2f(dd >> 16);
    int s, m;
    k4_scale_min_w(j, ld32(b + 4), ld32(b + 8), ld32(b + 12), s, m);
    const float d1 = d * (float)s, m1 = dmin * (float)m;
    uint8_t qh[32], q[32];
    ld_bytes32_a16(b + 16, qh);
    ld_bytes32_a16(b + 48 + 32 * (j >> 1), q);
    const int sh = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int hi = (qh[l] >> j) & 1;
        v[l] = d1 * (float)(((q[l] >> sh) & 0xF) + 16 * hi) - m1;
    }
}

template <>
__device__ __forceinline__ void deq32<T_Q6_K>(const uint8_t* __restrict__ row, int c, int nb, float v[32]) {
    const int ns = nb / 8, sb = c >> 3, j = c & 7;
    const int n = j >> 2, k = j & 3;
    const float d = h2f(ld16(row + q6k_d(ns, sb)));
    const uint8_t* sc = row + q6k_sc(ns, sb);
    const int8_t s0 = (int8_t)sc[8 * n + 2 * k];
    const int8_t s1 = (int8_t)sc[8 * n + 2 * k + 1];
    uint8_t ql[32], qh[32];
    const int u = 4 * sb + 2 * n + (k & 1);
    ld_halves32(row + q6k_ql(u, 0), row + q6k_ql(u, 1), ql);
    ld_halves32(row + q6k_qh(ns, u, 0), row + q6k_qh(ns, u, 1), qh);
    const int sl = (k >> 1) * 4, shh = 2 * k;
    const float d0 = d * (float)s0, d1 = d * (float)s1;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int q = (int)(((ql[l] >> sl) & 0xF) | (((qh[l] >> shh) & 3) << 4)) - 32;
        v[l] = (l < 16 ? d0 : d1) * (float)q;
    }
}

// ---- the decode matvec's int8 activations -----------------------------------------
// Whoever writes a matvec input's int8 copy (the quantize kernel, RMSNorm, attention,
// gate|up + SwiGLU) quantizes each 32-element block with this one function.
// The copy's byte order within a column of in_dim elements: the column's 16-byte chunk c
// lies at chunk (c % 4) * (in_dim / 64) + c / 4 when in_dim % 64 == 0 (always so under
// K-quant rows), else at (c % 2) * (in_dim / 32) + c / 2. The lanes of a matvec warp read
// chunk i of consecutive units at once (a K-quant unit is four chunks, a 32-element
// block two): in row order one chunk every 64 (or 32) bytes, here one run (two for the
// 32-element blocks and Q6_K, whose units take chunks 2 apart). The values, and so every
// sum, are the same in either order. (Row order measured slower once the K-quant rows
// were interleaved: H200 7B tg128 521.6 / 520.2 / 520.6 against 545.1 / 545.7 / 545.6.)
__host__ __device__ __forceinline__ int xq_chunk(int c, int in_dim) {
    return in_dim % 64 == 0 ? (c & 3) * (in_dim >> 6) + (c >> 2) : (c & 1) * (in_dim >> 5) + (c >> 1);
}
// The same where in_dim % 64 == 0 is known (rows of whole K-quant superblocks).
__host__ __device__ __forceinline__ int xq_chunk64(int c, int in_dim) { return (c & 3) * (in_dim >> 6) + (c >> 2); }

// One warp quantizes 32 consecutive values (v from lane) to int8: d = amax / 127 (0 for
// an all-zero block), q = rint(v / d); ds = (d, d * sum(q)).
// Both reductions are one redux.sync on sm_80+ (five shuffle rounds each before): a
// non-negative float orders as its bits, and an integer sum is exact in any order, so the
// results are the butterflies' for every finite block. A NaN now makes amax NaN (fmaxf
// dropped it), so the block's scale carries it to the matvec's output instead of the
// lane quietly quantizing to 0. col: the column's copy, of in_dim elements; the block is
// its elements e0 .. e0 + 31 (placed by xq_chunk).
__device__ __forceinline__ void quant_block_q8(float v, int lane, int8_t* __restrict__ col, int e0, int in_dim,
                                               float2* __restrict__ ds) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const float amax = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(fabsf(v))));
#else
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
#endif
    const float d = amax / 127.0f;
    const int qi = d > 0.0f ? __float2int_rn(v / d) : 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const int sum = __reduce_add_sync(0xffffffffu, qi);
#else
    int sum = qi;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#endif
    col[16 * xq_chunk((e0 + lane) >> 4, in_dim) + (lane & 15)] = (int8_t)qi;
    if (lane == 0) *ds = make_float2(d, d * (float)sum);
}

// Calls f.template operator()<T>() for a runtime weight type; false if unsupported.
template <class F>
bool dispatch_type(int32_t t, F&& f) {
    switch (t) {
        case T_F32: f.template operator()<T_F32>(); return true;
        case T_F16: f.template operator()<T_F16>(); return true;
        case T_Q4_0: f.template operator()<T_Q4_0>(); return true;
        case T_Q4_1: f.template operator()<T_Q4_1>(); return true;
        case T_Q5_0: f.template operator()<T_Q5_0>(); return true;
        case T_Q5_1: f.template operator()<T_Q5_1>(); return true;
        case T_Q8_0: f.template operator()<T_Q8_0>(); return true;
        case T_Q4_K: f.template operator()<T_Q4_K>(); return true;
        case T_Q5_K: f.template operator()<T_Q5_K>(); return true;
        case T_Q6_K: f.template operator()<T_Q6_K>(); return true;
        default: return false;
    }
}

}  // namespace minfer::cuda
