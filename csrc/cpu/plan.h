// A lowered split: the compact form Python hands to C++ once per graph build and
// re-runs on every reuse. One call executes a whole plan with the GIL released.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/pool.h"

namespace minfer::cpu {

// Step op codes. Field use per op (buf[0] is always the output):
//   ADD, MUL, SWIGLU   buf: y, a, b                      ip: n
//   SILU               buf: y, x                         ip: n
//   RMS_NORM, QK_NORM  buf: y, x          w: norm|-1     ip: d, nrows            fp: eps
//   MATMUL             buf: y, x          w: W, bias|-1  ip: in_dim, out_dim, nt
//   GET_ROWS_W         buf: y, ids        w: table       ip: d, n, n_table_rows
//   GET_ROWS           buf: y, x, ids                    ip: d, n, n_src_rows
//   ROPE               buf: y, x, pos                    ip: nt, nh, hd, n_rot   fp: freq_base
//   KV_STORE           buf: K, k, v, cells, V            ip: nt, kv_dim, n_ctx
//   ATTN               buf: y, q, K, V, pos, span|-1     ip: nt, nh, nkv, hd, n_ctx, q_stride  fp: scale
enum OpCode : int32_t {
    OP_ADD = 1, OP_MUL, OP_SILU, OP_SWIGLU, OP_RMS_NORM, OP_QK_NORM, OP_MATMUL,
    OP_GET_ROWS_W, OP_GET_ROWS, OP_ROPE, OP_KV_STORE, OP_ATTN,
};
const char* op_name(int32_t op);

struct Step {
    int32_t op = 0;
    int32_t node = -1;        // graph node id, for error messages and tracing
    int32_t buf[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
    int64_t ip[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float fp[4] = {0, 0, 0, 0};
    int32_t w[4] = {-1, -1, -1, -1};
};

// A weight: a view of GGUF bytes (kept alive by the Python side of WeightStore).
struct Weight {
    const uint8_t* data;
    size_t nbytes;
    int32_t type;
    int64_t ne0, ne1;  // GGUF order: ne0 = row length (in), ne1 = rows (out)
    size_t row_bytes;
    std::string name;
};

class WeightStore {
public:
    int add(Weight w);
    const Weight& get(int h) const;
    int count() const { return (int)ws_.size(); }
private:
    std::vector<Weight> ws_;
};

struct Plan {
    std::vector<Step> steps;
    std::string name;
    // Static checks (ids, sizes, shapes) depend only on the plan, the pool's buffers and
    // the weights, none of which change once allocated; remember what was validated so a
    // reused plan costs nothing per run.
    mutable const Pool* validated_pool = nullptr;
    mutable int validated_pool_count = -1;
    mutable int validated_weight_count = -1;
    // barrier_after[i]: threads must meet after step i because a later step (before the
    // next meeting) reads or overwrites what step i touches. Derived with the validation.
    mutable std::vector<uint8_t> barrier_after;
};

// Checks every step against the pool and weight store (ids, sizes, shapes) so a bad
// plan is an exception before any thread starts, never an out-of-bounds access.
void validate_plan(const Plan& plan, const Pool& pool, const WeightStore& ws);
// Runs steps [begin, end) with n_threads threads.
void run_plan(const Plan& plan, Pool& pool, const WeightStore& ws, int n_threads,
              size_t begin = 0, size_t end = (size_t)-1);

int default_threads();

// Index of the largest of x[0..n) (first on ties), computed by n_threads threads over
// the same contiguous row ranges the matmul gives each thread.
int64_t argmax_f32(const float* x, int64_t n, int n_threads);

}  // namespace minfer::cpu
