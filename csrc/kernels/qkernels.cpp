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
// The cost is per (row, column, block), so the AVX2 path (qkernels_avx2.cpp) gives each such
// pair one float lane: a tile is 8 pairs in one __m256, 8 rows x 1 column while 8 rows are left,
// then 4 x 2, 2 x 4 and 1 x 8 for the rest (batch 1 fills the lanes with columns). Per block it
// decodes each column's weights once, takes two madd_epi16 per pair, folds the 8 pairs' int32
// vectors into one vector of 8 block sums (unpacks and adds, ~1-3 ops a pair), and does the
// float steps above once for all 8 lanes. Columns left over from a tile width go through the
// scalar path. The AVX-512 path (qkernels_avx512.cpp) reads the weights tiled at load
// (pack_tiles: 16 weight rows a tile) and gives each output column one lane, for up to 8
// activation rows a tile, so a block's codes are unpacked once for all of them, and no
// horizontal sums are needed. The paths are chosen at run time (the module itself is built for
// plain x86-64): AVX-512 where CPUID and XGETBV say the CPU and the OS allow it, else AVX2,
// else scalar; BATON_QKERNELS or qgemm_path's argument forces one. All do exactly these IEEE
// operations, with no FMA contraction (the files are compiled with -ffp-contract=off), so they
// agree bit for bit: the scalar path is the tests' reference as well as the fallback on a CPU
// without AVX2.
//
// The ops are torch custom ops (TORCH_LIBRARY) threaded with at::parallel_for over output
// columns, so they use torch's own intra-op pool: a second pool would fight torch's spinning
// OpenMP threads on a small machine. The module must be compiled with OpenMP (CMakeLists.txt):
// without it ATen's header runs the body on the calling thread alone. The module is a Python extension only so that importing it
// registers the ops (`import baton._qkernels`) wherever Python finds the package.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "qkernels.hpp"

#include <cpuid.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace baton_q {

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

bool cpu_has_avx2() {
    static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
    return ok;
}

// The CPU has AVX-512 F, DQ, BW, VL and VNNI (CPUID) and the OS saves the opmask and ZMM state
// (XGETBV's XCR0 bits 1, 2, 5, 6, 7): a guest may hide the state that the CPU reports.
bool cpu_has_avx512() {
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return false;
        uint32_t xcr0, xcr0_hi;
        __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(xcr0_hi) : "c"(0));
        if ((xcr0 & 0xe6u) != 0xe6u) return false;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const unsigned need_b = bit_AVX512F | bit_AVX512DQ | bit_AVX512BW | bit_AVX512VL;
        return (b & need_b) == need_b && (c & bit_AVX512VNNI) && cpu_has_avx2();
    }();
    return ok;
}

// The kernel paths, slowest first; `BATON_QKERNELS` (or qgemm_path's argument) names one.
enum Path : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr const char* kPathNames[] = {"scalar", "avx2", "avx512"};

bool path_runs(Path p) {
    return p == kScalar || (p == kAvx2 && cpu_has_avx2()) || (p == kAvx512 && cpu_has_avx512());
}

Path parse_path(const std::string& name) {
    for (int p = kScalar; p <= kAvx512; ++p) {
        if (name != kPathNames[p]) continue;
        TORCH_CHECK(path_runs(static_cast<Path>(p)), "kernel path ", name,
                    " does not run on this CPU (or its OS does not enable it)");
        return static_cast<Path>(p);
    }
    TORCH_CHECK(false, "unknown kernel path '", name, "' (scalar, avx2, avx512 or auto)");
}

// The fastest path that runs here, unless BATON_QKERNELS names another (read once).
Path default_path() {
    static const Path path = [] {
        const char* env = std::getenv("BATON_QKERNELS");
        if (env != nullptr && *env != 0 && std::string(env) != "auto") return parse_path(env);
        return cpu_has_avx512() ? kAvx512 : cpu_has_avx2() ? kAvx2 : kScalar;
    }();
    return path;
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

void check_blocks(const at::Tensor& w, const char* what, int64_t row_bytes) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.is_cpu(),
                what, " must be a contiguous 2-D uint8 CPU tensor, got ", w.sizes(), " ",
                w.scalar_type());
    TORCH_CHECK(w.size(1) == row_bytes, what, ": rows hold ", w.size(1),
                " bytes, the activations' blocks need ", row_bytes);
}

// The activations quantized into thread-local scratch (a decode step allocates nothing), the
// scales transposed to [nb, m]; the SIMD quantizer does the scalar one's operations.
struct Codes {
    std::vector<int16_t> q;
    std::vector<float> d, s;
};

Codes& quantize_scratch(const at::Tensor& x, bool simd) {
    thread_local Codes c;
    const int64_t m = x.size(0), nb = x.size(1) / QK;
    c.q.resize(static_cast<size_t>(m * nb * QK));
    c.d.resize(static_cast<size_t>(m * nb));
    c.s.resize(static_cast<size_t>(m * nb));
    (simd ? quantize_rows_avx2 : quantize_rows_scalar)(x.data_ptr<float>(), m, nb, c.q.data(),
                                                       c.d.data(), c.s.data(), 1, m);
    return c;
}

at::Tensor pack_tiles(const at::Tensor& w, int64_t kind) {
    const int64_t bb = block_bytes(kind);
    TORCH_CHECK(w.dim() == 2 && w.size(1) % bb == 0, "weight blocks [n, nb * ", bb,
                "] expected, got ", w.sizes());
    check_blocks(w, "weight blocks", w.size(1));
    const int64_t n = w.size(0), nb = w.size(1) / bb;
    const int64_t num_tiles = (n + kTileCols - 1) / kTileCols, step = kTileCols * bb;
    at::Tensor out = at::zeros({num_tiles, nb * step}, w.options());
    const uint8_t* src = w.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    const int64_t qs = kind == kQ4_1 ? 4 : 2, codes = kind == kQ4_1 ? 64 : 32;
    const int64_t num_vectors = kind == kQ8_0 ? 8 : 4;
    for (int64_t c = 0; c < n; ++c) {
        const int64_t j = c % kTileCols;
        uint8_t* tile = dst + c / kTileCols * nb * step;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = src + c * w.size(1) + b * bb;
            uint8_t* t = tile + b * step;
            std::memcpy(t + 2 * j, blk, 2);
            if (kind == kQ4_1) std::memcpy(t + 32 + 2 * j, blk + 2, 2);
            for (int64_t u = 0; u < num_vectors; ++u)
                std::memcpy(t + codes + 64 * u + 4 * j, blk + qs + 4 * u, 4);
        }
    }
    return out;
}

at::Tensor qgemm_tiles(const at::Tensor& x, const at::Tensor& tiles, int64_t kind, int64_t n) {
    check_activations(x);
    TORCH_CHECK(cpu_has_avx512(), "tiled weights need the avx512 kernel path, which does not "
                "run on this CPU (or its OS does not enable it)");
    const int64_t bb = block_bytes(kind);
    const int64_t m = x.size(0), nb = x.size(1) / QK;
    const int64_t num_tiles = (n + kTileCols - 1) / kTileCols;
    check_blocks(tiles, "weight tiles", nb * kTileCols * bb);
    TORCH_CHECK(n > 0 && tiles.size(0) == num_tiles, "weight tiles: ", tiles.size(0), " tiles, ",
                n, " rows need ", num_tiles);
    Codes& c = quantize_scratch(x, true);
    thread_local std::vector<uint8_t> xb;
    thread_local std::vector<int32_t> corr;
    xb.resize(static_cast<size_t>(m * nb * 64));
    corr.resize(static_cast<size_t>(m * nb));
    split_codes_avx512(c.q.data(), m, nb, xb.data(), corr.data());
    const QActBytes a{xb.data(), corr.data(), c.d.data(), c.s.data(), m, nb};
    const QTiles wt{tiles.data_ptr<uint8_t>(), tiles.size(1), n};
    at::Tensor y = at::empty({m, n}, x.options());
    float* out = y.data_ptr<float>();
    // Tiles are independent: any split gives the same values.
    at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
        tiles_avx512(wt, kind, a, begin, end, out);
    });
    return y;
}

// Row-major blocks through `path`; the avx512 path tiles them first (a copy: the weights of a
// model are tiled once, at load, QuantizedWeight).
at::Tensor qgemm_impl(const at::Tensor& x, const at::Tensor& w, int64_t kind, Path path) {
    check_activations(x);
    const int64_t bb = block_bytes(kind);
    const int64_t m = x.size(0), nb = x.size(1) / QK;
    check_blocks(w, "weight blocks", nb * bb);
    const int64_t n = w.size(0);
    if (path == kAvx512) return qgemm_tiles(x, pack_tiles(w, kind), kind, n);
    Codes& c = quantize_scratch(x, path != kScalar);
    at::Tensor y = at::empty({m, n}, x.options());
    float* out = y.data_ptr<float>();
    const QW wq{w.data_ptr<uint8_t>(), nb * bb, n};
    const bool interleaved = path == kAvx2 && kind != kQ8_0;
    if (interleaved) interleave_codes_avx2(c.q.data(), m * nb);
    const QAct a{c.q.data(), c.d.data(), c.s.data(), m, nb, interleaved};
    auto columns = path == kAvx2 ? columns_avx2 : columns_scalar;
    // Columns are independent: any split gives the same values. Chunks of whole 8-column
    // groups (at least two), so only the last chunk has columns left over from a tile width.
    const int64_t groups = (n + kLanes - 1) / kLanes;
    at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
        columns(wq, kind, a, begin * kLanes, std::min(n, end * kLanes), out);
    });
    return y;
}

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& w, int64_t kind) {
    return qgemm_impl(x, w, kind, default_path());
}

at::Tensor qgemm_scalar(const at::Tensor& x, const at::Tensor& w, int64_t kind) {
    return qgemm_impl(x, w, kind, kScalar);
}

at::Tensor qgemm_path(const at::Tensor& x, const at::Tensor& w, int64_t kind,
                      const std::string& path) {
    return qgemm_impl(x, w, kind, path == "auto" ? default_path() : parse_path(path));
}

bool has_avx2() { return cpu_has_avx2(); }

std::vector<std::string> kernel_paths() {
    std::vector<std::string> out;
    for (int p = kScalar; p <= kAvx512; ++p)
        if (path_runs(static_cast<Path>(p))) out.emplace_back(kPathNames[p]);
    return out;
}

std::string kernel_path() { return kPathNames[default_path()]; }

}  // namespace baton_q

TORCH_LIBRARY(baton_q, m) {
    m.def("qgemm(Tensor x, Tensor w, int kind) -> Tensor", &baton_q::qgemm);
    m.def("qgemm_scalar(Tensor x, Tensor w, int kind) -> Tensor", &baton_q::qgemm_scalar);
    m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)", &baton_q::quantize_activations);
    m.def("qgemm_path(Tensor x, Tensor w, int kind, str path) -> Tensor", &baton_q::qgemm_path);
    m.def("pack_tiles(Tensor w, int kind) -> Tensor", &baton_q::pack_tiles);
    m.def("qgemm_tiles(Tensor x, Tensor tiles, int kind, int n) -> Tensor", &baton_q::qgemm_tiles);
    m.def("has_avx2() -> bool", &baton_q::has_avx2);
    m.def("kernel_paths() -> str[]", &baton_q::kernel_paths);
    m.def("kernel_path() -> str", &baton_q::kernel_path);
}

PYBIND11_MODULE(_qkernels, m) {
    m.doc() = "Registers the torch ops torch.ops.baton_q.* (quantized GEMV over GGUF blocks).";
}
