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
#include <atomic>
#include <cstdint>

namespace minfer::cpu {

struct Rect {
    int64_t r0, r1, t0, t1;  // rows [r0, r1) x tokens [t0, t1)
};

inline int64_t split_items(int64_t out, int64_t nt, int64_t tile) { return (out + 15) / 16 * ((nt + tile - 1) / tile); }

// Items [i, end) as at most 3 rectangles (a partial group, whole groups, a partial
// group); returns how many.
inline int range_rects(int64_t out, int64_t nt, int64_t tile, int64_t i, int64_t end, Rect rects[3]) {
    constexpr int64_t G = 16;
    const int64_t nc = (nt + tile - 1) / tile;
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

// A thread's static run as at most 3 rectangles; returns how many.
inline int matmul_split(int64_t out, int64_t nt, int64_t tile, int ith, int nth, Rect rects[3]) {
    const int64_t n = split_items(out, nt, tile);
    return range_rects(out, nt, tile, n * ith / nth, n * (ith + 1) / nth, rects);
}

// Work stealing over the static runs. A run is still its thread's own, but the thread
// claims it a piece at a time from the front, and a thread done with its own run takes
// pieces from the back of others'. A static split waits at every barrier for the
// slowest thread: one that lost its CPU for a while (a shared host, an interrupt) or runs
// at a lower clock holds up all the others; with stealing they finish its run instead.
// On an idle machine nobody steals and each thread walks its own run in order.
//
// Pieces: with 4 or more token tiles (prefill) a piece is a token slab of the whole run
// (all its rows x about an eighth of the tokens), so the activations of a slab are read
// once for all of the run's rows, as the repacked kernel's own token blocking does
// (pieces of a group's tiles instead re-streamed the activations once per group: +5-7%
// on a 4864-wide Q4_K/Q6_K ffn_down); otherwise (decode) a piece is one item, a 16-row
// group. Which thread computes an item never changes its bits (above). (Slabs as large as
// the AMX kernel's token block, so it widens each group fewer times a call, lost at 8 and
// 16 threads: docs/experiment-log.md.)
//
// state: pieces claimed from the front (low 32 bits) and from the back (high 32 bits)
// of one run, zero before the step.
struct StealRun {
    int64_t s, e;        // the run's items [s, e)
    int64_t slab;        // tokens per piece; 0: pieces are single items
    int64_t n;           // pieces in the run
    std::atomic<uint64_t>* state;

    // The next pieces [p0, p1): the owner's from the front (a slab, or a quarter of the
    // items left), a thief's one piece from the back. False when none is left.
    bool take(bool thief, int64_t& p0, int64_t& p1) const {
        uint64_t v = state->load(std::memory_order_relaxed);
        for (;;) {
            const int64_t f = (int64_t)(v & 0xffffffffu), k = (int64_t)(v >> 32), rem = n - f - k;
            if (rem <= 0) return false;
            const int64_t m = thief || slab ? 1 : std::max<int64_t>(1, rem / 4);
            const uint64_t nv = thief ? v + ((uint64_t)m << 32) : v + (uint64_t)m;
            if (state->compare_exchange_weak(v, nv, std::memory_order_relaxed)) {
                p0 = thief ? n - k - m : f;
                p1 = p0 + m;
                return true;
            }
        }
    }
};

// The run of thread t of nth, for stealing: state points at nth zeroed counters.
inline StealRun steal_run(int64_t out, int64_t nt, int64_t tile, int t, int nth, std::atomic<uint64_t>* state) {
    const int64_t items = split_items(out, nt, tile), nc = (nt + tile - 1) / tile;
    StealRun r{items * t / nth, items * (t + 1) / nth, 0, 0, state + t};
    if (nc >= 4) {
        r.slab = (nc + 7) / 8 * tile;
        r.n = r.s < r.e ? (nt + r.slab - 1) / r.slab : 0;
    } else {
        r.n = r.e - r.s;
    }
    return r;
}

// The rectangles of pieces [p0, p1) of a run (at most 3); returns how many.
inline int piece_rects(const StealRun& r, int64_t out, int64_t nt, int64_t tile, int64_t p0, int64_t p1,
                       Rect rects[3]) {
    if (!r.slab) return range_rects(out, nt, tile, r.s + p0, r.s + p1, rects);
    const int64_t t0 = p0 * r.slab, t1 = std::min(nt, p1 * r.slab);
    Rect all[3];
    const int k = range_rects(out, nt, tile, r.s, r.e, all);
    int m = 0;
    for (int i = 0; i < k; ++i) {
        const Rect c{all[i].r0, all[i].r1, std::max(all[i].t0, t0), std::min(all[i].t1, t1)};
        if (c.t0 < c.t1) rects[m++] = c;
    }
    return m;
}

// Thread ith's part of a stealing walk: its own run piece by piece, then pieces of the
// others' runs, starting with the next thread's so thieves spread over the victims.
// f(rect, stolen) computes one rectangle. Returns the number of pieces stolen.
template <class F>
int steal_walk(int64_t out, int64_t nt, int64_t tile, int ith, int nth, std::atomic<uint64_t>* state, F&& f) {
    int64_t p0, p1;
    Rect rects[3];
    const StealRun own = steal_run(out, nt, tile, ith, nth, state);
    while (own.take(false, p0, p1)) {
        const int k = piece_rects(own, out, nt, tile, p0, p1, rects);
        for (int i = 0; i < k; ++i) f(rects[i], false);
    }
    int stolen = 0;
    for (int d = 1; d < nth; ++d) {
        const StealRun other = steal_run(out, nt, tile, (ith + d) % nth, nth, state);
        while (other.take(true, p0, p1)) {
            const int k = piece_rects(other, out, nt, tile, p0, p1, rects);
            for (int i = 0; i < k; ++i) f(rects[i], true);
            ++stolen;
        }
    }
    return stolen;
}

}  // namespace minfer::cpu
