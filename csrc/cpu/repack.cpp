// Interleaved 16-row groups for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights and their matmul
// kernel. See repack.h for the layout's purpose and the rounding contract.
//
// Layout of one group (16 rows, nb blocks), in planes so every vector load is aligned
// to its own size within the group:
//   qs plane  nb x 256 bytes (Q4_0/1, Q5_0/1) or nb x 512 (Q8_0), block ib at ib * size.
//             Q4_x/Q5_x: chunk t (64 bytes, t < 4), lane r (bytes 4r..4r+3), byte b:
//             low nibble = low 4 bits of code[8t + b], high nibble = of code[8t + 4 + b].
//             Q8_0: chunk s (s < 8), lane r, byte b = (uint8)(q[4s + b] + 128).
//   qh plane  (Q5_0, Q5_1) nb x 64 bytes: lane r byte b: bit t = bit 4 of code[8t + b],
//             bit 4 + t = bit 4 of code[8t + 4 + b].
//   d plane   nb x 16 f16 (row r's block scale in lane r).
//   m plane   (Q4_1, Q5_1) nb x 16 f16: row r's block min (element = d * code + m).
// So step s (s < 8) of a block pairs codes 4s..4s+3 of every row with activation bytes
// 4s..4s+3, which one broadcast 32-bit load provides.
#include "cpu/repack.h"
#include "cpu/repack_k.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "common/ggml_types.h"
#include "cpu/repack_vec.h"

namespace minfer::cpu::repack {

namespace {

constexpr int G = 16;  // rows per group

struct Layout {
    size_t qs, qh, d, m;  // bytes per block of each plane (0 = absent)
    int off;              // code offset: stored code = signed code + off
};

// Stored code = signed code + offset (unsigned for vpdpbusd). Q4_1 / Q5_1 codes are
// unsigned already: their blocks carry a min instead.
constexpr int code_offset(int32_t type) {
    return type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? 128 : 0;
}
constexpr bool has_min(int32_t type) { return type == T_Q4_1 || type == T_Q5_1; }
constexpr bool has_qh(int32_t type) { return type == T_Q5_0 || type == T_Q5_1; }

Layout layout_of(int32_t type) {
    switch (type) {
        case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1:
            return {256, has_qh(type) ? 64u : 0u, 32, has_min(type) ? 32u : 0u, code_offset(type)};
        case T_Q8_0: return {512, 0, 32, 0, code_offset(T_Q8_0)};
        default: throw std::invalid_argument("repack: unsupported type " + std::to_string(type));
    }
}

// Unsigned codes (signed code + offset), scale and (Q4_1, Q5_1) min of one block of one row.
void codes_of(int32_t type, const uint8_t* blk, uint8_t code[32], half& d, half& m) {
    std::memcpy(&d, blk, 2);
    if (type == T_Q8_0) {
        const int8_t* q = (const int8_t*)(blk + 2);
        for (int i = 0; i < 32; ++i) code[i] = (uint8_t)(q[i] + 128);
        return;
    }
    const size_t head = has_min(type) ? 4 : 2;  // d, then m for the _1 types
    if (has_min(type)) std::memcpy(&m, blk + 2, 2);
    const bool q5 = has_qh(type);
    const uint8_t* qs = blk + head + (q5 ? 4 : 0);
    const uint32_t qh = q5 ? load_u32(blk + head) : 0;
    for (int j = 0; j < 16; ++j) {
        code[j] = (uint8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
        code[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}

void pack_block(int32_t type, const Layout& L, const uint8_t* const rows[G], size_t blk_bytes, int64_t ib,
                int64_t nb, uint8_t* g) {
    uint8_t* qs = g + ib * L.qs;
    uint8_t* qh = L.qh ? g + nb * L.qs + ib * L.qh : nullptr;
    half* dp = (half*)(g + nb * (L.qs + L.qh) + ib * L.d);
    half* mp = L.m ? (half*)(g + nb * (L.qs + L.qh + L.d) + ib * L.m) : nullptr;
    for (int r = 0; r < G; ++r) {
        uint8_t code[32];
        half d = 0, m = 0;
        if (rows[r]) codes_of(type, rows[r] + ib * blk_bytes, code, d, m);
        else std::memset(code, type == T_Q8_0 ? 128 : 0, 32);  // padding rows: zero weights
        dp[r] = rows[r] ? d : (half)0;
        if (mp) mp[r] = rows[r] ? m : (half)0;
        if (type == T_Q8_0) {
            for (int s = 0; s < 8; ++s)
                for (int b = 0; b < 4; ++b) qs[64 * s + 4 * r + b] = code[4 * s + b];
            continue;
        }
        for (int t = 0; t < 4; ++t)
            for (int b = 0; b < 4; ++b) {
                const uint8_t lo = code[8 * t + b], hi = code[8 * t + 4 + b];
                qs[64 * t + 4 * r + b] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
                if (qh) {
                    uint8_t& h = qh[4 * r + b];
                    if (t == 0) h = 0;
                    h |= (uint8_t)(((lo >> 4) & 1) << t);
                    h |= (uint8_t)(((hi >> 4) & 1) << (4 + t));
                }
            }
    }
}

// Per (token, block) of the activations: d_a as f32, and sum(a), whose product with
// -offset is the exact integer correction for the unsigned codes. Independent of the
// weight type, so one table serves every matmul that reads the same activations.
struct Meta {
    float d;
    int32_t sum;
};

#if defined(RP_AVX2)

inline float h2f(half h) { return _cvtsh_ss(h); }

// Sum of 32 signed bytes: sad against zero on the bytes biased to unsigned.
inline int32_t sum32(const int8_t* q) {
    const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)q), _mm256_set1_epi8((char)0x80));
    const __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());
    const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return (int32_t)(_mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1)) - 32 * 128;
}

// The 8 code vectors of block ib for lanes [lane0, lane0 + V::N) of the group.
template <class V, int32_t T>
inline void unpack(const uint8_t* g, int64_t nb, int64_t ib, int lane0, typename V::I w[8]) {
    using I = typename V::I;
    const int bo = lane0 * 4;  // byte offset of the first lane inside a 64-byte chunk
    if constexpr (T == T_Q8_0) {
        const uint8_t* qs = g + ib * 512 + bo;
        RP_UNROLL
        for (int s = 0; s < 8; ++s) w[s] = V::load(qs + 64 * s);
    } else {
        nibbles<V>(g + ib * 256 + bo, w);
        if constexpr (has_qh(T)) {
            const I h = V::load(g + nb * 256 + ib * 64 + bo), m10 = V::set8(0x10);
            // Bit t (low half of chunk t) and bit 4 + t (high half) moved to bit 4.
            w[0] = V::or_and(w[0], V::template sll16<4>(h), m10);
            w[1] = V::or_and(w[1], h, m10);
            w[2] = V::or_and(w[2], V::template sll16<3>(h), m10);
            w[3] = V::or_and(w[3], V::template srl16<1>(h), m10);
            w[4] = V::or_and(w[4], V::template sll16<2>(h), m10);
            w[5] = V::or_and(w[5], V::template srl16<2>(h), m10);
            w[6] = V::or_and(w[6], V::template sll16<1>(h), m10);
            w[7] = V::or_and(w[7], V::template srl16<3>(h), m10);
        }
    }
}

// NA tokens x lanes [lane0, lane0 + H * N) of one group, all blocks. meta is [token][nb].
template <class V, int32_t T, int NA, int H = 1>
void group_kernel(const uint8_t* g, int64_t nb, size_t dplane, int lane0, const uint8_t* act, size_t arb,
                  const Meta* meta, float* y, int64_t ldy, int lo, int hi) {
    using I = typename V::I;
    using F = typename V::F;
    F acc[NA][H];
    RP_UNROLL
    for (int j = 0; j < NA; ++j)
        for (int h = 0; h < H; ++h) acc[j][h] = V::zero();
    const half* dp = (const half*)(g + dplane);
    const half* mp = dp + nb * G;  // the mins (Q4_1, Q5_1) follow the scales
    constexpr size_t QS = T == T_Q8_0 ? 512 : 256;
    // A block's bytes over the group's planes (codes, high bits, scales, mins), and the group's.
    constexpr size_t BB = QS + (has_qh(T) ? 64 : 0) + 32 + (has_min(T) ? 32 : 0);
    const size_t gbytes = ((size_t)nb * BB + 63) / 64 * 64;
    for (int64_t ib = 0; ib < nb; ++ib) {
        // Decode streams the weights from DRAM. A group reads its three planes side by
        // side, short streams (rows of 896: 7, 1.8 and 0.9 KB) that the hardware
        // prefetcher keeps losing; so block ib prefetches the ib-th slice of the next
        // group (groups lie one after another), a group's bytes ahead in the order they
        // will be read. One thread on a Zen 4 VM, bench/quant_dot.py --cold, 1 token:
        // Q5_0 896x4864 11.8 / 10.3 -> 26.0 / 27.7 GB/s, Q8_0 15.6 -> 19.4 / 18.8, the
        // long rows (4864x896) unchanged; the default model's tg128 32.3 / 29.9 / 33.0 ->
        // 48.4 / 47.2 / 48.6 tok/s (1 thread) and 55.5 / 53.8 / 55.8 -> 65.1 / 75.5 / 74.5
        // (2). Before: ~1 KiB ahead within each plane.
        if constexpr (NA == 1) {
            const uint8_t* p = g + gbytes + ib * BB;
            for (size_t o = 0; o < BB; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
        }
        for (int h = 0; h < H; ++h) {
            const int ln = lane0 + h * V::N;
            I w[8];
            unpack<V, T>(g, nb, ib, ln, w);
            const F dw = V::loadh(dp + ib * G + ln);
            [[maybe_unused]] F mw;
            if constexpr (has_min(T)) mw = V::loadh(mp + ib * G + ln);
            RP_UNROLL
            for (int j = 0; j < NA; ++j) {
                const Meta m = meta[j * nb + ib];
                const uint8_t* q = (const uint8_t*)((const block_q8_0*)(act + j * arb))[ib].qs;
                I s = V::bcast(-code_offset(T) * m.sum);
                RP_UNROLL
                for (int k = 0; k < 8; ++k) s = V::dot(s, w[k], load_u32(q + 4 * k));
                acc[j][h] = V::fma(V::scale(dw, m.d), s, acc[j][h]);
                // The min times the activation block: m * d_a * (exact sum of its codes).
                if constexpr (has_min(T)) acc[j][h] = V::fma(V::scale(mw, m.d), V::bcast(m.sum), acc[j][h]);
            }
        }
    }
    RP_UNROLL
    for (int j = 0; j < NA; ++j) store_halves<V, H>(y + j * ldy, acc[j], lo, hi);
}

template <int32_t T>
using KernFn = void (*)(const uint8_t*, int64_t, size_t, int, const uint8_t*, size_t, const Meta*, float*, int64_t,
                        int, int);

template <int32_t T, int... NA>
constexpr std::array<KernFn<T>, sizeof...(NA)> kern_table(std::integer_sequence<int, NA...>) {
    return {group_kernel<VK, T, NA + 1>...};
}

void meta_q8_0(const uint8_t* blocks, int64_t n, Meta* m) {
    const block_q8_0* ab = (const block_q8_0*)blocks;
    for (int64_t ib = 0; ib < n; ++ib) m[ib] = {h2f(ab[ib].d), sum32(ab[ib].qs)};
}

template <int32_t T>
void matmul_t(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, float* y, int64_t ldy, int64_t r0,
              int64_t r1, const uint8_t* shared_meta) {
    static constexpr auto fns = kern_table<T>(std::make_integer_sequence<int, kNA>{});
    const Layout L = layout_of(T);
    const int64_t nb = p.nb;
    const size_t dplane = (size_t)nb * (L.qs + L.qh);
    const Meta* meta = (const Meta*)shared_meta;
    if (!meta) {  // no shared table: this call's tokens, here
        static thread_local std::vector<Meta> own;
        if (own.size() < (size_t)(nt * nb)) own.resize((size_t)(nt * nb));
        for (int64_t t = 0; t < nt; ++t) meta_q8_0(act + t * arb, nb, own.data() + t * nb);
        meta = own.data();
    }
    const bool whole = kDecodeHalves > 1 && nt == 1;
    for_tiles(r0, r1, nt, arb, whole, [&](int64_t gi, int lane0, int lo, int hi, int64_t t, int na) {
        const uint8_t* g = p.data.get() + gi * p.group_bytes;
        const auto fn = whole ? group_kernel<VK, T, 1, kDecodeHalves> : fns[na - 1];
        fn(g, nb, dplane, lane0, act + t * arb, arb, meta + t * nb, y + t * ldy + gi * G + lane0, ldy, lo, hi);
    });
}

#endif  // RP_AVX2

void free_aligned(void* p) { std::free(p); }

// Decode streams every packed byte once per token. On 4 KiB pages one thread read
// 24 GB/s on a Zen 4 VM where the same loop over 2 MiB pages read 33-35: each page
// costs a TLB walk and the hardware prefetcher stops at page boundaries. So weights
// start on a 2 MiB boundary and ask for transparent huge pages (a no-op where THP is
// off); only whole huge pages are asked for, so the tail costs no extra memory.
constexpr size_t kHuge = (size_t)2 << 20;

void* alloc_weights(size_t bytes) {
    void* mem = nullptr;
    const size_t align = bytes >= kHuge ? kHuge : 64;
    if (posix_memalign(&mem, align, bytes) != 0 || !mem) throw std::bad_alloc();
    if (bytes >= kHuge) madvise(mem, bytes / kHuge * kHuge, MADV_HUGEPAGE);
    return mem;
}

}  // namespace

bool packable(int32_t type) {
    if (k::handles(type)) return true;
#if defined(RP_AVX2)
    if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1) return true;
#if defined(RP_VNNI)
    if (type == T_Q8_0) return true;
#endif
#endif
    (void)type;
    return false;
}

// Whole pages inside [p, p + n) leave this process (see pack's release_source).
static void drop_pages(const uint8_t* p, size_t n) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)p + page - 1) / page * page, b = ((uintptr_t)p + n) / page * page;
    if (b > a) madvise((void*)a, b - a, MADV_DONTNEED);
}

std::unique_ptr<Packed> pack(int32_t type, const uint8_t* src, int64_t in, int64_t out, int n_threads,
                             bool release_source) {
    if (!packable(type)) throw std::invalid_argument("repack: type " + std::to_string(type) + " is not packable here");
    const bool kq = k::handles(type);
    const int64_t be = type_block_elems(type);
    if (in <= 0 || in % be || out <= 0) throw std::invalid_argument("repack: bad shape");
    const Layout L = kq ? Layout{} : layout_of(type);
    auto p = std::make_unique<Packed>();
    p->type = type;
    p->in = in;
    p->out = out;
    p->nb = in / be;
    p->groups = (out + G - 1) / G;
    // Rounded to 64 bytes so every group (and so every vector load in it) is aligned.
    p->group_bytes = kq ? k::group_bytes(type, p->nb) : ((size_t)p->nb * (L.qs + L.qh + L.d + L.m) + 63) / 64 * 64;
    const size_t total = (p->bytes() + 63) / 64 * 64;
    void* mem = alloc_weights(total);
    p->data = std::unique_ptr<uint8_t, void (*)(void*)>((uint8_t*)mem, free_aligned);
    const size_t blk = type_block_bytes(type), rb = (size_t)p->nb * blk;
    const int64_t groups = p->groups, nb = p->nb;
    uint8_t* dst = p->data.get();
    // In chunks of groups, so a file-mapped source is dropped as it is consumed: source and
    // copy then coexist one chunk at a time, not a whole matrix (a tied 145 MB vocabulary
    // head raised the peak RSS of a short generation by ~60 MiB while it was packed).
    constexpr int64_t kChunk = 256;
    for (int64_t g0 = 0; g0 < groups; g0 += kChunk) {
        const int64_t g1 = std::min(groups, g0 + kChunk);
        #pragma omp parallel for num_threads(std::max(1, n_threads)) schedule(static)
        for (int64_t gi = g0; gi < g1; ++gi) {
            const uint8_t* rows[G];
            for (int r = 0; r < G; ++r) rows[r] = gi * G + r < out ? src + (size_t)(gi * G + r) * rb : nullptr;
            if (kq) k::pack_group(type, rows, nb, dst + gi * p->group_bytes);
            else
                for (int64_t ib = 0; ib < nb; ++ib) pack_block(type, L, rows, blk, ib, nb, dst + gi * p->group_bytes);
        }
        if (release_source) {
            const int64_t r0 = g0 * G, r1 = std::min(out, g1 * G);
            drop_pages(src + (size_t)r0 * rb, (size_t)(r1 - r0) * rb);
        }
    }
    return p;
}

int token_tile() {
#if defined(RP_AVX2)
    return kNA;
#else
    return 1;
#endif
}

size_t meta_block_bytes(int32_t act_type) {
#if defined(RP_AVX2)
    if (act_type == T_Q8_0) return sizeof(Meta);
    if (act_type == T_Q8_K) return k::meta_block_bytes();
#endif
    (void)act_type;
    return 0;
}

void act_meta(int32_t act_type, const uint8_t* blocks, int64_t n, uint8_t* meta) {
#if defined(RP_AVX2)
    if (act_type == T_Q8_0) return meta_q8_0(blocks, n, (Meta*)meta);
    if (act_type == T_Q8_K) return k::act_meta(blocks, n, meta);
#endif
    (void)blocks; (void)n; (void)meta;
    throw std::invalid_argument("repack::act_meta: no summaries for activation type " + std::to_string(act_type));
}

void matmul(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, float* y, int64_t ldy, int64_t r0,
            int64_t r1, const uint8_t* meta) {
#if defined(RP_AVX2)
    r1 = std::min(r1, p.out);
    if (r0 >= r1 || nt <= 0) return;
    switch (p.type) {
        case T_Q4_K: case T_Q5_K: case T_Q6_K: return k::matmul(p, act, arb, nt, y, ldy, r0, r1, meta);
        case T_Q4_0: return matmul_t<T_Q4_0>(p, act, arb, nt, y, ldy, r0, r1, meta);
        case T_Q4_1: return matmul_t<T_Q4_1>(p, act, arb, nt, y, ldy, r0, r1, meta);
        case T_Q5_0: return matmul_t<T_Q5_0>(p, act, arb, nt, y, ldy, r0, r1, meta);
        case T_Q5_1: return matmul_t<T_Q5_1>(p, act, arb, nt, y, ldy, r0, r1, meta);
#if defined(RP_VNNI)
        case T_Q8_0: return matmul_t<T_Q8_0>(p, act, arb, nt, y, ldy, r0, r1, meta);
#endif
        default: break;
    }
#endif
    throw std::invalid_argument("repack::matmul: unsupported packed type " + std::to_string(p.type));
}

}  // namespace minfer::cpu::repack
