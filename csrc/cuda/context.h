// The process's CUDA context as the backend uses it: one device, one stream that every
// kernel, copy and graph launch is ordered on, one cuBLAS handle with a fixed workspace
// (so GEMMs can be captured into graphs), and counters of what a step costs the host.
// A second stream (`side`) only dequantizes prefill GEMM weights ahead of the main one;
// every run forks it from and joins it back to the main stream through events, so
// ordering on the main stream alone stays the contract for everything else.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

namespace minfer::cuda {

[[noreturn]] void throw_cuda(cudaError_t e, const char* what);
inline void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw_cuda(e, what);
}
void check_blas(cublasStatus_t s, const char* what);
#define MC_CHECK(x) ::minfer::cuda::check((x), #x)

// Per-process counts, read by tests that assert a reused step's budget.
struct Counters {
    uint64_t launches = 0;        // kernel launches issued directly (not replays)
    uint64_t graph_launches = 0;  // cudaGraphLaunch calls
    uint64_t captures = 0;        // graphs captured
    uint64_t h2d = 0, d2h = 0, d2d = 0;
    uint64_t h2d_bytes = 0, d2h_bytes = 0;
    uint64_t syncs = 0;           // host waits on the stream or an event
    uint64_t allocs = 0;          // cudaMalloc / cudaMallocHost calls
    uint64_t staged = 0;          // launches of the staged matvec (k_matvec_bulk), direct or captured
    uint64_t x4 = 0;              // launches of the four-rows-a-block matvec (k_matvec_x4)
    uint64_t pair = 0;            // launches of a two-type matvec instantiation (mv_pair)
    uint64_t mmq = 0;             // batched matmuls on the int8 tensor cores (k_mmq), direct or captured
};

struct Context {
    int device = 0;
    int n_sm = 0;
    int smem_per_sm = 0;  // shared memory per SM, and the most one block may opt in to (bytes)
    int smem_optin = 0;
    cudaStream_t stream = nullptr;
    cudaStream_t side = nullptr;  // the prefill GEMMs' weight dequantization (executor.cpp)
    cublasHandle_t blas = nullptr;
    void* blas_ws = nullptr;
    size_t blas_ws_bytes = 0;
    bool capturing = false;
    Counters c;
    // Device-side guard: kernels that find an index out of range (token id, KV cell,
    // position) store a nonzero code here (mapped pinned memory, so the host reads it
    // after its next wait without a copy). Never a silent clamp.
    int* err_host = nullptr;
    int* err_dev = nullptr;
};

// Number of visible devices; on failure 0 and *why says what is missing.
int device_count(std::string* why);
std::string device_name();
// The context, created on first use; throws if no device can be used.
Context& ctx();
// Held by every entry from Python that uses the stream (bindings_cuda.cpp): threads take
// the one stream in turn.
std::recursive_mutex& stream_mutex();
// After a host wait: raise if a kernel flagged bad index data since the last check.
void raise_device_error();
void sync_stream();
// Counts one kernel launch (a direct one; launches recorded into a capture are not).
inline void note_launch() {
    Context& c = ctx();
    if (!c.capturing) ++c.c.launches;
}

// Allocation helpers that count.
void* dev_alloc(size_t nbytes);
void* host_alloc_pinned(size_t nbytes);

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
PickSlot& pick_slot();  // dev/host allocated on first use (never inside a capture)
void forget_pick();

}  // namespace minfer::cuda
