#include "cpu/step_stats.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "common/plan.h"

namespace minfer::cpu::stats {

namespace {
std::mutex mu;
Totals totals;
}  // namespace

bool enabled() {
    static const bool on = [] {
        const char* e = std::getenv("MINFER_CPU_STATS");
        return e && *e && std::string(e) != "0";
    }();
    return on;
}

void RunTimes::init(int n_threads, size_t n_steps) {
    nth = n_threads;
    nsteps = n_steps;
    work.assign((size_t)n_threads * n_steps, 0);
    wait.assign(work.size(), 0);
    quant.assign(work.size(), 0);
    stolen.assign(work.size(), 0);
    op.assign(n_steps, 0);
    barrier.assign(n_steps, 0);
}

void add_run(const RunTimes& t, uint64_t wall_ns) {
    std::lock_guard<std::mutex> lock(mu);
    totals.runs += 1;
    totals.threads = t.nth;
    totals.wall_s += wall_ns * 1e-9;
    for (size_t i = 0; i < t.nsteps; ++i) {
        OpTotals& o = totals.ops[op_name(t.op[i])];
        OpTotals& q = totals.ops["quantize"];
        uint64_t crit = 0, qcrit = 0;
        bool quantized = false;
        for (int k = 0; k < t.nth; ++k) {
            const size_t j = i * t.nth + k;
            const uint64_t w = t.work[j] - t.quant[j];
            o.work_s += w * 1e-9;
            o.wait_s += t.wait[j] * 1e-9;
            o.stolen += (int64_t)t.stolen[j];
            crit = std::max(crit, w);
            q.work_s += t.quant[j] * 1e-9;
            qcrit = std::max(qcrit, t.quant[j]);
            quantized = quantized || t.quant[j];
        }
        o.steps += 1;
        o.crit_s += crit * 1e-9;
        if (quantized) {
            q.steps += 1;
            q.crit_s += qcrit * 1e-9;
        }
        totals.barriers += t.barrier[i];
    }
    if (totals.ops["quantize"].steps == 0) totals.ops.erase("quantize");
}

Totals take(bool reset) {
    std::lock_guard<std::mutex> lock(mu);
    Totals out = totals;
    if (reset) totals = Totals{};
    return out;
}

}  // namespace minfer::cpu::stats
