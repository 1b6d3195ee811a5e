// Small vector-math helpers shared by the element-wise and attention kernels.
// Internal to csrc/cpu (ops.cpp, attention.cpp); not part of the kernel contract.
//
// The SIMD helpers are written with explicit FMA intrinsics wherever a multiply
// feeds an add, so the compiler has no mul+add pairs left to contract differently
// depending on the inlining context; that keeps swiglu bit-identical to silu + mul.
#pragma once
#include <cmath>
#include <cstring>
#include <cstdint>

#include "common/simd.h"
#include "cpu/quants.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINFER_VEC_AVX2 1
#endif

namespace minfer::cpu::vm {

// The SIMD path unless set_kernel_path pinned the portable one (tests pin both).
inline bool use_simd() {
#ifdef MINFER_VEC_AVX2
    return kernel_path() == KernelPath::Simd;
#else
    return false;
#endif
}

// Contiguous [a, b) share of n items for thread ith; shares are multiples of align
// so SIMD loops see whole vectors except in the very last share.
inline void share(int64_t n, int ith, int nth, int64_t align, int64_t& a, int64_t& b) {
    int64_t per = (n + nth - 1) / nth;
    per = (per + align - 1) / align * align;
    a = per * ith < n ? per * ith : n;
    b = a + per < n ? a + per : n;
}

// Scalar silu, used by the portable path: splitting on the sign keeps exp() in (0, 1],
// so neither tail overflows and large negative inputs keep their relative accuracy.
// Clamping the negative multiplier at -200 (where e is already 0) makes silu(-inf) = -0
// rather than -inf * 0 = NaN.
inline float silu_scalar(float x) {
    float e = std::exp(-std::fabs(x));
    float num = x >= 0.0f ? x : (x < -200.0f ? -200.0f : x) * e;
    return num / (1.0f + e);
}

#ifdef MINFER_VEC_AVX2

// 8 float lanes (AVX2) and 16 (AVX-512) under one set of names, for kernels written once
// for both widths (exp_v here, attention's P V).
struct F8 {
    using F = __m256;
    static constexpr int N = 8;
    static F load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
    static F set(float v) { return _mm256_set1_ps(v); }
    static F max(F a, F b) { return _mm256_max_ps(a, b); }
    static F min(F a, F b) { return _mm256_min_ps(a, b); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
    static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    // 2^(n >> 1) and 2^(n - (n >> 1)) for the whole numbers n in fx.
    static void pow2_halves(F fx, F& s1, F& s2) {
        const __m256i n = _mm256_cvtps_epi32(fx), n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
        const __m256i bias = _mm256_set1_epi32(127);
        s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
        s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    }
};
#ifdef __AVX512F__
struct F16 {
    using F = __m512;
    static constexpr int N = 16;
    static F load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
    static F set(float v) { return _mm512_set1_ps(v); }
    static F max(F a, F b) { return _mm512_max_ps(a, b); }
    static F min(F a, F b) { return _mm512_min_ps(a, b); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
    static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static void pow2_halves(F fx, F& s1, F& s2) {
        const __m512i n = _mm512_cvtps_epi32(fx), n1 = _mm512_srai_epi32(n, 1), n2 = _mm512_sub_epi32(n, n1);
        const __m512i bias = _mm512_set1_epi32(127);
        s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
        s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
    }
};
#endif

// exp(x) lane by lane, Cephes-style: x = n*ln2 + r, |r| <= ln2/2, degree-6 polynomial
// (max rel. error ~2 ulp). 2^n is applied in two halves so results down to the
// denormal range (x ~ -103) come out right and x > 88.72 overflows to +inf. NaN stays NaN.
// The same operations at every width, so a lane's result does not depend on it.
template <class O>
inline typename O::F exp_v(typename O::F x) {
    using F = typename O::F;
    // Operand order matters: max/min return the second operand on NaN, so NaN survives.
    x = O::max(O::set(-104.0f), x);
    x = O::min(O::set(89.0f), x);
    const F fx = O::round(O::mul(x, O::set(1.44269504088896341f)));
    // ln2 split in two so r keeps full precision.
    F r = O::fnmadd(fx, O::set(0.693359375f), x);
    r = O::fnmadd(fx, O::set(-2.12194440e-4f), r);
    F p = O::set(1.9875691500e-4f);
    p = O::fmadd(p, r, O::set(1.3981999507e-3f));
    p = O::fmadd(p, r, O::set(8.3334519073e-3f));
    p = O::fmadd(p, r, O::set(4.1665795894e-2f));
    p = O::fmadd(p, r, O::set(1.6666665459e-1f));
    p = O::fmadd(p, r, O::set(5.0000001201e-1f));
    p = O::fmadd(p, O::mul(r, r), r);
    p = O::add(p, O::set(1.0f));
    F s1, s2;
    O::pow2_halves(fx, s1, s2);
    return O::mul(O::mul(p, s1), s2);
}

inline __m256 exp8(__m256 x) { return exp_v<F8>(x); }
#ifdef __AVX512F__
inline __m512 exp16(__m512 x) { return exp_v<F16>(x); }
#endif

// silu(x) = x * sigmoid(x), same sign split as silu_scalar.
inline __m256 silu8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 e = exp8(_mm256_or_ps(x, sign));  // exp(-|x|)
    __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256 xc = _mm256_max_ps(_mm256_set1_ps(-200.0f), x);  // see silu_scalar; NaN survives
    __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(xc, e), neg);
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}


// f over [i0, i1) of one / two inputs; the last partial vector goes through a padded copy
// so every element, tail included, takes the SIMD arithmetic. That makes the result
// independent of how the range was split between threads.
template <class F>
inline void map1(const float* x, float* y, int64_t i0, int64_t i1, F f) {
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) _mm256_storeu_ps(y + i, f(_mm256_loadu_ps(x + i)));
    if (i < i1) {
        alignas(32) float tx[8] = {0}, ty[8];
        const int64_t m = i1 - i;
        std::memcpy(tx, x + i, m * 4);
        _mm256_store_ps(ty, f(_mm256_load_ps(tx)));
        std::memcpy(y + i, ty, m * 4);
    }
}
template <class F>
inline void map2(const float* a, const float* b, float* y, int64_t i0, int64_t i1, F f) {
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) _mm256_storeu_ps(y + i, f(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    if (i < i1) {
        alignas(32) float ta[8] = {0}, tb[8] = {0}, ty[8];
        const int64_t m = i1 - i;
        std::memcpy(ta, a + i, m * 4);
        std::memcpy(tb, b + i, m * 4);
        _mm256_store_ps(ty, f(_mm256_load_ps(ta), _mm256_load_ps(tb)));
        std::memcpy(y + i, ty, m * 4);
    }
}
#endif  // MINFER_VEC_AVX2

}  // namespace minfer::cpu::vm
