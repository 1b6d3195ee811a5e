#include "cuda/executor.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/context.h"
#include "common/ggml_types.h"
#include "cuda/kernels.h"
#include "cuda/layout.h"
#include "cuda/timeline.h"

namespace minfer::cuda {

using minfer::T_F16;
using minfer::T_F32;

DevWeights::~DevWeights() {
    for (void* p : ptr)
        if (p) cudaFree(p);
}

const void* DevWeights::ensure(const WeightStore& ws, int h) {
    std::lock_guard<std::mutex> lk(mu);
    if ((int)ptr.size() < ws.count()) {
        ptr.resize(ws.count(), nullptr);
        row_bytes.resize(ws.count(), 0);
    }
    if (!ptr[h]) {
        const Weight& w = ws.get(h);
        const bool pack = packed_layout(w.type);
        const size_t stride = pack ? device_row_bytes(w.type, w.row_bytes) : w.row_bytes;
        const size_t n = pack ? stride * (size_t)w.ne1 : w.nbytes;
        void* d = dev_alloc(n);
        const cudaStream_t stream = lane().stream;
        if (pack) {
            std::vector<uint8_t> tmp(n);
            pack_rows(w.type, w.data, w.row_bytes, w.ne1, w.ne0, tmp.data());
            MC_CHECK(cudaMemcpyAsync(d, tmp.data(), n, cudaMemcpyHostToDevice, stream));
        } else {
            MC_CHECK(cudaMemcpyAsync(d, w.data, n, cudaMemcpyHostToDevice, stream));
        }
        // Landed before any lane can see the pointer (the other contexts' lanes share it).
        MC_CHECK(cudaStreamSynchronize(stream));
        ptr[h] = d;
        row_bytes[h] = stride;
        bytes += n;
    }
    return ptr[h];
}

namespace {

struct CudaPlanState : PlanState {
    const DevPool* pool = nullptr;
    int pool_count = -1;
    int weight_count = -1;
    // f16 dequantized weights for the prefill GEMM: two buffers, so the side stream can
    // dequantize the next GEMM's weight into one while the main stream's GEMM reads the
    // other. The pipeline's even GEMMs and every GEMM of a partial run (on the main
    // stream) use wh, the odd ones wh2 (sized for those alone: a 7B's lm head is 1 GB).
    void* wh = nullptr;
    void* wh2 = nullptr;
    size_t wh_bytes = 0;
    size_t wh2_bytes = 0;
    void* xh = nullptr;  // f16 activations for the prefill GEMM
    size_t xh_bytes = 0;
    float* attn = nullptr;  // attention chunk partials
    size_t attn_bytes = 0;
    int* attn_tk = nullptr;  // attention merge tickets: zeroed at allocation, left zero by every launch
    size_t attn_tk_bytes = 0;
    void* xq = nullptr;  // the decode matvec's int8 activation copy
    size_t xq_bytes = 0;
    void* xq2 = nullptr;  // a second one: gate|up writes down's input while reading its own
    size_t xq2_bytes = 0;
    void* xn = nullptr;  // a decode RMSNorm's deferred int8 copy (kernels.h rms_norm_copy)
    size_t xn_bytes = 0;
    int* rope_tk = nullptr;  // the q|k|v tail's head tickets: likewise
    size_t rope_tk_bytes = 0;
    int* route_tk = nullptr;  // the decode router's ticket (L_MOE_ROUTER): likewise
    void* moe = nullptr;  // a prefill MATMUL_ID's grouping of slots by expert (kernels.h moe_group)
    size_t moe_bytes = 0;
    int direct_runs = 0;
    bool no_graph = false;  // capture failed once: launch directly from then on
    cudaGraphExec_t exec = nullptr;
    size_t graph_nodes = 0;
    int32_t flags = -1;  // the Plan::flags the program was built for
    // The prefill GEMMs whose weight is dequantized (quantized types), in program order:
    // the pipeline's lookahead, worked out from the program once.
    struct Deq {
        int h;            // weight handle
        int64_t in, out;  // the weight's row length and rows
    };
    std::vector<Deq> deqs;
    // Events of the pipeline (no timing): the run's start on the main stream (the buffers
    // may still be read by the run before), each buffer's dequantization done (side), and
    // the GEMM that read each buffer last done (main). Created with the buffers.
    cudaEvent_t ev_start = nullptr;
    cudaEvent_t ev_deq[2] = {nullptr, nullptr};
    cudaEvent_t ev_gemm[2] = {nullptr, nullptr};
    // The whole run in progress takes the pipelined path: deqs dequantized on the side
    // stream, f16 inputs reused (xh_ready). Partial runs dequantize on the main stream
    // just before each GEMM and convert every input (as whole runs did before the
    // pipeline and the shared f16 inputs: the 7B's 512-token prefill GEMMs took 31.0 ms
    // then, 22.2 with them, d98fd85).
    bool pipe = false;
    // The greedy pick the program ends with: argmax over pick_n floats of buffer
    // pick_buf (the pool's pick target the last step writes), or none (-1).
    int pick_buf = -1;
    int64_t pick_n = 0;
    // The launch program of a whole run: each entry is one launch over steps
    // first[k] .. (kind-dependent), built at validation from the step merges allowed.
    struct Launch {
        int kind;
        int s[4];
        int n;
        bool xq_ready = false;  // the launch before wrote this matvec's int8 input (in scratch `slot`)
        bool q_next = false;    // this launch writes the next one's int8 input
        int slot = 0;           // the int8 input scratch this matvec reads: 0 = xq, 1 = xq2, 2 = xn
        int norm_in = -1;       // the RMSNorm step whose deferred copy (xn) this matvec launch reads
        int gq = -1;            // a prefill GEMM whose weight is dequantized: its index in deqs
        bool xh_ready = false;  // a prefill GEMM whose f16 input the launch before left in xh
        bool xh_out = false;    // a prefill RMSNorm that also writes its output's f16 copy into xh
        // A q|k|v matvec that also ropes and stores (FUSE_ROPE): the folded rope q, rope k
        // and KV store steps, and each job's role (1 q, 2 k, 3 v).
        int rope[3] = {-1, -1, -1};
        int role[4] = {0, 0, 0, 0};
        int qk_norm[2] = {-1, -1};  // L_ROPE_STORE: the QK_NORM steps of q and k it runs first, or none
        bool early_next = false;  // L_NORM_Q: the launch after it is a q|k|v matvec of one wave: it starts with the norm
        bool moe_grouped = false;  // a prefill MATMUL_ID whose slots the MATMUL_ID before grouped (moe scratch)
    };
    std::vector<Launch> program;
    // Per step: the decode RMSNorm whose deferred copy (xn) a matvec step reads, else -1
    // (partial runs launch steps one by one, and must read what whole runs read).
    std::vector<int> norm_in_step;
    // MINFER_CUDA_STAMP=1: device clock stamps around every launch of a whole run (two at
    // the start, then one after each launch), read back after the run.
    int64_t* stamps = nullptr;
    size_t stamps_cap = 0;
    // The q|k|v tail's pair angles by position (kernels.h rope_table), for one (rows,
    // n_rot, angle parameters): the decode program's.
    float2* rope_table = nullptr;
    int64_t rope_rows = 0;
    int rope_nrot = 0;
    RopeCfg rope_cfg;
    std::shared_ptr<Lane> lane;  // its pool's, which runs it (kept: the end waits for it)
    ~CudaPlanState() override {
        // The capture dies with the plan, once the stream no longer uses it.
        if (lane) {
            cudaStreamSynchronize(lane->stream);
            cudaStreamSynchronize(lane->side);  // joined by the main stream already; cheap
        }
        if (exec) cudaGraphExecDestroy(exec);
        if (wh) cudaFree(wh);
        if (wh2) cudaFree(wh2);
        for (cudaEvent_t e : {ev_start, ev_deq[0], ev_deq[1], ev_gemm[0], ev_gemm[1]})
            if (e) cudaEventDestroy(e);
        if (xh) cudaFree(xh);
        if (attn) cudaFree(attn);
        if (attn_tk) cudaFree(attn_tk);
        if (xq) cudaFree(xq);
        if (xq2) cudaFree(xq2);
        if (xn) cudaFree(xn);
        if (rope_tk) cudaFree(rope_tk);
        if (route_tk) cudaFree(route_tk);
        if (moe) cudaFree(moe);
        if (stamps) cudaFree(stamps);
        if (rope_table) cudaFree(rope_table);
    }
};

CudaPlanState& state_of(const Plan& plan) {
    auto* st = dynamic_cast<CudaPlanState*>(plan.state.get());
    if (!st) {
        plan.state = std::make_unique<CudaPlanState>();
        st = static_cast<CudaPlanState*>(plan.state.get());
    }
    return *st;
}

const CudaPlanState* peek_state(const Plan& plan) { return dynamic_cast<const CudaPlanState*>(plan.state.get()); }

[[noreturn]] void fail(const Step& s, const std::string& what) { step_fail(s, what); }

const Weight& need_weight(const Step& s, const WeightStore& ws, int slot) {
    if (s.w[slot] < 0 || s.w[slot] >= ws.count()) fail(s, "missing weight");
    return ws.get(s.w[slot]);
}

// A ROPE step's style and angles (fp 0 for freq_scale or attn_factor means 1).
RopeCfg rope_cfg(const Step& s, const DevWeights& dw) {
    RopeCfg r;
    r.base = s.fp[0];
    r.scale = s.fp[1] != 0.0f ? s.fp[1] : 1.0f;
    r.attn = s.fp[2] != 0.0f ? s.fp[2] : 1.0f;
    r.factors = s.w[0] >= 0 ? (const float*)dw.get(s.w[0]) : nullptr;
    r.style = (int)s.ip[4];
    return r;
}

// Two configurations give every pair the same angle.
bool same_angles(const RopeCfg& a, const RopeCfg& b) {
    return a.base == b.base && a.scale == b.scale && a.attn == b.attn && a.factors == b.factors;
}

enum LaunchKind { L_STEP = 0, L_MV, L_SWIGLU, L_MV_ADD, L_ROPE_STORE, L_NORM_Q, L_ARGMAX, L_MOE_ROUTE, L_MOE_FFN,
                  L_MOE_SUM_ADD, L_MOE_ROUTER, L_MOE_DOWN_SUM };

// Buffers a step reads / writes (plan.h's field contract).
void step_io(const Step& s, int rd[6], int& nr, int wr[2], int& nw) {
    nr = nw = 0;
    wr[nw++] = s.buf[0];
    auto R = [&](int slot) { if (s.buf[slot] >= 0) rd[nr++] = s.buf[slot]; };
    switch (s.op) {
        case OP_ADD: case OP_MUL: case OP_SWIGLU: case OP_GET_ROWS: case OP_ROPE: case OP_GEGLU:
        case OP_MATMUL_ID: case OP_MOE_SUM:
            R(1); R(2); break;
        case OP_KV_STORE: R(1); R(2); R(3); wr[nw++] = s.buf[4]; break;
        case OP_ATTN: R(1); R(2); R(3); R(4); R(5); break;
        default: R(1); break;
    }
}

// No step after `after` reads buf before something writes it again: its value may
// stay in registers (a fused launch need not store it). Plans whose buffers other
// splits read are never merged (Python sets flags only for a single-split graph).
bool dead_after(const Plan& plan, size_t after, int buf) {
    for (size_t k = after + 1; k < plan.steps.size(); ++k) {
        int rd[6], wr[2], nr, nw;
        step_io(plan.steps[k], rd, nr, wr, nw);
        for (int i = 0; i < nr; ++i)
            if (rd[i] == buf) return false;
        for (int i = 0; i < nw; ++i)
            if (wr[i] == buf) return true;
    }
    return true;
}

bool is_mv(const Step& s) { return s.op == OP_MATMUL && s.ip[2] == 1; }
// A block of row-exact columns: the matvec's (or k_mmq's) launch, not a GEMM.
bool is_rows_mv(const Step& s) { return s.op == OP_MATMUL && s.ip[2] >= 1 && s.ip[2] <= kRowExactMaxTokens; }
// A decode RMSNorm: its matvec readers take its deferred copy (kernels.h rms_norm_copy).
bool copy_norm(const Step& s) {
    return s.op == OP_RMS_NORM && s.ip[1] >= 1 && s.ip[1] <= kRowExactMaxTokens && s.ip[0] % 32 == 0 &&
           s.ip[0] <= kNormCopyMaxRow;
}
// A prefill GEMM (cuBLAS): reads the f16 copy of its input from xh unless its weight is F32.
bool is_gemm_f16(const Step& s, const WeightStore& ws) {
    return s.op == OP_MATMUL && s.ip[2] > kRowExactMaxTokens && ws.get(s.w[0]).type != T_F32;
}
// ... and dequantizes its weight to f16 first.
bool is_gemm_deq(const Step& s, const WeightStore& ws) {
    return is_gemm_f16(s, ws) && ws.get(s.w[0]).type != T_F16;
}

// A MATMUL_ID of a decode-sized block: the expert matvec (matvec_id).
bool is_mv_id(const Step& s) { return s.op == OP_MATMUL_ID && s.ip[5] <= kRowExactMaxTokens; }

// MOE_TOPK and MOE_WEIGHTS of one router's logits at steps i, i + 1 (either order), into
// buffers of their own: {topk step, weights step}, else empty.
std::vector<int> moe_route_pair(const std::vector<Step>& S, size_t i) {
    if (i + 1 >= S.size()) return {};
    const Step &a = S[i], &b = S[i + 1];
    const bool pair = (a.op == OP_MOE_TOPK && b.op == OP_MOE_WEIGHTS) || (a.op == OP_MOE_WEIGHTS && b.op == OP_MOE_TOPK);
    if (!pair || a.buf[1] != b.buf[1] || a.ip[0] != b.ip[0] || a.ip[1] != b.ip[1] || a.ip[2] != b.ip[2] ||
        a.buf[0] == b.buf[0] || a.buf[0] == a.buf[1] || b.buf[0] == b.buf[1])
        return {};
    const int t = a.op == OP_MOE_TOPK ? (int)i : (int)i + 1;
    return {t, t == (int)i ? (int)i + 1 : (int)i};
}

// The mixture-of-experts step merges at step i (flags as for their dense counterparts),
// pushed onto the program; returns the steps taken (0: none). Each launch computes
// bitwise what its steps compute one by one.
//   FUSE_FFN:      gate and up MATMUL_IDs (one input, one ids, one shape and type) + SWIGLU:
//                  one expert matvec with the SwiGLU epilogue (L_MOE_FFN).
//   FUSE_QKV:      MOE_TOPK and MOE_WEIGHTS of one router's logits: one launch (L_MOE_ROUTE);
//                  with the decode MATMUL that writes those logits before them, one
//                  launch for the three (L_MOE_ROUTER, kernels.h matvec_route).
//   FUSE_FFN:      a decode down MATMUL_ID + the MOE_SUM of its rows (+ with
//                  FUSE_RESIDUAL the ADD of the sum): one launch (L_MOE_DOWN_SUM,
//                  kernels.h matvec_id_sum).
//   FUSE_RESIDUAL: MOE_SUM + the ADD of its output: the add in the sum (L_MOE_SUM_ADD).
int moe_merge(const Plan& plan, const WeightStore& ws, size_t i, CudaPlanState& st) {
    const auto& S = plan.steps;
    const int32_t f = plan.flags;
    if ((f & FUSE_FFN) && i + 2 < S.size() && is_mv_id(S[i]) && is_mv_id(S[i + 1]) && S[i + 2].op == OP_SWIGLU) {
        const Step &a = S[i], &b = S[i + 1], &sw = S[i + 2];
        bool same = a.buf[1] == b.buf[1] && a.buf[2] == b.buf[2] && ws.get(a.w[0]).type == ws.get(b.w[0]).type &&
                    ws.get(a.w[0]).row_bytes == ws.get(b.w[0]).row_bytes;
        for (int k = 0; k < 6; ++k) same = same && a.ip[k] == b.ip[k];
        int g = -1, u = -1;
        if (sw.buf[1] == a.buf[0] && sw.buf[2] == b.buf[0]) g = (int)i, u = (int)i + 1;
        if (sw.buf[1] == b.buf[0] && sw.buf[2] == a.buf[0]) g = (int)i + 1, u = (int)i;
        // The launch reads x (or its int8 copy) and the ids while it writes SwiGLU's output.
        if (same && g >= 0 && a.buf[0] != b.buf[0] && sw.ip[0] == a.ip[1] * a.ip[4] * a.ip[5] &&
            sw.buf[0] != a.buf[1] && sw.buf[0] != a.buf[2] && dead_after(plan, i + 2, a.buf[0]) &&
            dead_after(plan, i + 2, b.buf[0])) {
            st.program.push_back({L_MOE_FFN, {g, u, (int)i + 2, 0}, 3});
            return 3;
        }
    }
    if ((f & FUSE_QKV) && i + 2 < S.size() && is_rows_mv(S[i]) && S[i].w[1] < 0) {
        const Step &m = S[i], &a = S[i + 1];
        const auto p = moe_route_pair(S, i + 1);
        // The logits are still written (later steps may read them); the routing reads
        // them, never x; the ids and weights go elsewhere.
        if (!p.empty() && a.buf[1] == m.buf[0] && a.ip[0] == m.ip[1] && a.ip[2] == m.ip[2] &&
            route_fusable(ws.get(m.w[0]).type, m.ip[1]) && a.ip[1] <= kRouteMaxK &&
            S[i + 1].buf[0] != m.buf[1] && S[i + 2].buf[0] != m.buf[1]) {
            st.program.push_back({L_MOE_ROUTER, {(int)i, p[0], p[1], 0}, 3});
            return 3;
        }
    }
    if (f & FUSE_QKV) {
        const auto p = moe_route_pair(S, i);
        if (!p.empty()) {
            st.program.push_back({L_MOE_ROUTE, {p[0], p[1], 0, 0}, 2});
            return 2;
        }
    }
    if ((f & FUSE_FFN) && i + 1 < S.size() && is_mv_id(S[i]) && S[i + 1].op == OP_MOE_SUM) {
        const Step &m = S[i], &sm = S[i + 1];
        const int64_t out = m.ip[1], k = m.ip[4], nt = m.ip[5];
        const int yd = m.buf[0], ys = sm.buf[0], w = sm.buf[2];
        // Every block reads x, the ids and the weights while others write the rows and
        // the sums: no output over an input, none over another.
        const bool ok = sm.buf[1] == yd && sm.ip[0] == out && sm.ip[1] == k && sm.ip[2] == nt && k <= 32 &&
                        yd != m.buf[1] && yd != m.buf[2] && yd != w && ys != yd && ys != m.buf[1] && ys != m.buf[2] &&
                        ys != w;
        if (ok) {
            CudaPlanState::Launch L{L_MOE_DOWN_SUM, {(int)i, (int)i + 1, 0, 0}, 2};
            if ((f & FUSE_RESIDUAL) && i + 2 < S.size() && S[i + 2].op == OP_ADD) {
                const Step& ad = S[i + 2];
                const bool one = (ad.buf[1] == ys) != (ad.buf[2] == ys);
                const int resid = ad.buf[1] == ys ? ad.buf[2] : ad.buf[1];
                if (one && ad.ip[0] == out * nt && resid != yd && ad.buf[0] != yd && ad.buf[0] != m.buf[1] &&
                    ad.buf[0] != m.buf[2] && ad.buf[0] != w && dead_after(plan, i + 2, ys)) {
                    L.s[2] = (int)i + 2;
                    L.n = 3;
                }
            }
            st.program.push_back(L);
            return L.n;
        }
    }
    if ((f & FUSE_RESIDUAL) && i + 1 < S.size() && S[i].op == OP_MOE_SUM && S[i + 1].op == OP_ADD) {
        const Step &m = S[i], &ad = S[i + 1];
        const int y = m.buf[0];
        const bool one = (ad.buf[1] == y) != (ad.buf[2] == y);
        // Element i of the add's output is written after element i of the residual is read,
        // never over the sum's inputs.
        if (one && ad.ip[0] == m.ip[0] * m.ip[2] && ad.buf[0] != m.buf[1] && ad.buf[0] != m.buf[2] &&
            dead_after(plan, i + 1, y)) {
            st.program.push_back({L_MOE_SUM_ADD, {(int)i, (int)i + 1, 0, 0}, 2});
            return 2;
        }
    }
    return 0;
}

// Prefill MATMUL_IDs that find their grouping already in the moe scratch: the previous
// prefill MATMUL_ID grouped the same ids buffer (same n_expert and slots) and no step
// since wrote it (gate, up and down of one layer group once).
void mark_moe_groups(const Plan& plan, CudaPlanState& st) {
    const auto& S = plan.steps;
    const Step* prev = nullptr;
    int since = 0;
    for (auto& L : st.program) {
        if (L.kind != L_STEP) continue;
        const Step& s = S[L.s[0]];
        if (s.op != OP_MATMUL_ID || is_mv_id(s)) continue;
        bool same = prev && prev->buf[2] == s.buf[2] && prev->ip[3] == s.ip[3] && prev->ip[4] == s.ip[4] &&
                    prev->ip[5] == s.ip[5];
        for (int k = since; same && k < L.s[0]; ++k) {
            int rd[6], wr[2], nr, nw;
            step_io(S[k], rd, nr, wr, nw);
            for (int w = 0; w < nw; ++w) same = same && wr[w] != s.buf[2];
        }
        L.moe_grouped = same;
        prev = &s;
        since = L.s[0];
    }
}

// Rope q, rope k and the KV store of the roped k at steps i .. i + 2, one launch's worth:
// the ropes agree (one configuration for both) and no output clobbers an input. Sets
// q and k to the two ropes' steps.
bool rope_store_at(const std::vector<Step>& S, size_t i, int& q, int& k) {
    if (i + 2 >= S.size() || S[i].op != OP_ROPE || S[i + 1].op != OP_ROPE || S[i + 2].op != OP_KV_STORE) return false;
    const Step &a = S[i], &b = S[i + 1], &kv = S[i + 2];
    const bool same = a.buf[2] == b.buf[2] && a.ip[0] == b.ip[0] && a.ip[2] == b.ip[2] && a.ip[3] == b.ip[3] &&
                      a.ip[4] == b.ip[4] && a.fp[0] == b.fp[0] && a.fp[1] == b.fp[1] && a.fp[2] == b.fp[2] &&
                      a.w[0] == b.w[0] && kv.ip[0] == a.ip[0];
    q = k = -1;
    if (kv.buf[1] == b.buf[0]) q = (int)i, k = (int)i + 1;
    else if (kv.buf[1] == a.buf[0]) q = (int)i + 1, k = (int)i;
    return same && q >= 0 && kv.ip[1] == S[k].ip[1] * S[k].ip[2] && S[q].buf[0] != S[k].buf[1] &&
           S[k].buf[0] != S[q].buf[1] && kv.buf[2] != S[q].buf[0] && kv.buf[2] != S[k].buf[0];
}

void build_program(const Plan& plan, const WeightStore& ws, CudaPlanState& st) {
    const auto& S = plan.steps;
    const int32_t f = plan.flags;
    st.program.clear();
    size_t i = 0;
    while (i < S.size()) {
        if (const int n = moe_merge(plan, ws, i, st)) {
            i += (size_t)n;
            continue;
        }
        // gate|up + SwiGLU
        if ((f & FUSE_FFN) && i + 2 < S.size() && is_mv(S[i]) && is_mv(S[i + 1]) && S[i + 2].op == OP_SWIGLU &&
            S[i].buf[1] == S[i + 1].buf[1] && S[i].ip[0] == S[i + 1].ip[0] && S[i].ip[1] == S[i + 1].ip[1] &&
            S[i + 2].ip[0] == S[i].ip[1] && S[i].buf[0] != S[i + 1].buf[0] && S[i + 2].buf[0] != S[i].buf[1]) {
            const Step& sw = S[i + 2];
            int g = -1, u = -1;
            if (sw.buf[1] == S[i].buf[0] && sw.buf[2] == S[i + 1].buf[0]) g = (int)i, u = (int)i + 1;
            if (sw.buf[1] == S[i + 1].buf[0] && sw.buf[2] == S[i].buf[0]) g = (int)i + 1, u = (int)i;
            if (g >= 0 && dead_after(plan, i + 2, S[i].buf[0]) && dead_after(plan, i + 2, S[i + 1].buf[0])) {
                st.program.push_back({L_SWIGLU, {g, u, (int)i + 2, 0}, 3});
                i += 3;
                continue;
            }
        }
        // matvec + residual add (a row-exact block's columns too: the add in the epilogue
        // is the same float addition, so no row's bits change)
        if ((f & FUSE_RESIDUAL) && i + 1 < S.size() && is_rows_mv(S[i]) && S[i + 1].op == OP_ADD &&
            S[i + 1].ip[0] == S[i].ip[1] * S[i].ip[2]) {
            const Step& ad = S[i + 1];
            const int y = S[i].buf[0];
            const bool one = (ad.buf[1] == y) != (ad.buf[2] == y);
            // Writing over the matvec's own input is safe when the kernel reads only
            // its int8 copy (quantized weights: made before the matvec starts).
            const int wt = ws.get(S[i].w[0]).type;
            const bool reads_x = wt == T_F32 || wt == T_F16;
            if (one && (ad.buf[0] != S[i].buf[1] || !reads_x) && dead_after(plan, i + 1, y)) {
                st.program.push_back({L_MV_ADD, {(int)i, (int)i + 1, 0, 0}, 2});
                i += 2;
                continue;
            }
        }
        // q|k|v (any run of matvecs over one input)
        if ((f & FUSE_QKV) && is_mv(S[i])) {
            size_t k = i + 1;
            while (k < S.size() && k - i < (size_t)MV_MAX_JOBS && is_mv(S[k]) && S[k].buf[1] == S[i].buf[1] &&
                   S[k].ip[0] == S[i].ip[0]) {
                bool clash = S[k].buf[0] == S[i].buf[1];
                for (size_t m = i; m < k; ++m) clash |= S[k].buf[0] == S[m].buf[0];
                if (clash) break;
                ++k;
            }
            if (k - i >= 2 && S[i].buf[0] != S[i].buf[1]) {
                CudaPlanState::Launch L{L_MV, {0, 0, 0, 0}, (int)(k - i)};
                for (size_t m = i; m < k; ++m) L.s[m - i] = (int)m;
                st.program.push_back(L);
                i = k;
                continue;
            }
        }
        // qk_norm q, qk_norm k, rope q, rope k, KV store of the roped k (Qwen3, Gemma 3)
        if ((f & FUSE_QKV) && i + 4 < S.size() && S[i].op == OP_QK_NORM && S[i + 1].op == OP_QK_NORM) {
            int q = -1, k = -1, nq = -1, nk = -1;
            if (rope_store_at(S, i + 2, q, k)) {
                for (int m : {(int)i, (int)i + 1}) {
                    if (S[m].buf[0] == S[q].buf[1]) nq = m;
                    else if (S[m].buf[0] == S[k].buf[1]) nk = m;
                }
            }
            if (nq >= 0 && nk >= 0) {
                const Step &a = S[nq], &b = S[nk], &rq = S[q], &rk = S[k], &kv = S[i + 4];
                // The launch reads the norms' inputs and never writes their outputs: a
                // norm's output feeds only its rope (which may write over it: RoPE
                // aliases its input), and nothing written clobbers an input.
                const bool q_gone = rq.buf[0] == a.buf[0] || dead_after(plan, i + 4, a.buf[0]);
                const bool k_gone = rk.buf[0] == b.buf[0] || dead_after(plan, i + 4, b.buf[0]);
                if (a.ip[0] == rq.ip[2] && a.ip[1] == rq.ip[0] * rq.ip[1] && b.ip[0] == rk.ip[2] &&
                    b.ip[1] == rk.ip[0] * rk.ip[1] && a.buf[0] != b.buf[1] && b.buf[0] != a.buf[1] &&
                    rq.buf[0] != b.buf[1] && rk.buf[0] != a.buf[1] && kv.buf[2] != a.buf[0] && kv.buf[2] != b.buf[0] &&
                    q_gone && k_gone) {
                    CudaPlanState::Launch L{L_ROPE_STORE, {q, k, (int)i + 4, 0}, 3};
                    L.qk_norm[0] = nq;
                    L.qk_norm[1] = nk;
                    st.program.push_back(L);
                    i += 5;
                    continue;
                }
            }
        }
        // rope q, rope k, KV store of the roped k
        if (f & FUSE_QKV) {
            int q = -1, k = -1;
            if (rope_store_at(S, i, q, k)) {
                st.program.push_back({L_ROPE_STORE, {q, k, (int)i + 2, 0}, 3});
                i += 3;
                continue;
            }
        }
        st.program.push_back({L_STEP, {(int)i, 0, 0, 0}, 1});
        ++i;
    }
    // Decode RMSNorms write their deferred copy into xn, and every matvec launch reading
    // one (its output unchanged since) takes it from there, whatever the flags: a
    // matvec's bits then depend neither on the fusions nor on the block's token count.
    int cur = -1;  // the norm step whose copy xn holds
    st.norm_in_step.assign(S.size(), -1);
    for (auto& L : st.program) {
        const Step& m = S[L.s[0]];
        // (A MATMUL_ID's ip[2] is its x rows: the norm's rows when its slots share them.)
        const bool reads_x = L.kind == L_MV || L.kind == L_SWIGLU || L.kind == L_MV_ADD || L.kind == L_MOE_FFN ||
                             L.kind == L_MOE_ROUTER || L.kind == L_MOE_DOWN_SUM ||
                             (L.kind == L_STEP && m.op == OP_MATMUL && m.ip[2] <= kRowExactMaxTokens) ||
                             (L.kind == L_STEP && is_mv_id(m));
        if (cur >= 0 && reads_x && m.buf[1] == S[cur].buf[0] && m.ip[0] == S[cur].ip[0] && m.ip[2] == S[cur].ip[1]) {
            L.norm_in = cur;
            L.xq_ready = true;
            L.slot = 2;
            for (int k = 0; k < L.n; ++k)
                if (S[L.s[k]].op == OP_MATMUL || S[L.s[k]].op == OP_MATMUL_ID) st.norm_in_step[L.s[k]] = cur;
        }
        if (L.kind == L_STEP && copy_norm(m)) {
            L.kind = L_NORM_Q;
            cur = L.s[0];
            continue;
        }
        for (int k = 0; k < L.n && cur >= 0; ++k) {
            int rd[6], wr[2], nr, nw;
            step_io(S[L.s[k]], rd, nr, wr, nw);
            for (int w = 0; w < nw; ++w)
                if (wr[w] == S[cur].buf[0]) cur = -1;
        }
    }
    // A one-token matvec's int8 input written by the launch producing it: attention (the
    // o projection's input) or gate|up + SwiGLU (down's, into the second scratch); so is
    // a decode expert down's, by the experts' gate|up + SwiGLU (every slot's column).
    for (size_t k = 0; (f & FUSE_QUANT) && k + 1 < st.program.size(); ++k) {
        auto& L = st.program[k];
        auto& N = st.program[k + 1];
        if (N.kind == L_ROPE_STORE || N.kind == L_NORM_Q || N.norm_in >= 0) continue;
        const Step& m = S[N.s[0]];
        if (L.kind == L_MOE_FFN && (N.kind == L_MOE_DOWN_SUM || (N.kind == L_STEP && is_mv_id(m)))) {
            const Step& g = S[L.s[0]];
            if (S[L.s[2]].buf[0] == m.buf[1] && g.ip[1] % 32 == 0 && m.ip[0] == g.ip[1] &&
                m.ip[2] == g.ip[4] * g.ip[5] && ws.get(m.w[0]).type != T_F32 && ws.get(m.w[0]).type != T_F16) {
                L.q_next = true;
                N.xq_ready = true;
                N.slot = 1;
            }
            continue;
        }
        if (!is_mv(m)) continue;
        const Step& p = S[L.s[0]];
        if (L.kind == L_STEP && p.op == OP_ATTN && p.ip[0] == 1 && m.buf[1] == p.buf[0] &&
                   m.ip[0] == p.ip[1] * p.ip[3]) {
            L.q_next = true;
            N.xq_ready = true;
        } else if (L.kind == L_SWIGLU && S[L.s[2]].buf[0] == m.buf[1] && p.ip[1] % 32 == 0 && m.ip[0] == p.ip[1]) {
            L.q_next = true;
            N.xq_ready = true;
            N.slot = 1;
        }
    }
    // Prefill GEMMs (never merged: one L_STEP each). Those with quantized weights, in
    // order, are the dequantization pipeline's lookahead. xh holds the f16 copy of one
    // buffer (rows x row length) from the launch that converted it: a GEMM (its input)
    // or a prefill RMSNorm whose next xh-reading GEMM reads its output (the norm then
    // writes the copy itself). A GEMM whose input is that buffer, in that shape, with no
    // step since the conversion writing it (a converting GEMM's own output included),
    // finds its f16 input already in xh: q, k, v over one normed x; gate, up.
    st.deqs.clear();
    int xh_buf = -1, xh_from = 0;  // the buffer xh copies; the first step that may have written it since
    int64_t xh_in = 0, xh_nt = 0;
    auto unwritten = [&](int buf, int from, int to) {
        for (int k = from; k < to; ++k) {
            int rd[6], wr[2], nr, nw;
            step_io(S[k], rd, nr, wr, nw);
            for (int i = 0; i < nw; ++i)
                if (wr[i] == buf) return false;
        }
        return true;
    };
    for (size_t e = 0; e < st.program.size(); ++e) {
        auto& L = st.program[e];
        if (L.kind != L_STEP) continue;
        const Step& s = S[L.s[0]];
        if (s.op == OP_RMS_NORM && s.ip[1] > kRowExactMaxTokens) {
            size_t g = e + 1;
            while (g < st.program.size() && !(st.program[g].kind == L_STEP && is_gemm_f16(S[st.program[g].s[0]], ws))) ++g;
            if (g < st.program.size()) {
                const Step& m = S[st.program[g].s[0]];
                if (m.buf[1] == s.buf[0] && m.ip[0] == s.ip[0] && m.ip[2] == s.ip[1] &&
                    unwritten(s.buf[0], L.s[0] + 1, st.program[g].s[0])) {
                    L.xh_out = true;
                    xh_buf = s.buf[0], xh_from = L.s[0] + 1, xh_in = s.ip[0], xh_nt = s.ip[1];
                }
            }
            continue;
        }
        if (!is_gemm_f16(s, ws)) continue;
        if (is_gemm_deq(s, ws)) {
            L.gq = (int)st.deqs.size();
            st.deqs.push_back({s.w[0], s.ip[0], s.ip[1]});
        }
        L.xh_ready = xh_buf == s.buf[1] && xh_in == s.ip[0] && xh_nt == s.ip[2] && unwritten(s.buf[1], xh_from, L.s[0]);
        xh_buf = s.buf[1], xh_from = L.s[0], xh_in = s.ip[0], xh_nt = s.ip[2];
    }
    // The q|k|v launch's tail (FUSE_ROPE): a one-token q|k|v matvec followed by rope q + rope k + KV store of
    // exactly its outputs does the rope and the store itself (k_matvec.cu's tail).
    for (size_t k = 0; (f & FUSE_ROPE) && k + 1 < st.program.size(); ++k) {
        auto& L = st.program[k];
        const auto& N = st.program[k + 1];
        if (L.kind != L_MV || N.kind != L_ROPE_STORE || N.qk_norm[0] >= 0) continue;
        const Step &q = S[N.s[0]], &kk = S[N.s[1]], &kv = S[N.s[2]];
        const int64_t hd = q.ip[2];
        if (q.ip[0] != 1 || hd % 4 || kv.ip[1] % hd) continue;
        int role[4] = {0, 0, 0, 0}, seen = 0;
        for (int m = 0; m < L.n; ++m) {
            const Step& mv = S[L.s[m]];
            const int y = mv.buf[0];
            const int r = y == q.buf[1] && mv.ip[1] == q.ip[1] * hd      ? 1
                          : y == kk.buf[1] && mv.ip[1] == kk.ip[1] * hd  ? 2
                          : y == kv.buf[2] && mv.ip[1] == kv.ip[1]       ? 3
                                                                          : 0;
            if (r && !(seen & (1 << r))) role[m] = r, seen |= 1 << r;
        }
        if (seen != 0xE) continue;
        for (int m = 0; m < 4; ++m) L.role[m] = role[m];
        L.rope[0] = N.s[0];
        L.rope[1] = N.s[1];
        L.rope[2] = N.s[2];
        st.program.erase(st.program.begin() + (long)k + 1);
    }
    for (size_t k = 0; k + 1 < st.program.size(); ++k) {
        const auto& nx = st.program[k + 1];
        if (st.program[k].kind != L_NORM_Q || nx.kind != L_MV) continue;
        int64_t rows = 0;
        for (int j = 0; j < nx.n; ++j) rows += S[nx.s[j]].ip[1];
        st.program[k].early_next = mv_blocks_one_wave(rows);
    }
    // The greedy pick last (after the passes above, which read entries' steps).
    mark_moe_groups(plan, st);
    if (st.pick_buf >= 0) st.program.push_back({L_ARGMAX, {0, 0, 0, 0}, 0});
    st.flags = plan.flags;
    if (st.exec) {
        cudaStreamSynchronize(lane().stream);
        cudaGraphExecDestroy(st.exec);
        st.exec = nullptr;
    }
}

// The angle table of the program's first q|k|v tail or rope + KV-store launch, filled once here, stream-ordered
// before any run. Positions run up to the KV cells (n_ctx, every sequence's). (Every
// block working its angles out in double measured slower: 0.5B tg128 1,565 / 1,564 /
// 1,561 against 1,588 / 1,606 / 1,599 with the table, 862161d.)
void build_rope_table(const Plan& plan, const DevWeights& dw, CudaPlanState& st) {
    for (const auto& L : st.program) {
        const bool tail = L.kind == L_MV && L.rope[0] >= 0;
        if (!tail && L.kind != L_ROPE_STORE) continue;
        const Step &q = plan.steps[tail ? L.rope[0] : L.s[0]], &kv = plan.steps[tail ? L.rope[2] : L.s[2]];
        const int64_t rows = kv.ip[2];
        const int n_rot = (int)q.ip[3];
        const RopeCfg cfg = rope_cfg(q, dw);
        if (st.rope_table && st.rope_rows == rows && st.rope_nrot == n_rot && same_angles(st.rope_cfg, cfg)) return;
        if (st.rope_table) {
            cudaStreamSynchronize(lane().stream);
            cudaFree(st.rope_table);
        }
        st.rope_table = (float2*)dev_alloc((size_t)rows * (n_rot / 2) * sizeof(float2));
        st.rope_rows = rows;
        st.rope_nrot = n_rot;
        st.rope_cfg = cfg;
        rope_table(st.rope_table, rows, n_rot, cfg);
        return;
    }
}

}  // namespace

void validate_plan(const Plan& plan, DevPool& pool, const WeightStore& ws, DevWeights& dw) {
    CudaPlanState& st = state_of(plan);
    // A plan whose last step writes the pool's pick target takes the argmax too.
    int pick_buf = -1;
    int64_t pick_n = 0;
    if (!plan.steps.empty()) {
        const int last = plan.steps.back().buf[0];
        pick_n = pool.valid(last) ? pool.pick_target(last) : 0;
        if (pick_n > 0) pick_buf = last;
    }
    if (st.pool == &pool && st.pool_count == pool.count() && st.weight_count == ws.count() &&
        st.flags == plan.flags && st.pick_buf == pick_buf && st.pick_n == pick_n)
        return;
    // Another pool's plan before: what its lane still runs of it ends first.
    if (st.lane && st.lane != pool.own_lane()) cudaStreamSynchronize(st.lane->stream);
    // The format's checks (ids, sizes, shapes), then what the CUDA kernels need.
    validate_format(plan, ws, pool.name(), [&](int id, size_t& have) {
        if (!pool.valid(id)) return false;
        have = pool.size(id);
        return true;
    });
    size_t wh = 0, wh2 = 0, xh = 0, attn = 0, attn_tk = 0, xqb = 0, xnb = 0, ropetk = 0, moeb = 0;
    int ndeq = 0;  // dequantized GEMMs so far: the pipeline alternates wh, wh2 in step order
    for (const Step& s : plan.steps) {
        const int64_t* ip = s.ip;
        switch (s.op) {
            case OP_ADD: case OP_MUL: case OP_SWIGLU: case OP_SILU: case OP_GET_ROWS:
                break;
            case OP_ROPE:
                // The q|k|v tail's tickets: q, k and v heads of a layer (each at most nh).
                if (ip[0] == 1) ropetk = std::max(ropetk, (size_t)(3 * ip[1]) * sizeof(int));
                if (s.w[0] >= 0) dw.ensure(ws, s.w[0]);
                break;
            case OP_SCALE: case OP_SOFTCAP: case OP_GELU: case OP_GEGLU: case OP_SLICE:
                break;
            case OP_RMS_NORM: case OP_QK_NORM:
                if (ip[0] > kRmsMaxRow) fail(s, "CUDA RMSNorm rows hold at most " + std::to_string(kRmsMaxRow) + " elements");
                if (copy_norm(s)) xnb = std::max(xnb, norm_copy_bytes(ip[0], ip[1]));
                if (s.w[0] >= 0) dw.ensure(ws, s.w[0]);
                break;
            case OP_MATMUL: {
                const Weight& w = need_weight(s, ws, 0);
                if (!matvec_type_supported(w.type)) fail(s, "weight type " + std::to_string(w.type) + " has no CUDA kernel");
                if (ip[0] % 32) fail(s, "CUDA matmuls need a row length that is a multiple of 32");
                if (ip[2] <= kRowExactMaxTokens) xqb = std::max(xqb, matvec_scratch_bytes(ip[0], ip[2]));
                if (ip[2] > kRowExactMaxTokens) {
                    if (w.type != T_F32 && w.type != T_F16) {
                        wh = std::max(wh, (size_t)(ip[0] * ip[1] * 2));
                        if (ndeq++ & 1) wh2 = std::max(wh2, (size_t)(ip[0] * ip[1] * 2));
                    }
                    if (w.type != T_F32) xh = std::max(xh, (size_t)(ip[0] * ip[2] * 2));
                }
                dw.ensure(ws, s.w[0]);
                if (s.w[1] >= 0) dw.ensure(ws, s.w[1]);
                break;
            }
            case OP_MOE_TOPK: case OP_MOE_WEIGHTS:
                if (ip[1] > kRouteMaxK || ip[0] > kRouteMaxExperts)
                    fail(s, "CUDA routes at most " + std::to_string(kRouteMaxK) + " of at most " +
                                std::to_string(kRouteMaxExperts) + " experts");
                break;
            case OP_SIGMOID: case OP_MOE_SUM:
                break;
            case OP_MATMUL_ID: {
                const Weight& w = need_weight(s, ws, 0);
                if (!matvec_type_supported(w.type)) fail(s, "weight type " + std::to_string(w.type) + " has no CUDA kernel");
                if (ip[0] % 32) fail(s, "CUDA matmuls need a row length that is a multiple of 32");
                if (is_mv_id(s)) xqb = std::max(xqb, matvec_scratch_bytes(ip[0], ip[2]));
                else moeb = std::max(moeb, moe_group_bytes(ip[3], ip[4] * ip[5]));
                dw.ensure(ws, s.w[0]);
                break;
            }
            case OP_GET_ROWS_W: {
                const Weight& w = need_weight(s, ws, 0);
                if (!matvec_type_supported(w.type)) fail(s, "table type " + std::to_string(w.type) + " has no CUDA kernel");
                dw.ensure(ws, s.w[0]);
                break;
            }
            case OP_KV_STORE:
                if (ip[3] != T_F16) fail(s, "the cuda backend stores KV as f16 only (kv_type " + std::to_string(ip[3]) + ")");
                break;
            case OP_ATTN:
                if (ip[6] != T_F16) fail(s, "the cuda backend stores KV as f16 only (kv_type " + std::to_string(ip[6]) + ")");
                if (!attn_head_dim_supported(ip[3])) fail(s, "head dim " + std::to_string(ip[3]) + " has no CUDA kernel");
                attn = std::max(attn, attn_scratch_floats(ip[0], ip[1], ip[3], ip[4], ip[8]) * 4);
                attn_tk = std::max(attn_tk, attn_tickets(ip[0], ip[1], ip[4], ip[8]) * sizeof(int));
                break;
            default:
                fail(s, std::string("op ") + op_name(s.op) + " has no CUDA kernel");
        }
    }
    // Scratch is sized from the plan alone and only grows, before any capture uses it.
    auto grow = [](void*& p, size_t& have, size_t need) {
        if (need <= have) return;
        if (p) {
            cudaStreamSynchronize(lane().stream);
            cudaFree(p);
        }
        p = dev_alloc(need);
        have = need;
    };
    if (st.exec && (wh > st.wh_bytes || wh2 > st.wh2_bytes || xh > st.xh_bytes || attn > st.attn_bytes || attn_tk > st.attn_tk_bytes ||
                    xqb > st.xq_bytes || xqb > st.xq2_bytes || xnb > st.xn_bytes ||
                    ropetk > st.rope_tk_bytes || moeb > st.moe_bytes)) {
        cudaStreamSynchronize(lane().stream);
        cudaGraphExecDestroy(st.exec);
        st.exec = nullptr;
    }
    grow(st.wh, st.wh_bytes, wh);
    grow(st.wh2, st.wh2_bytes, wh2);
    if (wh && !st.ev_start) {
        MC_CHECK(cudaEventCreateWithFlags(&st.ev_start, cudaEventDisableTiming));
        for (int b = 0; b < 2; ++b) {
            MC_CHECK(cudaEventCreateWithFlags(&st.ev_deq[b], cudaEventDisableTiming));
            MC_CHECK(cudaEventCreateWithFlags(&st.ev_gemm[b], cudaEventDisableTiming));
        }
    }
    grow(st.xh, st.xh_bytes, xh);
    grow(st.xq, st.xq_bytes, xqb);
    grow(st.xq2, st.xq2_bytes, xqb);
    grow(st.xn, st.xn_bytes, xnb);
    grow(st.moe, st.moe_bytes, moeb);
    if (ropetk > st.rope_tk_bytes) {
        void* m = st.rope_tk;
        grow(m, st.rope_tk_bytes, ropetk);
        MC_CHECK(cudaMemsetAsync(m, 0, ropetk, lane().stream));
        st.rope_tk = (int*)m;
    }
    if (!st.route_tk) {
        st.route_tk = (int*)dev_alloc(sizeof(int));
        MC_CHECK(cudaMemsetAsync(st.route_tk, 0, sizeof(int), lane().stream));
    }
    void* a = st.attn;
    grow(a, st.attn_bytes, attn);
    st.attn = (float*)a;
    void* tk = st.attn_tk;
    if (attn_tk > st.attn_tk_bytes) {
        grow(tk, st.attn_tk_bytes, attn_tk);
        // Stream-ordered, so it lands before any launch that draws a ticket.
        MC_CHECK(cudaMemsetAsync(tk, 0, attn_tk, lane().stream));
    }
    st.attn_tk = (int*)tk;
    st.pick_buf = pick_buf;
    st.pick_n = pick_n;
    if (pick_buf >= 0) {  // its device int and scratch exist before any capture records it
        pick_slot();
        argmax_ready();
    }
    build_program(plan, ws, st);
    build_rope_table(plan, dw, st);
    st.pool = &pool;
    st.lane = pool.own_lane();
    st.pool_count = pool.count();
    st.weight_count = ws.count();
}

namespace {

// MINFER_CUDA_PROFILE=1: direct runs time each launch with events (diagnostics only;
// the waits make the step slower). Totals per launch name, read by cuda_profile(); two
// threads' lanes book into them in turn.
std::map<std::string, ProfileEntry> g_profile;
std::mutex g_profile_mu;
// MINFER_CUDA_DIAG_SKIP="kind,null:kind,...": a diagnostic of what each launch kind
// costs inside the replayed graph, where programmatic dependent launch overlaps each
// launch with its neighbours (the stamps break that overlap): whole runs leave out the
// launches named by launch_name (a "null:" prefix launches an empty kernel in their
// place, which only waits for the launch before, so the difference is the launch's own
// work). The logits are wrong: it warns once on stderr, and is never for real use.
// The list as ",a,b,", or empty when unset (then no launch pays for a name lookup).
const std::string& diag_list() {
    static const std::string s = [] {
        const char* e = std::getenv("MINFER_CUDA_DIAG_SKIP");
        if (!(e && *e)) return std::string();
        std::fprintf(stderr, "minfer: MINFER_CUDA_DIAG_SKIP=%s leaves launches out: the results are wrong "
                             "(a timing diagnostic)\n", e);
        return "," + std::string(e) + ",";
    }();
    return s;
}
bool diag_listed(const std::string& what) { return diag_list().find("," + what + ",") != std::string::npos; }

thread_local bool g_profiling = false;  // inside a profiled direct run

// Runs fn; while profiling, also books its device time under name (a part of a launch,
// e.g. the prefill GEMM's dequantization, which the launch's own entry includes).
template <class Fn>
void timed_part(const char* name, Fn&& fn) {
    if (!g_profiling) {
        fn();
        return;
    }
    cudaEvent_t a, b;
    MC_CHECK(cudaEventCreate(&a));
    MC_CHECK(cudaEventCreate(&b));
    MC_CHECK(cudaEventRecord(a, lane().stream));
    fn();
    MC_CHECK(cudaEventRecord(b, lane().stream));
    MC_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    MC_CHECK(cudaEventElapsedTime(&ms, a, b));
    std::lock_guard<std::mutex> lk(g_profile_mu);
    ProfileEntry& e = g_profile[name];
    e.ms += ms;
    e.count += 1;
    cudaEventDestroy(a);
    cudaEventDestroy(b);
}

// Side-stream parts of a profiled run (the pipelined dequantizations): their event
// pairs are read once the run is done, so timing them never stalls the host between
// launches (which would show up as idle time in the main stream's entries).
thread_local bool g_prof_run = false;
thread_local std::vector<std::pair<cudaEvent_t, cudaEvent_t>> g_side_timed;

void book_side_parts() {
    for (auto& [a, b] : g_side_timed) {
        float ms = 0;
        if (cudaEventSynchronize(b) == cudaSuccess && cudaEventElapsedTime(&ms, a, b) == cudaSuccess) {
            std::lock_guard<std::mutex> lk(g_profile_mu);
            ProfileEntry& e = g_profile["  gemm: dequant (side stream)"];
            e.ms += ms;
            e.count += 1;
        }
        cudaEventDestroy(a);
        cudaEventDestroy(b);
    }
    g_side_timed.clear();
}

// Enqueues on the side stream the dequantization of pipelined GEMM k's weight into
// buffer k % 2, once the GEMM that read that buffer last is done: GEMM k - 2, or for
// the first two, whatever ran on the main stream before this run started. Every one is
// waited for by its GEMM on the main stream, so the side stream always joins back
// (before a capture ends, and before the main stream's run is over).
void side_dequant(const WeightStore& ws, const DevWeights& dw, CudaPlanState& st, int k) {
    Lane& c = lane();
    const CudaPlanState::Deq& d = st.deqs[k];
    const int b = k & 1;
    MC_CHECK(cudaStreamWaitEvent(c.side, k < 2 ? st.ev_start : st.ev_gemm[b], 0));
    auto run = [&] { dequant_f16(ws.get(d.h).type, dw.get(d.h), dw.stride(d.h), d.in, d.out, b ? st.wh2 : st.wh, c.side); };
    if (g_prof_run) {
        cudaEvent_t t0, t1;
        MC_CHECK(cudaEventCreate(&t0));
        MC_CHECK(cudaEventCreate(&t1));
        MC_CHECK(cudaEventRecord(t0, c.side));
        run();
        MC_CHECK(cudaEventRecord(t1, c.side));
        g_side_timed.emplace_back(t0, t1);
    } else {
        run();
    }
    MC_CHECK(cudaEventRecord(st.ev_deq[b], c.side));
}

// A decode MATMUL_ID's expert matvec (with up: gate|up + SwiGLU) into y.
MvIdJob id_job(const Step& s, const Step* up, float* y, DevPool& pool, const WeightStore& ws, const DevWeights& dw) {
    MvIdJob j;
    j.W = (const uint8_t*)dw.get(s.w[0]);
    j.W2 = up ? (const uint8_t*)dw.get(up->w[0]) : nullptr;
    j.row_bytes = dw.stride(s.w[0]);
    j.type = ws.get(s.w[0]).type;
    j.out = (int)s.ip[1];
    j.n_expert = (int)s.ip[3];
    j.k = (int)s.ip[4];
    j.nt = (int)s.ip[5];
    j.x_rows = s.ip[2];
    j.ids = (const int32_t*)pool.data(s.buf[2]);
    j.y = y;
    return j;
}

// MATMUL_ID into y: decode-sized blocks run the expert matvec (with up, gate|up + SwiGLU),
// xq_ready / xq / in_norm as for a matvec; larger ones group their slots by expert on the
// device (unless grouped: the MATMUL_ID before left this grouping in st.moe) and run the
// tiled expert matmul. Neither reads the ids on the host.
void run_matmul_id(const Step& s, const Step* up, float* y, DevPool& pool, const WeightStore& ws,
                   const DevWeights& dw, CudaPlanState& st, bool xq_ready, void* xq, bool in_norm, bool grouped,
                   bool q_next = false) {
    const int64_t* ip = s.ip;
    const int32_t type = ws.get(s.w[0]).type;
    const float* x = (const float*)pool.data(s.buf[1]);
    const int32_t* ids = (const int32_t*)pool.data(s.buf[2]);
    if (is_mv_id(s)) {
        MvIdJob j = id_job(s, up, y, pool, ws, dw);
        if (q_next) {  // the next launch's input: every slot's column, in the second scratch
            j.q_out = (int8_t*)st.xq2;
            j.ds_out = (float2*)((uint8_t*)st.xq2 + (size_t)ip[4] * ip[5] * ip[1]);
        }
        matvec_id(j, ip[0], x, xq ? xq : st.xq, xq_ready, in_norm);
        return;
    }
    if (up) fail(s, "gate|up MATMUL_IDs merge in decode blocks only");
    if (!grouped) moe_group(ids, ip[4] * ip[5], ip[3], st.moe);
    matmul_id_tiled(type, dw.get(s.w[0]), dw.stride(s.w[0]), ip[0], ip[1], ip[3], ip[4], ip[5], ip[2], x, st.moe, y);
}

// xq_ready / xq: a one-token matvec's int8 input is already in xq (else it uses st.xq);
// q_next: attention also writes its output's int8 copy into st.xq.
// L: the program entry of a whole run (the GEMM's place in the pipeline), else null.
// in_norm: a matvec reading a decode RMSNorm's deferred copy (in xq).
void launch_step(const Step& s, DevPool& pool, const WeightStore& ws, const DevWeights& dw, CudaPlanState& st,
                 bool xq_ready = false, void* xq = nullptr, bool q_next = false,
                 const CudaPlanState::Launch* L = nullptr, bool in_norm = false) {
    Lane& c = lane();
    const int64_t* ip = s.ip;
    auto F = [&](int slot) { return (float*)pool.data(s.buf[slot]); };
    auto I = [&](int slot) { return (const int32_t*)pool.data(s.buf[slot]); };
    auto W = [&](int slot) -> const void* { return s.w[slot] >= 0 ? dw.get(s.w[slot]) : nullptr; };
    switch (s.op) {
        case OP_ADD: add(F(1), F(2), F(0), ip[0]); break;
        case OP_MUL: mul(F(1), F(2), F(0), ip[0]); break;
        case OP_SWIGLU: swiglu(F(1), F(2), F(0), ip[0]); break;
        case OP_SILU: silu(F(1), F(0), ip[0]); break;
        case OP_RMS_NORM: case OP_QK_NORM:
            if (copy_norm(s))  // whole runs launch it as L_NORM_Q; partial runs, here
                rms_norm_copy(F(1), (const float*)W(0), F(0), ip[0], ip[1], s.fp[0], st.xn);
            else
                rms_norm(F(1), (const float*)W(0), F(0), ip[0], ip[1], s.fp[0], L && st.pipe && L->xh_out ? st.xh : nullptr);
            break;
        case OP_MATMUL: {
            const Weight& w = ws.get(s.w[0]);
            const int64_t in = ip[0], out = ip[1], nt = ip[2];
            const float* bias = (const float*)W(1);
            if (nt <= kRowExactMaxTokens) {
                MvJob j{};
                j.W = (const uint8_t*)W(0);
                j.row_bytes = dw.stride(s.w[0]);
                j.type = w.type;
                j.rows = (int)out;
                j.bias = bias;
                j.y = F(0);
                matvec_multi(&j, 1, in, F(1), xq ? xq : st.xq, (int)nt, xq_ready, nullptr, in_norm);
                break;
            }
            const float one = 1.0f, zero = 0.0f;
            if (w.type == T_F32) {
                check_blas(cublasGemmEx(c.blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)nt, (int)in, &one, W(0),
                                        CUDA_R_32F, (int)in, F(1), CUDA_R_32F, (int)in, &zero, F(0), CUDA_R_32F,
                                        (int)out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                           "cublasGemmEx f32");
            } else {
                const void* a = W(0);
                const bool piped = L && st.pipe;
                const int g = piped ? L->gq : -1;
                if (g >= 0) {
                    // Dequantized ahead on the side stream: wait for it (the time the main
                    // stream stalls is the profile's "dequant wait").
                    timed_part("  gemm: dequant wait", [&] { MC_CHECK(cudaStreamWaitEvent(c.stream, st.ev_deq[g & 1], 0)); });
                    a = (g & 1) ? st.wh2 : st.wh;
                } else if (w.type != T_F16) {
                    timed_part("  gemm: dequant", [&] { dequant_f16(w.type, W(0), dw.stride(s.w[0]), in, out, st.wh); });
                    a = st.wh;
                }
                if (!(piped && L->xh_ready)) timed_part("  gemm: x to f16", [&] { f32_to_f16(F(1), st.xh, in * nt); });
                timed_part("  gemm: cublas", [&] { check_blas(cublasGemmEx(c.blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)nt, (int)in, &one, a,
                                        CUDA_R_16F, (int)in, st.xh, CUDA_R_16F, (int)in, &zero, F(0), CUDA_R_32F,
                                        (int)out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                           "cublasGemmEx f16"); });
                if (g >= 0) {
                    // This buffer is free once the GEMM is done: the GEMM two ahead goes in it.
                    MC_CHECK(cudaEventRecord(st.ev_gemm[g & 1], c.stream));
                    if (g + 2 < (int)st.deqs.size()) side_dequant(ws, dw, st, g + 2);
                }
            }
            note_launch();
            if (bias) add_bias_rows(F(0), bias, nt, out);
            break;
        }
        case OP_GET_ROWS_W: {
            const Weight& w = ws.get(s.w[0]);
            get_rows_w(w.type, W(0), dw.stride(s.w[0]), ip[0], I(1), ip[1], w.ne1, F(0), c.err_dev);
            break;
        }
        case OP_GET_ROWS: get_rows_f32(F(1), ip[0], I(2), ip[1], ip[2], F(0), c.err_dev); break;
        case OP_ROPE: rope(F(1), F(0), I(2), ip[0], ip[1], ip[2], ip[3], rope_cfg(s, dw), c.err_dev); break;
        case OP_SCALE: scale(F(1), F(0), s.fp[0], ip[0]); break;
        case OP_SOFTCAP: softcap(F(1), F(0), s.fp[0], ip[0]); break;
        case OP_GELU: gelu(F(1), F(0), ip[0]); break;
        case OP_GEGLU: geglu(F(1), F(2), F(0), ip[0]); break;
        case OP_SLICE: slice_cols(F(1), F(0), ip[0], ip[1], ip[2], ip[3]); break;
        case OP_SIGMOID: sigmoid(F(1), F(0), ip[0]); break;
        case OP_MOE_TOPK:
            moe_route(F(1), (int32_t*)pool.data(s.buf[0]), nullptr, ip[0], ip[1], ip[2], 0, 0, 0.0f);
            break;
        case OP_MOE_WEIGHTS: moe_route(F(1), nullptr, F(0), ip[0], ip[1], ip[2], (int)ip[3], (int)ip[4], s.fp[0]); break;
        case OP_MOE_SUM: moe_sum(F(1), F(2), F(0), ip[0], ip[1], ip[2]); break;
        case OP_MATMUL_ID:
            run_matmul_id(s, nullptr, F(0), pool, ws, dw, st, xq_ready, xq, in_norm, L && L->moe_grouped);
            break;
        case OP_KV_STORE:
            kv_store_f16(F(1), F(2), I(3), ip[0], ip[1], ip[2], pool.data(s.buf[0]), pool.data(s.buf[4]), c.err_dev);
            break;
        case OP_ATTN: {
            AttnDev a;
            a.q = F(1);
            a.q_stride = ip[5];
            a.k = pool.data(s.buf[2]);
            a.v = pool.data(s.buf[3]);
            a.pos = I(4);
            a.span = s.buf[5] >= 0 ? I(5) : nullptr;
            a.out = F(0);
            a.nt = ip[0]; a.nh = ip[1]; a.nkv = ip[2]; a.hd = ip[3]; a.n_ctx = ip[4]; a.seq_ctx = ip[8];
            a.scale = s.fp[0];
            a.window = ip[7];
            a.softcap = s.fp[1];
            if (q_next) {
                a.q_out = (int8_t*)st.xq;
                a.ds_out = (float2*)((uint8_t*)st.xq + ip[1] * ip[3]);
            }
            attention(a, st.attn, st.attn_tk, c.err_dev);
            break;
        }
        default: fail(s, "unknown op code " + std::to_string(s.op));
    }
}

MvJob job_of(const Step& s, DevPool& pool, const WeightStore& ws, const DevWeights& dw) {
    const Weight& w = ws.get(s.w[0]);
    MvJob j{};
    j.W = (const uint8_t*)dw.get(s.w[0]);
    j.row_bytes = dw.stride(s.w[0]);
    j.type = w.type;
    j.rows = (int)s.ip[1];
    j.bias = s.w[1] >= 0 ? (const float*)dw.get(s.w[1]) : nullptr;
    j.y = (float*)pool.data(s.buf[0]);
    return j;
}

// The plan's angle table when it was filled for these angles (n_rot, cfg), with its
// positions in rows; else null (the launch works its angles out).
const float2* angle_table(const CudaPlanState& st, int n_rot, const RopeCfg& cfg, int64_t& rows) {
    if (!st.rope_table || st.rope_nrot != n_rot || !same_angles(st.rope_cfg, cfg)) return nullptr;
    rows = st.rope_rows;
    return st.rope_table;
}

void launch_merged(const CudaPlanState::Launch& L, const Plan& plan, DevPool& pool, const WeightStore& ws,
                   const DevWeights& dw, CudaPlanState& st) {
    const auto& S = plan.steps;
    auto F = [&](const Step& s, int slot) { return (float*)pool.data(s.buf[slot]); };
    void* xq = L.slot == 2 ? st.xn : L.slot == 1 ? st.xq2 : st.xq;
    const bool in_norm = L.norm_in >= 0;
    switch (L.kind) {
        case L_STEP: launch_step(S[L.s[0]], pool, ws, dw, st, L.xq_ready, xq, L.q_next, &L, in_norm); break;
        case L_NORM_Q: {
            const Step& s = S[L.s[0]];
            rms_norm_copy(F(s, 1), s.w[0] >= 0 ? (const float*)dw.get(s.w[0]) : nullptr, F(s, 0), s.ip[0], s.ip[1],
                          s.fp[0], st.xn, L.early_next);
            break;
        }
        case L_MV: {
            MvJob jobs[MV_MAX_JOBS];
            for (int k = 0; k < L.n; ++k) jobs[k] = job_of(S[L.s[k]], pool, ws, dw);
            if (L.rope[0] < 0) {
                matvec_multi(jobs, L.n, S[L.s[0]].ip[0], F(S[L.s[0]], 1), xq, 1, L.xq_ready, nullptr, in_norm);
                break;
            }
            const Step &q = S[L.rope[0]], &k = S[L.rope[1]], &kv = S[L.rope[2]];
            MvRopeStore r;
            for (int m = 0; m < 4; ++m) r.role[m] = L.role[m];
            r.yq = F(q, 0);
            r.yk = F(k, 0);
            r.pos = (const int32_t*)pool.data(q.buf[2]);
            r.cells = (const int32_t*)pool.data(kv.buf[3]);
            r.kc = pool.data(kv.buf[0]);
            r.vc = pool.data(kv.buf[4]);
            r.hd = (int)q.ip[2];
            r.n_rot = (int)q.ip[3];
            r.n_ctx = kv.ip[2];
            r.cfg = rope_cfg(q, dw);
            r.tickets = st.rope_tk;
            r.err = lane().err_dev;
            r.cs_table = angle_table(st, r.n_rot, r.cfg, r.cs_rows);
            matvec_multi(jobs, L.n, S[L.s[0]].ip[0], F(S[L.s[0]], 1), xq, 1, L.xq_ready, &r, in_norm);
            break;
        }
        case L_SWIGLU: {
            const Step &g = S[L.s[0]], &u = S[L.s[1]], &sw = S[L.s[2]];
            MvJob j = job_of(g, pool, ws, dw);
            const MvJob ju = job_of(u, pool, ws, dw);
            j.W2 = ju.W;
            j.row_bytes2 = ju.row_bytes;
            j.type2 = ju.type;
            j.bias2 = ju.bias;
            j.y = F(sw, 0);
            if (L.q_next) {
                j.q_out = (int8_t*)st.xq2;
                j.ds_out = (float2*)((uint8_t*)st.xq2 + g.ip[1]);
            }
            matvec_multi(&j, 1, g.ip[0], F(g, 1), xq, 1, L.xq_ready, nullptr, in_norm);
            break;
        }
        case L_MV_ADD: {
            const Step &m = S[L.s[0]], &ad = S[L.s[1]];
            MvJob j = job_of(m, pool, ws, dw);
            j.resid = F(ad, ad.buf[1] == m.buf[0] ? 2 : 1);
            j.y = F(ad, 0);
            matvec_multi(&j, 1, m.ip[0], F(m, 1), xq, m.ip[2], L.xq_ready, nullptr, in_norm);
            break;
        }
        case L_ROPE_STORE: {
            const Step &q = S[L.s[0]], &k = S[L.s[1]], &kv = S[L.s[2]];
            RopeStoreArgs a;
            a.xq = F(q, 1); a.yq = F(q, 0); a.nhq = q.ip[1];
            a.xk = F(k, 1); a.yk = F(k, 0); a.nhk = k.ip[1];
            if (L.qk_norm[0] >= 0) {
                const Step &nq = S[L.qk_norm[0]], &nk = S[L.qk_norm[1]];
                a.norm = true;
                a.xq = F(nq, 1);
                a.xk = F(nk, 1);
                a.wq = nq.w[0] >= 0 ? (const float*)dw.get(nq.w[0]) : nullptr;
                a.wk = nk.w[0] >= 0 ? (const float*)dw.get(nk.w[0]) : nullptr;
                a.eps_q = nq.fp[0];
                a.eps_k = nk.fp[0];
            }
            a.v = F(kv, 2);
            a.pos = (const int32_t*)pool.data(q.buf[2]);
            a.cells = (const int32_t*)pool.data(kv.buf[3]);
            a.nt = q.ip[0]; a.hd = q.ip[2]; a.n_rot = q.ip[3]; a.n_ctx = kv.ip[2];
            a.cfg = rope_cfg(q, dw);
            a.kc = pool.data(kv.buf[0]);
            a.vc = pool.data(kv.buf[4]);
            a.err = lane().err_dev;
            a.cs_table = angle_table(st, (int)a.n_rot, a.cfg, a.cs_rows);
            rope2_store(a);
            break;
        }
        case L_ARGMAX: argmax((const float*)pool.data(st.pick_buf), st.pick_n, pick_slot().dev, lane().err_dev); break;
        case L_MOE_ROUTE: {
            const Step &tk = S[L.s[0]], &wt = S[L.s[1]];
            moe_route(F(tk, 1), (int32_t*)pool.data(tk.buf[0]), F(wt, 0), tk.ip[0], tk.ip[1], tk.ip[2], (int)wt.ip[3],
                      (int)wt.ip[4], wt.fp[0]);
            break;
        }
        case L_MOE_ROUTER: {
            const Step &m = S[L.s[0]], &tk = S[L.s[1]], &wt = S[L.s[2]];
            MvRouteJob j;
            j.W = (const uint8_t*)dw.get(m.w[0]);
            j.row_bytes = dw.stride(m.w[0]);
            j.type = ws.get(m.w[0]).type;
            j.n_expert = (int)m.ip[1];
            j.nt = (int)m.ip[2];
            j.logits = F(m, 0);
            j.ticket = st.route_tk;
            j.ids = (int32_t*)pool.data(tk.buf[0]);
            j.w = F(wt, 0);
            j.k = (int)tk.ip[1];
            j.gating = (int)wt.ip[3];
            j.norm = (int)wt.ip[4];
            j.scale = wt.fp[0];
            matvec_route(j, m.ip[0], F(m, 1), xq, L.xq_ready, in_norm);
            break;
        }
        case L_MOE_DOWN_SUM: {
            const Step &m = S[L.s[0]], &sm = S[L.s[1]];
            const float* resid = nullptr;
            float* y = F(sm, 0);
            if (L.n == 3) {
                const Step& ad = S[L.s[2]];
                resid = F(ad, ad.buf[1] == sm.buf[0] ? 2 : 1);
                y = F(ad, 0);
            }
            matvec_id_sum(id_job(m, nullptr, F(m, 0), pool, ws, dw), m.ip[0], F(m, 1), xq, L.xq_ready, in_norm, F(sm, 2),
                          resid, y);
            break;
        }
        case L_MOE_FFN:
            run_matmul_id(S[L.s[0]], &S[L.s[1]], F(S[L.s[2]], 0), pool, ws, dw, st, L.xq_ready, xq, in_norm, false,
                          L.q_next);
            break;
        case L_MOE_SUM_ADD: {
            const Step &m = S[L.s[0]], &ad = S[L.s[1]];
            moe_sum(F(m, 1), F(m, 2), F(ad, 0), m.ip[0], m.ip[1], m.ip[2], F(ad, ad.buf[1] == m.buf[0] ? 2 : 1));
            break;
        }
    }
}

const char* launch_name(const CudaPlanState::Launch& L, const Plan& plan) {
    switch (L.kind) {
        case L_MV: return L.rope[0] >= 0 ? "fused_qkv_rope_store" : "fused_matvec";
        case L_SWIGLU: return "fused_ffn_swiglu";
        case L_MV_ADD: return "matvec_residual";
        case L_ROPE_STORE: return L.qk_norm[0] >= 0 ? "fused_norm_rope_kv_store" : "fused_rope_kv_store";
        case L_NORM_Q: return "rms_norm_copy";
        case L_ARGMAX: return "argmax";
        case L_MOE_ROUTE: return "moe_route";
        case L_MOE_ROUTER: return "moe_router";
        case L_MOE_DOWN_SUM: return L.n == 3 ? "moe_down_sum_residual" : "moe_down_sum";
        case L_MOE_FFN: return "moe_ffn_swiglu";
        case L_MOE_SUM_ADD: return "moe_sum_residual";
        default: {
            const Step& s = plan.steps[L.s[0]];
            if (s.op == OP_MATMUL) return s.ip[2] <= kRowExactMaxTokens ? "matvec" : "gemm";
            if (s.op == OP_MATMUL_ID) return is_mv_id(s) ? "matvec_id" : "matmul_id";
            return op_name(s.op);
        }
    }
}

size_t launch_weight_bytes(const CudaPlanState::Launch& L, const Plan& plan, const WeightStore& ws) {
    size_t b = 0;
    for (int k = 0; k < L.n; ++k) {
        const Step& s = plan.steps[L.s[k]];
        if (s.op == OP_MATMUL) b += ws.get(s.w[0]).nbytes;
        if (s.op == OP_MATMUL_ID) {  // the picked experts' rows, at most the whole tensor
            const Weight& w = ws.get(s.w[0]);
            b += std::min(w.nbytes, (size_t)(s.ip[1] * s.ip[4] * s.ip[5]) * w.row_bytes);
        }
    }
    return b;
}

// The pipeline's start: the side stream forks from the main stream here (inside a capture
// this wait makes it join the capture) and dequantizes the first two GEMMs' weights.
void start_pipe(const WeightStore& ws, const DevWeights& dw, CudaPlanState& st) {
    st.pipe = true;
    if (st.deqs.empty()) return;
    MC_CHECK(cudaEventRecord(st.ev_start, lane().stream));
    for (int k = 0; k < 2 && k < (int)st.deqs.size(); ++k) side_dequant(ws, dw, st, k);
}

bool stamping() {
    static const bool on = [] { const char* e = std::getenv("MINFER_CUDA_STAMP"); return e && *e && *e != '0'; }();
    return on;
}

// A whole run's stamps into the profile as "graph: <launch>": the time from the end of
// the launch before to the end of this one, which includes one stamp kernel. That cost
// is booked on its own as "graph: (stamp)": the gap between the two stamps at the start.
void book_stamps(const Plan& plan, const WeightStore& ws, CudaPlanState& st) {
    const size_t n = st.program.size() + 2;
    std::vector<int64_t> t(n);
    MC_CHECK(cudaMemcpyAsync(t.data(), st.stamps, n * sizeof(int64_t), cudaMemcpyDeviceToHost, lane().stream));
    MC_CHECK(cudaStreamSynchronize(lane().stream));
    std::lock_guard<std::mutex> lk(g_profile_mu);
    ProfileEntry& o = g_profile["graph: (stamp)"];
    o.ms += (double)(t[1] - t[0]) * 1e-6;
    o.count += 1;
    for (size_t k = 0; k < st.program.size(); ++k) {
        const auto& L = st.program[k];
        ProfileEntry& e = g_profile[std::string("graph: ") + launch_name(L, plan)];
        e.ms += (double)(t[k + 2] - t[k + 1]) * 1e-6;
        e.count += 1;
        e.bytes += launch_weight_bytes(L, plan, ws);
    }
    ProfileEntry& w = g_profile["graph: (whole run)"];
    w.ms += (double)(t[n - 1] - t[0]) * 1e-6;
    w.count += 1;
}

// Ends a whole run's prefill GEMM pipeline: a later partial run dequantizes on the main
// stream again. A run cut short by an error may leave dequantizations no GEMM waited
// for: the side stream is joined here (unchecked: this may run while unwinding).
struct PipeOff {
    CudaPlanState& st;
    ~PipeOff() {
        if (st.pipe && !st.deqs.empty() && std::uncaught_exceptions() > 0) {
            cudaEventRecord(st.ev_start, lane().side);
            cudaStreamWaitEvent(lane().stream, st.ev_start, 0);
        }
        st.pipe = false;
    }
};

void launch_program(const Plan& plan, DevPool& pool, const WeightStore& ws, const DevWeights& dw, CudaPlanState& st) {
    static const bool prof = [] { const char* e = std::getenv("MINFER_CUDA_PROFILE"); return e && *e && *e != '0'; }();
    PipeOff off{st};
    if (st.stamps) {
        stamp(st.stamps);
        stamp(st.stamps + 1);
        start_pipe(ws, dw, st);
        for (size_t k = 0; k < st.program.size(); ++k) {
            launch_merged(st.program[k], plan, pool, ws, dw, st);
            stamp(st.stamps + 2 + k);
        }
        return;
    }
    if (!prof || lane().capturing) {
        start_pipe(ws, dw, st);
        const bool diag = !diag_list().empty();
        for (const auto& L : st.program) {
            if (diag) {
                const std::string name = launch_name(L, plan);
                if (diag_listed(name)) continue;
                if (diag_listed("null:" + name)) {
                    null_launch(ctx().n_sm, 128);
                    continue;
                }
            }
            launch_merged(L, plan, pool, ws, dw, st);
        }
        return;
    }
    struct ProfRun {
        ProfRun() { g_prof_run = true; }
        ~ProfRun() {
            g_prof_run = false;
            book_side_parts();
        }
    } prof_run;
    start_pipe(ws, dw, st);
    cudaEvent_t a, b;
    MC_CHECK(cudaEventCreate(&a));
    MC_CHECK(cudaEventCreate(&b));
    for (const auto& L : st.program) {
        MC_CHECK(cudaEventRecord(a, lane().stream));
        g_profiling = true;
        try {
            launch_merged(L, plan, pool, ws, dw, st);
        } catch (...) {
            g_profiling = false;
            throw;
        }
        g_profiling = false;
        MC_CHECK(cudaEventRecord(b, lane().stream));
        MC_CHECK(cudaEventSynchronize(b));
        float ms = 0;
        MC_CHECK(cudaEventElapsedTime(&ms, a, b));
        std::lock_guard<std::mutex> lk(g_profile_mu);
        ProfileEntry& e = g_profile[launch_name(L, plan)];
        e.ms += ms;
        e.count += 1;
        e.bytes += launch_weight_bytes(L, plan, ws);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
}

bool graphs_disabled() {
    const char* e = std::getenv("MINFER_NO_CUDA_GRAPH");
    return e && *e && std::string(e) != "0";
}

}  // namespace

void run_plan(const Plan& plan, DevPool& pool, const WeightStore& ws, DevWeights& dw, size_t begin, size_t end) {
    validate_plan(plan, pool, ws, dw);
    CudaPlanState& st = state_of(plan);
    Context& c = ctx();
    Lane& l = lane();
    const size_t n = plan.steps.size();
    if (end > n) end = n;
    if (begin >= end) return;
    const bool whole = begin == 0 && end == n;
    const bool graphs = whole && !graphs_disabled() && !st.no_graph;
    // Whatever this run writes, the pick slot no longer answers for old logits; a
    // whole run of a program that ends with the argmax answers for its own.
    forget_pick();
    if (whole && stamping() && st.stamps_cap < st.program.size() + 2) {
        // The program grew (a pick added): a capture holding the old buffer goes with it.
        MC_CHECK(cudaStreamSynchronize(l.stream));
        if (st.exec) cudaGraphExecDestroy(st.exec);
        st.exec = nullptr;
        if (st.stamps) cudaFree(st.stamps);
        st.stamps_cap = 2 * st.program.size() + 16;
        MC_CHECK(cudaMalloc(&st.stamps, st.stamps_cap * sizeof(int64_t)));
    }
    auto picked = [&] {
        if (!whole || st.pick_buf < 0) return;
        PickSlot& pk = pick_slot();
        pk.pool = &pool;
        pk.buf = st.pick_buf;
        pk.n = st.pick_n;
    };
    if (graphs && st.exec) {
        MC_CHECK(cudaGraphLaunch(st.exec, l.stream));
        ++c.c.graph_launches;
        if (st.stamps) book_stamps(plan, ws, st);
        picked();
        return;
    }
    if (graphs && st.direct_runs >= 1) {
        // Capture: every launch below records into the graph instead of running.
        cudaGraph_t g = nullptr;
        MC_CHECK(cudaStreamBeginCapture(l.stream, cudaStreamCaptureModeThreadLocal));
        l.capturing = true;
        try {
            launch_program(plan, pool, ws, dw, st);
        } catch (...) {
            l.capturing = false;
            cudaStreamEndCapture(l.stream, &g);
            if (g) cudaGraphDestroy(g);
            cudaGetLastError();
            throw;
        }
        l.capturing = false;
        cudaError_t e = cudaStreamEndCapture(l.stream, &g);
        if (e == cudaSuccess) e = cudaGraphInstantiate(&st.exec, g, 0);
        if (e == cudaSuccess) {
            size_t nn = 0;
            cudaGraphGetNodes(g, nullptr, &nn);
            st.graph_nodes = nn;
            ++c.c.captures;
        }
        if (g) cudaGraphDestroy(g);
        if (e == cudaSuccess) {
            MC_CHECK(cudaGraphLaunch(st.exec, l.stream));
            ++c.c.graph_launches;
            picked();
            return;
        }
        // A plan that cannot be captured still runs, directly, from now on.
        cudaGetLastError();
        st.exec = nullptr;
        st.no_graph = true;
    }
    if (whole) {
        launch_program(plan, pool, ws, dw, st);
    } else {
        // Partial runs (tracing reads every node) launch the steps one by one.
        for (size_t i = begin; i < end; ++i) {
            const bool nm = st.norm_in_step[i] >= 0;
            launch_step(plan.steps[i], pool, ws, dw, st, nm, nm ? st.xn : nullptr, false, nullptr, nm);
        }
    }
    MC_CHECK(cudaGetLastError());
    if (whole) ++st.direct_runs;
    picked();
}

// bench/host_gap.py: the C++ floor of a step around a captured plan's replay, medians
// over reps (us): {launch, sync}; {the inputs' H2D (h2d_bytes from the mirror at src to
// dst), launch, sync}; {H2D, sync}; and reps launches with one sync (device-bound).
std::vector<double> replay_probe(const Plan& plan, void* dst, const void* src, size_t h2d_bytes, int reps) {
    const CudaPlanState* st = peek_state(plan);
    if (!st || !st->exec) throw std::invalid_argument("replay_probe: the plan has no capture");
    Lane& c = lane();
    using clk = std::chrono::steady_clock;
    auto us = [](clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
    std::vector<double> a, b, h;
    MC_CHECK(cudaStreamSynchronize(c.stream));
    for (int i = 0; i < reps; ++i) {
        auto t0 = clk::now();
        MC_CHECK(cudaGraphLaunch(st->exec, c.stream));
        MC_CHECK(cudaStreamSynchronize(c.stream));
        a.push_back(us(t0, clk::now()));
        t0 = clk::now();
        MC_CHECK(cudaMemcpyAsync(dst, src, h2d_bytes, cudaMemcpyHostToDevice, c.stream));
        MC_CHECK(cudaGraphLaunch(st->exec, c.stream));
        MC_CHECK(cudaStreamSynchronize(c.stream));
        b.push_back(us(t0, clk::now()));
        t0 = clk::now();
        MC_CHECK(cudaMemcpyAsync(dst, src, h2d_bytes, cudaMemcpyHostToDevice, c.stream));
        MC_CHECK(cudaStreamSynchronize(c.stream));
        h.push_back(us(t0, clk::now()));
    }
    auto t0 = clk::now();
    for (int i = 0; i < reps; ++i) MC_CHECK(cudaGraphLaunch(st->exec, c.stream));
    MC_CHECK(cudaStreamSynchronize(c.stream));
    const double ahead = us(t0, clk::now()) / reps;
    return {median_of(a), median_of(b), median_of(h), ahead};
}

double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

size_t plan_graph_nodes(const Plan& plan) {
    const CudaPlanState* st = peek_state(plan);
    return st ? st->graph_nodes : 0;
}

std::map<std::string, ProfileEntry> take_profile() {
    std::map<std::string, ProfileEntry> r;
    std::lock_guard<std::mutex> lk(g_profile_mu);
    r.swap(g_profile);
    return r;
}

size_t plan_launches(const Plan& plan) {
    const CudaPlanState* st = peek_state(plan);
    if (!st) return 0;
    // One launch per entry: attention merges its chunks inside its own launch.
    return st->program.size();
}

size_t plan_gemm_pipelined(const Plan& plan) {
    const CudaPlanState* st = peek_state(plan);
    return st ? st->deqs.size() : 0;
}

size_t plan_gemm_inputs_reused(const Plan& plan) {
    const CudaPlanState* st = peek_state(plan);
    size_t n = 0;
    if (st)
        for (const auto& L : st->program) n += L.xh_ready;
    return n;
}

bool plan_captured(const Plan& plan) {
    const CudaPlanState* st = peek_state(plan);
    return st && st->exec != nullptr;
}

std::vector<LaunchInfo> run_launches(const Plan& plan, DevPool& pool, const WeightStore& ws, DevWeights& dw,
                                     bool timed, const std::function<void(const LaunchInfo&, size_t)>& after) {
    // A read between launches waits for the stream, which the gate would hold until it times out.
    if (timed && after) throw std::invalid_argument("run_launches: a timed run reads nothing between its launches");
    validate_plan(plan, pool, ws, dw);
    CudaPlanState& st = state_of(plan);
    Context& c = ctx();
    const cudaStream_t stream = lane().stream;
    const size_t n = st.program.size();
    std::vector<LaunchInfo> out(n);
    std::vector<char> covered(plan.steps.size(), 0);
    for (size_t k = 0; k < n; ++k) {
        const auto& L = st.program[k];
        out[k].name = launch_name(L, plan);
        for (int j = 0; j < L.n; ++j) out[k].steps.push_back(L.s[j]);
        for (int r : L.rope)  // the q|k|v tail's folded rope and KV store steps
            if (r >= 0) out[k].steps.push_back(r);
        for (int r : L.qk_norm)  // the rope launch's folded q and k norms
            if (r >= 0) out[k].steps.push_back(r);
        std::sort(out[k].steps.begin(), out[k].steps.end());
        for (int s : out[k].steps) covered[s] = 1;
    }
    // A merge that folds steps some other way would leave them out of every trace unseen.
    for (size_t i = 0; i < covered.size(); ++i)
        if (!covered[i]) step_fail(plan.steps[i], "run_launches: the step is in no launch of the program");
    forget_pick();
    struct Events {
        std::vector<cudaEvent_t> ev;
        ~Events() {
            for (cudaEvent_t e : ev)
                if (e) cudaEventDestroy(e);
        }
    } events;
    struct Gate {  // opened on every way out, so an error never leaves the stream held
        bool shut = false;
        void open() {
            if (shut) tl::gate_open();
            shut = false;
        }
        ~Gate() { open(); }
    };
    if (timed) {
        events.ev.assign(n + 1, nullptr);
        for (auto& e : events.ev) MC_CHECK(cudaEventCreate(&e));
    }
    PipeOff off{st};
    Gate gate;
    if (timed) {
        // Launched one by one from the host, short kernels would wait on the host's launch
        // rate and the events would time that; queued behind the gate, they run back to back.
        tl::gate_close();
        gate.shut = true;
        MC_CHECK(cudaEventRecord(events.ev[0], stream));
    }
    start_pipe(ws, dw, st);
    for (size_t k = 0; k < n; ++k) {
        launch_merged(st.program[k], plan, pool, ws, dw, st);
        if (timed) MC_CHECK(cudaEventRecord(events.ev[k + 1], stream));
        if (after) after(out[k], k);
    }
    MC_CHECK(cudaGetLastError());
    if (timed) {
        gate.open();
        MC_CHECK(cudaEventSynchronize(events.ev[n]));
        ++c.c.syncs;
        raise_device_error();
        for (size_t k = 0; k < n; ++k) MC_CHECK(cudaEventElapsedTime(&out[k].ms, events.ev[k], events.ev[k + 1]));
    }
    return out;
}

}  // namespace minfer::cuda
