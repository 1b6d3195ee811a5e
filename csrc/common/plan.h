// The lowered-split format every backend executes: Python lowers a split to a Plan once
// per graph build and re-runs it on every reuse. The format (op codes, field meanings,
// buffer roles and sizes, weight descriptors) is shared; how a step runs, and whatever
// a backend derives from a plan to run it fast, belongs to the backend.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace minfer {

// Step op codes. Field use per op (buf[0] is always the output):
//   ADD, MUL, SWIGLU   buf: y, a, b                      ip: n
//   SILU               buf: y, x                         ip: n
//   RMS_NORM, QK_NORM  buf: y, x          w: norm|-1     ip: d, nrows            fp: eps
//   MATMUL             buf: y, x          w: W, bias|-1  ip: in_dim, out_dim, nt
//   GET_ROWS_W         buf: y, ids        w: table       ip: d, n, n_table_rows
//   GET_ROWS           buf: y, x, ids                    ip: d, n, n_src_rows
//   ROPE               buf: y, x, pos         w: factors|-1  ip: nt, nh, hd, n_rot, style
//                                                        fp: freq_base, freq_scale, attn_factor
//   KV_STORE           buf: K, k, v, cells, V            ip: nt, kv_dim, n_ctx, kv_type
//   ATTN               buf: y, q, K, V, pos, span|-1     ip: nt, nh, nkv, hd, n_ctx, q_stride, kv_type, window,
//                                                            seq_ctx
//                                                        fp: scale, softcap
//   SIGMOID            buf: y, x                         ip: n
//   MOE_TOPK           buf: ids, logits                  ip: n_expert, k, nt
//   MOE_WEIGHTS        buf: w, logits                    ip: n_expert, k, nt, gating, norm  fp: scale
//   MATMUL_ID          buf: y, x, ids     w: W           ip: in_dim, out_dim, x_rows, n_expert, k, nt
//   MOE_SUM            buf: y, x, w                      ip: d, k, nt
//   SCALE, SOFTCAP     buf: y, x                         ip: n                   fp: value
//   GELU               buf: y, x                         ip: n
//   GEGLU              buf: y, g, u                      ip: n
//   SLICE              buf: y, x                         ip: width, nt, src_width, offset
// kv_type is the GGML type of the K/V regions' elements: 0 = F32, 1 = F16.
// ROPE (llama.cpp's rope_ext with ext_factor 0): style 0 = NeoX (element i pairs with
// i + n_rot/2), 1 = normal (pairs 2i, 2i+1); the angle of pair i at position p is
// p * freq_scale * freq_base^(-2i/n_rot) / factors[i] (factors: f32[n_rot/2], or none),
// cos and sin are multiplied by attn_factor; freq_scale and attn_factor 0 mean 1.
// ATTN: without span, token t sees cells [0, pos[t]]; with it, the four ints a row of
// common/attn_span.h (its own cells, after a prefix shared with another sequence and
// read in place). window > 0 keeps the last `window` of those cells (the sliding-window
// layers); softcap > 0 maps every
// scaled score s to softcap * tanh(s / softcap) before the softmax. seq_ctx: the most
// cells one row's span holds (its sequence's context; 0: n_ctx), a hint for how a backend
// cuts the work (CUDA's decode splits), never a bound it enforces.
// SCALE: y = x * value. SOFTCAP: y = value * tanh(x / value). GELU: the tanh
// approximation. GEGLU: gelu(g) * u, bitwise GELU then MUL. SLICE: y[t] = columns
// [offset, offset + width) of row t of x (rows of src_width floats).
// The mixture-of-experts steps (cpu/moe.h): MOE_TOPK writes, per token, the ids of the k
// largest of its n_expert router logits (i32, descending; ties to the lower id);
// MOE_WEIGHTS the k routing weights of that same selection (gating 1: softmax over all
// experts, then picked; 2: sigmoid; 3: softmax over the k picked logits; norm 1: divided
// by their sum; scale 0 or 1: none). MATMUL_ID multiplies by expert ids[t][j]'s out_dim
// rows of W (ne1 = out_dim * n_expert, expert e's rows from e * out_dim): x holds
// x_rows = nt rows (one per token, shared by its k slots) or nt * k (one per slot), y
// nt * k rows of out_dim (row t * k + j). MOE_SUM: y[t] = sum over j, in order, of
// w[t][j] * x[t * k + j].
enum OpCode : int32_t {
    OP_ADD = 1, OP_MUL, OP_SILU, OP_SWIGLU, OP_RMS_NORM, OP_QK_NORM, OP_MATMUL,
    OP_GET_ROWS_W, OP_GET_ROWS, OP_ROPE, OP_KV_STORE, OP_ATTN,
    OP_SIGMOID, OP_MOE_TOPK, OP_MOE_WEIGHTS, OP_MATMUL_ID, OP_MOE_SUM,
    OP_SCALE, OP_GELU, OP_GEGLU, OP_SOFTCAP, OP_SLICE,
    OP_LAST = OP_SLICE,
};
const char* op_name(int32_t op);  // "?" for an unknown code

// Bytes per KV element for a step's kv_type field; 0 if the type is not a KV type.
inline size_t kv_elem_bytes(int64_t kv_type) { return kv_type == 0 ? 4 : kv_type == 1 ? 2 : 0; }

struct Step {
    int32_t op = 0;
    int32_t node = -1;        // graph node id, for error messages and tracing
    int32_t buf[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
    int64_t ip[12] = {};
    float fp[4] = {0, 0, 0, 0};
    int32_t w[4] = {-1, -1, -1, -1};
};

// A weight as a backend sees it: GGUF-layout bytes at an address the backend can read
// (a host mmap view on the CPU, a device allocation on a GPU).
struct Weight {
    const uint8_t* data;
    size_t nbytes;
    int32_t type;
    int64_t ne0, ne1;  // GGUF order: ne0 = row length (in), ne1 = rows (out)
    size_t row_bytes;
    std::string name;
    // The bytes are a read-only file mapping (the GGUF mmap): a backend that no longer
    // reads them (the CPU, once repacked) may drop their pages, which fault back from the
    // file if ever read again. False for anything else (anonymous memory would be lost).
    bool file_backed = false;
    // A backend's derived form of these bytes (the CPU: its repacked matmul copy, see
    // cpu/repack.h), made on first use by a plan and kept as long as the weight; null
    // when the backend computes from `data` directly. Read and set with
    // std::atomic_load / std::atomic_store.
    mutable std::shared_ptr<const void> prepared;
};

// Handles to weights. add() checks the layout (whole blocks, byte count); whether the
// backend can compute with the type is the backend's check, made before add().
class WeightStore {
public:
    int add(Weight w);
    const Weight& get(int h) const;
    int count() const { return (int)ws_.size(); }
private:
    std::vector<Weight> ws_;
};

// Whatever a backend derives from a plan to run it (the CPU: what was validated and its
// barrier table; a GPU: a captured graph). Dropped whenever the steps change.
struct PlanState {
    virtual ~PlanState() = default;
};

struct Plan {
    std::vector<Step> steps;
    std::string name;
    mutable std::unique_ptr<PlanState> state;
    // Backend execution switches set at lowering (CUDA: which step merges, i.e. fused
    // decode ops, its executor may apply; bits in cuda/executor.h). Not part of a
    // step's meaning: a plan computes the same values whatever the flags.
    int32_t flags = 0;

    void add(const Step& s) {
        steps.push_back(s);
        state.reset();
    }
};

// ---- The format's per-op description, shared by every backend's validator ----------

enum SlotAccess : uint8_t { SLOT_NONE = 0, SLOT_READ = 1, SLOT_WRITE = 2, SLOT_OPTIONAL = 4 };

struct OpFormat {
    const char* name;
    const char* role[8];  // buffer slot roles, for messages
    uint8_t access[8];    // SlotAccess bits per buffer slot
};
// nullptr for a code outside the format; the reserved fused codes have a name only.
const OpFormat* op_format(int32_t op);

[[noreturn]] void step_fail(const Step& s, const std::string& what);

// Checks the step's own fields and weights (shapes, ranks, types the format demands)
// and sets need[i] to the bytes buffer slot i must hold (0 for an absent optional one).
void step_requirements(const Step& s, const WeightStore& ws, size_t need[8]);

// Static validation of a whole plan against any backend's buffers. size_of(id, bytes)
// returns false for an id the pool does not hold.
template <class SizeOf>
void validate_format(const Plan& plan, const WeightStore& ws, const std::string& pool_name, SizeOf size_of) {
    for (const Step& s : plan.steps) {
        const OpFormat* f = op_format(s.op);
        if (!f) step_fail(s, "unknown op code " + std::to_string(s.op));
        size_t need[8];
        step_requirements(s, ws, need);
        for (int i = 0; i < 8; ++i) {
            if (!f->access[i]) continue;
            const int id = s.buf[i];
            if ((f->access[i] & SLOT_OPTIONAL) && id < 0) continue;
            size_t have = 0;
            if (!size_of(id, have))
                step_fail(s, std::string(f->role[i]) + " buffer " + std::to_string(id) + " is not in pool " + pool_name);
            if (have < need[i])
                step_fail(s, std::string(f->role[i]) + " buffer " + std::to_string(id) + " holds " + std::to_string(have) +
                                 " bytes, needs " + std::to_string(need[i]));
        }
    }
}

}  // namespace minfer
