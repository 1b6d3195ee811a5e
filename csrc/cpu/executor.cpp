// Runs a lowered plan: one OpenMP parallel region for the whole plan, threads meeting
// between steps only where a later step depends on an earlier one (the ggml model, with
// the barriers a hazard analysis proves unnecessary left out).
//
// Everything op-specific lives in one table (kCpuOps): how a step runs, which host-filled
// index data it checks before a run, whether it reads its input through the quantized
// activation memo, and what scratch it needs. What a step reads and writes and how big
// its buffers must be comes from the shared format (common/plan.h). Validation, data
// checks, barrier planning and execution all walk those two tables.
#include "cpu/executor.h"

#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/attn_span.h"
#include "cpu/moe.h"
#include "cpu/ops.h"
#include "cpu/quants.h"
#include "cpu/repack.h"
#include "cpu/step_barrier.h"
#include "cpu/step_stats.h"
#include "cpu/thread_pin.h"
#include "cpu/vec_math.h"
#include "cpu/work_split.h"

namespace minfer::cpu {

namespace {

struct Scratch {
    std::vector<uint8_t> act[2];    // quantized activations: [0] Q8_0 family, [1] Q8_K
    std::vector<uint8_t> meta[2];   // their per-block summaries for the repacked kernels
    std::vector<float> attn;        // nth * per-thread attention scratch
    moe::Scratch moe;               // the grouped expert matmul's gathered rows (MATMUL_ID)
};

struct ScratchNeed {
    size_t act[2] = {0, 0};   // bytes per activation slot
    size_t meta[2] = {0, 0};  // bytes of its summaries (repack::act_meta)
    size_t attn = 0;          // floats per thread
    size_t moe_act = 0, moe_meta = 0, moe_out = 0;  // moe::Scratch (bytes, bytes, floats)
};

// The quantized-activation memo: which input (buffer, row count) each scratch slot
// holds. A matmul whose input is already there skips quantizing it (q, k, v and gate,
// up share one input). run_plan keeps one per thread and plan_barriers simulates one;
// both go through enter() and leave(), so the simulation cannot drift from the run.
struct ActMemo {
    int src[2] = {-1, -1};
    int64_t nt[2] = {0, 0};

    // Called by a step that reads its input through slot: true if it must quantize
    // first (the memo then records the new contents).
    bool enter(int slot, const Step& s) {
        if (src[slot] == s.buf[1] && nt[slot] == s.ip[2]) return false;
        src[slot] = s.buf[1];
        nt[slot] = s.ip[2];
        return true;
    }
    // After every step. A step that writes a buffer a slot was quantized from makes that
    // slot stale; steps that do not use the memo drop it outright (cheap and obviously
    // safe: only runs of memo users profit from it).
    void leave(const Step& s, bool memo_user) {
        for (int k = 0; k < 2; ++k)
            if (!memo_user || src[k] == s.buf[0]) src[k] = -1;
    }
};

struct Ctx {
    const Step& s;
    Pool& pool;
    const WeightStore& ws;
    Scratch& scratch;
    size_t attn_floats;
    ActMemo& memo;
    StepBarrier& barrier;
    std::atomic<uint64_t>* work;  // this step's nth shared work counters, zero before it runs
    stats::StepClock* clock;     // null unless MINFER_CPU_STATS is on
    int ith, nth;

    // A barrier inside a step (after quantizing activations), timed when stats are on.
    void sync() const {
        if (!clock) return barrier.wait();
        const uint64_t t0 = stats::now_ns();
        barrier.wait();
        const uint64_t t1 = stats::now_ns();
        clock->waited += t1 - t0;
        clock->syncs += 1;
        clock->sync_at = t0;
    }

    float* F(int slot) const { return (float*)pool.data(s.buf[slot]); }
    const int32_t* I(int slot) const { return (const int32_t*)pool.data(s.buf[slot]); }
    const int64_t* ip() const { return s.ip; }
};

struct CpuOp {
    void (*run)(const Ctx&);
    // Checks the host-filled index inputs (ids, positions, cells) before every run; ""
    // if fine. Null for ops with none.
    std::string (*check_data)(const Step&, const Pool&);
    // The activation scratch slot the step reads its input through, or -1 (reads buf[1]
    // as f32). Null for ops that never use the memo.
    int (*act_slot)(const Step&, const WeightStore&);
    void (*scratch)(const Step&, const WeightStore&, ScratchNeed&);
    // CPU limits beyond the format (null: none).
    void (*check)(const Step&, const WeightStore&);
};

// ---- index data checks --------------------------------------------------------------

bool ids_in_range(const int32_t* ids, int64_t n, int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < lo || ids[i] >= hi) return false;
    return true;
}
const int32_t* idata(const Step& s, const Pool& pool, int slot) { return (const int32_t*)pool.data(s.buf[slot]); }

std::string data_get_rows_w(const Step& s, const Pool& pool) {
    if (!ids_in_range(idata(s, pool, 1), s.ip[1], 0, s.ip[2]))
        return "token id outside the vocabulary [0, " + std::to_string(s.ip[2]) + ")";
    return {};
}
std::string data_get_rows(const Step& s, const Pool& pool) {
    if (!ids_in_range(idata(s, pool, 2), s.ip[1], 0, s.ip[2])) return "row id outside [0, " + std::to_string(s.ip[2]) + ")";
    return {};
}
std::string data_kv_store(const Step& s, const Pool& pool) {
    if (!ids_in_range(idata(s, pool, 3), s.ip[0], 0, s.ip[2]))
        return "KV cell outside the context [0, " + std::to_string(s.ip[2]) + ")";
    return {};
}
std::string data_attn(const Step& s, const Pool& pool) {
    const int64_t* ip = s.ip;
    if (!ids_in_range(idata(s, pool, 4), ip[0], 0, ip[4])) return "position outside the context [0, " + std::to_string(ip[4]) + ")";
    if (s.buf[5] >= 0) {
        const int32_t* sp = idata(s, pool, 5);
        for (int64_t t = 0; t < ip[0]; ++t)
            if (!span_ok(sp + kSpanInts * t, ip[4])) return "attention span outside the context";
    }
    return {};
}

// ---- kernels ------------------------------------------------------------------------

void run_add(const Ctx& c) { add_f32(c.F(1), c.F(2), c.F(0), c.ip()[0], c.ith, c.nth); }
void run_mul(const Ctx& c) { mul_f32(c.F(1), c.F(2), c.F(0), c.ip()[0], c.ith, c.nth); }
void run_silu(const Ctx& c) { silu_f32(c.F(1), c.F(0), c.ip()[0], c.ith, c.nth); }
void run_swiglu(const Ctx& c) { swiglu_f32(c.F(1), c.F(2), c.F(0), c.ip()[0], c.ith, c.nth); }
void run_norm(const Ctx& c) {
    const float* w = c.s.w[0] >= 0 ? (const float*)c.ws.get(c.s.w[0]).data : nullptr;
    rms_norm_f32(c.F(1), w, c.F(0), c.ip()[0], c.ip()[1], c.s.fp[0], c.ith, c.nth);
}

// The rows of an output a thread computes: contiguous, multiples of 4 (whole tiles).
// argmax_f32 relies on using the same split as the matmul.
std::pair<int64_t, int64_t> row_range(int64_t rows, int ith, int nth) {
    int64_t r0, r1;
    vm::share(rows, ith, nth, 4, r0, r1);
    return {r0, r1};
}

int act_slot_of_type(int32_t wtype) {
    int32_t a = act_type_for(wtype);
    return a == T_Q8_K ? 1 : (a == T_Q8_0 ? 0 : -1);
}
int matmul_act_slot(const Step& s, const WeightStore& ws) { return act_slot_of_type(ws.get(s.w[0]).type); }

void matmul_scratch(const Step& s, const WeightStore& ws, ScratchNeed& n) {
    const Weight& w = ws.get(s.w[0]);
    const int slot = act_slot_of_type(w.type);
    if (slot < 0) return;
    n.act[slot] = std::max(n.act[slot], act_row_bytes(w.type, s.ip[0]) * (size_t)s.ip[2]);
    const int32_t at = act_type_for(w.type);
    const size_t blocks = (size_t)(s.ip[0] / type_block_elems(at)) * (size_t)s.ip[2];
    n.meta[slot] = std::max(n.meta[slot], repack::meta_block_bytes(at) * blocks);
}

// Bytes of summaries per activation block that quantizing must also write (0: none):
// only the repacked kernels read them, and only on the SIMD path. Whatever weight
// quantizes a slot, a later matmul sharing it may be a repacked one, so this depends on
// the activation type alone.
size_t meta_bytes_for(int32_t wtype) {
    return vm::use_simd() ? repack::meta_block_bytes(act_type_for(wtype)) : 0;
}

// The unpacked path: 16-row x 4-token tiles over the GGUF-layout rows [r0, r1).
void matmul_tiles(const Weight& w, int64_t in, int64_t nt, const uint8_t* act, size_t arb, float* y, int64_t out,
                  int64_t r0, int64_t r1) {
    constexpr int RB = 16, TB = 4;
    for (int64_t r = r0; r < r1; r += RB) {
        const int nw = (int)std::min<int64_t>(RB, r1 - r);
        for (int64_t t = 0; t < nt; t += TB) {
            const int na = (int)std::min<int64_t>(TB, nt - t);
            vec_dot_tile(w.type, in, w.data + r * w.row_bytes, w.row_bytes, nw, act + t * arb, arb, na,
                         y + t * out + r, (size_t)out);
        }
    }
}

// The repacked copy the matmul uses, if the weight has one and the SIMD path is on
// (the scalar path always reads the GGUF layout).
std::shared_ptr<const repack::Packed> packed_of(const Weight& w) {
    if (!vm::use_simd()) return nullptr;
    return std::static_pointer_cast<const repack::Packed>(std::atomic_load(&w.prepared));
}

// Once a weight has its repacked copy, the GGUF pages it was read from are dropped from
// this process (whole pages inside the tensor only): the SIMD matmul never reads them
// again, so keeping them would hold the weight twice (measured: peak RSS of a 64-token
// generation 557 -> 855 MiB with the copies). Only for a read-only file mapping, whose
// pages fault back from the file if a later reader (the scalar path) wants them;
// DONTNEED on anonymous memory would zero it.
void release_pages(const Weight& w) {
    if (!w.file_backed) return;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)w.data + page - 1) / page * page, b = ((uintptr_t)w.data + w.nbytes) / page * page;
    if (b > a) madvise((void*)a, b - a, MADV_DONTNEED);
}

// Weights that a plan multiplies with get their repacked copy here, once, before any
// thread runs. A table the plan also reads rows from (a tied embedding) is packed too
// when it lives in a file mapping: its GGUF pages leave the process as they are packed
// and only the rows the embedding lookups read fault back (a page per token), so the
// logits head, the largest single read of a decode step, streams the packed layout
// (Llama-3.2-1B shape, 1 thread, Zen 4: the 215 MB Q6_K head 10.6 -> 9.4 ms a token). A table
// in anonymous memory stays as it is: a second copy would cost its full size.
void prepare_packed(const Plan& plan, const WeightStore& ws, int n_threads) {
    std::vector<int> tables;
    for (const Step& s : plan.steps)
        if (s.op == OP_GET_ROWS_W) tables.push_back(s.w[0]);
    static std::mutex mu;
    for (const Step& s : plan.steps) {
        if (s.op != OP_MATMUL && s.op != OP_MATMUL_ID) continue;
        const Weight& w = ws.get(s.w[0]);
        if (!w.file_backed && std::find(tables.begin(), tables.end(), s.w[0]) != tables.end()) continue;
        if (!repack::packable(w.type) || std::atomic_load(&w.prepared)) continue;
        std::lock_guard<std::mutex> lock(mu);
        if (std::atomic_load(&w.prepared)) continue;
        std::shared_ptr<const void> p = repack::pack(w.type, w.data, w.ne0, w.ne1, n_threads, w.file_backed);
        std::atomic_store(&w.prepared, p);
        release_pages(w);
    }
}

void add_bias(const float* b, float* y, int64_t out, const Rect& R) {
    for (int64_t t = R.t0; t < R.t1; ++t)
        for (int64_t r = R.r0; r < R.r1; ++r) y[t * out + r] += b[r];
}

// This thread's share of quantizing nt activation rows (x: nt rows of `in` floats; q:
// nt rows of arb bytes). Whole rows while there are at least as many rows as threads;
// otherwise (decode) the rows' blocks are split, so one thread no longer quantizes a
// 4864-wide row while the others wait. Blocks are quantized independently, so the bytes
// are the same either way.
// With meta (mbb bytes per block, see meta_bytes_for), the same thread also writes the
// summaries of the blocks it quantized, once for every thread and matmul that reads them.
void quantize_share(int32_t wtype, const float* x, uint8_t* q, int64_t in, size_t arb, int64_t nt, int ith, int nth,
                    uint8_t* meta, size_t mbb) {
    const int32_t at = act_type_for(wtype);
    const int64_t be = type_block_elems(at), nblk = in / be;
    const size_t bb = arb / (size_t)nblk;
    if (nt >= nth) {
        for (int64_t t = ith; t < nt; t += nth) {
            quantize_act_row(wtype, x + t * in, q + t * arb, in);
            if (mbb) repack::act_meta(at, q + t * arb, nblk, meta + (size_t)t * nblk * mbb);
        }
        return;
    }
    const int64_t n = nt * nblk, i0 = n * ith / nth, i1 = n * (ith + 1) / nth;
    for (int64_t i = i0; i < i1;) {
        const int64_t t = i / nblk, b0 = i % nblk, b1 = std::min(nblk, b0 + (i1 - i));
        quantize_act_row(wtype, x + t * in + b0 * be, q + t * arb + b0 * bb, (b1 - b0) * be);
        if (mbb) repack::act_meta(at, q + t * arb + b0 * bb, b1 - b0, meta + (size_t)(t * nblk + b0) * mbb);
        i = t * nblk + b1;
    }
}

// A matmul's input rows (buf[1]: ip[2] rows of `in` floats) in the form its weight type
// multiplies: f32 as they are, else quantized into the memo's scratch slot (by the team,
// then a barrier) unless the slot already holds them.
struct ActRows {
    const uint8_t* act;
    size_t arb;
    const uint8_t* meta = nullptr;  // the activations' summaries (repack::act_meta)
    size_t meta_row = 0;
};
ActRows act_rows(const Ctx& c, const Weight& w, int64_t in, int64_t nt) {
    const Step& s = c.s;
    const int slot = act_slot_of_type(w.type);
    if (slot < 0) return {(const uint8_t*)c.F(1), (size_t)in * 4};
    ActRows r{c.scratch.act[slot].data(), act_row_bytes(w.type, in)};
    uint8_t* q = c.scratch.act[slot].data();
    const size_t mbb = meta_bytes_for(w.type);
    if (c.memo.enter(slot, s)) {
        quantize_share(w.type, c.F(1), q, in, r.arb, nt, c.ith, c.nth, c.scratch.meta[slot].data(), mbb);
        c.sync();
    }
    if (mbb) {
        r.meta = c.scratch.meta[slot].data();
        r.meta_row = mbb * (size_t)(in / type_block_elems(act_type_for(w.type)));
    }
    return r;
}

void run_matmul(const Ctx& c) {
    const Step& s = c.s;
    const Weight& w = c.ws.get(s.w[0]);
    const int64_t in = s.ip[0], out = s.ip[1], nt = s.ip[2];
    const ActRows ar = act_rows(c, w, in, nt);
    const uint8_t* act = ar.act;
    const size_t arb = ar.arb;
    const uint8_t* meta = ar.meta;
    const size_t meta_row = ar.meta_row;
    float* y = c.F(0);
    const float* bias = s.w[1] >= 0 ? (const float*)c.ws.get(s.w[1]).data : nullptr;
    if (const auto pk = packed_of(w)) {
        // Repacked weights (cpu/repack.h): (16-row group, token tile) items, cpu/work_split.h.
        const int64_t tile = repack::token_tile();
        auto run_rect = [&](const Rect& R) {
            repack::matmul(*pk, act + R.t0 * arb, arb, R.t1 - R.t0, y + R.t0 * out, out, R.r0, R.r1,
                           meta ? meta + R.t0 * meta_row : nullptr);
            if (bias) add_bias(bias, y, out, R);
        };
        if (c.nth == 1 || split_items(out, nt, tile) >= (int64_t(1) << 31)) {
            Rect rects[3];
            const int k = matmul_split(out, nt, tile, c.ith, c.nth, rects);
            for (int i = 0; i < k; ++i) run_rect(rects[i]);
            return;
        }
        const int stolen = steal_walk(out, nt, tile, c.ith, c.nth, c.work, [&](const Rect& R, bool) { run_rect(R); });
        if (c.clock) c.clock->stolen += stolen;
        return;
    }
    // Rows split into contiguous per-thread ranges (multiples of 4 keep tiles whole).
    const auto [r0, r1] = row_range(out, c.ith, c.nth);
    matmul_tiles(w, in, nt, act, arb, y, out, r0, r1);
    if (bias && r1 > r0) add_bias(bias, y, out, Rect{r0, r1, 0, nt});
}

void check_matmul(const Step& s, const WeightStore& ws) {
    const Weight& w = ws.get(s.w[0]);
    if (!weight_type_supported(w.type)) step_fail(s, "weight " + w.name + ": the cpu backend cannot compute with type " + std::to_string(w.type));
}

void run_get_rows_w(const Ctx& c) {
    const Weight& w = c.ws.get(c.s.w[0]);
    get_rows_w(w.type, w.data, w.row_bytes, c.ip()[0], c.I(1), c.ip()[1], c.F(0), c.ith, c.nth);
}
void run_get_rows(const Ctx& c) { get_rows_f32(c.F(1), c.ip()[0], c.I(2), c.ip()[1], c.F(0), c.ith, c.nth); }
void run_rope(const Ctx& c) {
    const int64_t* ip = c.ip();
    RopeExt ext;
    ext.style = (int)ip[4];
    if (c.s.fp[1] != 0.0f) ext.freq_scale = c.s.fp[1];
    if (c.s.fp[2] != 0.0f) ext.attn_factor = c.s.fp[2];
    if (c.s.w[0] >= 0) ext.factors = (const float*)c.ws.get(c.s.w[0]).data;
    rope_f32(c.F(1), c.F(0), c.I(2), ip[0], ip[1], ip[2], ip[3], c.s.fp[0], ext, c.ith, c.nth);
}

void run_kv_store(const Ctx& c) {
    const int64_t* ip = c.ip();
    kv_store(c.F(1), c.F(2), c.I(3), ip[0], ip[1], c.F(0), c.F(4), (int32_t)ip[3], c.ith, c.nth);
}

AttnArgs attn_args(const Step& s) {
    AttnArgs a{};
    a.nt = s.ip[0]; a.nh = s.ip[1]; a.nkv = s.ip[2]; a.hd = s.ip[3]; a.n_ctx = s.ip[4]; a.q_stride = s.ip[5];
    a.kv_type = (int32_t)s.ip[6];
    a.scale = s.fp[0];
    a.window = s.ip[7];
    a.softcap = s.fp[1];
    return a;
}
void attn_scratch(const Step& s, const WeightStore&, ScratchNeed& n) {
    n.attn = std::max(n.attn, attention_scratch_floats(attn_args(s)));
}
void run_attn(const Ctx& c) {
    AttnArgs a = attn_args(c.s);
    a.q = c.F(1); a.k = c.F(2); a.v = c.F(3); a.pos = c.I(4);
    a.span = c.s.buf[5] >= 0 ? c.I(5) : nullptr;
    a.out = c.F(0);
    // Each thread's scratch on its own cache lines (attn_floats is a multiple of 16): the
    // running max and sum at its start are rewritten every KV block, and the vector's
    // 16-byte alignment let that line also hold the end of the previous thread's region.
    float* base = (float*)(((uintptr_t)c.scratch.attn.data() + 63) & ~(uintptr_t)63);
    attention_f32(a, base + c.attn_floats * c.ith, c.ith, c.nth, c.work);
}

// ---- mixture of experts (cpu/moe.h) ---------------------------------------------------

void run_sigmoid(const Ctx& c) { moe::sigmoid_f32(c.F(1), c.F(0), c.ip()[0], c.ith, c.nth); }
void run_moe_topk(const Ctx& c) {
    const int64_t* ip = c.ip();
    moe::topk_ids(c.F(1), (int32_t*)c.F(0), ip[0], ip[1], ip[2], c.ith, c.nth);
}
void run_moe_weights(const Ctx& c) {
    const int64_t* ip = c.ip();
    moe::topk_weights(c.F(1), c.F(0), ip[0], ip[1], ip[2], (int)ip[3], (int)ip[4], c.s.fp[0], c.ith, c.nth);
}
void run_moe_sum(const Ctx& c) {
    const int64_t* ip = c.ip();
    moe::weighted_sum(c.F(1), c.F(2), c.F(0), ip[0], ip[1], ip[2], c.ith, c.nth);
}

// The matmul's activation slot and quantization (x_rows = ip[2] rows, so the memo
// shares them with the other matmuls reading the same input), then the grouped product.
void run_matmul_id(const Ctx& c) {
    const Step& s = c.s;
    const Weight& w = c.ws.get(s.w[0]);
    const ActRows ar = act_rows(c, w, s.ip[0], s.ip[2]);
    const auto pk = packed_of(w);
    moe::MatmulIdArgs a{&w, pk.get(), ar.act, ar.arb, ar.meta, ar.meta_row, c.I(2),
                        s.ip[0], s.ip[1], s.ip[3], s.ip[4], s.ip[5], s.ip[2], c.F(0)};
    moe::matmul_id(a, c.scratch.moe, c.work, c.ith, c.nth, [&c]() { c.sync(); });
}

void matmul_id_scratch(const Step& s, const WeightStore& ws, ScratchNeed& n) {
    matmul_scratch(s, ws, n);  // the activation slot: ip[2] rows of ip[0], as a matmul's
    const Weight& w = ws.get(s.w[0]);
    const int slot = act_slot_of_type(w.type);
    const size_t arb = slot < 0 ? (size_t)s.ip[0] * 4 : act_row_bytes(w.type, s.ip[0]);
    const size_t mrow = slot < 0 ? 0 : repack::meta_block_bytes(act_type_for(w.type)) *
                                           (size_t)(s.ip[0] / type_block_elems(act_type_for(w.type)));
    size_t act, meta, out;
    moe::scratch_need(s.ip[5], s.ip[4], s.ip[1], arb, mrow, act, meta, out);
    n.moe_act = std::max(n.moe_act, act);
    n.moe_meta = std::max(n.moe_meta, meta);
    n.moe_out = std::max(n.moe_out, out);
}

// The dense families' element-wise ops (ops_dense.cpp).
void run_scale(const Ctx& c) { scale_f32(c.F(1), c.F(0), c.s.fp[0], c.ip()[0], c.ith, c.nth); }
void run_gelu(const Ctx& c) { gelu_f32(c.F(1), c.F(0), c.ip()[0], c.ith, c.nth); }
void run_geglu(const Ctx& c) { geglu_f32(c.F(1), c.F(2), c.F(0), c.ip()[0], c.ith, c.nth); }
void run_softcap(const Ctx& c) { softcap_f32(c.F(1), c.F(0), c.s.fp[0], c.ip()[0], c.ith, c.nth); }
void run_slice(const Ctx& c) {
    const int64_t* ip = c.ip();
    slice_f32(c.F(1), c.F(0), ip[0], ip[1], ip[2], ip[3], c.ith, c.nth);
}

const CpuOp* cpu_op(int32_t op) {
    //                          run              check_data        act_slot         scratch         check
    static const CpuOp ops[] = {
        {nullptr, nullptr, nullptr, nullptr, nullptr},
        /* add        */ {run_add, nullptr, nullptr, nullptr, nullptr},
        /* mul        */ {run_mul, nullptr, nullptr, nullptr, nullptr},
        /* silu       */ {run_silu, nullptr, nullptr, nullptr, nullptr},
        /* swiglu     */ {run_swiglu, nullptr, nullptr, nullptr, nullptr},
        /* rms_norm   */ {run_norm, nullptr, nullptr, nullptr, nullptr},
        /* qk_norm    */ {run_norm, nullptr, nullptr, nullptr, nullptr},
        /* matmul     */ {run_matmul, nullptr, matmul_act_slot, matmul_scratch, check_matmul},
        /* get_rows_w */ {run_get_rows_w, data_get_rows_w, nullptr, nullptr, nullptr},
        /* get_rows   */ {run_get_rows, data_get_rows, nullptr, nullptr, nullptr},
        /* rope       */ {run_rope, nullptr, nullptr, nullptr, nullptr},
        /* kv_store   */ {run_kv_store, data_kv_store, nullptr, nullptr, nullptr},
        /* attn       */ {run_attn, data_attn, nullptr, attn_scratch, nullptr},
        /* sigmoid    */ {run_sigmoid, nullptr, nullptr, nullptr, nullptr},
        /* moe_topk   */ {run_moe_topk, nullptr, nullptr, nullptr, nullptr},
        /* moe_weights*/ {run_moe_weights, nullptr, nullptr, nullptr, nullptr},
        /* matmul_id  */ {run_matmul_id, nullptr, matmul_act_slot, matmul_id_scratch, check_matmul},
        /* moe_sum    */ {run_moe_sum, nullptr, nullptr, nullptr, nullptr},
        /* scale      */ {run_scale, nullptr, nullptr, nullptr, nullptr},
        /* gelu       */ {run_gelu, nullptr, nullptr, nullptr, nullptr},
        /* geglu      */ {run_geglu, nullptr, nullptr, nullptr, nullptr},
        /* softcap    */ {run_softcap, nullptr, nullptr, nullptr, nullptr},
        /* slice      */ {run_slice, nullptr, nullptr, nullptr, nullptr},
    };
    static_assert(sizeof(ops) / sizeof(ops[0]) == OP_LAST + 1, "one CPU entry per core op code");
    return op >= OP_ADD && op <= OP_LAST ? &ops[op] : nullptr;
}

// Hazard analysis for the barriers between steps. Every thread walks the same steps,
// and a step only reads what its sources hold and writes its outputs, so threads need
// to meet only where a step reads a buffer written since the last meeting, or writes a
// buffer read or written since then (the in-place ops included). The quantized
// activation scratch slots count as buffers (ids -1 and -2), written by a step that
// quantizes its input there (ActMemo, as in the run). Consecutive q/k/v (and gate/up)
// matmuls and the two RoPEs then run back to back, which removes about a third of a
// decode step's barriers.
std::vector<uint8_t> plan_barriers(const Plan& plan, const WeightStore& ws) {
    const size_t n = plan.steps.size();
    std::vector<uint8_t> after(n, 1);
    std::vector<int> pend_r, pend_w;
    auto touches = [](const std::vector<int>& v, int id) { return std::find(v.begin(), v.end(), id) != v.end(); };
    ActMemo memo;
    for (size_t i = 0; i < n; ++i) {
        const Step& s = plan.steps[i];
        const OpFormat& f = *op_format(s.op);
        const CpuOp& d = *cpu_op(s.op);
        const int slot = d.act_slot ? d.act_slot(s, ws) : -1;
        std::vector<int> r, w;
        for (int k = 0; k < 8; ++k) {
            if (!f.access[k] || s.buf[k] < 0) continue;
            // A memo user reads its input from the scratch slot, not from buf[1].
            if (f.access[k] & SLOT_READ) r.push_back(k == 1 && slot >= 0 ? -1 - slot : s.buf[k]);
            if (f.access[k] & SLOT_WRITE) w.push_back(s.buf[k]);
        }
        const bool quantizes = slot >= 0 && memo.enter(slot, s);
        bool meet = false;
        if (i > 0) {
            // The quantization phase reads the input and writes the scratch slot.
            std::vector<int> qr = r, qw = w;
            if (quantizes) { qr.push_back(s.buf[1]); qw.push_back(-1 - slot); }
            for (int id : qr) meet = meet || touches(pend_w, id);
            for (int id : qw) meet = meet || touches(pend_w, id) || touches(pend_r, id);
            after[i - 1] = meet;
        }
        // run_plan meets right after quantizing, so then only the compute phase is pending.
        if (meet || quantizes) { pend_r.clear(); pend_w.clear(); }
        pend_r.insert(pend_r.end(), r.begin(), r.end());
        pend_w.insert(pend_w.end(), w.begin(), w.end());
        memo.leave(s, d.act_slot != nullptr);
    }
    return after;
}

struct CpuPlanState : PlanState {
    const Pool* pool = nullptr;
    int pool_count = -1;
    int weight_count = -1;
    // barrier_after[i]: threads meet after step i (see plan_barriers).
    std::vector<uint8_t> barrier_after;
};

}  // namespace

void validate_plan(const Plan& plan, const Pool& pool, const WeightStore& ws) {
    for (const Step& s : plan.steps) {
        if (!op_format(s.op)) step_fail(s, "unknown op code " + std::to_string(s.op));
        const CpuOp* d = cpu_op(s.op);
        if (!d) step_fail(s, "the cpu backend does not implement this op");
    }
    validate_format(plan, ws, pool.name(), [&](int id, size_t& nbytes) {
        if (!pool.valid(id)) return false;
        nbytes = pool.size(id);
        return true;
    });
    for (const Step& s : plan.steps) {
        const CpuOp* d = cpu_op(s.op);
        if (d->check) d->check(s, ws);
    }
}

void run_plan(const Plan& plan, Pool& pool, const WeightStore& ws, int n_threads, size_t begin, size_t end) {
    end = std::min(end, plan.steps.size());
    if (begin >= end) return;
    // Static checks depend only on the plan, the pool's buffers and the weights, none of
    // which change once allocated: a reused plan revalidates only when one of them grew.
    auto* st = dynamic_cast<CpuPlanState*>(plan.state.get());
    if (!st || st->pool != &pool || st->pool_count != pool.count() || st->weight_count != ws.count()) {
        validate_plan(plan, pool, ws);
        auto fresh = std::make_unique<CpuPlanState>();
        fresh->pool = &pool;
        fresh->pool_count = pool.count();
        fresh->weight_count = ws.count();
        fresh->barrier_after = std::getenv("MINFER_ALL_BARRIERS") ? std::vector<uint8_t>(plan.steps.size(), 1)
                                                                   : plan_barriers(plan, ws);
        prepare_packed(plan, ws, n_threads);
        st = fresh.get();
        plan.state = std::move(fresh);
    }
    const std::vector<uint8_t>& barrier_after = st->barrier_after;
    ScratchNeed need;
    for (size_t i = begin; i < end; ++i) {
        const Step& s = plan.steps[i];
        const CpuOp& d = *cpu_op(s.op);
        if (d.check_data) {
            std::string err = d.check_data(s, pool);  // inputs are filled before the run
            if (!err.empty()) step_fail(s, err);
        }
        if (d.scratch) d.scratch(s, ws, need);
    }
    int nth = std::max(1, n_threads);

    // Scratch sized for the largest consumer, grown only when a plan needs more.
    static thread_local Scratch tls_scratch;
    Scratch& scratch = tls_scratch;  // workers must see the caller's instance
    for (int k = 0; k < 2; ++k) {
        if (scratch.act[k].size() < need.act[k]) scratch.act[k].resize(need.act[k]);
        if (scratch.meta[k].size() < need.meta[k]) scratch.meta[k].resize(need.meta[k]);
    }
    if (scratch.moe.act.size() < need.moe_act) scratch.moe.act.resize(need.moe_act);
    if (scratch.moe.meta.size() < need.moe_meta) scratch.moe.meta.resize(need.moe_meta);
    if (scratch.moe.out.size() < need.moe_out) scratch.moe.out.resize(need.moe_out);
    need.attn = (need.attn + 15) / 16 * 16;  // whole cache lines per thread (run_attn)
    if (scratch.attn.size() < need.attn * nth + 16) scratch.attn.resize(need.attn * nth + 16);

    // nth work counters per step for kernels that hand out work dynamically (attention's
    // items, the matmuls' stealing), zeroed for every run; kept by the calling thread.
    static thread_local std::unique_ptr<std::atomic<uint64_t>[]> counters;
    static thread_local size_t counters_cap = 0;
    const size_t n_counters = (end - begin) * (size_t)nth;
    if (counters_cap < n_counters) {
        counters.reset(new std::atomic<uint64_t>[n_counters]);
        counters_cap = n_counters;
    }
    std::atomic<uint64_t>* const work = counters.get();  // workers must see the caller's
    for (size_t i = 0; i < n_counters; ++i) work[i].store(0, std::memory_order_relaxed);

    // The team size is fixed before the barrier is sized: no dynamic adjustment.
    omp_set_dynamic(0);
    StepBarrier barrier(nth);
    pin::TeamPlacement placement(nth);  // cpu/thread_pin.h: worker i on the i-th CPU
    std::unique_ptr<stats::RunTimes> times(stats::enabled() ? new stats::RunTimes : nullptr);
    const uint64_t run_t0 = times ? stats::now_ns() : 0;
    #pragma omp parallel num_threads(nth)
    {
        const int ith = omp_get_thread_num();
        placement.place(ith);
        // OpenMP may grant fewer threads than asked (OMP_THREAD_LIMIT): size to the team.
        #pragma omp single
        barrier.resize(omp_get_num_threads());
        const int nt_ = omp_get_num_threads();
        // Every thread walks the same steps, so the private memos agree.
        ActMemo memo;
        if (!times) {
            for (size_t i = begin; i < end; ++i) {
                const Step& s = plan.steps[i];
                const CpuOp& d = *cpu_op(s.op);
                d.run(Ctx{s, pool, ws, scratch, need.attn, memo, barrier, &work[(i - begin) * nth], nullptr, ith, nt_});
                memo.leave(s, d.act_slot != nullptr);
                if (barrier_after[i]) barrier.wait();
            }
        } else {
            // The same walk, timed (MINFER_CPU_STATS=1, cpu/step_stats.h).
            #pragma omp single
            times->init(nt_, end - begin);
            for (size_t i = begin; i < end; ++i) {
                const Step& s = plan.steps[i];
                const CpuOp& d = *cpu_op(s.op);
                stats::StepClock clk;
                const uint64_t t0 = stats::now_ns();
                d.run(Ctx{s, pool, ws, scratch, need.attn, memo, barrier, &work[(i - begin) * nth], &clk, ith, nt_});
                memo.leave(s, d.act_slot != nullptr);
                const uint64_t t1 = stats::now_ns();
                if (barrier_after[i]) barrier.wait();
                const size_t j = (i - begin) * nt_ + ith;
                times->work[j] = t1 - t0 - clk.waited;
                times->wait[j] = stats::now_ns() - t1 + clk.waited;
                times->quant[j] = clk.syncs ? clk.sync_at - t0 : 0;
                times->stolen[j] = clk.stolen;
                if (ith == 0) {
                    times->op[i - begin] = s.op;
                    times->barrier[i - begin] = (uint8_t)(barrier_after[i] + clk.syncs);
                }
            }
        }
    }
    if (times) stats::add_run(*times, stats::now_ns() - run_t0);
}

void prepare_weights(const Plan& plan, const WeightStore& ws, int n_threads) { prepare_packed(plan, ws, n_threads); }

int64_t argmax_f32(const float* x, int64_t n, int n_threads) {
    const int nth = std::max(1, n_threads);
    std::vector<int64_t> best(nth, -1);
    pin::TeamPlacement placement(nth);  // the threads that wrote the logits, where they ran
    #pragma omp parallel num_threads(nth)
    {
        const int ith = omp_get_thread_num();
        placement.place(ith);
        const auto [r0, r1] = row_range(n, ith, omp_get_num_threads());
        const int64_t b = first_max_finite(x + r0, r1 - r0);
        best[ith] = b < 0 ? (r0 < r1 ? -2 : -1) : r0 + b;  // -2: a NaN or Inf in this share
    }
    int64_t b = -1;
    for (int64_t c : best) {
        if (c == -2) return -1;
        if (c >= 0 && (b < 0 || x[c] > x[b])) b = c;
    }
    return b;
}

}  // namespace minfer::cpu
