// The CUDA plan executor: the same Step/Plan format the CPU runs (cpu/plan.h), run on
// the stream of the pool's lane (context.h: the calling thread's current lane). A
// whole-plan run is launched directly the first time, captured into a CUDA graph the
// second, and replayed from then on (MINFER_NO_CUDA_GRAPH=1, partial runs and tracing
// always launch directly). In a whole run the prefill GEMMs' weights are dequantized one
// GEMM ahead on the lane's side stream (forked from and joined back to the main stream by
// events, so captures hold it too); partial runs dequantize on the main stream just
// before each GEMM.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/plan.h"
#include "cuda/pool.h"

namespace minfer::cuda {

// The device copy of a host WeightStore: one buffer per handle, uploaded on first use
// by a validated plan, quantized as in the GGUF, rows in the device layout
// (cuda/layout.h: rearranged within the row for the types whose blocks are unaligned).
// Shared by every context of the model: uploads are taken in turn and each is complete
// (its lane's stream waited for) before its pointer is published, so another lane never
// reads a weight still in flight.
struct DevWeights {
    std::mutex mu;
    std::vector<void*> ptr;
    std::vector<size_t> row_bytes;  // device row stride per handle
    size_t bytes = 0;
    ~DevWeights();
    const void* ensure(const WeightStore& ws, int h);
    const void* get(int h) const { return ptr[h]; }
    size_t stride(int h) const { return row_bytes[h]; }
};

void validate_plan(const Plan& plan, DevPool& pool, const WeightStore& ws, DevWeights& dw);
void run_plan(const Plan& plan, DevPool& pool, const WeightStore& ws, DevWeights& dw, size_t begin,
              size_t end);

// Plan::flags bits: step merges (fused decode ops) the executor may apply. Each fused
// launch computes bitwise what its steps compute one by one.
enum PlanFlags : int32_t {
    FUSE_QKV = 1,       // consecutive matvecs over one input in one launch; rope q + rope k + KV store in one
    FUSE_FFN = 2,       // gate|up matvecs + SwiGLU in one launch
    FUSE_RESIDUAL = 4,  // a matvec followed by a residual add: the add in the matvec epilogue
    FUSE_QUANT = 8,     // a decode matvec's int8 input is written by the kernel producing it
                        // (attention, gate|up + SwiGLU) instead of a launch of its own
    // (16 was the norm fusion's, deleted: slower, 0.5B tg128 1,118 / 1,145 against 1,245 / 1,311)
    FUSE_ROPE = 32,     // a one-token q|k|v matvec also ropes q, k and stores k, v (kernels.h MvRopeStore)
};

struct ProfileEntry {
    double ms = 0;
    uint64_t count = 0;
    uint64_t bytes = 0;  // weight bytes the launches streamed
};
// Per-launch-kind event timings collected under MINFER_CUDA_PROFILE=1 (and cleared).
std::map<std::string, ProfileEntry> take_profile();

// What the last capture of this plan holds (0 when it was never captured).
size_t plan_graph_nodes(const Plan& plan);
// Launches one whole run of the plan issues (after step merges).
size_t plan_launches(const Plan& plan);
bool plan_captured(const Plan& plan);
std::vector<double> replay_probe(const Plan& plan, void* dst, const void* src, size_t h2d_bytes, int reps);
// The median of the probes' timings (the upper one of an even count).
double median_of(std::vector<double> v);
// Prefill GEMMs whose weight a whole run dequantizes on the side stream, and those that
// reuse the f16 input the GEMM before them converted (both fixed at validation).
size_t plan_gemm_pipelined(const Plan& plan);
size_t plan_gemm_inputs_reused(const Plan& plan);

// One launch of a whole run's program, as tracing and profiling show it: the kernel that
// runs (a step merge is one launch over several steps) and the plan steps it computes.
struct LaunchInfo {
    std::string name;        // launch_name(): "fused_ffn_swiglu", "matvec", "gemm", an op's name, ...
    std::vector<int> steps;  // plan step indices, ascending (none for the greedy pick)
    float ms = 0;            // timed: device time from the end of the launch before to the end of this one
};
// A whole run launched directly (never captured or replayed), one program entry at a
// time, with everything a whole run does (step merges, the prefill GEMM pipeline), so its
// results are bitwise run_plan's. after(info, k), when set, follows launch k's enqueue:
// tracing reads the launch's outputs there (each read a D2H + wait). timed (never with
// after): every launch is queued behind a gate (timeline.h) before the device starts, an
// event follows each, and the times are read once after the last; the events cost the
// launches their PDL overlap, so the total reads a little above a replay's.
std::vector<LaunchInfo> run_launches(const Plan& plan, DevPool& pool, const WeightStore& ws, DevWeights& dw,
                                     bool timed, const std::function<void(const LaunchInfo&, size_t)>& after);

}  // namespace minfer::cuda
