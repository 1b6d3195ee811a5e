// Sampling's candidates on the device: the k best of each logits row, best first, equal
// values by the lower index (the CPU's top_k order), plus the values at a few given ids
// (the repetition penalty's), so a sampled step reads back a few hundred bytes instead of
// the 600 KB row.
//
// A value and its index make one unique 64-bit key whose unsigned order is that order:
// the float's bits made order-preserving in the high half (-0 taken as +0, as the CPU's
// compare does), the complement of the index in the low half. Selecting the k largest
// keys is a radix select: 8 bits a pass from the top, a 256-bin histogram of the keys
// still in play, the bin holding the k-th key found by a scan; it stops early when that
// bin holds exactly the keys still wanted. Histograms are integer atomics, so the
// selected set, and with the final sort the output, is the same on every run.
// Stage 1: one block per 2,048-value slice keeps its slice's k best. Stage 2: one block
// per row selects the k best of those and sorts them.
#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "cuda/context.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace minfer::cuda {

namespace {

constexpr int TK1_THREADS = 256, TK1_ITEMS = 8, TK1_SLICE = TK1_THREADS * TK1_ITEMS;
constexpr int TK2_THREADS = 1024;
constexpr uint64_t TK_PAD = 0;  // below every finite value's key: fills a slice shorter than k

__device__ __forceinline__ uint64_t tk_key(float v, int64_t i) {
    if (v == 0.0f) v = 0.0f;
    uint32_t u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)u << 32) | (uint32_t)~(uint32_t)i;
}
__device__ __forceinline__ int32_t tk_index(uint64_t key) { return (int32_t)~(uint32_t)key; }

// Shared state of one block's select.
struct TkShared {
    int hist[256];
    int digit, above;
    int count;
};

// Among the block's keys (each(f) calls f(key) for every key a thread holds), the k
// largest are exactly those whose bits under `mask` are >= `prefix`; returns them as
// (prefix, mask). k must not exceed the number of keys.
template <class Each>
__device__ void tk_select(Each each, int k, TkShared& s, uint64_t& prefix, uint64_t& mask) {
    prefix = 0;
    mask = 0;
    int need = k;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) s.hist[b] = 0;
        __syncthreads();
        each([&](uint64_t key) {
            if ((key & mask) == prefix) atomicAdd(&s.hist[(key >> shift) & 255], 1);
        });
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l sums bins 255 - 8l down to 248 - 8l; an exclusive scan over lanes
            // gives the keys in higher bins; the lane whose range crosses `need` finds the
            // bin.
            const int lane = threadIdx.x;
            int c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) sum += c[j] = s.hist[255 - 8 * lane - j];
            int incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int t = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += t;
            }
            int run = incl - sum;
            if (run < need && need <= incl) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (run < need && need <= run + c[j]) {
                        s.digit = 255 - 8 * lane - j;
                        s.above = run;
                    }
                    run += c[j];
                }
            }
        }
        __syncthreads();
        const int d = s.digit;
        need -= s.above;
        prefix |= (uint64_t)d << shift;
        mask |= (uint64_t)255 << shift;
        const bool done = s.hist[d] == need;  // the whole bin is wanted
        __syncthreads();                      // everyone has read digit, above and the bin
        if (done) return;
    }
}

// Stage 1: block (slice, row) writes its slice's min(k, slice) best keys (unsorted, then
// TK_PAD) to cand[row][slice][0..k) and ORs a non-finite flag into bad[row].
__global__ void __launch_bounds__(TK1_THREADS) k_topk_slices(const float* __restrict__ x, int64_t n, int k,
                                                            uint64_t* __restrict__ cand, int* __restrict__ bad) {
    pdl_wait();
    pdl_trigger();
    __shared__ TkShared s;
    const int row = blockIdx.y, nslices = gridDim.x;
    x += (int64_t)row * n;
    const int64_t lo = (int64_t)blockIdx.x * TK1_SLICE;
    const int m = (int)min((int64_t)TK1_SLICE, n - lo);
    uint64_t key[TK1_ITEMS];
    int nonfinite = 0;
#pragma unroll
    for (int j = 0; j < TK1_ITEMS; ++j) {
        const int i = j * TK1_THREADS + threadIdx.x;
        key[j] = TK_PAD;
        if (i < m) {
            const float v = x[lo + i];
            nonfinite |= !isfinite(v);
            key[j] = tk_key(v, lo + i);
        }
    }
    nonfinite = __syncthreads_or(nonfinite);
    if (nonfinite && threadIdx.x == 0) atomicOr(bad + row, 1);
    uint64_t* out = cand + ((int64_t)row * nslices + blockIdx.x) * k;
    const int kk = min(k, m);
    if (threadIdx.x == 0) s.count = 0;
    auto each = [&](auto f) {
#pragma unroll
        for (int j = 0; j < TK1_ITEMS; ++j)
            if (j * TK1_THREADS + (int)threadIdx.x < m) f(key[j]);
    };
    uint64_t prefix = 0, mask = 0;  // a slice of at most k values keeps them all
    if (kk < m) tk_select(each, kk, s, prefix, mask);
    else __syncthreads();
    each([&](uint64_t key) {
        if ((key & mask) >= prefix) out[atomicAdd(&s.count, 1)] = key;
    });
    for (int i = kk + threadIdx.x; i < k; i += blockDim.x) out[i] = TK_PAD;
}

// Stage 2: block `row` selects the k best of the row's slices' keys, sorts them best
// first, and writes ids, values, the values at the gather ids and the row's flag:
// 0, 1 when a value is NaN or Inf, -1 - code when the device error word is set.
__global__ void __launch_bounds__(TK2_THREADS) k_topk_merge(const float* __restrict__ x, int64_t n, int k,
                                                           int nslices, const uint64_t* __restrict__ cand,
                                                           int* __restrict__ bad, const int32_t* __restrict__ gather,
                                                           int g, int32_t* __restrict__ outs, int kcap, int gcap,
                                                           const int* err) {
    pdl_wait();
    pdl_trigger();
    __shared__ TkShared s;
    __shared__ uint64_t best[kTopKMax];
    const int row = blockIdx.x;
    x += (int64_t)row * n;
    const uint64_t* keys = cand + (int64_t)row * nslices * k;
    const int m = nslices * k;
    int32_t* o = outs + (size_t)row * (1 + 2 * (size_t)kcap + gcap);  // topk_row_words
    int32_t* ids = o + 1;
    float* vals = reinterpret_cast<float*>(ids + kcap);
    float* gvals = vals + kcap;
    const int32_t* gid = gather + (int64_t)row * g;
    for (int i = threadIdx.x; i < g; i += blockDim.x) gvals[i] = gid[i] >= 0 ? x[gid[i]] : 0.0f;
    auto each = [&](auto f) {
        for (int i = threadIdx.x; i < m; i += blockDim.x) f(keys[i]);
    };
    if (threadIdx.x == 0) s.count = 0;
    uint64_t prefix, mask;
    tk_select(each, k, s, prefix, mask);
    // Pad to a power of two for the sort with keys below every real one.
    int p2 = 1;
    while (p2 < k) p2 <<= 1;
    for (int i = k + threadIdx.x; i < p2; i += blockDim.x) best[i] = TK_PAD;
    each([&](uint64_t key) {
        if ((key & mask) >= prefix) best[atomicAdd(&s.count, 1)] = key;
    });
    __syncthreads();
    // Bitonic sort, descending.
    for (int size = 2; size <= p2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < p2; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool desc = (i & size) == 0;
                    const uint64_t a = best[i], b = best[j];
                    if (desc ? a < b : a > b) {
                        best[i] = b;
                        best[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        const int32_t id = tk_index(best[i]);
        ids[i] = id;
        vals[i] = x[id];
    }
    if (threadIdx.x == 0) {
        const int e = *(volatile const int*)err;
        o[0] = e ? -1 - e : bad[row] ? 1 : 0;
        bad[row] = 0;  // ready for the next call
    }
}

// Block (slice, j) puts kMaskedLogit at the ids that row rows[j]'s bit words do not
// allow. NaN and Inf stay: a row is checked for them whatever its mask (the host's
// masked pick checks the whole row too).
__global__ void k_mask_rows(float* __restrict__ x, int64_t n, const int32_t* __restrict__ rows,
                            const uint32_t* __restrict__ words, int64_t nw) {
    pdl_wait();
    pdl_trigger();
    const int j = blockIdx.y;
    float* row = x + (int64_t)rows[j] * n;
    const uint32_t* w = words + (int64_t)j * nw;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        if (!((w[i >> 5] >> (i & 31)) & 1u)) {
            const float v = row[i];
            if (isfinite(v)) row[i] = kMaskedLogit;
        }
    }
}

}  // namespace

void mask_rows(float* x, int64_t n, int m, const int32_t* rows, const uint32_t* words) {
    if (m < 1 || m > kArgmaxMaxRows) throw std::invalid_argument("mask_rows: 1..kArgmaxMaxRows rows");
    const int64_t nw = (n + 31) / 32;
    const unsigned blocks = (unsigned)std::min<int64_t>((n + 255) / 256, 64);
    launch(k_mask_rows, dim3(blocks, (unsigned)m), 256, x, n, rows, words, nw);
}

int topk_slices(int64_t n) { return (int)((n + TK1_SLICE - 1) / TK1_SLICE); }

// The rows' non-finite flags first, at a place no call's candidates cover (each call
// leaves them zero), then the candidates.
constexpr size_t TK_FLAGS_BYTES = kArgmaxMaxRows * sizeof(int);

size_t topk_scratch_bytes(int64_t n, int rows, int k) {
    return TK_FLAGS_BYTES + (size_t)rows * topk_slices(n) * k * sizeof(uint64_t);
}

void top_k(const float* x, int64_t n, int rows, int k, const int32_t* gather, int g, void* scratch, int32_t* out,
           int kcap, int gcap, const int* err) {
    if (rows < 1 || rows > kArgmaxMaxRows || k < 1 || k > kTopKMax || k > n || k > kcap || g < 0 || g > gcap)
        throw std::invalid_argument("top_k: bad shape");
    const int ns = topk_slices(n);
    int* bad = (int*)scratch;
    auto* cand = (uint64_t*)((uint8_t*)scratch + TK_FLAGS_BYTES);
    launch(k_topk_slices, dim3((unsigned)ns, (unsigned)rows), TK1_THREADS, x, n, k, cand, bad);
    launch(k_topk_merge, (unsigned)rows, TK2_THREADS, x, n, k, ns, (const uint64_t*)cand, bad, gather, g, out, kcap,
           gcap, err);
}

}  // namespace minfer::cuda
