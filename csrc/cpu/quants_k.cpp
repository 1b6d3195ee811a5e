// K-quant weights (Q4_K, Q5_K, Q6_K) against Q8_K activations.
//
// Every path computes each block's dot product exactly in 32-bit integers (the 6-bit
// and 8-bit sub-block scales are small enough that nothing overflows) and only then
// scales by the f16/f32 block factors, so scalar and SIMD results differ only in the
// order of the float accumulation across blocks.
//
// The row kernels are templated on NA, the number of activation rows sharing one pass
// over the weights: each weight block is unpacked to bytes once and reused for all NA
// rows, which is what makes prefill cheaper per token than decode.
#include "cpu/quants_k.h"

#include "common/simd.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KQ_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KQ_AVX512 1
#endif
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define KQ_NEON 1
#endif

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace minfer::cpu::kq {
namespace {

constexpr int kMaxNA = 4;

using simd::f16_to_f32;

// The GGUF dequantizers compute `d*q - m` as a rounded product followed by a rounded
// subtraction. Hiding the product from the optimizer stops it from fusing the two into
// an FMA, which would change the last bit and break byte-for-byte agreement.
#if defined(__x86_64__) || defined(__i386__)
#define KQ_OPAQUE(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define KQ_OPAQUE(v) __asm__("" : "+w"(v))
#else
#define KQ_OPAQUE(v) do { volatile float kq_t_ = (v); (v) = kq_t_; } while (0)
#endif

// Q4_K/Q5_K pack eight 6-bit scales and eight 6-bit mins into 12 bytes. Unpacks them to
// out bytes 0..7 = scales, 8..15 = mins (little-endian word tricks, same bits as
// GGUF's get_scale_min_k4).
inline void unpack_scales_k4(const uint8_t* s, uint8_t out[16]) {
    uint32_t u[3], r[4];
    std::memcpy(u, s, 12);
    const uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
    r[0] = u[0] & k6;
    r[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
    r[2] = u[1] & k6;
    r[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
    std::memcpy(out, r, 16);
}

void check_n(int64_t n) {
    if (n < 0 || n % QK_K != 0)
        throw std::invalid_argument("K-quant row length " + std::to_string(n) +
                                    " is not a multiple of 256");
}

[[noreturn]] void bad_type(int32_t t, const char* what) {
    throw std::invalid_argument(std::string(what) + ": unsupported tensor type " + std::to_string(t));
}

// ---------------------------------------------------------------------------------
// Scalar reference paths (always compiled; used when simd=false and on other CPUs).

float dot_q4K_scalar(int64_t nb, const block_q4_K* x, const block_q8_K* y) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        uint8_t sm[16];
        unpack_scales_k4(x[i].scales, sm);
        int32_t summ = 0;
        for (int j = 0; j < 8; ++j) summ += sm[8 + j] * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
        int32_t sumi = 0;
        for (int j = 0; j < 4; ++j) {
            const uint8_t* q = x[i].qs + 32 * j;
            const int8_t* a = y[i].qs + 64 * j;
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 32; ++l) {
                s0 += (q[l] & 0x0F) * a[l];
                s1 += (q[l] >> 4) * a[32 + l];
            }
            sumi += sm[2 * j] * s0 + sm[2 * j + 1] * s1;
        }
        acc += y[i].d * (f16_to_f32(x[i].d) * (float)sumi - f16_to_f32(x[i].dmin) * (float)summ);
    }
    return acc;
}

float dot_q5K_scalar(int64_t nb, const block_q5_K* x, const block_q8_K* y) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        uint8_t sm[16];
        unpack_scales_k4(x[i].scales, sm);
        int32_t summ = 0;
        for (int j = 0; j < 8; ++j) summ += sm[8 + j] * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
        int32_t sumi = 0;
        for (int j = 0; j < 4; ++j) {
            const uint8_t* q = x[i].qs + 32 * j;
            const uint8_t* qh = x[i].qh;
            const int8_t* a = y[i].qs + 64 * j;
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 32; ++l) {
                s0 += ((q[l] & 0x0F) | (((qh[l] >> (2 * j)) & 1) << 4)) * a[l];
                s1 += ((q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) * a[32 + l];
            }
            sumi += sm[2 * j] * s0 + sm[2 * j + 1] * s1;
        }
        acc += y[i].d * (f16_to_f32(x[i].d) * (float)sumi - f16_to_f32(x[i].dmin) * (float)summ);
    }
    return acc;
}

float dot_q6K_scalar(int64_t nb, const block_q6_K* x, const block_q8_K* y) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        // Unpacking to a flat array first keeps the sub-block loops simple enough for
        // the compiler to vectorize even in this portable path.
        int8_t q[QK_K];
        for (int h = 0; h < 2; ++h) {
            const uint8_t* ql = x[i].ql + 64 * h;
            const uint8_t* qh = x[i].qh + 32 * h;
            int8_t* o = q + 128 * h;
            for (int l = 0; l < 32; ++l) {
                o[l + 0] = (int8_t)(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
                o[l + 32] = (int8_t)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        int32_t sumi = 0;
        for (int k = 0; k < 16; ++k) {
            int32_t s = 0;
            for (int l = 0; l < 16; ++l) s += q[16 * k + l] * y[i].qs[16 * k + l];
            sumi += x[i].scales[k] * s;
        }
        acc += y[i].d * f16_to_f32(x[i].d) * (float)sumi;
    }
    return acc;
}

float dot_scalar(int32_t wtype, int64_t nb, const void* w, const block_q8_K* a) {
    switch (wtype) {
        case T_Q4_K: return dot_q4K_scalar(nb, (const block_q4_K*)w, a);
        case T_Q5_K: return dot_q5K_scalar(nb, (const block_q5_K*)w, a);
        case T_Q6_K: return dot_q6K_scalar(nb, (const block_q6_K*)w, a);
        default: bad_type(wtype, "K-quant vec_dot");
    }
}

// ---------------------------------------------------------------------------------
#if defined(KQ_AVX2)

using simd::hsum_halves;

// One "pair" is 64 weights as unsigned bytes (two 32-wide chunks) with the i16 scale of
// each chunk; pair_dot accumulates sum(scale * w * a) into 32-bit lanes. The AVX-512
// build holds both chunks in one 512-bit register.
#if defined(KQ_AVX512)
// GCC 12's own _mm512_undefined_* trips -Wmaybe-uninitialized inside insert/extract.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
struct Pair { __m512i w, s; };
using IAcc = __m512i;
inline IAcc iacc_zero() { return _mm512_setzero_si512(); }
inline IAcc pair_dot(IAcc acc, const Pair& p, const int8_t* a) {
    const __m512i prod = _mm512_maddubs_epi16(p.w, _mm512_loadu_si512((const void*)a));
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, prod, p.s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(prod, p.s));
#endif
}
inline __m256i iacc_fold(IAcc v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// Per-half shift counts and word-permute indices. Building each 512-bit pair with
// variable shifts of a broadcast load and one vpermw (instead of two 256-bit halves
// joined by inserts) keeps the shuffle port free; with inserts the 512-bit path was
// slower than AVX2 at one activation row.
struct Z512Tables {
    alignas(64) int16_t k4_idx[4][32];  // Q4_K/Q5_K pair j: scale word 2j | 2j+1
    alignas(64) int16_t q6_idx[4][32];  // Q6_K pair p: 128-bit lane q gets scale 4p+q
    alignas(64) int16_t q5_shl[4][32];  // Q5_K pair j: move qh bit 2j | 2j+1 to bit 4
    alignas(64) int16_t q5_shr[4][32];
    alignas(64) int16_t shr_0_4[32];    // low nibbles | high nibbles
    alignas(64) int16_t q6_shl[32];     // qh bits 0-1 | 2-3 to bits 4-5
    alignas(64) int16_t q6_shr[32];     // qh bits 4-5 | 6-7 to bits 4-5
};
constexpr Z512Tables make_z512_tables() {
    Z512Tables t{};
    for (int l = 0; l < 32; ++l) {
        const int hi = l / 16;
        for (int j = 0; j < 4; ++j) {
            const int bit = 2 * j + hi;
            t.k4_idx[j][l] = (int16_t)bit;
            t.q6_idx[j][l] = (int16_t)(4 * j + l / 8);
            t.q5_shl[j][l] = (int16_t)(bit < 4 ? 4 - bit : 0);
            t.q5_shr[j][l] = (int16_t)(bit > 4 ? bit - 4 : 0);
        }
        t.shr_0_4[l] = (int16_t)(4 * hi);
        t.q6_shl[l] = (int16_t)(hi ? 2 : 4);
        t.q6_shr[l] = (int16_t)(hi ? 2 : 0);
    }
    return t;
}
alignas(64) constexpr Z512Tables kZ = make_z512_tables();
inline __m512i ztab(const int16_t* p) { return _mm512_load_si512((const void*)p); }
#else
struct Pair { __m256i w0, w1, s0, s1; };
using IAcc = __m256i;
inline Pair make_pair(__m256i w0, __m256i w1, __m256i s0, __m256i s1) { return {w0, w1, s0, s1}; }
inline IAcc iacc_zero() { return _mm256_setzero_si256(); }
inline IAcc pair_dot(IAcc acc, const Pair& p, const int8_t* a) {
    // maddubs cannot saturate here: |w| <= 63 and |a| <= 127 give at most 2*63*127.
    const __m256i p0 = _mm256_maddubs_epi16(p.w0, _mm256_loadu_si256((const __m256i*)a));
    const __m256i p1 = _mm256_maddubs_epi16(p.w1, _mm256_loadu_si256((const __m256i*)(a + 32)));
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(p0, p.s0), _mm256_madd_epi16(p1, p.s1)));
}
inline __m256i iacc_fold(IAcc v) { return v; }
#endif

// i16 lanes all equal to word k of a register that holds 8 words in each 128-bit lane.
inline __m256i splat_word(__m256i v, int k) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 + 0x0202 * k)));
}

// Low 128-bit lane = word klo, high lane = word khi (Q6_K: 16-element sub-blocks).
inline __m256i splat_word2(__m256i v, int klo, int khi) {
    return _mm256_shuffle_epi8(v, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * khi)),
                                                   _mm_set1_epi16((short)(0x0100 + 0x0202 * klo))));
}

// Bit S of each byte of hb moved to bit 4 (the fifth bit of a Q5_K weight).
template <int S>
inline __m256i hbit5(__m256i hb) {
    const __m256i m = _mm256_set1_epi8(0x10);
    if constexpr (S < 4) return _mm256_and_si256(_mm256_slli_epi16(hb, 4 - S), m);
    else if constexpr (S == 4) return _mm256_and_si256(hb, m);
    else return _mm256_and_si256(_mm256_srli_epi16(hb, S - 4), m);
}

// Small fixed loops unrolled early, so per-token accumulator arrays stay in registers.
#define KQ_UNROLL _Pragma("GCC unroll 8")

// Decode streams weights from DRAM: prefetching each block's lines 1 KiB ahead adds to
// what the hardware prefetcher keeps in flight.
template <size_t BYTES>
inline void prefetch_block(const void* b) {
    const char* p = (const char*)b + 1024;
    for (size_t o = 0; o < BYTES; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

// unpack_scales_k4 in registers: the same 16 bytes. Building them with four 32-bit
// stores and reloading them as one 128-bit load defeated store forwarding, a stall per
// block that made Q4_K the slowest type (bench/quant_dot.py Q4_K 4864x896, 1 thread,
// warm: decode 27 -> 70 GOP/s, 128-token prefill 83 -> 110).
inline __m128i unpack_scales_k4_sse(const uint8_t* s) {
    uint32_t u2;
    std::memcpy(&u2, s + 8, 4);
    const __m128i v = _mm_insert_epi32(_mm_loadl_epi64((const __m128i*)s), (int)u2, 2);  // u0 u1 u2 0
    const __m128i x = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));                    // u0 u2 u1 u2
    const __m128i y = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));                    // u0 u0 u1 u1
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(x, _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(y, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

// Shared by Q4_K and Q5_K: both carry 6-bit scales/mins; `Q5` adds the high bits.
template <int NA, bool Q5, class Block>
void dot_k4_avx2(int64_t nb, const Block* x, const block_q8_K* const* y, float* res) {
    [[maybe_unused]] const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[NA];
    __m128 accm[NA];
    for (int a = 0; a < NA; ++a) { acc[a] = _mm256_setzero_ps(); accm[a] = _mm_setzero_ps(); }

    for (int64_t i = 0; i < nb; ++i) {
        const Block& b = x[i];
        if constexpr (NA == 1) prefetch_block<sizeof(Block)>(&b);
        const __m256i sm16 = _mm256_cvtepu8_epi16(unpack_scales_k4_sse(b.scales));
        const __m128i mins = _mm256_extracti128_si256(sm16, 1);
        [[maybe_unused]] const __m256i scl = _mm256_permute2x128_si256(sm16, sm16, 0x00);

        // Integer sums per token. The AVX2 build uses each 64-weight pair for every token
        // as soon as it is unpacked (four pairs of four registers each would not fit in
        // 16 ymm registers next to the accumulators, and the spills cost ~20% at NA = 4);
        // the summation order per token is the same either way.
        IAcc s[NA];
        KQ_UNROLL
        for (int a = 0; a < NA; ++a) s[a] = iacc_zero();
#if defined(KQ_AVX512)
        Pair p[4];
        {
            const __m512i m4z = _mm512_set1_epi8(0x0F), m10z = _mm512_set1_epi8(0x10);
            const __m512i smz = _mm512_castsi256_si512(sm16);
            [[maybe_unused]] __m512i hbz;
            if constexpr (Q5) hbz = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)b.qh));
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b.qs + 32 * j)));
                __m512i w = _mm512_and_si512(_mm512_srlv_epi16(v, ztab(kZ.shr_0_4)), m4z);
                if constexpr (Q5) {
                    const __m512i h = _mm512_srlv_epi16(_mm512_sllv_epi16(hbz, ztab(kZ.q5_shl[j])), ztab(kZ.q5_shr[j]));
                    w = _mm512_or_si512(w, _mm512_and_si512(h, m10z));
                }
                p[j] = {w, _mm512_permutexvar_epi16(ztab(kZ.k4_idx[j]), smz)};
            }
        }
#else
        [[maybe_unused]] __m256i hb;
        if constexpr (Q5) hb = _mm256_loadu_si256((const __m256i*)b.qh);
#define KQ_CHUNK(J, SLO, SHI)                                                                  \
        {                                                                                      \
            const __m256i v = _mm256_loadu_si256((const __m256i*)(b.qs + 32 * J));             \
            __m256i lo = _mm256_and_si256(v, m4);                                              \
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);                        \
            if constexpr (Q5) {                                                                \
                lo = _mm256_or_si256(lo, hbit5<SLO>(hb));                                      \
                hi = _mm256_or_si256(hi, hbit5<SHI>(hb));                                      \
            }                                                                                  \
            const Pair pj = make_pair(lo, hi, splat_word(scl, SLO), splat_word(scl, SHI));     \
            KQ_UNROLL                                                                          \
            for (int a = 0; a < NA; ++a) s[a] = pair_dot(s[a], pj, y[a][i].qs + 64 * J);       \
        }
        KQ_CHUNK(0, 0, 1) KQ_CHUNK(1, 2, 3) KQ_CHUNK(2, 4, 5) KQ_CHUNK(3, 6, 7)
#undef KQ_CHUNK
#endif
        const float dw = f16_to_f32(b.d), dmw = f16_to_f32(b.dmin);

        KQ_UNROLL
        for (int a = 0; a < NA; ++a) {
            const block_q8_K& yb = y[a][i];
            const __m256i bs = _mm256_loadu_si256((const __m256i*)yb.bsums);
            const __m128i bs8 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
            accm[a] = _mm_fmadd_ps(_mm_set1_ps(dmw * yb.d), _mm_cvtepi32_ps(_mm_madd_epi16(mins, bs8)), accm[a]);
#if defined(KQ_AVX512)
            for (int j = 0; j < 4; ++j) s[a] = pair_dot(s[a], p[j], yb.qs + 64 * j);
#endif
            acc[a] = _mm256_fmadd_ps(_mm256_set1_ps(dw * yb.d), _mm256_cvtepi32_ps(iacc_fold(s[a])), acc[a]);
        }
    }
    for (int a = 0; a < NA; ++a) res[a] = hsum_halves(acc[a]) - hsum_halves(accm[a]);
}

template <int NA>
void dot_q6K_avx2(int64_t nb, const block_q6_K* x, const block_q8_K* const* y, float* res) {
    [[maybe_unused]] const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[NA];
    for (int a = 0; a < NA; ++a) acc[a] = _mm256_setzero_ps();

    for (int64_t i = 0; i < nb; ++i) {
        const block_q6_K& b = x[i];
        if constexpr (NA == 1) prefetch_block<sizeof(block_q6_K)>(&b);
        // Weights stay unsigned (0..63) for maddubs; the -32 offset is applied once per
        // block through the activation sub-block sums: sum(sc*(q-32)*a) = sum(sc*q*a) - 32*sum(sc*bsum).
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)b.scales));
        IAcc s[NA];  // as in dot_k4_avx2: AVX2 consumes each pair right after unpacking it
        KQ_UNROLL
        for (int a = 0; a < NA; ++a) s[a] = iacc_zero();
#if defined(KQ_AVX512)
        Pair p[4];
        const __m512i m4z = _mm512_set1_epi8(0x0F), m30z = _mm512_set1_epi8(0x30);
        const __m512i scz = _mm512_castsi256_si512(sc16);
        for (int h = 0; h < 2; ++h) {
            const __m512i ql = _mm512_loadu_si512((const void*)(b.ql + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b.qh + 32 * h)));
            const __m512i w01 = _mm512_or_si512(_mm512_and_si512(ql, m4z),
                                                _mm512_and_si512(_mm512_sllv_epi16(qh, ztab(kZ.q6_shl)), m30z));
            const __m512i w23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4z),
                                                _mm512_and_si512(_mm512_srlv_epi16(qh, ztab(kZ.q6_shr)), m30z));
            p[2 * h] = {w01, _mm512_permutexvar_epi16(ztab(kZ.q6_idx[2 * h]), scz)};
            p[2 * h + 1] = {w23, _mm512_permutexvar_epi16(ztab(kZ.q6_idx[2 * h + 1]), scz)};
        }
#else
        KQ_UNROLL
        for (int h = 0; h < 2; ++h) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i*)(b.ql + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i*)(b.ql + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i*)(b.qh + 32 * h));
            const __m256i q0 = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
            const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
            const __m256i sch = h == 0 ? _mm256_permute2x128_si256(sc16, sc16, 0x00)
                                       : _mm256_permute2x128_si256(sc16, sc16, 0x11);
            const Pair pa = make_pair(q0, q1, splat_word2(sch, 0, 1), splat_word2(sch, 2, 3));
            KQ_UNROLL
            for (int a = 0; a < NA; ++a) s[a] = pair_dot(s[a], pa, y[a][i].qs + 128 * h);
            const Pair pb = make_pair(q2, q3, splat_word2(sch, 4, 5), splat_word2(sch, 6, 7));
            KQ_UNROLL
            for (int a = 0; a < NA; ++a) s[a] = pair_dot(s[a], pb, y[a][i].qs + 128 * h + 64);
        }
#endif
        const float dw = f16_to_f32(b.d);

        KQ_UNROLL
        for (int a = 0; a < NA; ++a) {
            const block_q8_K& yb = y[a][i];
#if defined(KQ_AVX512)
            for (int j = 0; j < 4; ++j) s[a] = pair_dot(s[a], p[j], yb.qs + 64 * j);
#endif
            const __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)yb.bsums));
            const __m256i si = _mm256_sub_epi32(iacc_fold(s[a]), _mm256_slli_epi32(corr, 5));
            acc[a] = _mm256_fmadd_ps(_mm256_set1_ps(dw * yb.d), _mm256_cvtepi32_ps(si), acc[a]);
        }
    }
    for (int a = 0; a < NA; ++a) res[a] = hsum_halves(acc[a]);
}

template <int NA>
void dot_simd_na(int32_t wtype, int64_t nb, const void* w, const block_q8_K* const* y, float* res) {
    switch (wtype) {
        case T_Q4_K: return dot_k4_avx2<NA, false>(nb, (const block_q4_K*)w, y, res);
        case T_Q5_K: return dot_k4_avx2<NA, true>(nb, (const block_q5_K*)w, y, res);
        case T_Q6_K: return dot_q6K_avx2<NA>(nb, (const block_q6_K*)w, y, res);
        default: bad_type(wtype, "K-quant vec_dot");
    }
}
#define KQ_HAVE_SIMD 1

// ---------------------------------------------------------------------------------
#elif defined(KQ_NEON)

// Sum of a0.b0 + a1.b1 (16 int8 lanes each) into four 32-bit lanes.
inline int32x4_t dot2(int8x16_t a0, int8x16_t b0, int8x16_t a1, int8x16_t b1) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), a0, b0), a1, b1);
#else
    // Each i16 lane holds two products of magnitude <= 64*127: no overflow.
    int16x8_t p0 = vmull_s8(vget_low_s8(a0), vget_low_s8(b0));
    p0 = vmlal_s8(p0, vget_high_s8(a0), vget_high_s8(b0));
    int16x8_t p1 = vmull_s8(vget_low_s8(a1), vget_low_s8(b1));
    p1 = vmlal_s8(p1, vget_high_s8(a1), vget_high_s8(b1));
    return vpadalq_s16(vpaddlq_s16(p0), p1);
#endif
}

inline int32x4_t dot1(int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), a, b);
#else
    int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    p = vmlal_s8(p, vget_high_s8(a), vget_high_s8(b));
    return vpaddlq_s16(p);
#endif
}

template <int NA, bool Q5, class Block>
void dot_k4_neon(int64_t nb, const Block* x, const block_q8_K* const* y, float* res) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    float acc[NA];
    for (int a = 0; a < NA; ++a) acc[a] = 0.0f;

    for (int64_t i = 0; i < nb; ++i) {
        const Block& b = x[i];
        uint8_t sm[16];
        unpack_scales_k4(b.scales, sm);
        const int16x8_t mins = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(sm + 8)));
        // q[2c], q[2c+1]: the 32 weights of chunk c (scale sm[c]).
        int8x16_t q[16];
        [[maybe_unused]] uint8x16_t h0, h1;
        if constexpr (Q5) { h0 = vld1q_u8(b.qh); h1 = vld1q_u8(b.qh + 16); }
        for (int j = 0; j < 4; ++j) {
            const uint8x16_t v0 = vld1q_u8(b.qs + 32 * j), v1 = vld1q_u8(b.qs + 32 * j + 16);
            uint8x16_t l0 = vandq_u8(v0, m4), l1 = vandq_u8(v1, m4);
            uint8x16_t u0 = vshrq_n_u8(v0, 4), u1 = vshrq_n_u8(v1, 4);
            if constexpr (Q5) {
                const uint8x16_t one = vdupq_n_u8(1), two = vdupq_n_u8(2);
                l0 = vorrq_u8(l0, vshlq_n_u8(vandq_u8(h0, one), 4));
                l1 = vorrq_u8(l1, vshlq_n_u8(vandq_u8(h1, one), 4));
                u0 = vorrq_u8(u0, vshlq_n_u8(vandq_u8(h0, two), 3));
                u1 = vorrq_u8(u1, vshlq_n_u8(vandq_u8(h1, two), 3));
                h0 = vshrq_n_u8(h0, 2);
                h1 = vshrq_n_u8(h1, 2);
            }
            q[4 * j + 0] = vreinterpretq_s8_u8(l0);
            q[4 * j + 1] = vreinterpretq_s8_u8(l1);
            q[4 * j + 2] = vreinterpretq_s8_u8(u0);
            q[4 * j + 3] = vreinterpretq_s8_u8(u1);
        }
        const float dw = f16_to_f32(b.d), dmw = f16_to_f32(b.dmin);

        for (int a = 0; a < NA; ++a) {
            const block_q8_K& yb = y[a][i];
            const int16x8_t bs = vpaddq_s16(vld1q_s16(yb.bsums), vld1q_s16(yb.bsums + 8));
            int32x4_t pm = vmull_s16(vget_low_s16(mins), vget_low_s16(bs));
            pm = vmlal_s16(pm, vget_high_s16(mins), vget_high_s16(bs));
            int32x4_t s = vdupq_n_s32(0);
            for (int c = 0; c < 8; ++c)
                s = vmlaq_n_s32(s, dot2(q[2 * c], vld1q_s8(yb.qs + 32 * c), q[2 * c + 1], vld1q_s8(yb.qs + 32 * c + 16)),
                                sm[c]);
            acc[a] += yb.d * (dw * (float)vaddvq_s32(s) - dmw * (float)vaddvq_s32(pm));
        }
    }
    for (int a = 0; a < NA; ++a) res[a] = acc[a];
}

template <int NA>
void dot_q6K_neon(int64_t nb, const block_q6_K* x, const block_q8_K* const* y, float* res) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(0x03);
    const int8x16_t off = vdupq_n_s8(32);
    float acc[NA];
    for (int a = 0; a < NA; ++a) acc[a] = 0.0f;

    for (int64_t i = 0; i < nb; ++i) {
        const block_q6_K& b = x[i];
        int8x16_t q[16];  // q[k]: the 16 signed weights of sub-block k
        for (int h = 0; h < 2; ++h) {
            const uint8_t* ql = b.ql + 64 * h;
            const uint8_t* qh = b.qh + 32 * h;
            for (int s = 0; s < 2; ++s) {
                const uint8x16_t la = vld1q_u8(ql + 16 * s), lb = vld1q_u8(ql + 32 + 16 * s);
                const uint8x16_t hv = vld1q_u8(qh + 16 * s);
                const uint8x16_t w0 = vorrq_u8(vandq_u8(la, m4), vshlq_n_u8(vandq_u8(hv, m3), 4));
                const uint8x16_t w1 = vorrq_u8(vandq_u8(lb, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hv, 2), m3), 4));
                const uint8x16_t w2 = vorrq_u8(vshrq_n_u8(la, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hv, 4), m3), 4));
                const uint8x16_t w3 = vorrq_u8(vshrq_n_u8(lb, 4), vshlq_n_u8(vshrq_n_u8(hv, 6), 4));
                q[8 * h + s + 0] = vsubq_s8(vreinterpretq_s8_u8(w0), off);
                q[8 * h + s + 2] = vsubq_s8(vreinterpretq_s8_u8(w1), off);
                q[8 * h + s + 4] = vsubq_s8(vreinterpretq_s8_u8(w2), off);
                q[8 * h + s + 6] = vsubq_s8(vreinterpretq_s8_u8(w3), off);
            }
        }
        const float dw = f16_to_f32(b.d);

        for (int a = 0; a < NA; ++a) {
            const block_q8_K& yb = y[a][i];
            int32x4_t s = vdupq_n_s32(0);
            for (int k = 0; k < 16; ++k) s = vmlaq_n_s32(s, dot1(q[k], vld1q_s8(yb.qs + 16 * k)), b.scales[k]);
            acc[a] += yb.d * dw * (float)vaddvq_s32(s);
        }
    }
    for (int a = 0; a < NA; ++a) res[a] = acc[a];
}

template <int NA>
void dot_simd_na(int32_t wtype, int64_t nb, const void* w, const block_q8_K* const* y, float* res) {
    switch (wtype) {
        case T_Q4_K: return dot_k4_neon<NA, false>(nb, (const block_q4_K*)w, y, res);
        case T_Q5_K: return dot_k4_neon<NA, true>(nb, (const block_q5_K*)w, y, res);
        case T_Q6_K: return dot_q6K_neon<NA>(nb, (const block_q6_K*)w, y, res);
        default: bad_type(wtype, "K-quant vec_dot");
    }
}
#define KQ_HAVE_SIMD 1
#endif

bool is_kq_weight(int32_t t) { return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }

// One weight row against na <= kMaxNA activation rows.
void row_dot(int32_t wtype, int64_t nb, const void* w, const block_q8_K* const* y, int na, float* res, bool simd) {
#if defined(KQ_HAVE_SIMD)
    if (simd) {
        switch (na) {
            case 1: return dot_simd_na<1>(wtype, nb, w, y, res);
            case 2: return dot_simd_na<2>(wtype, nb, w, y, res);
            case 3: return dot_simd_na<3>(wtype, nb, w, y, res);
            case 4: return dot_simd_na<4>(wtype, nb, w, y, res);
            default: break;
        }
    }
#endif
    for (int a = 0; a < na; ++a) res[a] = dot_scalar(wtype, nb, w, y[a]);
}

// Rounds to nearest, ties to even, exactly like ggml's nearest_int (|v| < 2^22).
inline int nearest_int(float v) {
    float t = v + 12582912.0f;
    int32_t i;
    std::memcpy(&i, &t, 4);
    return (i & 0x007fffff) - 0x00400000;
}

}  // namespace

#if defined(KQ_AVX2)
// One block, the same bytes as the scalar loop below: the max |x| is exact in any order,
// the first element reaching it gives the sign (as the scalar scan's strict >), the
// product iscale * x is the same float multiply, and vcvtps2dq rounds to nearest even
// exactly as nearest_int's magic-number add does for |v| < 2^22. Returns false (the
// caller then runs the scalar loop) for a block holding a NaN or an infinity.
bool quantize_block_q8_K_avx2(const float* x, block_q8_K& b) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int j = 0; j < QK_K; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        m = _mm256_max_ps(m, _mm256_and_ps(v, abs_mask));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return false;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    if (!(amax <= 3.4028235e38f)) return false;
    if (amax == 0.0f) {
        b.d = 0.0f;
        std::memset(b.qs, 0, sizeof(b.qs));
        std::memset(b.bsums, 0, sizeof(b.bsums));
        return true;
    }
    int j = 0;
    while (std::fabs(x[j]) != amax) ++j;
    const float iscale = -127.0f / x[j];
    const __m256 is = _mm256_set1_ps(iscale);
    const __m256i q127 = _mm256_set1_epi32(127);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int k = 0; k < QK_K; k += 32) {
        __m256i v[4];
        for (int u = 0; u < 4; ++u)
            v[u] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(is, _mm256_loadu_ps(x + k + 8 * u))), q127);
        // bsums of the two 16-element groups: exact int32 sums, no saturation.
        for (int g = 0; g < 2; ++g) {
            const __m256i s8 = _mm256_add_epi32(v[2 * g], v[2 * g + 1]);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            b.bsums[k / 16 + g] = (int16_t)_mm_cvtsi128_si32(s4);
        }
        const __m256i p16 = _mm256_packs_epi32(v[0], v[1]), p16b = _mm256_packs_epi32(v[2], v[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b), perm);
        _mm256_storeu_si256((__m256i*)(b.qs + k), p8);
    }
    b.d = 1.0f / iscale;
    return true;
}
#endif

void quantize_row_q8_K(const float* x, block_q8_K* y, int64_t n, bool simd) {
    check_n(n);
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
#if defined(KQ_AVX2)
        if (simd && quantize_block_q8_K_avx2(x, y[i])) continue;
#endif
        // The signed value of largest magnitude (first one on ties) maps to -127, as in ggml.
        float amax = 0.0f, vmax = 0.0f;
        for (int j = 0; j < QK_K; ++j) {
            const float ax = std::fabs(x[j]);
            if (ax > amax) { amax = ax; vmax = x[j]; }
        }
        block_q8_K& b = y[i];
        if (amax == 0.0f) {
            b.d = 0.0f;
            std::memset(b.qs, 0, sizeof(b.qs));
            std::memset(b.bsums, 0, sizeof(b.bsums));
            continue;
        }
        const float iscale = -127.0f / vmax;
        for (int j = 0; j < QK_K; ++j) {
            const int v = nearest_int(iscale * x[j]);
            b.qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < QK_K / 16; ++g) {
            int s = 0;
            for (int l = 0; l < 16; ++l) s += b.qs[16 * g + l];
            b.bsums[g] = (int16_t)s;
        }
        b.d = 1.0f / iscale;
    }
}

float vec_dot(int32_t wtype, int64_t n, const void* w, const block_q8_K* a, bool simd) {
    check_n(n);
    if (!is_kq_weight(wtype)) bad_type(wtype, "K-quant vec_dot");
    float r;
    row_dot(wtype, n / QK_K, w, &a, 1, &r, simd);
    return r;
}

void vec_dot_tile(int32_t wtype, int64_t n, const void* w, size_t w_stride, int nw, const void* a,
                  size_t a_stride, int na, float* out, size_t out_stride, bool simd) {
    check_n(n);
    if (!is_kq_weight(wtype)) bad_type(wtype, "K-quant vec_dot_tile");
    if (nw < 0 || na < 0) throw std::invalid_argument("K-quant vec_dot_tile: negative tile size");
    const int64_t nb = n / QK_K;
    const uint8_t* wb = (const uint8_t*)w;
    const uint8_t* ab = (const uint8_t*)a;
    for (int iw = 0; iw < nw; ++iw) {
        const void* wrow = wb + (size_t)iw * w_stride;
        for (int a0 = 0; a0 < na; a0 += kMaxNA) {
            const int cnt = na - a0 < kMaxNA ? na - a0 : kMaxNA;
            const block_q8_K* rows[kMaxNA];
            float res[kMaxNA];
            for (int k = 0; k < cnt; ++k) rows[k] = (const block_q8_K*)(ab + (size_t)(a0 + k) * a_stride);
            row_dot(wtype, nb, wrow, rows, cnt, res, simd);
            for (int k = 0; k < cnt; ++k) out[(size_t)(a0 + k) * out_stride + iw] = res[k];
        }
    }
}

void dequantize_row(int32_t type, const void* src, float* dst, int64_t n) {
    check_n(n);
    const int64_t nb = n / QK_K;
    switch (type) {
        case T_Q4_K:
        case T_Q5_K: {
            const bool q5 = type == T_Q5_K;
            const uint8_t* base = (const uint8_t*)src;
            const size_t bsz = q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
            for (int64_t i = 0; i < nb; ++i) {
                const uint8_t* blk = base + (size_t)i * bsz;
                // Both layouts start with d, dmin, scales; Q5_K then has qh before qs.
                const block_q4_K* h = (const block_q4_K*)blk;
                const uint8_t* qh = q5 ? ((const block_q5_K*)blk)->qh : nullptr;
                const uint8_t* qs = q5 ? ((const block_q5_K*)blk)->qs : h->qs;
                uint8_t sm[16];
                unpack_scales_k4(h->scales, sm);
                const float d = f16_to_f32(h->d), dmin = f16_to_f32(h->dmin);
                for (int j = 0; j < 4; ++j) {
                    for (int half_ = 0; half_ < 2; ++half_) {
                        const int sub = 2 * j + half_;
                        const float ds = d * (float)sm[sub], ms = dmin * (float)sm[8 + sub];
                        for (int l = 0; l < 32; ++l) {
                            int q = half_ ? (qs[32 * j + l] >> 4) : (qs[32 * j + l] & 0x0F);
                            if (q5) q |= ((qh[l] >> sub) & 1) << 4;
                            float t = ds * (float)q;
                            KQ_OPAQUE(t);
                            *dst++ = t - ms;
                        }
                    }
                }
            }
            return;
        }
        case T_Q6_K: {
            const block_q6_K* x = (const block_q6_K*)src;
            for (int64_t i = 0; i < nb; ++i) {
                const float d = f16_to_f32(x[i].d);
                for (int h = 0; h < 2; ++h) {
                    const uint8_t* ql = x[i].ql + 64 * h;
                    const uint8_t* qh = x[i].qh + 32 * h;
                    const int8_t* sc = x[i].scales + 8 * h;
                    float* y = dst + 256 * i + 128 * h;
                    for (int l = 0; l < 32; ++l) {
                        const int is = l / 16;
                        const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
                        const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                        y[l + 0] = d * (float)sc[is + 0] * (float)q1;
                        y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                        y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                        y[l + 96] = d * (float)sc[is + 6] * (float)q4;
                    }
                }
            }
            return;
        }
        case T_Q8_K: {
            const block_q8_K* x = (const block_q8_K*)src;
            for (int64_t i = 0; i < nb; ++i)
                for (int j = 0; j < QK_K; ++j) *dst++ = x[i].d * (float)x[i].qs[j];
            return;
        }
        default: bad_type(type, "K-quant dequantize_row");
    }
}

}  // namespace minfer::cpu::kq
