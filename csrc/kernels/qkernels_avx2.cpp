// The block kernels' AVX2 path: 8 (row, column) lanes a tile. The arithmetic, which this path
// and the scalar one (qkernels.cpp) do identically, is described at the top of qkernels.cpp.
// Compiled for plain x86-64 like the rest; each function is built for AVX2 (BATON_AVX2) and
// called only after qkernels.cpp checked the CPU at run time.
#include "qkernels.hpp"

#include <immintrin.h>

#include <algorithm>

namespace baton_q {

// The codes of `blocks` consecutive blocks reordered as QAct::interleaved describes.
BATON_AVX2 void interleave_codes_avx2(int16_t* q, int64_t blocks) {
    // Per 128 bits: the even words, then the odd ones; then both halves' even words first.
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int64_t i = 0; i < blocks * 2; ++i, q += 16) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                            _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0xd8));
    }
}

// A block's 32 weight codes as two vectors of 16 int16 in the activations' order: Q8_0 values
// 0..15 and 16..31; Q4 interleaved (QAct::interleaved): the 16 nibble bytes in both halves,
// each 32-bit lane shifted right by 0 | 8 (w0) and 4 | 12 (w1), then 4 bits of each 16-bit
// lane: low nibbles of even, of odd bytes, high nibbles of even, of odd bytes (no lane crossing).
template <int64_t KIND>
BATON_AVX2 inline void decode_avx2(const uint8_t* blk, __m256i& w0, __m256i& w1) {
    if (KIND == kQ8_0) {
        w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
        w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
    } else {
        const __m256i low4 = _mm256_set1_epi16(0x0f);
        const __m256i raw = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (KIND == kQ4_1 ? 4 : 2))));
        w0 = _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8)),
                              low4);
        w1 = _mm256_and_si256(
            _mm256_srlv_epi32(raw, _mm256_setr_epi32(4, 4, 4, 4, 12, 12, 12, 12)), low4);
    }
}

// Lane l of the result: the sum of v[l]'s eight int32 lanes (integer adds: any order is exact).
// Unpacks and adds (one uop each), not phaddd (several uops on Zen).
BATON_AVX2 inline __m256i fold4_avx2(__m256i a, __m256i b, __m256i c, __m256i d) {
    // ab: a0+a2, b0+b2, a1+a3, b1+b3 per 128 bits; then a, b, c, d's 128-bit sums in order.
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

BATON_AVX2 inline __m256i reduce8_avx2(const __m256i v[kLanes]) {
    const __m256i lo = fold4_avx2(v[0], v[1], v[2], v[3]);  // v0..v3: low 128 bits, then high
    const __m256i hi = fold4_avx2(v[4], v[5], v[6], v[7]);
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
}

// The weight scales of lanes l = r * C + c from the C columns' block headers (fp16 d, then
// Q4_1's fp16 m): lane l takes column l % C.
template <int64_t KIND, int C>
BATON_AVX2 inline void weight_scales_avx2(const int32_t hdr[C], __m256& dw, __m256& mw) {
    __m256i h;
    if (C == 1) h = _mm256_set1_epi32(hdr[0]);
    else if (C == 2) h = _mm256_setr_epi32(hdr[0], hdr[1], hdr[0], hdr[1], hdr[0], hdr[1], hdr[0], hdr[1]);
    else if (C == 4) h = _mm256_setr_epi32(hdr[0], hdr[1], hdr[2], hdr[3], hdr[0], hdr[1], hdr[2], hdr[3]);
    else h = _mm256_setr_epi32(hdr[0], hdr[1], hdr[2], hdr[3], hdr[4], hdr[5], hdr[6], hdr[7]);
    // Per 128 bits: the four d's, then the four m's; then d0..d7 below m0..m7.
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h, split), 0xd8);
    dw = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    if (KIND == kQ4_1) mw = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
    else if (KIND == kQ4_0) mw = _mm256_mul_ps(_mm256_set1_ps(-8.0f), dw);
    else mw = _mm256_setzero_ps();
}

// The activation scales of lanes l = r * C + c (row l / C) for rows p[0..R).
template <int R>
BATON_AVX2 inline __m256 row_scales_avx2(const float* p) {
    if (R == 8) return _mm256_loadu_ps(p);
    if (R == 1) return _mm256_set1_ps(p[0]);
    const __m128 v = R == 4 ? _mm_loadu_ps(p)
                            : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
    const __m256i idx = R == 4 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                               : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), idx);
}

// One tile: rows r0..r0+R, columns c0..c0+8/R, lane l = (r0 + l / C, c0 + l % C).
template <int64_t KIND, int R>
BATON_AVX2 void tile_avx2(const QW& w, const QAct& a, int64_t r0, int64_t c0, float* out) {
    constexpr int C = kLanes / R;
    constexpr int64_t bb = KIND == kQ4_1 ? 20 : KIND == kQ4_0 ? 18 : 34;
    // Locals, not a.*: the compiler cannot tell the stores into `out` from the scales.
    const int64_t nb = a.nb, m = a.m, row_bytes = w.row_bytes;
    const uint8_t* blk = w.p + c0 * row_bytes;  // column c's block b: blk + c * row_bytes
    const int16_t* x = a.q + r0 * nb * QK;
    const float* dx = a.d + r0;
    const float* sx = a.s + r0;
    __m256 acc = _mm256_setzero_ps(), summ = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, blk += bb, x += QK, dx += m, sx += m) {
        __m256i w0[C], w1[C];
        int32_t hdr[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            decode_avx2<KIND>(blk + c * row_bytes, w0[c], w1[c]);
            hdr[c] = load_i32(blk + c * row_bytes);
            // The next tile's columns: C interleaved weight streams defeat the hardware
            // prefetcher (batch 1's 30 MB Q8_0 head: 4.7 ms without this, 2.4 ms with).
            if (C > 1) _mm_prefetch(reinterpret_cast<const char*>(blk + (C + c) * row_bytes),
                                    _MM_HINT_T0);
        }
        __m256i v[kLanes];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const int16_t* xr = x + r * nb * QK;
            const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
            const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16));
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
                v[r * C + c] = _mm256_add_epi32(_mm256_madd_epi16(w0[c], y0),
                                                _mm256_madd_epi16(w1[c], y1));
        }
        const __m256 isum = _mm256_cvtepi32_ps(reduce8_avx2(v));
        __m256 dw, mw;
        weight_scales_avx2<KIND, C>(hdr, dw, mw);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dw, row_scales_avx2<R>(dx)), isum));
        if (KIND != kQ8_0) summ = _mm256_add_ps(summ, _mm256_mul_ps(mw, row_scales_avx2<R>(sx)));
    }
    alignas(32) float y[kLanes];
    _mm256_store_ps(y, _mm256_add_ps(acc, summ));
    for (int l = 0; l < kLanes; ++l) out[(r0 + l / C) * w.n + c0 + l % C] = y[l];
}

// Eight int16 at p in both 128-bit halves.
BATON_AVX2 inline __m256i both_halves_avx2(const int16_t* p) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 1 x 8 tile of Q4 blocks (batch 1's): columns c and c + 4 share one vector, 16 nibble
// bytes in each half, against the row's interleaved codes duplicated in both halves; four
// and/shift masks give the 4 bits of each 16-bit lane (values 2j, 16 + 2j, 2j + 1, 17 + 2j),
// and the 4 column pairs' sums fold straight into lanes 0..7 (9 ops for 8 pairs, not 21).
template <int64_t KIND>
BATON_AVX2 void tile1_q4_avx2(const QW& w, const QAct& a, int64_t r, int64_t c0, float* out) {
    constexpr int64_t bb = KIND == kQ4_1 ? 20 : 18;
    constexpr int64_t qs = KIND == kQ4_1 ? 4 : 2;  // where the nibbles start
    const int64_t nb = a.nb, m = a.m, row_bytes = w.row_bytes;
    const uint8_t* blk = w.p + c0 * row_bytes;
    const int16_t* x = a.q + r * nb * QK;
    const float* dx = a.d + r;
    const float* sx = a.s + r;
    const __m256i low4 = _mm256_set1_epi16(0x0f);
    __m256 acc = _mm256_setzero_ps(), summ = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, blk += bb, x += QK, dx += m, sx += m) {
        const __m256i ya = both_halves_avx2(x), yc = both_halves_avx2(x + 8);
        const __m256i yb = both_halves_avx2(x + 16), yd = both_halves_avx2(x + 24);
        __m256i v[4];
        int32_t hdr[kLanes];
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
            const uint8_t* lo = blk + k * row_bytes;
            const uint8_t* hi = blk + (k + 4) * row_bytes;
            hdr[k] = load_i32(lo);
            hdr[k + 4] = load_i32(hi);
            _mm_prefetch(reinterpret_cast<const char*>(lo + kLanes * row_bytes), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(hi + kLanes * row_bytes), _MM_HINT_T0);
            const __m256i raw = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + qs))),
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + qs)), 1);
            const __m256i wa = _mm256_and_si256(raw, low4);
            const __m256i wb = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            const __m256i wc = _mm256_and_si256(_mm256_srli_epi16(raw, 8), low4);
            const __m256i wd = _mm256_srli_epi16(raw, 12);
            v[k] = _mm256_add_epi32(
                _mm256_add_epi32(_mm256_madd_epi16(wa, ya), _mm256_madd_epi16(wb, yb)),
                _mm256_add_epi32(_mm256_madd_epi16(wc, yc), _mm256_madd_epi16(wd, yd)));
        }
        const __m256 isum = _mm256_cvtepi32_ps(fold4_avx2(v[0], v[1], v[2], v[3]));
        __m256 dw, mw;
        weight_scales_avx2<KIND, kLanes>(hdr, dw, mw);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(*dx)), isum));
        summ = _mm256_add_ps(summ, _mm256_mul_ps(mw, _mm256_set1_ps(*sx)));
    }
    _mm256_storeu_ps(out + r * w.n + c0, _mm256_add_ps(acc, summ));
}

// Rows r0..r0+R over columns c0..c1 (c0 a multiple of 8 / R): tiles, then the leftover columns.
template <int64_t KIND, int R>
void strip_avx2(const QW& w, const QAct& a, int64_t r0, int64_t c0, int64_t c1, float* out) {
    constexpr int C = kLanes / R;
    int64_t c = c0;
    for (; c + C <= c1; c += C) {
        if (R == 1 && KIND != kQ8_0) tile1_q4_avx2<KIND == kQ8_0 ? kQ4_1 : KIND>(w, a, r0, c, out);
        else tile_avx2<KIND, R>(w, a, r0, c, out);
    }
    pairs_scalar(w, KIND, a, r0, r0 + R, c, c1, out);
}

template <int64_t KIND>
void columns_kind_avx2(const QW& w, const QAct& a, int64_t c0, int64_t c1, float* out) {
    const int64_t full = a.m / kLanes * kLanes;
    for (int64_t cb = c0; cb < c1; cb += kColumnBlock) {
        const int64_t ce = std::min(c1, cb + kColumnBlock);
        for (int64_t r0 = 0; r0 < full; r0 += kLanes)
            for (int64_t c = cb; c < ce; ++c) tile_avx2<KIND, 8>(w, a, r0, c, out);
        int64_t r0 = full;
        if (a.m - r0 >= 4) strip_avx2<KIND, 4>(w, a, r0, cb, ce, out), r0 += 4;
        if (a.m - r0 >= 2) strip_avx2<KIND, 2>(w, a, r0, cb, ce, out), r0 += 2;
        if (a.m - r0 >= 1) strip_avx2<KIND, 1>(w, a, r0, cb, ce, out);
    }
}

void columns_avx2(const QW& w, int64_t kind, const QAct& a, int64_t c0, int64_t c1, float* out) {
    if (kind == kQ4_1) columns_kind_avx2<kQ4_1>(w, a, c0, c1, out);
    else if (kind == kQ4_0) columns_kind_avx2<kQ4_0>(w, a, c0, c1, out);
    else columns_kind_avx2<kQ8_0>(w, a, c0, c1, out);
}

}  // namespace baton_q
