// The block kernels' AVX-512 path (F, BW, DQ, VL, VNNI): 16 weight rows (output columns) a
// tile, one per int32 / float lane, and up to 8 activation rows, so a block's weights are loaded
// and unpacked once and used from registers for every row of the tile. The arithmetic, which
// this path and the scalar one (qkernels.cpp) do identically, is described at the top of
// qkernels.cpp.
//
// It reads the weights as tiles (pack_tiles in qkernels.cpp, done once at load): per 16 columns
// and block, the 16 fp16 d (and Q4_1's 16 m), then the codes 4 bytes a column at a time, so
// that one 64-byte load gives lane j 4 code bytes of column j. No horizontal sums: the block
// sum isum of (row, column) builds up in that column's lane. The row's int16 codes
// x = 256 xh + xl (xl unsigned, xh signed bytes, QActBytes) are broadcast 4 bytes at a time,
// and vpdpbusd (u8 x s8, four products into each int32 lane) takes
//   Q4: ih += w * xh (w unsigned), il += xl * w (w as signed: 0..15)
//   Q8: ih += (w + 128) * xh from ih = -128 * sum(xh), il += xl * w
// so isum = 256 ih + il is the exact integer sum (|256 ih| < 2^28), and the float steps run on
// 16 lanes at once. Built for plain x86-64 like the rest; each function carries its target
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

constexpr int kMaxRows = 8;  // rows a tile
// How far ahead of the block it multiplies a tile prefetches the weights into L2. A decode
// step's weights (96 MB for SmolLM2 in int4) come from memory at every step, and a few-row tile
// does too little arithmetic per byte for the hardware prefetcher's distance to hide the
// latency: on this Xeon (one thread, model-sized weights) 8 KiB ahead made the 1-row GEMMs
// ~25% faster; 2-6 KiB and into L1 gained less, 16-32 KiB no more. Tiles lie end to end, so
// the prefetch runs on into the next tile (and harmlessly past the last).
constexpr int64_t kPrefetchBytes = 8192;

BATON_AVX512 inline __m512i bcast4(const uint8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// One tile: rows r0..r0+R, columns c0..c0 + nc (nc <= 16) from the tile's blocks at t; lane j
// is column c0 + j.
template <int64_t KIND, int R>
BATON_AVX512 void tile_avx512(const uint8_t* t, const QActBytes& a, int64_t r0, int64_t c0,
                              int nc, int64_t n, float* out) {
    constexpr int64_t step = kTileCols * (KIND == kQ4_1 ? 20 : KIND == kQ4_0 ? 18 : 34);
    constexpr int64_t codes = KIND == kQ4_1 ? 64 : 32;  // where a block's codes start
    // Locals, not a.*: the compiler cannot tell the stores into `out` from the scales.
    const int64_t nb = a.nb, m = a.m;
    const uint8_t* xb = a.x + r0 * nb * 64;  // row r0 + r's block b: xb + (r * nb + b) * 64
    __m512 acc[R], summ[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = summ[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, t += step) {
#pragma GCC unroll 9
        for (int64_t line = 0; line < step; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchBytes + line), _MM_HINT_T1);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
        __m512 mw = _mm512_setzero_ps();
        if (KIND == kQ4_1)
            mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
        else if (KIND == kQ4_0) mw = _mm512_mul_ps(_mm512_set1_ps(-8.0f), dw);
        // wq[u]: values 4u..4u+3 of each column; wu[u]: Q4 the same, Q8 + 128 (unsigned).
        __m512i wq[8], wu[8];
        if (KIND == kQ8_0) {
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) {
                wq[u] = _mm512_loadu_si512(t + codes + 64 * u);
                wu[u] = _mm512_xor_si512(wq[u], _mm512_set1_epi8(-128));
            }
        } else {
            const __m512i low4 = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 4
            for (int u = 0; u < 4; ++u) {  // low nibbles: values 0..15, high: 16..31
                const __m512i raw = _mm512_loadu_si512(t + codes + 64 * u);
                wq[u] = wu[u] = _mm512_and_si512(raw, low4);
                wq[u + 4] = wu[u + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const uint8_t* xl = xb + (r * nb + b) * 64;  // 32 low bytes, then 32 high bytes
            const int64_t at = b * m + r0 + r;
            // Four chains of 4 (integer sums: any order is exact): vpdpbusd's latency is
            // hidden for a one-row tile too (2-3% faster at 8 rows than two chains).
            __m512i ih[2], il[2];
            ih[0] = KIND == kQ8_0 ? _mm512_set1_epi32(a.corr[at]) : _mm512_setzero_si512();
            ih[1] = il[0] = il[1] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) {
                ih[u & 1] = _mm512_dpbusd_epi32(ih[u & 1], wu[u], bcast4(xl + 32 + 4 * u));
                il[u & 1] = _mm512_dpbusd_epi32(il[u & 1], bcast4(xl + 4 * u), wq[u]);
            }
            const __m512i isum = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_add_epi32(ih[0], ih[1]), 8), _mm512_add_epi32(il[0], il[1]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a.d[at])),
                                                         _mm512_cvtepi32_ps(isum)));
            if (KIND != kQ8_0)
                summ[r] = _mm512_add_ps(summ[r], _mm512_mul_ps(mw, _mm512_set1_ps(a.s[at])));
        }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << nc) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(out + (r0 + r) * n + c0, keep, _mm512_add_ps(acc[r], summ[r]));
}

template <int64_t KIND>
BATON_AVX512 void rows_avx512(const uint8_t* t, const QActBytes& a, int64_t r0, int R, int64_t c0,
                              int nc, int64_t n, float* out) {
    switch (R) {
        case 1: return tile_avx512<KIND, 1>(t, a, r0, c0, nc, n, out);
        case 2: return tile_avx512<KIND, 2>(t, a, r0, c0, nc, n, out);
        case 3: return tile_avx512<KIND, 3>(t, a, r0, c0, nc, n, out);
        case 4: return tile_avx512<KIND, 4>(t, a, r0, c0, nc, n, out);
        case 5: return tile_avx512<KIND, 5>(t, a, r0, c0, nc, n, out);
        case 6: return tile_avx512<KIND, 6>(t, a, r0, c0, nc, n, out);
        case 7: return tile_avx512<KIND, 7>(t, a, r0, c0, nc, n, out);
        default: return tile_avx512<KIND, 8>(t, a, r0, c0, nc, n, out);
    }
}

// Tiles t0..t1; each tile's weights (16 rows of blocks, <= 30 KiB) stay in L1 / L2 while every
// 8-row group of activations passes over them.
template <int64_t KIND>
BATON_AVX512 void tiles_kind_avx512(const QTiles& w, const QActBytes& a, int64_t t0, int64_t t1,
                                    float* out) {
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t c0 = t * kTileCols;
        const int nc = static_cast<int>(std::min<int64_t>(kTileCols, w.n - c0));
        for (int64_t r0 = 0; r0 < a.m; r0 += kMaxRows)
            rows_avx512<KIND>(w.p + t * w.tile_bytes, a, r0,
                              static_cast<int>(std::min<int64_t>(kMaxRows, a.m - r0)), c0, nc,
                              w.n, out);
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

void tiles_avx512(const QTiles& w, int64_t kind, const QActBytes& a, int64_t t0, int64_t t1,
                  float* out) {
    if (kind == kQ4_1) tiles_kind_avx512<kQ4_1>(w, a, t0, t1, out);
    else if (kind == kQ4_0) tiles_kind_avx512<kQ4_0>(w, a, t0, t1, out);
    else tiles_kind_avx512<kQ8_0>(w, a, t0, t1, out);
}

}  // namespace baton_q
