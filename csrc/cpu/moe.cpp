// Mixture-of-experts kernels (see moe.h).
#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/quants.h"
#include "cpu/vec_math.h"
#include "cpu/work_split.h"

namespace minfer::cpu::moe {

namespace {

// A token's contiguous range [t0, t1) of nt for thread ith (the router ops are tiny:
// one token per thread at most in a decode step).
inline void token_share(int64_t nt, int ith, int nth, int64_t& t0, int64_t& t1) {
    t0 = nt * ith / nth;
    t1 = nt * (ith + 1) / nth;
}

// NaN ranks below every number (so a broken router still selects k distinct ids).
inline float rank_key(float v) { return std::isnan(v) ? -INFINITY : v; }

// The k best of one token's logits, best first, ties to the lower id: insertion into a
// sorted run, a new value going after the equal ones already there.
void select(const float* x, int64_t n, int64_t k, int32_t* ids, float* keys) {
    int64_t m = 0;
    for (int64_t e = 0; e < n; ++e) {
        const float v = rank_key(x[e]);
        if (m == k && !(v > keys[k - 1])) continue;
        int64_t pos = m < k ? m : k - 1;
        while (pos > 0 && keys[pos - 1] < v) {
            keys[pos] = keys[pos - 1];
            ids[pos] = ids[pos - 1];
            --pos;
        }
        keys[pos] = v;
        ids[pos] = (int32_t)e;
        if (m < k) ++m;
    }
}

}  // namespace

void sigmoid_f32(const float* x, float* y, int64_t n, int ith, int nth) {
    int64_t a, b;
    vm::share(n, ith, nth, 16, a, b);
    for (int64_t i = a; i < b; ++i) {
        // Split on the sign so exp() stays in (0, 1]: neither tail overflows.
        const float e = std::exp(-std::fabs(x[i]));
        y[i] = x[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    }
}

void topk_ids(const float* logits, int32_t* ids, int64_t n_expert, int64_t k, int64_t nt, int ith, int nth) {
    int64_t t0, t1;
    token_share(nt, ith, nth, t0, t1);
    std::vector<float> keys((size_t)k);
    for (int64_t t = t0; t < t1; ++t) select(logits + t * n_expert, n_expert, k, ids + t * k, keys.data());
}

void topk_weights(const float* logits, float* w, int64_t n_expert, int64_t k, int64_t nt, int gating, int norm,
                  float scale, int ith, int nth) {
    int64_t t0, t1;
    token_share(nt, ith, nth, t0, t1);
    std::vector<float> keys((size_t)k);
    std::vector<int32_t> ids((size_t)k);
    for (int64_t t = t0; t < t1; ++t) {
        const float* x = logits + t * n_expert;
        float* wt = w + t * k;
        select(x, n_expert, k, ids.data(), keys.data());
        if (gating == 1) {  // softmax over every expert, then the picked probabilities
            float mx = -INFINITY;
            for (int64_t e = 0; e < n_expert; ++e) mx = std::max(mx, x[e]);
            float sum = 0.0f;
            for (int64_t e = 0; e < n_expert; ++e) sum += std::exp(x[e] - mx);
            for (int64_t j = 0; j < k; ++j) wt[j] = std::exp(x[ids[j]] - mx) / sum;
        } else if (gating == 2) {  // sigmoid of each picked logit
            for (int64_t j = 0; j < k; ++j) wt[j] = 1.0f / (1.0f + std::exp(-x[ids[j]]));
        } else {  // softmax over the picked logits only
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < k; ++j) mx = std::max(mx, x[ids[j]]);
            for (int64_t j = 0; j < k; ++j) sum += (wt[j] = std::exp(x[ids[j]] - mx));
            for (int64_t j = 0; j < k; ++j) wt[j] /= sum;
        }
        if (norm) {
            float sum = 0.0f;
            for (int64_t j = 0; j < k; ++j) sum += wt[j];
            sum = std::max(sum, 6.103515625e-5f);  // llama.cpp's clamp: the smallest normal f16
            for (int64_t j = 0; j < k; ++j) wt[j] /= sum;
        }
        if (scale != 0.0f && scale != 1.0f)
            for (int64_t j = 0; j < k; ++j) wt[j] *= scale;
    }
}

void weighted_sum(const float* x, const float* w, float* y, int64_t d, int64_t k, int64_t nt, int ith, int nth) {
    int64_t a, b;
    vm::share(d * nt, ith, nth, 16, a, b);
    while (a < b) {
        const int64_t t = a / d, i0 = a % d, i1 = std::min(d, i0 + (b - a));
        const float* wt = w + t * k;
        float* yt = y + t * d;
        const float* x0 = x + t * k * d;
        for (int64_t i = i0; i < i1; ++i) yt[i] = wt[0] * x0[i];
        for (int64_t j = 1; j < k; ++j) {
            const float wj = wt[j];
            const float* xj = x0 + j * d;
            for (int64_t i = i0; i < i1; ++i) yt[i] += wj * xj[i];
        }
        a += i1 - i0;
    }
}

void scratch_need(int64_t nt, int64_t k, int64_t out, size_t arb, size_t meta_row, size_t& act, size_t& meta,
                  size_t& out_floats) {
    const size_t rows = (size_t)(nt * k);
    act = rows * arb;
    meta = rows * meta_row;
    out_floats = rows * (size_t)out;
}

namespace {

// Which (token, slot) rows each expert serves: experts in id order, rows ascending.
struct Table {
    std::vector<int32_t> count, start, rows, active;
    int64_t n_valid = 0;

    void build(const int32_t* ids, int64_t n_slots, int64_t n_expert) {
        count.assign((size_t)n_expert, 0);
        start.assign((size_t)n_expert + 1, 0);
        for (int64_t p = 0; p < n_slots; ++p)
            if (ids[p] >= 0 && ids[p] < n_expert) ++count[ids[p]];
        active.clear();
        for (int64_t e = 0; e < n_expert; ++e) {
            start[e + 1] = start[e] + count[e];
            if (count[e]) active.push_back((int32_t)e);
        }
        n_valid = start[n_expert];
        rows.resize((size_t)n_valid);
        std::vector<int32_t>& fill = scratch_fill;
        fill.assign(start.begin(), start.end() - 1);
        for (int64_t p = 0; p < n_slots; ++p)
            if (ids[p] >= 0 && ids[p] < n_expert) rows[fill[ids[p]]++] = (int32_t)p;
    }

private:
    std::vector<int32_t> scratch_fill;
};

// Rows [r0, r1) (the expert's own numbering) of y[t * ldy + r] = W_e row r . act row t,
// for nt activation rows of arb bytes.
void expert_rows(const MatmulIdArgs& a, int64_t e, const uint8_t* act, const uint8_t* meta, int64_t nt, float* y,
                 int64_t r0, int64_t r1) {
    const int64_t base = e * a.out;
    if (a.packed) {
        // The packed copy numbers rows across all experts: shift y so that global row
        // base + r lands on y's row r (only rows in [base + r0, base + r1) are stored).
        float* yb = (float*)((uintptr_t)y - (uintptr_t)base * sizeof(float));
        repack::matmul(*a.packed, act, a.arb, nt, yb, a.out, base + r0, base + r1, meta);
        return;
    }
    const Weight& w = *a.w;
    const uint8_t* wb = w.data + (size_t)base * w.row_bytes;
    constexpr int RB = 16, TB = 4;
    for (int64_t r = r0; r < r1; r += RB) {
        const int nw = (int)std::min<int64_t>(RB, r1 - r);
        for (int64_t t = 0; t < nt; t += TB) {
            const int na = (int)std::min<int64_t>(TB, nt - t);
            vec_dot_tile(w.type, a.in, wb + r * w.row_bytes, w.row_bytes, nw, act + t * a.arb, a.arb, na,
                         y + t * a.out + r, (size_t)a.out);
        }
    }
}

}  // namespace

void matmul_id_impl(const MatmulIdArgs& a, Scratch& sc, std::atomic<uint64_t>* state, int ith, int nth,
                    void (*sync_fn)(const void*), const void* sync_ctx) {
    const int64_t n_slots = a.nt * a.k, out = a.out;
    static thread_local Table tab;
    tab.build(a.ids, n_slots, a.n_expert);
    // Rows of slots without a valid expert: zero (MOE_TOPK never writes such an id).
    if (tab.n_valid < n_slots)
        for (int64_t p = ith; p < n_slots; p += nth)
            if (a.ids[p] < 0 || a.ids[p] >= a.n_expert) std::memset(a.y + p * out, 0, (size_t)out * 4);
    const bool per_slot_x = a.x_rows != a.nt;  // x holds one row per (token, slot)
    auto x_row = [&](int32_t p) { return per_slot_x ? (int64_t)p : (int64_t)(p / a.k); };
    // One token per expert (a decode step): its rows are read and written in place.
    bool gather = false;
    for (int32_t e : tab.active) gather = gather || tab.count[e] > 1;
    if (gather) {
        // The scratch is the team's: an earlier step (the gate before the up) may still
        // be reading it.
        sync_fn(sync_ctx);
        const int64_t g0 = tab.n_valid * ith / nth, g1 = tab.n_valid * (ith + 1) / nth;
        for (int64_t g = g0; g < g1; ++g) {
            const int64_t xr = x_row(tab.rows[g]);
            std::memcpy(sc.act.data() + g * a.arb, a.act + xr * a.arb, a.arb);
            if (a.meta) std::memcpy(sc.meta.data() + g * a.meta_row, a.meta + xr * a.meta_row, a.meta_row);
        }
        sync_fn(sync_ctx);
    }
    constexpr int64_t G = 16;
    const int64_t ng = (out + G - 1) / G, n_items = (int64_t)tab.active.size() * ng;
    // Items [i0, i1) of one expert: rows [g0 * 16, g1 * 16) for all its tokens.
    auto run_items = [&](int64_t i0, int64_t i1) {
        while (i0 < i1) {
            const int64_t ai = i0 / ng, g0 = i0 % ng, g1 = std::min(ng, g0 + (i1 - i0));
            const int64_t e = tab.active[ai], r0 = g0 * G, r1 = std::min(out, g1 * G);
            const int64_t s = tab.start[e], cnt = tab.count[e];
            if (!gather) {
                const int32_t p = tab.rows[s];  // one token: its rows in place
                const int64_t xr = x_row(p);
                expert_rows(a, e, a.act + xr * a.arb, a.meta ? a.meta + xr * a.meta_row : nullptr, 1, a.y + p * out,
                            r0, r1);
            } else {
                float* tmp = sc.out.data() + s * out;
                expert_rows(a, e, sc.act.data() + s * a.arb, a.meta ? sc.meta.data() + s * a.meta_row : nullptr, cnt,
                            tmp, r0, r1);
                for (int64_t i = 0; i < cnt; ++i)
                    std::memcpy(a.y + tab.rows[s + i] * out + r0, tmp + i * out + r0, (size_t)(r1 - r0) * 4);
            }
            i0 += g1 - g0;
        }
    };
    // Contiguous runs, claimed piece by piece; a thread done with its own run takes
    // pieces from the back of the others' (cpu/work_split.h). Which thread computes an
    // item never changes its bits.
    auto run_of = [&](int t) {
        const int64_t s = n_items * t / nth, e = n_items * (t + 1) / nth;
        return StealRun{s, e, 0, e - s, state + t};
    };
    int64_t p0, p1;
    const StealRun own = run_of(ith);
    while (own.take(false, p0, p1)) run_items(own.s + p0, own.s + p1);
    for (int d = 1; d < nth; ++d) {
        const StealRun other = run_of((ith + d) % nth);
        while (other.take(true, p0, p1)) run_items(other.s + p0, other.s + p1);
    }
}

}  // namespace minfer::cpu::moe
