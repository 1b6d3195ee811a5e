// K-quant prefill on the AMX tiles (Q4_K, Q5_K, Q6_K; 16 tokens and more).
//
// A tile product sums 64 products of a K step, but the K-quants scale every 32 (Q4_K,
// Q5_K) or 16 (Q6_K) of them by a per-row integer: scaling each sub-block's product
// afterwards, in vector registers, cost more than the products. Here the scale goes
// into the weights instead: w = code * scale (Q6_K: (code - 32) * scale, its offset
// folded in as well) is exact in int16 (|w| <= 63 * 31 and 32 * 128), and a TDPBxUD of
// its low bytes plus 256 times one of its high bytes is the exact integer
//   S = sum over sub-blocks of scale * (sub-block dot)
// that the vector kernel (repack_k.cpp) forms step by step (below 2^31: 256 products of
// at most 127 * 4096). The float epilogue per super-block is the vector kernel's, in
// the same operations, so every output is bitwise its result.
//
// Each group is widened once per call (8 KB a super-block: 4 K steps x the low and high
// byte planes, each one B tile) and used by every token, in blocks of about
// kAmxActBytes of activations, which stay in L2 while the groups pass. A call is one
// thread's piece of the work split, an eighth of a prefill's tokens: slabs of a whole
// block, widening each group fewer times, won at 4 threads and lost at 8 and 16 (the
// experiment log).
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/repack_k.h"
#include "cpu/repack_k_layout.h"

#if defined(RP_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define RP_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#endif

namespace minfer::cpu::repack::k {

#if defined(RP_AMX)
namespace {

constexpr int kTok = 16;  // tokens of one A tile
// A block of activations: 1 MiB beat 512 KiB by 3% on one Sapphire Rapids thread.
constexpr size_t kAmxActBytes = 1 << 20;
constexpr size_t kKStep = 2048;  // one K step of a widened super-block: low plane, then high

struct TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tmm0..3: the products of token tile u, plane p in tmm(2u + p); tmm4 / tmm5: token
// tiles 0 / 1 (16 tokens x 64 activations); tmm6 / tmm7: the low / high byte plane of
// the widened weights (16 K quads x 16 rows x 4 bytes). All 16 rows of 64 bytes.
void config() {
    TileConfig c;
    for (int i = 0; i < 8; ++i) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

// Super-block R of a group into bt: K step s (elements 64s..64s+63) at bt + s * kKStep,
// B row q of it = 32-element chunk 2s + q / 8, step q % 8 (chunk_codes' order); low
// plane, then the high one at + 1024.
template <int32_t T>
void widen(const uint8_t* R, uint8_t* bt) {
    using V = V16;
    const __m512i lo8 = _mm512_set1_epi16(0x00FF), hi8 = _mm512_set1_epi16((short)0xFF00);
    for (int j = 0; j < 8; ++j) {
        __m512i w[8];
        chunk_codes<V, T>(R, j, 0, w);
        __m512i s[2];  // each row's scale as an int16 pair: steps 0-3, 4-7
        if constexpr (T == T_Q6_K) {
            s[0] = V::dup16(V::s8_32(R + q6_sc(j)));
            s[1] = V::dup16(V::s8_32(R + q6_sc(j) + 16));
        } else {
            s[0] = s[1] = V::dup16(V::u8_32(R + k4_tail<T>(kQ4Sc) + 16 * j));
        }
        uint8_t* o = bt + (j / 2) * kKStep + (j & 1) * 512;
        for (int k = 0; k < 8; ++k) {
            // Even and odd code bytes as int16, times the scale; then the products' low
            // and high bytes back in byte order.
            __m512i e = _mm512_and_si512(w[k], lo8), d = _mm512_srli_epi16(w[k], 8);
            if constexpr (T == T_Q6_K) {
                e = _mm512_sub_epi16(e, _mm512_set1_epi16(32));
                d = _mm512_sub_epi16(d, _mm512_set1_epi16(32));
            }
            const __m512i pe = _mm512_mullo_epi16(e, s[k / 4]), pd = _mm512_mullo_epi16(d, s[k / 4]);
            _mm512_store_si512((void*)(o + 64 * k), V::or_and(_mm512_slli_epi16(pd, 8), pe, lo8));
            _mm512_store_si512((void*)(o + 1024 + 64 * k), V::or_and(_mm512_srli_epi16(pe, 8), pd, hi8));
        }
    }
}

// The rows' per-super-block constants of record R.
struct Tail {
    V16::F dw, dm;
    V16::I mn[4];
};

template <int32_t T>
Tail tail_of(const uint8_t* R) {
    Tail t;
    if constexpr (T == T_Q6_K) {
        t.dw = V16::loadh((const half*)(R + kQ6D));
    } else {
        t.dw = V16::loadh((const half*)(R + k4_tail<T>(kQ4D)));
        t.dm = V16::loadh((const half*)(R + k4_tail<T>(kQ4Dmin)));
        for (int k = 0; k < 4; ++k) t.mn[k] = V16::u8_16(R + k4_tail<T>(kQ4Mn) + 32 * k);
    }
    return t;
}

// U token tiles (16 U tokens from the one whose super-block ib's codes are at a) times
// the widened super-block bt, into their rows of acc (16 floats a token).
template <int32_t T, int U>
void tiles(const uint8_t* bt, const uint8_t* a, size_t arb, const KMeta* meta, int64_t nb, const Tail& tl,
           float* acc) {
    // (Spelled out: GCC's tile intrinsics paste their register numbers into the
    // instruction text, so they take literals, not a loop's or template's value.)
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (U == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int s = 0; s < 4; ++s) {
        _tile_loadd(6, bt + s * kKStep, 64);
        _tile_loadd(7, bt + s * kKStep + 1024, 64);
        _tile_loadd(4, a + 64 * s, (long)arb);
        _tile_dpbsud(0, 4, 6);
        if constexpr (T == T_Q6_K) _tile_dpbssd(1, 4, 7);  // Q6_K's high bytes are signed
        else _tile_dpbsud(1, 4, 7);
        if constexpr (U == 2) {
            _tile_loadd(5, a + kTok * arb + 64 * s, (long)arb);
            _tile_dpbsud(2, 5, 6);
            if constexpr (T == T_Q6_K) _tile_dpbssd(3, 5, 7);
            else _tile_dpbsud(3, 5, 7);
        }
    }
    alignas(64) int32_t c[U][2][kTok][16];
    _tile_stored(0, c[0][0], 64);
    _tile_stored(1, c[0][1], 64);
    if constexpr (U == 2) {
        _tile_stored(2, c[1][0], 64);
        _tile_stored(3, c[1][1], 64);
    }
    using V = V16;
    for (int u = 0; u < U; ++u)
        for (int i = 0; i < kTok; ++i) {
            const KMeta& m = meta[(u * kTok + i) * nb];
            const V::I S = V::add(_mm512_slli_epi32(_mm512_load_si512((const void*)c[u][1][i]), 8),
                                  _mm512_load_si512((const void*)c[u][0][i]));
            float* o = acc + 16 * (u * kTok + i);
            V::F f = _mm512_load_ps(o);
            f = V::fma(V::scale(tl.dw, m.d), S, f);
            if constexpr (T != T_Q6_K) {
                V::I sm = V::zero_i();
                for (int k = 0; k < 4; ++k) sm = V::dotw(sm, tl.mn[k], (uint32_t)m.pair[k]);
                f = V::fnma(V::scale(tl.dm, m.d), sm, f);
            }
            _mm512_store_ps(o, f);
        }
}

template <int32_t T>
void run(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, const KMeta* meta, float* y, int64_t ldy,
         int64_t r0, int64_t r1) {
    const int64_t nb = p.nb;
    constexpr size_t rec = rec_bytes(T);
    constexpr size_t kWide = 4 * kKStep;  // one widened super-block
    struct alignas(64) Line {
        uint8_t b[64];
    };
    static thread_local std::vector<Line> btv, accv;
    const int64_t tb = std::max<int64_t>(kTok, (int64_t)(kAmxActBytes / arb) / kTok * kTok);
    if (btv.size() < (size_t)nb * kWide / 64) btv.resize((size_t)nb * kWide / 64);
    if (accv.size() < (size_t)std::min(tb, nt)) accv.resize((size_t)std::min(tb, nt));
    uint8_t* bt = reinterpret_cast<uint8_t*>(btv.data());
    float* acc = reinterpret_cast<float*>(accv.data());
    const size_t qs = offsetof(block_q8_K, qs);
    const int64_t g0 = r0 / G, g1 = (r1 + G - 1) / G;
    config();
    for (int64_t gi = g0; gi < g1; ++gi) {
        // The group widened once (nb * 8 KB, in L2 beside a block of activations) for
        // all the call's tokens, not once per token block: a super-block's widening took
        // 95-133 ns on a Zen 4, its 16 tokens' tile products about 55 on a Sapphire Rapids.
        const uint8_t* g = p.data.get() + gi * p.group_bytes;
        for (int64_t ib = 0; ib < nb; ++ib) widen<T>(g + ib * rec, bt + ib * kWide);
        const int lo = (int)std::max<int64_t>(r0 - gi * G, 0), hi = (int)std::min<int64_t>(r1 - gi * G, G);
        for (int64_t b0 = 0; b0 < nt; b0 += tb) {
            const int64_t b1 = std::min(nt, b0 + tb);
            std::memset(acc, 0, (size_t)(b1 - b0) * 64);
            for (int64_t ib = 0; ib < nb; ++ib) {
                const Tail tl = tail_of<T>(g + ib * rec);
                const uint8_t* b = bt + ib * kWide;
                const uint8_t* a = act + ib * sizeof(block_q8_K) + qs;
                int64_t t = b0;
                for (; t + 2 * kTok <= b1; t += 2 * kTok)
                    tiles<T, 2>(b, a + t * arb, arb, meta + t * nb + ib, nb, tl, acc + 16 * (t - b0));
                if (t < b1) tiles<T, 1>(b, a + t * arb, arb, meta + t * nb + ib, nb, tl, acc + 16 * (t - b0));
            }
            for (int64_t t = b0; t < b1; ++t) V16::store(y + t * ldy + gi * G, _mm512_load_ps(acc + 16 * (t - b0)), lo, hi);
        }
    }
    _tile_release();
}

std::atomic<int> g_amx_on{-1};  // -1: not asked yet; 0 / 1 (the OS granted the tile state)
std::atomic<bool> g_amx_use{true};  // tests compare the tiles with the vector kernel (set_amx)
std::atomic<uint64_t> g_amx_calls{0};  // matmul calls that ran tiles (tests see them run)

bool amx_on() {
    int v = g_amx_on.load(std::memory_order_relaxed);
    if (v < 0) {
        // The tile data state is off until the process asks for it (Linux 5.16+).
        constexpr long kReqPerm = 0x1023, kXtileData = 18;
        v = syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0 ? 1 : 0;
        g_amx_on.store(v, std::memory_order_relaxed);
    }
    return v == 1;
}

}  // namespace

int64_t amx_matmul(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, const KMeta* meta, float* y,
                   int64_t ldy, int64_t r0, int64_t r1) {
    if (nt < kTok || !g_amx_use.load(std::memory_order_relaxed) || !amx_on()) return 0;
    const int64_t n = nt / kTok * kTok;
    g_amx_calls.fetch_add(1, std::memory_order_relaxed);
    switch (p.type) {
        case T_Q4_K: run<T_Q4_K>(p, act, arb, n, meta, y, ldy, r0, r1); return n;
        case T_Q5_K: run<T_Q5_K>(p, act, arb, n, meta, y, ldy, r0, r1); return n;
        case T_Q6_K: run<T_Q6_K>(p, act, arb, n, meta, y, ldy, r0, r1); return n;
        default: return 0;
    }
}

bool amx_available() { return amx_on(); }
uint64_t amx_calls() { return g_amx_calls.load(std::memory_order_relaxed); }
void set_amx(bool on) { g_amx_use.store(on, std::memory_order_relaxed); }

#else

int64_t amx_matmul(const Packed&, const uint8_t*, size_t, int64_t, const KMeta*, float*, int64_t, int64_t,
                   int64_t) {
    return 0;
}

bool amx_available() { return false; }
uint64_t amx_calls() { return 0; }
void set_amx(bool) {}

#endif

}  // namespace minfer::cpu::repack::k
