// Launchers for the CUDA kernels (defined in the *.cu files, callable from host code).
// Every launcher enqueues on the current lane's stream (context.h) and counts itself;
// none synchronizes.
// Every kernel is deterministic: fixed work split, fixed reduction trees, no atomics
// on floats.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/ggml_types.h"

namespace minfer::cuda {

bool matvec_type_supported(int32_t wtype);

// Decode matvec: y[r] = dot(W row r, x) (+ bias[r]) (+ resid[r]) for r < rows. W rows
// of in_dim elements of a weight type, in the device layout (cuda/layout.h), row_bytes
// apart (in_dim a multiple of 32); x f32. Quantized weights meet an int8 copy of x
// (blocks of 32, like the CPU's Q8 activations) in __dp4a; F32/F16 weights meet x in f32.
// One launch computes several matrices against the same x (fused q|k|v, gate|up): each
// job's rows are bitwise what a separate launch gives. With W2 set, a job is a SwiGLU
// pair: y = silu(W x + bias) * (W2 x + bias2).
struct MvJob {
    const uint8_t* W = nullptr;
    size_t row_bytes = 0;
    int type = 0;
    int rows = 0;
    const float* bias = nullptr;
    const float* resid = nullptr;
    float* y = nullptr;
    const uint8_t* W2 = nullptr;
    size_t row_bytes2 = 0;
    int type2 = 0;
    const float* bias2 = nullptr;
    // Also write y's int8 copy (the next matvec's input, laid out as its scratch) here, by
    // a quantization launch after the matvec's. Needs one job, ncols == 1, rows % 32 == 0.
    int8_t* q_out = nullptr;
    float2* ds_out = nullptr;
};
constexpr int MV_MAX_JOBS = 4;
// A RoPE step's style and angles (plan.h ROPE): pair k of n_rot/2 at position p turns by
// p * scale * base^(-2k/n_rot) / factors[k], and its cos and sin are then times attn.
struct RopeCfg {
    float base = 10000.0f;
    float scale = 1.0f;
    float attn = 1.0f;
    const float* factors = nullptr;  // f32[n_rot / 2] on the device, or null
    int style = 0;                   // 0 NeoX (pair k: k, k + n_rot/2), 1 normal (2k, 2k + 1)
};
// The q|k|v launch's tail (one token, FUSE_ROPE): the q, k and v jobs of one launch also rope q and k into
// yq / yk and store roped k and v into the f16 KV cache row cells[0], bitwise as
// rope2_store does it. When n_rot and hd - n_rot are multiples of 4 (local), a head's
// rows are dealt to its blocks in whole rotated pairs and each block does its own rows;
// else the last block to finish a head's rows (an integer ticket per head, zero before
// and after every launch) does that head.
struct MvRopeStore {
    int role[MV_MAX_JOBS] = {0, 0, 0, 0};  // 0 none, 1 q, 2 k, 3 v
    float* yq = nullptr;
    float* yk = nullptr;
    const int32_t* pos = nullptr;
    const int32_t* cells = nullptr;
    void* kc = nullptr;
    void* vc = nullptr;
    int hd = 0, n_rot = 0;
    int64_t n_ctx = 0;
    RopeCfg cfg;
    int* tickets = nullptr;  // one per head of the q, k and v jobs, in job order (set: the tail is on)
    int* err = nullptr;
    int local = 0;  // each block ropes and stores its own rows, no tickets (set by matvec_multi)
    // Pair angles by position (rope_table: cs_rows positions of n_rot / 2 pairs), or null;
    // a position outside it is worked out as rope_cs does.
    const float2* cs_table = nullptr;
    int64_t cs_rows = 0;
};
// The (cos, sin) of every rotated pair at positions 0 .. rows - 1, as rope_cs gives
// them, into table (rows * n_rot / 2 float2): the decode q|k|v tail then loads a step's
// angles instead of working them out in double in every block of every layer.
void rope_table(float2* table, int64_t rows, int n_rot, const RopeCfg& cfg);
// scratch: matvec_scratch_bytes(in_dim, ncols) device bytes for the activations' int8
// copy. xq_ready: the copy is already there (written by the launch before), skip the
// quantization launch.
// ncols > 1 (one job, no W2): ncols tokens at once, x / y / resid / the scratch holding
// the tokens' rows one after another; each column's bits are those of ncols == 1 (the
// weights are read once for all of them: a speculative block costs little more than a
// single step).
// in_norm: x is an RMSNorm's output and the scratch holds that norm's deferred copy
// (rms_norm_copy): a quantized job's row sums are multiplied by the norm's scale. Any
// launch of a matvec reading such a norm does this, so its bits do not depend on the
// fusions.
void matvec_multi(const MvJob* jobs, int njobs, int64_t in_dim, const float* x, void* scratch, int ncols = 1,
                  bool xq_ready = false, const MvRopeStore* rope = nullptr, bool in_norm = false);
size_t matvec_scratch_bytes(int64_t in_dim, int64_t ncols = 1);
// The columns of such a block on the int8 tensor cores (k_mmq.cu) when there are at least
// mmq_min_cols() of them and the type has the kernel (the quantized ones): one launch
// reading the weights once, each column bitwise the matvec's. False: not taken (the
// caller launches the matvec's columns). xq / xds: the int8 copy as matvec_multi lays it
// out; xscale: the norm's per-column scales or null.
bool mmq_matvec(const MvJob& jb, int64_t in_dim, const int8_t* xq, const float2* xds, const float* xscale,
                int ncols);
bool mmq_type_supported(int32_t t);
int& mmq_min_cols();
// Launches of 2 to 8 columns of rows of at least this many units (default 0: all) take
// k_matvec_x4's layout; the GPU suite holds it to one row a warp through the testing hook.
int& x4_cols_min_units();
// RMSNorm rows whose readers are decode matvecs (d % 32 == 0, d <= kNormCopyMaxRow, nt
// rows of at most kRowExactMaxTokens): y bitwise rms_norm's, plus the rows' deferred
// int8 copy: q8 of x * w per 32-element group (no whole-row reduction in it), and each
// row's scale, which the matvec applies to its row sums. Scratch: the int8 copies and their (d, d * sum) pairs as matvec_multi
// reads them, the groups' sums of squares (nt * d / 32 doubles), the scales (nt floats).
constexpr int64_t kNormCopyMaxRow = 4096;
size_t norm_copy_bytes(int64_t d, int64_t nt = 1);
inline double* norm_copy_ss(void* scratch, int64_t d, int64_t nt) {
    return (double*)((uint8_t*)scratch + matvec_scratch_bytes(d, nt));
}
inline float* norm_copy_scale(void* scratch, int64_t d, int64_t nt) {
    return (float*)(norm_copy_ss(scratch, d, nt) + nt * (d / 32));
}
// early: the norm lets the next launch start at the norm's start, not after its wait (the
// executor's choice: when that launch is a q|k|v matvec that fits one wave, see
// mv_blocks_one_wave).
void rms_norm_copy(const float* x, const float* w, float* y, int64_t d, int64_t nt, float eps, void* scratch,
                   bool early = false);
// Whether a one-column decode matvec of `rows` rows, one a warp, fits one wave of the
// K-quant kernels (7 blocks of 4 warps an SM): the 0.5B's q|k|v (288 blocks) does, the
// 7B's (1,152) does not.
bool mv_blocks_one_wave(int64_t rows);

// W (rows x in_dim of wtype, device layout) -> f16 rows (prefill GEMM operand), on
// `stream` (the current lane's stream when null; the executor's side stream dequantizes
// the next GEMM's weight while the main one computes).
void dequant_f16(int32_t wtype, const void* W, size_t row_bytes, int64_t in_dim, int64_t rows, void* out_f16,
                 void* stream = nullptr);
// nbytes (a multiple of 16, both 16-byte aligned) from src to dst by `blocks` blocks of
// 256 threads: dst may be pinned host memory (a D2H made by the SMs, not a copy engine).
void copy_out(const void* src, void* dst, size_t nbytes, unsigned blocks);
// y[i] = f16(x[i]) (round to nearest); four at a time when n % 4 == 0 and both are 16/8-byte aligned.
void f32_to_f16(const float* x, void* y, int64_t n);
// y[t][o] += bias[o] (+ resid[t][o])
void add_bias_rows(float* y, const float* bias, int64_t nt, int64_t out_dim);

void add(const float* a, const float* b, float* y, int64_t n);
void mul(const float* a, const float* b, float* y, int64_t n);
void silu(const float* x, float* y, int64_t n);
void swiglu(const float* g, const float* u, float* y, int64_t n);
// The dense families' element-wise ops, as cpu/ops_dense.cpp defines them: y = x * v;
// y = cap * tanh(x / cap); GELU's tanh approximation; gelu(g) * u (bitwise gelu then mul);
// and the column slice y[t] = x[t][offset, offset + width) of rows of src_width.
void scale(const float* x, float* y, float v, int64_t n);
void softcap(const float* x, float* y, float cap, int64_t n);
void gelu(const float* x, float* y, int64_t n);
void geglu(const float* g, const float* u, float* y, int64_t n);
void slice_cols(const float* x, float* y, int64_t width, int64_t nt, int64_t src_width, int64_t offset);
// yh: also write y's f16 copy there (bitwise what f32_to_f16 of y gives). d <= kRmsMaxRow.
constexpr int64_t kRmsMaxRow = 32768;
void rms_norm(const float* x, const float* w, float* y, int64_t d, int64_t nrows, float eps, void* yh = nullptr);
// Either style; dims past n_rot pass through.
void rope(const float* x, float* y, const int32_t* pos, int64_t nt, int64_t nh, int64_t hd, int64_t n_rot,
          const RopeCfg& cfg, int* err);
struct RopeStoreArgs {
    const float* xq; float* yq; int64_t nhq;
    const float* xk; float* yk; int64_t nhk;
    const float* v;
    const int32_t* pos; const int32_t* cells;
    int64_t nt, hd, n_rot, n_ctx;
    RopeCfg cfg;
    void* kc; void* vc;
    int* err;
    // With norm: q and k are first RMS-normalized per head (QK_NORM: weights wq / wk of
    // hd, eps_q / eps_k), one warp a head, bitwise rms_norm's rows.
    bool norm = false;
    const float* wq = nullptr;
    const float* wk = nullptr;
    float eps_q = 0.0f, eps_k = 0.0f;
    // Pair angles by position (rope_table, for this cfg and n_rot), or null: the same
    // values rope_cs gives.
    const float2* cs_table = nullptr;
    int64_t cs_rows = 0;
};
// rope(q), rope(k), and the KV store of roped k and v, in one launch (bitwise the same
// as rope twice and kv_store_f16; with norm, as qk_norm twice before them).
void rope2_store(const RopeStoreArgs& a);
void get_rows_w(int32_t wtype, const void* table, size_t row_bytes, int64_t d, const int32_t* ids, int64_t n,
                int64_t n_rows, float* y, int* err);
void get_rows_f32(const float* x, int64_t d, const int32_t* ids, int64_t n, int64_t n_src, float* y, int* err);
// K/V regions hold f16 [n_ctx][kv_dim].
void kv_store_f16(const float* k, const float* v, const int32_t* cells, int64_t nt, int64_t kv_dim, int64_t n_ctx,
                  void* kc, void* vc, int* err);

struct AttnDev {
    const float* q; int64_t q_stride;
    const void* k; const void* v;   // f16 [n_ctx][nkv*hd]
    const int32_t* pos; const int32_t* span;
    float* out;
    int64_t nt, nh, nkv, hd, n_ctx;
    // Cells one sequence may span (0: n_ctx), which sizes the decode splits: a row's
    // splits are cut from its own first cell in chunks fixed by this alone, so its bits
    // do not depend on where its cells lie or how many sequences share the arena.
    int64_t seq_ctx = 0;
    float scale;
    // Sliding window (> 0: a row sees only the last `window` cells of its span) and the
    // scores' soft-cap (> 0: s -> softcap * tanh(s / softcap)), as plan.h's ATTN.
    int64_t window = 0;
    float softcap = 0.0f;
    // Also write out's int8 copy (the next matvec's input, laid out as its scratch).
    int8_t* q_out = nullptr;
    float2* ds_out = nullptr;
};
bool attn_head_dim_supported(int64_t hd);
// Up to this many token rows, matmuls run the decode matvec with the rows as columns
// (each column bitwise the one-token result) and attention splits the KV as a
// single-token step does, so every row's logits are bitwise those of decoding it alone:
// speculative verification blocks (and small batches) then pick exactly what plain
// greedy decoding picks, and every sequence of a batched server step gets the tokens it
// would get alone. Larger blocks (prefill) take the f16 GEMM path.
constexpr int64_t kRowExactMaxTokens = 64;
// Splits over KV a decode step uses (depends on nt and the cells one sequence may span,
// seq_ctx, or n_ctx where that is 0; never on positions).
int attn_splits(int64_t nt, int64_t n_ctx, int64_t seq_ctx);
// scratch: attn_scratch_floats() floats of chunk partials; tickets: attn_tickets()
// ints, zero before the first launch and left zero by every launch (the last chunk of
// a (token, head) to finish merges them and resets its ticket). One launch either way.
size_t attn_scratch_floats(int64_t nt, int64_t nh, int64_t hd, int64_t n_ctx, int64_t seq_ctx);
size_t attn_tickets(int64_t nt, int64_t nh, int64_t n_ctx, int64_t seq_ctx);
void attention(const AttnDev& a, float* scratch, int* tickets, int* err);
// Diagnostics (executor's MINFER_CUDA_DIAG_SKIP): an empty kernel that only waits for
// the launch before it and lets the next one launch.
void null_launch(unsigned blocks, unsigned threads);
// Blocks of more than kRowExactMaxTokens rows on the tensor cores (f16 Q and P), head
// dims 32, 64, 96, 128; false (nothing launched) for what it does not take.
bool attention_prefill(const AttnDev& a, int* err);

// Index of the largest of x[0..n) (first on ties) -> *out; writes -1 - code (<= -2)
// if the device error word is set, else kArgmaxNonFinite if any x is NaN or Inf, so
// one 4-byte readback carries all three.
constexpr int32_t kArgmaxNonFinite = -1;
// rows > 1: rows consecutive rows of n, one answer each (out[0..rows)), in one launch.
constexpr int kArgmaxMaxRows = 64;
void argmax(const float* x, int64_t n, int32_t* out, const int* err, int rows = 1);
// Allocates the current lane's argmax scratch now (outside any capture that may record
// an argmax; else the first argmax does).
void argmax_ready();

// Sampling's candidates (k_topk.cu): for each of `rows` consecutive rows of n values, the
// k best (value descending, equal values by the lower index: the CPU top_k's order) and
// the values at g gather ids (gather: rows x g device ints, -1 for none). Row r of `out`
// is topk_row_words(kcap, gcap) ints: a flag (0; 1 when a value is NaN or Inf; -1 - code
// when the device error word is set), kcap ids, kcap values (float bits), gcap gathered
// values. scratch: topk_scratch_bytes(n, rows, k) device bytes, zero at allocation (its
// flags are left zero by every call). rows <= kArgmaxMaxRows. Two launches.
constexpr int kTopKMax = 256;
// A token mask applied in place (k_topk.cu): for each j < m, the ids of row rows[j]
// (of n values) whose bit in words[j] (ceil(n/32) words, bit i%32 of word i/32) is 0
// become kMaskedLogit, below any logit and finite, so argmax and top_k pick the allowed
// ids only, as the host's masked pick does. NaN and Inf are left for those to flag.
constexpr float kMaskedLogit = -3.0e38f;
void mask_rows(float* x, int64_t n, int m, const int32_t* rows, const uint32_t* words);
constexpr size_t topk_row_words(int kcap, int gcap) { return 1 + 2 * (size_t)kcap + gcap; }
size_t topk_scratch_bytes(int64_t n, int rows, int k);
void top_k(const float* x, int64_t n, int rows, int k, const int32_t* gather, int g, void* scratch, int32_t* out,
           int kcap, int gcap, const int* err);

// Profiling only (MINFER_CUDA_STAMP=1): one thread writes the device clock (ns) into *slot
// once every kernel before it on the stream has finished.
void stamp(int64_t* slot);

// ---- mixture of experts (common/plan.h's MoE steps, as cpu/moe.cpp computes them) ----

// Decode MATMUL_ID (k_matvec.cu; blocks of at most kRowExactMaxTokens tokens): for slot p =
// t * k + j, y[p][r] = dot(W row ids[p] * out + r, x row t (x_rows == nt) or p), r < out;
// W holds n_expert * out rows of `type` in the device layout, row_bytes apart. The ids are
// read on the device, one launch for every slot. Quantized weights meet x's int8 copy in
// scratch (matvec_scratch_bytes(in_dim, x_rows); made by a quantization launch unless
// xq_ready; in_norm: a decode RMSNorm's deferred copy, as matvec_multi reads it). With W2
// (the up tensor: same shape, type and stride), y = silu(W x) * (W2 x), bitwise the two
// launches and SWIGLU. A slot's rows do not depend on the block's other slots, so a
// speculative block's rows are those of single steps. An id outside [0, n_expert) gives
// a zero row.
struct MvIdJob {
    const uint8_t* W = nullptr;
    const uint8_t* W2 = nullptr;
    size_t row_bytes = 0;
    int type = 0;
    int out = 0, n_expert = 0, k = 0, nt = 0;
    int64_t x_rows = 0;
    const int32_t* ids = nullptr;  // [nt][k]
    float* y = nullptr;            // [nt * k][out]
    // With W2 and out % 32 == 0: also y's int8 copy (the down matvec's input, a column
    // per slot, laid out as its scratch), made inside this launch: a block takes 32 rows
    // of one slot and quantizes them with quant_block_q8 as k_quant_q8 would.
    int8_t* q_out = nullptr;
    float2* ds_out = nullptr;
};
void matvec_id(const MvIdJob& j, int64_t in_dim, const float* x, void* scratch, bool xq_ready = false,
               bool in_norm = false);
// The same expert matvec (no W2) followed by MOE_SUM of its rows (rows of j.out, weights
// w [nt][k]) into y_sum, plus resid after the sum when set (resid may be y_sum), in one
// launch: a block takes one output row of one token for all its k slots, each slot's
// row as matvec_id computes it (j.y still receives them), then the weighted sum in slot
// order as moe_sum does. Bitwise matvec_id then moe_sum.
void matvec_id_sum(const MvIdJob& j, int64_t in_dim, const float* x, void* scratch, bool xq_ready, bool in_norm,
                   const float* w, const float* resid, float* y_sum);

// The decode router: the router's MATMUL (nt <= kRowExactMaxTokens rows of in_dim, no
// bias) writing its logits, and MOE_TOPK / MOE_WEIGHTS of those logits, in one launch:
// each row is the plain matvec's bits, and the block that finishes last (an integer
// ticket, zero before and after) routes every token as moe_route does. Same scratch,
// xq_ready and in_norm contract as matvec_id.
struct MvRouteJob {
    const uint8_t* W = nullptr;
    size_t row_bytes = 0;
    int type = 0;
    int n_expert = 0, nt = 0;
    float* logits = nullptr;  // [nt][n_expert]
    int* ticket = nullptr;
    int32_t* ids = nullptr;   // [nt][k] or null
    float* w = nullptr;       // [nt][k] or null
    int k = 0, gating = 0, norm = 0;
    float scale = 0.0f;
};
void matvec_route(const MvRouteJob& j, int64_t in_dim, const float* x, void* scratch, bool xq_ready = false,
                  bool in_norm = false);
// The routers matvec_route takes: the types routers come in (llama.cpp keeps them F32),
// up to 256 experts. Others run as their steps.
inline bool route_fusable(int type, int64_t n_expert) {
    return (type == T_F32 || type == T_F16 || type == T_Q8_0) && n_expert <= 256;
}

// k_moe.cu. SIGMOID: y = 1 / (1 + exp(-x)).
void sigmoid(const float* x, float* y, int64_t n);
// MOE_TOPK (ids) and / or MOE_WEIGHTS (w; gating 1..3, norm, scale) of nt rows of
// n_expert router logits, in one launch: either output may be null.
// k <= kRouteMaxK, n_expert <= kRouteMaxExperts (one warp holds a token's logits).
constexpr int64_t kRouteMaxK = 32;
constexpr int64_t kRouteMaxExperts = 1024;
void moe_route(const float* logits, int32_t* ids, float* w, int64_t n_expert, int64_t k, int64_t nt, int gating,
               int norm, float scale);
// MOE_SUM: y[t] = sum over j in order of w[t][j] * x[t * k + j] (rows of d); with resid,
// y = resid + that sum, bitwise MOE_SUM then ADD (resid may be y).
void moe_sum(const float* x, const float* w, float* y, int64_t d, int64_t k, int64_t nt, const float* resid = nullptr);
// Prefill MATMUL_ID (blocks of more than kRowExactMaxTokens tokens), without a host read
// of the ids: moe_group sorts the n_slots = nt * k slots by expert into `groups`
// (moe_group_bytes(n_expert, n_slots) device bytes; two launches), then matmul_id_tiled
// multiplies each expert's rows by its slots' x rows (f16 operands, f32 accumulation,
// the dense prefill GEMM's arithmetic) in one launch sized for any routing. A grouping
// serves every MATMUL_ID of the same ids, n_expert and nt * k.
size_t moe_group_bytes(int64_t n_expert, int64_t n_slots);
void moe_group(const int32_t* ids, int64_t n_slots, int64_t n_expert, void* groups);
void matmul_id_tiled(int32_t wtype, const void* W, size_t row_bytes, int64_t in_dim, int64_t out, int64_t n_expert,
                     int64_t k, int64_t nt, int64_t x_rows, const float* x, void* groups, float* y);

}  // namespace minfer::cuda
