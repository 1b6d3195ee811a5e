#include "cpu/thread_pin.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <strings.h>
#include <unistd.h>
#endif

namespace minfer::cpu::pin {

namespace {

#if defined(__linux__)

std::vector<int> mask_cpus(const cpu_set_t& set) {
    std::vector<int> v;
    for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) v.push_back(c);
    return v;
}

bool set_mask(const std::vector<int>& cpus) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : cpus) CPU_SET(c, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

std::vector<int> own_mask() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return {};
    return mask_cpus(set);
}

long read_id(int cpu, const char* what) {
    char path[128];
    std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/%s", cpu, what);
    FILE* f = std::fopen(path, "r");
    if (!f) return -1;
    long v = -1;
    if (std::fscanf(f, "%ld", &v) != 1) v = -1;
    std::fclose(f);
    return v;
}

// (package, core) of a CPU, read once per CPU from sysfs; a CPU without topology
// files counts as its own core.
std::pair<long, long> core_of(int cpu) {
    static std::mutex mu;
    static std::vector<std::pair<long, long>> known;  // index: cpu; first == -2: not read yet
    std::lock_guard<std::mutex> lock(mu);
    if ((int)known.size() <= cpu) known.resize(cpu + 1, {-2, -2});
    if (known[cpu].first == -2) {
        const long pkg = read_id(cpu, "physical_package_id"), core = read_id(cpu, "core_id");
        known[cpu] = core < 0 ? std::make_pair(-1L, (long)-1 - cpu) : std::make_pair(pkg, core);
    }
    return known[cpu];
}

// Cores-first order of a mask: a CPU's rank is how many CPUs of the same core come
// before it in the mask; order by (rank, cpu). On a machine with one CPU per core that
// is the mask in ascending order.
std::vector<int> order_of(const std::vector<int>& mask) {
    std::vector<std::pair<int, int>> ranked;
    std::vector<std::pair<long, long>> cores;
    for (int c : mask) {
        const auto k = core_of(c);
        ranked.emplace_back((int)std::count(cores.begin(), cores.end(), k), c);
        cores.push_back(k);
    }
    std::sort(ranked.begin(), ranked.end());
    std::vector<int> out;
    for (const auto& r : ranked) out.push_back(r.second);
    return out;
}

bool env_allows() {
    const char* e = std::getenv("MINFER_CPU_PIN");
    if (e && std::string(e) == "0") return false;
    // The user asked OpenMP to place threads: its binding wins.
    const char* b = std::getenv("OMP_PROC_BIND");
    if (b && strcasecmp(b, "false") != 0) return false;
    return !std::getenv("OMP_PLACES") && !std::getenv("GOMP_CPU_AFFINITY");
}

// The CPU this thread was pinned to by a team placement (-1: not pinned by us), and a
// CPU that refused it (not asked again: a failing pin costs a syscall per run).
thread_local int tl_pinned = -1;
thread_local int tl_refused = -1;

#endif  // __linux__

}  // namespace

#if defined(__linux__)

std::vector<int> cpu_order() { return order_of(own_mask()); }

TeamPlacement::TeamPlacement(int n_threads) {
    if (n_threads < 2 || !env_allows()) {
        // Still read the mask: a worker pinned by an earlier team must be given it back.
        mask_ = own_mask();
        return;
    }
    // The order is cached per calling thread while its mask stays the same.
    thread_local std::vector<int> last_mask, last_order;
    mask_ = own_mask();
    if (mask_ != last_mask) {
        last_order = order_of(mask_);
        last_mask = mask_;
    }
    if (n_threads <= (int)last_order.size()) cpus_.assign(last_order.begin(), last_order.begin() + n_threads);
}

TeamPlacement::~TeamPlacement() {
    if (caller_moved_ && !mask_.empty()) set_mask(mask_);
}

void TeamPlacement::place(int ith) {
    if (ith == 0) {
        // The calling thread: pinned for this run only (the destructor undoes it).
        if (!cpus_.empty()) caller_moved_ = set_mask({cpus_[0]});
        return;
    }
    if (cpus_.empty() || ith >= (int)cpus_.size()) {
        if (tl_pinned >= 0 && !mask_.empty() && set_mask(mask_)) tl_pinned = -1;
        return;
    }
    const int want = cpus_[ith];
    if (tl_pinned == want) return;
    if (tl_refused != want && set_mask({want})) {
        tl_pinned = want;
        return;
    }
    // Refused (a cgroup or hotplug change since the mask was read): run unpinned.
    tl_refused = want;
    if (tl_pinned >= 0 && !mask_.empty() && set_mask(mask_)) tl_pinned = -1;
}

std::vector<std::vector<int>> team_masks(int n_threads) {
    const int n = std::max(1, n_threads);
    std::vector<std::vector<int>> out(n);
    #pragma omp parallel num_threads(n)
    out[omp_get_thread_num()] = own_mask();
    return out;
}

#else  // no affinity API: nothing is pinned

std::vector<int> cpu_order() { return {}; }
TeamPlacement::TeamPlacement(int) {}
TeamPlacement::~TeamPlacement() {}
void TeamPlacement::place(int) {}
std::vector<std::vector<int>> team_masks(int n_threads) { return std::vector<std::vector<int>>(std::max(1, n_threads)); }

#endif

}  // namespace minfer::cpu::pin
