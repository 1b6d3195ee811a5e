// Interleaved 16-row groups for Q4_K / Q5_K / Q6_K weights and their VNNI matmul kernel.
// See repack_k.h for the rounding contract and repack.h for why rows are interleaved.
//
// A group is nb records, one per super-block (256 elements), each 64-byte aligned:
//   Q4_K (2368 bytes): qs [8 sub-blocks][256] | sc [8][16] | mn [4][16][2] | d [16] f16 | dmin [16] f16
//   Q5_K (2880 bytes): 8 sub-blocks of [qs [256] | qh [64]] | then as Q4_K from sc
//   Q6_K (3392 bytes): 4 chunk pairs of [qs [2][256] | qh [2][2][64] | sc [4][16] int8] (832 bytes
//   each) | d [16] f16 | pad 32
// qs: 32 codes per row in the nibble layout of repack.cpp (chunk t, lane r, byte b: low
// nibble = code[8t + b], high = code[8t + 4 + b]), so step s (s < 8) of a 32-element
// block pairs codes 4s..4s+3 of all 16 rows with one broadcast 4-byte activation load.
// Q4_K codes are its 4-bit values (sub-block = 32 elements, scale sc, min mn); Q5_K's are
// 5-bit, the low 4 in qs and the fifth in qh (bit k of lane r byte b is that of code
// 4k + b: one vector per sub-block, beside its codes so decode reads one stream); Q6_K
// keeps the low 4 bits there and the top 2 bits in qh (vector v of a chunk holds steps
// 4v..4v+3: bits 2k..2k+1 of lane r byte b are those of code[4(4v + k) + b]); its 6-bit
// codes stay unsigned (0..63) and the -32 offset is applied exactly as -32 * the
// activation sub-block sum (Q8_K's bsums), which seeds the sub-block's accumulator.
// mn holds row r's mins 2k and 2k+1 as a byte pair, widened to the int16 pair that one
// vpdpwssd multiplies with the activation sums of sub-blocks 2k and 2k+1.
//
// Per sub-block the integer dot (8 or 4 vpdpbusd steps for 16 rows at once) is scaled
// by the rows' sub-block scales with one vpmulld, keeping S exact; the float epilogue
// runs once per super-block (256 elements) rather than once per 32.
#include "cpu/repack_k.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/ggml_types.h"
#include "cpu/repack_vec.h"

#if defined(RP_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define RP_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#endif

namespace minfer::cpu::repack::k {

namespace {

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

size_t rec_bytes(int32_t type) { return type == T_Q4_K ? kQ4Rec : type == T_Q5_K ? kQ5Rec : kQ6Rec; }

// Q4_K and Q5_K share the record's tail (scales, mins, d, dmin) at these offsets.
template <int32_t T>
constexpr size_t k4_tail(size_t q4_off) { return T == T_Q5_K ? q4_off + kQ5Tail : q4_off; }
template <int32_t T>
constexpr size_t k4_qs(int j) { return T == T_Q5_K ? q5_qs(j) : 256 * (size_t)j; }

// ggml's get_scale_min_k4: 6-bit scale and min of sub-block j from the 12 packed bytes.
void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// The 256 unsigned codes of one super-block (Q4_K: 0..15, Q5_K: 0..31, Q6_K: 0..63).
void codes_of(int32_t type, const uint8_t* blk, uint8_t code[256]) {
    if (type == T_Q5_K) {  // ggml's dequantize_row_q5_K: qh bit 2c (2c + 1) is bit 4 of the pair's low (high) codes
        const block_q5_K& b = *(const block_q5_K*)blk;
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) {
                code[64 * c + l] = (uint8_t)((b.qs[32 * c + l] & 15) | (((b.qh[l] >> (2 * c)) & 1) << 4));
                code[64 * c + 32 + l] = (uint8_t)((b.qs[32 * c + l] >> 4) | (((b.qh[l] >> (2 * c + 1)) & 1) << 4));
            }
        return;
    }
    if (type == T_Q4_K) {
        const block_q4_K& b = *(const block_q4_K*)blk;
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) {
                code[64 * c + l] = b.qs[32 * c + l] & 15;
                code[64 * c + 32 + l] = b.qs[32 * c + l] >> 4;
            }
        return;
    }
    const block_q6_K& b = *(const block_q6_K*)blk;
    for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b.ql + 64 * h;
        const uint8_t* qh = b.qh + 32 * h;
        uint8_t* o = code + 128 * h;
        for (int l = 0; l < 32; ++l) {
            o[l] = (uint8_t)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4));
            o[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
            o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
}

// Row r's 32 codes of one block into the nibble layout at qs (256 bytes).
void put_nibbles(uint8_t* qs, int r, const uint8_t* code) {
    for (int t = 0; t < 4; ++t)
        for (int b = 0; b < 4; ++b)
            qs[64 * t + 4 * r + b] = (uint8_t)((code[8 * t + b] & 15) | ((code[8 * t + 4 + b] & 15) << 4));
}

void pack_record(int32_t type, const uint8_t* const rows[G], int64_t ib, uint8_t* rec) {
    std::memset(rec, 0, rec_bytes(type));
    const size_t bb = type_block_bytes(type);
    for (int r = 0; r < G; ++r) {
        if (!rows[r]) continue;  // padding row: zero codes, scales and factors
        const uint8_t* blk = rows[r] + ib * bb;
        uint8_t code[256];
        codes_of(type, blk, code);
        for (int c = 0; c < 8; ++c)
            put_nibbles(rec + (type == T_Q4_K ? 256 * c : type == T_Q5_K ? q5_qs(c) : q6_qs(c)), r, code + 32 * c);
        if (type == T_Q4_K || type == T_Q5_K) {
            // block_q5_K begins as block_q4_K does: d, dmin, the 12 scale bytes.
            const block_q4_K& b = *(const block_q4_K*)blk;
            const size_t tail = type == T_Q5_K ? kQ5Tail : 0;
            for (int j = 0; j < 8; ++j) {
                uint8_t sc, m;
                scale_min_k4(j, b.scales, sc, m);
                rec[tail + kQ4Sc + 16 * j + r] = sc;
                rec[tail + kQ4Mn + 32 * (j / 2) + 2 * r + (j & 1)] = m;
                if (type == T_Q5_K)
                    for (int b4 = 0; b4 < 4; ++b4) {
                        uint8_t h = 0;
                        for (int k = 0; k < 8; ++k) h |= (uint8_t)(((code[32 * j + 4 * k + b4] >> 4) & 1) << k);
                        rec[q5_qh(j) + 4 * r + b4] = h;
                    }
            }
            std::memcpy(rec + tail + kQ4D + 2 * r, &b.d, 2);
            std::memcpy(rec + tail + kQ4Dmin + 2 * r, &b.dmin, 2);
        } else {
            const block_q6_K& b = *(const block_q6_K*)blk;
            for (int c = 0; c < 8; ++c)
                for (int v = 0; v < 2; ++v)
                    for (int b4 = 0; b4 < 4; ++b4) {
                        uint8_t h = 0;
                        for (int k = 0; k < 4; ++k) h |= (uint8_t)((code[32 * c + 4 * (4 * v + k) + b4] >> 4) << (2 * k));
                        rec[q6_qh(c) + 64 * v + 4 * r + b4] = h;
                    }
            for (int j = 0; j < 16; ++j) rec[q6_sc(j / 2) + 16 * (j & 1) + r] = (uint8_t)b.scales[j];
            std::memcpy(rec + kQ6D + 2 * r, &b.d, 2);
        }
    }
}

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

inline int32_t int16_pair(int32_t lo, int32_t hi) {
    return (int32_t)((uint32_t)(uint16_t)(int16_t)lo | ((uint32_t)(uint16_t)(int16_t)hi << 16));
}

void meta_of(const block_q8_K& a, KMeta& m) {
    m.d = a.d;
    for (int j = 0; j < 16; ++j) m.c[j] = -32 * a.bsums[j];
    for (int k = 0; k < 4; ++k)
        m.pair[k] = int16_pair(a.bsums[4 * k] + a.bsums[4 * k + 1], a.bsums[4 * k + 2] + a.bsums[4 * k + 3]);
    for (int k = 0; k < 8; ++k) m.bpair[k] = int16_pair(a.bsums[2 * k], a.bsums[2 * k + 1]);
}

#if defined(RP_AVX2)

// Measured (bench/quant_dot.py --cold, 1 thread, 4864x896): Q6_K 0.44 ms without
// a useful distance, 0.35 at 4 KiB (the unpacked kernel: 0.36); Q4_K 0.28 -> 0.24.
// 2 KiB then beat 4 KiB on a 2-vCPU Sapphire Rapids, the Llama-3.2-1B shape's decode
// (`minfer bench -p 0 -n 128 -r 3`, alternating builds): 1 thread 16.99 / 16.45 / 16.98
// / 17.49 / 16.43 against 14.50 / 14.79 / 15.11 tok/s (1 KiB 16.07, 1.5 KiB 16.41,
// 12 KiB 14.15); 2 threads 29.72 / 27.72 against 28.02 / 25.59; the default 0.5B (whose
// K-quant rows are only its ffn_down) unchanged.
constexpr size_t kPfDist = 2048;
constexpr int kPfMaxNA = 1;  // prefill reuses each record for many tokens from cache
// Decode streams the weights from DRAM: each of a record's 8 steps prefetches its eighth
// of the record kPfDist bytes ahead, adding to what the hardware prefetcher keeps in
// flight (a 1-token matmul is latency-bound without it).
template <size_t REC>
inline void prefetch_eighth(const uint8_t* R, int c) {
    const uint8_t* p = R + kPfDist + c * (REC / 8);
    for (size_t o = 0; o < REC / 8; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
}

// NA tokens x lanes [lane0, lane0 + H * V::N) of one group, all super-blocks.
template <class V, int32_t T, int NA, int H = 1>
void group_kernel(const uint8_t* g, int64_t nb, int lane0, const uint8_t* act, size_t arb, const KMeta* meta,
                  float* y, int64_t ldy, int lo, int hi) {
    using I = typename V::I;
    using F = typename V::F;
    constexpr size_t rec = T == T_Q4_K ? kQ4Rec : T == T_Q5_K ? kQ5Rec : kQ6Rec;
    F acc[NA][H];
    RP_UNROLL
    for (int a = 0; a < NA; ++a)
        for (int h = 0; h < H; ++h) acc[a][h] = V::zero();
    for (int64_t ib = 0; ib < nb; ++ib) {
        const uint8_t* R = g + ib * rec;
        const int8_t* q[NA];
        RP_UNROLL
        for (int a = 0; a < NA; ++a) q[a] = ((const block_q8_K*)(act + a * arb))[ib].qs;
        I isum[NA][H];
        RP_UNROLL
        for (int a = 0; a < NA; ++a)
            for (int h = 0; h < H; ++h) isum[a][h] = V::zero_i();
        if constexpr (T == T_Q4_K || T == T_Q5_K) {
            for (int j = 0; j < 8; ++j) {
                if constexpr (NA <= kPfMaxNA) prefetch_eighth<rec>(R, j);
                for (int h = 0; h < H; ++h) {
                    const int ln = lane0 + h * V::N;
                    I w[8];
                    nibbles<V>(R + k4_qs<T>(j) + 4 * ln, w);
                    if constexpr (T == T_Q5_K) {  // bit k of the qh vector is step k's fifth bit
                        const I hb = V::load(R + q5_qh(j) + 4 * ln), m10 = V::set8(0x10);
                        w[0] = V::or_and(w[0], V::template sll16<4>(hb), m10);
                        w[1] = V::or_and(w[1], V::template sll16<3>(hb), m10);
                        w[2] = V::or_and(w[2], V::template sll16<2>(hb), m10);
                        w[3] = V::or_and(w[3], V::template sll16<1>(hb), m10);
                        w[4] = V::or_and(w[4], hb, m10);
                        w[5] = V::or_and(w[5], V::template srl16<1>(hb), m10);
                        w[6] = V::or_and(w[6], V::template srl16<2>(hb), m10);
                        w[7] = V::or_and(w[7], V::template srl16<3>(hb), m10);
                    }
                    const I sc = V::u8_32(R + k4_tail<T>(kQ4Sc) + 16 * j + ln);
                    RP_UNROLL
                    for (int a = 0; a < NA; ++a) {
                        const uint8_t* qa = (const uint8_t*)q[a] + 32 * j;
                        if constexpr (V::kMaddubs) {
                            // Codes <= 15: the 8 steps' 16-bit sums stay below 8 * 2 * 15 * 128 < 2^15,
                            // so they add in 16 bits, and one madd by the 6-bit scale widens and
                            // scales them (the same integers as mullo of the 32-bit sum). Q5_K's
                            // codes <= 31 take two madds of four steps (4 * 2 * 31 * 128 < 2^15).
                            constexpr int kRun = T == T_Q5_K ? 4 : 8;
                            RP_UNROLL
                            for (int k0 = 0; k0 < 8; k0 += kRun) {
                                I s16 = V::zero_i();
                                RP_UNROLL
                                for (int k = k0; k < k0 + kRun; ++k) s16 = V::dot16(s16, w[k], load_u32(qa + 4 * k));
                                isum[a][h] = V::widen16_mul(isum[a][h], s16, V::dup16(sc));
                            }
                        } else {
                            I s = V::zero_i();
                            RP_UNROLL
                            for (int k = 0; k < 8; ++k) s = V::dot(s, w[k], load_u32(qa + 4 * k));
                            isum[a][h] = V::add(isum[a][h], V::mullo(s, sc));
                        }
                    }
                }
            }
            for (int h = 0; h < H; ++h) {
                const int ln = lane0 + h * V::N;
                const F dw = V::loadh((const half*)(R + k4_tail<T>(kQ4D)) + ln);
                const F dm = V::loadh((const half*)(R + k4_tail<T>(kQ4Dmin)) + ln);
                I mn[4];
                RP_UNROLL
                for (int k = 0; k < 4; ++k) mn[k] = V::u8_16(R + k4_tail<T>(kQ4Mn) + 32 * k + 2 * ln);
                RP_UNROLL
                for (int a = 0; a < NA; ++a) {
                    const KMeta& m = meta[a * nb + ib];
                    I sm = V::zero_i();
                    RP_UNROLL
                    for (int k = 0; k < 4; ++k) sm = V::dotw(sm, mn[k], (uint32_t)m.pair[k]);
                    acc[a][h] = V::fma(V::scale(dw, m.d), isum[a][h], acc[a][h]);
                    acc[a][h] = V::fnma(V::scale(dm, m.d), sm, acc[a][h]);
                }
            }
        } else {
            const I m30 = V::set8(0x30);
            for (int c = 0; c < 8; ++c) {
                if constexpr (NA <= kPfMaxNA) prefetch_eighth<rec>(R, c);
                for (int h = 0; h < H; ++h) {
                    const int ln = lane0 + h * V::N, bo = 4 * ln;
                    I w[8];
                    nibbles<V>(R + q6_qs(c) + bo, w);
                    const I h0 = V::load(R + q6_qh(c) + bo), h1 = V::load(R + q6_qh(c) + 64 + bo);
                    w[0] = V::or_and(w[0], V::template sll16<4>(h0), m30);
                    w[1] = V::or_and(w[1], V::template sll16<2>(h0), m30);
                    w[2] = V::or_and(w[2], h0, m30);
                    w[3] = V::or_and(w[3], V::template srl16<2>(h0), m30);
                    w[4] = V::or_and(w[4], V::template sll16<4>(h1), m30);
                    w[5] = V::or_and(w[5], V::template sll16<2>(h1), m30);
                    w[6] = V::or_and(w[6], h1, m30);
                    w[7] = V::or_and(w[7], V::template srl16<2>(h1), m30);
                    const I sa = V::s8_32(R + q6_sc(c) + ln), sb = V::s8_32(R + q6_sc(c) + 16 + ln);
                    // Without VNNI: the scales as int16 pairs (sa, sa), (sb, sb), (sa, sb).
                    [[maybe_unused]] I sa2, sb2, sab;
                    if constexpr (V::kMaddubs) {
                        sa2 = V::dup16(sa);
                        sb2 = V::dup16(sb);
                        sab = V::pack16(sa, sb);
                    }
                    RP_UNROLL
                    for (int a = 0; a < NA; ++a) {
                        const uint8_t* qa = (const uint8_t*)q[a] + 32 * c;
                        const KMeta& m = meta[a * nb + ib];
                        if constexpr (V::kMaddubs) {
                            // Codes <= 63: two steps' 16-bit sums stay below 2 * 2 * 63 * 128 < 2^15;
                            // madd by the int8 scale widens and scales them, and the offset
                            // terms, -32 (sa bsum_2c + sb bsum_2c+1), are one madd of int16
                            // pairs: the same integers as the mullo form below.
                            const auto two = [&](int k) {
                                return V::dot16(V::dot16(V::zero_i(), w[k], load_u32(qa + 4 * k)), w[k + 1],
                                                load_u32(qa + 4 * k + 4));
                            };
                            I v = V::widen16_mul(V::widen16_mul(isum[a][h], two(0), sa2), two(2), sa2);
                            v = V::widen16_mul(V::widen16_mul(v, two(4), sb2), two(6), sb2);
                            isum[a][h] = V::sub(v, V::template slli32<5>(V::dotw(V::zero_i(), sab, (uint32_t)m.bpair[c])));
                        } else {
                            I s0 = V::bcast(m.c[2 * c]), s1 = V::bcast(m.c[2 * c + 1]);
                            RP_UNROLL
                            for (int k = 0; k < 4; ++k) s0 = V::dot(s0, w[k], load_u32(qa + 4 * k));
                            RP_UNROLL
                            for (int k = 4; k < 8; ++k) s1 = V::dot(s1, w[k], load_u32(qa + 4 * k));
                            isum[a][h] = V::add(isum[a][h], V::add(V::mullo(s0, sa), V::mullo(s1, sb)));
                        }
                    }
                }
            }
            for (int h = 0; h < H; ++h) {
                const F dw = V::loadh((const half*)(R + kQ6D) + lane0 + h * V::N);
                RP_UNROLL
                for (int a = 0; a < NA; ++a) acc[a][h] = V::fma(V::scale(dw, meta[a * nb + ib].d), isum[a][h], acc[a][h]);
            }
        }
    }
    RP_UNROLL
    for (int a = 0; a < NA; ++a) store_halves<V, H>(y + a * ldy, acc[a], lo, hi);
}

template <int32_t T>
using KernFn = void (*)(const uint8_t*, int64_t, int, const uint8_t*, size_t, const KMeta*, float*, int64_t, int,
                        int);

template <int32_t T, int... NA>
constexpr std::array<KernFn<T>, sizeof...(NA)> kern_table(std::integer_sequence<int, NA...>) {
    return {group_kernel<VK, T, NA + 1>...};
}

#if defined(RP_AMX)
// Q4_K on the AMX tiles, 16 tokens at a time: TDPBSUD multiplies a tile of 16 tokens' 32
// activations of one sub-block (signed, read in place from the Q8_K rows) by the group's
// 32 codes of that sub-block for its 16 rows (unsigned, in the VNNI layout a tile's B
// operand takes, which is the record's nibble chunks unpacked: chunk t's low nibbles are
// B row 2t, its high nibbles row 2t + 1). Each product tile is the exact integer
// sub-block dot of every (token, row), the same ints group_kernel's vpdpbusd steps sum,
// and is then scaled by the rows' sub-block scales and folded into the per-super-block
// float epilogue in the same operations: the outputs are bitwise group_kernel's.
constexpr int kAmxTokens = 16;

struct TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tmm0..3: four sub-blocks' products (16 tokens x 16 rows, int32); tmm4: activations
// (16 tokens x 32 bytes); tmm5: codes (8 rows of 4-code groups x 16 rows x 4 bytes).
void amx_config() {
    TileConfig c;
    for (int i = 0; i < 4; ++i) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    c.colsb[4] = 32;
    c.rows[4] = 16;
    c.colsb[5] = 64;
    c.rows[5] = 8;
    _tile_loadconfig(&c);
}

// Every sub-block's B tile of one group, nb super-blocks, into bt (nb * 8 * 512 bytes).
void amx_unpack(const uint8_t* g, int64_t nb, uint8_t* bt) {
    const __m512i m = _mm512_set1_epi8(0x0F);
    for (int64_t ib = 0; ib < nb; ++ib) {
        const uint8_t* R = g + ib * kQ4Rec;
        for (int j = 0; j < 8; ++j) {
            uint8_t* o = bt + (ib * 8 + j) * 512;
            for (int t = 0; t < 4; ++t) {
                const __m512i x = _mm512_load_si512((const void*)(R + 256 * j + 64 * t));
                _mm512_store_si512((void*)(o + 128 * t), _mm512_and_si512(x, m));
                _mm512_store_si512((void*)(o + 128 * t + 64), _mm512_and_si512(_mm512_srli_epi16(x, 4), m));
            }
        }
    }
}

// Lanes [lo, hi) of group g for tokens t0 .. t0 + 15 (all present).
void amx_tile(const uint8_t* g, const uint8_t* bt, int64_t nb, const uint8_t* act, size_t arb, const KMeta* meta,
              float* y, int64_t ldy, int lo, int hi) {
    using V = V16;
    alignas(64) int32_t c[4][kAmxTokens][16];
    alignas(64) float acc[kAmxTokens][16] = {};
    for (int64_t ib = 0; ib < nb; ++ib) {
        const uint8_t* R = g + ib * kQ4Rec;
        const uint8_t* a0 = act + ib * sizeof(block_q8_K) + offsetof(block_q8_K, qs);
        V::I isum[kAmxTokens];
        for (int a = 0; a < kAmxTokens; ++a) isum[a] = V::zero_i();
        // Four sub-blocks' products, then their stores, then the scaling: the loads of
        // a stored tile come a few products after its store.
        for (int j0 = 0; j0 < 8; j0 += 4) {
            // (Spelled out: GCC's tile intrinsics paste their register numbers into the
            // instruction text, so they take literals, not a loop's or template's value.)
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, a0 + 32 * j0, (long)arb);
            _tile_loadd(5, bt + (ib * 8 + j0) * 512, 64);
            _tile_dpbsud(0, 4, 5);
            _tile_loadd(4, a0 + 32 * (j0 + 1), (long)arb);
            _tile_loadd(5, bt + (ib * 8 + j0 + 1) * 512, 64);
            _tile_dpbsud(1, 4, 5);
            _tile_loadd(4, a0 + 32 * (j0 + 2), (long)arb);
            _tile_loadd(5, bt + (ib * 8 + j0 + 2) * 512, 64);
            _tile_dpbsud(2, 4, 5);
            _tile_loadd(4, a0 + 32 * (j0 + 3), (long)arb);
            _tile_loadd(5, bt + (ib * 8 + j0 + 3) * 512, 64);
            _tile_dpbsud(3, 4, 5);
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            // sum over the four of scale * product, in floats: each product (|dot| <=
            // 32 * 15 * 127, scale <= 63) and each partial sum stays below 2^24, so every
            // step is exact and the sum converts back to the integer the vector kernel adds.
            __m512 scf[4];
            for (int q = 0; q < 4; ++q) scf[q] = _mm512_cvtepi32_ps(V::u8_32(R + kQ4Sc + 16 * (j0 + q)));
            for (int a = 0; a < kAmxTokens; ++a) {
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void*)c[0][a])), scf[0]);
                for (int q = 1; q < 4; ++q)
                    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void*)c[q][a])), scf[q], f);
                isum[a] = V::add(isum[a], _mm512_cvtps_epi32(f));
            }
        }
        const V::F dw = V::loadh((const half*)(R + kQ4D));
        const V::F dm = V::loadh((const half*)(R + kQ4Dmin));
        V::I mn[4];
        for (int k = 0; k < 4; ++k) mn[k] = V::u8_16(R + kQ4Mn + 32 * k);
        for (int a = 0; a < kAmxTokens; ++a) {
            const KMeta& m = meta[a * nb + ib];
            V::I sm = V::zero_i();
            for (int k = 0; k < 4; ++k) sm = V::dotw(sm, mn[k], (uint32_t)m.pair[k]);
            V::F f = _mm512_load_ps(acc[a]);
            f = V::fma(V::scale(dw, m.d), isum[a], f);
            f = V::fnma(V::scale(dm, m.d), sm, f);
            _mm512_store_ps(acc[a], f);
        }
    }
    for (int a = 0; a < kAmxTokens; ++a) V::store(y + a * ldy, _mm512_load_ps(acc[a]), lo, hi);
}

std::atomic<int> g_amx_on{-1};  // -1: not asked yet; 0 / 1 (the OS granted the tile state)
std::atomic<bool> g_amx_use{true};  // tests compare the tiles with group_kernel (set_amx)
std::atomic<uint64_t> g_amx_calls{0};  // matmul calls that ran tiles (tests see them run)

bool amx_on() {
    int v = g_amx_on.load(std::memory_order_relaxed);
    if (v < 0) {
        // The tile data state is off until the process asks for it (Linux 5.16+).
        constexpr long kReqPerm = 0x1023, kXtileData = 18;
        v = syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0 ? 1 : 0;
        g_amx_on.store(v, std::memory_order_relaxed);
    }
    return v == 1;
}
#endif  // RP_AMX

template <int32_t T>
void matmul_t(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, float* y, int64_t ldy, int64_t r0,
              int64_t r1, const uint8_t* shared_meta) {
    static constexpr auto fns = kern_table<T>(std::make_integer_sequence<int, kNA>{});
    const int64_t nb = p.nb;
    const KMeta* meta = (const KMeta*)shared_meta;
    if (!meta) {  // no shared table: this call's tokens, here
        static thread_local std::vector<KMeta> own;
        if (own.size() < (size_t)(nt * nb)) own.resize((size_t)(nt * nb));
        for (int64_t t = 0; t < nt; ++t) act_meta(act + t * arb, nb, (uint8_t*)(own.data() + t * nb));
        meta = own.data();
    }
    int64_t done = 0;  // tokens [0, done) taken by the tiles
#if defined(RP_AMX)
    if (T == T_Q4_K && nt >= kAmxTokens && g_amx_use.load(std::memory_order_relaxed) && amx_on()) {
        done = nt / kAmxTokens * kAmxTokens;
        static thread_local std::vector<__m512i> bt;  // the group's B tiles, 64-byte aligned
        if (bt.size() < (size_t)nb * 8 * 8) bt.resize((size_t)nb * 8 * 8);
        uint8_t* b = reinterpret_cast<uint8_t*>(bt.data());
        amx_config();
        g_amx_calls.fetch_add(1, std::memory_order_relaxed);
        // Tokens in blocks of about kActBlockBytes, each over all the groups (for_tiles'
        // order): a block's activations stay in L2 while the groups stream past.
        const int64_t tb = std::max<int64_t>(kAmxTokens, (int64_t)(kActBlockBytes / arb) / kAmxTokens * kAmxTokens);
        const int64_t g0 = r0 / G, g1 = (r1 + G - 1) / G;
        for (int64_t b0 = 0; b0 < done; b0 += tb) {
            const int64_t b1 = std::min(done, b0 + tb);
            for (int64_t gi = g0; gi < g1; ++gi) {
                const uint8_t* g = p.data.get() + gi * p.group_bytes;
                const int lo = (int)std::max<int64_t>(r0 - gi * G, 0), hi = (int)std::min<int64_t>(r1 - gi * G, G);
                amx_unpack(g, nb, b);
                for (int64_t t = b0; t < b1; t += kAmxTokens)
                    amx_tile(g, b, nb, act + t * arb, arb, meta + t * nb, y + t * ldy + gi * G, ldy, lo, hi);
            }
        }
        _tile_release();
    }
#endif
    if (done == nt) return;
    act += done * arb;
    y += done * ldy;
    meta += done * nb;
    nt -= done;
    const bool whole = kDecodeHalves > 1 && nt == 1;
    for_tiles(r0, r1, nt, arb, whole, [&](int64_t gi, int lane0, int lo, int hi, int64_t t, int na) {
        const uint8_t* g = p.data.get() + gi * p.group_bytes;
        const auto fn = whole ? group_kernel<VK, T, 1, kDecodeHalves> : fns[na - 1];
        fn(g, nb, lane0, act + t * arb, arb, meta + t * nb, y + t * ldy + gi * G + lane0, ldy, lo, hi);
    });
}

#endif  // RP_AVX2

}  // namespace

bool amx_available() {
#if defined(RP_AMX)
    return amx_on();
#else
    return false;
#endif
}

uint64_t amx_calls() {
#if defined(RP_AMX)
    return g_amx_calls.load(std::memory_order_relaxed);
#else
    return 0;
#endif
}

void set_amx(bool on) {
#if defined(RP_AMX)
    g_amx_use.store(on, std::memory_order_relaxed);
#else
    (void)on;
#endif
}

bool handles(int32_t type) {
#if defined(RP_AVX2)
    return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
#else
    (void)type;
    return false;
#endif
}

size_t group_bytes(int32_t type, int64_t nb) {
    if (type != T_Q4_K && type != T_Q5_K && type != T_Q6_K)
        throw std::invalid_argument("repack: unsupported K type " + std::to_string(type));
    return (size_t)nb * rec_bytes(type);
}

void pack_group(int32_t type, const uint8_t* const rows[G], int64_t nb, uint8_t* dst) {
    const size_t rec = rec_bytes(type);
    for (int64_t ib = 0; ib < nb; ++ib) pack_record(type, rows, ib, dst + ib * rec);
}

size_t meta_block_bytes() { return sizeof(KMeta); }

void act_meta(const uint8_t* blocks, int64_t n, uint8_t* meta) {
    const block_q8_K* ab = (const block_q8_K*)blocks;
    KMeta* m = (KMeta*)meta;
    for (int64_t ib = 0; ib < n; ++ib) meta_of(ab[ib], m[ib]);
}

void matmul(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, float* y, int64_t ldy, int64_t r0,
            int64_t r1, const uint8_t* meta) {
#if defined(RP_AVX2)
    switch (p.type) {
        case T_Q4_K: return matmul_t<T_Q4_K>(p, act, arb, nt, y, ldy, r0, r1, meta);
        case T_Q5_K: return matmul_t<T_Q5_K>(p, act, arb, nt, y, ldy, r0, r1, meta);
        case T_Q6_K: return matmul_t<T_Q6_K>(p, act, arb, nt, y, ldy, r0, r1, meta);
        default: break;
    }
#endif
    throw std::invalid_argument("repack::k::matmul: unsupported packed type " + std::to_string(p.type));
}

}  // namespace minfer::cpu::repack::k
