// Decode attention of one layer as one op (baton/model/backends/cpu_fused.py says why): for n
// sequences with one new token each, RoPE on the token's query and key heads, its key and value
// written into the sequence's dense decode row, and attention of each query head over the row.
// Every output value depends only on its own sequence's row and token (never on the batch or
// the thread split), so a disaggregated deployment decodes what a co-located one does.
//
// A torch op (TORCH_LIBRARY) threaded with at::parallel_for, so it runs on torch's own
// intra-op pool; the module is a Python extension only so that importing it registers the op.
// Built for plain x86-64: the inner loops have AVX2 clones chosen at load time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace baton_decode {

// Inner loops of the portable paths, inlined into their callers (RMSNorm's row is compiled for
// AVX2+FMA and for plain x86-64 by GCC's target_clones; the attention has an AVX2 twin below).
// `KV` is the decode rows' element type (float, or c10::BFloat16 under --kv-cache-dtype
// bfloat16): read as float, so the arithmetic is the float rows' over the rounded values.
template <typename KV>
__attribute__((always_inline)) inline float dot(const float* __restrict a,
                                                const KV* __restrict b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; ++l) acc[l] += a[j + l] * static_cast<float>(b[j + l]);
    float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; j < n; ++j) s += a[j] * static_cast<float>(b[j]);
    return s;
}

__attribute__((always_inline)) inline float sum_sq(const float* x, int64_t n) { return dot(x, x, n); }

__attribute__((target_clones("avx2,fma", "default")))
float sum(const float* x, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; ++l) acc[l] += x[j + l];
    float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; j < n; ++j) s += x[j];
    return s;
}

template <typename KV>
__attribute__((always_inline)) inline void axpy(float* __restrict y, float a,
                                                const KV* __restrict x, int64_t n) {
    for (int64_t j = 0; j < n; ++j) y[j] += a * static_cast<float>(x[j]);
}

// exp(v), v clamped to [-87, 88] (softmax's arguments, after the max is taken off, are <= 0; SiLU's
// any): Cephes' single-precision polynomial, about 1 ulp.
inline float exp_poly(float v) {
    v = v < -87.0f ? -87.0f : v > 88.0f ? 88.0f : v;
    const float k = std::floor(v * 1.44269504088896341f + 0.5f);
    v = v - k * 0.693359375f;
    v = v - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * v + 1.3981999507e-3f;
    p = p * v + 8.3334519073e-3f;
    p = p * v + 4.1665795894e-2f;
    p = p * v + 1.6666665459e-1f;
    p = p * v + 5.0000001201e-1f;
    p = p * v * v + v + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    return p * __builtin_bit_cast(float, bits);
}

// The same operations eight lanes at a time (no FMA: the scalar tail stays identical).
__attribute__((target("avx2"))) inline __m256 exp8(__m256 v) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f),
                 log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f),
                 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f),
                 one = _mm256_set1_ps(1.0f);
    const float coef[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    v = _mm256_blendv_ps(v, lo, _mm256_cmp_ps(v, lo, _CMP_LT_OQ));
    v = _mm256_blendv_ps(v, hi, _mm256_cmp_ps(v, hi, _CMP_GT_OQ));
    const __m256 k = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(v, log2e), half));
    v = _mm256_sub_ps(v, _mm256_mul_ps(k, c1));
    v = _mm256_sub_ps(v, _mm256_mul_ps(k, c2));
    __m256 p = _mm256_set1_ps(coef[0]);
    for (int c = 1; c < 6; ++c) p = _mm256_add_ps(_mm256_mul_ps(p, v), _mm256_set1_ps(coef[c]));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, v), v), v), one);
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2")))
int64_t exp_shifted_avx2(float* x, float shift, int64_t n) {
    const __m256 sh = _mm256_set1_ps(shift);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(x + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), sh)));
    return j;
}

// y[j] = silu(g[j]) * u[j] = g[j] / (1 + exp(-g[j])) * u[j]; returns how many it did.
__attribute__((target("avx2")))
int64_t silu_mul_avx2(const float* g, const float* u, float* y, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 e = exp8(_mm256_sub_ps(zero, gv));
        _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                              _mm256_loadu_ps(u + j)));
    }
    return j;
}

const bool kAvx2 = __builtin_cpu_supports("avx2");

// x[j] = exp(x[j] - shift); returns their sum.
float exp_shifted(float* x, float shift, int64_t n) {
    int64_t j = kAvx2 ? exp_shifted_avx2(x, shift, n) : 0;
    for (; j < n; ++j) x[j] = exp_poly(x[j] - shift);
    return sum(x, n);
}

void silu_mul_row(const float* g, const float* u, float* y, int64_t n) {
    int64_t j = kAvx2 ? silu_mul_avx2(g, u, y, n) : 0;
    for (; j < n; ++j) y[j] = g[j] / (1.0f + exp_poly(0.0f - g[j])) * u[j];
}

// RMSNorm of one row as transformers computes it, (x * (1 / sqrt(mean(x^2) + eps))) * w, with
// one fixed summation order.
__attribute__((target_clones("avx2,fma", "default")))
void rms_row(const float* x, const float* w, float eps, int64_t n, float* y) {
    const float r = 1.0f / std::sqrt(sum_sq(x, n) / static_cast<float>(n) + eps);
    for (int64_t j = 0; j < n; ++j) y[j] = x[j] * r * w[j];
}

__attribute__((target_clones("avx2,fma", "default")))
void add_row(const float* a, const float* b, int64_t n, float* y) {
    for (int64_t j = 0; j < n; ++j) y[j] = a[j] + b[j];
}

// out = x * cos + rotate_half(x) * sin, with rotate_half's sign folded into `signed_sin`.
void rope(float* out, const float* x, const float* cos, const float* ssin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cos[j] + x[j + half] * ssin[j];
    for (int64_t j = half; j < d; ++j) out[j] = x[j] * cos[j] + x[j - half] * ssin[j];
}

// Where one sequence's keys and values of one layer and KV head lie: token t's key at
// base + table[t / block] * block_stride + (t % block) * token_stride, its value kv_stride
// further on. The block pool is [blocks, L, 2, B, Hkv, D] (table: the sequence's block table,
// block: B); a dense decode row is the same with one block as long as the row (table: its row).
template <typename KV>
struct KVSpan {
    KV* base;  // layer and head applied
    const int64_t* table;
    int64_t block, block_stride, token_stride, kv_stride;

    KV* key(int64_t t) const {
        return base + table[t / block] * block_stride + (t % block) * token_stride;
    }
};

// One query head over its span's keys and values 0..len-1: out = softmax(q . k * scale) v.
// Portable path (any CPU, any head size). Keys are visited block by block in token order: the
// scores, their softmax and the value sum are those of one dense run, wherever the keys lie.
template <typename KV>
void head_attention_scalar(const float* q, const KVSpan<KV>& s, int64_t len, int64_t d,
                           float scale, float* scores, float* out) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < len; ++t) {
        scores[t] = dot(q, s.key(t), d) * scale;
        mx = std::max(mx, scores[t]);
    }
    const float total = exp_shifted(scores, mx, len);
    std::fill(out, out + d, 0.0f);
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < len; ++t) axpy(out, scores[t] * inv, s.key(t) + s.kv_stride, d);
}

// dot's lane reduction, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), of one vector.
__attribute__((target("avx2"))) inline float reduce8(__m256 v) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, 1));
}

// Eight row values as floats: a load, or (bf16) the 16 bits widened into a float's top half,
// which is exactly static_cast<float>(c10::BFloat16).
__attribute__((target("avx2"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2"))) inline __m256 load8(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// q . k of one key, 8 lanes then reduce8: the same operations for every key, however they are
// grouped below.
template <int NV, typename KV>
__attribute__((target("avx2"))) inline float dot_avx2(const float* q, const KV* k) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t j = 0; j < 8 * NV; j += 8)
        a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(q + j), load8(k + j)));
    return reduce8(a);
}

// One layer of a KV store: sequence i's span of KV head h is
// {layer_base + h * head_stride, tables + i * table_stride, block, block_stride, ...}.
template <typename KV>
struct KVLayout {
    KV* layer_base;
    const int64_t* tables;
    int64_t table_stride, block, block_stride, token_stride, head_stride, kv_stride;

    KVSpan<KV> span(int64_t i, int64_t h) const {
        return {layer_base + h * head_stride, tables + i * table_stride, block, block_stride,
                token_stride, kv_stride};
    }
};

// Asks for the cache lines of [p, p + bytes) ahead of their use.
inline void prefetch(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// How many tokens ahead a dense row's keys and values are asked for (16-128 measured: 32 best,
// a one-thread decode step's attention ~10% faster at 256 tokens with the weights streaming
// through the caches between layers).
constexpr int64_t kRowAhead = 32;

// Query heads h0..h1-1 of sequence i (queries q [h1 - h0, d], KV head h / group each), the
// same operations as the portable path, lane for lane, for head sizes 8 * NV (a template
// argument, so that an output row stays in NV registers while the values stream by). Block by
// block, four tokens at a time, every head of the range takes its keys: in the pool a token's
// heads lie side by side, so the pass walks each block's run of keys once, in address order.
// Per head the keys' dot products go four at a time within a block (four independent add
// chains), the softmax runs over its scores, and the value sum adds token after token, reading
// each value where it lies (the next block's keys and values were asked for during the key
// pass, so they are in the caches by then): a head's output does not depend on the blocks, the
// range or the thread split. (The values used to be copied into a zeroed dense scratch row
// first. Without that copy one layer over a pool still takes 1.1-1.26x its time over dense
// rows here, one thread, batch 1-32 x 256-1000 tokens, down from 1.3-1.5x: the blocks' 24 KB
// runs lie far apart; but a whole decode step over the pool is no slower than over rows,
// which it spares their upkeep: README, bench/decode_attention_bench.py --skip-eager.)
template <int NV, typename KV>
__attribute__((target("avx2"))) void heads_attention_avx2(
        const float* __restrict q, const KVLayout<KV>& kv, int64_t i, int64_t h0, int64_t h1,
        int64_t group, int64_t len, float scale, float* __restrict scores,
        float* __restrict mx, float* __restrict out) {
    constexpr int64_t d = 8 * NV, nv = NV;
    const int64_t nh = h1 - h0, ts = kv.token_stride, block = kv.block;
    const int64_t* table = kv.tables + i * kv.table_stride;
    const int64_t kv_lo = h0 / group, num_kv = (h1 - 1) / group - kv_lo + 1;
    // Each head's offset inside a block, and a block's start: no division in the loops.
    std::vector<int64_t> head_off(nh);
    for (int64_t hh = 0; hh < nh; ++hh) head_off[hh] = ((h0 + hh) / group) * kv.head_stride;
    auto block_start = [&](int64_t b) { return kv.layer_base + table[b] * kv.block_stride; };
    const int64_t run = 4 * ts * static_cast<int64_t>(sizeof(KV));  // four tokens' heads
    const bool paged = block < len;  // more than one block: a pool
    for (int64_t hh = 0; hh < nh; ++hh) mx[hh] = -INFINITY;
    for (int64_t b = 0, b0 = 0; b0 < len; ++b, b0 += block) {
        const int64_t m = std::min(block, len - b0);
        const KV* blk = block_start(b);
        // Blocks lie anywhere in the pool: no hardware prefetcher follows them, so the next
        // block's keys and values are asked for while this one is computed.
        const KV* next = b0 + block < len ? block_start(b + 1) : nullptr;
        int64_t t = 0;
        for (; t + 4 <= m; t += 4) {  // four tokens at a time, every head: one pass over them
            if (next != nullptr) {
                prefetch(next + t * ts, run);
                prefetch(next + kv.kv_stride + t * ts, run);
            } else if (!paged) {
                // A dense row: each KV head's keys a few tokens ahead, and its values (read
                // by the value sum below), so that the row streams in at the memory's pace.
                for (int64_t h = kv_lo; h < kv_lo + num_kv; ++h) {
                    const KV* k = blk + h * kv.head_stride + t * ts;
                    if (t + kRowAhead < m) prefetch(k + kRowAhead * ts, run);
                    prefetch(k + kv.kv_stride + kRowAhead * ts, run);
                }
            }
            for (int64_t hh = 0; hh < nh; ++hh) {
                const KV* k = blk + head_off[hh] + t * ts;
                const float* qh = q + hh * d;
                float* sc = scores + hh * len + b0;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t j = 0; j < d; j += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + j);
                    a0 = _mm256_add_ps(a0, _mm256_mul_ps(qv, load8(k + j)));
                    a1 = _mm256_add_ps(a1, _mm256_mul_ps(qv, load8(k + ts + j)));
                    a2 = _mm256_add_ps(a2, _mm256_mul_ps(qv, load8(k + 2 * ts + j)));
                    a3 = _mm256_add_ps(a3, _mm256_mul_ps(qv, load8(k + 3 * ts + j)));
                }
                const float s0 = reduce8(a0) * scale, s1 = reduce8(a1) * scale,
                            s2 = reduce8(a2) * scale, s3 = reduce8(a3) * scale;
                sc[t] = s0;
                sc[t + 1] = s1;
                sc[t + 2] = s2;
                sc[t + 3] = s3;
                mx[hh] = std::max(std::max(std::max(mx[hh], s0), s1), std::max(s2, s3));
            }
        }
        for (; t < m; ++t) {
            for (int64_t hh = 0; hh < nh; ++hh) {
                const float s0 = dot_avx2<NV>(q + hh * d, blk + head_off[hh] + t * ts) * scale;
                scores[hh * len + b0 + t] = s0;
                mx[hh] = std::max(mx[hh], s0);
            }
        }
    }
    // The value sum, token after token, each head's output row in registers, block by block
    // (a dense row: one block).
    for (int64_t hh = 0; hh < nh; ++hh) {
        const float inv = 1.0f / exp_shifted(scores + hh * len, mx[hh], len);
        const float* sc = scores + hh * len;
        __m256 o[NV];
        for (int64_t l = 0; l < nv; ++l) o[l] = _mm256_setzero_ps();
        for (int64_t b = 0, b0 = 0; b0 < len; ++b, b0 += block) {
            const int64_t m = std::min(block, len - b0);
            const KV* vals = block_start(b) + kv.kv_stride + head_off[hh];
            for (int64_t t = 0; t < m; ++t) {
                const __m256 w = _mm256_set1_ps(sc[b0 + t] * inv);
                const KV* v = vals + t * ts;
                for (int64_t l = 0; l < nv; ++l)
                    o[l] = _mm256_add_ps(o[l], _mm256_mul_ps(w, load8(v + 8 * l)));
            }
        }
        for (int64_t l = 0; l < nv; ++l) _mm256_storeu_ps(out + hh * d + 8 * l, o[l]);
    }
}

template <typename KV>
void heads_attention(const float* q, const KVLayout<KV>& kv, int64_t i, int64_t h0, int64_t h1,
                     int64_t group, int64_t len, int64_t d, float scale, float* scores,
                     float* mx, float* out) {
    if (kAvx2 && d == 64)
        return heads_attention_avx2<8>(q, kv, i, h0, h1, group, len, scale, scores, mx, out);
    if (kAvx2 && d == 128)
        return heads_attention_avx2<16>(q, kv, i, h0, h1, group, len, scale, scores, mx, out);
    if (kAvx2 && d == 32)
        return heads_attention_avx2<4>(q, kv, i, h0, h1, group, len, scale, scores, mx, out);
    for (int64_t h = h0; h < h1; ++h)
        head_attention_scalar(q + (h - h0) * d, kv.span(i, h / group), len, d, scale, scores,
                              out + (h - h0) * d);
}

// A new key or value into its row: rounded to nearest even for bf16, as torch's .to() rounds
// (the eager path and the prefill path round the same token identically).
inline void store_row(float* dst, const float* src, int64_t d) { std::copy(src, src + d, dst); }
inline void store_row(c10::BFloat16* dst, const float* src, int64_t d) {
    for (int64_t j = 0; j < d; ++j) dst[j] = c10::BFloat16(src[j]);
}

// The op's body over a store of element type KV (its arguments are checked by the callers):
// RoPE, the new K/V at position pp[i] of sequence i's span, attention of each query head.
template <typename KV>
void decode_body(const float* qp, const float* cp, const float* sp, const KVLayout<KV>& kv,
                 float* op, const int64_t* pp, int64_t n, int64_t d, int64_t num_heads,
                 int64_t num_kv_heads, int64_t width) {
    const bool rotate = cp != nullptr;
    const int64_t group = num_heads / num_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    // The new keys and values first (every query head of the group reads them), then one task
    // per sequence, or per slice of its query heads when there are fewer sequences than
    // threads (batch 1 on two threads: two tasks of 4 and 5 SmolLM2 heads).
    std::vector<float> rotated(d);
    for (int64_t i = 0; i < n; ++i) {
        const float* x = qp + i * width;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            KV* key = kv.span(i, h).key(pp[i]);
            const float* k = x + (num_heads + h) * d;
            if (rotate) {
                rope(rotated.data(), k, cp + i * d, sp + i * d, d);
                k = rotated.data();
            }
            store_row(key, k, d);
            store_row(key + kv.kv_stride, x + (num_heads + num_kv_heads + h) * d, d);
        }
    }
    const int64_t threads = at::get_num_threads();
    const int64_t slices = std::min(num_heads, std::max<int64_t>(1, (threads + n - 1) / n));
    const int64_t per = (num_heads + slices - 1) / slices;
    at::parallel_for(0, n * slices, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qr, scores, mx;
        for (int64_t task = begin; task < end; ++task) {
            const int64_t i = task / slices, h0 = (task % slices) * per;
            const int64_t h1 = std::min(num_heads, h0 + per), nh = h1 - h0;
            if (nh <= 0) continue;
            const float* x = qp + i * width;
            const int64_t len = pp[i] + 1;
            qr.resize(nh * d);
            for (int64_t h = h0; h < h1; ++h) {
                if (rotate) rope(qr.data() + (h - h0) * d, x + h * d, cp + i * d, sp + i * d, d);
                else std::copy(x + h * d, x + (h + 1) * d, qr.begin() + (h - h0) * d);
            }
            scores.resize(nh * len);
            mx.resize(nh);
            heads_attention(qr.data(), kv, i, h0, h1, group, len, d, scale, scores.data(),
                            mx.data(), op + i * num_heads * d + h0 * d);
        }
    });
}

// The arguments both ops share: the projection, the rotation, the heads.
struct Step {
    int64_t n, d;
    const float *qp, *cp, *sp;
};

Step check_step(const at::Tensor& qkv, const c10::optional<at::Tensor>& cos_opt,
                const c10::optional<at::Tensor>& ssin_opt, int64_t d, int64_t num_heads,
                int64_t num_kv_heads, int64_t store_kv_heads) {
    TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(), "qkv");
    const int64_t n = qkv.size(0);
    TORCH_CHECK(num_kv_heads > 0 && store_kv_heads == num_kv_heads && num_heads % num_kv_heads == 0,
                "heads");
    TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "qkv width");
    const bool rotate = cos_opt.has_value();
    TORCH_CHECK(rotate == ssin_opt.has_value(), "cos and sin come together");
    Step step{n, d, qkv.data_ptr<float>(), nullptr, nullptr};
    if (rotate) {
        const at::Tensor &cos = *cos_opt, &ssin = *ssin_opt;
        TORCH_CHECK(cos.sizes() == at::IntArrayRef({n, d}) && ssin.sizes() == cos.sizes() &&
                    cos.is_contiguous() && ssin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                    ssin.scalar_type() == at::kFloat, "cos/sin");
        step.cp = cos.data_ptr<float>();
        step.sp = ssin.data_ptr<float>();
    }
    return step;
}

template <typename KV>
KVLayout<KV> layout_of(const at::Tensor& store, int64_t layer_offset, const int64_t* tables,
                       int64_t table_stride, int64_t block, int64_t block_stride,
                       int64_t token_stride, int64_t head_stride, int64_t kv_stride) {
    return {store.data_ptr<KV>() + layer_offset, tables, table_stride, block, block_stride,
            token_stride, head_stride, kv_stride};
}

template <typename... Args>
at::Tensor run_body(const at::Tensor& qkv, const Step& st, const at::Tensor& store,
                    const int64_t* pp, int64_t num_heads, int64_t num_kv_heads, Args... layout) {
    auto out = at::empty({st.n, num_heads * st.d}, qkv.options());
    if (store.scalar_type() == at::kBFloat16)
        decode_body(st.qp, st.cp, st.sp, layout_of<c10::BFloat16>(store, layout...),
                    out.data_ptr<float>(), pp, st.n, st.d, num_heads, num_kv_heads, qkv.size(1));
    else
        decode_body(st.qp, st.cp, st.sp, layout_of<float>(store, layout...),
                    out.data_ptr<float>(), pp, st.n, st.d, num_heads, num_kv_heads, qkv.size(1));
    return out;
}

void check_store(const at::Tensor& store, const char* name) {
    TORCH_CHECK(store.dim() == 6 && store.is_contiguous() && store.is_cpu() &&
                (store.scalar_type() == at::kFloat || store.scalar_type() == at::kBFloat16),
                name, " must be a contiguous 6-D float32 or bfloat16 CPU tensor, got ",
                store.sizes(), " ", store.scalar_type());
}

// One decode step of one layer's attention for n sequences with one new token each over their
// dense decode rows ws [L, 2, rows, Hkv, capacity, D]: RoPE on the new token's query and key
// heads, the key and value written into row rows[i] at its position, attention of each query
// head over the row's keys 0..pos.
at::Tensor decode_attention(const at::Tensor& qkv, const c10::optional<at::Tensor>& cos_opt,
                            const c10::optional<at::Tensor>& ssin_opt,
                            at::Tensor ws, int64_t layer, const at::Tensor& rows,
                            const at::Tensor& pos, int64_t num_heads, int64_t num_kv_heads) {
    check_store(ws, "ws");
    const int64_t d = ws.size(5), cap = ws.size(4), num_rows = ws.size(2), hkv = ws.size(3);
    const Step st = check_step(qkv, cos_opt, ssin_opt, d, num_heads, num_kv_heads, hkv);
    TORCH_CHECK(layer >= 0 && layer < ws.size(0), "layer");
    TORCH_CHECK(rows.numel() == st.n && pos.numel() == st.n && rows.scalar_type() == at::kLong &&
                pos.scalar_type() == at::kLong, "rows/pos");
    auto rows_c = rows.contiguous(), pos_c = pos.contiguous();
    const int64_t* rp = rows_c.data_ptr<int64_t>();
    const int64_t* pp = pos_c.data_ptr<int64_t>();
    for (int64_t i = 0; i < st.n; ++i)
        TORCH_CHECK(rp[i] >= 0 && rp[i] < num_rows && pp[i] >= 0 && pp[i] < cap,
                    "row/position out of range");
    const int64_t head = cap * d, row = hkv * head, kv = num_rows * row;
    // One block per row, as long as the row: table = the row, block_stride = a row.
    return run_body(qkv, st, ws, pp, num_heads, num_kv_heads, layer * 2 * kv, rp, int64_t{1},
                    cap, row, d, head, kv);
}

// The same step over the block pool [num_blocks, L, 2, B, Hkv, D] itself: sequence i's token
// t lies in block block_tables[i, t / B] at offset t % B; the new key and value go to position
// pos[i] there, and each query head attends over tokens 0..pos[i] block by block.
at::Tensor decode_attention_paged(const at::Tensor& qkv, const c10::optional<at::Tensor>& cos_opt,
                                  const c10::optional<at::Tensor>& ssin_opt, at::Tensor pool,
                                  int64_t layer, const at::Tensor& block_tables,
                                  const at::Tensor& pos, int64_t num_heads, int64_t num_kv_heads) {
    check_store(pool, "pool");
    const int64_t num_blocks = pool.size(0), num_layers = pool.size(1), bs = pool.size(3),
                  hkv = pool.size(4), d = pool.size(5);
    const Step st = check_step(qkv, cos_opt, ssin_opt, d, num_heads, num_kv_heads, hkv);
    TORCH_CHECK(layer >= 0 && layer < num_layers, "layer ", layer, " of ", num_layers);
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == st.n &&
                block_tables.scalar_type() == at::kLong && pos.numel() == st.n &&
                pos.scalar_type() == at::kLong, "block_tables [n, max_blocks] / pos [n] int64");
    auto tables_c = block_tables.contiguous(), pos_c = pos.contiguous();
    const int64_t* tp = tables_c.data_ptr<int64_t>();
    const int64_t* pp = pos_c.data_ptr<int64_t>();
    const int64_t width = tables_c.size(1);
    for (int64_t i = 0; i < st.n; ++i) {
        TORCH_CHECK(pp[i] >= 0 && pp[i] < width * bs, "position ", pp[i], " of sequence ", i,
                    " out of range of its ", width, " blocks of ", bs);
        // Block 0 is the null block: a table that reaches it would read zeros as keys.
        for (int64_t b = 0; b <= pp[i] / bs; ++b)
            TORCH_CHECK(tp[i * width + b] >= 1 && tp[i * width + b] < num_blocks, "block ",
                        tp[i * width + b], " (sequence ", i, ", entry ", b,
                        ") out of range 1..", num_blocks - 1);
    }
    const int64_t token = hkv * d, kv = bs * token, block = num_layers * 2 * kv;
    return run_body(qkv, st, pool, pp, num_heads, num_kv_heads, layer * 2 * kv, tp, width, bs,
                    block, token, d, kv);
}

void check_rows(const at::Tensor& x, const char* name) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.is_cpu(),
                name, " must be a contiguous 2-D float32 CPU tensor, got ", x.sizes(), " ",
                x.scalar_type());
}

// Rows are independent: any split over threads gives the same values.
constexpr int64_t kRowGrain = 8;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
    check_rows(x, "x");
    const int64_t m = x.size(0), n = x.size(1);
    TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.scalar_type() == at::kFloat && w.is_cpu() &&
                w.is_contiguous(), "weight must be float32 [", n, "], got ", w.sizes());
    auto y = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, m, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) rms_row(xp + r * n, wp, static_cast<float>(eps), n, yp + r * n);
    });
    return y;
}

// (x + r, rms_norm(x + r)): the residual add and the next norm in one call.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps) {
    check_rows(x, "x");
    check_rows(r, "residual");
    TORCH_CHECK(r.sizes() == x.sizes(), "residual ", r.sizes(), " must match x ", x.sizes());
    const int64_t m = x.size(0), n = x.size(1);
    TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.scalar_type() == at::kFloat && w.is_cpu() &&
                w.is_contiguous(), "weight must be float32 [", n, "], got ", w.sizes());
    auto s = at::empty_like(x), y = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *rp = r.data_ptr<float>(), *wp = w.data_ptr<float>();
    float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>();
    at::parallel_for(0, m, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            add_row(xp + i * n, rp + i * n, n, sp + i * n);
            rms_row(sp + i * n, wp, static_cast<float>(eps), n, yp + i * n);
        }
    });
    return {s, y};
}

// silu(gate) * up of a fused gate|up projection [M, 2I]: [M, I].
at::Tensor silu_mul(const at::Tensor& gu) {
    check_rows(gu, "gate_up");
    TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up width must be even, got ", gu.size(1));
    const int64_t m = gu.size(0), n = gu.size(1) / 2;
    auto y = at::empty({m, n}, gu.options());
    const float* gp = gu.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, m, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * 2 * n, gp + r * 2 * n + n, yp + r * n, n);
    });
    return y;
}

}  // namespace baton_decode

TORCH_LIBRARY(baton_decode, m) {
    m.def("decode_attention(Tensor qkv, Tensor? cos, Tensor? ssin, Tensor(a!) ws, int layer, Tensor rows, Tensor pos, int num_heads, int num_kv_heads) -> Tensor",
          &baton_decode::decode_attention);
    m.def("decode_attention_paged(Tensor qkv, Tensor? cos, Tensor? ssin, Tensor(a!) pool, int layer, Tensor block_tables, Tensor pos, int num_heads, int num_kv_heads) -> Tensor",
          &baton_decode::decode_attention_paged);
    m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &baton_decode::rms_norm);
    m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)",
          &baton_decode::add_rms_norm);
    m.def("silu_mul(Tensor gate_up) -> Tensor", &baton_decode::silu_mul);
}

PYBIND11_MODULE(_decode_ops, m) { m.doc() = "registers torch.ops.baton_decode"; }
