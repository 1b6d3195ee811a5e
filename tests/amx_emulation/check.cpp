// Packs random and extreme Q4_K / Q5_K / Q6_K rows, runs repack::matmul over Q8_K
// activations with the (emulated) tiles and with the vector kernel, and prints one line
// per case: "type in out nt tile_calls differing_outputs".
#include <cstdio>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "common/ggml_types.h"
#include "cpu/repack.h"
#include "cpu/repack_k.h"

using namespace minfer;
using namespace minfer::cpu;

int main() {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> scale(0.001f, 0.1f);
    // 8192 x 130: token blocks of 112 (kAmxActBytes over rows of 9,344 bytes), then 16 + a tail of 2.
    const std::tuple<int, int, int> shapes[] = {{512, 40, 70}, {2048, 35, 48}, {256, 16, 16}, {1024, 50, 37}, {8192, 20, 130}};
    for (int32_t type : {T_Q4_K, T_Q5_K, T_Q6_K})
        for (auto [in, out, nt] : shapes) {
            const int nb = in / 256;
            const size_t bb = type_block_bytes(type);
            std::vector<uint8_t> w((size_t)out * nb * bb);
            for (auto& x : w) x = (uint8_t)rng();
            for (int r = 0; r < out; ++r)
                for (int ib = 0; ib < nb; ++ib) {
                    uint8_t* blk = w.data() + ((size_t)r * nb + ib) * bb;
                    const uint16_t d = _cvtss_sh(scale(rng), 0), m = _cvtss_sh(scale(rng), 0);
                    if (type == T_Q6_K) {
                        std::memcpy(blk + bb - 2, &d, 2);
                        if (r == 3) std::memset(blk, 0xFF, 192);  // codes 63
                        if (r == 4) std::memset(blk, 0, 192);  // codes 0
                        if (r == 3 || r == 4) std::memset(blk + 192, r == 3 ? 0x7F : 0x80, 16);  // scales 127, -128
                    } else {
                        std::memcpy(blk, &d, 2);
                        std::memcpy(blk + 2, &m, 2);
                        if (r == 3) std::memset(blk + 4, 0xFF, bb - 4);  // scales and mins 63, top codes
                    }
                }
            const auto P = repack::pack(type, w.data(), in, out, 1);
            const size_t arb = (size_t)nb * sizeof(block_q8_K);
            std::vector<uint8_t> act((size_t)nt * arb);
            for (int t = 0; t < nt; ++t)
                for (int ib = 0; ib < nb; ++ib) {
                    block_q8_K& b = *(block_q8_K*)(act.data() + t * arb + ib * sizeof(block_q8_K));
                    b.d = scale(rng);
                    for (int k = 0; k < 256; ++k) b.qs[k] = t == 5 ? (k & 1 ? -127 : 127) : (int8_t)((int)(rng() % 255) - 127);
                    for (int j = 0; j < 16; ++j) {
                        int s = 0;
                        for (int k = 0; k < 16; ++k) s += b.qs[16 * j + k];
                        b.bsums[j] = (int16_t)s;
                    }
                }
            std::vector<float> y[2] = {std::vector<float>((size_t)nt * out), std::vector<float>((size_t)nt * out)};
            uint64_t calls = 0;
            for (int on = 0; on < 2; ++on) {
                repack::k::set_amx(on);
                const uint64_t c0 = repack::k::amx_calls();
                // two row ranges, as two threads take them
                repack::matmul(*P, act.data(), arb, nt, y[on].data(), out, 0, out / 2);
                repack::matmul(*P, act.data(), arb, nt, y[on].data(), out, out / 2, out);
                if (on) calls = repack::k::amx_calls() - c0;
            }
            int diff = 0;
            for (size_t i = 0; i < y[0].size(); ++i) diff += std::memcmp(&y[0][i], &y[1][i], 4) != 0;
            std::printf("%d %d %d %d %llu %d\n", type, in, out, nt, (unsigned long long)calls, diff);
        }
    return 0;
}
