// The process's CUDA context as the backend uses it: one device, its properties, the
// counters of what a step costs the host, and lanes. A lane is one stream set: the stream
// every kernel, copy and graph launch of its owner is ordered on, a second stream (`side`)
// that only dequantizes prefill GEMM weights ahead of the main one (every run forks it
// from and joins it back to the main stream through events, so ordering on the main
// stream alone stays the contract), a cuBLAS handle with a fixed workspace (so GEMMs can
// be captured into graphs), the greedy pick slot, readback staging and the device error
// word. Each device pool (one per Python Context) owns a lane, so two contexts on two
// threads run concurrently, each on its own stream, and no capture can record another
// thread's launch (captures are cudaStreamCaptureModeThreadLocal, so another thread's
// allocations are legal meanwhile; nothing here syncs the legacy default stream). Calls
// with no pool (device queries, probes) use the default lane. Kernels and the executor
// read the calling thread's current lane (lane()), which bindings_cuda.cpp's LaneGuard
// sets.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace minfer::cuda {

[[noreturn]] void throw_cuda(cudaError_t e, const char* what);
inline void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw_cuda(e, what);
}
void check_blas(cublasStatus_t s, const char* what);
#define MC_CHECK(x) ::minfer::cuda::check((x), #x)

// Per-process counts (every lane's), read by tests that assert a reused step's budget.
// Atomic: two threads' lanes bump them at once.
struct Counters {
    using N = std::atomic<uint64_t>;
    N launches{0};        // kernel launches issued directly (not replays)
    N graph_launches{0};  // cudaGraphLaunch calls
    N captures{0};        // graphs captured
    N h2d{0}, d2h{0}, d2d{0};
    N h2d_bytes{0}, d2h_bytes{0};
    N syncs{0};           // host waits on a stream or an event
    N allocs{0};          // cudaMalloc / cudaMallocHost calls
    N staged{0};          // launches of the staged matvec (k_matvec_bulk), direct or captured
    N x4{0};              // launches of the four-rows-a-block matvec (k_matvec_x4)
    N pair{0};            // launches of a two-type matvec instantiation (mv_pair)
    N mmq{0};             // batched matmuls on the int8 tensor cores (k_mmq), direct or captured
    void reset() {
        for (N* n : {&launches, &graph_launches, &captures, &h2d, &d2h, &d2d, &h2d_bytes, &d2h_bytes, &syncs,
                     &allocs, &staged, &x4, &pair, &mmq})
            *n = 0;
    }
};

// The greedy pick: the argmax kernel's device int and its pinned host copy (one 4-byte
// D2H). A plan whose last step writes a pool's pick target ends with the argmax, inside
// its graph; `pool`/`buf`/`n` then name the logits the device int already answers for,
// until anything else runs or writes (forget_pick), so argmax is just the readback.
struct PickSlot {
    int32_t* dev = nullptr;
    int32_t* host = nullptr;
    const void* pool = nullptr;
    int buf = -1;
    int64_t n = 0;
};

// A device buffer and its pinned host twin, grown together (a readback's staging).
struct Staging {
    void* dev = nullptr;
    void* pin = nullptr;
    size_t cap = 0;
    void grow(size_t need);  // frees the old pair: only once nothing in flight uses it
    Staging() = default;
    Staging(const Staging&) = delete;
    Staging& operator=(const Staging&) = delete;
    ~Staging();
};

struct Lane {
    cudaStream_t stream = nullptr;
    cudaStream_t side = nullptr;    // the prefill GEMMs' weight dequantization (executor.cpp)
    cublasHandle_t blas = nullptr;  // none on the default lane, which runs no plan
    void* blas_ws = nullptr;
    bool capturing = false;
    // Device-side guard: kernels that find an index out of range (token id, KV cell,
    // position) store a nonzero code here (mapped pinned memory, so the host reads it
    // after its next wait without a copy). Never a silent clamp. One per lane, so a
    // context raises its own bad index data, never another thread's.
    int* err_host = nullptr;
    int* err_dev = nullptr;
    PickSlot pick;
    void* argmax_scratch = nullptr;  // the argmax kernel's posts and tickets (k_ops.cu)
    // The staging of argmax_rows and top_k_rows (each ends with a wait, so they share
    // rows_out) and of mask_rows (bindings_cuda.cpp).
    Staging rows_in, rows_out, mask;
    cudaEvent_t mask_copied = nullptr;  // mask_rows' last copy out of `mask`
    void* topk_scratch = nullptr;
    size_t topk_scratch_bytes = 0;
    cudaEvent_t handoff = nullptr;  // copy_buffer between two lanes' pools orders them with it
    // Held by every binding that uses the lane (bindings_cuda.cpp, LaneGuard): one
    // context used from two threads takes its lane in turn.
    std::recursive_mutex mu;

    explicit Lane(bool gemms);
    ~Lane();  // waits for the streams first
    Lane(const Lane&) = delete;
    Lane& operator=(const Lane&) = delete;
};

struct Context {
    int device = 0;
    int n_sm = 0;
    int smem_per_sm = 0;  // shared memory per SM, and the most one block may opt in to (bytes)
    int smem_optin = 0;
    Counters c;
    std::shared_ptr<Lane> deflt;  // the lane of calls that have no pool
};

// Number of visible devices; on failure 0 and *why says what is missing.
int device_count(std::string* why);
std::string device_name();
// The context, created on first use; throws if no device can be used.
Context& ctx();
// A pool's lane (with cuBLAS).
std::shared_ptr<Lane> new_lane();
// The calling thread's current lane: the one a LaneGuard set, else the default lane.
Lane& lane();
// Makes l the calling thread's current lane (null: none); returns the one before.
Lane* swap_lane(Lane* l);
// Every lane alive now (cuda_sync waits for each).
std::vector<std::shared_ptr<Lane>> live_lanes();
// After a host wait: raise if a kernel on the current lane flagged bad index data since
// the last check.
void raise_device_error();
void sync_stream();  // the current lane's
// Counts one kernel launch (a direct one; launches recorded into a capture are not).
inline void note_launch() {
    if (!lane().capturing) ++ctx().c.launches;
}

// Allocation helpers that count.
void* dev_alloc(size_t nbytes);
void* host_alloc_pinned(size_t nbytes);

PickSlot& pick_slot();  // the current lane's; dev/host allocated on first use (never inside a capture)
void forget_pick();

}  // namespace minfer::cuda
