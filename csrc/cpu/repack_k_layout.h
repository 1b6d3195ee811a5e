// The record layout of the packed K-quant groups (see repack_k.cpp's header comment),
// the per-token activation terms, and the code unpacking that the vector kernel
// (repack_k.cpp) and the AMX kernel (repack_k_amx.cpp) share. Internal to csrc/cpu.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/ggml_types.h"
#include "cpu/repack.h"
#include "cpu/repack_vec.h"

namespace minfer::cpu::repack::k {

constexpr int G = 16;
constexpr size_t kQ4Rec = 2368, kQ5Rec = 2880, kQ6Rec = 3392;
// Offsets inside a record.
constexpr size_t kQ4Sc = 2048, kQ4Mn = 2176, kQ4D = 2304, kQ4Dmin = 2336;
// Q5_K: sub-block j's codes and fifth bits, then the Q4_K tail shifted by 512 bytes.
constexpr size_t q5_qs(int j) { return 320 * (size_t)j; }
constexpr size_t q5_qh(int j) { return 320 * (size_t)j + 256; }
constexpr size_t kQ5Tail = 512;  // the eight qh vectors move the Q4_K tail back by this
constexpr size_t kQ6D = 3328;
// A Q6_K record keeps each chunk's codes, high bits and scales within 832 bytes of each
// other, so decode reads it front to back. With the three in planes of their own
// (codes, then high bits, then scales) the hardware prefetcher lost the stream: 11.6
// GB/s cold without software prefetch, 17-19 with it, on a Zen 4 where Q4_K (one plane)
// read 22-30. Pairs keep every vector load 64-byte aligned.
constexpr size_t q6_qs(int c) { return 832 * (size_t)(c / 2) + 256 * (size_t)(c & 1); }
constexpr size_t q6_qh(int c) { return 832 * (size_t)(c / 2) + 512 + 128 * (size_t)(c & 1); }
constexpr size_t q6_sc(int c) { return 832 * (size_t)(c / 2) + 768 + 32 * (size_t)(c & 1); }

constexpr size_t rec_bytes(int32_t type) { return type == T_Q4_K ? kQ4Rec : type == T_Q5_K ? kQ5Rec : kQ6Rec; }

// Q4_K and Q5_K share the record's tail (scales, mins, d, dmin) at these offsets.
template <int32_t T>
constexpr size_t k4_tail(size_t q4_off) { return T == T_Q5_K ? q4_off + kQ5Tail : q4_off; }
template <int32_t T>
constexpr size_t k4_qs(int j) { return T == T_Q5_K ? q5_qs(j) : 256 * (size_t)j; }

// Per (token, super-block) of the activations: d_a, and the integer terms that pair
// with the weights' per-row constants: for Q6_K c[j] = -32 * sum of 16-element
// sub-block j, and (without VNNI) bpair[k] = int16 pair (sum of sub-block 2k, of 2k + 1);
// for Q4_K's mins pair[k] = int16 pair (sum of 32-element sub-block 2k, sum of 2k + 1).
// All, so one table serves Q4_K and Q6_K weights alike.
struct KMeta {
    float d;
    int32_t c[16];
    int32_t pair[4];
    int32_t bpair[8];
};

#if defined(RP_AVX2)
// The 8 step vectors of 32-element chunk j of record R for the lanes from ln: step k
// holds codes 4k..4k+3 of every lane's row, unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63).
template <class V, int32_t T>
inline void chunk_codes(const uint8_t* R, int j, int ln, typename V::I w[8]) {
    using I = typename V::I;
    const int bo = 4 * ln;
    if constexpr (T == T_Q4_K) {
        nibbles<V>(R + k4_qs<T>(j) + bo, w);
    } else if constexpr (T == T_Q5_K) {  // bit k of the qh vector is step k's fifth bit
        nibbles<V>(R + q5_qs(j) + bo, w);
        const I hb = V::load(R + q5_qh(j) + bo), m10 = V::set8(0x10);
        w[0] = V::or_and(w[0], V::template sll16<4>(hb), m10);
        w[1] = V::or_and(w[1], V::template sll16<3>(hb), m10);
        w[2] = V::or_and(w[2], V::template sll16<2>(hb), m10);
        w[3] = V::or_and(w[3], V::template sll16<1>(hb), m10);
        w[4] = V::or_and(w[4], hb, m10);
        w[5] = V::or_and(w[5], V::template srl16<1>(hb), m10);
        w[6] = V::or_and(w[6], V::template srl16<2>(hb), m10);
        w[7] = V::or_and(w[7], V::template srl16<3>(hb), m10);
    } else {  // Q6_K: the top 2 bits of steps 0-3 in h0, of 4-7 in h1
        nibbles<V>(R + q6_qs(j) + bo, w);
        const I m30 = V::set8(0x30);
        const I h0 = V::load(R + q6_qh(j) + bo), h1 = V::load(R + q6_qh(j) + 64 + bo);
        w[0] = V::or_and(w[0], V::template sll16<4>(h0), m30);
        w[1] = V::or_and(w[1], V::template sll16<2>(h0), m30);
        w[2] = V::or_and(w[2], h0, m30);
        w[3] = V::or_and(w[3], V::template srl16<2>(h0), m30);
        w[4] = V::or_and(w[4], V::template sll16<4>(h1), m30);
        w[5] = V::or_and(w[5], V::template sll16<2>(h1), m30);
        w[6] = V::or_and(w[6], h1, m30);
        w[7] = V::or_and(w[7], V::template srl16<2>(h1), m30);
    }
}
#endif

// Q4_K, Q5_K and Q6_K prefill on the AMX tiles (repack_k_amx.cpp): runs tokens [0, n)
// of the call for rows [r0, r1) and returns n, a multiple of 16 (0 where the tiles are
// not built, not granted, or switched off). Bitwise the vector kernel's results.
int64_t amx_matmul(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, const KMeta* meta, float* y,
                   int64_t ldy, int64_t r0, int64_t r1);

}  // namespace minfer::cpu::repack::k
