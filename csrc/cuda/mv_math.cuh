// What the decode matvec (k_matvec.cu, integer sums by __dp4a) and the batched matmul on
// the tensor cores (k_mmq.cu, the same integers by mma) share: how a row is cut into
// units and its pieces loaded and decoded, and the float side of a quantized dot
// product, how a unit's exact integer sums become its float value, one function per
// weight family. Both kernels call these, so a row's bits are the same whichever kernel
// computed it: the integers are exact in any order, and every float operation here is
// spelled out (_rn) so no instantiation contracts differently.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "common/ggml_types.h"

namespace minfer::cuda::mvm {

// A unit is what a matvec lane decodes per trip: half a superblock (64 elements) for the
// K-quants, a 32-element block for the rest; nb 32-element blocks a row.
__host__ __device__ constexpr bool kquant(int t) { return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }
__host__ __device__ constexpr int row_units(int t, int nb) { return kquant(t) ? nb / 2 : nb; }

__device__ __forceinline__ uint4 ldg4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
// Weight loads: G = global memory through the read-only path, else shared memory (a
// staged copy of the row, k_matvec_bulk).
template <bool G = true>
__device__ __forceinline__ uint4 ld4(const uint8_t* p) {
    if constexpr (G) return ldg4(p);
    else return *reinterpret_cast<const uint4*>(p);
}
template <bool G = true>
__device__ __forceinline__ float ldh(const uint8_t* p) {
    if constexpr (G) return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p))));
    else return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}
template <bool G = true>
__device__ __forceinline__ uint32_t ldw(const uint8_t* p) {
    if constexpr (G) return __ldg(reinterpret_cast<const unsigned int*>(p));
    else return *reinterpret_cast<const unsigned int*>(p);
}
template <bool G = true>
__device__ __forceinline__ unsigned short ldu16(const uint8_t* p) {
    if constexpr (G) return __ldg(reinterpret_cast<const unsigned short*>(p));
    else return *reinterpret_cast<const unsigned short*>(p);
}

// Byte i of 16 as a signed int (Q6_K's scales).
__device__ __forceinline__ int sbyte(const uint4& v, int i) {
    const uint32_t w = i < 4 ? v.x : i < 8 ? v.y : i < 12 ? v.z : v.w;
    return (int)(int8_t)((w >> (8 * (i & 3))) & 0xFF);
}

// Bits j..j+3 of qh to bit 4 of bytes 0..3 (the fifth bit of four 5-bit quants). The
// multiply adds b, b << 7, b << 14 and b << 21: bit i of b lands at bit 8i in the copy
// shifted by 7i, and the copies take disjoint bits (0-3, 7-10, 14-17, 21-24), so nothing
// carries.
__device__ __forceinline__ uint32_t spread4(uint32_t qh, int j) {
    const uint32_t b = (qh >> j) & 0xF;
    return ((b * 0x00204081u) & 0x01010101u) << 4;
}

__device__ __forceinline__ float fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float half_lo(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFF))); }
__device__ __forceinline__ float half_hi(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }

// The value functions come in two spellings: on the integer sums (the matvec, whose
// __dp4a sums are ints) and on exact floats of them (the tensor-core matmul, k_mmq.cu,
// whose sums come out as floats). The integer one converts and calls the float one, so
// both run the same float operations and give the same bits wherever the conversions
// are exact (integers below 2^24).

// Legacy 32-element block: d (dm's low half) times the activation block's scale times
// the sum s; Q4_1 / Q5_1 (kMin) add their min m (dm's high half) times d * sum(q).
template <bool kMin>
__device__ __forceinline__ float val_q45f(uint32_t dm, float2 ds, float s) {
    float r = fmul(fmul(half_lo(dm), ds.x), s);
    if constexpr (kMin) r = fadd(r, fmul(half_hi(dm), ds.y));
    return r;
}
template <bool kMin>
__device__ __forceinline__ float val_q45(uint32_t dm, float2 ds, int s) { return val_q45f<kMin>(dm, ds, (float)s); }

__device__ __forceinline__ float val_q8_0f(float d, float2 ds, float s) { return fmul(fmul(d, ds.x), s); }
__device__ __forceinline__ float val_q8_0(float d, float2 ds, int s) { return val_q8_0f(d, ds, (float)s); }

// Q4_K / Q5_K half superblock: sub-blocks with 6-bit scales sc0, sc1 and mins m0, m1,
// sums s0, s1 against activation blocks ds = (d0, d0 * sum0, d1, d1 * sum1); dd holds the
// superblock's d (low half) and dmin (high half). The float spelling takes fs0 =
// sc0 * s0, fm0 = m0, fs1 = sc1 * s1, fm1 = m1.
__device__ __forceinline__ float val_k45f(float d, float dmin, float fs0, float fm0, float fs1, float fm1, float4 ds) {
    const float fs = fadd(fmul(fs0, ds.x), fmul(fs1, ds.z));
    const float fm = fadd(fmul(fm0, ds.y), fmul(fm1, ds.w));
    return __fsub_rn(fmul(d, fs), fmul(dmin, fm));
}
__device__ __forceinline__ float val_k45(uint32_t dd, int sc0, int m0, int sc1, int m1, int s0, int s1, float4 ds) {
    return val_k45f(half_lo(dd), half_hi(dd), (float)(sc0 * s0), (float)m0, (float)(sc1 * s1), (float)m1, ds);
}

// Q6_K unit: the scale-weighted integers of its two chunks (ia, ib) against their
// activation scales (da, db), times the superblock's d.
__device__ __forceinline__ float val_q6kf(float d, float ia, float ib, float da, float db) {
    return fmul(d, fadd(fmul(da, ia), fmul(db, ib)));
}
__device__ __forceinline__ float val_q6k(float d, int ia, int ib, float da, float db) {
    return val_q6kf(d, (float)ia, (float)ib, da, db);
}

}  // namespace minfer::cuda::mvm
