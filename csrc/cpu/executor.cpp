// Runs a lowered plan: one OpenMP parallel region for the whole plan, a barrier
// between steps (the ggml model), so a decode step costs one Python->C++ call.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu/ops.h"
#include "cpu/plan.h"
#include "cpu/quants.h"
#include "cpu/vec_math.h"

namespace minfer::cpu {

const char* op_name(int32_t op) {
    switch (op) {
        case OP_ADD: return "add";
        case OP_MUL: return "mul";
        case OP_SILU: return "silu";
        case OP_SWIGLU: return "swiglu";
        case OP_RMS_NORM: return "rms_norm";
        case OP_QK_NORM: return "qk_norm";
        case OP_MATMUL: return "matmul";
        case OP_GET_ROWS_W: return "get_rows_w";
        case OP_GET_ROWS: return "get_rows";
        case OP_ROPE: return "rope";
        case OP_KV_STORE: return "kv_store";
        case OP_ATTN: return "attn";
        default: return "?";
    }
}

int WeightStore::add(Weight w) {
    if (!weight_type_supported(w.type))
        throw std::invalid_argument("weight " + w.name + ": unsupported tensor type " + std::to_string(w.type));
    size_t rb = type_row_bytes(w.type, w.ne0);
    if (rb == 0)
        throw std::invalid_argument("weight " + w.name + ": row length " + std::to_string(w.ne0) +
                                    " is not a whole number of blocks of type " + std::to_string(w.type));
    if (rb * (size_t)w.ne1 != w.nbytes)
        throw std::invalid_argument("weight " + w.name + ": " + std::to_string(w.nbytes) + " bytes, expected " +
                                    std::to_string(rb * (size_t)w.ne1));
    w.row_bytes = rb;
    ws_.push_back(std::move(w));
    return (int)ws_.size() - 1;
}

const Weight& WeightStore::get(int h) const {
    if (h < 0 || h >= (int)ws_.size()) throw std::out_of_range("unknown weight handle " + std::to_string(h));
    return ws_[h];
}

int default_threads() {
    unsigned n = std::thread::hardware_concurrency();
    return n ? (int)n : 1;
}

namespace {

[[noreturn]] void fail(const Step& s, const std::string& what) {
    throw std::invalid_argument(std::string("plan step ") + op_name(s.op) + " (node " + std::to_string(s.node) +
                                "): " + what);
}

void need_buf(const Step& s, const Pool& pool, int slot, size_t nbytes, const char* role) {
    int id = s.buf[slot];
    if (!pool.valid(id)) fail(s, std::string(role) + " buffer " + std::to_string(id) + " is not in pool " + pool.name());
    if (pool.size(id) < nbytes)
        fail(s, std::string(role) + " buffer " + std::to_string(id) + " holds " + std::to_string(pool.size(id)) +
                    " bytes, needs " + std::to_string(nbytes));
}

const Weight& need_weight(const Step& s, const WeightStore& ws, int slot) {
    if (s.w[slot] < 0 || s.w[slot] >= ws.count()) fail(s, "missing weight");
    return ws.get(s.w[slot]);
}

}  // namespace

void validate_plan(const Plan& plan, const Pool& pool, const WeightStore& ws) {
    for (const Step& s : plan.steps) {
        const int64_t* ip = s.ip;
        switch (s.op) {
            case OP_ADD: case OP_MUL: case OP_SWIGLU:
                for (int i = 0; i < 3; ++i) need_buf(s, pool, i, ip[0] * 4, i ? "input" : "output");
                break;
            case OP_SILU:
                for (int i = 0; i < 2; ++i) need_buf(s, pool, i, ip[0] * 4, i ? "input" : "output");
                break;
            case OP_RMS_NORM: case OP_QK_NORM:
                need_buf(s, pool, 0, ip[0] * ip[1] * 4, "output");
                need_buf(s, pool, 1, ip[0] * ip[1] * 4, "input");
                if (s.w[0] >= 0) {
                    const Weight& w = ws.get(s.w[0]);
                    if (w.type != T_F32 || w.ne0 * w.ne1 != ip[0]) fail(s, "norm weight " + w.name + " must be f32[" + std::to_string(ip[0]) + "]");
                }
                break;
            case OP_MATMUL: {
                const Weight& w = need_weight(s, ws, 0);
                if (w.ne0 != ip[0] || w.ne1 != ip[1])
                    fail(s, "weight " + w.name + " is [" + std::to_string(w.ne0) + ", " + std::to_string(w.ne1) +
                                "], node wants [" + std::to_string(ip[0]) + ", " + std::to_string(ip[1]) + "]");
                need_buf(s, pool, 0, ip[1] * ip[2] * 4, "output");
                need_buf(s, pool, 1, ip[0] * ip[2] * 4, "input");
                if (s.w[1] >= 0) {
                    const Weight& b = ws.get(s.w[1]);
                    if (b.type != T_F32 || b.ne0 * b.ne1 != ip[1]) fail(s, "bias " + b.name + " must be f32[" + std::to_string(ip[1]) + "]");
                }
                break;
            }
            case OP_GET_ROWS_W: {
                const Weight& w = need_weight(s, ws, 0);
                if (w.ne0 != ip[0]) fail(s, "table " + w.name + " rows are " + std::to_string(w.ne0) + " wide, node wants " + std::to_string(ip[0]));
                need_buf(s, pool, 0, ip[0] * ip[1] * 4, "output");
                need_buf(s, pool, 1, ip[1] * 4, "ids");
                break;
            }
            case OP_GET_ROWS:
                need_buf(s, pool, 0, ip[0] * ip[1] * 4, "output");
                need_buf(s, pool, 1, ip[0] * ip[2] * 4, "input");
                need_buf(s, pool, 2, ip[1] * 4, "ids");
                break;
            case OP_ROPE:
                if (ip[3] > ip[2] || ip[3] % 2) fail(s, "n_rot must be even and <= head dim");
                need_buf(s, pool, 0, ip[0] * ip[1] * ip[2] * 4, "output");
                need_buf(s, pool, 1, ip[0] * ip[1] * ip[2] * 4, "input");
                need_buf(s, pool, 2, ip[0] * 4, "positions");
                break;
            case OP_KV_STORE:
                need_buf(s, pool, 0, ip[2] * ip[1] * 4, "K region");
                need_buf(s, pool, 1, ip[0] * ip[1] * 4, "k");
                need_buf(s, pool, 2, ip[0] * ip[1] * 4, "v");
                need_buf(s, pool, 3, ip[0] * 4, "cells");
                need_buf(s, pool, 4, ip[2] * ip[1] * 4, "V region");
                break;
            case OP_ATTN:
                if (ip[2] <= 0 || ip[1] % ip[2]) fail(s, "head count must be a multiple of the KV head count");
                need_buf(s, pool, 0, ip[0] * ip[1] * ip[3] * 4, "output");
                need_buf(s, pool, 1, ((ip[0] - 1) * ip[5] + ip[1] * ip[3]) * 4, "q");
                need_buf(s, pool, 2, ip[4] * ip[2] * ip[3] * 4, "K region");
                need_buf(s, pool, 3, ip[4] * ip[2] * ip[3] * 4, "V region");
                need_buf(s, pool, 4, ip[0] * 4, "positions");
                if (s.buf[5] >= 0) need_buf(s, pool, 5, ip[0] * 8, "span");
                break;
            default:
                fail(s, "unknown op code " + std::to_string(s.op));
        }
    }
}

namespace {

// Index data (token ids, positions, cells) is host-filled every step, so it is checked
// on every run, by every thread alike (same data, same verdict, no extra barrier).
bool ids_in_range(const int32_t* ids, int64_t n, int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < lo || ids[i] >= hi) return false;
    return true;
}

std::string data_error(const Step& s, Pool& pool) {
    auto I = [&](int slot) { return (const int32_t*)pool.data(s.buf[slot]); };
    const int64_t* ip = s.ip;
    switch (s.op) {
        case OP_GET_ROWS_W:
            if (!ids_in_range(I(1), ip[1], 0, ip[2])) return "token id outside the vocabulary [0, " + std::to_string(ip[2]) + ")";
            break;
        case OP_GET_ROWS:
            if (!ids_in_range(I(2), ip[1], 0, ip[2])) return "row id outside [0, " + std::to_string(ip[2]) + ")";
            break;
        case OP_KV_STORE:
            if (!ids_in_range(I(3), ip[0], 0, ip[2])) return "KV cell outside the context [0, " + std::to_string(ip[2]) + ")";
            break;
        case OP_ATTN:
            if (!ids_in_range(I(4), ip[0], 0, ip[4])) return "position outside the context [0, " + std::to_string(ip[4]) + ")";
            if (s.buf[5] >= 0) {
                const int32_t* sp = I(5);
                for (int64_t t = 0; t < ip[0]; ++t)
                    if (sp[2 * t] < 0 || sp[2 * t] > sp[2 * t + 1] || sp[2 * t + 1] > ip[4]) return "attention span outside the context";
            }
            break;
        default: break;
    }
    return {};
}

// The barrier between steps. A decode step crosses ~600 of them, so on an idle machine
// they must cost a few hundred nanoseconds (spin); but when another process holds a
// core, spinning burns the quantum the late thread needs and a step collapses 3-5x
// (measured with OpenMP's spinning barrier). So: spin briefly, then sleep on a futex
// (sched_yield measured no better than spinning under CFS).
class StepBarrier {
public:
    explicit StepBarrier(int n) : n_(n) {}
    void resize(int n) { n_ = n; }
    void wait() {
        if (n_ == 1) return;
        const int gen = gen_.load(std::memory_order_acquire);
        if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
            count_.store(0, std::memory_order_relaxed);
            gen_.fetch_add(1, std::memory_order_seq_cst);
            if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(&gen_);
            return;
        }
        for (int i = 0; i < spins(); ++i) {
            if (gen_.load(std::memory_order_acquire) != gen) return;
            pause();
        }
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (gen_.load(std::memory_order_seq_cst) == gen) futex_wait(&gen_, gen);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }

private:
    // ~100 us of pauses: on an idle machine a step's threads finish within that of each
    // other, so the futex (a ~50-100 us wake in a VM) is only hit under contention.
    // Measured decode step, 2 threads: 100 spins 29.9 ms, 2000 18.3 ms, 4000 17.1 ms.
    static int spins() {
        static const int n = std::getenv("MINFER_SPIN") ? std::atoi(std::getenv("MINFER_SPIN")) : 4000;
        return n;
    }
    static void pause() {
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
    }
    static void futex_wait(std::atomic<int>* a, int expected) {
        syscall(SYS_futex, reinterpret_cast<int*>(a), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
    }
    static void futex_wake(std::atomic<int>* a) {
        syscall(SYS_futex, reinterpret_cast<int*>(a), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
    }
    int n_;
    alignas(64) std::atomic<int> count_{0};
    alignas(64) std::atomic<int> gen_{0};
    alignas(64) std::atomic<int> sleepers_{0};
};

struct Scratch {
    std::vector<uint8_t> act[2];    // quantized activations: [0] Q8_0 family, [1] Q8_K
    std::vector<float> attn;        // nth * per-thread attention scratch
};

int act_slot(int32_t wtype);

// The rows of an output a thread computes: contiguous, multiples of 4 (whole tiles).
// argmax_f32 relies on using the same split as the matmul.
std::pair<int64_t, int64_t> row_range(int64_t rows, int ith, int nth) {
    int64_t r0, r1;
    vm::share(rows, ith, nth, 4, r0, r1);
    return {r0, r1};
}

// Hazard analysis for the barriers between steps. Every thread walks the same steps,
// and a step only reads what its sources hold and writes its outputs, so threads need
// to meet only where a step reads a buffer written since the last meeting, or writes a
// buffer read or written since then (the in-place ops included). The quantized
// activation scratch slots count as buffers (ids -1 and -2), written by a matmul whose
// input is not already quantized there: the memo is simulated exactly as run_plan
// keeps it. Consecutive q/k/v (and gate/up) matmuls and the two RoPEs then run back to
// back, which removes about a third of a decode step's barriers.
std::vector<uint8_t> plan_barriers(const Plan& plan, const WeightStore& ws) {
    const size_t n = plan.steps.size();
    std::vector<uint8_t> after(n, 1);
    std::vector<int> pend_r, pend_w;
    auto touches = [](const std::vector<int>& v, int id) { return std::find(v.begin(), v.end(), id) != v.end(); };
    int memo_src[2] = {-1, -1};
    int64_t memo_nt[2] = {0, 0};
    for (size_t i = 0; i < n; ++i) {
        const Step& s = plan.steps[i];
        std::vector<int> r, w;
        int quant_slot = -1;
        switch (s.op) {
            case OP_ADD: case OP_MUL: case OP_SWIGLU: r = {s.buf[1], s.buf[2]}; w = {s.buf[0]}; break;
            case OP_SILU: case OP_RMS_NORM: case OP_QK_NORM: case OP_GET_ROWS_W: r = {s.buf[1]}; w = {s.buf[0]}; break;
            case OP_GET_ROWS: case OP_ROPE: r = {s.buf[1], s.buf[2]}; w = {s.buf[0]}; break;
            case OP_KV_STORE: r = {s.buf[1], s.buf[2], s.buf[3]}; w = {s.buf[0], s.buf[4]}; break;
            case OP_ATTN: r = {s.buf[1], s.buf[2], s.buf[3], s.buf[4], s.buf[5]}; w = {s.buf[0]}; break;
            case OP_MATMUL: {
                const int slot = act_slot(ws.get(s.w[0]).type);
                w = {s.buf[0]};
                if (slot < 0) {
                    r = {s.buf[1]};
                } else {
                    r = {-1 - slot};
                    if (memo_src[slot] != s.buf[1] || memo_nt[slot] != s.ip[2]) quant_slot = slot;
                }
                break;
            }
            default: r.clear(); w.clear(); break;
        }
        bool meet = false;
        if (i > 0) {
            // The quantization phase reads the input and writes the scratch slot.
            std::vector<int> qr = r, qw = w;
            if (quant_slot >= 0) { qr.push_back(s.buf[1]); qw.push_back(-1 - quant_slot); }
            for (int id : qr) meet = meet || touches(pend_w, id);
            for (int id : qw) meet = meet || touches(pend_w, id) || touches(pend_r, id);
            after[i - 1] = meet;
        }
        if (meet) { pend_r.clear(); pend_w.clear(); }
        if (quant_slot >= 0) {
            // run_plan meets right after quantizing, so only the compute phase is pending.
            pend_r.clear(); pend_w.clear();
            memo_src[quant_slot] = s.buf[1];
            memo_nt[quant_slot] = s.ip[2];
        }
        pend_r.insert(pend_r.end(), r.begin(), r.end());
        pend_w.insert(pend_w.end(), w.begin(), w.end());
        if (s.op != OP_MATMUL) {
            memo_src[0] = memo_src[1] = -1;
        } else {
            for (int k = 0; k < 2; ++k)
                if (memo_src[k] == s.buf[0]) memo_src[k] = -1;
        }
    }
    return after;
}

int act_slot(int32_t wtype) {
    int32_t a = act_type_for(wtype);
    return a == T_Q8_K ? 1 : (a == T_Q8_0 ? 0 : -1);
}

}  // namespace

void run_plan(const Plan& plan, Pool& pool, const WeightStore& ws, int n_threads, size_t begin, size_t end) {
    end = std::min(end, plan.steps.size());
    if (begin >= end) return;
    if (plan.validated_pool != &pool || plan.validated_pool_count != pool.count() ||
        plan.validated_weight_count != ws.count()) {
        validate_plan(plan, pool, ws);
        plan.validated_pool = &pool;
        plan.validated_pool_count = pool.count();
        plan.validated_weight_count = ws.count();
        plan.barrier_after = std::getenv("MINFER_ALL_BARRIERS") ? std::vector<uint8_t>(plan.steps.size(), 1)
                                                                 : plan_barriers(plan, ws);
    }
    for (size_t i = begin; i < end; ++i) {
        std::string err = data_error(plan.steps[i], pool);
        if (!err.empty()) fail(plan.steps[i], err);  // inputs are filled before the run
    }
    int nth = std::max(1, n_threads);

    // Scratch sized for the largest consumer, grown only when a plan needs more.
    static thread_local Scratch tls_scratch;
    Scratch& scratch = tls_scratch;  // workers must see the caller's instance
    size_t need_act[2] = {0, 0};
    size_t attn_floats = 0;
    for (size_t i = begin; i < end; ++i) {
        const Step& s = plan.steps[i];
        if (s.op == OP_MATMUL) {
            const Weight& w = ws.get(s.w[0]);
            int slot = act_slot(w.type);
            if (slot >= 0) need_act[slot] = std::max(need_act[slot], act_row_bytes(w.type, s.ip[0]) * (size_t)s.ip[2]);
        } else if (s.op == OP_ATTN) {
            AttnArgs a{};
            a.nt = s.ip[0]; a.nh = s.ip[1]; a.nkv = s.ip[2]; a.hd = s.ip[3]; a.n_ctx = s.ip[4];
            attn_floats = std::max(attn_floats, attention_scratch_floats(a));
        }
    }
    for (int k = 0; k < 2; ++k)
        if (scratch.act[k].size() < need_act[k]) scratch.act[k].resize(need_act[k]);
    if (scratch.attn.size() < attn_floats * nth) scratch.attn.resize(attn_floats * nth);

    // The team size is fixed before the barrier is sized: no dynamic adjustment.
    omp_set_dynamic(0);
    StepBarrier barrier(nth);
    #pragma omp parallel num_threads(nth)
    {
        // OpenMP may grant fewer threads than asked (OMP_THREAD_LIMIT): size to the team.
        #pragma omp single
        barrier.resize(omp_get_num_threads());
        const int ith = omp_get_thread_num();
        const int nt_ = omp_get_num_threads();
        // Which input buffer each activation slot currently holds, quantized. Every
        // thread walks the same steps, so these private copies agree.
        int memo_src[2] = {-1, -1};
        int64_t memo_nt[2] = {0, 0};
        for (size_t i = begin; i < end; ++i) {
            const Step& s = plan.steps[i];
            const int64_t* ip = s.ip;
            auto F = [&](int slot) { return (float*)pool.data(s.buf[slot]); };
            auto I = [&](int slot) { return (const int32_t*)pool.data(s.buf[slot]); };
            bool writes_memo_src = false;
            switch (s.op) {
                case OP_ADD: add_f32(F(1), F(2), F(0), ip[0], ith, nt_); break;
                case OP_MUL: mul_f32(F(1), F(2), F(0), ip[0], ith, nt_); break;
                case OP_SILU: silu_f32(F(1), F(0), ip[0], ith, nt_); break;
                case OP_SWIGLU: swiglu_f32(F(1), F(2), F(0), ip[0], ith, nt_); break;
                case OP_RMS_NORM: case OP_QK_NORM: {
                    const float* w = s.w[0] >= 0 ? (const float*)ws.get(s.w[0]).data : nullptr;
                    rms_norm_f32(F(1), w, F(0), ip[0], ip[1], s.fp[0], ith, nt_);
                    break;
                }
                case OP_MATMUL: {
                    const Weight& w = ws.get(s.w[0]);
                    const int64_t in = ip[0], out = ip[1], nt = ip[2];
                    const int slot = act_slot(w.type);
                    const uint8_t* act;
                    size_t arb;
                    if (slot < 0) {
                        act = (const uint8_t*)F(1);
                        arb = (size_t)in * 4;
                    } else {
                        arb = act_row_bytes(w.type, in);
                        uint8_t* q = scratch.act[slot].data();
                        if (memo_src[slot] != s.buf[1] || memo_nt[slot] != nt) {
                            const float* x = F(1);
                            for (int64_t t = ith; t < nt; t += nt_) quantize_act_row(w.type, x + t * in, q + t * arb, in);
                            barrier.wait();
                            memo_src[slot] = s.buf[1];
                            memo_nt[slot] = nt;
                        }
                        act = q;
                    }
                    float* y = F(0);
                    // Rows split into contiguous per-thread ranges (multiples of 4 keep tiles whole).
                    const auto [r0, r1] = row_range(out, ith, nt_);
                    constexpr int RB = 16, TB = 4;
                    for (int64_t r = r0; r < r1; r += RB) {
                        const int nw = (int)std::min<int64_t>(RB, r1 - r);
                        for (int64_t t = 0; t < nt; t += TB) {
                            const int na = (int)std::min<int64_t>(TB, nt - t);
                            vec_dot_tile(w.type, in, w.data + r * w.row_bytes, w.row_bytes, nw,
                                         act + t * arb, arb, na, y + t * out + r, (size_t)out);
                        }
                    }
                    if (s.w[1] >= 0 && r1 > r0) {
                        const float* b = (const float*)ws.get(s.w[1]).data;
                        for (int64_t t = 0; t < nt; ++t)
                            for (int64_t r = r0; r < r1; ++r) y[t * out + r] += b[r];
                    }
                    writes_memo_src = true;
                    break;
                }
                case OP_GET_ROWS_W: {
                    const Weight& w = ws.get(s.w[0]);
                    get_rows_w(w.type, w.data, w.row_bytes, ip[0], I(1), ip[1], F(0), ith, nt_);
                    break;
                }
                case OP_GET_ROWS: get_rows_f32(F(1), ip[0], I(2), ip[1], F(0), ith, nt_); break;
                case OP_ROPE: rope_neox_f32(F(1), F(0), I(2), ip[0], ip[1], ip[2], ip[3], s.fp[0], ith, nt_); break;
                case OP_KV_STORE: kv_store_f32(F(1), F(2), I(3), ip[0], ip[1], F(0), F(4), ith, nt_); break;
                case OP_ATTN: {
                    AttnArgs a{};
                    a.q = F(1); a.q_stride = ip[5]; a.k = F(2); a.v = F(3); a.pos = I(4);
                    a.span = s.buf[5] >= 0 ? I(5) : nullptr;
                    a.out = F(0); a.nt = ip[0]; a.nh = ip[1]; a.nkv = ip[2]; a.hd = ip[3]; a.n_ctx = ip[4];
                    a.scale = s.fp[0];
                    attention_f32(a, scratch.attn.data() + attn_floats * ith, ith, nt_);
                    break;
                }
                default: break;
            }
            // A step that writes a buffer a memo points at makes that memo stale;
            // non-matmul steps drop the memo outright (cheap and obviously safe).
            if (!writes_memo_src) {
                memo_src[0] = memo_src[1] = -1;
            } else {
                for (int k = 0; k < 2; ++k)
                    if (memo_src[k] == s.buf[0]) memo_src[k] = -1;
            }
            if (plan.barrier_after[i]) barrier.wait();
        }
    }
}

int64_t argmax_f32(const float* x, int64_t n, int n_threads) {
    const int nth = std::max(1, n_threads);
    std::vector<int64_t> best(nth, -1);
    #pragma omp parallel num_threads(nth)
    {
        const int ith = omp_get_thread_num();
        const auto [r0, r1] = row_range(n, ith, omp_get_num_threads());
        int64_t b = r0 < r1 ? r0 : -1;
        for (int64_t i = r0 + 1; i < r1; ++i)
            if (x[i] > x[b]) b = i;
        best[ith] = b;
    }
    int64_t b = -1;
    for (int64_t c : best)
        if (c >= 0 && (b < 0 || x[c] > x[b])) b = c;
    return b;
}

}  // namespace minfer::cpu
