// The cells one query row of ATTN reads (plan.h), shared by every backend's kernels so
// a row sees the same cells whichever runs it.
//
// With a span input a row has two segments, read in this order as one sequence of
// cells: [lo[0], hi[0]), a prompt prefix it shares with another sequence and reads where
// that sequence's KV lies (no copy), then [lo[1], hi[1]), its own cells. The span holds
// four ints a row: own lo, own hi, prefix lo, prefix hi (prefix lo == hi: none).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SPAN_HD __host__ __device__ __forceinline__
#else
#define SPAN_HD inline
#endif

namespace minfer {

constexpr int kSpanInts = 4;

// A sliding window (> 0) keeps the last `window` cells of the two segments together:
// it cuts the prefix first, then the row's own cells. (CUDA's kernels cut the cell
// ranges; the CPU kernel, which walks a row's positions, keeps the last `window` of them:
// the same cells.)
SPAN_HD void attn_window(int64_t lo[2], int64_t hi[2], int64_t window) {
    if (window <= 0) return;
    const int64_t n0 = hi[0] > lo[0] ? hi[0] - lo[0] : 0;
    const int64_t n1 = hi[1] > lo[1] ? hi[1] - lo[1] : 0;
    const int64_t cut = n0 + n1 - window;
    if (cut <= 0) return;
    const int64_t c0 = cut < n0 ? cut : n0;
    lo[0] += c0;
    lo[1] += cut - c0;
}

// A row's four span ints are inside [0, n_ctx) with lo <= hi in each segment.
SPAN_HD bool span_ok(const int32_t* sp, int64_t n_ctx) {
    return sp[0] >= 0 && sp[0] <= sp[1] && sp[1] <= n_ctx && sp[2] >= 0 && sp[2] <= sp[3] && sp[3] <= n_ctx;
}

}  // namespace minfer
