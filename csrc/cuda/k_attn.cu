// GQA attention over the f16 K/V regions with an online softmax, f32 accumulation.
//
// One block per (token, head, split) of the context. Its warps take 32-cell groups in
// turn; within a warp each lane scores one KV cell of a group (a whole-row dot product,
// q broadcast from shared memory), the group's max and sum are warp butterflies (every
// lane ends with the same bits), and then each lane accumulates its own slice of head
// dims over the group's cells in cell order. The warps merge in shared memory, in warp
// order. The splits (a number fixed by the cells one sequence may span, so a captured
// graph serves every position) run in one launch. A row's splits are cut from its own
// first cell, in chunks fixed by that span alone: where its cells lie in the arena and how
// many sequences share it change nothing, so a sequence batched with others gets the
// bits it gets alone. Each split holding cells stores its partial (max, sum, acc),
// fences, and takes an integer ticket for its (token, head); the block that takes the
// last ticket merges the splits in split order (whichever block that is) and resets the
// ticket for the next launch; a row whose cells fit one split writes its output itself.
// With head dims up to 64 a warp's first group's K and V loads go out with q's
// (LoadedGroup). Nothing depends on timing: the same inputs give the same bits. A
// sliding window only narrows a row's cells (so fewer splits hold any); a soft-cap maps
// each scaled score before the softmax, as the CPU does.
#include <cuda_fp16.h>

#include <cmath>
#include <cstdlib>

#include "common/attn_span.h"
#include "cuda/context.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/quant.cuh"
#include "cuda/timeline.cuh"

namespace minfer::cuda {

namespace tl {
TL_BIND(bind_attn)
}

namespace {

constexpr int WARPS = 4;

// A row's cells as one sequence (common/attn_span.h): index i is the shared prefix's
// cell p0 + i below n0, the row's own cell own + i from there (own = own lo - n0). A row
// without a prefix reads the cells it always did, in the same order: the same bits, and
// a prefix read in place gives the bits of the same cells copied in front of the own.
struct CellMap {
    int64_t p0, n0, own;
    __device__ __forceinline__ int64_t operator()(int64_t i) const { return i < n0 ? p0 + i : own + i; }
};

// One redux.sync on sm_80+ (five shuffle rounds before) over the floats' bits mapped to
// signed integers in the floats' order: the same maximum as the fmaxf butterfly (a +0 /
// -0 tie aside, which gives the same softmax), except that a NaN score now wins the max
// and so turns the whole row NaN rather than only its own cell's weight.
__device__ __forceinline__ float warp_max(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const int b = __float_as_int(v);
    const int m = __reduce_max_sync(0xffffffffu, b >= 0 ? b : b ^ 0x7fffffff);
    return __int_as_float(m >= 0 ? m : m ^ 0x7fffffff);
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A lane's EPL consecutive head dims of one V row, in one load (EPL halves are 2, 4,
// 8 or 16 bytes, aligned as the row and the lane's offset are); head dim 96's three
// halves (6 bytes, 2-byte aligned) in three.
template <int EPL> struct VSlice;
template <> struct VSlice<1> {
    __half h;
    __device__ __forceinline__ void load(const __half* p) { h = *p; }
    __device__ __forceinline__ float at(int) const { return __half2float(h); }
};
template <> struct VSlice<2> {
    __half2 h;
    __device__ __forceinline__ void load(const __half* p) { h = *reinterpret_cast<const __half2*>(p); }
    __device__ __forceinline__ float at(int j) const { return j == 0 ? __low2float(h) : __high2float(h); }
};
template <> struct VSlice<3> {
    __half h[3];
    __device__ __forceinline__ void load(const __half* p) {
        h[0] = p[0];
        h[1] = p[1];
        h[2] = p[2];
    }
    __device__ __forceinline__ float at(int j) const { return __half2float(h[j]); }
};
template <> struct VSlice<4> {
    uint2 u;
    __device__ __forceinline__ void load(const __half* p) { u = *reinterpret_cast<const uint2*>(p); }
    __device__ __forceinline__ float at(int j) const {
        const __half2 h = *reinterpret_cast<const __half2*>(j < 2 ? &u.x : &u.y);
        return (j & 1) ? __high2float(h) : __low2float(h);
    }
};
template <> struct VSlice<8> {
    uint4 u;
    __device__ __forceinline__ void load(const __half* p) { u = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ float at(int j) const {
        const unsigned w = j < 2 ? u.x : j < 4 ? u.y : j < 6 ? u.z : u.w;
        const __half2 h = *reinterpret_cast<const __half2*>(&w);
        return (j & 1) ? __high2float(h) : __low2float(h);
    }
};

// Merge the partials of splits 0 .. n - 1 (those with cells) of one (token, head):
// out[d] for the lane's dims. Lane k takes splits k, k + 32, ... for the max and the
// softmax sum (each a fixed butterfly), then every lane adds the splits' weighted sums
// for its dims in split order. The partials are read through L2 (__ldcg): other SMs
// wrote them during this launch, and this SM's L1 may hold older lines of the scratch.
template <int HD>
__device__ __forceinline__ void merge_chunks(const float* pp, int n, int lane, float* __restrict__ out) {
    constexpr int EPL = HD / 32, ST = HD + 2;
    float M = -INFINITY;
    for (int s = lane; s < n; s += 32)
        if (__ldcg(pp + s * ST + 1) > 0.0f) M = fmaxf(M, __ldcg(pp + s * ST));
    M = warp_max(M);
    float L = 0.0f;
    for (int s = lane; s < n; s += 32) {
        const float l = __ldcg(pp + s * ST + 1);
        if (l > 0.0f) L += l * expf(__ldcg(pp + s * ST) - M);
    }
    L = warp_sum(L);
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    float o[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) o[j] = 0.0f;
    for (int s0 = 0; s0 < n; s0 += 32) {
        // This lane's split's weight (0 for none, or no mass), then each split in order.
        const int mine = s0 + lane;
        float f = 0.0f;
        bool has = false;
        if (mine < n) {
            has = __ldcg(pp + mine * ST + 1) > 0.0f;
            if (has) f = expf(__ldcg(pp + mine * ST) - M);
        }
        const unsigned live = __ballot_sync(0xffffffffu, has);
        const int cnt = n - s0 < 32 ? n - s0 : 32;
        for (int k = 0; k < cnt; ++k) {
            const float fk = __shfl_sync(0xffffffffu, f, k);
            if (!((live >> k) & 1u)) continue;
            const float* a = pp + (s0 + k) * ST + 2 + lane * EPL;
#pragma unroll
            for (int j = 0; j < EPL; ++j) o[j] += __ldcg(a + j) * fk;
        }
    }
#pragma unroll
    for (int j = 0; j < EPL; ++j) out[lane * EPL + j] = o[j] * inv;
}

// Block b of the int8 copy of the (token, head) output row at off: a token's row of
// nh * HD values is one column of the next matvec's input (in its chunk order, quant.cuh).
template <int HD>
__device__ __forceinline__ void quant_out_block(const AttnDev& a, int64_t off, int b, float v, int lane) {
    const int in_dim = (int)(a.nh * HD);
    const int64_t t = off / in_dim;
    quant_block_q8(v, lane, a.q_out + t * in_dim, (int)(off - t * in_dim) + 32 * b, in_dim, a.ds_out + off / 32 + b);
}

// The int8 copy of one (token, head) output row the warp has just written (a head is
// whole 32-element blocks), as k_quant_q8 would make it.
template <int HD>
__device__ __forceinline__ void quant_head(const AttnDev& a, int64_t off, int lane) {
    if (!a.q_out) return;
    __syncwarp();
#pragma unroll
    for (int b = 0; b < HD / 32; ++b) quant_out_block<HD>(a, off, b, a.out[off + 32 * b + lane], lane);
}

// One cell's score: q (shared memory) against its K row k (global memory, or registers
// loaded ahead), in dim order, scaled; with CAP (Gemma 2's soft-capped layers, a kernel
// of their own so the others keep their registers) then cap * tanh(s * (1 / cap)), as
// the CPU computes it.
template <int HD, bool CAP>
__device__ __forceinline__ float cell_score(const float* qs, const uint4* k, float scale, float cap) {
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) {
        const uint4 u = k[i];
        const __half2* hh = reinterpret_cast<const __half2*>(&u);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __half22float2(hh[j]);
            dot = fmaf(qs[8 * i + 2 * j], f.x, dot);
            dot = fmaf(qs[8 * i + 2 * j + 1], f.y, dot);
        }
    }
    const float s = dot * scale;
    if constexpr (CAP) return __fmul_rn(cap, tanhf(__fmul_rn(s, __frcp_rn(cap))));
    return s;
}

// A group's scores into the warp's online softmax state (m, l, acc rescaled): the
// group's max and sum are butterflies; returns this lane's cell's weight.
template <int EPL>
__device__ __forceinline__ float group_softmax(float s, bool valid, float& m, float& l, float acc[EPL]) {
    const float m_new = fmaxf(m, warp_max(s));
    const float p = valid ? expf(s - m_new) : 0.0f;
    const float corr = expf(m - m_new);
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int j = 0; j < EPL; ++j) acc[j] *= corr;
    m = m_new;
    return p;
}

// One group of up to 32 cells [base, min(base + 32, c1)) into a warp's online softmax
// state: each lane scores one cell (a whole-row dot product, q from shared memory), the
// group's max and sum are butterflies, then each lane adds the cells' V slices for its
// dims in cell order.
template <int HD, bool CAP>
__device__ __forceinline__ void attend_group(const float* qs, const __half* K, const __half* V, int64_t kvs,
                                             const CellMap& cm, float scale, float cap, int64_t base, int64_t c1,
                                             int lane, float& m, float& l, float acc[HD / 32]) {
    constexpr int EPL = HD / 32;
    const int64_t c = base + lane;
    const bool valid = c < c1;
    const float s =
        valid ? cell_score<HD, CAP>(qs, reinterpret_cast<const uint4*>(K + cm(c) * kvs), scale, cap) : -INFINITY;
    const float p = group_softmax<EPL>(s, valid, m, l, acc);
    const int nvalid = (int)((c1 - base) < 32 ? (c1 - base) : 32);
    // VB cells' V slices (32 registers; 16 cells of three halves for head dim 96) are
    // loaded before any is used, so their latencies overlap; the sums still take the
    // cells in order.
    constexpr int VB = EPL <= 2 ? 32 : EPL == 3 ? 16 : 128 / EPL;
#pragma unroll
    for (int i0 = 0; i0 < 32; i0 += VB) {
        if (i0 >= nvalid) break;
        VSlice<EPL> vs[VB];
#pragma unroll
        for (int k = 0; k < VB; ++k)
            if (i0 + k < nvalid) vs[k].load(V + cm(base + i0 + k) * kvs);
#pragma unroll
        for (int k = 0; k < VB; ++k) {
            const float pi = __shfl_sync(0xffffffffu, p, i0 + k);
            if (i0 + k < nvalid) {
#pragma unroll
                for (int j = 0; j < EPL; ++j) acc[j] = fmaf(pi, vs[k].at(j), acc[j]);
            }
        }
    }
}

// A warp's first group with its loads already issued (head dims <= 64, where a group's
// K row and V slices fit in registers): the loads go out with q's, before q is in shared
// memory, so the three come back in one round trip instead of three. The arithmetic is
// attend_group's, in its order: the same bits.
template <int HD>
struct LoadedGroup {
    static constexpr int EPL = HD / 32;
    uint4 k[HD / 8];
    VSlice<EPL> v[32];
    int nvalid;
    bool valid;
    __device__ __forceinline__ void load(const __half* K, const __half* V, int64_t kvs, const CellMap& cm,
                                         int64_t base, int64_t c1, int lane) {
        const int64_t c = base + lane;
        valid = c < c1;
        nvalid = (int)((c1 - base) < 32 ? (c1 - base) : 32);
        if (valid) {
            const uint4* kr = reinterpret_cast<const uint4*>(K + cm(c) * kvs);
#pragma unroll
            for (int i = 0; i < HD / 8; ++i) k[i] = kr[i];
        }
#pragma unroll
        for (int i = 0; i < 32; ++i)
            if (i < nvalid) v[i].load(V + cm(base + i) * kvs);
    }
    template <bool CAP>
    __device__ __forceinline__ void attend(const float* qs, float scale, float cap, int lane, float& m, float& l,
                                           float acc[EPL]) const {
        const float s = valid ? cell_score<HD, CAP>(qs, k, scale, cap) : -INFINITY;
        const float p = group_softmax<EPL>(s, valid, m, l, acc);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const float pi = __shfl_sync(0xffffffffu, p, i);
            if (i < nvalid) {
#pragma unroll
                for (int j = 0; j < EPL; ++j) acc[j] = fmaf(pi, v[i].at(j), acc[j]);
            }
        }
    }
};

// The block's warps' attention states merged: M, the largest max among the warps that
// saw weight, then, warp by warp, the sum of weights (returned) and o[j] += the warp's
// value of dim(j) scaled alike. Warp 0 merging a split's partial (its head's dims) and
// the warps merging a one-split head 32 dims each call this.
template <int HD, int N, class Dim>
__device__ __forceinline__ float merge_warps(const float* wm, const float* wl, const float (*wacc)[HD], Dim dim,
                                             float o[N], float& M) {
    M = -INFINITY;
#pragma unroll
    for (int k = 0; k < WARPS; ++k)
        if (wl[k] > 0.0f) M = fmaxf(M, wm[k]);
    float L = 0.0f;
#pragma unroll
    for (int k = 0; k < WARPS; ++k) {
        if (!(wl[k] > 0.0f)) continue;
        const float f = expf(wm[k] - M);
        L += wl[k] * f;
#pragma unroll
        for (int j = 0; j < N; ++j) o[j] += wacc[k][dim(j)] * f;
    }
    return L;
}

// One block per (token, head, split): its WARPS warps take the split's 32-cell groups in
// turn (warp w: groups w, w + WARPS, ...), so a short context is one group per warp, all
// in flight at once; the warps' states merge in shared memory in warp order. CAP: the
// scores are soft-capped (a.softcap > 0).
template <int HD, bool CAP>
__global__ void __launch_bounds__(WARPS * 32) k_attn(AttnDev a, int n_splits, int chunk, float* __restrict__ part,
                                                     int* __restrict__ ticket, int* err) {
    TL_BEGIN(tl::ATTN);
    pdl_trigger();
    constexpr int EPL = HD / 32;  // head dims per lane
    __shared__ float qs[HD];
    __shared__ float wm[WARPS], wl[WARPS];
    __shared__ float wacc[WARPS][HD];
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t pair = blockIdx.x;
    const int64_t t = pair / a.nh, h = pair % a.nh;
    const int64_t kvh = h / (a.nh / a.nkv);
    const int split = blockIdx.y;

    // Positions and spans are inputs (written before the run, never by a kernel), so the
    // cells this block reads are known before the kernel before it has finished.
    int64_t lo[2] = {0, 0}, hi[2] = {0, 0};
    if (a.span) {
        const int32_t* sp = a.span + kSpanInts * t;
        if (!span_ok(sp, a.n_ctx)) {
            if (threadIdx.x == 0) *err = 4;
        } else {
            lo[1] = sp[0];
            hi[1] = sp[1];
            lo[0] = sp[2];
            hi[0] = sp[3];
        }
    } else {
        const int64_t p = a.pos[t];
        if (p < 0 || p >= a.n_ctx) {
            if (threadIdx.x == 0) *err = 4;
        } else {
            hi[1] = p + 1;
        }
    }
    attn_window(lo, hi, a.window);  // a sliding-window layer
    const int64_t n0 = hi[0] > lo[0] ? hi[0] - lo[0] : 0;
    const int64_t n = n0 + (hi[1] > lo[1] ? hi[1] - lo[1] : 0);
    const CellMap cm{lo[0], n0, lo[1] - n0};
    // Splits holding cells of the row's n, cut from its first: 0 .. s_hi - 1 (the last
    // one takes any rest past n_splits chunks, which a span of at most seq_ctx cells
    // never has). Only those publish a partial and draw a ticket; with no cells, split 0
    // writes the zeros.
    const int64_t need = n > 0 ? (n + chunk - 1) / chunk : 1;
    const int s_hi = need < n_splits ? (int)need : n_splits;
    if (split >= s_hi) return;
    const int64_t c0 = (int64_t)split * chunk;
    const int64_t c1 = split == s_hi - 1 ? n : c0 + chunk;
    const int64_t kvs = a.nkv * HD;
    // Those cells' K and V rows into L2 while the kernel before finishes (the weights
    // streamed since the last step have evicted them). The newest cell, which that kernel
    // writes, is read only after the wait; a prefetch has no effect on what is read.
    for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const __half* kr = reinterpret_cast<const __half*>(a.k) + cm(c) * kvs + kvh * HD;
        const __half* vr = reinterpret_cast<const __half*>(a.v) + cm(c) * kvs + kvh * HD;
#pragma unroll
        for (int o = 0; o < HD; o += 64) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(kr + o));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(vr + o));
        }
    }
    TL_MARK(1);
    pdl_wait();
    TL_MARK(2);
    const __half* K = reinterpret_cast<const __half*>(a.k) + kvh * HD;
    const __half* V = reinterpret_cast<const __half*>(a.v) + kvh * HD + lane * EPL;
    float m = -INFINITY, l = 0.0f;
    float acc[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) acc[j] = 0.0f;
    int64_t base = c0 + 32 * w;
    const float* q = a.q + t * a.q_stride + h * HD;
    if constexpr (HD <= 64) {
        // q's load goes out first (HD <= blockDim.x here), then the warp's first group's
        // K and V loads: one round trip instead of three. (The group's loads before q's,
        // or all of them after q is in shared memory, measured slower: H200 0.5B tg128
        // 1,505 / 1,546 / 1,536 against 1,438 / 1,507 / 1,501 with the latter.)
        LoadedGroup<HD> g;
        const bool qfirst = (int)threadIdx.x < HD;
        const float qv = qfirst ? q[threadIdx.x] : 0.0f;
        if (base < c1) g.load(K, V, kvs, cm, base, c1, lane);
        if (qfirst) qs[threadIdx.x] = qv;
        TL_MARK(3);
        __syncthreads();
        TL_MARK(4);
        if (base < c1) g.template attend<CAP>(qs, a.scale, a.softcap, lane, m, l, acc);
        TL_MARK(5);
        base += 32 * WARPS;
    } else {
        for (int d = threadIdx.x; d < HD; d += blockDim.x) qs[d] = q[d];
        __syncthreads();
    }
    for (; base < c1; base += 32 * WARPS)
        attend_group<HD, CAP>(qs, K, V, kvs, cm, a.scale, a.softcap, base, c1, lane, m, l, acc);
    TL_MARK(6);

    if (lane == 0) {
        wm[w] = m;
        wl[w] = l;
    }
#pragma unroll
    for (int j = 0; j < EPL; ++j) wacc[w][lane * EPL + j] = acc[j];
    __syncthreads();
    const int64_t off = t * a.nh * HD + h * HD;
    if (s_hi == 1) {
        // The block's warps merge the head a 32-dim block each (dim 32 b + lane) by
        // merge_warps, then store their block and make its int8 copy: the blocks'
        // reductions side by side (warp 0 alone doing them one after the other was
        // slower, 3572076).
        for (int b = w; b < HD / 32; b += WARPS) {
            const int dim = 32 * b + lane;
            float o = 0.0f, M;
            const float L = merge_warps<HD, 1>(wm, wl, wacc, [&](int) { return dim; }, &o, M);
            const float inv = L > 0.0f ? 1.0f / L : 0.0f;
            const float v = o * inv;
            a.out[off + dim] = v;
            if (w == 0) TL_MARK(8);
            if (a.q_out) quant_out_block<HD>(a, off, b, v, lane);
        }
        if (w == 0) TL_MARK(9);
        TL_END();
        return;
    }
    if (w != 0) return;
    TL_MARK(7);
    float o[EPL], M;
#pragma unroll
    for (int j = 0; j < EPL; ++j) o[j] = 0.0f;
    const float L = merge_warps<HD, EPL>(wm, wl, wacc, [&](int j) { return lane * EPL + j; }, o, M);
    float* pp = part + pair * n_splits * (HD + 2);
    float* mine = pp + split * (HD + 2);
    if (lane == 0) {
        mine[0] = M;
        mine[1] = L;
    }
#pragma unroll
    for (int j = 0; j < EPL; ++j) mine[2 + lane * EPL + j] = o[j];
    // Publish the partial before taking a ticket (threadFenceReduction's pattern):
    // whoever draws the last ticket then sees every split's stores.
    __threadfence();
    __syncwarp();
    int tk = 0;
    if (lane == 0) tk = atomicAdd(ticket + pair, 1);
    tk = __shfl_sync(0xffffffffu, tk, 0);
    if (tk != s_hi - 1) {
        TL_END();
        return;
    }
    __threadfence();
    merge_chunks<HD>(pp, s_hi, lane, a.out + off);
    quant_head<HD>(a, off, lane);
    // Every split of this pair has drawn its ticket: ready for the next launch.
    if (lane == 0) ticket[pair] = 0;
    TL_MARK(9);
    TL_END();
}

// Cells per split: whole rounds of the block's warps' 32-cell groups.
int chunk_of(int64_t n_ctx, int n_splits) {
    int64_t c = (n_ctx + n_splits - 1) / n_splits;
    return (int)((c + 32 * WARPS - 1) / (32 * WARPS) * (32 * WARPS));
}

// The cells one row may span: its sequence's context where the arena holds several.
int64_t span_cells(int64_t n_ctx, int64_t seq_ctx) { return seq_ctx > 0 && seq_ctx < n_ctx ? seq_ctx : n_ctx; }

}  // namespace

bool attn_head_dim_supported(int64_t hd) { return hd == 32 || hd == 64 || hd == 96 || hd == 128 || hd == 256; }

// Cells per decode split (whole rounds of 32 * WARPS): a warp walks its share of a split's
// groups one after another, so shorter splits mean shorter critical paths and more
// partials to merge. (Splits of 128 or 64 cells measured the same or slower: tg128 1133
// vs 1126 on the 0.5B, 293 vs 297 on the 7B, with 128.)
constexpr int kAttnChunkCells = 256;

int attn_splits(int64_t nt, int64_t n_ctx, int64_t seq_ctx) {
    if (nt > kRowExactMaxTokens) return 1;
    const int64_t c = kAttnChunkCells;
    int64_t s = (span_cells(n_ctx, seq_ctx) + c - 1) / c;
    return (int)(s < 1 ? 1 : (s > 64 ? 64 : s));
}

size_t attn_scratch_floats(int64_t nt, int64_t nh, int64_t hd, int64_t n_ctx, int64_t seq_ctx) {
    const int s = attn_splits(nt, n_ctx, seq_ctx);
    return s > 1 ? (size_t)(nt * nh * s * (hd + 2)) : 0;
}

size_t attn_tickets(int64_t nt, int64_t nh, int64_t n_ctx, int64_t seq_ctx) {
    return attn_splits(nt, n_ctx, seq_ctx) > 1 ? (size_t)(nt * nh) : 0;
}

void attention(const AttnDev& a, float* scratch, int* tickets, int* err) {
    if (attention_prefill(a, err)) return;
    const int n_splits = attn_splits(a.nt, a.n_ctx, a.seq_ctx);
    const int chunk = chunk_of(span_cells(a.n_ctx, a.seq_ctx), n_splits);
    const int64_t pairs = a.nt * a.nh;
    dim3 grid((unsigned)pairs, (unsigned)n_splits);
    const bool cap = a.softcap > 0.0f;
    switch (a.hd) {
        case 32: launch(cap ? k_attn<32, true> : k_attn<32, false>, grid, WARPS * 32, a, n_splits, chunk, scratch, tickets, err); break;
        case 64: launch(cap ? k_attn<64, true> : k_attn<64, false>, grid, WARPS * 32, a, n_splits, chunk, scratch, tickets, err); break;
        case 96: launch(cap ? k_attn<96, true> : k_attn<96, false>, grid, WARPS * 32, a, n_splits, chunk, scratch, tickets, err); break;
        case 128: launch(cap ? k_attn<128, true> : k_attn<128, false>, grid, WARPS * 32, a, n_splits, chunk, scratch, tickets, err); break;
        case 256: launch(cap ? k_attn<256, true> : k_attn<256, false>, grid, WARPS * 32, a, n_splits, chunk, scratch, tickets, err); break;
        default: throw std::invalid_argument("attention: unsupported head dim");
    }
}

}  // namespace minfer::cuda
