// Device-side decoding of GGML blocks, 32 elements ("a chunk") at a time: the unit
// every CUDA matmul, dequantization and row gather works in. K-quant superblocks are
// 8 chunks. Formulas follow ggml's dequantize_row_* exactly (d * sc * q - dmin * m),
// so the f16 prefill operand and the decode dot product decode identically.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "common/ggml_types.h"

namespace minfer::cuda {

__device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ uint16_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// 16 bytes from a 2-byte aligned address into q[16].
__device__ __forceinline__ void ld_bytes16_a2(const uint8_t* p, uint8_t q[16]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) reinterpret_cast<uint16_t*>(q)[i] = ld16(p + 2 * i);
}
__device__ __forceinline__ void ld_bytes16_a4(const uint8_t* p, uint8_t q[16]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) reinterpret_cast<uint32_t*>(q)[i] = ld32(p + 4 * i);
}
__device__ __forceinline__ void ld_bytes32_a16(const uint8_t* p, uint8_t q[32]) {
    reinterpret_cast<uint4*>(q)[0] = reinterpret_cast<const uint4*>(p)[0];
    reinterpret_cast<uint4*>(q)[1] = reinterpret_cast<const uint4*>(p)[1];
}

__device__ __forceinline__ void k4_scale_min(int j, const uint8_t* q, int& d, int& m) {
    if (j < 4) {
        d = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// The same from the 12 scale bytes as three little-endian words (no byte array, so
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

// Decode chunk c (elements 32c .. 32c+31) of a row of type T into v.
template <int T>
__device__ __forceinline__ void deq32(const uint8_t* __restrict__ row, int c, float v[32]);

template <>
__device__ __forceinline__ void deq32<T_F32>(const uint8_t* __restrict__ row, int c, float v[32]) {
    const float4* p = reinterpret_cast<const float4*>(row) + c * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float4 t = p[i];
        v[4 * i] = t.x; v[4 * i + 1] = t.y; v[4 * i + 2] = t.z; v[4 * i + 3] = t.w;
    }
}

template <>
__device__ __forceinline__ void deq32<T_F16>(const uint8_t* __restrict__ row, int c, float v[32]) {
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

template <>
__device__ __forceinline__ void deq32<T_Q4_0>(const uint8_t* __restrict__ row, int c, float v[32]) {
    const uint8_t* b = row + (size_t)c * 18;
    const float d = h2f(ld16(b));
    uint8_t q[16];
    ld_bytes16_a2(b + 2, q);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        v[j] = (float)((int)(q[j] & 0xF) - 8) * d;
        v[j + 16] = (float)((int)(q[j] >> 4) - 8) * d;
    }
}

template <>
__device__ __forceinline__ void deq32<T_Q4_1>(const uint8_t* __restrict__ row, int c, float v[32]) {
    const uint8_t* b = row + (size_t)c * 20;
    const uint32_t dm = ld32(b);
    const float d = h2f(dm & 0xFFFF), m = h2f(dm >> 16);
    uint8_t q[16];
    ld_bytes16_a4(b + 4, q);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        v[j] = (float)(q[j] & 0xF) * d + m;
        v[j + 16] = (float)(q[j] >> 4) * d + m;
    }
}

template <>
__device__ __forceinline__ void deq32<T_Q5_0>(const uint8_t* __restrict__ row, int c, float v[32]) {
    const uint8_t* b = row + (size_t)c * 22;
    const float d = h2f(ld16(b));
    const uint32_t qh = (uint32_t)ld16(b + 2) | ((uint32_t)ld16(b + 4) << 16);
    uint8_t q[16];
    ld_bytes16_a2(b + 6, q);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int h0 = ((qh >> j) << 4) & 0x10;
        const int h1 = (qh >> (j + 12)) & 0x10;
        v[j] = (float)(((q[j] & 0xF) | h0) - 16) * d;
        v[j + 16] = (float)(((q[j] >> 4) | h1) - 16) * d;
    }
}

template <>
__device__ __forceinline__ void deq32<T_Q5_1>(const uint8_t* __restrict__ row, int c, float v[32]) {
    const uint8_t* b = row + (size_t)c * 24;
    const uint32_t dm = ld32(b);
    const float d = h2f(dm & 0xFFFF), m = h2f(dm >> 16);
    const uint32_t qh = ld32(b + 4);
    uint8_t q[16];
    ld_bytes16_a4(b + 8, q);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int h0 = ((qh >> j) << 4) & 0x10;
        const int h1 = (qh >> (j + 12)) & 0x10;
        v[j] = (float)((q[j] & 0xF) | h0) * d + m;
        v[j + 16] = (float)((q[j] >> 4) | h1) * d + m;
    }
}

template <>
__device__ __forceinline__ void deq32<T_Q8_0>(const uint8_t* __restrict__ row, int c, float v[32]) {
    const uint8_t* b = row + (size_t)c * 34;
    const float d = h2f(ld16(b));
    int8_t q[32];
#pragma unroll
    for (int i = 0; i < 16; ++i) reinterpret_cast<uint16_t*>(q)[i] = ld16(b + 2 + 2 * i);
#pragma unroll
    for (int j = 0; j < 32; ++j) v[j] = (float)q[j] * d;
}

template <>
__device__ __forceinline__ void deq32<T_Q4_K>(const uint8_t* __restrict__ row, int c, float v[32]) {
    const uint8_t* b = row + (size_t)(c >> 3) * 144;
    const int j = c & 7;
    const uint32_t dd = ld32(b);
    const float d = h2f(dd & 0xFFFF), dmin = h2f(dd >> 16);
    int s, m;
    k4_scale_min_w(j, ld32(b + 4), ld32(b + 8), ld32(b + 12), s, m);
    const float d1 = d * (float)s, m1 = dmin * (float)m;
    uint8_t q[32];
    ld_bytes32_a16(b + 16 + 32 * (j >> 1), q);
    const int sh = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = d1 * (float)((q[l] >> sh) & 0xF) - m1;
}

template <>
__device__ __forceinline__ void deq32<T_Q5_K>(const uint8_t* __restrict__ row, int c, float v[32]) {
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
__device__ __forceinline__ void deq32<T_Q6_K>(const uint8_t* __restrict__ row, int c, float v[32]) {
    const uint8_t* b = row + (size_t)(c >> 3) * 210;
    const int j = c & 7;
    const int n = j >> 2, k = j & 3;
    const float d = h2f(ld16(b + 208));
    const int8_t s0 = (int8_t)b[192 + 8 * n + 2 * k];
    const int8_t s1 = (int8_t)b[192 + 8 * n + 2 * k + 1];
    uint8_t ql[32], qh[32];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        reinterpret_cast<uint16_t*>(ql)[i] = ld16(b + 64 * n + (k & 1) * 32 + 2 * i);
        reinterpret_cast<uint16_t*>(qh)[i] = ld16(b + 128 + 32 * n + 2 * i);
    }
    const int sl = (k >> 1) * 4, shh = 2 * k;
    const float d0 = d * (float)s0, d1 = d * (float)s1;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int q = (int)(((ql[l] >> sl) & 0xF) | (((qh[l] >> shh) & 3) << 4)) - 32;
        v[l] = (l < 16 ? d0 : d1) * (float)q;
    }
}

// A quarter chunk: 8 elements of sub-chunk u (chunk u >> 2, part s = u & 3), for the
// decode matvec, where four consecutive lanes share a chunk so a warp's weight and
// activation loads are contiguous. v[0..3] pair with x[o0 .. o0+3], v[4..7] with
// x[o1 .. o1+3] (element offsets in the row). Same formulas as deq32.
template <int T>
__device__ __forceinline__ void deq8(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1);

template <>
__device__ __forceinline__ void deq8<T_F32>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const float4* p = reinterpret_cast<const float4*>(row) + u * 2;
    const float4 a = p[0], b = p[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    o0 = u * 8; o1 = o0 + 4;
}

template <>
__device__ __forceinline__ void deq8<T_F16>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const uint4 t = reinterpret_cast<const uint4*>(row)[u];
    const __half2* h = reinterpret_cast<const __half2*>(&t);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(h[j]);
        v[2 * j] = f.x; v[2 * j + 1] = f.y;
    }
    o0 = u * 8; o1 = o0 + 4;
}

template <>
__device__ __forceinline__ void deq8<T_Q4_0>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 18;
    const float d = h2f(ld16(b));
    const uint32_t q = (uint32_t)ld16(b + 2 + 4 * s) | ((uint32_t)ld16(b + 4 + 4 * s) << 16);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t qb = (q >> (8 * j)) & 0xFF;
        v[j] = (float)((int)(qb & 0xF) - 8) * d;
        v[j + 4] = (float)((int)(qb >> 4) - 8) * d;
    }
    o0 = c * 32 + 4 * s; o1 = o0 + 16;
}

template <>
__device__ __forceinline__ void deq8<T_Q4_1>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 20;
    const uint32_t dm = ld32(b);
    const float d = h2f(dm & 0xFFFF), m = h2f(dm >> 16);
    const uint32_t q = ld32(b + 4 + 4 * s);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t qb = (q >> (8 * j)) & 0xFF;
        v[j] = (float)(qb & 0xF) * d + m;
        v[j + 4] = (float)(qb >> 4) * d + m;
    }
    o0 = c * 32 + 4 * s; o1 = o0 + 16;
}

template <>
__device__ __forceinline__ void deq8<T_Q5_0>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 22;
    const float d = h2f(ld16(b));
    const uint32_t qh = (uint32_t)ld16(b + 2) | ((uint32_t)ld16(b + 4) << 16);
    const uint32_t q = (uint32_t)ld16(b + 6 + 4 * s) | ((uint32_t)ld16(b + 8 + 4 * s) << 16);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * s + jj;
        const uint32_t qb = (q >> (8 * jj)) & 0xFF;
        const int h0 = ((qh >> j) << 4) & 0x10;
        const int h1 = (qh >> (j + 12)) & 0x10;
        v[jj] = (float)(((int)(qb & 0xF) | h0) - 16) * d;
        v[jj + 4] = (float)(((int)(qb >> 4) | h1) - 16) * d;
    }
    o0 = c * 32 + 4 * s; o1 = o0 + 16;
}

template <>
__device__ __forceinline__ void deq8<T_Q5_1>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 24;
    const uint32_t dm = ld32(b);
    const float d = h2f(dm & 0xFFFF), m = h2f(dm >> 16);
    const uint32_t qh = ld32(b + 4);
    const uint32_t q = ld32(b + 8 + 4 * s);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * s + jj;
        const uint32_t qb = (q >> (8 * jj)) & 0xFF;
        const int h0 = ((qh >> j) << 4) & 0x10;
        const int h1 = (qh >> (j + 12)) & 0x10;
        v[jj] = (float)((int)(qb & 0xF) | h0) * d + m;
        v[jj + 4] = (float)((int)(qb >> 4) | h1) * d + m;
    }
    o0 = c * 32 + 4 * s; o1 = o0 + 16;
}

template <>
__device__ __forceinline__ void deq8<T_Q8_0>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 34;
    const float d = h2f(ld16(b));
    int8_t q[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) reinterpret_cast<uint16_t*>(q)[i] = ld16(b + 2 + 8 * s + 2 * i);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = (float)q[j] * d;
    o0 = c * 32 + 8 * s; o1 = o0 + 4;
}

template <>
__device__ __forceinline__ void deq8<T_Q4_K>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)(c >> 3) * 144;
    const int j = c & 7;
    const uint32_t dd = ld32(b);
    const float d = h2f(dd & 0xFFFF), dmin = h2f(dd >> 16);
    int si, mi;
    k4_scale_min_w(j, ld32(b + 4), ld32(b + 8), ld32(b + 12), si, mi);
    const float d1 = d * (float)si, m1 = dmin * (float)mi;
    const uint2 qq = *reinterpret_cast<const uint2*>(b + 16 + 32 * (j >> 1) + 8 * s);
    const uint8_t* q = reinterpret_cast<const uint8_t*>(&qq);
    const int sh = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 8; ++l) v[l] = d1 * (float)((q[l] >> sh) & 0xF) - m1;
    o0 = c * 32 + 8 * s; o1 = o0 + 4;
}

template <>
__device__ __forceinline__ void deq8<T_Q5_K>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)(c >> 3) * 176;
    const int j = c & 7;
    const uint32_t dd = ld32(b);
    const float d = h2f(dd & 0xFFFF), dmin = h2f(dd >> 16);
    int si, mi;
    k4_scale_min_w(j, ld32(b + 4), ld32(b + 8), ld32(b + 12), si, mi);
    const float d1 = d * (float)si, m1 = dmin * (float)mi;
    const uint2 hh = *reinterpret_cast<const uint2*>(b + 16 + 8 * s);
    const uint2 qq = *reinterpret_cast<const uint2*>(b + 48 + 32 * (j >> 1) + 8 * s);
    const uint8_t* qh = reinterpret_cast<const uint8_t*>(&hh);
    const uint8_t* q = reinterpret_cast<const uint8_t*>(&qq);
    const int sh = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 8; ++l) {
        const int hi = (qh[l] >> j) & 1;
        v[l] = d1 * (float)(((q[l] >> sh) & 0xF) + 16 * hi) - m1;
    }
    o0 = c * 32 + 8 * s; o1 = o0 + 4;
}

template <>
__device__ __forceinline__ void deq8<T_Q6_K>(const uint8_t* __restrict__ row, int u, float v[8], int& o0, int& o1) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)(c >> 3) * 210;
    const int j = c & 7;
    const int n = j >> 2, k = j & 3;
    const float d = h2f(ld16(b + 208));
    const int8_t sc = (int8_t)b[192 + 8 * n + 2 * k + (s >> 1)];
    uint8_t ql[8], qh[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        reinterpret_cast<uint16_t*>(ql)[i] = ld16(b + 64 * n + (k & 1) * 32 + 8 * s + 2 * i);
        reinterpret_cast<uint16_t*>(qh)[i] = ld16(b + 128 + 32 * n + 8 * s + 2 * i);
    }
    const int sl = (k >> 1) * 4, shh = 2 * k;
    const float d0 = d * (float)sc;
#pragma unroll
    for (int l = 0; l < 8; ++l) {
        const int q = (int)(((ql[l] >> sl) & 0xF) | (((qh[l] >> shh) & 3) << 4)) - 32;
        v[l] = d0 * (float)q;
    }
    o0 = c * 32 + 8 * s; o1 = o0 + 4;
}

// ---- int8 dot products (decode matvec) --------------------------------------------
// The activation is quantized once per matvec input to int8 in blocks of 32 (d = amax
// / 127, q = rint(x / d)), like the CPU's Q8 activations. dotq8<T> returns the
// contribution of quarter chunk u: the weights' integer codes meet the activation's in
// __dp4a (4 products per instruction), and the per-block scales are applied once. A
// block's min term (Q4_1, Q5_1, Q4_K, Q5_K) is added by its first quarter only, from the
// activation block's sum ds.y = d * sum(q).
__device__ __forceinline__ int ld32_a2(const uint8_t* p) { return (int)((uint32_t)ld16(p) | ((uint32_t)ld16(p + 2) << 16)); }
__device__ __forceinline__ int xq4(const int8_t* xq, int o) { return *reinterpret_cast<const int*>(xq + o); }

// Byte k of the result = bit (j + 8k) of w... spread: bits j, j+1, j+2, j+3 of qh to
// bit 4 of bytes 0..3.
__device__ __forceinline__ int spread4(uint32_t qh, int j) {
    const uint32_t b = (qh >> j) & 0xF;
    return (int)(((b & 1) << 4) | ((b & 2) << 11) | ((b & 4) << 18) | ((b & 8) << 25));
}

template <int T>
__device__ __forceinline__ float dotq8(const uint8_t* __restrict__ row, int u, const int8_t* __restrict__ xq,
                                       const float2* __restrict__ xds);

template <>
__device__ __forceinline__ float dotq8<T_Q4_0>(const uint8_t* __restrict__ row, int u, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xds) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 18;
    const int w = ld32_a2(b + 2 + 4 * s);
    const int lo = __vsubss4(w & 0x0F0F0F0F, 0x08080808), hi = __vsubss4((w >> 4) & 0x0F0F0F0F, 0x08080808);
    const int o0 = c * 32 + 4 * s;
    const int isum = __dp4a(hi, xq4(xq, o0 + 16), __dp4a(lo, xq4(xq, o0), 0));
    return h2f(ld16(b)) * xds[c].x * (float)isum;
}

template <>
__device__ __forceinline__ float dotq8<T_Q4_1>(const uint8_t* __restrict__ row, int u, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xds) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 20;
    const uint32_t dm = ld32(b);
    const int w = (int)ld32(b + 4 + 4 * s);
    const int o0 = c * 32 + 4 * s;
    const int isum = __dp4a((w >> 4) & 0x0F0F0F0F, xq4(xq, o0 + 16), __dp4a(w & 0x0F0F0F0F, xq4(xq, o0), 0));
    const float2 ds = xds[c];
    float r = h2f(dm & 0xFFFF) * ds.x * (float)isum;
    if (s == 0) r += h2f(dm >> 16) * ds.y;
    return r;
}

template <>
__device__ __forceinline__ float dotq8<T_Q5_0>(const uint8_t* __restrict__ row, int u, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xds) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 22;
    const uint32_t qh = (uint32_t)ld16(b + 2) | ((uint32_t)ld16(b + 4) << 16);
    const int w = ld32_a2(b + 6 + 4 * s);
    const int lo = __vsubss4((w & 0x0F0F0F0F) | spread4(qh, 4 * s), 0x10101010);
    const int hi = __vsubss4(((w >> 4) & 0x0F0F0F0F) | spread4(qh, 4 * s + 16), 0x10101010);
    const int o0 = c * 32 + 4 * s;
    const int isum = __dp4a(hi, xq4(xq, o0 + 16), __dp4a(lo, xq4(xq, o0), 0));
    return h2f(ld16(b)) * xds[c].x * (float)isum;
}

template <>
__device__ __forceinline__ float dotq8<T_Q5_1>(const uint8_t* __restrict__ row, int u, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xds) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 24;
    const uint32_t dm = ld32(b);
    const uint32_t qh = ld32(b + 4);
    const int w = (int)ld32(b + 8 + 4 * s);
    const int lo = (w & 0x0F0F0F0F) | spread4(qh, 4 * s);
    const int hi = ((w >> 4) & 0x0F0F0F0F) | spread4(qh, 4 * s + 16);
    const int o0 = c * 32 + 4 * s;
    const int isum = __dp4a(hi, xq4(xq, o0 + 16), __dp4a(lo, xq4(xq, o0), 0));
    const float2 ds = xds[c];
    float r = h2f(dm & 0xFFFF) * ds.x * (float)isum;
    if (s == 0) r += h2f(dm >> 16) * ds.y;
    return r;
}

template <>
__device__ __forceinline__ float dotq8<T_Q8_0>(const uint8_t* __restrict__ row, int u, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xds) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)c * 34;
    const int o0 = c * 32 + 8 * s;
    const int isum = __dp4a(ld32_a2(b + 6 + 8 * s), xq4(xq, o0 + 4), __dp4a(ld32_a2(b + 2 + 8 * s), xq4(xq, o0), 0));
    return h2f(ld16(b)) * xds[c].x * (float)isum;
}

template <>
__device__ __forceinline__ float dotq8<T_Q4_K>(const uint8_t* __restrict__ row, int u, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xds) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)(c >> 3) * 144;
    const int j = c & 7;
    const uint32_t dd = ld32(b);
    int si, mi;
    k4_scale_min_w(j, ld32(b + 4), ld32(b + 8), ld32(b + 12), si, mi);
    const uint2 qq = *reinterpret_cast<const uint2*>(b + 16 + 32 * (j >> 1) + 8 * s);
    const int sh = (j & 1) * 4;
    const int o0 = c * 32 + 8 * s;
    const int isum = __dp4a((int)(qq.y >> sh) & 0x0F0F0F0F, xq4(xq, o0 + 4),
                            __dp4a((int)(qq.x >> sh) & 0x0F0F0F0F, xq4(xq, o0), 0));
    const float2 ds = xds[c];
    float r = h2f(dd & 0xFFFF) * (float)si * ds.x * (float)isum;
    if (s == 0) r -= h2f(dd >> 16) * (float)mi * ds.y;
    return r;
}

template <>
__device__ __forceinline__ float dotq8<T_Q5_K>(const uint8_t* __restrict__ row, int u, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xds) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)(c >> 3) * 176;
    const int j = c & 7;
    const uint32_t dd = ld32(b);
    int si, mi;
    k4_scale_min_w(j, ld32(b + 4), ld32(b + 8), ld32(b + 12), si, mi);
    const uint2 hh = *reinterpret_cast<const uint2*>(b + 16 + 8 * s);
    const uint2 qq = *reinterpret_cast<const uint2*>(b + 48 + 32 * (j >> 1) + 8 * s);
    const int sh = (j & 1) * 4;
    const int v0 = (int)((qq.x >> sh) & 0x0F0F0F0F) | (int)(((hh.x >> j) & 0x01010101) << 4);
    const int v1 = (int)((qq.y >> sh) & 0x0F0F0F0F) | (int)(((hh.y >> j) & 0x01010101) << 4);
    const int o0 = c * 32 + 8 * s;
    const int isum = __dp4a(v1, xq4(xq, o0 + 4), __dp4a(v0, xq4(xq, o0), 0));
    const float2 ds = xds[c];
    float r = h2f(dd & 0xFFFF) * (float)si * ds.x * (float)isum;
    if (s == 0) r -= h2f(dd >> 16) * (float)mi * ds.y;
    return r;
}

template <>
__device__ __forceinline__ float dotq8<T_Q6_K>(const uint8_t* __restrict__ row, int u, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xds) {
    const int c = u >> 2, s = u & 3;
    const uint8_t* b = row + (size_t)(c >> 3) * 210;
    const int j = c & 7;
    const int n = j >> 2, k = j & 3;
    const int8_t sc = (int8_t)b[192 + 8 * n + 2 * k + (s >> 1)];
    const uint8_t* ql = b + 64 * n + (k & 1) * 32 + 8 * s;
    const uint8_t* qh = b + 128 + 32 * n + 8 * s;
    const int sl = (k >> 1) * 4, shh = 2 * k;
    const int v0 = __vsubss4((((uint32_t)ld32_a2(ql) >> sl) & 0x0F0F0F0F) | ((((uint32_t)ld32_a2(qh) >> shh) & 0x03030303) << 4),
                             0x20202020);
    const int v1 = __vsubss4((((uint32_t)ld32_a2(ql + 4) >> sl) & 0x0F0F0F0F) |
                                 ((((uint32_t)ld32_a2(qh + 4) >> shh) & 0x03030303) << 4),
                             0x20202020);
    const int o0 = c * 32 + 8 * s;
    const int isum = __dp4a(v1, xq4(xq, o0 + 4), __dp4a(v0, xq4(xq, o0), 0));
    return h2f(ld16(b + 208)) * (float)sc * xds[c].x * (float)isum;
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
