// Block layouts of the GGML quantization types, byte-compatible with GGUF files.
// Shared by every backend: a weight tensor is used in place, straight from the mmap.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace minfer {

// GGUF tensor type ids (a file-format contract: never renumber).
enum GgmlType : int32_t {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7,
    T_Q8_0 = 8, T_Q8_1 = 9, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13,
    T_Q6_K = 14, T_Q8_K = 15,
};

using half = uint16_t;  // IEEE binary16 bit pattern

constexpr int QK4_0 = 32, QK4_1 = 32, QK5_0 = 32, QK5_1 = 32, QK8_0 = 32;
constexpr int QK_K = 256;
constexpr int K_SCALE_SIZE = 12;

#pragma pack(push, 1)
struct block_q4_0 { half d; uint8_t qs[QK4_0 / 2]; };
struct block_q4_1 { half d; half m; uint8_t qs[QK4_1 / 2]; };
struct block_q5_0 { half d; uint8_t qh[4]; uint8_t qs[QK5_0 / 2]; };
struct block_q5_1 { half d; half m; uint8_t qh[4]; uint8_t qs[QK5_1 / 2]; };
struct block_q8_0 { half d; int8_t qs[QK8_0]; };
struct block_q4_K { half d; half dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; };
struct block_q5_K { half d; half dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct block_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; half d; };
// Activation blocks (the CPU quantizes activations once per matmul input, ADR-0013).
struct block_q8_K { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };
#pragma pack(pop)

static_assert(sizeof(block_q4_0) == 18, "q4_0");
static_assert(sizeof(block_q4_1) == 20, "q4_1");
static_assert(sizeof(block_q5_0) == 22, "q5_0");
static_assert(sizeof(block_q5_1) == 24, "q5_1");
static_assert(sizeof(block_q8_0) == 34, "q8_0");
static_assert(sizeof(block_q4_K) == 144, "q4_K");
static_assert(sizeof(block_q5_K) == 176, "q5_K");
static_assert(sizeof(block_q6_K) == 210, "q6_K");
static_assert(sizeof(block_q8_K) == 292, "q8_K");

// Elements per block and bytes per block; 0 for a type we do not support.
inline int type_block_elems(int32_t t) {
    switch (t) {
        case T_F32: case T_F16: return 1;
        case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
        case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_Q8_K: return QK_K;
        default: return 0;
    }
}
inline size_t type_block_bytes(int32_t t) {
    switch (t) {
        case T_F32: return 4;
        case T_F16: return 2;
        case T_Q4_0: return sizeof(block_q4_0);
        case T_Q4_1: return sizeof(block_q4_1);
        case T_Q5_0: return sizeof(block_q5_0);
        case T_Q5_1: return sizeof(block_q5_1);
        case T_Q8_0: return sizeof(block_q8_0);
        case T_Q4_K: return sizeof(block_q4_K);
        case T_Q5_K: return sizeof(block_q5_K);
        case T_Q6_K: return sizeof(block_q6_K);
        case T_Q8_K: return sizeof(block_q8_K);
        default: return 0;
    }
}
// Bytes of one row of n elements; 0 if n is not a whole number of blocks or the type is unknown.
inline size_t type_row_bytes(int32_t t, int64_t n) {
    int be = type_block_elems(t);
    if (be == 0 || n % be != 0) return 0;
    return (size_t)(n / be) * type_block_bytes(t);
}

inline float fp16_to_fp32(half h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: renormalize
            int e = -1;
            do { e++; mant <<= 1; } while ((mant & 0x400) == 0);
            mant &= 0x3ff;
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline half fp32_to_fp16(float f) {  // round to nearest even
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (half)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (half)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (half)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t hm = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (hm & 1))) hm++;
        return (half)(sign | hm);
    }
    uint32_t hm = mant >> 13, rem = mant & 0x1fff;
    uint32_t h = sign | ((uint32_t)exp << 10) | hm;
    if (rem > 0x1000 || (rem == 0x1000 && (hm & 1))) h++;
    return (half)h;
}

}  // namespace minfer
