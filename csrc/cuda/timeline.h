// In-kernel timeline, a diagnostic build only (-C cmake.define.MINFER_CUDA_TIMELINE=ON;
// `python bench/timeline.py MODEL`): thread 0 of block (0, 0) of each instrumented
// kernel keeps the SM clock at its marks in registers and stores them once at its end,
// so the marks cost the kernel a clock read each and nothing on its memory path. It
// answers what the stamps and the launch-cost variants cannot: where inside a launch of
// the real replay (PDL overlap kept) the time goes. Without the option every macro is
// empty and no kernel changes.
#pragma once
#include <cstdint>
#include <vector>

namespace minfer::cuda::tl {

constexpr int kKinds = 8, kRing = 2048, kMarks = 10;
// A record: the marks' clocks (0: not reached), the global timer at mark 0 and at the
// last mark, the grid's block count, the SM.
constexpr int kWords = kMarks + 4;
enum Kind { ATTN = 0, MV_ROPE = 1, MV = 2, MV_BULK = 3, NORM = 4, QUANT = 5 };

struct Buf {
    unsigned long long rec[kKinds][kRing][kWords];
    unsigned n[kKinds];
};

bool built();
// Every kind's records (at most kRing each, oldest first), then zeroed if reset.
std::vector<std::vector<unsigned long long>> read(bool reset);

// The gate of a timed run (executor.cpp run_launches, `minfer profile` on CUDA), in every
// build: gate_close() enqueues a one-thread kernel that holds the stream until
// gate_open() (mapped pinned memory the kernel polls), so a run's launches and the events
// between them are all queued before the device starts the first, and the events time
// the kernels rather than the host's launch rate. The hold gives up after kGateMaxNs, so
// a host that blocks before it opens the gate (a full launch queue; a kernel's first
// load, which waits for the device under lazy module loading) costs a delay, not a hang.
constexpr long long kGateMaxNs = 200'000'000;
void gate_close();
void gate_open();

}  // namespace minfer::cuda::tl
