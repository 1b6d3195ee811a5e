// Dot products for the 32-element block family and float weights: a portable scalar
// path (always compiled) and one SIMD path chosen at compile time (AVX-512 > AVX2 >
// NEON). Integer weights meet Q8_0 activations in integer multiply-adds; the float
// scale d_w * d_a is applied once per 32-element block.
#include "cpu/quants_legacy.h"

#include "common/simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MINFER_Q_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MINFER_Q_AVX512 1
#endif
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define MINFER_Q_NEON 1
#include <arm_neon.h>
#endif

namespace minfer::cpu::legacy {

using simd::f16_to_f32;

const char* simd_name() {
#if defined(MINFER_Q_AVX512)
    return "avx512";
#elif defined(MINFER_Q_AVX2)
    return "avx2";
#elif defined(MINFER_Q_NEON)
    return "neon";
#else
    return "scalar";
#endif
}

bool handles(int32_t t) {
    switch (t) {
        case T_F32: case T_F16: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return true;
        default: return false;
    }
}

namespace {

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// ---------------------------------------------------------------------------------
// Scalar path. Each weight block is unpacked to 32 small integers q with
// x = d*q (+ m for the types with a min); the offset types keep q unsigned.

template <int32_t T> struct SBlk;
template <> struct SBlk<T_Q4_0> {
    using B = block_q4_0;
    static constexpr bool kMin = false;
    static void unpack(const B& b, int8_t* q, float& d, float& m) {
        d = fp16_to_fp32(b.d); m = 0.0f;
        for (int j = 0; j < 16; ++j) { q[j] = (int8_t)((b.qs[j] & 15) - 8); q[j + 16] = (int8_t)((b.qs[j] >> 4) - 8); }
    }
};
template <> struct SBlk<T_Q4_1> {
    using B = block_q4_1;
    static constexpr bool kMin = true;
    static void unpack(const B& b, int8_t* q, float& d, float& m) {
        d = fp16_to_fp32(b.d); m = fp16_to_fp32(b.m);
        for (int j = 0; j < 16; ++j) { q[j] = (int8_t)(b.qs[j] & 15); q[j + 16] = (int8_t)(b.qs[j] >> 4); }
    }
};
template <> struct SBlk<T_Q5_0> {
    using B = block_q5_0;
    static constexpr bool kMin = false;
    static void unpack(const B& b, int8_t* q, float& d, float& m) {
        d = fp16_to_fp32(b.d); m = 0.0f;
        const uint32_t qh = load_u32(b.qh);
        for (int j = 0; j < 16; ++j) {
            q[j] = (int8_t)(((b.qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16);
            q[j + 16] = (int8_t)(((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
        }
    }
};
template <> struct SBlk<T_Q5_1> {
    using B = block_q5_1;
    static constexpr bool kMin = true;
    static void unpack(const B& b, int8_t* q, float& d, float& m) {
        d = fp16_to_fp32(b.d); m = fp16_to_fp32(b.m);
        const uint32_t qh = load_u32(b.qh);
        for (int j = 0; j < 16; ++j) {
            q[j] = (int8_t)((b.qs[j] & 15) | (((qh >> j) & 1) << 4));
            q[j + 16] = (int8_t)((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
    }
};
template <> struct SBlk<T_Q8_0> {
    using B = block_q8_0;
    static constexpr bool kMin = false;
    static void unpack(const B& b, int8_t* q, float& d, float& m) {
        d = fp16_to_fp32(b.d); m = 0.0f;
        std::memcpy(q, b.qs, 32);
    }
};

template <int32_t T>
void tile_scalar(int64_t n, const uint8_t* w, size_t ws, int nw, const uint8_t* a, size_t as, int na,
                 float* out, size_t os) {
    using K = SBlk<T>;
    const int64_t nb = n / 32;
    int8_t q[32];
    for (int r = 0; r < nw; ++r) {
        const typename K::B* x = (const typename K::B*)(w + r * ws);
        for (int a0 = 0; a0 < na; a0 += 4) {
            const int k = std::min(4, na - a0);
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int64_t ib = 0; ib < nb; ++ib) {
                float d, m;
                K::unpack(x[ib], q, d, m);
                for (int j = 0; j < k; ++j) {
                    const block_q8_0& y = ((const block_q8_0*)(a + (a0 + j) * as))[ib];
                    int32_t s = 0, sy = 0;
                    for (int i = 0; i < 32; ++i) s += (int32_t)q[i] * y.qs[i];
                    const float dy = fp16_to_fp32(y.d);
                    acc[j] += (d * dy) * (float)s;
                    if (K::kMin) {
                        for (int i = 0; i < 32; ++i) sy += y.qs[i];
                        acc[j] += (m * dy) * (float)sy;
                    }
                }
            }
            for (int j = 0; j < k; ++j) out[(a0 + j) * os + r] = acc[j];
        }
    }
}

template <bool F16>
inline float wval(const uint8_t* w, int64_t i) {
    if constexpr (F16) return fp16_to_fp32(((const half*)w)[i]);
    else return ((const float*)w)[i];
}

template <bool F16>
void tile_float_scalar(int64_t n, const uint8_t* w, size_t ws, int nw, const uint8_t* a, size_t as, int na,
                       float* out, size_t os) {
    for (int r = 0; r < nw; ++r)
        for (int j = 0; j < na; ++j) {
            const uint8_t* wr = w + r * ws;
            const float* x = (const float*)(a + j * as);
            float s = 0.0f;
            for (int64_t i = 0; i < n; ++i) s += wval<F16>(wr, i) * x[i];
            out[j * os + r] = s;
        }
}

void quantize_q8_0_scalar(const float* x, block_q8_0* y, int64_t nb) {
    for (int64_t ib = 0; ib < nb; ++ib, x += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[ib].d = fp32_to_fp16(d);
        for (int i = 0; i < 32; ++i) y[ib].qs[i] = (int8_t)std::roundf(x[i] * id);
    }
}

// ---------------------------------------------------------------------------------
// AVX2 path (AVX-512 builds run it too for this family; see below).
#if defined(MINFER_Q_AVX2)

using simd::hsum_halves;



// 16 bytes of packed nibbles -> 32 bytes in element order (element j < 16 is the low
// nibble of byte j, element j + 16 its high nibble).
// A broadcast load and one per-lane variable shift instead of shift + insert: the
// insert competed with the bit-spreading shuffle for the same ports.
inline __m256i nibbles32(const uint8_t* qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0xFF where the bit is set: byte k of the result is picked from
// byte k/8 of the bit field, then tested against its own bit.
inline __m256i bits32(const uint8_t* qh) {
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                             0x0101010101010101LL, 0x0000000000000000LL);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load_u32(qh)), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

// Per type: load() gives the 32 weight codes as bytes, signed for the symmetric types,
// unsigned (0..31) for the types with a min.
// kOff != 0: the AVX2 kernel takes loadu()'s unsigned codes (code + kOff) straight into
// maddubs and subtracts kOff * (pairwise sums of y) afterwards, which replaces the two
// sign operations that signed codes need with one op shared by a group of rows.
struct AQ4_0 {
    using B = block_q4_0;
    static constexpr bool kMin = false;
    static constexpr int kOff = 8;
    static __m256i load(const B& b) { return _mm256_sub_epi8(nibbles32(b.qs), _mm256_set1_epi8(8)); }
    static __m256i loadu(const B& b) { return nibbles32(b.qs); }
};
struct AQ4_1 {
    using B = block_q4_1;
    static constexpr bool kMin = true;
    static constexpr int kOff = 0;
    static __m256i load(const B& b) { return nibbles32(b.qs); }
};
struct AQ5_0 {
    using B = block_q5_0;
    static constexpr bool kMin = false;
    // A clear fifth bit means code - 16 < 0: setting the top nibble to 0xF is that
    // subtraction in two's complement; a set bit leaves the nibble as the answer.
    static __m256i load(const B& b) {
        return _mm256_or_si256(nibbles32(b.qs), _mm256_andnot_si256(bits32(b.qh), _mm256_set1_epi8((char)0xF0)));
    }
    static constexpr int kOff = 16;
    static __m256i loadu(const B& b) {
        return _mm256_or_si256(nibbles32(b.qs), _mm256_and_si256(bits32(b.qh), _mm256_set1_epi8(0x10)));
    }
};
struct AQ5_1 {
    using B = block_q5_1;
    static constexpr bool kMin = true;
    static constexpr int kOff = 0;
    static __m256i load(const B& b) {
        return _mm256_or_si256(nibbles32(b.qs), _mm256_and_si256(bits32(b.qh), _mm256_set1_epi8(0x10)));
    }
};
struct AQ8_0 {
    using B = block_q8_0;
    static constexpr bool kMin = false;
    static constexpr int kOff = 0;
    static __m256i load(const B& b) { return _mm256_loadu_si256((const __m256i*)b.qs); }
};

template <class W> inline float wmin(const typename W::B& b) {
    if constexpr (W::kMin) return f16_to_f32(b.m);
    else return 0.0f;
}

// acc += one block's contribution. For signed codes, maddubs needs an unsigned left
// operand: |q| * (y with q's sign) is the same product. aq = |q| is hoisted by the caller.
template <class W>
inline __m256 block_step(__m256i q, __m256i aq, float d, float m, const block_q8_0& y, __m256 acc) {
    const __m256i ones16 = _mm256_set1_epi16(1);
    const __m256i yv = _mm256_loadu_si256((const __m256i*)y.qs);
    const float dy = f16_to_f32(y.d);
    if constexpr (!W::kMin) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(yv, q)), ones16);
        return _mm256_fmadd_ps(_mm256_set1_ps(d * dy), _mm256_cvtepi32_ps(p), acc);
    } else {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, yv), ones16);
        const __m256i sy = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), yv), ones16);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dy), _mm256_cvtepi32_ps(p), acc);
        return _mm256_fmadd_ps(_mm256_set1_ps(m * dy), _mm256_cvtepi32_ps(sy), acc);
    }
}

// f16 -> f32 by table: a scalar index and a broadcast load keep the per-block weight
// scale off the vector ports (insert + vcvtph2ps + broadcast cost four uops per block,
// a quarter of a Q5_0 block's whole budget). Weight scales cluster in a few exponents,
// so the touched part of the table stays in L1/L2.
struct F16Table {
    float v[65536];
    F16Table() {
        for (int i = 0; i < 65536; ++i) v[i] = _cvtsh_ss((unsigned short)i);
    }
};
const F16Table g_f16;
inline const float* f16p(half h) { return &g_f16.v[(uint16_t)h]; }

// Fully unrolled before scalar replacement, so the accumulator arrays live in registers
// (otherwise GCC keeps a stack copy and stores every accumulator every block).
#define MINFER_UNROLL _Pragma("GCC unroll 8")

// NR weight rows x NA activation rows per pass: each unpacked weight block feeds NA
// tokens and each activation block NR rows. Every (row, token) result sees the same
// instruction sequence whatever NR, so grouping never changes a bit.
template <class W, int NR, int NA>
inline void group_avx2(int64_t nb, const uint8_t* w, size_t ws, const uint8_t* a, size_t as, float* out, size_t os) {
    const __m256i ones16 = _mm256_set1_epi16(1);
    const typename W::B* x[NR];
    MINFER_UNROLL
    for (int r = 0; r < NR; ++r) x[r] = (const typename W::B*)(w + r * ws);
    const block_q8_0* y[NA];
    MINFER_UNROLL
    for (int j = 0; j < NA; ++j) y[j] = (const block_q8_0*)(a + j * as);
    __m256 acc[NR][NA];
    MINFER_UNROLL
    for (int r = 0; r < NR; ++r)
        MINFER_UNROLL
        for (int j = 0; j < NA; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < nb; ++ib) {
        __m256i q[NR], aq[NR];
        __m256 d[NR], m[NR];
        // Decode streams the weights from DRAM: a software prefetch 1 KiB ahead adds to
        // what the hardware prefetcher keeps in flight (Q8_0 cold, 1 thread: +15%).
        if constexpr (NA == 1) _mm_prefetch((const char*)&x[NR - 1][ib] + 1024, _MM_HINT_T0);
        MINFER_UNROLL
        for (int r = 0; r < NR; ++r) {
            d[r] = _mm256_broadcast_ss(f16p(x[r][ib].d));
            if constexpr (W::kMin) {
                q[r] = W::load(x[r][ib]);
                m[r] = _mm256_broadcast_ss(f16p(x[r][ib].m));
            } else if constexpr (W::kOff != 0) {
                q[r] = W::loadu(x[r][ib]);
            } else {
                q[r] = W::load(x[r][ib]);
                aq[r] = _mm256_sign_epi8(q[r], q[r]);
            }
        }
        MINFER_UNROLL
        for (int j = 0; j < NA; ++j) {
            const __m256i yv = _mm256_loadu_si256((const __m256i*)y[j][ib].qs);
            const __m256 dy = _mm256_broadcast_ss(f16p(y[j][ib].d));
            // kOff * pairwise sums of y, shared by the NR rows (computing it here beat a
            // per-tile precomputed table: the table's build cost more than it saved).
            [[maybe_unused]] __m256i off;
            if constexpr (W::kOff != 0) off = _mm256_maddubs_epi16(_mm256_set1_epi8(W::kOff), yv);
            if constexpr (W::kMin) {
                const __m256 sy = _mm256_cvtepi32_ps(
                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), yv), ones16));
                MINFER_UNROLL
                for (int r = 0; r < NR; ++r) {
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[r], yv), ones16);
                    acc[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(d[r], dy), _mm256_cvtepi32_ps(p), acc[r][j]);
                    acc[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(m[r], dy), sy, acc[r][j]);
                }
            } else {
                MINFER_UNROLL
                for (int r = 0; r < NR; ++r) {
                    __m256i p16;
                    if constexpr (W::kOff != 0)
                        p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q[r], yv), off);
                    else
                        p16 = _mm256_maddubs_epi16(aq[r], _mm256_sign_epi8(yv, q[r]));
                    const __m256i p = _mm256_madd_epi16(p16, ones16);
                    acc[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(d[r], dy), _mm256_cvtepi32_ps(p), acc[r][j]);
                }
            }
        }
    }
    MINFER_UNROLL
    for (int r = 0; r < NR; ++r)
        MINFER_UNROLL
        for (int j = 0; j < NA; ++j) out[j * os + r] = hsum_halves(acc[r][j]);
}

template <class W, int NA>
void rows_avx2(int64_t nb, const uint8_t* w, size_t ws, int nw, const uint8_t* a, size_t as, float* out,
               size_t os) {
    // Decode (NA = 1) walks one row at a time: two interleaved row streams were faster
    // in cache but 15-25% slower from DRAM. Prefill shares each activation load between
    // two rows.
    constexpr int NR = NA == 1 ? 1 : 2;
    int r = 0;
    for (; r + NR <= nw; r += NR) group_avx2<W, NR, NA>(nb, w + r * ws, ws, a, as, out + r, os);
    for (; r < nw; ++r) group_avx2<W, 1, NA>(nb, w + r * ws, ws, a, as, out + r, os);
}

template <bool F16> inline __m256 wload8(const uint8_t* w, int64_t i) {
    if constexpr (F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const half*)w + i)));
    else return _mm256_loadu_ps((const float*)w + i);
}
template <bool F16> inline float wload1(const uint8_t* w, int64_t i) {
    if constexpr (F16) return f16_to_f32(((const half*)w)[i]);
    else return ((const float*)w)[i];
}

template <bool F16, int NA>
void rows_float_avx2(int64_t n, const uint8_t* w, size_t ws, int nw, const uint8_t* a, size_t as, float* out,
                     size_t os) {
    for (int r = 0; r < nw; ++r) {
        const uint8_t* wr = w + r * ws;
        __m256 acc0[NA], acc1[NA];
        for (int j = 0; j < NA; ++j) acc0[j] = acc1[j] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const __m256 w0 = wload8<F16>(wr, i), w1 = wload8<F16>(wr, i + 8);
            for (int j = 0; j < NA; ++j) {
                const float* x = (const float*)(a + j * as) + i;
                acc0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc0[j]);
                acc1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc1[j]);
            }
        }
        if (i + 8 <= n) {
            const __m256 w0 = wload8<F16>(wr, i);
            for (int j = 0; j < NA; ++j)
                acc0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps((const float*)(a + j * as) + i), acc0[j]);
            i += 8;
        }
        for (int j = 0; j < NA; ++j) {
            const float* x = (const float*)(a + j * as);
            float s = hsum_halves(_mm256_add_ps(acc0[j], acc1[j]));
            for (int64_t k = i; k < n; ++k) s += wload1<F16>(wr, k) * x[k];
            out[j * os + r] = s;
        }
    }
}

// roundf (half away from zero) for the |v| <= 127 range: trunc, then step away from
// zero when the dropped fraction is at least one half (v - trunc(v) is exact).
inline __m256 round_away(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 frac = _mm256_and_ps(_mm256_sub_ps(v, t), absmask);
    const __m256 step = _mm256_or_ps(_mm256_andnot_ps(absmask, v), _mm256_set1_ps(1.0f));  // +-1 with v's sign
    return _mm256_add_ps(t, _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), step));
}

void quantize_q8_0_avx2(const float* x, block_q8_0* y, int64_t nb) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t ib = 0; ib < nb; ++ib, x += 32) {
        __m256 v[4];
        for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                  _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[ib].d = fp32_to_fp16(d);
        const __m256 vid = _mm256_set1_ps(id);
        __m256i i32[4];
        for (int k = 0; k < 4; ++k) i32[k] = _mm256_cvtps_epi32(round_away(_mm256_mul_ps(v[k], vid)));
        // packs work per 128-bit lane; the final permute restores element order.
        const __m256i p01 = _mm256_packs_epi32(i32[0], i32[1]);
        const __m256i p23 = _mm256_packs_epi32(i32[2], i32[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)y[ib].qs, p);
    }
}

#endif  // MINFER_Q_AVX2

// ---------------------------------------------------------------------------------
// No separate AVX-512 rows for this family: on a Sapphire Rapids Xeon (2 threads, weights
// from DRAM, bench/quant_dot.py --cold) the AVX2 rows beat the former 512-bit ones for
// decode (Q5_0 16.1 vs 10.0 GB/s, Q8_0 20.9 vs 14.3) and tied for 4-token prefill
// (Q5_0 70 vs 73, Q8_0 74-93 vs 74-76 GOP/s): the unpacking, not the vector width, is the
// limit. An AVX-512 build runs the AVX2 rows here and the 512-bit K-quant kernels.

// ---------------------------------------------------------------------------------
// NEON path: codes as two int8x16 halves; every type's codes fit int8 (the offset
// types are 0..31), so one signed dot product serves all.
#if defined(MINFER_Q_NEON)


inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    const int16x8_t p0 = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    const int16x8_t p1 = vmull_high_s8(a, b);
    return vaddq_s32(acc, vaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1)));
#endif
}

// 16 bits -> 16 bytes, 0x10 where the bit is set.
inline uint8x16_t bits16_x10(uint32_t bits) {
    static const uint8_t kSel[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vcombine_u8(vdup_n_u8((uint8_t)(bits & 0xFF)), vdup_n_u8((uint8_t)((bits >> 8) & 0xFF)));
    return vandq_u8(vtstq_u8(v, vld1q_u8(kSel)), vdupq_n_u8(0x10));
}

inline void nib(const uint8_t* qs, uint8x16_t& lo, uint8x16_t& hi) {
    const uint8x16_t v = vld1q_u8(qs);
    lo = vandq_u8(v, vdupq_n_u8(0x0F));
    hi = vshrq_n_u8(v, 4);
}

struct NQ4_0 {
    using B = block_q4_0;
    static constexpr bool kMin = false;
    static void load(const B& b, int8x16_t& l, int8x16_t& h) {
        uint8x16_t lo, hi;
        nib(b.qs, lo, hi);
        l = vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(8));
        h = vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(8));
    }
};
struct NQ4_1 {
    using B = block_q4_1;
    static constexpr bool kMin = true;
    static void load(const B& b, int8x16_t& l, int8x16_t& h) {
        uint8x16_t lo, hi;
        nib(b.qs, lo, hi);
        l = vreinterpretq_s8_u8(lo);
        h = vreinterpretq_s8_u8(hi);
    }
};
template <bool kSub16> inline void load5(const uint8_t* qs, const uint8_t* qhp, int8x16_t& l, int8x16_t& h) {
    uint8x16_t lo, hi;
    nib(qs, lo, hi);
    const uint32_t qh = load_u32(qhp);
    l = vreinterpretq_s8_u8(vorrq_u8(lo, bits16_x10(qh)));
    h = vreinterpretq_s8_u8(vorrq_u8(hi, bits16_x10(qh >> 16)));
    if (kSub16) { l = vsubq_s8(l, vdupq_n_s8(16)); h = vsubq_s8(h, vdupq_n_s8(16)); }
}
struct NQ5_0 {
    using B = block_q5_0;
    static constexpr bool kMin = false;
    static void load(const B& b, int8x16_t& l, int8x16_t& h) { load5<true>(b.qs, b.qh, l, h); }
};
struct NQ5_1 {
    using B = block_q5_1;
    static constexpr bool kMin = true;
    static void load(const B& b, int8x16_t& l, int8x16_t& h) { load5<false>(b.qs, b.qh, l, h); }
};
struct NQ8_0 {
    using B = block_q8_0;
    static constexpr bool kMin = false;
    static void load(const B& b, int8x16_t& l, int8x16_t& h) { l = vld1q_s8(b.qs); h = vld1q_s8(b.qs + 16); }
};

template <class W, int NA>
void rows_neon(int64_t nb, const uint8_t* w, size_t ws, int nw, const uint8_t* a, size_t as, float* out,
               size_t os) {
    const int8x16_t ones = vdupq_n_s8(1);
    for (int r = 0; r < nw; ++r) {
        const typename W::B* x = (const typename W::B*)(w + r * ws);
        float32x4_t acc[NA];
        for (int j = 0; j < NA; ++j) acc[j] = vdupq_n_f32(0.0f);
        for (int64_t ib = 0; ib < nb; ++ib) {
            int8x16_t ql, qh;
            W::load(x[ib], ql, qh);
            const float d = f16_to_f32(x[ib].d);
            for (int j = 0; j < NA; ++j) {
                const block_q8_0& y = ((const block_q8_0*)(a + j * as))[ib];
                const int8x16_t y0 = vld1q_s8(y.qs), y1 = vld1q_s8(y.qs + 16);
                const float dy = f16_to_f32(y.d);
                const int32x4_t p = dot16(dot16(vdupq_n_s32(0), ql, y0), qh, y1);
                acc[j] = vfmaq_n_f32(acc[j], vcvtq_f32_s32(p), d * dy);
                if constexpr (W::kMin) {
                    const int32x4_t s = dot16(dot16(vdupq_n_s32(0), ones, y0), ones, y1);
                    acc[j] = vfmaq_n_f32(acc[j], vcvtq_f32_s32(s), f16_to_f32(x[ib].m) * dy);
                }
            }
        }
        for (int j = 0; j < NA; ++j) out[j * os + r] = vaddvq_f32(acc[j]);
    }
}

template <bool F16> inline float32x4_t wload4(const uint8_t* w, int64_t i) {
    if constexpr (F16) return vcvt_f32_f16(vld1_f16((const __fp16*)((const half*)w + i)));
    else return vld1q_f32((const float*)w + i);
}
template <bool F16> inline float wload1n(const uint8_t* w, int64_t i) {
    if constexpr (F16) return f16_to_f32(((const half*)w)[i]);
    else return ((const float*)w)[i];
}

template <bool F16, int NA>
void rows_float_neon(int64_t n, const uint8_t* w, size_t ws, int nw, const uint8_t* a, size_t as, float* out,
                     size_t os) {
    for (int r = 0; r < nw; ++r) {
        const uint8_t* wr = w + r * ws;
        float32x4_t acc0[NA], acc1[NA];
        for (int j = 0; j < NA; ++j) acc0[j] = acc1[j] = vdupq_n_f32(0.0f);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const float32x4_t w0 = wload4<F16>(wr, i), w1 = wload4<F16>(wr, i + 4);
            for (int j = 0; j < NA; ++j) {
                const float* x = (const float*)(a + j * as) + i;
                acc0[j] = vfmaq_f32(acc0[j], w0, vld1q_f32(x));
                acc1[j] = vfmaq_f32(acc1[j], w1, vld1q_f32(x + 4));
            }
        }
        for (int j = 0; j < NA; ++j) {
            const float* x = (const float*)(a + j * as);
            float s = vaddvq_f32(vaddq_f32(acc0[j], acc1[j]));
            for (int64_t k = i; k < n; ++k) s += wload1n<F16>(wr, k) * x[k];
            out[j * os + r] = s;
        }
    }
}

#endif  // MINFER_Q_NEON

// ---------------------------------------------------------------------------------
// Tile drivers: activation rows go in groups of up to four so one unpacked weight
// block feeds four accumulators.

#if defined(MINFER_Q_AVX2)
#define MINFER_QROWS rows_avx2
#elif defined(MINFER_Q_NEON)
#define MINFER_QROWS rows_neon
#endif
#if defined(MINFER_Q_AVX2)
#define MINFER_FROWS rows_float_avx2
#elif defined(MINFER_Q_NEON)
#define MINFER_FROWS rows_float_neon
#endif

#if defined(MINFER_QROWS)
using RowsFn = void (*)(int64_t, const uint8_t*, size_t, int, const uint8_t*, size_t, float*, size_t);

void tile_groups(const RowsFn fns[4], int64_t len, const uint8_t* w, size_t ws, int nw, const uint8_t* a,
                 size_t as, int na, float* out, size_t os) {
    for (int a0 = 0; a0 < na; a0 += 4) {
        const int k = std::min(4, na - a0);
        fns[k - 1](len, w, ws, nw, a + a0 * as, as, out + a0 * os, os);
    }
}

template <class W>
void tile_simd(int64_t n, const uint8_t* w, size_t ws, int nw, const uint8_t* a, size_t as, int na, float* out,
               size_t os) {
    static const RowsFn fns[4] = {MINFER_QROWS<W, 1>, MINFER_QROWS<W, 2>, MINFER_QROWS<W, 3>, MINFER_QROWS<W, 4>};
    tile_groups(fns, n / 32, w, ws, nw, a, as, na, out, os);
}
template <bool F16>
void tile_float_simd(int64_t n, const uint8_t* w, size_t ws, int nw, const uint8_t* a, size_t as, int na,
                     float* out, size_t os) {
    static const RowsFn fns[4] = {MINFER_FROWS<F16, 1>, MINFER_FROWS<F16, 2>, MINFER_FROWS<F16, 3>,
                                  MINFER_FROWS<F16, 4>};
    tile_groups(fns, n, w, ws, nw, a, as, na, out, os);
}
#endif

#if defined(MINFER_Q_AVX2)
using SQ4_0 = AQ4_0; using SQ4_1 = AQ4_1; using SQ5_0 = AQ5_0; using SQ5_1 = AQ5_1; using SQ8_0 = AQ8_0;
#elif defined(MINFER_Q_NEON)
using SQ4_0 = NQ4_0; using SQ4_1 = NQ4_1; using SQ5_0 = NQ5_0; using SQ5_1 = NQ5_1; using SQ8_0 = NQ8_0;
#endif

// Every product d * q is exact in f32 (11-bit by at most 8-bit significands), so the
// only rounding is the one "+ m": fused or not, the result equals gguf's. The symmetric
// types skip "+ 0" so a negative scale keeps gguf's -0.0.
template <int32_t T>
void dequant_blocks(const uint8_t* src, float* dst, int64_t n) {
    using K = SBlk<T>;
    const typename K::B* b = (const typename K::B*)src;
    int8_t q[32];
    for (int64_t ib = 0; ib < n / 32; ++ib, dst += 32) {
        float d, m;
        K::unpack(b[ib], q, d, m);
        for (int i = 0; i < 32; ++i) dst[i] = K::kMin ? d * (float)q[i] + m : d * (float)q[i];
    }
}

[[noreturn]] void bad_type(const char* fn, int32_t t) {
    throw std::invalid_argument(std::string(fn) + ": unsupported tensor type " + std::to_string(t));
}

}  // namespace

void quantize_row_q8_0(const float* x, block_q8_0* y, int64_t n, bool simd) {
#if defined(MINFER_Q_AVX2)
    if (simd) return quantize_q8_0_avx2(x, y, n / 32);
#endif
    quantize_q8_0_scalar(x, y, n / 32);
}

void vec_dot_tile(int32_t wtype, int64_t n, const void* wv, size_t ws, int nw, const void* av, size_t as, int na,
                  float* out, size_t os, bool simd) {
    const uint8_t* w = (const uint8_t*)wv;
    const uint8_t* a = (const uint8_t*)av;
#if defined(MINFER_QROWS)
    if (simd) {
        switch (wtype) {
            case T_F32: return tile_float_simd<false>(n, w, ws, nw, a, as, na, out, os);
            case T_F16: return tile_float_simd<true>(n, w, ws, nw, a, as, na, out, os);
            case T_Q4_0: return tile_simd<SQ4_0>(n, w, ws, nw, a, as, na, out, os);
            case T_Q4_1: return tile_simd<SQ4_1>(n, w, ws, nw, a, as, na, out, os);
            case T_Q5_0: return tile_simd<SQ5_0>(n, w, ws, nw, a, as, na, out, os);
            case T_Q5_1: return tile_simd<SQ5_1>(n, w, ws, nw, a, as, na, out, os);
            case T_Q8_0: return tile_simd<SQ8_0>(n, w, ws, nw, a, as, na, out, os);
            default: bad_type("vec_dot_tile", wtype);
        }
    }
#endif
    switch (wtype) {
        case T_F32: return tile_float_scalar<false>(n, w, ws, nw, a, as, na, out, os);
        case T_F16: return tile_float_scalar<true>(n, w, ws, nw, a, as, na, out, os);
        case T_Q4_0: return tile_scalar<T_Q4_0>(n, w, ws, nw, a, as, na, out, os);
        case T_Q4_1: return tile_scalar<T_Q4_1>(n, w, ws, nw, a, as, na, out, os);
        case T_Q5_0: return tile_scalar<T_Q5_0>(n, w, ws, nw, a, as, na, out, os);
        case T_Q5_1: return tile_scalar<T_Q5_1>(n, w, ws, nw, a, as, na, out, os);
        case T_Q8_0: return tile_scalar<T_Q8_0>(n, w, ws, nw, a, as, na, out, os);
        default: bad_type("vec_dot_tile", wtype);
    }
}

void dequantize_row(int32_t type, const void* src, float* dst, int64_t n) {
    const uint8_t* s = (const uint8_t*)src;
    switch (type) {
        case T_F32: std::memcpy(dst, src, (size_t)n * 4); return;
        case T_F16:
            for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(((const half*)src)[i]);
            return;
        case T_Q4_0: return dequant_blocks<T_Q4_0>(s, dst, n);
        case T_Q4_1: return dequant_blocks<T_Q4_1>(s, dst, n);
        case T_Q5_0: return dequant_blocks<T_Q5_0>(s, dst, n);
        case T_Q5_1: return dequant_blocks<T_Q5_1>(s, dst, n);
        case T_Q8_0: return dequant_blocks<T_Q8_0>(s, dst, n);
        default: bad_type("dequantize_row", type);
    }
}

}  // namespace minfer::cpu::legacy
