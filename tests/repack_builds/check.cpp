// The repacked matmul (csrc/cpu/repack*.cpp) built for one x86 target, on cases from a
// file: tests/test_repack_builds.py builds it for the targets a native build of this
// machine never compiles (AVX2 alone, AVX-512 without VNNI, AVX-VNNI) and compares what
// it computes with the float64 references and, bitwise, with the native build.
//
// Usage: check IN OUT. IN (little-endian): "MRPVEC1\0", u32 ncases, then per case
//   i32 wtype, i32 out, i32 nt, i32 pad, i64 in, u64 wbytes, u8 w[wbytes], f32 x[nt][in].
// OUT, per case: u8 packed (the build packs this type), then when packed
//   f32 prefill[nt][out] (one call per row range [0, 16) and [16, out), all tokens),
//   f32 decode[nt][out] (one call per token, all rows).
// Prints the build's SIMD path.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/quants.h"
#include "cpu/repack.h"

using namespace minfer;
using namespace minfer::cpu;

namespace {

template <class T>
T get(FILE* f) {
    T v;
    if (std::fread(&v, sizeof v, 1, f) != 1) throw std::runtime_error("truncated input");
    return v;
}

template <class T>
std::vector<T> vec(FILE* f, size_t n) {
    std::vector<T> v(n);
    if (n && std::fread(v.data(), sizeof(T), n, f) != n) throw std::runtime_error("truncated input");
    return v;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 2;
    }
    std::printf("simd path: %s\n", simd_path_name());
    try {
        FILE* in = std::fopen(argv[1], "rb");
        FILE* out = std::fopen(argv[2], "wb");
        if (!in || !out) throw std::runtime_error("cannot open the files");
        char magic[8];
        if (std::fread(magic, 1, 8, in) != 8 || std::memcmp(magic, "MRPVEC1", 8) != 0)
            throw std::runtime_error("bad magic");
        const uint32_t ncases = get<uint32_t>(in);
        for (uint32_t i = 0; i < ncases; ++i) {
            const int32_t wtype = get<int32_t>(in), rows = get<int32_t>(in), nt = get<int32_t>(in);
            get<int32_t>(in);
            const int64_t k = get<int64_t>(in);
            const std::vector<uint8_t> w = vec<uint8_t>(in, get<uint64_t>(in));
            const std::vector<float> x = vec<float>(in, (size_t)nt * k);
            const uint8_t packed = repack::packable(wtype) ? 1 : 0;
            std::fwrite(&packed, 1, 1, out);
            if (!packed) continue;
            const auto P = repack::pack(wtype, w.data(), k, rows, 1);
            const size_t arb = act_row_bytes(wtype, k);
            std::vector<uint8_t> act((size_t)nt * arb);
            for (int t = 0; t < nt; ++t) quantize_act_row(wtype, x.data() + (size_t)t * k, act.data() + t * arb, k);
            std::vector<float> pre((size_t)nt * rows), dec((size_t)nt * rows);
            const int64_t cut = rows > 16 ? 16 : rows;
            repack::matmul(*P, act.data(), arb, nt, pre.data(), rows, 0, cut);
            if (cut < rows) repack::matmul(*P, act.data(), arb, nt, pre.data(), rows, cut, rows);
            for (int t = 0; t < nt; ++t)
                repack::matmul(*P, act.data() + t * arb, arb, 1, dec.data() + (size_t)t * rows, rows, 0, rows);
            std::fwrite(pre.data(), 4, pre.size(), out);
            std::fwrite(dec.data(), 4, dec.size(), out);
        }
        std::fclose(in);
        std::fclose(out);
    } catch (const std::exception& e) {
        std::printf("ERROR: %s\n", e.what());
        return 2;
    }
    return 0;
}
