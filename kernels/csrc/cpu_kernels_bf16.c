/* Native CPU kernels for bfloat16 tensors with float32 accumulation: the paged decode
 * attention and the LoRA segments of cpu_kernels.c, reading bf16 K/V caches, queries,
 * activations and LoRA weights, writing bf16 outputs.
 *
 * Two implementations of each, chosen per call by `impl` (see loraplex_bf16_impls):
 *   BF16_PORTABLE: every bf16 value widened to float32 (a 16-bit shift) and multiplied
 *                  with float32 FMAs; any CPU, whatever the compiler vectorises to.
 *   BF16_AVX512:   AVX-512 BF16 dot products (vdpbf16ps: each fp32 lane gets the sum of
 *                  two bf16 x bf16 products, exact, added in fp32); compiled only when the
 *                  compiler targets a CPU with avx512_bf16 (-march=native on one).
 * Both round what the PyTorch reference rounds to bf16 (the LoRA shrink's output, the
 * attention probabilities before the value product, the outputs), so they differ from
 * each other only in the order of fp32 additions.
 *
 * The vdpbf16ps operand wants pairs of consecutive bf16 values along the summed axis, so
 * the LoRA weights come pair-interleaved ("VNNI" layout, written by lora_slots.py):
 *   At: [ceil(in / 2), R, 2]   At[i2, k, j] = A^T[2 * i2 + j, k]   (zero past `in`)
 *   Bt: [R / 2, out, 2]        Bt[k2, o, j] = scaled B^T[2 * k2 + j, o]
 * and a V pass pairs two cached positions by interleaving their rows (unpacklo/hi), which
 * permutes the fp32 accumulator lanes; they are put back in order once per sequence.
 */
#include "common.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

typedef uint16_t bf16;

enum { BF16_PORTABLE = 0, BF16_AVX512 = 1 };

static inline float bf16_to_f32(bf16 h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even, as torch does; NaN stays a (quiet) NaN */
static inline bf16 f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

/* Bit i set: implementation i is compiled into this library. */
int loraplex_bf16_impls(void)
{
#ifdef __AVX512BF16__
    return (1 << BF16_PORTABLE) | (1 << BF16_AVX512);
#else
    return 1 << BF16_PORTABLE;
#endif
}

/* ---- decode attention ------------------------------------------------------------- */

/* One sequence, every head (the layout and passes of cpu_kernels.c's decode_one).
 * Scratch: scores [heads * len], acc and qf [heads * head_dim]. */
static inline __attribute__((always_inline)) void decode_one_portable(
    const bf16 *restrict q, int64_t q_head_stride,
    const bf16 *restrict k_cache, const bf16 *restrict v_cache, const int32_t *restrict table,
    int64_t len, int64_t kv_heads, int64_t group, const int64_t head_dim, int64_t block_size,
    float scale, float *restrict scores, float *restrict acc, float *restrict qf,
    bf16 *restrict o, int64_t o_head_stride)
{
    const int64_t heads = kv_heads * group;
    const int64_t pos_stride = kv_heads * head_dim;
    const int64_t block_stride = block_size * pos_stride;
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
            qf[h * head_dim + d] = bf16_to_f32(q[h * q_head_stride + d]);
    for (int64_t pos0 = 0; pos0 < len; pos0 += block_size) {
        const bf16 *restrict kb = k_cache + (int64_t)table[pos0 / block_size] * block_stride;
        const int64_t n = len - pos0 < block_size ? len - pos0 : block_size;
        for (int64_t p = 0; p < n; ++p)
            for (int64_t h = 0; h < heads; ++h) {
                const bf16 *restrict k = kb + p * pos_stride + (h / group) * head_dim;
                const float *restrict qh = qf + h * head_dim;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * bf16_to_f32(k[d]);
                scores[h * len + pos0 + p] = s * scale;
            }
    }
    softmax_rows(scores, heads, len);
    for (int64_t j = 0; j < heads * head_dim; ++j) acc[j] = 0.0f;
    for (int64_t pos0 = 0; pos0 < len; pos0 += block_size) {
        const bf16 *restrict vb = v_cache + (int64_t)table[pos0 / block_size] * block_stride;
        const int64_t n = len - pos0 < block_size ? len - pos0 : block_size;
        for (int64_t p = 0; p < n; ++p)
            for (int64_t h = 0; h < heads; ++h) {
                const bf16 *restrict v = vb + p * pos_stride + (h / group) * head_dim;
                /* the probability in bf16, as the reference's value product takes it */
                const float pr = bf16_to_f32(f32_to_bf16(scores[h * len + pos0 + p]));
                float *restrict a = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += pr * bf16_to_f32(v[d]);
            }
    }
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
            o[h * o_head_stride + d] = f32_to_bf16(acc[h * head_dim + d]);
}

#ifdef __AVX512BF16__
static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

/* two probabilities as one bf16 pair, broadcast to every lane */
static inline __m512bh prob_pair(float p0, float p1)
{
    return as_bh(_mm512_set1_epi32((int32_t)((uint32_t)f32_to_bf16(p1) << 16
                                             | f32_to_bf16(p0))));
}

/* acc[h*head_dim + 32c + (0..15)] += pair . lo, acc[... + 16 + (0..15)] += pair . hi, where
 * lo/hi interleave rows v0 and v1 (v1 NULL: zeros). Lane m of lo holds dimension
 * 32c + 8(m/4) + m%4, of hi 32c + 8(m/4) + 4 + m%4. */
static inline void value_pair(float *restrict a, const bf16 *restrict v0,
                              const bf16 *restrict v1, __m512bh pair, int64_t head_dim)
{
    for (int64_t d = 0; d < head_dim; d += 32) {
        const __m512i x0 = _mm512_loadu_si512(v0 + d);
        const __m512i x1 = v1 ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
        __m512 lo = _mm512_loadu_ps(a + d), hi = _mm512_loadu_ps(a + d + 16);
        lo = _mm512_dpbf16_ps(lo, pair, as_bh(_mm512_unpacklo_epi16(x0, x1)));
        hi = _mm512_dpbf16_ps(hi, pair, as_bh(_mm512_unpackhi_epi16(x0, x1)));
        _mm512_storeu_ps(a + d, lo);
        _mm512_storeu_ps(a + d + 16, hi);
    }
}

/* head_dim a multiple of 32. Scratch: scores [heads * len], acc [heads * head_dim]. */
static inline __attribute__((always_inline)) void decode_one_avx512(
    const bf16 *restrict q, int64_t q_head_stride,
    const bf16 *restrict k_cache, const bf16 *restrict v_cache, const int32_t *restrict table,
    int64_t len, int64_t kv_heads, int64_t group, const int64_t head_dim, int64_t block_size,
    float scale, float *restrict scores, float *restrict acc, bf16 *restrict o,
    int64_t o_head_stride)
{
    const int64_t heads = kv_heads * group;
    const int64_t pos_stride = kv_heads * head_dim;
    const int64_t block_stride = block_size * pos_stride;
    for (int64_t pos0 = 0; pos0 < len; pos0 += block_size) {
        const bf16 *restrict kb = k_cache + (int64_t)table[pos0 / block_size] * block_stride;
        const int64_t n = len - pos0 < block_size ? len - pos0 : block_size;
        int64_t p = 0;
        /* four positions at a time: four independent dot-product chains per head */
        for (; p + 4 <= n; p += 4)
            for (int64_t h = 0; h < heads; ++h) {
                const bf16 *restrict k0 = kb + p * pos_stride + (h / group) * head_dim;
                const bf16 *restrict qh = q + h * q_head_stride;
                __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
                for (int64_t d = 0; d < head_dim; d += 32) {
                    const __m512bh qv = as_bh(_mm512_loadu_si512(qh + d));
                    s0 = _mm512_dpbf16_ps(s0, qv, as_bh(_mm512_loadu_si512(k0 + d)));
                    s1 = _mm512_dpbf16_ps(s1, qv, as_bh(_mm512_loadu_si512(
                        k0 + pos_stride + d)));
                    s2 = _mm512_dpbf16_ps(s2, qv, as_bh(_mm512_loadu_si512(
                        k0 + 2 * pos_stride + d)));
                    s3 = _mm512_dpbf16_ps(s3, qv, as_bh(_mm512_loadu_si512(
                        k0 + 3 * pos_stride + d)));
                }
                float *restrict sh = scores + h * len + pos0 + p;
                sh[0] = _mm512_reduce_add_ps(s0) * scale;
                sh[1] = _mm512_reduce_add_ps(s1) * scale;
                sh[2] = _mm512_reduce_add_ps(s2) * scale;
                sh[3] = _mm512_reduce_add_ps(s3) * scale;
            }
        for (; p < n; ++p)
            for (int64_t h = 0; h < heads; ++h) {
                const bf16 *restrict k = kb + p * pos_stride + (h / group) * head_dim;
                const bf16 *restrict qh = q + h * q_head_stride;
                __m512 s = _mm512_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 32)
                    s = _mm512_dpbf16_ps(s, as_bh(_mm512_loadu_si512(qh + d)),
                                         as_bh(_mm512_loadu_si512(k + d)));
                scores[h * len + pos0 + p] = _mm512_reduce_add_ps(s) * scale;
            }
    }
    softmax_rows(scores, heads, len);
    for (int64_t j = 0; j < heads * head_dim; ++j) acc[j] = 0.0f;
    for (int64_t pos0 = 0; pos0 < len; pos0 += block_size) {
        const bf16 *restrict vb = v_cache + (int64_t)table[pos0 / block_size] * block_stride;
        const int64_t n = len - pos0 < block_size ? len - pos0 : block_size;
        int64_t p = 0;
        for (; p + 2 <= n; p += 2)
            for (int64_t h = 0; h < heads; ++h) {
                const bf16 *restrict v0 = vb + p * pos_stride + (h / group) * head_dim;
                const float *restrict sh = scores + h * len + pos0 + p;
                value_pair(acc + h * head_dim, v0, v0 + pos_stride, prob_pair(sh[0], sh[1]),
                           head_dim);
            }
        if (p < n) /* an odd last position, paired with zeros */
            for (int64_t h = 0; h < heads; ++h)
                value_pair(acc + h * head_dim, vb + p * pos_stride + (h / group) * head_dim,
                           NULL, prob_pair(scores[h * len + pos0 + p], 0.0f), head_dim);
    }
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < head_dim; d += 32)
            for (int64_t m = 0; m < 16; ++m) {
                const int64_t dim = d + 8 * (m / 4) + m % 4;
                o[h * o_head_stride + dim] = f32_to_bf16(acc[h * head_dim + d + m]);
                o[h * o_head_stride + dim + 4] = f32_to_bf16(acc[h * head_dim + d + 16 + m]);
            }
}
#endif

/* Like paged_decode_attention_f32, with bf16 query, caches and output; `impl` one of
 * loraplex_bf16_impls (BF16_AVX512 needs head_dim % 32 == 0, else the portable one runs).
 * Returns 0, -1 when scratch memory could not be allocated, -2 for an impl not compiled. */
int paged_decode_attention_bf16(
    const bf16 *query, int64_t q_row_stride, int64_t q_head_stride,
    const bf16 *k_cache, const bf16 *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens_all, const int64_t *seq_ids, const int64_t *rows,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale,
    bf16 *out, int64_t o_row_stride, int64_t o_head_stride, int num_threads, int impl)
{
    if (!(loraplex_bf16_impls() & (1 << impl))) return -2;
    const int vector = impl == BF16_AVX512 && head_dim % 32 == 0;
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_len = 1;
    for (int64_t i = 0; i < num_seqs; ++i)
        if (seq_lens_all[seq_ids[i]] > max_len) max_len = seq_lens_all[seq_ids[i]];
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_len));
        float *acc = malloc(sizeof(float) * (size_t)(2 * num_heads * head_dim));
        const int ok = scores && acc;
        /* every thread must reach the worksharing loop, even one without scratch */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_seqs; ++i) {
            if (!ok) {
                failed = 1;
                continue;
            }
            const int64_t seq = seq_ids[i], row = rows[i];
            const int32_t *table = block_tables + seq * table_stride;
            const bf16 *q = query + row * q_row_stride;
            bf16 *o = out + row * o_row_stride;
            const int64_t len = seq_lens_all[seq];
            float *qf = acc + num_heads * head_dim;
#ifdef __AVX512BF16__
            if (vector && head_dim == 64)
                decode_one_avx512(q, q_head_stride, k_cache, v_cache, table, len, num_kv_heads,
                                  group, 64, block_size, scale, scores, acc, o, o_head_stride);
            else if (vector)
                decode_one_avx512(q, q_head_stride, k_cache, v_cache, table, len, num_kv_heads,
                                  group, head_dim, block_size, scale, scores, acc, o,
                                  o_head_stride);
            else
#endif
            if (head_dim == 64)
                decode_one_portable(q, q_head_stride, k_cache, v_cache, table, len,
                                    num_kv_heads, group, 64, block_size, scale, scores, acc,
                                    qf, o, o_head_stride);
            else
                decode_one_portable(q, q_head_stride, k_cache, v_cache, table, len,
                                    num_kv_heads, group, head_dim, block_size, scale, scores,
                                    acc, qf, o, o_head_stride);
        }
        free(scores);
        free(acc);
    }
    (void)vector;
    return failed ? -1 : 0;
}

/* ---- LoRA segments ---------------------------------------------------------------- */

#define LORA_TOKENS 4

/* Up to 4 consecutive tokens of one slot (cpu_kernels.c's lora_tokens), weights in the
 * pair-interleaved layout. xb: the tokens' rows widened to fp32, zero-padded to 4 rows of
 * in2 * 2; y: [4, r], the shrink's output, rounded to bf16 values. */
static void lora_tokens_portable(const float *restrict xb, bf16 *restrict out,
                                 int64_t out_stride, int64_t nt, int64_t in2, int64_t n_out,
                                 const bf16 *restrict at, const bf16 *restrict bt, int64_t r,
                                 const int64_t *restrict slices, int64_t num_slices,
                                 float *restrict y)
{
    const int64_t w = 2 * in2;
    for (int64_t k0 = 0; k0 < r; k0 += 16) {
        float c[LORA_TOKENS][16] = {{0}};
        for (int64_t i2 = 0; i2 < in2; ++i2) {
            const bf16 *restrict a = at + (i2 * r + k0) * 2;
            for (int64_t t = 0; t < LORA_TOKENS; ++t) {
                const float xa = xb[t * w + 2 * i2], xc = xb[t * w + 2 * i2 + 1];
#pragma omp simd
                for (int64_t k = 0; k < 16; ++k)
                    c[t][k] += xa * bf16_to_f32(a[2 * k]) + xc * bf16_to_f32(a[2 * k + 1]);
            }
        }
        for (int64_t t = 0; t < LORA_TOKENS; ++t)
            for (int64_t k = 0; k < 16; ++k)
                y[t * r + k0 + k] = bf16_to_f32(f32_to_bf16(c[t][k]));
    }
    for (int64_t s = 0; s < num_slices; ++s) {
        /* the pairs holding the slice's ranks; a pair's other row is zero here */
        const int64_t k2b = slices[4 * s] / 2, k2e = (slices[4 * s + 1] + 1) / 2;
        const int64_t hi = slices[4 * s + 3];
        for (int64_t o0 = slices[4 * s + 2]; o0 < hi; o0 += 64) {
            const int64_t width = hi - o0 < 64 ? hi - o0 : 64;
            float c[LORA_TOKENS][64] = {{0}};
            for (int64_t k2 = k2b; k2 < k2e; ++k2) {
                const bf16 *restrict b = bt + (k2 * n_out + o0) * 2;
                for (int64_t t = 0; t < LORA_TOKENS; ++t) {
                    const float ya = y[t * r + 2 * k2], yc = y[t * r + 2 * k2 + 1];
#pragma omp simd
                    for (int64_t o = 0; o < width; ++o)
                        c[t][o] += ya * bf16_to_f32(b[2 * o]) + yc * bf16_to_f32(b[2 * o + 1]);
                }
            }
            for (int64_t t = 0; t < nt; ++t) {
                bf16 *restrict ot = out + t * out_stride + o0;
                for (int64_t o = 0; o < width; ++o)
                    ot[o] = f32_to_bf16(bf16_to_f32(ot[o]) + c[t][o]);
            }
        }
    }
}

#ifdef __AVX512BF16__
static inline __m512 load_bf16x16(const bf16 *p)
{
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512bh pair_at(const bf16 *p) /* p[0], p[1] broadcast */
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return as_bh(_mm512_set1_epi32(v));
}

/* The shrink of 4 tokens for ranks k0 .. k0 + 16 * nv (nv <= 4, a constant where it is
 * inlined): each pair-row of A^T's tile is one contiguous read of up to 256 bytes, and the
 * 4 x nv vectors of sums stay in registers. yb[t * r + k] = bf16(xb[t] . A^T[:, k]). */
static inline __attribute__((always_inline)) void shrink_ranks_avx512(
    const bf16 *restrict xb, int64_t in2, const bf16 *restrict at, int64_t r, int64_t k0,
    const int nv, bf16 *restrict yb)
{
    const int64_t w = 2 * in2;
    __m512 c[LORA_TOKENS][4];
#pragma GCC unroll 4
    for (int t = 0; t < LORA_TOKENS; ++t)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) c[t][j] = _mm512_setzero_ps();
    for (int64_t i2 = 0; i2 < in2; ++i2) {
        const bf16 *restrict a = at + (i2 * r + k0) * 2;
        __m512bh av[4];
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) av[j] = as_bh(_mm512_loadu_si512(a + 32 * j));
#pragma GCC unroll 4
        for (int t = 0; t < LORA_TOKENS; ++t) {
            const __m512bh xp = pair_at(xb + t * w + 2 * i2);
#pragma GCC unroll 4
            for (int j = 0; j < nv; ++j) c[t][j] = _mm512_dpbf16_ps(c[t][j], xp, av[j]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < LORA_TOKENS; ++t)
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j)
            _mm256_storeu_si256((__m256i *)(yb + t * r + k0 + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(c[t][j]));
}

/* The same with vdpbf16ps. xb: the tokens' bf16 rows, zero-padded to 4 rows of in2 * 2;
 * yb: [4, r] bf16. */
static void lora_tokens_avx512(const bf16 *restrict xb, bf16 *restrict out,
                               int64_t out_stride, int64_t nt, int64_t in2, int64_t n_out,
                               const bf16 *restrict at, const bf16 *restrict bt, int64_t r,
                               const int64_t *restrict slices, int64_t num_slices,
                               bf16 *restrict yb)
{
    int64_t k0 = 0;
    for (; k0 + 64 <= r; k0 += 64) shrink_ranks_avx512(xb, in2, at, r, k0, 4, yb);
    switch ((r - k0) / 16) { /* r is a multiple of 16 */
    case 3: shrink_ranks_avx512(xb, in2, at, r, k0, 3, yb); break;
    case 2: shrink_ranks_avx512(xb, in2, at, r, k0, 2, yb); break;
    case 1: shrink_ranks_avx512(xb, in2, at, r, k0, 1, yb); break;
    default: break;
    }
    for (int64_t s = 0; s < num_slices; ++s) {
        /* the pairs holding the slice's ranks; a pair's other row is zero here */
        const int64_t k2b = slices[4 * s] / 2, k2e = (slices[4 * s + 1] + 1) / 2;
        const int64_t lo = slices[4 * s + 2], hi = slices[4 * s + 3];
        int64_t o0 = lo;
        for (; o0 + 64 <= hi; o0 += 64) {
            __m512 c[LORA_TOKENS][4];
            for (int64_t t = 0; t < LORA_TOKENS; ++t)
                for (int64_t j = 0; j < 4; ++j) c[t][j] = _mm512_setzero_ps();
            for (int64_t k2 = k2b; k2 < k2e; ++k2) {
                const bf16 *restrict b = bt + (k2 * n_out + o0) * 2;
                const __m512bh b0 = as_bh(_mm512_loadu_si512(b)),
                               b1 = as_bh(_mm512_loadu_si512(b + 32)),
                               b2 = as_bh(_mm512_loadu_si512(b + 64)),
                               b3 = as_bh(_mm512_loadu_si512(b + 96));
                for (int64_t t = 0; t < LORA_TOKENS; ++t) {
                    const __m512bh yp = pair_at(yb + t * r + 2 * k2);
                    c[t][0] = _mm512_dpbf16_ps(c[t][0], yp, b0);
                    c[t][1] = _mm512_dpbf16_ps(c[t][1], yp, b1);
                    c[t][2] = _mm512_dpbf16_ps(c[t][2], yp, b2);
                    c[t][3] = _mm512_dpbf16_ps(c[t][3], yp, b3);
                }
            }
            for (int64_t t = 0; t < nt; ++t)
                for (int64_t j = 0; j < 4; ++j) {
                    bf16 *ot = out + t * out_stride + o0 + 16 * j;
                    const __m512 sum = _mm512_add_ps(load_bf16x16(ot), c[t][j]);
                    _mm256_storeu_si256((__m256i *)ot, (__m256i)_mm512_cvtneps_pbh(sum));
                }
        }
        for (int64_t t = 0; t < nt; ++t) /* the slice's last (hi - lo) % 64 columns */
            for (int64_t o = o0; o < hi; ++o) {
                float acc = 0.0f;
                for (int64_t k = 2 * k2b; k < 2 * k2e; ++k)
                    acc += bf16_to_f32(yb[t * r + k])
                           * bf16_to_f32(bt[((k / 2) * n_out + o) * 2 + k % 2]);
                bf16 *ot = out + t * out_stride + o;
                *ot = f32_to_bf16(bf16_to_f32(*ot) + acc);
            }
    }
}
#endif

/* Like lora_segments_f32, with bf16 x, out and weights (the pair-interleaved layout above,
 * R a multiple of 16); `impl` one of loraplex_bf16_impls.
 * Returns 0, -1 when scratch memory could not be allocated, -2 for an impl not compiled. */
int lora_segments_bf16(
    const bf16 *x, int64_t x_stride, bf16 *out, int64_t out_stride,
    int64_t in_features, int64_t n_out,
    const int64_t *seg_first, const int64_t *seg_len, const int64_t *seg_slot,
    int64_t num_segs, const int64_t *at_ptrs, const int64_t *bt_ptrs, const int64_t *ranks,
    const int64_t *slice_table, const int64_t *num_slices, int64_t max_slices,
    int num_threads, int impl)
{
    if (!(loraplex_bf16_impls() & (1 << impl))) return -2;
    int64_t num_groups = 0, max_rank = 16;
    for (int64_t i = 0; i < num_segs; ++i)
        if (ranks[seg_slot[i]] > max_rank) max_rank = ranks[seg_slot[i]];
    int64_t *work = lora_work_items(seg_first, seg_len, seg_slot, num_segs, LORA_TOKENS,
                                    &num_groups);
    if (!work) return -1;
    const int64_t in2 = (in_features + 1) / 2, w = 2 * in2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* y: fp32 [4, R] (portable) or bf16 (vector); xf: [4, w] fp32; xh: [4, w] bf16 */
        float *y = malloc(sizeof(float) * (size_t)(LORA_TOKENS * max_rank));
        float *xf = calloc((size_t)(LORA_TOKENS * w), sizeof(float));
        bf16 *xh = calloc((size_t)(LORA_TOKENS * w), sizeof(bf16));
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < num_groups; ++g) {
            if (!y || !xf || !xh) {
                failed = 1;
                continue;
            }
            const int64_t t = work[3 * g], nt = work[3 * g + 1], slot = work[3 * g + 2];
            const bf16 *at = (const bf16 *)(intptr_t)at_ptrs[slot];
            const bf16 *bt = (const bf16 *)(intptr_t)bt_ptrs[slot];
            const int64_t *slices = slice_table + slot * max_slices * 4;
            for (int64_t j = 0; j < LORA_TOKENS; ++j) { /* rows past nt stay zero */
                if (j < nt)
                    memcpy(xh + j * w, x + (t + j) * x_stride,
                           sizeof(bf16) * (size_t)in_features);
                else
                    memset(xh + j * w, 0, sizeof(bf16) * (size_t)w);
            }
#ifdef __AVX512BF16__
            if (impl == BF16_AVX512) {
                lora_tokens_avx512(xh, out + t * out_stride, out_stride, nt, in2, n_out, at,
                                   bt, ranks[slot], slices, num_slices[slot], (bf16 *)y);
                continue;
            }
#endif
            for (int64_t i = 0; i < LORA_TOKENS * w; ++i) xf[i] = bf16_to_f32(xh[i]);
            lora_tokens_portable(xf, out + t * out_stride, out_stride, nt, in2, n_out, at, bt,
                                 ranks[slot], slices, num_slices[slot], y);
        }
        free(y);
        free(xf);
        free(xh);
    }
    free(work);
    return failed ? -1 : 0;
}
