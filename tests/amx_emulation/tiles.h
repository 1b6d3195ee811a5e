// The AMX tile instructions the K-quant prefill uses, in plain C++ (their semantics as
// the Intel SDM gives them), force-included ahead of csrc/cpu/repack_k_amx.cpp by
// tests/test_amx_emulated.py so that its tile code runs, and is checked, on machines
// without AMX. The real intrinsics' header comes first and its names are then taken over.
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

struct EmuTile {
    int rows = 0, colsb = 0;
    uint8_t d[16][64];
};
inline thread_local EmuTile emu_tiles[8];

inline void emu_loadconfig(const void* cfg) {  // palette 1: colsb at byte 16, rows at 48
    const uint8_t* c = (const uint8_t*)cfg;
    for (int i = 0; i < 8; ++i) {
        uint16_t cb;
        std::memcpy(&cb, c + 16 + 2 * i, 2);
        emu_tiles[i].colsb = cb;
        emu_tiles[i].rows = c[48 + i];
    }
}
inline void emu_loadd(int t, const void* base, long stride) {
    for (int r = 0; r < emu_tiles[t].rows; ++r)
        std::memcpy(emu_tiles[t].d[r], (const uint8_t*)base + r * stride, emu_tiles[t].colsb);
}
inline void emu_stored(int t, void* base, long stride) {
    for (int r = 0; r < emu_tiles[t].rows; ++r)
        std::memcpy((uint8_t*)base + r * stride, emu_tiles[t].d[r], emu_tiles[t].colsb);
}
inline void emu_zero(int t) { std::memset(emu_tiles[t].d, 0, sizeof emu_tiles[t].d); }
// TDPBSUD / TDPBSSD: C[m][n] += sum over k of A's signed bytes 4k..4k+3 of row m times
// B's bytes 4n..4n+3 of row k (unsigned / signed).
template <bool SignedB>
inline void emu_dp(int c, int a, int b) {
    EmuTile &C = emu_tiles[c], &A = emu_tiles[a], &B = emu_tiles[b];
    for (int m = 0; m < C.rows; ++m)
        for (int n = 0; n < C.colsb / 4; ++n) {
            int32_t s;
            std::memcpy(&s, C.d[m] + 4 * n, 4);
            for (int k = 0; k < A.colsb / 4; ++k)
                for (int i = 0; i < 4; ++i)
                    s += (int8_t)A.d[m][4 * k + i] * (SignedB ? (int)(int8_t)B.d[k][4 * n + i] : (int)B.d[k][4 * n + i]);
            std::memcpy(C.d[m] + 4 * n, &s, 4);
        }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbsud
#undef _tile_dpbssd
#define _tile_loadd(t, base, stride) emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_stored(t, base, stride)
#define _tile_zero(t) emu_zero(t)
#define _tile_dpbsud(c, a, b) emu_dp<false>(c, a, b)
#define _tile_dpbssd(c, a, b) emu_dp<true>(c, a, b)
#define _tile_loadconfig(cfg) emu_loadconfig(cfg)
#define _tile_release() ((void)0)
#define syscall(...) 0L  // the tile-state request: granted
