// The block kernels' AVX-512 path (F, BW, DQ, VL, VNNI): 16 weight columns a tile, one per
// int32 / float lane, and up to 8 activation rows, so a block's weights are loaded and unpacked
// once and used from registers for every row of the tile. The arithmetic, which this path and
// the scalar one (qkernels.cpp) do identically, is described at the top of qkernels.cpp.
//
// No horizontal sums: a lane is one column, so the block sum isum of (row, column) builds up in
// that column's lane. Per block the 16 columns' code bytes are transposed (4-byte groups, four
// 128-bit loads a vector) so that lane j holds 4 consecutive codes of column j; the row's int16
// codes x = 256 xh + xl (xl unsigned, xh signed bytes, QActBytes) are broadcast 4 bytes at a
// time, and vpdpbusd (u8 x s8, four products into each int32 lane) takes
//   Q4: ih += w * xh (w unsigned), il += xl * w (w as signed: 0..15)
//   Q8: ih += (w + 128) * xh from ih = -128 * sum(xh), il += xl * w
// so isum = 256 ih + il is the exact integer sum (|256 ih| < 2^28), and the float steps run on
// 16 lanes at once. Columns past the end of a tile read the last column again and are not
// stored. Built for plain x86-64 like the rest; each function carries its target
// (BATON_AVX512) and is called only after qkernels.cpp checked the CPU and the OS (XGETBV: the
// ZMM state is enabled) at run time. Target attributes, not per-file flags: an inline function
// from a header compiled with AVX-512 in this file could be the copy the linker keeps.
#include "qkernels.hpp"

#include <immintrin.h>

#include <algorithm>

#define BATON_AVX512 \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))

namespace baton_q {

namespace {

constexpr int kCols = 16;  // columns a tile: one per lane
constexpr int kMaxRows = 8;  // rows a tile

// Byte t of dword u of lanes 0..15 (column j at lane j): 4 bytes at p[j] + o, for 4 dwords
// u = 0..3 from one 16-byte load per column: vector a holds columns a, 4 + a, 8 + a, 12 + a
// in its 128-bit lanes; the 4 x 4 dword transposes inside the lanes put column 4 q + a at
// dword 4 q + a of each result.
BATON_AVX512 inline void transpose16x4(const uint8_t* const p[kCols], int64_t o, __m512i out[4]) {
    __m512i z[4];
#pragma GCC unroll 4
    for (int a = 0; a < 4; ++a) {
        z[a] = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[a] + o)));
        z[a] = _mm512_inserti32x4(
            z[a], _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[4 + a] + o)), 1);
        z[a] = _mm512_inserti32x4(
            z[a], _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[8 + a] + o)), 2);
        z[a] = _mm512_inserti32x4(
            z[a], _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[12 + a] + o)), 3);
    }
    const __m512i lo01 = _mm512_unpacklo_epi32(z[0], z[1]), hi01 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i lo23 = _mm512_unpacklo_epi32(z[2], z[3]), hi23 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(lo01, lo23);
    out[1] = _mm512_unpackhi_epi64(lo01, lo23);
    out[2] = _mm512_unpacklo_epi64(hi01, hi23);
    out[3] = _mm512_unpackhi_epi64(hi01, hi23);
}

BATON_AVX512 inline __m512i bcast4(const uint8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// One tile: rows r0..r0+R, columns c0..c0 + nc (nc <= 16); lane j is column c0 + j.
template <int64_t KIND, int R>
BATON_AVX512 void tile_avx512(const QW& w, const QActBytes& a, int64_t r0, int64_t c0, int nc,
                              float* out) {
    constexpr int64_t bb = KIND == kQ4_1 ? 20 : KIND == kQ4_0 ? 18 : 34;
    constexpr int64_t qs = KIND == kQ4_1 ? 4 : 2;  // where the codes start
    // Locals, not a.*: the compiler cannot tell the stores into `out` from the scales.
    const int64_t nb = a.nb, m = a.m, row_bytes = w.row_bytes;
    const uint8_t* base = w.p + c0 * row_bytes;
    const uint8_t* col[kCols];
    alignas(64) int32_t hoff[kCols];
    for (int j = 0; j < kCols; ++j) {
        const int64_t at = std::min(j, nc - 1) * row_bytes;
        col[j] = base + at;
        hoff[j] = static_cast<int32_t>(at);
    }
    const __m512i hidx = _mm512_load_si512(hoff);
    const uint8_t* xb = a.x + r0 * nb * 64;  // row r0 + r's block b: xb + (r * nb + b) * 64
    __m512 acc[R], summ[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = summ[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t o = b * bb;
        const __m512i hdr = _mm512_i32gather_epi32(
            _mm512_add_epi32(hidx, _mm512_set1_epi32(static_cast<int32_t>(o))), base, 1);
        const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
        __m512 mw = _mm512_setzero_ps();
        if (KIND == kQ4_1) mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16)));
        else if (KIND == kQ4_0) mw = _mm512_mul_ps(_mm512_set1_ps(-8.0f), dw);
        // wq[u]: codes 4u..4u+3 of each column; wu[u]: Q4 the same, Q8 + 128 (unsigned).
        __m512i wq[8], wu[8];
        if (KIND == kQ8_0) {
            transpose16x4(col, o + qs, wq);
            transpose16x4(col, o + qs + 16, wq + 4);
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) wu[u] = _mm512_xor_si512(wq[u], _mm512_set1_epi8(-128));
        } else {
            __m512i raw[4];
            transpose16x4(col, o + qs, raw);
            const __m512i low4 = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 4
            for (int u = 0; u < 4; ++u) {
                wq[u] = wu[u] = _mm512_and_si512(raw[u], low4);  // values 4u..4u+3
                wq[u + 4] = wu[u + 4] = _mm512_and_si512(_mm512_srli_epi16(raw[u], 4), low4);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const uint8_t* xl = xb + (r * nb + b) * 64;  // 32 low bytes, then 32 high bytes
            const int64_t at = b * m + r0 + r;
            __m512i ih = KIND == kQ8_0 ? _mm512_set1_epi32(a.corr[at]) : _mm512_setzero_si512();
            __m512i il = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) {
                ih = _mm512_dpbusd_epi32(ih, wu[u], bcast4(xl + 32 + 4 * u));
                il = _mm512_dpbusd_epi32(il, bcast4(xl + 4 * u), wq[u]);
            }
            const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(ih, 8), il);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a.d[at])),
                                                         _mm512_cvtepi32_ps(isum)));
            if (KIND != kQ8_0)
                summ[r] = _mm512_add_ps(summ[r], _mm512_mul_ps(mw, _mm512_set1_ps(a.s[at])));
        }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << nc) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(out + (r0 + r) * w.n + c0, keep, _mm512_add_ps(acc[r], summ[r]));
}

template <int64_t KIND>
BATON_AVX512 void rows_avx512(const QW& w, const QActBytes& a, int64_t r0, int R, int64_t c0,
                              int nc, float* out) {
    switch (R) {
        case 1: return tile_avx512<KIND, 1>(w, a, r0, c0, nc, out);
        case 2: return tile_avx512<KIND, 2>(w, a, r0, c0, nc, out);
        case 3: return tile_avx512<KIND, 3>(w, a, r0, c0, nc, out);
        case 4: return tile_avx512<KIND, 4>(w, a, r0, c0, nc, out);
        case 5: return tile_avx512<KIND, 5>(w, a, r0, c0, nc, out);
        case 6: return tile_avx512<KIND, 6>(w, a, r0, c0, nc, out);
        case 7: return tile_avx512<KIND, 7>(w, a, r0, c0, nc, out);
        default: return tile_avx512<KIND, 8>(w, a, r0, c0, nc, out);
    }
}

// Columns c0..c1 tile by tile; each tile's weights (16 rows of blocks) stay in L1 while every
// 8-row group of activations passes over them.
template <int64_t KIND>
BATON_AVX512 void columns_kind_avx512(const QW& w, const QActBytes& a, int64_t c0, int64_t c1,
                                      float* out) {
    for (int64_t c = c0; c < c1; c += kCols) {
        const int nc = static_cast<int>(std::min<int64_t>(kCols, c1 - c));
        for (int64_t r0 = 0; r0 < a.m; r0 += kMaxRows)
            rows_avx512<KIND>(w, a, r0, static_cast<int>(std::min<int64_t>(kMaxRows, a.m - r0)),
                              c, nc, out);
    }
}

}  // namespace

BATON_AVX512 void split_codes_avx512(const int16_t* q, int64_t m, int64_t nb, uint8_t* x,
                                     int32_t* corr) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < nb; ++b, q += QK, x += 64) {
            const __m512i v = _mm512_loadu_si512(q);
            const __m512i hi = _mm512_srai_epi16(v, 8);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi16_epi8(v));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 32), _mm512_cvtepi16_epi8(hi));
            corr[b * m + r] =
                -128 * _mm512_reduce_add_epi32(_mm512_madd_epi16(hi, _mm512_set1_epi16(1)));
        }
}

void columns_avx512(const QW& w, int64_t kind, const QActBytes& a, int64_t c0, int64_t c1,
                    float* out) {
    if (kind == kQ4_1) columns_kind_avx512<kQ4_1>(w, a, c0, c1, out);
    else if (kind == kQ4_0) columns_kind_avx512<kQ4_0>(w, a, c0, c1, out);
    else columns_kind_avx512<kQ8_0>(w, a, c0, c1, out);
}

}  // namespace baton_q
