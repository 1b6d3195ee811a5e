// Non-matmul CPU kernels. Every kernel takes (ith, nth): it does its 1/nth share of
// the work and returns; the executor puts a barrier between steps. In-place use
// (y == x) is allowed for silu, rope and the element-wise ops.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace minfer::cpu {

void add_f32(const float* a, const float* b, float* y, int64_t n, int ith, int nth);
void mul_f32(const float* a, const float* b, float* y, int64_t n, int ith, int nth);
void silu_f32(const float* x, float* y, int64_t n, int ith, int nth);
// y = silu(g) * u in one pass; bit-identical to silu_f32 followed by mul_f32.
void swiglu_f32(const float* g, const float* u, float* y, int64_t n, int ith, int nth);

// nrows rows of d floats; w (d floats) may be null.
void rms_norm_f32(const float* x, const float* w, float* y, int64_t d, int64_t nrows,
                  float eps, int ith, int nth);

// RoPE over the first n_rot dims of each head; x and y are [nt][nh * hd], pos holds nt
// positions. style 0 (NeoX): element i pairs with i + n_rot/2; style 1 (normal, llama):
// elements 2i and 2i + 1 pair. Pair i turns by pos * freq_scale * base^(-2i/n_rot) /
// factors[i] (factors null: 1), and cos/sin are scaled by attn_factor (common/plan.h).
struct RopeExt {
    int style = 0;
    float freq_scale = 1.0f;
    float attn_factor = 1.0f;
    const float* factors = nullptr;  // n_rot/2 floats, or null
};
void rope_f32(const float* x, float* y, const int32_t* pos, int64_t nt, int64_t nh, int64_t hd, int64_t n_rot,
              float freq_base, const RopeExt& ext, int ith, int nth);

// Greedy pick over x[0..n): the first index of the maximum, or -1 when any value is
// NaN or +-Inf (the pick must never be the argmax of broken logits), or when n <= 0.
int64_t first_max_finite(const float* x, int64_t n);
// The min(k, n) largest of x[0..n), best first (equal values: the lower index first),
// written to ids; false (ids unspecified) when any value is NaN or +-Inf.
bool top_k_finite(const float* x, int64_t n, int64_t k, int64_t* ids);
// Embedding lookup from a (possibly quantized) weight table of row_bytes per row.
void get_rows_w(int32_t wtype, const void* table, size_t row_bytes, int64_t d,
                const int32_t* ids, int64_t n, float* y, int ith, int nth);
// Row selection from an f32 activation [rows][d].
void get_rows_f32(const float* x, int64_t d, const int32_t* ids, int64_t n, float* y,
                  int ith, int nth);

// Writes nt rows of k and v (kv_dim floats each) into rows cells[t] of the persistent
// regions kc, vc ([n_ctx][kv_dim] of kv_type: T_F32, or T_F16 rounded to nearest even).
void kv_store(const float* k, const float* v, const int32_t* cells, int64_t nt,
              int64_t kv_dim, void* kc, void* vc, int32_t kv_type, int ith, int nth);

struct AttnArgs {
    const float* q;      // [nt][q_stride], head h at q + h*hd
    int64_t q_stride;
    const void* k;       // [n_ctx][nkv*hd] of kv_type (T_F32 or T_F16)
    const void* v;       // [n_ctx][nkv*hd] of kv_type
    int32_t kv_type;
    const int32_t* pos;  // [nt] positions: token t sees cells [0, pos[t]] ...
    const int32_t* span; // ... unless span != null: token t's four ints (common/attn_span.h)
    float* out;          // [nt][nh*hd]
    int64_t nt, nh, nkv, hd, n_ctx;
    float scale;
    int64_t window = 0;   // > 0: each query sees at most its last `window` cells of the span
    float softcap = 0.0f; // > 0: scores s -> softcap * tanh(s / softcap)
};
// Causal GQA attention with an online softmax (prefill tiles queries, decode splits
// nothing but heads), accumulating in f32 whatever the KV element type. scratch is
// this thread's attention_scratch_floats() floats. next: a counter shared by the team,
// zero before the step, from which threads take work items heaviest first (null: a
// static round robin of the items).
size_t attention_scratch_floats(const AttnArgs& a);
void attention_f32(const AttnArgs& a, float* scratch, int ith, int nth, std::atomic<uint64_t>* next = nullptr);

// The dense-family element-wise ops (ops_dense.cpp). gelu: the tanh approximation,
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); geglu is bitwise gelu then mul.
void scale_f32(const float* x, float* y, float v, int64_t n, int ith, int nth);
void gelu_f32(const float* x, float* y, int64_t n, int ith, int nth);
void geglu_f32(const float* g, const float* u, float* y, int64_t n, int ith, int nth);
void softcap_f32(const float* x, float* y, float cap, int64_t n, int ith, int nth);
// y[t][0..width) = x[t][offset..offset + width) for nt rows of src_width floats.
void slice_f32(const float* x, float* y, int64_t width, int64_t nt, int64_t src_width, int64_t offset, int ith,
               int nth);

}  // namespace minfer::cpu
