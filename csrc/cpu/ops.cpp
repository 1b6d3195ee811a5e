// Element-wise ops, RMSNorm, RoPE, row gathers and the KV store (attention lives in
// attention.cpp). Each kernel does a contiguous share of its rows/elements; nothing
// here synchronizes, the executor's barrier between steps does that.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/ops.h"
#include "cpu/quants.h"
#include "cpu/vec_math.h"

namespace minfer::cpu {

namespace {

using vm::use_simd;


// 1 when the float's exponent bits are all ones (NaN or +-Inf): integer arithmetic, so
// the check vectorizes and costs nothing beside the max.
inline uint32_t non_finite_bit(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return ((u & 0x7f800000u) + 0x00800000u) >> 31;
}

// Blocks of values scanned for their max before any index is tracked: the max pass
// carries no index (so it is a plain vector max), then only the first block holding the
// overall max is searched for its first index.
constexpr int64_t kPickBlock = 1024;

float block_max(const float* x, int64_t n, uint32_t& bad) {
    int64_t i = 0;
    float m = -INFINITY;
#ifdef MINFER_VEC_AVX2
    if (use_simd() && n >= 32) {
        const __m256i exp = _mm256_set1_epi32(0x7f800000);
        __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
        __m256i b = _mm256_setzero_si256();
        for (; i + 32 <= n; i += 32) {
            const __m256 v[4] = {_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(x + i + 16),
                                 _mm256_loadu_ps(x + i + 24)};
            m0 = _mm256_max_ps(m0, v[0]);
            m1 = _mm256_max_ps(m1, v[1]);
            m2 = _mm256_max_ps(m2, v[2]);
            m3 = _mm256_max_ps(m3, v[3]);
            for (const __m256& w : v)
                b = _mm256_or_si256(b, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(w), exp), exp));
        }
        bad |= !_mm256_testz_si256(b, b);
        alignas(32) float t[8];
        _mm256_store_ps(t, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
        for (float f : t) m = f > m ? f : m;
    }
#endif
    for (; i < n; ++i) {
        bad |= non_finite_bit(x[i]);
        m = x[i] > m ? x[i] : m;
    }
    return m;
}
}  // namespace

int64_t first_max_finite(const float* x, int64_t n) {
    if (n <= 0) return -1;
    uint32_t bad = 0;
    float best = 0.0f;
    int64_t at = -1;  // the first block whose max is the largest so far
    for (int64_t b0 = 0; b0 < n; b0 += kPickBlock) {
        const float m = block_max(x + b0, std::min(kPickBlock, n - b0), bad);
        if (at < 0 || m > best) best = m, at = b0;
    }
    if (bad) return -1;
    while (!(x[at] == best)) ++at;  // -0 and +0 compare equal, as a strict > scan treats them
    return at;
}

bool top_k_finite(const float* x, int64_t n, int64_t k, int64_t* ids) {
    k = std::min(k, n);
    if (k <= 0) return true;
    // A heap of the k best so far whose top is the worst of them: a later value enters
    // only when strictly greater than that (an equal one has the higher index, and
    // loses). Logits rarely beat the k-th best, so most of the scan is the compare.
    const auto better = [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
    std::vector<int64_t> h(k);
    uint32_t bad = 0;
    for (int64_t i = 0; i < k; ++i) {
        h[i] = i;
        bad |= non_finite_bit(x[i]);
    }
    std::make_heap(h.begin(), h.end(), better);
    float thr = x[h[0]];
    const auto offer = [&](int64_t i) {
        if (!(x[i] > thr)) return;
        std::pop_heap(h.begin(), h.end(), better);
        h.back() = i;
        std::push_heap(h.begin(), h.end(), better);
        thr = x[h[0]];
    };
    int64_t i = k;
#ifdef MINFER_VEC_AVX2
    if (use_simd()) {
        const __m256i exp = _mm256_set1_epi32(0x7f800000);
        __m256i b = _mm256_setzero_si256();
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            b = _mm256_or_si256(b, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exp), exp));
            for (int m = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(thr), _CMP_GT_OQ)); m; m &= m - 1)
                offer(i + __builtin_ctz(m));
        }
        bad |= !_mm256_testz_si256(b, b);
    }
#endif
    for (; i < n; ++i) {
        bad |= non_finite_bit(x[i]);
        offer(i);
    }
    if (bad) return false;
    std::sort_heap(h.begin(), h.end(), better);
    std::copy(h.begin(), h.end(), ids);
    return true;
}

void add_f32(const float* a, const float* b, float* y, int64_t n, int ith, int nth) {
    int64_t i0, i1;
    vm::share(n, ith, nth, 16, i0, i1);
#ifdef MINFER_VEC_AVX2
    if (use_simd()) {
        vm::map2(a, b, y, i0, i1, [](__m256 x, __m256 z) { return _mm256_add_ps(x, z); });
        return;
    }
#endif
    for (int64_t i = i0; i < i1; ++i) y[i] = a[i] + b[i];
}

void mul_f32(const float* a, const float* b, float* y, int64_t n, int ith, int nth) {
    int64_t i0, i1;
    vm::share(n, ith, nth, 16, i0, i1);
#ifdef MINFER_VEC_AVX2
    if (use_simd()) {
        vm::map2(a, b, y, i0, i1, [](__m256 x, __m256 z) { return _mm256_mul_ps(x, z); });
        return;
    }
#endif
    for (int64_t i = i0; i < i1; ++i) y[i] = a[i] * b[i];
}

void silu_f32(const float* x, float* y, int64_t n, int ith, int nth) {
    int64_t i0, i1;
    vm::share(n, ith, nth, 16, i0, i1);
#ifdef MINFER_VEC_AVX2
    if (use_simd()) {
        // b is unused; passing x keeps one helper for both arities.
        vm::map2(x, x, y, i0, i1, [](__m256 v, __m256) { return vm::silu8(v); });
        return;
    }
#endif
    for (int64_t i = i0; i < i1; ++i) y[i] = vm::silu_scalar(x[i]);
}

void swiglu_f32(const float* g, const float* u, float* y, int64_t n, int ith, int nth) {
    int64_t i0, i1;
    vm::share(n, ith, nth, 16, i0, i1);
#ifdef MINFER_VEC_AVX2
    if (use_simd()) {
        vm::map2(g, u, y, i0, i1, [](__m256 a, __m256 b) { return _mm256_mul_ps(vm::silu8(a), b); });
        return;
    }
#endif
    for (int64_t i = i0; i < i1; ++i) {
        // silu ends in a division, so there is no mul+add to contract: s * u rounds
        // exactly as silu_f32 followed by mul_f32 does.
        const float s = vm::silu_scalar(g[i]);
        y[i] = s * u[i];
    }
}

void rms_norm_f32(const float* x, const float* w, float* y, int64_t d, int64_t nrows, float eps, int ith,
                  int nth) {
    int64_t r0, r1;
    vm::share(nrows, ith, nth, 1, r0, r1);
    [[maybe_unused]] const bool simd = use_simd();
    for (int64_t r = r0; r < r1; ++r) {
        const float* xr = x + r * d;
        float* yr = y + r * d;
        // Sum of squares in double: rows are short, and this matches a float64
        // reference to ~1e-7 instead of drifting with d.
        double ss = 0.0;
        int64_t i = 0;
#ifdef MINFER_VEC_AVX2
        if (simd) {
            __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
            for (; i + 8 <= d; i += 8) {
                __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(xr + i));
                __m256d hi = _mm256_cvtps_pd(_mm_loadu_ps(xr + i + 4));
                acc0 = _mm256_fmadd_pd(lo, lo, acc0);
                acc1 = _mm256_fmadd_pd(hi, hi, acc1);
            }
            alignas(32) double t[4];
            _mm256_store_pd(t, _mm256_add_pd(acc0, acc1));
            ss = (t[0] + t[1]) + (t[2] + t[3]);
        }
#endif
        for (; i < d; ++i) ss += (double)xr[i] * (double)xr[i];
        const float scale = (float)(1.0 / std::sqrt(ss / (double)d + (double)eps));
        i = 0;
#ifdef MINFER_VEC_AVX2
        if (simd) {
            const __m256 vs = _mm256_set1_ps(scale);
            if (w) {
                for (; i + 8 <= d; i += 8)
                    _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vs),
                                                           _mm256_loadu_ps(w + i)));
            } else {
                for (; i + 8 <= d; i += 8) _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(xr + i), vs));
            }
        }
#endif
        if (w) {
            for (; i < d; ++i) yr[i] = xr[i] * scale * w[i];
        } else {
            for (; i < d; ++i) yr[i] = xr[i] * scale;
        }
    }
}

void rope_f32(const float* x, float* y, const int32_t* pos, int64_t nt, int64_t nh, int64_t hd, int64_t n_rot,
              float freq_base, const RopeExt& ext, int ith, int nth) {
    // Rows are (token, head) pairs; a thread recomputes cos/sin only when its token changes.
    int64_t r0, r1;
    vm::share(nt * nh, ith, nth, 1, r0, r1);
    if (r0 >= r1) return;
    const int64_t half = n_rot / 2;
    static thread_local std::vector<float> cs;
    static thread_local std::vector<double> inv_freq;
    if ((int64_t)cs.size() < 2 * half) cs.resize(2 * half);
    if ((int64_t)inv_freq.size() < half) inv_freq.resize(half);
    for (int64_t i = 0; i < half; ++i) {
        inv_freq[i] = std::pow((double)freq_base, -2.0 * (double)i / (double)n_rot);
        // Scaling only where asked, so the plain NeoX angles keep their exact bits.
        if (ext.freq_scale != 1.0f) inv_freq[i] *= (double)ext.freq_scale;
        if (ext.factors) inv_freq[i] /= (double)ext.factors[i];
    }
    float* cosv = cs.data();
    float* sinv = cs.data() + half;
    const float mscale = ext.attn_factor;
    int64_t cur_t = -1;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t t = r / nh;
        if (t != cur_t) {
            // Angles in double: at position 3e4 a float theta would already be off by ~1e-3 rad.
            for (int64_t i = 0; i < half; ++i) {
                const double th = (double)pos[t] * inv_freq[i];
                cosv[i] = (float)std::cos(th);
                sinv[i] = (float)std::sin(th);
                if (mscale != 1.0f) {
                    cosv[i] *= mscale;
                    sinv[i] *= mscale;
                }
            }
            cur_t = t;
        }
        const float* xr = x + r * hd;
        float* yr = y + r * hd;
        if (ext.style == 0) {
            for (int64_t i = 0; i < half; ++i) {
                const float x0 = xr[i], x1 = xr[i + half];
                yr[i] = x0 * cosv[i] - x1 * sinv[i];
                yr[i + half] = x0 * sinv[i] + x1 * cosv[i];
            }
        } else {
            for (int64_t i = 0; i < half; ++i) {
                const float x0 = xr[2 * i], x1 = xr[2 * i + 1];
                yr[2 * i] = x0 * cosv[i] - x1 * sinv[i];
                yr[2 * i + 1] = x0 * sinv[i] + x1 * cosv[i];
            }
        }
        if (yr != xr && n_rot < hd) std::memcpy(yr + n_rot, xr + n_rot, (hd - n_rot) * sizeof(float));
    }
}

void get_rows_w(int32_t wtype, const void* table, size_t row_bytes, int64_t d, const int32_t* ids, int64_t n,
                float* y, int ith, int nth) {
    int64_t r0, r1;
    vm::share(n, ith, nth, 1, r0, r1);
    const uint8_t* base = (const uint8_t*)table;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* src = base + (size_t)ids[r] * row_bytes;
        if (wtype == T_F32)
            std::memcpy(y + r * d, src, d * sizeof(float));
        else
            dequantize_row(wtype, src, y + r * d, d);
    }
}

void get_rows_f32(const float* x, int64_t d, const int32_t* ids, int64_t n, float* y, int ith, int nth) {
    int64_t r0, r1;
    vm::share(n, ith, nth, 1, r0, r1);
    for (int64_t r = r0; r < r1; ++r) std::memcpy(y + r * d, x + (int64_t)ids[r] * d, d * sizeof(float));
}

void kv_store(const float* k, const float* v, const int32_t* cells, int64_t nt, int64_t kv_dim, void* kc, void* vc,
              int32_t kv_type, int ith, int nth) {
    // 2*nt row copies (K rows, then V rows) so a single decode token still uses two threads.
    int64_t r0, r1;
    vm::share(2 * nt, ith, nth, 1, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t t = r < nt ? r : r - nt;
        const int64_t c = cells[t];
        const float* src = (r < nt ? k : v) + t * kv_dim;
        void* dst = r < nt ? kc : vc;
        if (kv_type == T_F32) {
            std::memcpy((float*)dst + c * kv_dim, src, (size_t)kv_dim * sizeof(float));
            continue;
        }
        half* d = (half*)dst + c * kv_dim;
        int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
        for (; i + 8 <= kv_dim; i += 8) simd::store8_f16(d + i, _mm256_loadu_ps(src + i));
#endif
        for (; i < kv_dim; ++i) d[i] = simd::f32_to_f16(src[i]);
    }
}

}  // namespace minfer::cpu
