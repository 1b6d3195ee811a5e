// Mixture-of-experts kernels (semantics: common/plan.h and cpu/moe.cpp): SIGMOID, the
// router's top-k ids and weights (MOE_TOPK, MOE_WEIGHTS), the weighted sum of the
// experts' rows (MOE_SUM), and MATMUL_ID for blocks of more than kRowExactMaxTokens
// tokens. Decode-sized MATMUL_IDs run the expert matvec in k_matvec.cu (matvec_id).
//
// The prefill MATMUL_ID never reads the expert ids on the host (they are written by
// MOE_TOPK in the same plan, maybe inside a captured graph): a grouping launch sorts the
// (token, slot) rows by expert on the device (counts, starts and a permutation, stable in
// slot order), a second one cuts each expert's rows into tiles of MM_BN, and the matmul
// launch is sized for the most tiles any routing can make; its blocks past the actual
// count return at once. Each tile multiplies MM_BM rows of its expert's weights,
// dequantized to f16 in shared memory (deq32, the dense GEMM's decoding), by the tile's
// activation rows rounded to f16, on the tensor cores with f32 accumulation: the dense
// prefill GEMM's arithmetic, without reading an expert once per token.
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/context.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/quant.cuh"
#include "cuda/route.cuh"

namespace minfer::cuda {

namespace {

constexpr unsigned kFull = 0xffffffffu;

// ---- element-wise ---------------------------------------------------------------------

// cpu/moe.cpp's sigmoid_f32: split on the sign so exp() stays in (0, 1].
__global__ void k_sigmoid(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    pdl_wait();
    pdl_trigger();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i];
    const float e = expf(-fabsf(v));
    y[i] = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// y[t][i] = sum over j in order of w[t][j] * x[t * k + j][i] (products and sums rounded
// one by one, no fused multiply-add), plus resid[t][i] after the sum when set: bitwise
// MOE_SUM then ADD (float addition commutes).
__global__ void k_moe_sum(const float* __restrict__ x, const float* __restrict__ w, const float* resid, float* y,
                          int64_t d, int k, int64_t nt) {
    pdl_wait();
    pdl_trigger();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d * nt) return;
    const int64_t t = i / d, c = i - t * d;
    const float* wt = w + t * k;
    const float* xt = x + t * k * d + c;
    float s = __fmul_rn(wt[0], xt[0]);
    for (int j = 1; j < k; ++j) s = __fadd_rn(s, __fmul_rn(wt[j], xt[(int64_t)j * d]));
    // resid may be y itself (an in-place residual): read before the write, same index.
    if (resid) s = __fadd_rn(resid[i], s);
    y[i] = s;
}

// ---- the router -------------------------------------------------------------------------

constexpr int ROUTE_WARPS = 4;

// One warp per token (route.cuh).
template <int NPL>
__global__ void __launch_bounds__(ROUTE_WARPS * 32) k_moe_route(RouteArgs a) {
    pdl_wait();
    pdl_trigger();
    const int64_t t = (int64_t)blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5);
    if (t >= a.nt) return;  // the whole warp: t is the warp's
    route_token<NPL>(a, t, threadIdx.x & 31);
}

// ---- prefill MATMUL_ID: grouping ------------------------------------------------------

constexpr int MM_BM = 64;  // weight rows (outputs) per tile
constexpr int MM_BN = 64;  // (token, slot) rows per tile
constexpr int MM_BK = 64;  // elements of a row per step: two 32-element chunks
constexpr int MM_LD = MM_BK + 8;  // f16 row stride in shared memory (16-byte multiple, skewed banks)
constexpr int MM_CLD = MM_BM + 4;  // f32 stride of the result staging
constexpr int MM_THREADS = 128;
constexpr int GROUP_THREADS = 256;

// The group of a slot's id: its expert, or n_expert for an id outside [0, n_expert)
// (such a slot gets a zero row, as on the CPU; MOE_TOPK never writes one).
__device__ __forceinline__ int group_of(int32_t id, int n_expert) { return id >= 0 && id < n_expert ? id : n_expert; }

__device__ __forceinline__ int warp_isum(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

// The grouping's arrays in one scratch block (moe_group_bytes): per group (n_expert + 1)
// its row count and first position, the number of tiles, the permutation (position ->
// slot) and the tiles (group, first row within the group).
struct Groups {
    int32_t* count;
    int32_t* start;
    int32_t* n_tiles;
    int32_t* perm;
    int2* tiles;
    int64_t max_tiles;
};

inline size_t up16(size_t n) { return (n + 15) & ~(size_t)15; }

// Tiles any routing of n_slots rows over n_groups groups can make: sum of ceil(c_g / BN)
// <= n_slots / BN + (groups with a row), each at most min(n_groups, n_slots).
inline int64_t max_tiles_for(int64_t n_groups, int64_t n_slots) {
    return (n_slots + MM_BN - 1) / MM_BN + (n_groups < n_slots ? n_groups : n_slots);
}

Groups groups_at(void* scratch, int64_t n_expert, int64_t n_slots) {
    uint8_t* p = (uint8_t*)scratch;
    const int64_t ng = n_expert + 1;
    Groups g;
    g.count = (int32_t*)p;
    p += up16((size_t)ng * 4);
    g.start = (int32_t*)p;
    p += up16((size_t)ng * 4);
    g.n_tiles = (int32_t*)p;
    p += 16;
    g.perm = (int32_t*)p;
    p += up16((size_t)n_slots * 4);
    g.tiles = (int2*)p;
    g.max_tiles = max_tiles_for(ng, n_slots);
    return g;
}

// Block g (one per group, n_expert + 1) counts the slots of groups below g (its start)
// and of g, then writes g's slots in slot order at start + rank: a ballot per warp, the
// warps' counts in shared memory. Integer counts only: deterministic.
__global__ void __launch_bounds__(GROUP_THREADS) k_moe_group(const int32_t* __restrict__ ids, int n_slots,
                                                              int n_expert, int32_t* __restrict__ count,
                                                              int32_t* __restrict__ start, int32_t* __restrict__ perm) {
    pdl_wait();
    pdl_trigger();
    constexpr int W = GROUP_THREADS / 32;
    __shared__ int red[2][W];
    __shared__ int wcnt[W];
    const int g = blockIdx.x, t = threadIdx.x, lane = t & 31, w = t >> 5;
    int less = 0, eq = 0;
    for (int p = t; p < n_slots; p += GROUP_THREADS) {
        const int q = group_of(ids[p], n_expert);
        less += q < g;
        eq += q == g;
    }
    less = warp_isum(less);
    eq = warp_isum(eq);
    if (lane == 0) {
        red[0][w] = less;
        red[1][w] = eq;
    }
    __syncthreads();
    less = eq = 0;
    for (int i = 0; i < W; ++i) {
        less += red[0][i];
        eq += red[1][i];
    }
    if (t == 0) {
        count[g] = eq;
        start[g] = less;
    }
    if (eq == 0) return;  // the same for every thread of the block
    int base = less;
    for (int p0 = 0; p0 < n_slots; p0 += GROUP_THREADS) {
        const int p = p0 + t;
        const bool mine = p < n_slots && group_of(ids[p], n_expert) == g;
        const unsigned b = __ballot_sync(kFull, mine);
        if (lane == 0) wcnt[w] = __popc(b);
        __syncthreads();
        int off = base, tot = 0;
        for (int i = 0; i < W; ++i) {
            off += i < w ? wcnt[i] : 0;
            tot += wcnt[i];
        }
        if (mine) perm[off + __popc(b & ((1u << lane) - 1u))] = p;
        base += tot;
        __syncthreads();  // wcnt is rewritten next round
    }
}

// One block: each thread takes a run of groups, the block scans their tile counts
// (Hillis-Steele over the threads), and each thread writes its groups' tiles in order.
constexpr int TILE_THREADS = 1024;
__global__ void __launch_bounds__(TILE_THREADS) k_moe_tiles(const int32_t* __restrict__ count, int n_groups,
                                                             int2* __restrict__ tiles, int32_t* __restrict__ n_tiles) {
    pdl_wait();
    pdl_trigger();
    __shared__ int part[TILE_THREADS];
    const int t = threadIdx.x;
    const int per = (n_groups + TILE_THREADS - 1) / TILE_THREADS;
    const int g0 = min(n_groups, t * per), g1 = min(n_groups, g0 + per);
    int mine = 0;
    for (int g = g0; g < g1; ++g) mine += (count[g] + MM_BN - 1) / MM_BN;
    part[t] = mine;
    __syncthreads();
    for (int o = 1; o < TILE_THREADS; o <<= 1) {
        const int v = t >= o ? part[t - o] : 0;
        __syncthreads();
        part[t] += v;
        __syncthreads();
    }
    int off = part[t] - mine;
    for (int g = g0; g < g1; ++g)
        for (int r = 0; r < count[g]; r += MM_BN) tiles[off++] = make_int2(g, r);
    if (t == TILE_THREADS - 1) *n_tiles = part[t];
}

// ---- prefill MATMUL_ID: the tiled matmul ------------------------------------------------

struct MmIdArgs {
    const uint8_t* W;  // n_expert * out rows, device layout, row_bytes apart
    size_t row_bytes;
    const float* x;  // x_rows rows of in
    float* y;        // n_slots rows of out
    Groups g;
    int in, nb, out, n_expert, k;
    int per_slot;  // x holds a row per slot (else per token: slot / k)
};

// Block (tile, m-block): rows [m0, m0 + MM_BM) of the tile's expert against its up to
// MM_BN (token, slot) rows. Per step of MM_BK elements, thread i dequantizes chunk
// (i & 1) of weight row i >> 1 and converts the same chunk of activation row i >> 1 to
// f16; the four warps each take a 32 x 32 quarter of the tile in 16 x 16 x 16 products.
template <int T>
__global__ void __launch_bounds__(MM_THREADS) k_moe_mm(MmIdArgs a) {
    using namespace nvcuda;
    static_assert(MM_BM == MM_BN && MM_THREADS == 2 * MM_BM && MM_BK == 64, "thread i: row i / 2, chunk i % 2");
    constexpr size_t kAB = (size_t)(MM_BM + MM_BN) * MM_LD * sizeof(__half);
    constexpr size_t kC = (size_t)MM_BN * MM_CLD * sizeof(float);
    __shared__ __align__(128) uint8_t smem[kAB > kC ? kAB : kC];
    __shared__ int s_slot[MM_BN];
    __half* As = reinterpret_cast<__half*>(smem);
    __half* Bs = As + MM_BM * MM_LD;
    float* Cs = reinterpret_cast<float*>(smem);  // after the last step, over As and Bs
    pdl_wait();
    pdl_trigger();
    const int tile = blockIdx.x;
    if (tile >= *a.g.n_tiles) return;
    const int2 te = a.g.tiles[tile];
    const int grp = te.x, r0 = te.y;
    const int cnt = min(MM_BN, a.g.count[grp] - r0);
    const int32_t* rows = a.g.perm + a.g.start[grp] + r0;
    const int m0 = blockIdx.y * MM_BM, tid = threadIdx.x;
    if (grp == a.n_expert) {  // slots without an expert: zero rows
        for (int i = tid; i < cnt * MM_BM; i += MM_THREADS) {
            const int n = i / MM_BM, m = m0 + i % MM_BM;
            if (m < a.out) a.y[(size_t)rows[n] * a.out + m] = 0.0f;
        }
        return;
    }
    if (tid < MM_BN) s_slot[tid] = tid < cnt ? rows[tid] : -1;
    __syncthreads();
    const int ar = tid >> 1, hh = tid & 1;  // this thread's row (weights and activations) and chunk
    const bool w_ok = m0 + ar < a.out;
    const uint8_t* wrow = a.W + ((size_t)grp * a.out + (w_ok ? m0 + ar : 0)) * a.row_bytes;
    const int slot = s_slot[ar];
    const float* xrow = slot >= 0 ? a.x + (size_t)(a.per_slot ? slot : slot / a.k) * a.in : nullptr;
    const int warp = tid >> 5, wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    uint4* as = reinterpret_cast<uint4*>(As + ar * MM_LD + hh * 32);
    uint4* bs = reinterpret_cast<uint4*>(Bs + ar * MM_LD + hh * 32);
    for (int c0 = 0; c0 < a.nb; c0 += 2) {
        const int c = c0 + hh;
        float v[32];
        if (w_ok && c < a.nb) {
            deq32<T>(wrow, c, a.nb, v);
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) v[i] = 0.0f;
        }
        store_half32(v, as);
        if (xrow && c < a.nb) {
            const float4* xs = reinterpret_cast<const float4*>(xrow + 32 * c);
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const float4 f = xs[q];
                v[4 * q] = f.x;
                v[4 * q + 1] = f.y;
                v[4 * q + 2] = f.z;
                v[4 * q + 3] = f.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) v[i] = 0.0f;
        }
        store_half32(v, bs);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MM_BK; kk += 16) {
            // A (m, k) at As[m * LD + k]: row-major; B (k, n) at Bs[n * LD + k]: column-major.
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], As + (wm + 16 * i) * MM_LD + kk, MM_LD);
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], Bs + (wn + 16 * j) * MM_LD + kk, MM_LD);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();  // the tiles are rewritten next step (and Cs takes their place after the last)
    }
    // C (m, n) at Cs[n * CLD + m]: each slot's outputs contiguous, for coalesced stores.
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(Cs + (wn + 16 * j) * MM_CLD + wm + 16 * i, acc[i][j], MM_CLD, wmma::mem_col_major);
    __syncthreads();
    for (int i = tid; i < cnt * MM_BM; i += MM_THREADS) {
        const int n = i / MM_BM, m = i % MM_BM;
        if (m0 + m < a.out) a.y[(size_t)s_slot[n] * a.out + m0 + m] = Cs[n * MM_CLD + m];
    }
}

}  // namespace

void sigmoid(const float* x, float* y, int64_t n) {
    if (n < 1) return;
    launch(k_sigmoid, blocks_for(n, 256), 256, x, y, n);
}

void moe_route(const float* logits, int32_t* ids, float* w, int64_t n_expert, int64_t k, int64_t nt, int gating,
               int norm, float scale) {
    if (n_expert < 1 || k < 1 || k > n_expert || nt < 1 || (w && (gating < 1 || gating > 3)) ||
        k > kRouteMaxK || n_expert > kRouteMaxExperts)
        throw std::invalid_argument("moe_route: 1 <= k <= n_expert, k <= 32, n_expert <= 1024, gating 1..3");
    RouteArgs a{logits, ids, w, (int)n_expert, (int)k, (int)nt, gating, norm, scale};
    dispatch_route((int)n_expert, [&]<int NPL>() { launch(k_moe_route<NPL>, blocks_for(nt, ROUTE_WARPS), ROUTE_WARPS * 32, a); });
}

void moe_sum(const float* x, const float* w, float* y, int64_t d, int64_t k, int64_t nt, const float* resid) {
    if (d * nt < 1) return;
    launch(k_moe_sum, blocks_for(d * nt, 256), 256, x, w, resid, y, d, (int)k, nt);
}

size_t moe_group_bytes(int64_t n_expert, int64_t n_slots) {
    const size_t ng = (size_t)n_expert + 1;
    return 2 * up16(ng * 4) + 16 + up16((size_t)n_slots * 4) + (size_t)max_tiles_for((int64_t)ng, n_slots) * sizeof(int2);
}

void moe_group(const int32_t* ids, int64_t n_slots, int64_t n_expert, void* scratch) {
    if (n_expert < 1 || n_slots < 1 || n_slots > (int64_t)1 << 30)
        throw std::invalid_argument("moe_group: 1 <= n_slots < 2^30, n_expert >= 1");
    const Groups g = groups_at(scratch, n_expert, n_slots);
    launch(k_moe_group, (unsigned)(n_expert + 1), GROUP_THREADS, ids, (int)n_slots, (int)n_expert, g.count, g.start,
           g.perm);
    launch(k_moe_tiles, 1u, TILE_THREADS, (const int32_t*)g.count, (int)(n_expert + 1), g.tiles, g.n_tiles);
}

void matmul_id_tiled(int32_t wtype, const void* W, size_t row_bytes, int64_t in_dim, int64_t out, int64_t n_expert,
                     int64_t k, int64_t nt, int64_t x_rows, const float* x, void* groups, float* y) {
    if (in_dim % 32 || out < 1 || (x_rows != nt && x_rows != nt * k))
        throw std::invalid_argument("matmul_id_tiled: rows of a multiple of 32, x_rows nt or nt * k");
    MmIdArgs a;
    a.W = (const uint8_t*)W;
    a.row_bytes = row_bytes;
    a.x = x;
    a.y = y;
    a.g = groups_at(groups, n_expert, nt * k);
    a.in = (int)in_dim;
    a.nb = (int)(in_dim / 32);
    a.out = (int)out;
    a.n_expert = (int)n_expert;
    a.k = (int)k;
    a.per_slot = x_rows != nt;
    const dim3 grid((unsigned)a.g.max_tiles, (unsigned)((out + MM_BM - 1) / MM_BM));
    if (grid.y > 65535) throw std::invalid_argument("matmul_id_tiled: too many output rows");
    if (!dispatch_type(wtype, [&]<int T>() { launch(k_moe_mm<T>, grid, MM_THREADS, a); }))
        throw std::invalid_argument("matmul_id_tiled: weight type " + std::to_string(wtype) + " has no CUDA kernel");
}

}  // namespace minfer::cuda
