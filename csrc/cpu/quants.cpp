// The quants.h dispatcher: picks the kernel family by weight type (32-element family
// and float weights here and in quants_legacy.cpp, K-quants in quants_k.cpp) and the
// path (scalar or the widest SIMD compiled in) by the process-wide kernel path.
#include "cpu/quants.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/quants_k.h"
#include "cpu/quants_legacy.h"

namespace minfer::cpu {

namespace {

std::atomic<int> g_path{(int)KernelPath::Simd};

inline bool use_simd() { return g_path.load(std::memory_order_relaxed) == (int)KernelPath::Simd; }

inline bool is_k(int32_t t) { return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }

[[noreturn]] void unsupported(const char* fn, int32_t t) {
    throw std::invalid_argument(std::string(fn) + ": unsupported tensor type " + std::to_string(t));
}

}  // namespace

void set_kernel_path(KernelPath p) {
    if (p != KernelPath::Scalar && p != KernelPath::Simd) throw std::invalid_argument("unknown kernel path");
    g_path.store((int)p, std::memory_order_relaxed);
}

KernelPath kernel_path() { return (KernelPath)g_path.load(std::memory_order_relaxed); }

const char* simd_path_name() { return legacy::simd_name(); }

bool weight_type_supported(int32_t wtype) { return legacy::handles(wtype) || is_k(wtype); }

int32_t act_type_for(int32_t wtype) {
    switch (wtype) {
        case T_F32: case T_F16: return T_F32;
        case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return T_Q8_0;
        case T_Q4_K: case T_Q5_K: case T_Q6_K: return T_Q8_K;
        default: unsupported("act_type_for", wtype);
    }
}

size_t act_row_bytes(int32_t wtype, int64_t n) {
    size_t rb = type_row_bytes(act_type_for(wtype), n);
    if (rb == 0)
        throw std::invalid_argument("act_row_bytes: row length " + std::to_string(n) +
                                    " is not a whole number of blocks of type " + std::to_string(wtype));
    return rb;
}

void quantize_act_row(int32_t wtype, const float* x, void* dst, int64_t n) {
    switch (act_type_for(wtype)) {
        case T_F32: std::memcpy(dst, x, (size_t)n * sizeof(float)); break;
        case T_Q8_0: legacy::quantize_row_q8_0(x, (block_q8_0*)dst, n, use_simd()); break;
        default: kq::quantize_row_q8_K(x, (block_q8_K*)dst, n, use_simd()); break;
    }
}

float vec_dot(int32_t wtype, int64_t n, const void* wrow, const void* arow) {
    if (is_k(wtype)) return kq::vec_dot(wtype, n, wrow, (const block_q8_K*)arow, use_simd());
    float out = 0.0f;
    legacy::vec_dot_tile(wtype, n, wrow, 0, 1, arow, 0, 1, &out, 0, use_simd());
    return out;
}

void vec_dot_tile(int32_t wtype, int64_t n, const void* w, size_t w_stride, int nw,
                  const void* a, size_t a_stride, int na, float* out, size_t out_stride) {
    if (is_k(wtype))
        kq::vec_dot_tile(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride, use_simd());
    else
        legacy::vec_dot_tile(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride, use_simd());
}

void dequantize_row(int32_t type, const void* src, float* dst, int64_t n) {
    if (type_row_bytes(type, n) == 0)
        throw std::invalid_argument("dequantize_row: type " + std::to_string(type) + " with " + std::to_string(n) +
                                    " elements is not a whole number of supported blocks");
    if (legacy::handles(type)) legacy::dequantize_row(type, src, dst, n);
    else if (is_k(type) || type == T_Q8_K) kq::dequantize_row(type, src, dst, n);
    else unsupported("dequantize_row", type);
}

void quantize_row_q8_0_ref(const float* x, block_q8_0* y, int64_t n) {
    if (n % QK8_0) throw std::invalid_argument("quantize_row_q8_0_ref: n must be a multiple of 32");
    legacy::quantize_row_q8_0(x, y, n, false);
}

void quantize_row_q8_K_ref(const float* x, block_q8_K* y, int64_t n) {
    if (n % QK_K) throw std::invalid_argument("quantize_row_q8_K_ref: n must be a multiple of 256");
    kq::quantize_row_q8_K(x, y, n, false);
}

}  // namespace minfer::cpu
