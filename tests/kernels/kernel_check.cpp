// Standalone kernel check: links only csrc/cpu/quants*.cpp, so it can be cross-compiled
// (aarch64, run under qemu) to exercise SIMD paths this machine cannot run natively.
//
// Usage: kernel_check VECTORS_FILE
// The file is written by tests/test_kernels_qemu.py (all little-endian):
//   "MQKVEC1\0", u32 ncases, then per case:
//   i32 wtype, i32 nw, i32 na, i32 pad, i64 n, u64 wbytes, u8 w[wbytes],
//   f32 x[na][n], f32 deq[nw][n]   (gguf's dequantization: must match bitwise),
//   f64 ref[na][nw], f64 tol[na][nw]   (NumPy float64 reference and its bound),
//   u64 nact, u8 act[nact]   (gguf's Q8_0 bytes of x, or nact = 0 for no reference).
// For both kernel paths it checks dequantize_row, quantize_act_row (same bytes on both
// paths), vec_dot against ref, and vec_dot_tile (bitwise equal to vec_dot per pair).
// Prints the SIMD path name and a summary; exits non-zero on any mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/quants.h"

using namespace minfer;
using namespace minfer::cpu;

namespace {

struct Reader {
    FILE* f;
    template <class T> T get() {
        T v;
        read(&v, sizeof v);
        return v;
    }
    void read(void* p, size_t n) {
        if (n && std::fread(p, 1, n, f) != n) throw std::runtime_error("truncated vectors file");
    }
    template <class T> std::vector<T> vec(size_t n) {
        std::vector<T> v(n);
        read(v.data(), n * sizeof(T));
        return v;
    }
};

struct Case {
    int32_t wtype, nw, na;
    int64_t n;
    std::vector<uint8_t> w;
    std::vector<float> x, deq;
    std::vector<double> ref, tol;
    std::vector<uint8_t> act;
};

int g_fail = 0, g_checks = 0;

void failf(const Case& c, const char* path, const std::string& what) {
    if (++g_fail <= 20) std::printf("FAIL type=%d nw=%d na=%d n=%lld path=%s: %s\n", c.wtype, c.nw, c.na, (long long)c.n,
                                    path, what.c_str());
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// Returns the quantized activations (to compare across paths).
std::vector<uint8_t> check_case(const Case& c, KernelPath p) {
    const char* pname = p == KernelPath::Scalar ? "scalar" : simd_path_name();
    set_kernel_path(p);
    const size_t rb = type_row_bytes(c.wtype, c.n);

    std::vector<float> deq((size_t)c.nw * c.n);
    dequantize_row(c.wtype, c.w.data(), deq.data(), (int64_t)c.nw * c.n);
    ++g_checks;
    for (size_t i = 0; i < deq.size(); ++i)
        if (!same_bits(deq[i], c.deq[i])) {
            failf(c, pname, "dequantize_row element " + std::to_string(i) + ": " + std::to_string(deq[i]) +
                                " != " + std::to_string(c.deq[i]));
            break;
        }

    const size_t arb = act_row_bytes(c.wtype, c.n);
    std::vector<uint8_t> act(arb * c.na);
    for (int j = 0; j < c.na; ++j) quantize_act_row(c.wtype, c.x.data() + (size_t)j * c.n, act.data() + j * arb, c.n);

    std::vector<float> single((size_t)c.na * c.nw);
    for (int j = 0; j < c.na; ++j)
        for (int r = 0; r < c.nw; ++r) {
            const float v = vec_dot(c.wtype, c.n, c.w.data() + r * rb, act.data() + j * arb);
            single[(size_t)j * c.nw + r] = v;
            const size_t k = (size_t)j * c.nw + r;
            ++g_checks;
            if (!(std::fabs((double)v - c.ref[k]) <= c.tol[k]))
                failf(c, pname, "vec_dot row " + std::to_string(r) + " act " + std::to_string(j) + ": got " +
                                    std::to_string(v) + ", want " + std::to_string(c.ref[k]) + " +- " +
                                    std::to_string(c.tol[k]));
        }

    // Whole tile, then a ragged split (odd widths, an activation group of one).
    std::vector<float> tile((size_t)c.na * c.nw, NAN);
    vec_dot_tile(c.wtype, c.n, c.w.data(), rb, c.nw, act.data(), arb, c.na, tile.data(), c.nw);
    std::vector<float> ragged((size_t)c.na * c.nw, NAN);
    for (int r = 0; r < c.nw; r += 5)
        for (int j = 0; j < c.na; j += 3) {
            const int nw = std::min(5, c.nw - r), na = std::min(3, c.na - j);
            vec_dot_tile(c.wtype, c.n, c.w.data() + r * rb, rb, nw, act.data() + j * arb, arb, na,
                         ragged.data() + (size_t)j * c.nw + r, c.nw);
        }
    ++g_checks;
    for (size_t k = 0; k < tile.size(); ++k)
        if (!same_bits(tile[k], single[k]) || !same_bits(ragged[k], single[k])) {
            failf(c, pname, "vec_dot_tile differs from vec_dot at " + std::to_string(k) + ": " +
                                std::to_string(tile[k]) + " / " + std::to_string(ragged[k]) + " vs " +
                                std::to_string(single[k]));
            break;
        }
    return act;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s VECTORS_FILE\n", argv[0]);
        return 2;
    }
    std::printf("simd path: %s\n", simd_path_name());
    try {
        FILE* f = std::fopen(argv[1], "rb");
        if (!f) throw std::runtime_error(std::string("cannot open ") + argv[1]);
        Reader rd{f};
        char magic[8];
        rd.read(magic, 8);
        if (std::memcmp(magic, "MQKVEC1", 8) != 0) throw std::runtime_error("bad magic");
        const uint32_t ncases = rd.get<uint32_t>();
        for (uint32_t i = 0; i < ncases; ++i) {
            Case c;
            c.wtype = rd.get<int32_t>();
            c.nw = rd.get<int32_t>();
            c.na = rd.get<int32_t>();
            rd.get<int32_t>();
            c.n = rd.get<int64_t>();
            c.w = rd.vec<uint8_t>(rd.get<uint64_t>());
            if (c.w.size() != type_row_bytes(c.wtype, c.n) * c.nw) throw std::runtime_error("weight size mismatch");
            c.x = rd.vec<float>((size_t)c.na * c.n);
            c.deq = rd.vec<float>((size_t)c.nw * c.n);
            c.ref = rd.vec<double>((size_t)c.na * c.nw);
            c.tol = rd.vec<double>((size_t)c.na * c.nw);
            c.act = rd.vec<uint8_t>(rd.get<uint64_t>());
            const std::vector<uint8_t> a_scalar = check_case(c, KernelPath::Scalar);
            const std::vector<uint8_t> a_simd = check_case(c, KernelPath::Simd);
            ++g_checks;
            if (a_scalar != a_simd) failf(c, "both", "quantize_act_row bytes differ between scalar and SIMD");
            if (!c.act.empty()) {
                ++g_checks;
                if (c.act != a_scalar) failf(c, "scalar", "quantize_act_row bytes differ from gguf's Q8_0");
            }
        }
        std::fclose(f);
        std::printf("cases: %u  checks: %d  failures: %d\n", ncases, g_checks, g_fail);
    } catch (const std::exception& e) {
        std::printf("ERROR: %s\n", e.what());
        return 2;
    }
    return g_fail ? 1 : 0;
}
