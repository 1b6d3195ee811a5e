// Mixture-of-experts kernels for the CPU backend: the router's top-k selection and
// weights, the grouped expert matmul (MATMUL_ID, llama.cpp's mul_mat_id shape) and the
// weighted sum of the experts' outputs. Step fields: common/plan.h.
//
// Like the other kernels each takes (ith, nth) and does its share; the grouped matmul
// also meets the team inside the step (a `sync` callback) where a batch's activation
// rows are gathered per expert.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/plan.h"
#include "cpu/repack.h"

namespace minfer::cpu::moe {

// y = 1 / (1 + exp(-x)), n values.
void sigmoid_f32(const float* x, float* y, int64_t n, int ith, int nth);

// Per token t of nt, the ids of the k largest of logits[t * n_expert ..] (best first;
// equal values: the lower id first; NaN ranks below every number), as i32.
void topk_ids(const float* logits, int32_t* ids, int64_t n_expert, int64_t k, int64_t nt, int ith, int nth);

// The routing weights of that same selection (gating, norm, scale: plan.h MOE_WEIGHTS).
void topk_weights(const float* logits, float* w, int64_t n_expert, int64_t k, int64_t nt, int gating, int norm,
                  float scale, int ith, int nth);

// y[t][i] = sum over j in order of w[t * k + j] * x[(t * k + j) * d + i].
void weighted_sum(const float* x, const float* w, float* y, int64_t d, int64_t k, int64_t nt, int ith, int nth);

// Shared scratch of the grouped matmul (one per executor run, sized before the team
// starts): activation rows and their summaries gathered expert by expert, and the
// gathered outputs before they go back to their (token, slot) rows.
struct Scratch {
    std::vector<uint8_t> act, meta;
    std::vector<float> out;
};
// Bytes / floats the grouped matmul needs for a step with nt tokens (nt * k rows; a
// decode step reads and writes its rows in place, but a plan's steps share one size).
// arb, meta_row: bytes per activation row and per row of summaries.
void scratch_need(int64_t nt, int64_t k, int64_t out, size_t arb, size_t meta_row, size_t& act, size_t& meta,
                  size_t& out_floats);

struct MatmulIdArgs {
    const Weight* w;               // ne0 = in, ne1 = out * n_expert
    const repack::Packed* packed;  // its repacked copy, or null (the GGUF rows)
    const uint8_t* act;            // x_rows activation rows of arb bytes (quantized, or f32)
    size_t arb;
    const uint8_t* meta;           // their summaries (meta_row bytes a row), or null
    size_t meta_row;
    const int32_t* ids;            // [nt][k]
    int64_t in, out, n_expert, k, nt, x_rows;
    float* y;                      // [nt * k][out]
};

// This thread's part of y = W[ids] x. Every thread builds the same expert -> rows table;
// with more than one token the activation rows are gathered per expert (between two
// sync() calls), so each selected expert's weights are read once per step for all its
// tokens. Work items are (expert, 16-row group) pairs in expert order, split in
// contiguous runs with stealing (state: nth zeroed counters). A slot whose id is outside
// [0, n_expert) gets a zero row (MOE_TOPK never writes one).
template <class Sync>
void matmul_id(const MatmulIdArgs& a, Scratch& sc, std::atomic<uint64_t>* state, int ith, int nth, Sync&& sync);

// The non-template part (moe.cpp): the table, the gather and the compute. sync_fn(ctx)
// meets the team.
void matmul_id_impl(const MatmulIdArgs& a, Scratch& sc, std::atomic<uint64_t>* state, int ith, int nth,
                    void (*sync_fn)(const void*), const void* sync_ctx);

template <class Sync>
void matmul_id(const MatmulIdArgs& a, Scratch& sc, std::atomic<uint64_t>* state, int ith, int nth, Sync&& sync) {
    using S = std::remove_reference_t<Sync>;
    matmul_id_impl(a, sc, state, ith, nth, [](const void* p) { (*(const S*)p)(); }, (const void*)&sync);
}

}  // namespace minfer::cpu::moe
