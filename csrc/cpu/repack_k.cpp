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
#include "cpu/repack_k_layout.h"
#include "cpu/repack_vec.h"

namespace minfer::cpu::repack::k {

namespace {

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
                    chunk_codes<V, T>(R, j, ln, w);
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
            for (int c = 0; c < 8; ++c) {
                if constexpr (NA <= kPfMaxNA) prefetch_eighth<rec>(R, c);
                for (int h = 0; h < H; ++h) {
                    const int ln = lane0 + h * V::N;
                    I w[8];
                    chunk_codes<V, T>(R, c, ln, w);
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

// Tokens per prefill call: 8 with 256-bit vectors too (the 32-element family keeps kNA =
// 4 there), so each chunk's unpacked codes and scales serve twice the tokens; the
// accumulators that no longer fit the 16 registers wait in L1, which costs less than
// unpacking every chunk twice. The Llama-3.2-1B shape's pp512 on an AVX2
// build, one Zen 4 thread, two rounds alternating: 4 tokens 82.6 / 83.6 / 83.1 / 85.8,
// 6 tokens 87.4 / 84.6, 8 tokens 86.9 / 87.3 / 89.3 / 87.2 tok/s.
constexpr int kNAK = 8;

template <int32_t T>
using KernFn = void (*)(const uint8_t*, int64_t, int, const uint8_t*, size_t, const KMeta*, float*, int64_t, int,
                        int);

template <int32_t T, int... NA>
constexpr std::array<KernFn<T>, sizeof...(NA)> kern_table(std::integer_sequence<int, NA...>) {
    return {group_kernel<VK, T, NA + 1>...};
}

template <int32_t T>
void matmul_t(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, float* y, int64_t ldy, int64_t r0,
              int64_t r1, const uint8_t* shared_meta) {
    static constexpr auto fns = kern_table<T>(std::make_integer_sequence<int, kNAK>{});
    const int64_t nb = p.nb;
    const KMeta* meta = (const KMeta*)shared_meta;
    if (!meta) {  // no shared table: this call's tokens, here
        static thread_local std::vector<KMeta> own;
        if (own.size() < (size_t)(nt * nb)) own.resize((size_t)(nt * nb));
        for (int64_t t = 0; t < nt; ++t) act_meta(act + t * arb, nb, (uint8_t*)(own.data() + t * nb));
        meta = own.data();
    }
    const int64_t done = amx_matmul(p, act, arb, nt, meta, y, ldy, r0, r1);  // tokens [0, done)
    if (done == nt) return;
    act += done * arb;
    y += done * ldy;
    meta += done * nb;
    nt -= done;
    const bool whole = kDecodeHalves > 1 && nt == 1;
    for_tiles<kNAK>(r0, r1, nt, arb, whole, [&](int64_t gi, int lane0, int lo, int hi, int64_t t, int na) {
        const uint8_t* g = p.data.get() + gi * p.group_bytes;
        const auto fn = whole ? group_kernel<VK, T, 1, kDecodeHalves> : fns[na - 1];
        fn(g, nb, lane0, act + t * arb, arb, meta + t * nb, y + t * ldy + gi * G + lane0, ldy, lo, hi);
    });
}

#endif  // RP_AVX2

}  // namespace

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
