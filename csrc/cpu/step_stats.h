// Where a multi-threaded plan run spends its threads' time, per op: computing, or
// waiting at barriers for the slowest thread. Collected only with MINFER_CPU_STATS=1
// (read once), for bench/cpu_balance.py: a 16-thread prefill that scales 6x instead of
// 12x either loses it to waits (imbalance, serial work, wake-ups) or to slower threads,
// and this says which, op by op. Off, it costs one predictable branch per step.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace minfer::cpu::stats {

bool enabled();

inline uint64_t now_ns() {
    return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// One thread's clock for the step it is running: time it waited inside the step (the
// matmul's barrier after quantizing) and time it spent quantizing activations.
struct StepClock {
    uint64_t waited = 0;   // inside the step, at its barriers
    uint64_t sync_at = 0;  // when its (last) inner barrier began: quantizing ends there
    int syncs = 0;
    int stolen = 0;        // pieces of other threads' work it took (matmul stealing)
};

// Per step and thread of one run: [step * nth + ith].
struct RunTimes {
    int nth = 0;
    size_t nsteps = 0;
    std::vector<uint64_t> work, wait, quant, stolen;
    std::vector<int32_t> op;
    std::vector<uint8_t> barrier;
    void init(int n_threads, size_t n_steps);
};

struct OpTotals {
    int64_t steps = 0;
    double work_s = 0;  // summed over threads
    double crit_s = 0;  // summed over steps: the slowest thread's work
    double wait_s = 0;  // summed over threads: at barriers after and inside the step
    int64_t stolen = 0; // pieces taken from other threads' runs
};

// Adds one run (wall time from the caller's clock) to the process totals.
void add_run(const RunTimes& t, uint64_t wall_ns);

struct Totals {
    int64_t runs = 0, barriers = 0;
    int threads = 0;  // of the last run
    double wall_s = 0;
    std::map<std::string, OpTotals> ops;  // by op name; "quantize" is the matmuls' share
};
Totals take(bool reset);

}  // namespace minfer::cpu::stats
