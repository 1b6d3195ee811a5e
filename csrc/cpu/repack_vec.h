// Vector traits shared by the repacked-weight kernels (repack.cpp for the 32-element
// family, repack_k.cpp for the K-quants). Internal to csrc/cpu.
//
// V16 is one 512-bit register of 16 int32/f32 lanes (AVX-512), V8 one 256-bit register
// (AVX2); a 16-row group is one V16 or two V8 halves, lane r holding row r. dot() is the
// int8 step: every 32-bit lane adds the dot product of its 4 unsigned weight bytes with
// the same 4 signed activation bytes (vpdpbusd where the CPU has VNNI; maddubs + madd
// otherwise, exact as long as two products stay inside int16: codes <= 63).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/ggml_types.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RP_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RP_AVX512 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RP_VNNI 1
#elif defined(__AVXVNNI__)
#define RP_VNNI 1
#define RP_AVXVNNI 1
#endif
#endif

namespace minfer::cpu::repack {

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

#if defined(RP_AVX2)

#define RP_UNROLL _Pragma("GCC unroll 8")

#if defined(RP_AVX512)
// GCC 12's own _mm512_undefined_* trips -Wmaybe-uninitialized inside its intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
struct V16 {
    static constexpr int N = 16;
    using I = __m512i;
    using F = __m512;
    static I load(const uint8_t* p) { return _mm512_load_si512((const void*)p); }
    static I set8(int v) { return _mm512_set1_epi8((char)v); }
    static I zero_i() { return _mm512_setzero_si512(); }
    static I and_(I a, I b) { return _mm512_and_si512(a, b); }
    static I or_(I a, I b) { return _mm512_or_si512(a, b); }
    static I add(I a, I b) { return _mm512_add_epi32(a, b); }
    static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
    // a | (b & c) in one instruction
    static I or_and(I a, I b, I c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }
    template <int K> static I srl16(I a) { return K == 0 ? a : _mm512_srli_epi16(a, K); }
    template <int K> static I sll16(I a) { return K == 0 ? a : _mm512_slli_epi16(a, K); }
    static I bcast(int32_t v) { return _mm512_set1_epi32(v); }
    // N bytes -> N int32 lanes (unsigned / signed); 2N bytes -> 2N int16 (unsigned).
    static I u8_32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
    static I s8_32(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
    static I u8_16(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
    static I dot(I acc, I w, uint32_t a4) {
#if defined(__AVX512VNNI__)
        return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32((int)a4));
#else
        const __m512i p = _mm512_maddubs_epi16(w, _mm512_set1_epi32((int)a4));
        return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
    }
    // Without VNNI, dot() is maddubs + madd: dot16() keeps a run's maddubs sums in 16
    // bits and widen16_mul() widens and scales them once (group_kernel: the run lengths).
#if defined(__AVX512VNNI__)
    static constexpr bool kMaddubs = false;
#else
    static constexpr bool kMaddubs = true;
#endif
    static I dot16(I acc16, I w, uint32_t a4) {
        return _mm512_add_epi16(acc16, _mm512_maddubs_epi16(w, _mm512_set1_epi32((int)a4)));
    }
    // acc + (s16.lo + s16.hi) * v per lane, v an int16 in both halves of sc2 (dup16(v)).
    static I widen16_mul(I acc, I s16, I sc2) { return _mm512_add_epi32(acc, _mm512_madd_epi16(s16, sc2)); }
    static I dup16(I v) { return pack16(v, v); }
    // The low 16 bits of a's lanes below b's (int16 pairs (a, b)).
    static I pack16(I a, I b) {
        return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(b, 16));
    }
    static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
    template <int K> static I slli32(I a) { return _mm512_slli_epi32(a, K); }
    // acc + w.lo16 * a2.lo16 + w.hi16 * a2.hi16 per lane (int16 pairs, int32 sums).
    static I dotw(I acc, I w, uint32_t a2) {
#if defined(__AVX512VNNI__)
        return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32((int)a2));
#else
        return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32((int)a2)));
#endif
    }
    static F zero() { return _mm512_setzero_ps(); }
    static F loadh(const half* p) { return _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)p)); }
    static F scale(F dw, float da) { return _mm512_mul_ps(dw, _mm512_set1_ps(da)); }
    static F fma(F a, I b, F c) { return _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(b), c); }
    static F fnma(F a, I b, F c) { return _mm512_fnmadd_ps(a, _mm512_cvtepi32_ps(b), c); }
    static void store(float* y, F v, int lo, int hi) {
        if (lo == 0 && hi == N) _mm512_storeu_ps(y, v);
        else _mm512_mask_storeu_ps(y, (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1)), v);
    }
};
#endif

struct V8 {
    static constexpr int N = 8;
    using I = __m256i;
    using F = __m256;
    static I load(const uint8_t* p) { return _mm256_load_si256((const __m256i*)p); }
    static I set8(int v) { return _mm256_set1_epi8((char)v); }
    static I zero_i() { return _mm256_setzero_si256(); }
    static I and_(I a, I b) { return _mm256_and_si256(a, b); }
    static I or_(I a, I b) { return _mm256_or_si256(a, b); }
    static I add(I a, I b) { return _mm256_add_epi32(a, b); }
    static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
    static I or_and(I a, I b, I c) {
#if defined(RP_AVX512)
        return _mm256_ternarylogic_epi32(a, b, c, 0xF8);
#else
        return _mm256_or_si256(a, _mm256_and_si256(b, c));
#endif
    }
    template <int K> static I srl16(I a) { return K == 0 ? a : _mm256_srli_epi16(a, K); }
    template <int K> static I sll16(I a) { return K == 0 ? a : _mm256_slli_epi16(a, K); }
    static I bcast(int32_t v) { return _mm256_set1_epi32(v); }
    static I u8_32(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
    static I s8_32(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
    static I u8_16(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)); }
    static I dot(I acc, I w, uint32_t a4) {
#if defined(RP_AVXVNNI)
        return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32((int)a4));
#elif defined(RP_VNNI)
        return _mm256_dpbusd_epi32(acc, w, _mm256_set1_epi32((int)a4));
#else
        // No saturation for codes <= 63 (Q8_0 is only packed where vpdpbusd exists).
        const __m256i p = _mm256_maddubs_epi16(w, _mm256_set1_epi32((int)a4));
        return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
    }
#if defined(RP_AVXVNNI) || defined(RP_VNNI)
    static constexpr bool kMaddubs = false;
#else
    static constexpr bool kMaddubs = true;
#endif
    static I dot16(I acc16, I w, uint32_t a4) {
        return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, _mm256_set1_epi32((int)a4)));
    }
    static I widen16_mul(I acc, I s16, I sc2) { return _mm256_add_epi32(acc, _mm256_madd_epi16(s16, sc2)); }
    static I dup16(I v) { return pack16(v, v); }
    static I pack16(I a, I b) {
        return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(b, 16));
    }
    static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
    template <int K> static I slli32(I a) { return _mm256_slli_epi32(a, K); }
    static I dotw(I acc, I w, uint32_t a2) {
#if defined(RP_AVXVNNI)
        return _mm256_dpwssd_avx_epi32(acc, w, _mm256_set1_epi32((int)a2));
#elif defined(RP_VNNI)
        return _mm256_dpwssd_epi32(acc, w, _mm256_set1_epi32((int)a2));
#else
        return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32((int)a2)));
#endif
    }
    static F zero() { return _mm256_setzero_ps(); }
    static F loadh(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    static F scale(F dw, float da) { return _mm256_mul_ps(dw, _mm256_set1_ps(da)); }
    static F fma(F a, I b, F c) { return _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(b), c); }
    static F fnma(F a, I b, F c) { return _mm256_fnmadd_ps(a, _mm256_cvtepi32_ps(b), c); }
    static void store(float* y, F v, int lo, int hi) {
        if (lo == 0 && hi == N) {
            _mm256_storeu_ps(y, v);
            return;
        }
        alignas(32) float t[8];
        _mm256_store_ps(t, v);
        for (int i = lo; i < hi; ++i) y[i] = t[i];
    }
};

#if defined(RP_AVX512)
using VK = V16;
constexpr int kNA = 8;  // tokens per kernel call: accumulators that fit the 32 registers
#else
using VK = V8;
constexpr int kNA = 4;
#endif

// Walks rows [r0, r1) x nt tokens as kernel calls f(group, lane0, lo, hi, t, na): na <= kNA
// tokens from t, lanes [lo, hi) of the V-wide half at lane0 of the group. Tokens go in
// blocks of about kActBlockBytes of activations, each block over all the rows before the
// next: a 512-token prefill's Q8_K input to ffn_down is 2.8 MB, more than a core's L2,
// and re-streaming it once per group from L3 is what 16 threads then contend on. A
// thread's groups and one block of activations stay in L2 instead. The order changes
// no result: each call computes whole (row, token) dot products.
constexpr size_t kActBlockBytes = 256 << 10;
// whole_group: one call per group for all 16 lanes (lane0 0, lo/hi within [0, 16)), for
// kernels that walk both V8 halves in one pass (see kDecodeHalves).
template <int NA = kNA, class Fn>
inline void for_tiles(int64_t r0, int64_t r1, int64_t nt, size_t arb, bool whole_group, Fn&& f) {
    constexpr int G = 16;
    const int step = whole_group ? G : VK::N;
    const int64_t tb = std::max<int64_t>(NA, (int64_t)(kActBlockBytes / arb) / NA * NA);
    const int64_t g0 = r0 / G, g1 = (r1 + G - 1) / G;
    for (int64_t b0 = 0; b0 < nt; b0 += tb) {
        const int64_t b1 = std::min(nt, b0 + tb);
        for (int64_t gi = g0; gi < g1; ++gi) {
            const int64_t base = gi * G;
            for (int lane0 = 0; lane0 < G; lane0 += step) {
                const int64_t lo = std::max<int64_t>(r0 - base - lane0, 0);
                const int64_t hi = std::min<int64_t>(r1 - base - lane0, step);
                if (hi <= lo) continue;
                for (int64_t t = b0; t < b1; t += NA) f(gi, lane0, (int)lo, (int)hi, t, (int)std::min<int64_t>(NA, b1 - t));
            }
        }
    }
}

// Lane halves a one-token kernel walks per pass over a group: with 256-bit vectors a
// group is two halves, and a pass per half read every 64-byte line of the group twice,
// the first time for half its bytes; from DRAM (decode) that made the AVX2 build's
// repacked Q4_K / Q6_K slower than the unpacked kernels (bench/quant_dot.py --cold,
// 4864x896: Q6_K 0.38 -> 0.47 ms). Both halves per record keep each line's use together.
constexpr int kDecodeHalves = 16 / VK::N;

// Store lanes [lo, hi) of a 16-lane group held as H vectors of V::N lanes.
template <class V, int H>
inline void store_halves(float* y, const typename V::F* acc, int lo, int hi) {
    for (int h = 0; h < H; ++h) {
        const int l = std::max(lo - h * V::N, 0), u = std::min(hi - h * V::N, V::N);
        if (u > l) V::store(y + h * V::N, acc[h], l, u);
    }
}

// The 8 step vectors of a 32-code nibble block (4 chunks of 64 bytes; chunk t, lane r,
// byte b: low nibble = code[8t + b], high nibble = code[8t + 4 + b]), for the lanes
// that start at qs (qs = block start + 4 * first lane).
template <class V>
inline void nibbles(const uint8_t* qs, typename V::I w[8]) {
    using I = typename V::I;
    const I m4 = V::set8(0x0F);
    const I q0 = V::load(qs), q1 = V::load(qs + 64), q2 = V::load(qs + 128), q3 = V::load(qs + 192);
    w[0] = V::and_(q0, m4);
    w[1] = V::and_(V::template srl16<4>(q0), m4);
    w[2] = V::and_(q1, m4);
    w[3] = V::and_(V::template srl16<4>(q1), m4);
    w[4] = V::and_(q2, m4);
    w[5] = V::and_(V::template srl16<4>(q2), m4);
    w[6] = V::and_(q3, m4);
    w[7] = V::and_(V::template srl16<4>(q3), m4);
}

#endif  // RP_AVX2

}  // namespace minfer::cpu::repack
