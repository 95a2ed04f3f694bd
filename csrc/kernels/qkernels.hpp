// Shared by the block kernels' scalar path (qkernels.cpp, where the header comment describes
// the arithmetic) and their AVX2 path (qkernels_avx2.cpp).
#pragma once

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define BATON_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace baton_q {

constexpr int QK = 32;  // values per block
constexpr int kLanes = 8;  // (row, column) pairs per AVX2 tile
// Columns a thread walks before it moves to the next 8 activation rows: their weight rows (at
// most 64 x 960 bytes) stay in L2 while each 8-row group's codes (<= 24 KiB) stay in L1.
constexpr int64_t kColumnBlock = 64;
enum Kind : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

inline int64_t block_bytes(int64_t kind) {
    switch (kind) {
        case kQ4_0: return 18;
        case kQ4_1: return 20;
        case kQ8_0: return 34;
        default: TORCH_CHECK(false, "unknown block kind ", kind, " (0 Q4_0, 1 Q4_1, 2 Q8_0)");
    }
}

// Activations quantized per 32-block: codes [m, nb * 32]; the scales dx and sx transposed to
// [nb, m], so that 8 consecutive rows' scales of one block are one load. `interleaved`: each
// block's codes stored as values 0, 2, .., 14, then 1, 3, .., 15, then 16, 18, .., 30, then
// 17, 19, .., 31, the order in which the AVX2 path unpacks a Q4 block's nibbles.
struct QAct {
    const int16_t* q;
    const float* d;
    const float* s;
    int64_t m, nb;
    bool interleaved;
};

// The AVX-512 path's activations: each (row, block)'s int16 codes x = 256 xh + xl as 64 bytes
// at x + (row * nb + block) * 64, the 32 xl (unsigned) then the 32 xh (signed), in value order;
// corr [nb, m]: -128 * the block's sum of xh (Q8_0's unsigned weight bytes, w + 128, need it);
// d and s as QAct's.
struct QActBytes {
    const uint8_t* x;
    const int32_t* corr;
    const float* d;
    const float* s;
    int64_t m, nb;
};

// Weight blocks [n, nb * block bytes].
struct QW {
    const uint8_t* p;
    int64_t row_bytes, n;
};

// The same blocks as tiles of 16 rows (pack_tiles): tile t at p + t * tile_bytes, its block b
// (16 * block bytes) at b * 16 * block bytes: the 16 rows' fp16 d, Q4_1's 16 fp16 m, then the
// codes as vectors of 64 bytes, vector u's bytes 4 j .. 4 j + 3 = row j's code bytes 4 u .. 4 u + 3
// (Q4: nibble bytes, low nibbles values 0..15, high 16..31; Q8_0: values). Rows past n: zeros.
constexpr int64_t kTileCols = 16;
struct QTiles {
    const uint8_t* p;
    int64_t tile_bytes, n;
};

inline float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
        const float f = std::ldexp(static_cast<float>(mant), -24);
        return sign ? -f : f;
    }
    const uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                                    : (sign | ((exp + 112) << 23) | (mant << 13));
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// always_inline: the AVX2 functions (another target) would otherwise call them out of line.
__attribute__((always_inline)) inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

__attribute__((always_inline)) inline int32_t load_i32(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// The scalar path: y[row, col] alone; rows r0..r1 x columns c0..c1 into out [m, n].
float pair_scalar(const QW& w, int64_t kind, const QAct& a, int64_t row, int64_t col);
void pairs_scalar(const QW& w, int64_t kind, const QAct& a, int64_t r0, int64_t r1, int64_t c0,
                  int64_t c1, float* out);

// The AVX2 path (call only where the CPU has AVX2, FMA and F16C).
void interleave_codes_avx2(int16_t* q, int64_t blocks);
void columns_avx2(const QW& w, int64_t kind, const QAct& a, int64_t c0, int64_t c1, float* out);

// The AVX-512 path (call only where the CPU has AVX-512 F, BW, DQ, VL and VNNI and the OS
// saves the ZMM state). codes [m, nb * 32] int16 -> x [m * nb * 64] bytes, corr [nb, m].
void split_codes_avx512(const int16_t* q, int64_t m, int64_t nb, uint8_t* x, int32_t* corr);
void tiles_avx512(const QTiles& w, int64_t kind, const QActBytes& a, int64_t t0, int64_t t1,
                  float* out);

}  // namespace baton_q
