// Quantized GEMV / small GEMM (1..16 rows) over GGUF weight blocks read as stored:
//   Q4_0 (18 bytes: fp16 d, 16 bytes of nibbles)          w = d * (q - 8)
//   Q4_1 (20 bytes: fp16 d, fp16 m, 16 bytes of nibbles)  w = d * q + m
//   Q8_0 (34 bytes: fp16 d, 32 int8)                      w = d * q
// times activations quantized per 32-block to int16 codes with an fp32 scale dx and
// sx = dx * sum(codes) (ggml's q8_1 with 16-bit codes: ggml's 8-bit ones cost 2.2 points of
// teacher-forced top-1 agreement with the exact mode, 97.2% against 98% needed; 16 bits keep
// the activations as fine as bf16 would, and _mm256_madd_epi16 still gives exact int32 sums).
// Low nibbles hold a Q4 block's first 16 values, high nibbles the last 16.
//
// Every output value is computed by one fixed sequence of operations that depends only on its
// weight row and its activation row, never on how many rows are in the batch or how the output
// columns are split over threads (disaggregated == co-located token for token needs that):
//   lane[j] = sum over values 2j, 2j+1, 16+2j, 17+2j of wq * xq      (exact int32, j = 0..7)
//   acc[j]  = acc[j] + (dw * dx) * float(lane[j])                     (block by block)
//   summ    = summ + mw * sx                                          (Q4 only; Q4_0: mw = -8 dw)
//   y       = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)) + summ
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
constexpr int kMaxTile = 4;  // activation rows that share one read of a weight block
enum Kind : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

int64_t block_bytes(int64_t kind) {
    switch (kind) {
        case kQ4_0: return 18;
        case kQ4_1: return 20;
        case kQ8_0: return 34;
        default: TORCH_CHECK(false, "unknown block kind ", kind, " (0 Q4_0, 1 Q4_1, 2 Q8_0)");
    }
}

// Activations quantized per 32-block: codes [M, nb * 32], dx [M, nb], sx [M, nb].
struct QAct {
    const int16_t* q;
    const float* d;
    const float* s;
    int64_t nb;
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

uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// One row's blocks; inlined into both the plain and the AVX2 wrapper below, where the compiler
// may vectorize it but must keep each IEEE operation (no contraction, no reassociation).
constexpr float kQMax = 32767.0f;

__attribute__((always_inline)) inline void quantize_row_body(const float* x, int64_t nb,
                                                             int16_t* q, float* d, float* s) {
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
        d[b] = db;
        s[b] = db * static_cast<float>(sum);
    }
}

void quantize_rows_scalar(const float* x, int64_t m, int64_t nb, int16_t* q, float* d, float* s) {
    for (int64_t r = 0; r < m; ++r)
        quantize_row_body(x + r * nb * QK, nb, q + r * nb * QK, d + r * nb, s + r * nb);
}

__attribute__((target("avx2,fma,f16c"))) void quantize_rows_avx2(const float* x, int64_t m,
                                                                   int64_t nb, int16_t* q, float* d,
                                                                   float* s) {
    for (int64_t r = 0; r < m; ++r)
        quantize_row_body(x + r * nb * QK, nb, q + r * nb * QK, d + r * nb, s + r * nb);
}

// ------------------------------------------------------------------ scalar (reference) path

// The eight lane sums of one block (the AVX2 path's lanes).
void lanes_scalar(const uint8_t* blk, int64_t kind, const int16_t* y, int32_t lane[8]) {
    int32_t w[QK];
    if (kind == kQ8_0) {
        for (int i = 0; i < QK; ++i) w[i] = static_cast<int8_t>(blk[2 + i]);
    } else {
        const uint8_t* qs = blk + (kind == kQ4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) {
            w[i] = qs[i] & 0x0f;
            w[i + 16] = qs[i] >> 4;
        }
    }
    for (int j = 0; j < 8; ++j) {
        const int i = 2 * j;
        lane[j] = w[i] * y[i] + w[i + 1] * y[i + 1] + w[i + 16] * y[i + 16] + w[i + 17] * y[i + 17];
    }
}

float reduce_lanes(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

void column_scalar(const uint8_t* wrow, int64_t kind, const QAct& a, int64_t m0, int64_t rows,
                   float* out, int64_t ldo) {
    const int64_t bb = block_bytes(kind);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = m0 + r;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        float summ = 0.0f;
        for (int64_t b = 0; b < a.nb; ++b) {
            const uint8_t* blk = wrow + b * bb;
            const float dw = fp16_to_fp32(load_u16(blk));
            int32_t lane[8];
            lanes_scalar(blk, kind, a.q + (row * a.nb + b) * QK, lane);
            const float dd = dw * a.d[row * a.nb + b];
            for (int j = 0; j < 8; ++j) acc[j] = acc[j] + dd * static_cast<float>(lane[j]);
            if (kind != kQ8_0) {
                const float mw = kind == kQ4_1 ? fp16_to_fp32(load_u16(blk + 2)) : -8.0f * dw;
                summ = summ + mw * a.s[row * a.nb + b];
            }
        }
        out[r * ldo] = reduce_lanes(acc) + summ;  // Q8_0: summ stays 0, + 0 changes nothing
    }
}

// ------------------------------------------------------------------ AVX2 path

__attribute__((target("avx2,fma,f16c"))) inline float reduce_avx2(__m256 v) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // j, j+4
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));  // (0+4)+(2+6), (1+5)+(3+7)
    return _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, 1));
}

// Lanes j = 0..7 of w . y for one block held as two halves of 16 int16 (values 0..15, 16..31):
// the products of values 2j, 2j+1 and 16+2j, 17+2j, each < 2^21: the int32 sums are exact.
__attribute__((target("avx2,fma,f16c"))) inline __m256i lanes_avx2(__m256i w0, __m256i w1,
                                                                   const int16_t* y) {
    const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
    const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 16));
    return _mm256_add_epi32(_mm256_madd_epi16(w0, y0), _mm256_madd_epi16(w1, y1));
}

// Q4 blocks (Q4_0 or Q4_1: a template argument, so the inner loop has no branch) and Q8_0
// blocks; R activation rows share one read of each weight block.
template <int64_t KIND, int R>
__attribute__((target("avx2,fma,f16c"))) void tile_kind_avx2(const uint8_t* wrow, const QAct& a,
                                                              int64_t m0, float* out, int64_t ldo) {
    constexpr int64_t bb = KIND == kQ4_1 ? 20 : KIND == kQ4_0 ? 18 : 34;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m256 acc[R];
    float summ[R];
    for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_setzero_ps();
        summ[r] = 0.0f;
    }
    for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* blk = wrow + b * bb;
        const float dw = _cvtsh_ss(load_u16(blk));
        __m256i w0, w1;
        if (KIND == kQ8_0) {
            w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
            w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
        } else {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + bb - 16));
            w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
            w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        }
        const float mw = KIND == kQ4_1 ? _cvtsh_ss(load_u16(blk + 2)) : -8.0f * dw;
        for (int r = 0; r < R; ++r) {
            const int64_t i = (m0 + r) * a.nb + b;
            const __m256i lane = lanes_avx2(w0, w1, a.q + i * QK);
            const __m256 dd = _mm256_set1_ps(dw * a.d[i]);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(lane)));
            if (KIND != kQ8_0) summ[r] = summ[r] + mw * a.s[i];
        }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = reduce_avx2(acc[r]) + summ[r];
}

template <int R>
void tile_avx2(const uint8_t* wrow, int64_t kind, const QAct& a, int64_t m0, float* out,
               int64_t ldo) {
    if (kind == kQ4_1) tile_kind_avx2<kQ4_1, R>(wrow, a, m0, out, ldo);
    else if (kind == kQ4_0) tile_kind_avx2<kQ4_0, R>(wrow, a, m0, out, ldo);
    else tile_kind_avx2<kQ8_0, R>(wrow, a, m0, out, ldo);
}

void column_avx2(const uint8_t* wrow, int64_t kind, const QAct& a, int64_t m0, int64_t rows,
                 float* out, int64_t ldo) {
    switch (rows) {
        case 1: return tile_avx2<1>(wrow, kind, a, m0, out, ldo);
        case 2: return tile_avx2<2>(wrow, kind, a, m0, out, ldo);
        case 3: return tile_avx2<3>(wrow, kind, a, m0, out, ldo);
        default: return tile_avx2<4>(wrow, kind, a, m0, out, ldo);
    }
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
                         s.data_ptr<float>());
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
                                                      d.data(), s.data());
    at::Tensor y = at::empty({m, n}, x.options());
    float* out = y.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const QAct a{q.data(), d.data(), s.data(), nb};
    auto column = simd ? column_avx2 : column_scalar;
    // Columns are independent: any split gives the same values (at least 16 columns a chunk).
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t col = begin; col < end; ++col)
            for (int64_t m0 = 0; m0 < m; m0 += kMaxTile)
                column(wp + col * nb * bb, kind, a, m0, std::min<int64_t>(kMaxTile, m - m0),
                       out + m0 * n + col, n);
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
