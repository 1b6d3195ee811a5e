// The CPU backend's executor: runs a Plan (common/plan.h) over one Pool with one OpenMP
// parallel region for the whole plan, so a decode step costs one Python->C++ call.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/plan.h"
#include "cpu/pool.h"

namespace minfer::cpu {

// Checks every step against the pool and weight store (ids, sizes, shapes, and that the
// CPU implements the op) so a bad plan is an exception before any thread starts, never
// an out-of-bounds access.
void validate_plan(const Plan& plan, const Pool& pool, const WeightStore& ws);
// Runs steps [begin, end) with n_threads threads. Validation and the barrier table are
// derived once per (pool, weights) state and kept in plan.state.
void run_plan(const Plan& plan, Pool& pool, const WeightStore& ws, int n_threads,
              size_t begin = 0, size_t end = (size_t)-1);

// What a plan's first run would do to its weights (the repacked copies of its matmul
// weights), done now: a caller can overlap it with other start-up work.
void prepare_weights(const Plan& plan, const WeightStore& ws, int n_threads);

// Index of the largest of x[0..n) (first on ties), computed by n_threads threads over
// the same contiguous row ranges the matmul gives each thread; -1 when any value is NaN
// or +-Inf (checked in the same pass, so greedy decoding needs no second scan).
int64_t argmax_f32(const float* x, int64_t n, int n_threads);

}  // namespace minfer::cpu
