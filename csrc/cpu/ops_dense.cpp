// Element-wise kernels of the dense families beyond Qwen (llama, gemma2/3, phi3): scale,
// GELU (tanh approximation) and its fused gated form, soft-capping, and the column slice
// that splits a fused projection (q|k|v, gate|up). Same conventions as ops.cpp: each
// kernel does a contiguous share, the executor puts the barriers between steps, and the
// SIMD and portable paths compute every element the same way whatever the split.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/ops.h"
#include "cpu/vec_math.h"

namespace minfer::cpu {

namespace {

using vm::use_simd;

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

// Every multiply that feeds an add is an explicit fma, so the compiler has nothing left to
// contract differently in gelu_f32 and geglu_f32 (fused and unfused must agree bitwise).
inline float gelu_scalar(float x) {
    const float u = kGeluC * std::fma(kGeluA * x, x * x, x);  // sqrt(2/pi) (x + a x^3)
    return 0.5f * x * (1.0f + std::tanh(u));
}

#ifdef MINFER_VEC_AVX2
// tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|): no overflow for any |y|, and
// the absolute error stays at a few ulp of 1 (exp8 is ~2 ulp).
inline __m256 tanh8(__m256 y) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 ay = _mm256_andnot_ps(sign, y);
    const __m256 e = vm::exp8(_mm256_mul_ps(ay, _mm256_set1_ps(-2.0f)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    return _mm256_or_ps(t, _mm256_and_ps(y, sign));
}

inline __m256 gelu8(__m256 x) {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(kGeluA), x), _mm256_mul_ps(x, x));
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(kGeluC), _mm256_add_ps(x3, x));
    const __m256 h = _mm256_mul_ps(_mm256_set1_ps(0.5f), x);
    return _mm256_mul_ps(h, _mm256_add_ps(_mm256_set1_ps(1.0f), tanh8(u)));
}

#endif

}  // namespace

void scale_f32(const float* x, float* y, float v, int64_t n, int ith, int nth) {
    int64_t i0, i1;
    vm::share(n, ith, nth, 16, i0, i1);
    for (int64_t i = i0; i < i1; ++i) y[i] = x[i] * v;
}

void gelu_f32(const float* x, float* y, int64_t n, int ith, int nth) {
    int64_t i0, i1;
    vm::share(n, ith, nth, 16, i0, i1);
#ifdef MINFER_VEC_AVX2
    if (use_simd()) {
        vm::map1(x, y, i0, i1, [](__m256 v) { return gelu8(v); });
        return;
    }
#endif
    for (int64_t i = i0; i < i1; ++i) y[i] = gelu_scalar(x[i]);
}

void geglu_f32(const float* g, const float* u, float* y, int64_t n, int ith, int nth) {
    int64_t i0, i1;
    vm::share(n, ith, nth, 16, i0, i1);
#ifdef MINFER_VEC_AVX2
    if (use_simd()) {
        vm::map2(g, u, y, i0, i1, [](__m256 a, __m256 b) { return _mm256_mul_ps(gelu8(a), b); });
        return;
    }
#endif
    for (int64_t i = i0; i < i1; ++i) {
        const float a = gelu_scalar(g[i]);  // stored first: rounds as gelu_f32 then mul_f32
        y[i] = a * u[i];
    }
}

void softcap_f32(const float* x, float* y, float cap, int64_t n, int ith, int nth) {
    int64_t i0, i1;
    vm::share(n, ith, nth, 16, i0, i1);
    const float inv = 1.0f / cap;
#ifdef MINFER_VEC_AVX2
    if (use_simd()) {
        const __m256 vi = _mm256_set1_ps(inv), vc = _mm256_set1_ps(cap);
        vm::map1(x, y, i0, i1, [&](__m256 v) { return _mm256_mul_ps(vc, tanh8(_mm256_mul_ps(v, vi))); });
        return;
    }
#endif
    for (int64_t i = i0; i < i1; ++i) y[i] = cap * std::tanh(x[i] * inv);
}

void slice_f32(const float* x, float* y, int64_t width, int64_t nt, int64_t src_width, int64_t offset, int ith,
               int nth) {
    int64_t r0, r1;
    vm::share(nt, ith, nth, 1, r0, r1);
    for (int64_t r = r0; r < r1; ++r) std::memcpy(y + r * width, x + r * src_width + offset, width * sizeof(float));
}

}  // namespace minfer::cpu
