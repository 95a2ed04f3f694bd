// Quantized GEMV / small GEMM over GGUF weight blocks read as stored:
//   Q4_0 (18 bytes: fp16 d, 16 bytes of nibbles)          w = d * (q - 8)
//   Q4_1 (20 bytes: fp16 d, fp16 m, 16 bytes of nibbles)  w = d * q + m
//   Q8_0 (34 bytes: fp16 d, 32 int8)                      w = d * q
// times activations quantized per 32-block to int16 codes with an fp32 scale dx and
// sx = dx * sum(codes) (ggml's q8_1 with 16-bit codes: ggml's 8-bit ones cost 2.2 points of
// teacher-forced top-1 agreement with the exact mode, 97.2% against 98% needed; 16 bits keep
// the activations as fine as bf16 would, and _mm256_madd_epi16 still gives exact int32 sums).
// Low nibbles hold a Q4 block's first 16 values, high nibbles the last 16.
//
// Every output value y[r, c] (activation row r, weight row c) is computed by one fixed sequence
// of IEEE operations that depends only on those two rows, never on how many rows are in the
// batch, which tile computed it, or how the output columns are split over threads
// (disaggregated == co-located token for token needs that):
//   isum = sum of the block's 32 products wq * xq    (exact int32; Q4: |isum| <= 15*32767*32
//                                                     < 2^24, so float(isum) is exact too)
//   acc  = acc + (dw * dx) * float(isum)              (block by block, in order)
//   summ = summ + mw * sx                             (Q4 only; Q4_0: mw = -8 dw)
//   y    = acc + summ
// The cost is per (row, column, block), so the AVX2 path gives each such pair one float lane:
// a tile is 8 pairs in one __m256, 8 rows x 1 column while 8 rows are left, then 4 x 2, 2 x 4
// and 1 x 8 for the rest (batch 1 fills the lanes with columns). Per block it decodes each
// column's weights once, takes two madd_epi16 per pair, folds the 8 pairs' int32 vectors into
// one vector of 8 block sums (a hadd tree, ~1 op a pair), and does the float steps above once
// for all 8 lanes. Columns left over from a tile width go through the scalar path.
// The AVX2 path (selected at run time, the module itself is built for plain x86-64) and the
// portable scalar path do exactly these IEEE operations, with no FMA contraction (the file is
// compiled with -ffp-contract=off), so they agree bit for bit: the scalar path is the tests'
// reference as well as the fallback on a CPU without AVX2.
//
// The ops are torch custom ops (TORCH_LIBRARY) threaded with at::parallel_for over output
// columns, so they use torch's own intra-op pool: a second pool would fight torch's spinning
// OpenMP threads on a small machine. The module is a Python extension only so that importing it
// registers the ops (`import baton._qkernels`) wherever Python finds the package.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace baton_q {

constexpr int QK = 32;  // values per block
constexpr int kLanes = 8;  // (row, column) pairs per AVX2 tile
// Columns a thread walks before it moves to the next 8 activation rows: their weight rows (at
// most 64 x 960 bytes) stay in L2 while each 8-row group's codes (<= 24 KiB) stay in L1.
constexpr int64_t kColumnBlock = 64;
enum Kind : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

int64_t block_bytes(int64_t kind) {
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

// Weight blocks [n, nb * block bytes].
struct QW {
    const uint8_t* p;
    int64_t row_bytes, n;
};

float fp16_to_fp32(uint16_t h) {
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

// One row's blocks; inlined into both the plain and the AVX2 wrapper below, where the compiler
// may vectorize it but must keep each IEEE operation (no contraction, no reassociation).
// Block b's scales go to d[b * bstep] and s[b * bstep].
constexpr float kQMax = 32767.0f;

__attribute__((always_inline)) inline void quantize_row_body(const float* x, int64_t nb,
                                                             int16_t* q, float* d, float* s,
                                                             int64_t bstep) {
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float db = amax / kQMax;
        const float id = amax != 0.0f ? kQMax / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; ++i) {
            const int v = static_cast<int>(std::nearbyint(xb[i] * id));
            q[b * QK + i] = static_cast<int16_t>(v);
            sum += v;
        }
        d[b * bstep] = db;
        s[b * bstep] = db * static_cast<float>(sum);
    }
}

// Row r's scales start at d + r * rstep: [m, nb] is rstep = nb, bstep = 1; [nb, m] the reverse.
void quantize_rows_scalar(const float* x, int64_t m, int64_t nb, int16_t* q, float* d, float* s,
                          int64_t rstep, int64_t bstep) {
    for (int64_t r = 0; r < m; ++r)
        quantize_row_body(x + r * nb * QK, nb, q + r * nb * QK, d + r * rstep, s + r * rstep,
                          bstep);
}

__attribute__((target("avx2,fma,f16c"))) void quantize_rows_avx2(const float* x, int64_t m,
                                                                   int64_t nb, int16_t* q, float* d,
                                                                   float* s, int64_t rstep,
                                                                   int64_t bstep) {
    for (int64_t r = 0; r < m; ++r)
        quantize_row_body(x + r * nb * QK, nb, q + r * nb * QK, d + r * rstep, s + r * rstep,
                          bstep);
}

#define BATON_AVX2 __attribute__((target("avx2,fma,f16c")))

// ------------------------------------------------------------------ scalar (reference) path

// The exact integer dot product of one block's codes with 32 activation codes.
int32_t block_dot_scalar(const uint8_t* blk, int64_t kind, const int16_t* x, bool interleaved) {
    int32_t sum = 0;
    if (kind == kQ8_0) {
        for (int i = 0; i < QK; ++i) sum += static_cast<int8_t>(blk[2 + i]) * x[i];
    } else {
        const uint8_t* qs = blk + (kind == kQ4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) {
            const int at = interleaved ? (i & 1) * 8 + (i >> 1) : i;  // where value i is stored
            sum += (qs[i] & 0x0f) * x[at] + (qs[i] >> 4) * x[at + 16];
        }
    }
    return sum;
}

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

// y[row, col]: the per-lane operations of the header, one pair at a time.
float pair_scalar(const QW& w, int64_t kind, const QAct& a, int64_t row, int64_t col) {
    const int64_t bb = block_bytes(kind);
    const uint8_t* wrow = w.p + col * w.row_bytes;
    float acc = 0.0f, summ = 0.0f;
    for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* blk = wrow + b * bb;
        const float dw = fp16_to_fp32(load_u16(blk));
        const int32_t isum = block_dot_scalar(blk, kind, a.q + (row * a.nb + b) * QK,
                                              a.interleaved);
        acc = acc + (dw * a.d[b * a.m + row]) * static_cast<float>(isum);
        if (kind != kQ8_0) {
            const float mw = kind == kQ4_1 ? fp16_to_fp32(load_u16(blk + 2)) : -8.0f * dw;
            summ = summ + mw * a.s[b * a.m + row];
        }
    }
    return acc + summ;  // Q8_0: summ stays 0 (both paths add it)
}

void pairs_scalar(const QW& w, int64_t kind, const QAct& a, int64_t r0, int64_t r1, int64_t c0,
                  int64_t c1, float* out) {
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) out[r * w.n + c] = pair_scalar(w, kind, a, r, c);
}

void columns_scalar(const QW& w, int64_t kind, const QAct& a, int64_t c0, int64_t c1,
                    float* out) {
    pairs_scalar(w, kind, a, 0, a.m, c0, c1, out);
}

// ------------------------------------------------------------------ AVX2 path

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

// Rows r0..r0+R over columns c0..c1 (c0 a multiple of 8 / R): tiles, then the leftover columns.
template <int64_t KIND, int R>
void strip_avx2(const QW& w, const QAct& a, int64_t r0, int64_t c0, int64_t c1, float* out) {
    constexpr int C = kLanes / R;
    int64_t c = c0;
    for (; c + C <= c1; c += C) tile_avx2<KIND, R>(w, a, r0, c, out);
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

bool cpu_has_avx2() {
    static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
    return ok;
}

// ------------------------------------------------------------------ ops

void check_activations(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.is_cpu(),
                "activations must be a contiguous 2-D float32 CPU tensor, got ", x.sizes(), " ",
                x.scalar_type());
    TORCH_CHECK(x.size(1) % QK == 0 && x.size(1) > 0, "in_features must be a positive multiple of ",
                QK, ", got ", x.size(1));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
    check_activations(x);
    const int64_t m = x.size(0), nb = x.size(1) / QK;
    at::Tensor q = at::empty({m, nb * QK}, x.options().dtype(at::kShort));
    at::Tensor d = at::empty({m, nb}, x.options());
    at::Tensor s = at::empty({m, nb}, x.options());
    quantize_rows_scalar(x.data_ptr<float>(), m, nb, q.data_ptr<int16_t>(), d.data_ptr<float>(),
                         s.data_ptr<float>(), nb, 1);
    return {q, d, s};
}

at::Tensor qgemm_impl(const at::Tensor& x, const at::Tensor& w, int64_t kind, bool use_simd) {
    check_activations(x);
    const int64_t bb = block_bytes(kind);
    const int64_t m = x.size(0), nb = x.size(1) / QK;
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.is_cpu(),
                "weight blocks must be a contiguous 2-D uint8 CPU tensor, got ", w.sizes(), " ",
                w.scalar_type());
    TORCH_CHECK(w.size(1) == nb * bb, "weight rows hold ", w.size(1), " bytes, ", nb,
                " blocks of kind ", kind, " need ", nb * bb);
    const int64_t n = w.size(0);
    // Thread-local scratch: a decode step quantizes its activations without allocating.
    thread_local std::vector<int16_t> q;
    thread_local std::vector<float> d, s;
    q.resize(static_cast<size_t>(m * nb * QK));
    d.resize(static_cast<size_t>(m * nb));
    s.resize(static_cast<size_t>(m * nb));
    const bool simd = use_simd && cpu_has_avx2();
    (simd ? quantize_rows_avx2 : quantize_rows_scalar)(x.data_ptr<float>(), m, nb, q.data(),
                                                      d.data(), s.data(), 1, m);  // [nb, m]
    at::Tensor y = at::empty({m, n}, x.options());
    float* out = y.data_ptr<float>();
    const QW wq{w.data_ptr<uint8_t>(), nb * bb, n};
    const bool interleaved = simd && kind != kQ8_0;
    if (interleaved) interleave_codes_avx2(q.data(), m * nb);
    const QAct a{q.data(), d.data(), s.data(), m, nb, interleaved};
    auto columns = simd ? columns_avx2 : columns_scalar;
    // Columns are independent: any split gives the same values. Chunks of whole 8-column
    // groups (at least two), so only the last chunk has columns left over from a tile width.
    const int64_t groups = (n + kLanes - 1) / kLanes;
    at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
        columns(wq, kind, a, begin * kLanes, std::min(n, end * kLanes), out);
    });
    return y;
}

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& w, int64_t kind) {
    return qgemm_impl(x, w, kind, true);
}

at::Tensor qgemm_scalar(const at::Tensor& x, const at::Tensor& w, int64_t kind) {
    return qgemm_impl(x, w, kind, false);
}

bool has_avx2() { return cpu_has_avx2(); }

}  // namespace baton_q

TORCH_LIBRARY(baton_q, m) {
    m.def("qgemm(Tensor x, Tensor w, int kind) -> Tensor", &baton_q::qgemm);
    m.def("qgemm_scalar(Tensor x, Tensor w, int kind) -> Tensor", &baton_q::qgemm_scalar);
    m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)", &baton_q::quantize_activations);
    m.def("has_avx2() -> bool", &baton_q::has_avx2);
}

PYBIND11_MODULE(_qkernels, m) {
    m.doc() = "Registers the torch ops torch.ops.baton_q.* (quantized GEMV over GGUF blocks).";
}
