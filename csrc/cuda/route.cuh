// The router's picks and weights for one token (MOE_TOPK and MOE_WEIGHTS, cpu/moe.cpp's
// semantics), by one warp: shared by the router kernel (k_moe.cu) and the router matvec
// whose last block routes (k_matvec.cu), so the two give the same bits.
#pragma once
#include <cstdint>

#include "cuda/kernels.h"

namespace minfer::cuda {

struct RouteArgs {
    const float* logits;  // [nt][n_expert]
    int32_t* ids;         // [nt][k] or null
    float* w;             // [nt][k] or null
    int n_expert, k, nt, gating, norm;
    float scale;
};

// cpu/moe.cpp's ranking: NaN below every number, so a broken router still picks k
// distinct ids. Order: the larger key first, equal keys by the lower id.
__device__ __forceinline__ float rank_key(float v) { return isnan(v) ? -INFINITY : v; }
__device__ __forceinline__ bool ranks_before(float ka, int ia, float kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

// gating 1's softmax statistics over a token's logits (the max, NaN skipped as std::max
// keeps it, and the sum of exp(x - max)): lane l adds its share l, l + 32, ... (at(i) is
// its i-th, n_expert <= 32 * NPL) in order, then a butterfly. Every lane gets both.
template <int NPL, class At>
__device__ __forceinline__ void route_stats(At&& at, int n, int lane, float& mx, float& sum) {
    constexpr unsigned kFull = 0xffffffffu;
    mx = -INFINITY;
    sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NPL; ++i)
        if (lane + 32 * i < n) mx = fmaxf(mx, at(i));
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
#pragma unroll
    for (int i = 0; i < NPL; ++i)
        if (lane + 32 * i < n) sum = __fadd_rn(sum, expf(__fsub_rn(at(i), mx)));
    for (int o = 16; o > 0; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(kFull, sum, o));
}

// Lane j < k holds slot j's pick (id, its logit vb): its weight, the sums that finish the
// weights (gating 3's softmax over the picks, norm) in slot order as the CPU's do, and
// the stores. The whole warp calls it.
__device__ __forceinline__ void route_store(const RouteArgs& a, int64_t t, int lane, int id, float vb, float mx,
                                            float sum) {
    constexpr unsigned kFull = 0xffffffffu;
    const int k = a.k;
    float w = a.gating == 1 ? expf(__fsub_rn(vb, mx)) / sum
              : a.gating == 2 ? 1.0f / (1.0f + expf(-vb))
                              : vb;  // gating 3: the logit, finished below
    if (a.w) {
        if (a.gating == 3) {  // softmax over the picked logits, in slot order
            float m = lane < k ? w : -INFINITY;
            for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
            const float e = lane < k ? expf(__fsub_rn(w, m)) : 0.0f;
            float s = 0.0f;
            for (int j = 0; j < k; ++j) s = __fadd_rn(s, __shfl_sync(kFull, e, j));
            w = e / s;
        }
        if (a.norm) {
            float s = 0.0f;
            for (int j = 0; j < k; ++j) s = __fadd_rn(s, __shfl_sync(kFull, w, j));
            constexpr float kMin = 6.103515625e-5f;  // llama.cpp's clamp: the smallest normal f16
            s = s < kMin ? kMin : s;                  // as std::max(s, kMin): a NaN sum stays NaN
            w = w / s;
        }
        if (a.scale != 0.0f && a.scale != 1.0f) w = __fmul_rn(w, a.scale);
    }
    if (lane < k) {
        if (a.ids) a.ids[t * k + lane] = id;
        if (a.w) a.w[t * k + lane] = w;
    }
}

// Token t's route by one warp. Each lane holds logits lane, lane + 32, ... in registers
// (NPL of them: n_expert <= 32 * NPL). Pick j is the best (rank order) of the logits
// ranked after pick j - 1: a lane's best of its share, then a butterfly that keeps the
// better of two (a strict total order, so every lane ends with the same pick). These are
// exactly the CPU's insertion selection's k ids, in its order; lane j keeps slot j
// (k <= 32). The logits are read through L2: the fused launch's other blocks wrote them.
template <int NPL>
__device__ __forceinline__ void route_token(const RouteArgs& a, int64_t t, int lane) {
    constexpr unsigned kFull = 0xffffffffu;
    constexpr int kNone = 0x7fffffff;
    const int n = a.n_expert, k = a.k;
    const float* x = a.logits + t * n;
    float v[NPL];
#pragma unroll
    for (int i = 0; i < NPL; ++i) v[i] = lane + 32 * i < n ? __ldcg(x + lane + 32 * i) : 0.0f;
    float mx = -INFINITY, sum = 0.0f;
    if (a.w && a.gating == 1) route_stats<NPL>([&](int i) { return v[i]; }, n, lane, mx, sum);
    float pk = INFINITY;  // the previous pick's key and id: (+inf, -1) ranks before everything
    int pi = -1, my_id = 0;
    float my_v = 0.0f;
    for (int j = 0; j < k; ++j) {
        float bk = 0.0f;
        int bi = kNone;
#pragma unroll
        for (int i = 0; i < NPL; ++i) {
            const int e = lane + 32 * i;
            const float ke = rank_key(v[i]);
            if (e < n && ranks_before(pk, pi, ke, e) && (bi == kNone || ranks_before(ke, e, bk, bi))) {
                bk = ke;
                bi = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ok = __shfl_xor_sync(kFull, bk, o);
            const int oi = __shfl_xor_sync(kFull, bi, o);
            if (oi != kNone && (bi == kNone || ranks_before(ok, oi, bk, bi))) {
                bk = ok;
                bi = oi;
            }
        }
        pk = bk;
        pi = bi;  // k <= n_expert: there is always one
        float own = 0.0f;  // the pick's logit, from the lane that holds it
#pragma unroll
        for (int i = 0; i < NPL; ++i)
            if (i == bi >> 5) own = v[i];
        const float vb = __shfl_sync(kFull, own, bi & 31);
        if (lane == j) {
            my_id = bi;
            my_v = vb;
        }
    }
    route_store(a, t, lane, my_id, my_v, mx, sum);
}

// One token's route by a whole block (nw warps, n_expert <= min(32 * NPL, kRouteBlockMax)):
// the logits in shared memory, each expert's rank (how many rank before it) counted by
// a thread of its own, the experts of rank j < k are pick j (the same picks as
// route_token's, the order being strict), then warp 0 finishes as route_token does.
constexpr int kRouteBlockMax = 256;
template <int NPL>
__device__ __forceinline__ void route_token_block(const RouteArgs& a, int64_t t) {
    __shared__ float s_x[kRouteBlockMax];
    __shared__ int s_pick[kRouteMaxK];
    const int n = a.n_expert, k = a.k, lane = threadIdx.x & 31;
    for (int e = threadIdx.x; e < n; e += blockDim.x) s_x[e] = __ldcg(a.logits + t * n + e);
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        const float ke = rank_key(s_x[e]);
        int before = 0;
        for (int q = 0; q < n; ++q) before += ranks_before(rank_key(s_x[q]), q, ke, e) ? 1 : 0;
        if (before < k) s_pick[before] = e;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float mx = -INFINITY, sum = 0.0f;
        if (a.w && a.gating == 1) route_stats<NPL>([&](int i) { return s_x[lane + 32 * i]; }, n, lane, mx, sum);
        const int id = lane < k ? s_pick[lane] : 0;
        route_store(a, t, lane, id, lane < k ? s_x[id] : 0.0f, mx, sum);
    }
    __syncthreads();
}

// The route_token instantiation for n_expert logits (n_expert <= kRouteMaxExperts):
// f.template operator()<NPL>().
template <class Fn>
__host__ inline void dispatch_route(int n_expert, Fn&& f) {
    if (n_expert <= 32) f.template operator()<1>();
    else if (n_expert <= 64) f.template operator()<2>();
    else if (n_expert <= 128) f.template operator()<4>();
    else if (n_expert <= 256) f.template operator()<8>();
    else if (n_expert <= 512) f.template operator()<16>();
    else f.template operator()<32>();
}

}  // namespace minfer::cuda
