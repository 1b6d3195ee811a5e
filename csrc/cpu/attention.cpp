// Causal GQA attention over the persistent K/V regions, with an online softmax.
//
// Work is cut into items of (query-token block, KV head, slice of that head's query
// heads). An item walks KV cells in blocks of BK; each K/V row of a block is loaded
// once and used by every query row of the item (all heads of the GQA group, for a
// block of tokens), which is what makes prefill cache-friendly. P V and the softmax run
// on the widest vectors. (Scores as a matrix product over the block's K transposed were
// 7% faster in a prefill and 8% slower in decode at depth, where every block's transpose
// serves a few rows: docs/experiment-log.md.)
//
// Determinism: an item's rows are of one sequence, its KV blocks are counted in BK
// positions from the sequence's first (its cells read through its span: a shared
// prefix's, then its own), and every per-row operation (dot-product tree, max, exp,
// sums, accumulation order) depends only on that row's own data and positions. So a
// (token, head) output is bit-identical whatever item it landed in, for any thread
// count, wherever its sequence's cells lie in the arena, and whether its prefix is read
// in place or held in its own cells.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/attn_span.h"
#include "cpu/ops.h"
#include "cpu/quants.h"
#include "cpu/vec_math.h"

namespace minfer::cpu {

namespace {

constexpr int64_t BK = 64;      // KV cells per block: a 64 x hd64 f32 K block is 16 KiB (L1)
constexpr int64_t QROWS = 64;   // target query rows per prefill item

struct Tiling {
    int64_t r;         // query heads per KV head
    int64_t bq;        // tokens per item
    int64_t nqb;       // token blocks
    int64_t rows_max;  // query rows an item may hold
};

Tiling tiling(const AttnArgs& a) {
    Tiling t;
    t.r = a.nh / a.nkv;
    t.bq = a.nt <= 1 ? 1 : std::max<int64_t>(1, QROWS / t.r);
    t.bq = std::min<int64_t>(t.bq, std::max<int64_t>(a.nt, 1));
    t.nqb = (a.nt + t.bq - 1) / t.bq;
    t.rows_max = t.bq * t.r;
    return t;
}

inline int64_t round8(int64_t x) { return (x + 7) / 8 * 8; }

using vm::use_simd;

// One float lane under vm::F8's names: the portable path of the P V kernel below. Each
// lane runs its own chain of fused multiply-adds, so a lane's bits are the same at every
// width: FV1 computes exactly what F8 and F16 do.
struct FV1 {
    using F = float;
    static constexpr int N = 1;
    static F load(const float* p) { return *p; }
    static void store(float* p, F v) { *p = v; }
    static F set(float x) { return x; }
    static F mul(F a, F b) { return a * b; }
    static F fmadd(F a, F b, F c) { return std::fma(a, b, c); }
};
#ifdef __AVX512F__
using FVW = vm::F16;  // the widest vector of the SIMD path
#elif defined(MINFER_VEC_AVX2)
using FVW = vm::F8;
#endif

// out[j] = dot(q[j], k) for four query rows.
inline void dot4(const float* const q[4], const float* k, int64_t hd, bool simd, float out[4]) {
    int64_t d = 0;
#ifdef MINFER_VEC_AVX2
    if (simd) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; d + 8 <= hd; d += 8) {
            const __m256 kv = _mm256_loadu_ps(k + d);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q[0] + d), kv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q[1] + d), kv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q[2] + d), kv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q[3] + d), kv, a3);
        }
        _mm_storeu_ps(out, simd::hsum_pairs_x4(a0, a1, a2, a3));
    } else
#endif
    {
        out[0] = out[1] = out[2] = out[3] = 0.0f;
    }
    // Explicit fma: a contractible a += b * c could compile differently here and in
    // dot4x2_avx2, and then a score would depend on how cells were paired.
    for (; d < hd; ++d)
        for (int j = 0; j < 4; ++j) out[j] = std::fma(q[j][d], k[d], out[j]);
}

#ifdef MINFER_VEC_AVX2
// Two cells at once: each q load feeds two FMAs. Every (row, cell) sum uses the same
// accumulation and reduction tree as dot4, so pairing never changes a score.
inline void dot4x2_avx2(const float* const q[4], const float* k0, const float* k1, int64_t hd, float o0[4],
                        float o1[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8) {
        const __m256 x = _mm256_loadu_ps(k0 + d), y = _mm256_loadu_ps(k1 + d);
        __m256 qv = _mm256_loadu_ps(q[0] + d);
        a0 = _mm256_fmadd_ps(qv, x, a0);
        b0 = _mm256_fmadd_ps(qv, y, b0);
        qv = _mm256_loadu_ps(q[1] + d);
        a1 = _mm256_fmadd_ps(qv, x, a1);
        b1 = _mm256_fmadd_ps(qv, y, b1);
        qv = _mm256_loadu_ps(q[2] + d);
        a2 = _mm256_fmadd_ps(qv, x, a2);
        b2 = _mm256_fmadd_ps(qv, y, b2);
        qv = _mm256_loadu_ps(q[3] + d);
        a3 = _mm256_fmadd_ps(qv, x, a3);
        b3 = _mm256_fmadd_ps(qv, y, b3);
    }
    _mm_storeu_ps(o0, simd::hsum_pairs_x4(a0, a1, a2, a3));
    _mm_storeu_ps(o1, simd::hsum_pairs_x4(b0, b1, b2, b3));
    for (; d < hd; ++d)
        for (int j = 0; j < 4; ++j) {
            o0[j] = std::fma(q[j][d], k0[d], o0[j]);
            o1[j] = std::fma(q[j][d], k1[d], o1[j]);
        }
}

// max of p[0..n), n >= 1; max is exact, so the lane order cannot change the result.
#ifdef __AVX512F__
inline __m256 hi256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#endif

inline float max_avx2(const float* p, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 w = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (; i + 16 <= n; i += 16) w = _mm512_max_ps(w, _mm512_loadu_ps(p + i));
    __m256 m = _mm256_max_ps(_mm512_castps512_ps256(w), hi256(w));
#else
    __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
#endif
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(p + i));
    alignas(32) float t[8];
    _mm256_store_ps(t, m);
    float r = t[0];
    for (int j = 1; j < 8; ++j) r = std::max(r, t[j]);
    for (; i < n; ++i) r = std::max(r, p[i]);
    return r;
}
#endif

// p[0..n) = exp(p - m) in place; returns their sum.
inline float exp_sub_sum(float* p, int64_t n, float m, bool simd) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    if (simd) {
        // Whole vectors, the last padded with -inf (exp gives 0, which adds exactly).
        const __m512 vm_ = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        __m512 acc = _mm512_setzero_ps();
        for (; i < n; i += 16) {
            const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
            const __m512 e = vm::exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(ninf, k, p + i), vm_));
            _mm512_mask_storeu_ps(p + i, k, e);
            acc = _mm512_add_ps(acc, e);
        }
        return simd::hsum_pairs(_mm256_add_ps(_mm512_castps512_ps256(acc), hi256(acc)));
    }
#elif defined(MINFER_VEC_AVX2)
    if (simd) {
        const __m256 vm_ = _mm256_set1_ps(m);
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 e = vm::exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm_));
            _mm256_storeu_ps(p + i, e);
            acc = _mm256_add_ps(acc, e);
        }
        sum = simd::hsum_pairs(acc);
        if (i < n) {
            alignas(32) float t[8];
            const int64_t rem = n - i;
            for (int j = 0; j < 8; ++j) t[j] = j < rem ? p[i + j] - m : -std::numeric_limits<float>::infinity();
            _mm256_store_ps(t, vm::exp8(_mm256_load_ps(t)));
            for (int64_t j = 0; j < rem; ++j) {
                p[i + j] = t[j];
                sum += t[j];
            }
        }
        return sum;
    }
#endif
    for (; i < n; ++i) {
        p[i] = std::exp(p[i] - m);
        sum += p[i];
    }
    return sum;
}

// NV vectors of acc from d0: acc * alpha + sum over c in [0, n) of p[c] * v[c][..], the
// cells in order, one fused multiply-add each (a lane's bits are the same at any width).
template <class V, int NV>
inline void accumulate_pass(float* acc, float alpha, const float* p, const float* v, int64_t vstride, int64_t n,
                            int64_t d0) {
    using F = typename V::F;
    const F va = V::set(alpha);
    F r[NV];
    for (int k = 0; k < NV; ++k) r[k] = V::mul(V::load(acc + d0 + k * V::N), va);
    const float* vr = v + d0;
    for (int64_t c = 0; c < n; ++c, vr += vstride) {
        const F pc = V::set(p[c]);
        for (int k = 0; k < NV; ++k) r[k] = V::fmadd(pc, V::load(vr + k * V::N), r[k]);
    }
    for (int k = 0; k < NV; ++k) V::store(acc + d0 + k * V::N, r[k]);
}

// acc[0..hd) = acc * alpha + sum_{c in [0, n)} p[c] * v[c * vstride + 0..hd).
inline void accumulate(float* acc, float alpha, const float* p, const float* v, int64_t vstride, int64_t n,
                       int64_t hd, bool simd) {
    int64_t d0 = 0;
#ifdef MINFER_VEC_AVX2
    if (simd) {
        // 64 dims stay in registers across the whole cell loop (4 AVX-512 or 8 AVX2 vectors).
        constexpr int NV = 64 / FVW::N;
        for (; d0 + NV * FVW::N <= hd; d0 += NV * FVW::N) accumulate_pass<FVW, NV>(acc, alpha, p, v, vstride, n, d0);
        for (; d0 + FVW::N <= hd; d0 += FVW::N) accumulate_pass<FVW, 1>(acc, alpha, p, v, vstride, n, d0);
        for (; d0 + vm::F8::N <= hd; d0 += vm::F8::N) accumulate_pass<vm::F8, 1>(acc, alpha, p, v, vstride, n, d0);
    }
#endif
    for (; d0 < hd; ++d0) accumulate_pass<FV1, 1>(acc, alpha, p, v, vstride, n, d0);
}

// The cells of one sequence as its rows read them (common/attn_span.h): its position i
// is the shared prefix's cell p0 + i below n0, its own cell own + i from there.
struct SeqCells {
    int64_t p0 = 0, n0 = 0, own = 0;
    int64_t cell(int64_t i) const { return i < n0 ? p0 + i : own + i; }
    bool operator==(const SeqCells& o) const { return p0 == o.p0 && n0 == o.n0 && own == o.own; }
};

// A query row and the positions [lo, hi) of its sequence it sees.
struct Row {
    const float* q;
    float* out;
    int64_t lo, hi;
};

// rows [c0, c1) of KV head g (f16, row stride kvs) -> dst [c1 - c0][hd] f32. Exact, so
// attention over f16 K/V is the f32 computation on the rounded values. Each row also
// asks for the same row of the next block (below c_end) into L2: decode at depth reads
// the whole cache from DRAM every token, and waited on it row by row (at 4096 cells,
// attention's thread-time 18.0 / 17.6 / 18.1 -> 10.0 / 10.0 / 9.4 ms a token on a Zen 4,
// the default model; a whole block's requests at once, before it, changed nothing:
// they overran the outstanding-miss slots).
void widen_block(const half* src, int64_t kvs, int64_t c0, int64_t c1, int64_t hd, float* dst, int64_t c_end) {
    for (int64_t c = c0; c < c1; ++c) {
        const half* s = src + c * kvs;
        float* d = dst + (c - c0) * hd;
        if (c + BK < c_end)
            for (int64_t o = 0; o < hd * 2; o += 64) __builtin_prefetch((const char*)(s + BK * kvs) + o, 0, 2);
        int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
        for (; i + 8 <= hd; i += 8) _mm256_storeu_ps(d + i, simd::load8_f16(s + i));
#endif
        for (; i < hd; ++i) d[i] = simd::f16_to_f32(s[i]);
    }
}

// Positions [pa, pb) of sequence sc's K or V (KV head g) -> dst [pb - pa][hd] f32, piece
// by piece of contiguous cells: widened from f16 (exact; each row asks for its segment's
// row a block on, below position `last`), or copied from f32 (where they straddle the
// prefix's end; run_item reads them in place otherwise).
void load_positions(const AttnArgs& a, const void* region, int64_t g, const SeqCells& sc, int64_t pa, int64_t pb,
                    int64_t last, float* dst) {
    const int64_t hd = a.hd, kvs = a.nkv * hd;
    while (pa < pb) {
        const int64_t end = pa < sc.n0 ? std::min(pb, sc.n0) : pb;  // within one segment
        const int64_t c = sc.cell(pa), n = end - pa;
        const int64_t seg_end = pa < sc.n0 ? sc.p0 + std::min(sc.n0, last) : sc.own + last;
        if (a.kv_type == T_F16) {
            widen_block((const half*)region + g * hd, kvs, c, c + n, hd, dst, seg_end);
        } else {
            for (int64_t r = 0; r < n; ++r)
                std::memcpy(dst + r * hd, (const float*)region + (c + r) * kvs + g * hd, hd * sizeof(float));
        }
        dst += n * hd;
        pa = end;
    }
}

// One work item: rows are (token, head) pairs of one sequence that all read KV head g.
// Blocks of BK positions are counted from the sequence's first position, not from cell
// 0, so a row's bits depend on its own data and positions only: not on where its cells
// lie in the arena, nor on whether its prefix is read in place or held in its own cells.
void run_item(const AttnArgs& a, int64_t g, const SeqCells& sc, const Row* rows, int64_t nrows, float* scratch,
              bool simd) {
    const int64_t hd = a.hd;
    const int64_t hdp = round8(hd);
    float* m = scratch;               // running max per row
    float* l = m + nrows;             // running sum per row
    float* acc = scratch + round8(2 * nrows);  // [nrows][hdp]
    float* S = acc + nrows * hdp;     // [nrows][BK] scores, then probabilities
    float* kbuf = S + nrows * BK;     // a block's K and V rows in f32 where they are not read in place
    float* vbuf = kbuf + BK * hd;
    int64_t lmin = std::numeric_limits<int64_t>::max(), lmax = 0;
    for (int64_t i = 0; i < nrows; ++i) {
        m[i] = -std::numeric_limits<float>::infinity();
        l[i] = 0.0f;
        std::memset(acc + i * hdp, 0, hd * sizeof(float));
        if (rows[i].lo < rows[i].hi) {
            lmin = std::min(lmin, rows[i].lo);
            lmax = std::max(lmax, rows[i].hi);
        }
    }
    for (int64_t c0 = lmin / BK * BK; c0 < lmax; c0 += BK) {
        const int64_t c1 = std::min(c0 + BK, lmax);
        // Position c's K row at kb + (c - w0) * ks (V likewise): f32 rows of one segment in
        // place, the others widened or copied into the buffers.
        const int64_t w0 = std::max(c0, lmin);
        const float *kb = kbuf, *vb = vbuf;
        int64_t ks = hd;
        if (a.kv_type != T_F16 && (w0 >= sc.n0 || c1 <= sc.n0)) {
            ks = a.nkv * hd;
            kb = (const float*)a.k + sc.cell(w0) * ks + g * hd;
            vb = (const float*)a.v + sc.cell(w0) * ks + g * hd;
        } else {
            load_positions(a, a.k, g, sc, w0, c1, lmax, kbuf);
            load_positions(a, a.v, g, sc, w0, c1, lmax, vbuf);
        }
        // Scores, four query rows per pass so each K row is read once per four rows.
        for (int64_t i = 0; i < nrows; i += 4) {
            const int64_t nj = std::min<int64_t>(4, nrows - i);
            const float* qp[4];
            int64_t a0 = c1, b0 = c0;
            for (int64_t j = 0; j < 4; ++j) {
                const Row& rw = rows[i + std::min(j, nj - 1)];  // pad with the last real row
                qp[j] = rw.q;
                if (j < nj && rw.lo < rw.hi) {
                    a0 = std::min(a0, std::max(rw.lo, c0));
                    b0 = std::max(b0, std::min(rw.hi, c1));
                }
            }
            // Dots land cell-major in a small buffer, then get transposed into the score
            // rows: four scattered scalar stores per cell stalled the dot loop.
            alignas(16) float T[BK][4];
            int64_t c = a0;
#ifdef MINFER_VEC_AVX2
            if (simd)
                for (; c + 2 <= b0; c += 2)
                    dot4x2_avx2(qp, kb + (c - w0) * ks, kb + (c + 1 - w0) * ks, hd, T[c - c0], T[c + 1 - c0]);
#endif
            for (; c < b0; ++c) dot4(qp, kb + (c - w0) * ks, hd, simd, T[c - c0]);
            for (int64_t j = 0; j < nj; ++j) {
                float* Sr = S + (i + j) * BK;
                for (int64_t c = a0; c < b0; ++c) Sr[c - c0] = T[c - c0][j] * a.scale;
                if (a.softcap > 0.0f) {  // Gemma 2: softcap * tanh(s / softcap), per score
                    const float inv = 1.0f / a.softcap;
                    for (int64_t c = a0; c < b0; ++c) Sr[c - c0] = a.softcap * std::tanh(Sr[c - c0] * inv);
                }
            }
        }
        // Online softmax update, row by row.
        for (int64_t i = 0; i < nrows; ++i) {
            const int64_t ca = std::max(rows[i].lo, c0), cb = std::min(rows[i].hi, c1);
            if (ca >= cb) continue;
            float* p = S + i * BK + (ca - c0);
            const int64_t n = cb - ca;
            float mb;
#ifdef MINFER_VEC_AVX2
            if (simd) {
                mb = max_avx2(p, n);
            } else
#endif
            {
                mb = p[0];
                for (int64_t c = 1; c < n; ++c) mb = std::max(mb, p[c]);
            }
            const float mnew = std::max(m[i], mb);
            const float alpha = m[i] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[i] - mnew);
            const float ps = exp_sub_sum(p, n, mnew, simd);
            l[i] = l[i] * alpha + ps;
            m[i] = mnew;
            accumulate(acc + i * hdp, alpha, p, vb + (ca - w0) * ks, ks, n, hd, simd);
        }
    }
    for (int64_t i = 0; i < nrows; ++i) {
        float* o = rows[i].out;
        if (l[i] > 0.0f) {
            const float inv = 1.0f / l[i];
            for (int64_t d = 0; d < hd; ++d) o[d] = acc[i * hdp + d] * inv;
        } else {
            std::memset(o, 0, hd * sizeof(float));  // nothing visible: defined as zeros
        }
    }
}

}  // namespace

size_t attention_scratch_floats(const AttnArgs& a) {
    if (a.nkv <= 0 || a.nh <= 0 || a.hd <= 0) return 0;
    const Tiling t = tiling(a);
    return (size_t)(round8(2 * t.rows_max) + t.rows_max * (round8(a.hd) + BK)) + (size_t)(2 * BK * a.hd);
}

void attention_f32(const AttnArgs& a, float* scratch, int ith, int nth, std::atomic<uint64_t>* next) {
    if (a.nt <= 0 || a.nkv <= 0) return;
    const Tiling t = tiling(a);
    // When token blocks x KV heads cannot keep every thread busy (decode with few KV
    // heads), also split each group's query heads. Rows stay bit-identical (see top).
    const int64_t base_items = t.nqb * a.nkv;
    const int64_t hs = base_items >= nth ? 1 : std::min<int64_t>(t.r, (nth + base_items - 1) / base_items);
    const int64_t hc = (t.r + hs - 1) / hs;
    const int64_t n_items = base_items * hs;
    const bool simd = use_simd();
    Row rows[1024];
    // Causal prefill items differ in cost by the token block (block qb sees ~qb * bq
    // cells), and a static round robin of them over 16 threads left the busiest thread
    // ~10% above the mean for 512 tokens (114 items with 2 KV heads) and ~50% for 128
    // (30 items), by a cost model of visible cells. From the shared counter, threads
    // take items from the last token block down: heavy ones first, light ones fill the
    // gaps (~1.5% and ~5% above the mean), and a thread that lost its CPU for a while
    // just takes fewer. Every (token, head) row is computed the same whoever takes it
    // (see top), so the order changes no bit.
    for (int64_t k = next ? (int64_t)next->fetch_add(1, std::memory_order_relaxed) : ith; k < n_items;
         k = next ? (int64_t)next->fetch_add(1, std::memory_order_relaxed) : k + nth) {
        const int64_t it = next ? n_items - 1 - k : k;
        const int64_t hsub = it % hs;
        const int64_t g = (it / hs) % a.nkv;
        const int64_t qb = it / (hs * a.nkv);
        const int64_t t0 = qb * t.bq, t1 = std::min(a.nt, t0 + t.bq);
        const int64_t h0 = g * t.r + hsub * hc, h1 = std::min(g * t.r + t.r, h0 + hc);
        if (h0 >= h1) continue;
        int64_t nrows = 0;
        SeqCells sc;
        for (int64_t tk = t0; tk < t1; ++tk) {
            // The token's sequence (its cells) and the positions [lo, hi) of it it sees.
            SeqCells tc;
            int64_t hi;
            if (a.span) {
                const int32_t* sp = a.span + kSpanInts * tk;
                tc.p0 = sp[2];
                tc.n0 = std::max<int64_t>(sp[3] - sp[2], 0);
                tc.own = sp[0] - tc.n0;
                hi = tc.n0 + std::max<int64_t>(sp[1] - sp[0], 0);
            } else {
                hi = (int64_t)a.pos[tk] + 1;
            }
            const int64_t lo = a.window > 0 ? std::max<int64_t>(0, hi - a.window) : 0;  // the last `window`
            if (nrows && !(tc == sc)) {  // an item's rows share one sequence's cells
                run_item(a, g, sc, rows, nrows, scratch, simd);
                nrows = 0;
            }
            sc = tc;
            for (int64_t h = h0; h < h1; ++h) {
                Row& rw = rows[nrows];
                rw.q = a.q + tk * a.q_stride + h * a.hd;
                rw.out = a.out + (tk * a.nh + h) * a.hd;
                rw.lo = lo;
                rw.hi = hi;
                if (++nrows == 1024) {  // very wide groups: flush early, rows are independent
                    run_item(a, g, sc, rows, nrows, scratch, simd);
                    nrows = 0;
                }
            }
        }
        if (nrows) run_item(a, g, sc, rows, nrows, scratch, simd);
    }
}

}  // namespace minfer::cpu
