// SIMD helpers shared by the kernels: f16 <-> f32 and horizontal sums. One definition
// each; the reduction trees are named for their order because results are pinned bit
// for bit (tests compare paths and thread counts exactly), so a caller picks a tree on
// purpose and never gets a different one by sharing a name.
#pragma once
#include <cstdint>
#include <cstring>

#include "common/ggml_types.h"

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace minfer::simd {

// f16 -> f32 of one value: exact on every path (the conversion is exact; only the
// instruction differs).
inline float f16_to_f32(half h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
#else
    return fp16_to_fp32(h);
#endif
}

// f32 -> f16, round to nearest even (same bits on every path, NaN payloads aside).
inline half f32_to_f16(float f) {
#if defined(__F16C__)
    return (half)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__aarch64__)
    __fp16 v = (__fp16)f;
    half h;
    std::memcpy(&h, &v, 2);
    return h;
#else
    return fp32_to_fp16(f);
#endif
}

#if defined(__F16C__) && defined(__AVX__)
inline __m256 load8_f16(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline void store8_f16(half* p, __m256 v) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

#if defined(__AVX__)
// Halves tree: ((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7)). The quantized dot products'.
inline float hsum_halves(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
// The same tree's last two levels for four lanes: (x0+x2) + (x1+x3).
inline float hsum_halves(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Pairs tree: ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)). Attention's (scores, softmax sums).
inline float hsum_pairs(__m256 v) {
    __m256 h = _mm256_hadd_ps(v, v);
    h = _mm256_hadd_ps(h, h);
    __m128 lo = _mm256_castps256_ps128(h), hi = _mm256_extractf128_ps(h, 1);
    return _mm_cvtss_f32(_mm_add_ps(lo, hi));
}
// Four pairs-tree sums at once -> (sum a, sum b, sum c, sum d), each in the very same
// tree as hsum_pairs, so a row's value never depends on which helper summed it.
inline __m128 hsum_pairs_x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b);   // a01 a23 b01 b23 | a45 a67 b45 b67
    __m256 cd = _mm256_hadd_ps(c, d);
    __m256 s = _mm256_hadd_ps(ab, cd);  // a0123 b0123 c0123 d0123 | a4567 ...
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

}  // namespace minfer::simd
