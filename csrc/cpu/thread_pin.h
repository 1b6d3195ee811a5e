// Where the executor's threads run: worker i of an n-thread team pinned to the i-th CPU
// of the caller's affinity mask (physical cores first), so threads stop migrating and a
// thread keeps the cache lines of the rows it computed step after step (measured on a
// 16-core Xeon: OpenMP's own close/cores binding gave pp512 +12% at 16 threads).
//
// Rules: pinning only when 2 <= n <= the CPUs of the mask (oversubscribed threads must
// be free to share CPUs; one thread has no team to keep apart); MINFER_CPU_PIN=0 turns
// it off, and an explicit OMP_PROC_BIND or OMP_PLACES leaves placement to OpenMP. It
// never fails a run: a CPU that refuses the thread leaves it unpinned. The calling
// thread (worker 0) is pinned only for the duration of the run and gets its mask back
// afterwards, so threads it creates later (Python's, a tokenizer's) inherit no pinning.
// Placement changes where arithmetic runs, never what it computes.
#pragma once
#include <vector>

namespace minfer::cpu::pin {

// The CPUs of the calling thread's affinity mask in the order workers take them: one CPU
// per physical core first (ascending), then the second hardware threads, and so on.
std::vector<int> cpu_order();

// One team's placement, made by the calling thread before its parallel region.
class TeamPlacement {
public:
    explicit TeamPlacement(int n_threads);
    ~TeamPlacement();  // gives the calling thread its own mask back
    TeamPlacement(const TeamPlacement&) = delete;
    TeamPlacement& operator=(const TeamPlacement&) = delete;
    // Called by every thread of the team, first thing in the region, with its number.
    // Pins it to its CPU, or (when this team is not pinned) undoes an earlier pin.
    void place(int ith);
    bool pinned() const { return !cpus_.empty(); }

private:
    std::vector<int> cpus_;    // CPU of each worker; empty: no pinning for this team
    std::vector<int> mask_;    // the caller's mask when the team was placed
    bool caller_moved_ = false;
};

// The CPUs each thread of an n-thread OpenMP team may run on right now, without placing
// anyone (tests: what the last run left the workers with).
std::vector<std::vector<int>> team_masks(int n_threads);

}  // namespace minfer::cpu::pin
