// How a repacked matmul's work is cut between threads.
//
// Items are (16-row group, tile of `tile` tokens) pairs, numbered group-major; thread
// ith of nth takes the contiguous run [n * ith / nth, n * (ith + 1) / nth) of the n
// items, so shares differ by at most one item at any thread count. Splitting by rows
// alone left threads idle: a 896-row matrix is 56 groups, and rows rounded up to whole
// groups per thread kept 2 of 16 threads without work (14 x 64 rows), a 128-row K/V
// projection 8 of 16; with the token tiles of a 512-token prefill both have thousands
// of items. Decode (one tile) still splits by groups. Within a run a thread walks one
// group's tiles before the next group, as the single-thread loop does, so a group's
// weights stay in cache while the activations stream by.
//
// Each item computes whole (row, token) results with the same instructions whatever
// its neighbours (repack.h), so the split never changes a bit.
#pragma once
#include <algorithm>
#include <cstdint>

namespace minfer::cpu {

struct Rect {
    int64_t r0, r1, t0, t1;  // rows [r0, r1) x tokens [t0, t1)
};

// A thread's run as at most 3 rectangles (a partial group, whole groups, a partial
// group); returns how many.
inline int matmul_split(int64_t out, int64_t nt, int64_t tile, int ith, int nth, Rect rects[3]) {
    constexpr int64_t G = 16;
    const int64_t ng = (out + G - 1) / G, nc = (nt + tile - 1) / tile, n = ng * nc;
    int64_t i = n * ith / nth;
    const int64_t end = n * (ith + 1) / nth;
    int k = 0;
    while (i < end) {
        const int64_t g = i / nc, c = i % nc;
        if (c == 0 && end - i >= nc) {  // a run of whole groups
            const int64_t g1 = g + (end - i) / nc;
            rects[k++] = {g * G, std::min(out, g1 * G), 0, nt};
            i = g1 * nc;
        } else {  // part of one group's tiles
            const int64_t c1 = std::min(nc, c + (end - i));
            rects[k++] = {g * G, std::min(out, (g + 1) * G), c * tile, std::min(nt, c1 * tile)};
            i = g * nc + c1;
        }
    }
    return k;
}

}  // namespace minfer::cpu
