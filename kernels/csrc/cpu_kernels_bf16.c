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
 * attention weights before the value product, the outputs), so they differ from each
 * other only in the order of fp32 additions. The attention runs an online softmax
 * (decode_attention.h), so the weights rounded are exp(score - running max), normalised
 * in fp32 at the end, where the reference rounds the normalised probabilities: the same
 * relative rounding error, on a differently scaled value.
 *
 * The vdpbf16ps operand wants pairs of consecutive bf16 values along the summed axis, so
 * the LoRA weights come pair-interleaved ("VNNI" layout, written by lora_slots.py):
 *   At: [ceil(in / 2), R, 2]   At[i2, k, j] = A^T[2 * i2 + j, k]   (zero past `in`)
 *   Bt: [R / 2, out, 2]        Bt[k2, o, j] = scaled B^T[2 * k2 + j, o]
 * and a V pass pairs two cached positions by interleaving their rows (unpacklo/hi), which
 * permutes the fp32 accumulator lanes; they are put back in order once per sequence.
 */
#include "common.h"
#include "decode_attention.h"

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

/* Query heads scored together against each K row loaded. */
#define SCORE_HEADS 4

/* Scaled scores of `n` positions for `nh` query heads of one KV head (qf: the heads'
 * queries widened to fp32, head_dim apart): w[h * ws + p]; four positions' chains at a
 * time, as cpu_kernels.c's scores_portable. */
static inline __attribute__((always_inline)) void scores_portable(
    const float *restrict qf, int64_t nh, const bf16 *restrict k, int64_t pos_stride,
    int64_t n, const int64_t head_dim, float scale, float *restrict w, int64_t ws)
{
    int64_t p = 0;
    for (; p + 4 <= n; p += 4)
        for (int64_t h = 0; h < nh; ++h) {
            const bf16 *restrict k0 = k + p * pos_stride, *restrict k1 = k0 + pos_stride,
                       *restrict k2 = k1 + pos_stride, *restrict k3 = k2 + pos_stride;
            const float *restrict qh = qf + h * head_dim;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t d = 0; d < head_dim; ++d) {
                s0 += qh[d] * bf16_to_f32(k0[d]);
                s1 += qh[d] * bf16_to_f32(k1[d]);
                s2 += qh[d] * bf16_to_f32(k2[d]);
                s3 += qh[d] * bf16_to_f32(k3[d]);
            }
            float *restrict wh = w + h * ws + p;
            wh[0] = s0 * scale;
            wh[1] = s1 * scale;
            wh[2] = s2 * scale;
            wh[3] = s3 * scale;
        }
    for (; p < n; ++p)
        for (int64_t h = 0; h < nh; ++h) {
            const bf16 *restrict kp = k + p * pos_stride;
            const float *restrict qh = qf + h * head_dim;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * bf16_to_f32(kp[d]);
            w[h * ws + p] = s * scale;
        }
}

/* the weight in bf16, as the reference's value product takes its probabilities */
static inline float weight_bf16(float w) { return bf16_to_f32(f32_to_bf16(w)); }

/* acc[h * head_dim + d] += bf16(w[h * ws + p]) * v[p * pos_stride + d], four rows per acc
 * update. */
static inline __attribute__((always_inline)) void values_portable(
    float *restrict acc, const bf16 *restrict v, int64_t pos_stride, const float *restrict w,
    int64_t ws, int64_t nh, int64_t n, const int64_t head_dim)
{
    int64_t p = 0;
    for (; p + 4 <= n; p += 4) {
        const bf16 *restrict v0 = v + p * pos_stride, *restrict v1 = v0 + pos_stride,
                   *restrict v2 = v1 + pos_stride, *restrict v3 = v2 + pos_stride;
        for (int64_t h = 0; h < nh; ++h) {
            const float *restrict wh = w + h * ws + p;
            const float p0 = weight_bf16(wh[0]), p1 = weight_bf16(wh[1]),
                        p2 = weight_bf16(wh[2]), p3 = weight_bf16(wh[3]);
            float *restrict a = acc + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d)
                a[d] += p0 * bf16_to_f32(v0[d]) + p1 * bf16_to_f32(v1[d])
                        + p2 * bf16_to_f32(v2[d]) + p3 * bf16_to_f32(v3[d]);
        }
    }
    for (; p < n; ++p)
        for (int64_t h = 0; h < nh; ++h) {
            const bf16 *restrict vp = v + p * pos_stride;
            const float pr = weight_bf16(w[h * ws + p]);
            float *restrict a = acc + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += pr * bf16_to_f32(vp[d]);
        }
}

#ifdef __AVX512BF16__
static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

/* two weights as one bf16 pair, broadcast to every lane */
static inline __m512bh prob_pair(float p0, float p1)
{
    return as_bh(_mm512_set1_epi32((int32_t)((uint32_t)f32_to_bf16(p1) << 16
                                             | f32_to_bf16(p0))));
}

/* scores_portable with vdpbf16ps (head_dim a multiple of 32, q in bf16 as given): per K
 * row one chain per head with 16 lanes of pair sums kept apart, reduced across 16
 * positions at once (decode_attention.h's reduce16). Rows past n are never loaded. */
static inline __attribute__((always_inline)) void scores_avx512(
    const bf16 *restrict q, int64_t q_head_stride, const int64_t nh, const bf16 *restrict k,
    int64_t pos_stride, int64_t n, const int64_t head_dim, float scale, float *restrict w,
    int64_t ws)
{
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t p0 = 0; p0 < n; p0 += 16) {
        const int64_t m = n - p0 < 16 ? n - p0 : 16;
        __m512 u[SCORE_HEADS][4];
        for (int64_t c = 0; c < 4; ++c) {
            __m512 t[SCORE_HEADS][4];
            for (int64_t h = 0; h < nh; ++h)
                for (int64_t j = 0; j < 4; ++j) t[h][j] = _mm512_setzero_ps();
            for (int64_t j = 0; j < 4 && 4 * c + j < m; ++j) {
                const bf16 *restrict kr = k + (p0 + 4 * c + j) * pos_stride;
                for (int64_t d = 0; d < head_dim; d += 32) {
                    const __m512bh kv = as_bh(_mm512_loadu_si512(kr + d));
                    for (int64_t h = 0; h < nh; ++h)
                        t[h][j] = _mm512_dpbf16_ps(
                            t[h][j], as_bh(_mm512_loadu_si512(q + h * q_head_stride + d)), kv);
                }
            }
            for (int64_t h = 0; h < nh; ++h)
                u[h][c] = reduce4(t[h][0], t[h][1], t[h][2], t[h][3]);
        }
        for (int64_t h = 0; h < nh; ++h)
            _mm512_mask_storeu_ps(w + h * ws + p0, (__mmask16)((1u << m) - 1u),
                                  _mm512_mul_ps(reduce16(u[h][0], u[h][1], u[h][2], u[h][3]),
                                                vscale));
    }
}

/* values_portable with vdpbf16ps: two positions' rows interleaved (unpacklo/hi) once,
 * then dotted with each head's weight pair. Lane m of acc's lo half of 32 dimensions holds
 * dimension 32c + 8(m/4) + m%4, of the hi half 32c + 8(m/4) + 4 + m%4 (undone on output).
 * An odd last position pairs with zeros. */
static inline __attribute__((always_inline)) void values_avx512(
    float *restrict acc, const bf16 *restrict v, int64_t pos_stride, const float *restrict w,
    int64_t ws, const int64_t nh, int64_t n, const int64_t head_dim)
{
    for (int64_t d = 0; d < head_dim; d += 32) {
        __m512 lo[SCORE_HEADS], hi[SCORE_HEADS];
        for (int64_t h = 0; h < nh; ++h) {
            lo[h] = _mm512_loadu_ps(acc + h * head_dim + d);
            hi[h] = _mm512_loadu_ps(acc + h * head_dim + d + 16);
        }
        for (int64_t p = 0; p < n; p += 2) {
            const int two = p + 1 < n;
            const __m512i x0 = _mm512_loadu_si512(v + p * pos_stride + d);
            const __m512i x1 = two ? _mm512_loadu_si512(v + (p + 1) * pos_stride + d)
                                   : _mm512_setzero_si512();
            const __m512bh xl = as_bh(_mm512_unpacklo_epi16(x0, x1));
            const __m512bh xh = as_bh(_mm512_unpackhi_epi16(x0, x1));
            for (int64_t h = 0; h < nh; ++h) {
                const __m512bh pair = prob_pair(w[h * ws + p], two ? w[h * ws + p + 1] : 0.0f);
                lo[h] = _mm512_dpbf16_ps(lo[h], pair, xl);
                hi[h] = _mm512_dpbf16_ps(hi[h], pair, xh);
            }
        }
        for (int64_t h = 0; h < nh; ++h) {
            _mm512_storeu_ps(acc + h * head_dim + d, lo[h]);
            _mm512_storeu_ps(acc + h * head_dim + d + 16, hi[h]);
        }
    }
}
#endif

/* Positions [begin, end) of one sequence (begin on a block boundary), every head, into
 * the running state m, l [heads], acc [heads * head_dim] (started here; lanes permuted
 * as values_avx512 says when `vector`). Scratch: w [SCORE_HEADS * block_size], qf [heads *
 * head_dim] (the portable scores' queries). */
static inline __attribute__((always_inline)) void decode_range(
    const bf16 *restrict q, int64_t q_head_stride,
    const bf16 *restrict k_cache, const bf16 *restrict v_cache, const int32_t *restrict table,
    int64_t begin, int64_t end, int64_t kv_heads, int64_t group, const int64_t head_dim,
    int64_t block_size, float scale, int vector, float *restrict m, float *restrict l,
    float *restrict acc, float *restrict w, float *restrict qf)
{
    const int64_t heads = kv_heads * group;
    const int64_t pos_stride = kv_heads * head_dim;
    const int64_t block_stride = block_size * pos_stride;
    for (int64_t h = 0; h < heads; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int64_t j = 0; j < heads * head_dim; ++j) acc[j] = 0.0f;
    if (!vector)
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t d = 0; d < head_dim; ++d)
                qf[h * head_dim + d] = bf16_to_f32(q[h * q_head_stride + d]);
    float corr[SCORE_HEADS];
    prefetch_first_blocks(k_cache, v_cache, table, begin, end, block_size, block_stride * 2);
    for (int64_t pos0 = begin; pos0 < end; pos0 += block_size) {
        const int64_t blk = pos0 / block_size;
        const int64_t off = (int64_t)table[blk] * block_stride;
        const int64_t n = end - pos0 < block_size ? end - pos0 : block_size;
        const int64_t ahead = pos0 + DECODE_PREFETCH_BLOCKS * block_size;
        const int64_t next_n = end - ahead < block_size ? end - ahead : block_size;
        const int64_t next = next_n > 0
            ? (int64_t)table[blk + DECODE_PREFETCH_BLOCKS] * block_stride : 0;
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            const bf16 *restrict kb = k_cache + off + kh * head_dim;
            const bf16 *restrict vb = v_cache + off + kh * head_dim;
            if (next_n > 0) {
                prefetch_rows(k_cache + next + kh * head_dim, next_n, pos_stride * 2,
                              head_dim * 2);
                prefetch_rows(v_cache + next + kh * head_dim, next_n, pos_stride * 2,
                              head_dim * 2);
            }
            for (int64_t g0 = 0; g0 < group; g0 += SCORE_HEADS) {
                const int64_t nh = group - g0 < SCORE_HEADS ? group - g0 : SCORE_HEADS;
                const int64_t h0 = kh * group + g0;
                float *restrict a = acc + h0 * head_dim;
#ifdef __AVX512BF16__
                if (vector) {
                    const bf16 *restrict qh = q + h0 * q_head_stride;
                    if (nh == 3)
                        scores_avx512(qh, q_head_stride, 3, kb, pos_stride, n, head_dim, scale,
                                      w, block_size);
                    else
                        scores_avx512(qh, q_head_stride, nh, kb, pos_stride, n, head_dim,
                                      scale, w, block_size);
                    online_softmax_block(w, block_size, nh, n, m + h0, l + h0, corr);
                    scale_rows(a, nh, head_dim, corr);
                    if (nh == 3)
                        values_avx512(a, vb, pos_stride, w, block_size, 3, n, head_dim);
                    else
                        values_avx512(a, vb, pos_stride, w, block_size, nh, n, head_dim);
                    continue;
                }
#endif
                scores_portable(qf + h0 * head_dim, nh, kb, pos_stride, n, head_dim, scale, w,
                                block_size);
                online_softmax_block(w, block_size, nh, n, m + h0, l + h0, corr);
                scale_rows(a, nh, head_dim, corr);
                values_portable(a, vb, pos_stride, w, block_size, nh, n, head_dim);
            }
        }
    }
}

/* o = acc / l in bf16, the vector path's lane order undone */
static inline void write_out(const float *restrict acc, const float *restrict l, int64_t heads,
                             int64_t head_dim, int vector, bf16 *restrict o,
                             int64_t o_head_stride)
{
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        const float *restrict a = acc + h * head_dim;
        bf16 *restrict oh = o + h * o_head_stride;
        if (!vector) {
            for (int64_t d = 0; d < head_dim; ++d) oh[d] = f32_to_bf16(a[d] * inv);
            continue;
        }
        for (int64_t d = 0; d < head_dim; d += 32)
            for (int64_t m = 0; m < 16; ++m) {
                const int64_t dim = d + 8 * (m / 4) + m % 4;
                oh[dim] = f32_to_bf16(a[d + m] * inv);
                oh[dim + 4] = f32_to_bf16(a[d + 16 + m] * inv);
            }
    }
}

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
    int64_t num_items = 0;
    int split = 0;
    decode_item *items = decode_items(seq_lens_all, seq_ids, num_seqs, block_size,
                                      num_threads, &num_items, &split);
    if (!items) return -1;
    /* a split sequence's parts keep their states here until merged (as for float32) */
    const int64_t state = num_heads * (2 + head_dim);
    float *parts = split ? malloc(sizeof(float) * (size_t)(num_items * state)) : NULL;
    float *ms = parts, *ls = parts + num_items * num_heads, *accs = ls + num_items * num_heads;
    int failed = split && !parts;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* state, w, qf */
        float *own = malloc(sizeof(float) * (size_t)(state + SCORE_HEADS * block_size
                                                     + num_heads * head_dim));
        const int ok = own && (!split || parts);
        /* every thread must reach the worksharing loops, even one without scratch */
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < num_items; ++j) {
            if (!ok) {
                failed = 1;
                continue;
            }
            const decode_item it = items[j];
            const int64_t seq = seq_ids[it.seq], row = rows[it.seq];
            const int32_t *table = block_tables + seq * table_stride;
            const bf16 *q = query + row * q_row_stride;
            const int whole = it.parts == 1;
            float *m = whole ? own : ms + j * num_heads;
            float *l = whole ? own + num_heads : ls + j * num_heads;
            float *acc = whole ? own + 2 * num_heads : accs + j * num_heads * head_dim;
            float *w = own + state, *qf = w + SCORE_HEADS * block_size;
            if (head_dim == 64)
                decode_range(q, q_head_stride, k_cache, v_cache, table, it.begin, it.end,
                             num_kv_heads, group, 64, block_size, scale, vector, m, l, acc, w,
                             qf);
            else
                decode_range(q, q_head_stride, k_cache, v_cache, table, it.begin, it.end,
                             num_kv_heads, group, head_dim, block_size, scale, vector, m, l,
                             acc, w, qf);
            if (whole)
                write_out(acc, l, num_heads, head_dim, vector, out + row * o_row_stride,
                          o_head_stride);
        }
        if (split) { /* after the barrier above: every part is done */
#pragma omp for schedule(dynamic, 1)
            for (int64_t j = 0; j < num_items; ++j) {
                const decode_item it = items[j];
                if (!ok || it.parts == 1 || it.part != 0) continue;
                float *acc = accs + j * num_heads * head_dim;
                merge_parts(ms + j * num_heads, ls + j * num_heads, acc, it.parts, num_heads,
                            head_dim);
                write_out(acc, ls + j * num_heads, num_heads, head_dim, vector,
                          out + rows[it.seq] * o_row_stride, o_head_stride);
            }
        }
        free(own);
    }
    free(parts);
    free(items);
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
