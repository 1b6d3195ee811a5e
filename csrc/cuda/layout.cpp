#include "cuda/layout.h"

#include <cstring>
#include <stdexcept>

namespace minfer::cuda {

namespace {

// GGUF block: where its scale(s), high bits and quants sit, and how big the scale is.
struct Native {
    int block, sc, sc_bytes, qh, qs;
};
Native native_of(int32_t t) {
    switch (t) {
        case T_Q4_0: return {18, 0, 2, -1, 2};
        case T_Q4_1: return {20, 0, 4, -1, 4};
        case T_Q5_0: return {22, 0, 2, 2, 6};
        case T_Q5_1: return {24, 0, 4, 4, 8};
        case T_Q8_0: return {34, 0, 2, -1, 2};
        default: throw std::invalid_argument("pack_rows: not a packed type");
    }
}

}  // namespace

void pack_rows(int32_t t, const uint8_t* src, size_t row_bytes, int64_t rows, int64_t in_dim, uint8_t* dst) {
    const size_t stride = device_row_bytes(t, row_bytes);
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* s = src + (size_t)r * row_bytes;
        uint8_t* d = dst + (size_t)r * stride;
        // Padding is zero. The packed fields fill the first row_bytes densely, but for an
        // odd superblock count the K-quants' last 8-unit groups are half padding.
        const bool gaps = (t == T_Q4_K || t == T_Q6_K) && (in_dim / 256) % 2;
        if (gaps) std::memset(d, 0, stride);
        else std::memset(d + row_bytes, 0, stride - row_bytes);
        if (t == T_Q4_K) {
            const int ns = (int)(in_dim / 256);
            for (int b = 0; b < ns; ++b) {
                const uint8_t* blk = s + (size_t)144 * b;
                std::memcpy(d + q4k_hdr(b), blk, 16);
                for (int p = 0; p < 4; ++p)
                    for (int i = 0; i < 2; ++i) std::memcpy(d + q4k_qs(ns, 4 * b + p, i), blk + 16 + 32 * p + 16 * i, 16);
            }
            continue;
        }
        if (t == T_Q6_K) {
            const int ns = (int)(in_dim / 256);
            for (int b = 0; b < ns; ++b) {
                const uint8_t* blk = s + (size_t)210 * b;
                for (int i = 0; i < 2; ++i) {
                    for (int p = 0; p < 4; ++p) std::memcpy(d + q6k_ql(4 * b + p, i), blk + 32 * p + 16 * i, 16);
                    for (int n = 0; n < 2; ++n) std::memcpy(d + q6k_qh(ns, 4 * b + 2 * n, i), blk + 128 + 32 * n + 16 * i, 16);
                }
                std::memcpy(d + q6k_sc(ns, b), blk + 192, 16);
                std::memcpy(d + q6k_d(ns, b), blk + 208, 2);
            }
            continue;
        }
        const Native nv = native_of(t);
        const Packed pk = packed_fields(t);
        const int nb = (int)(in_dim / 32);
        for (int c = 0; c < nb; ++c) {
            const uint8_t* blk = s + (size_t)nv.block * c;
            std::memcpy(d + (size_t)pk.qs_bytes * c, blk + nv.qs, pk.qs_bytes);
            if (nv.qh >= 0) std::memcpy(d + (size_t)pk.qh_at * nb + 4 * c, blk + nv.qh, 4);
            std::memcpy(d + (size_t)pk.sc_at * nb + (size_t)nv.sc_bytes * c, blk + nv.sc, nv.sc_bytes);
        }
    }
}

}  // namespace minfer::cuda
