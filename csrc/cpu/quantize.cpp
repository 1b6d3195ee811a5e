// Weight quantizers (see quantize.h). Written from the algorithms of ggml's reference
// quantizers: every float operation happens in the same order as there, and this file is
// compiled without FMA contraction (the pragma below), so a block comes out bit for bit
// as llama-quantize (without an importance matrix) makes it.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
// The 8-lane helpers are internal: their vector ABI on builds without AVX does not matter.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include "cpu/quantize.h"

#include <algorithm>
#include <cctype>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu/quants.h"

namespace minfer::cpu::qz {

namespace {

struct block_bf16 { uint16_t bits; };

inline float f32_bits(uint32_t w) { float f; std::memcpy(&f, &w, 4); return f; }
inline uint32_t bits_f32(float f) { uint32_t w; std::memcpy(&w, &f, 4); return w; }

// float -> IEEE half, round to nearest even; NaN -> 0x7E00 (ggml's software conversion).
inline half to_f16(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = bits_f32(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = f32_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = bits_f32(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (half)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float from_f16(half h) { return fp16_to_fp32(h); }

// float -> bfloat16, round to nearest even, NaN kept quiet.
inline uint16_t to_bf16(float f) {
    const uint32_t u = bits_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

// Round to nearest (ties to even) for |x| < 2^22, by the float-magic trick.
inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int i;
    std::memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

// C's float -> small integer conversions as the reference's casts compile on x86/ARM
// (truncate to int, keep the low byte); inputs are in range for finite weights.
inline int8_t trunc_i8(float v) { return (int8_t)(int)v; }
inline uint8_t trunc_u8(float v) { return (uint8_t)(int)v; }

constexpr float GROUP_MAX_EPS = 1e-15f;

// ---- the 32-element family ------------------------------------------------------------

void row_q4_0(const float* x, block_q4_0* y, int64_t k) {
    const int qk = QK4_0;
    const int64_t nb = k / qk;
    for (int64_t i = 0; i < nb; i++) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < qk; j++) {
            const float v = x[i * qk + j];
            if (amax < std::fabs(v)) { amax = std::fabs(v); max = v; }
        }
        const float d = max / -8;
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_f16(d);
        for (int j = 0; j < qk / 2; ++j) {
            const float x0 = x[i * qk + 0 + j] * id;
            const float x1 = x[i * qk + qk / 2 + j] * id;
            const uint8_t xi0 = (uint8_t)std::min(15, (int)trunc_i8(x0 + 8.5f));
            const uint8_t xi1 = (uint8_t)std::min(15, (int)trunc_i8(x1 + 8.5f));
            y[i].qs[j] = (uint8_t)(xi0 | (xi1 << 4));
        }
    }
}

void row_q4_1(const float* x, block_q4_1* y, int64_t k) {
    const int qk = QK4_1;
    const int64_t nb = k / qk;
    for (int64_t i = 0; i < nb; i++) {
        float min = FLT_MAX, max = -FLT_MAX;
        for (int j = 0; j < qk; j++) {
            const float v = x[i * qk + j];
            if (v < min) min = v;
            if (v > max) max = v;
        }
        const float d = (max - min) / ((1 << 4) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_f16(d);
        y[i].m = to_f16(min);
        for (int j = 0; j < qk / 2; ++j) {
            const float x0 = (x[i * qk + 0 + j] - min) * id;
            const float x1 = (x[i * qk + qk / 2 + j] - min) * id;
            const uint8_t xi0 = (uint8_t)std::min(15, (int)trunc_i8(x0 + 0.5f));
            const uint8_t xi1 = (uint8_t)std::min(15, (int)trunc_i8(x1 + 0.5f));
            y[i].qs[j] = (uint8_t)(xi0 | (xi1 << 4));
        }
    }
}

void row_q5_0(const float* x, block_q5_0* y, int64_t k) {
    const int qk = QK5_0;
    const int64_t nb = k / qk;
    for (int64_t i = 0; i < nb; i++) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < qk; j++) {
            const float v = x[i * qk + j];
            if (amax < std::fabs(v)) { amax = std::fabs(v); max = v; }
        }
        const float d = max / -16;
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_f16(d);
        uint32_t qh = 0;
        for (int j = 0; j < qk / 2; ++j) {
            const float x0 = x[i * qk + 0 + j] * id;
            const float x1 = x[i * qk + qk / 2 + j] * id;
            const uint8_t xi0 = (uint8_t)std::min(31, (int)trunc_i8(x0 + 16.5f));
            const uint8_t xi1 = (uint8_t)std::min(31, (int)trunc_i8(x1 + 16.5f));
            y[i].qs[j] = (uint8_t)((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
            qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
            qh |= ((xi1 & 0x10u) >> 4) << (j + qk / 2);
        }
        std::memcpy(&y[i].qh, &qh, sizeof(qh));
    }
}

void row_q5_1(const float* x, block_q5_1* y, int64_t k) {
    const int qk = QK5_1;
    const int64_t nb = k / qk;
    for (int64_t i = 0; i < nb; i++) {
        float min = FLT_MAX, max = -FLT_MAX;
        for (int j = 0; j < qk; j++) {
            const float v = x[i * qk + j];
            if (v < min) min = v;
            if (v > max) max = v;
        }
        const float d = (max - min) / ((1 << 5) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_f16(d);
        y[i].m = to_f16(min);
        uint32_t qh = 0;
        for (int j = 0; j < qk / 2; ++j) {
            const float x0 = (x[i * qk + 0 + j] - min) * id;
            const float x1 = (x[i * qk + qk / 2 + j] - min) * id;
            const uint8_t xi0 = trunc_u8(x0 + 0.5f);
            const uint8_t xi1 = trunc_u8(x1 + 0.5f);
            y[i].qs[j] = (uint8_t)((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
            qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
            qh |= ((xi1 & 0x10u) >> 4) << (j + qk / 2);
        }
        std::memcpy(&y[i].qh, &qh, sizeof(qh));
    }
}

void row_q8_0(const float* x, block_q8_0* y, int64_t k) {
    const int64_t nb = k / QK8_0;
    for (int64_t i = 0; i < nb; i++) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) {
            const float v = x[i * QK8_0 + j];
            const float a = std::fabs(v);
            amax = amax > a ? amax : a;
        }
        const float d = amax / ((1 << 7) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_f16(d);
        for (int j = 0; j < QK8_0; ++j) {
            const float x0 = x[i * QK8_0 + j] * id;
            y[i].qs[j] = (int8_t)(int)std::round(x0);  // half away from zero, as roundf
        }
    }
}

// ---- K-quants -----------------------------------------------------------------------

// Scale and min for n values in [0, nmax] levels, weighted least squares over a search of
// nstep+1 candidate scales (ggml's make_qkx2_quants). Returns the scale; *the_min = -min.
// The scalar forms below are what the 8-lane versions (make_qkx2_quants8,
// make_qx_quants8) compute per lane; kept as their readable specification.
[[maybe_unused]] float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep, bool use_mad) {
    float min = x[0];
    float max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)std::max(0, std::min(nmax, l));
        float diff = scale * L[i] + min - x[i];
        diff = use_mad ? std::fabs(diff) : diff * diff;
        float w = weights[i];
        best_error += w * diff;
    }
    if (nstep < 1) {
        *the_min = -min;
        return scale;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * (x[i] - min));
            l = std::max(0, std::min(nmax, l));
            Laux[i] = (uint8_t)l;
            float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? std::fabs(diff) : diff * diff;
                float w = weights[i];
                cur_error += w * diff;
            }
            if (cur_error < best_error) {
                for (int i = 0; i < n; ++i) L[i] = Laux[i];
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

// Symmetric scale for n values in [-nmax, nmax-1], weighted by x^2 (rmse_type 1 without
// importance weights), searching 18 scales around -nmax/max (ggml's make_qx_quants).
[[maybe_unused]] float make_qx_quants_rmse1(int n, int nmax, const float* x, int8_t* L) {
    float max = 0;
    float amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = std::fabs(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0;
    float suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = std::max(-nmax, std::min(nmax - 1, l));
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            l = std::max(-nmax, std::min(nmax - 1, l));
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) {
                int l = nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + std::max(-nmax, std::min(nmax - 1, l)));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

// ---- the same searches, eight sub-blocks at a time -------------------------------------
//
// Each lane of these vector versions runs exactly the scalar code's sequence of IEEE
// operations for one sub-block (same order, no contraction, correctly rounded division
// and square root), so the results are bit for bit the scalar ones; only the eight
// independent sub-blocks of a super-block run side by side.

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8i nearest_int8(v8f f) {
    v8f val = f + 12582912.f;
    return ((v8i)val & 0x007fffff) - 0x00400000;
}
inline v8i clamp8(v8i l, int lo, int hi) {
    l = l < lo ? (v8i){} + lo : l;
    return l > hi ? (v8i){} + hi : l;
}
inline v8f to_f8(v8i l) { return __builtin_convertvector(l, v8f); }
inline v8f fabs8(v8f v) { return (v8f)((v8i)v & 0x7fffffff); }

// make_qkx2_quants over 8 sub-blocks of n: x[i] and w[i] hold element i of every
// sub-block (lane j = sub-block j). Returns the scales; L[i] the levels; *the_min.
v8f make_qkx2_quants8(int n, int nmax, const v8f* x, const v8f* weights, v8i* L, v8f* the_min, float rmin,
                      float rdelta, int nstep) {
    v8f min = x[0], max = x[0];
    v8f sum_w = weights[0];
    v8f sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        min = x[i] < min ? x[i] : min;
        max = x[i] > max ? x[i] : max;
        v8f w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    min = min > 0 ? (v8f){} : min;
    const v8i flat = max == min;
    const v8f range = flat ? (v8f){} + 1.0f : max - min;  // flat lanes: results replaced below
    v8f iscale = (float)nmax / range;
    v8f scale = 1 / iscale;
    v8f best_error = {};
    for (int i = 0; i < n; ++i) {
        v8i l = clamp8(nearest_int8(iscale * (x[i] - min)), 0, nmax);
        L[i] = l;
        v8f diff = scale * to_f8(l) + min - x[i];
        diff = diff * diff;
        best_error += weights[i] * diff;
    }
    v8i Laux[32];
    for (int is = 0; is <= nstep; ++is) {
        // min moves when a candidate wins, and the next candidates scale from it
        iscale = (rmin + rdelta * is + nmax) / (flat ? (v8f){} + 1.0f : max - min);
        v8f sum_l = {}, sum_l2 = {}, sum_xl = {};
        for (int i = 0; i < n; ++i) {
            v8i l = clamp8(nearest_int8(iscale * (x[i] - min)), 0, nmax);
            Laux[i] = l;
            v8f w = weights[i], lf = to_f8(l);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        v8f D = sum_w * sum_l2 - sum_l * sum_l;
        const v8i ok = D > 0;
        if (!(ok[0] | ok[1] | ok[2] | ok[3] | ok[4] | ok[5] | ok[6] | ok[7])) continue;
        v8f this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
        v8f this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        const v8i pos = this_min > 0;
        this_min = pos ? (v8f){} : this_min;
        this_scale = pos ? sum_xl / sum_l2 : this_scale;
        v8f cur_error = {};
        for (int i = 0; i < n; ++i) {
            v8f diff = this_scale * to_f8(Laux[i]) + this_min - x[i];
            diff = diff * diff;
            cur_error += weights[i] * diff;
        }
        const v8i better = ok & ~flat & (cur_error < best_error);
        for (int i = 0; i < n; ++i) L[i] = better ? Laux[i] : L[i];
        best_error = better ? cur_error : best_error;
        scale = better ? this_scale : scale;
        min = better ? this_min : min;
    }
    for (int i = 0; i < n; ++i) L[i] = flat ? (v8i){} : L[i];
    *the_min = -min;
    return flat ? (v8f){} : scale;
}

// make_qx_quants (rmse_type 1, no importance weights) over 8 sub-blocks of n.
v8f make_qx_quants8(int n, int nmax, const v8f* x, v8i* L) {
    v8f max = {}, amax = {};
    for (int i = 0; i < n; ++i) {
        v8f ax = fabs8(x[i]);
        const v8i gt = ax > amax;
        amax = gt ? ax : amax;
        max = gt ? x[i] : max;
    }
    const v8i zero = amax < GROUP_MAX_EPS;
    const v8f safe_max = zero ? (v8f){} + 1.0f : max;
    v8f iscale = (float)(-nmax) / safe_max;
    v8f sumlx = {}, suml2 = {};
    for (int i = 0; i < n; ++i) {
        v8i l = clamp8(nearest_int8(iscale * x[i]), -nmax, nmax - 1);
        L[i] = l + nmax;
        v8f w = x[i] * x[i], lf = to_f8(l);
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    v8f scale = suml2 != 0 ? sumlx / suml2 : (v8f){};
    v8f best = scale * sumlx;
    v8i Lc[32];
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / safe_max;
        sumlx = (v8f){};
        suml2 = (v8f){};
        for (int i = 0; i < n; ++i) {
            v8i l = clamp8(nearest_int8(iscale * x[i]), -nmax, nmax - 1);
            Lc[i] = l;
            v8f w = x[i] * x[i], lf = to_f8(l);
            sumlx += w * x[i] * lf;
            suml2 += w * lf * lf;
        }
        const v8i better = (suml2 > 0) & (sumlx * sumlx > best * suml2);
        for (int i = 0; i < n; ++i) L[i] = better ? Lc[i] + nmax : L[i];
        v8f s = sumlx / suml2;
        scale = better ? s : scale;
        best = better ? s * sumlx : best;
    }
    for (int i = 0; i < n; ++i) L[i] = zero ? (v8i){} : L[i];
    return zero ? (v8f){} : scale;
}

inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

// Shared by Q4_K and Q5_K: 8 sub-blocks of 32 get a scale and a min from
// make_qkx2_quants, both quantized to 6 bits against the block's largest, then every
// value is requantized against the stored (rounded) scales. Fills L[256] and the header.
template <class Block>
void k_scales_and_levels(const float* x, Block& y, uint8_t* L, int nmax, float rmin, float rdelta, int nstep) {
    float mins[QK_K / 32];
    float scales[QK_K / 32];
    float max_scale = 0;
    float max_min = 0;
    {
        // element i of the 8 sub-blocks side by side; weights av_x + |x| per sub-block
        v8f xv[32], wv[32];
        v8i Lv[32];
        for (int i = 0; i < 32; ++i)
            for (int j = 0; j < 8; ++j) xv[i][j] = x[32 * j + i];
        v8f sum_x2 = {};
        for (int i = 0; i < 32; ++i) sum_x2 += xv[i] * xv[i];
        v8f av_x;
        for (int j = 0; j < 8; ++j) av_x[j] = std::sqrt(sum_x2[j] / 32);
        for (int i = 0; i < 32; ++i) wv[i] = av_x + fabs8(xv[i]);
        v8f mv;
        v8f sv = make_qkx2_quants8(32, nmax, xv, wv, Lv, &mv, rmin, rdelta, nstep);
        for (int j = 0; j < 8; ++j) {
            scales[j] = sv[j];
            mins[j] = mv[j];
            for (int i = 0; i < 32; ++i) L[32 * j + i] = (uint8_t)Lv[i][j];
        }
    }
    for (int j = 0; j < QK_K / 32; ++j) {
        float scale = scales[j];
        if (scale > max_scale) max_scale = scale;
        float min = mins[j];
        if (min > max_min) max_min = min;
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = std::min<uint8_t>(63, ls);
        lm = std::min<uint8_t>(63, lm);
        if (j < 4) {
            y.scales[j] = ls;
            y.scales[j + 4] = lm;
        } else {
            y.scales[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            y.scales[j - 4] |= (uint8_t)((ls >> 4) << 6);
            y.scales[j - 0] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    y.d = to_f16(max_scale / 63.f);
    y.dmin = to_f16(max_min / 63.f);
    uint8_t sc, m;
    for (int j = 0; j < QK_K / 32; ++j) {
        get_scale_min_k4(j, y.scales, &sc, &m);
        const float d = from_f16(y.d) * sc;
        if (!d) continue;
        const float dm = from_f16(y.dmin) * m;
        for (int ii = 0; ii < 32; ++ii) {
            int l = nearest_int((x[32 * j + ii] + dm) / d);
            l = std::max(0, std::min(nmax, l));
            L[32 * j + ii] = (uint8_t)l;
        }
    }
}

void row_q4_K(const float* x, block_q4_K* y, int64_t k) {
    const int64_t nb = k / QK_K;
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++) {
        k_scales_and_levels(x, y[i], L, 15, -1.f, 0.1f, 20);
        uint8_t* q = y[i].qs;
        for (int j = 0; j < QK_K; j += 64) {
            for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
            q += 32;
        }
        x += QK_K;
    }
}

void row_q5_K(const float* x, block_q5_K* y, int64_t k) {
    const int64_t nb = k / QK_K;
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++) {
        k_scales_and_levels(x, y[i], L, 31, -0.5f, 0.1f, 15);
        uint8_t* qh = y[i].qh;
        uint8_t* ql = y[i].qs;
        std::memset(qh, 0, QK_K / 8);
        uint8_t m1 = 1, m2 = 2;
        for (int n = 0; n < QK_K; n += 64) {
            for (int j = 0; j < 32; ++j) {
                int l1 = L[n + j];
                if (l1 > 15) { l1 -= 16; qh[j] |= m1; }
                int l2 = L[n + j + 32];
                if (l2 > 15) { l2 -= 16; qh[j] |= m2; }
                ql[j] = (uint8_t)(l1 | (l2 << 4));
            }
            m1 <<= 2;
            m2 <<= 2;
            ql += 32;
        }
        x += QK_K;
    }
}

void row_q6_K(const float* x, block_q6_K* y, int64_t k) {
    const int64_t nb = k / QK_K;
    int8_t L[QK_K];
    float scales[QK_K / 16];
    for (int64_t i = 0; i < nb; i++) {
        float max_scale = 0;
        float max_abs_scale = 0;
        for (int g = 0; g < 2; ++g) {
            v8f xv[16];
            v8i Lv[16];
            for (int e = 0; e < 16; ++e)
                for (int j = 0; j < 8; ++j) xv[e][j] = x[16 * (8 * g + j) + e];
            v8f sv = make_qx_quants8(16, 32, xv, Lv);
            for (int j = 0; j < 8; ++j) {
                scales[8 * g + j] = sv[j];
                for (int e = 0; e < 16; ++e) L[16 * (8 * g + j) + e] = (int8_t)Lv[e][j];
            }
        }
        for (int ib = 0; ib < QK_K / 16; ++ib) {
            const float scale = scales[ib];
            const float abs_scale = std::fabs(scale);
            if (abs_scale > max_abs_scale) {
                max_abs_scale = abs_scale;
                max_scale = scale;
            }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            std::memset(&y[i], 0, sizeof(block_q6_K));
            y[i].d = to_f16(0.f);
            x += QK_K;
            continue;
        }
        float iscale = -128.f / max_scale;
        y[i].d = to_f16(1 / iscale);
        for (int ib = 0; ib < QK_K / 16; ++ib)
            y[i].scales[ib] = (int8_t)std::min(127, nearest_int(iscale * scales[ib]));
        for (int j = 0; j < QK_K / 16; ++j) {
            float d = from_f16(y[i].d) * y[i].scales[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int(x[16 * j + ii] / d);
                l = std::max(-32, std::min(31, l));
                L[16 * j + ii] = (int8_t)(l + 32);
            }
        }
        uint8_t* ql = y[i].ql;
        uint8_t* qh = y[i].qh;
        for (int j = 0; j < QK_K; j += 128) {
            for (int l = 0; l < 32; ++l) {
                const uint8_t q1 = L[j + l + 0] & 0xF;
                const uint8_t q2 = L[j + l + 32] & 0xF;
                const uint8_t q3 = L[j + l + 64] & 0xF;
                const uint8_t q4 = L[j + l + 96] & 0xF;
                ql[l + 0] = (uint8_t)(q1 | (q3 << 4));
                ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
                qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                                  ((L[j + l + 96] >> 4) << 6));
            }
            ql += 64;
            qh += 32;
        }
        x += QK_K;
    }
}

// ---- plain floats -------------------------------------------------------------------

void row_f32(const float* x, float* y, int64_t n) { std::memcpy(y, x, (size_t)n * sizeof(float)); }
void row_f16(const float* x, half* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = to_f16(x[i]);
}
void row_bf16(const float* x, uint16_t* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = to_bf16(x[i]);
}
// F16 -> f32 (exact): the F16C instruction where the build has it.
void deq_f16(const half* x, float* y, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + i))));
#endif
    for (; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
}
void deq_bf16(const uint16_t* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = f32_bits((uint32_t)x[i] << 16);
}

// Runs fn(first_row, n_rows) over [0, nrows) on up to n_threads threads (the caller's
// thread takes the first share), in contiguous row ranges.
template <class F>
void parallel_rows(int64_t nrows, int n_threads, int64_t row_cost, F fn) {
    // A thread is worth starting for ~1M elements of work at least.
    const int64_t min_rows = std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(1, row_cost));
    int64_t nt = std::min<int64_t>(std::max(1, n_threads), (nrows + min_rows - 1) / min_rows);
    nt = std::max<int64_t>(1, nt);
    if (nt == 1) { fn(0, nrows); return; }
    std::vector<std::thread> workers;
    workers.reserve((size_t)nt - 1);
    const int64_t per = nrows / nt, extra = nrows % nt;
    int64_t r0 = 0;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t t = 0; t < nt; ++t) {
        const int64_t n = per + (t < extra ? 1 : 0);
        ranges.emplace_back(r0, n);
        r0 += n;
    }
    for (int64_t t = 1; t < nt; ++t) workers.emplace_back([&, t] { fn(ranges[t].first, ranges[t].second); });
    fn(ranges[0].first, ranges[0].second);
    for (auto& w : workers) w.join();
}

}  // namespace

int32_t type_from_name(const std::string& name) {
    std::string u = name;
    for (auto& c : u) c = (char)std::toupper((unsigned char)c);
    static const std::pair<const char*, int32_t> table[] = {
        {"F32", T_F32}, {"F16", T_F16}, {"BF16", T_BF16}, {"Q4_0", T_Q4_0}, {"Q4_1", T_Q4_1},
        {"Q5_0", T_Q5_0}, {"Q5_1", T_Q5_1}, {"Q8_0", T_Q8_0}, {"Q4_K", T_Q4_K}, {"Q5_K", T_Q5_K},
        {"Q6_K", T_Q6_K}, {"Q8_K", T_Q8_K},
    };
    for (const auto& [n, t] : table)
        if (u == n) return t;
    return -1;
}

const char* type_name(int32_t type) {
    switch (type) {
        case T_F32: return "F32";
        case T_F16: return "F16";
        case T_BF16: return "BF16";
        case T_Q4_0: return "Q4_0";
        case T_Q4_1: return "Q4_1";
        case T_Q5_0: return "Q5_0";
        case T_Q5_1: return "Q5_1";
        case T_Q8_0: return "Q8_0";
        case T_Q4_K: return "Q4_K";
        case T_Q5_K: return "Q5_K";
        case T_Q6_K: return "Q6_K";
        case T_Q8_K: return "Q8_K";
        default: return "?";
    }
}

bool can_quantize(int32_t type) {
    switch (type) {
        case T_F32: case T_F16: case T_BF16: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1:
        case T_Q8_0: case T_Q4_K: case T_Q5_K: case T_Q6_K:
            return true;
        default:
            return false;
    }
}

bool can_dequantize(int32_t type) { return can_quantize(type) || type == T_Q8_K; }

int type_block(int32_t type) { return type == T_BF16 ? 1 : type_block_elems(type); }

size_t row_bytes(int32_t type, int64_t n) {
    if (type == T_BF16) return n >= 0 ? (size_t)n * 2 : 0;
    return type_row_bytes(type, n);
}

void quantize_row(int32_t type, const float* x, void* y, int64_t n) {
    switch (type) {
        case T_F32: row_f32(x, (float*)y, n); break;
        case T_F16: row_f16(x, (half*)y, n); break;
        case T_BF16: row_bf16(x, (uint16_t*)y, n); break;
        case T_Q4_0: row_q4_0(x, (block_q4_0*)y, n); break;
        case T_Q4_1: row_q4_1(x, (block_q4_1*)y, n); break;
        case T_Q5_0: row_q5_0(x, (block_q5_0*)y, n); break;
        case T_Q5_1: row_q5_1(x, (block_q5_1*)y, n); break;
        case T_Q8_0: row_q8_0(x, (block_q8_0*)y, n); break;
        case T_Q4_K: row_q4_K(x, (block_q4_K*)y, n); break;
        case T_Q5_K: row_q5_K(x, (block_q5_K*)y, n); break;
        case T_Q6_K: row_q6_K(x, (block_q6_K*)y, n); break;
        default: throw std::invalid_argument(std::string("cannot quantize to type ") + type_name(type));
    }
}

static void check_shape(int32_t type, int64_t nrows, int64_t n_per_row, bool quantizing) {
    if (!(quantizing ? can_quantize(type) : can_dequantize(type)))
        throw std::invalid_argument(std::string(quantizing ? "cannot quantize to type " : "cannot dequantize type ") +
                                    type_name(type) + " (id " + std::to_string(type) + ")");
    if (nrows < 0 || n_per_row <= 0 || row_bytes(type, n_per_row) == 0)
        throw std::invalid_argument(std::string("row length ") + std::to_string(n_per_row) +
                                    " is not a multiple of the " + type_name(type) + " block size " +
                                    std::to_string(type_block(type)));
}

void quantize_rows(int32_t type, const float* src, int64_t nrows, int64_t n_per_row, void* dst, int n_threads) {
    check_shape(type, nrows, n_per_row, true);
    const size_t rb = row_bytes(type, n_per_row);
    // K-quants cost ~50x a plain conversion per element: weight the split accordingly.
    const int64_t cost = n_per_row * (type_block(type) == QK_K ? 64 : type_block(type) == 32 ? 4 : 1);
    parallel_rows(nrows, n_threads, cost, [&](int64_t r0, int64_t n) {
        for (int64_t r = r0; r < r0 + n; ++r)
            quantize_row(type, src + r * n_per_row, (uint8_t*)dst + (size_t)r * rb, n_per_row);
    });
}

void dequantize_rows(int32_t type, const void* src, int64_t nrows, int64_t n_per_row, float* dst, int n_threads) {
    check_shape(type, nrows, n_per_row, false);
    const size_t rb = row_bytes(type, n_per_row);
    parallel_rows(nrows, n_threads, n_per_row, [&](int64_t r0, int64_t n) {
        for (int64_t r = r0; r < r0 + n; ++r) {
            const uint8_t* s = (const uint8_t*)src + (size_t)r * rb;
            float* d = dst + r * n_per_row;
            if (type == T_BF16) deq_bf16((const uint16_t*)s, d, n_per_row);
            else if (type == T_F16) deq_f16((const half*)s, d, n_per_row);
            else dequantize_row(type, s, d, n_per_row);
        }
    });
}

}  // namespace minfer::cpu::qz
