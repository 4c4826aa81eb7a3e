/* Native CPU kernels for bfloat16 tensors with float32 accumulation, paged decode
 * attention (cpu_lora_bf16.c holds the LoRA segments): bf16 K/V caches and queries, bf16
 * outputs.
 *
 * Two implementations, chosen per call by `impl` (see loraplex_bf16_impls):
 *   BF16_PORTABLE: every bf16 value widened to float32 (a 16-bit shift) and multiplied
 *                  with float32 FMAs; any CPU, whatever the compiler vectorises to.
 *   BF16_AVX512:   AVX-512 BF16 dot products (vdpbf16ps: each fp32 lane gets the sum of
 *                  two bf16 x bf16 products, exact, added in fp32); compiled only when the
 *                  compiler targets a CPU with avx512_bf16 (-march=native on one).
 * Both round what the PyTorch reference rounds to bf16 (the attention weights before the
 * value product, the outputs), so they differ from each other only in the order of fp32
 * additions. The attention runs an online softmax (decode_attention.h), so the weights
 * rounded are exp(score - running max), normalised in fp32 at the end, where the reference
 * rounds the normalised probabilities: the same relative rounding error, on a differently
 * scaled value.
 *
 * A V pass pairs two cached positions by interleaving their rows (unpacklo/hi), which
 * permutes the fp32 accumulator lanes; they are put back in order once per sequence.
 */
#include "bf16.h"
#include "common.h"
#include "decode_attention.h"
#include "kernels.h"

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
 * time, as cpu_attention_f32.c's scores_portable. */
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
/* f32_to_bf16 of 16 floats at once, bit for bit (round to nearest even, NaN kept quiet,
 * denormals kept: vcvtneps2bf16 would flush them), into 16 bf16. */
static inline __m256i f32_to_bf16_x16(__m512 f)
{
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

/* scores_portable with vdpbf16ps (head_dim a multiple of 32, q in bf16 as given): per K
 * row one chain per head with 16 lanes of pair sums kept apart, reduced across 16
 * positions at once (decode_attention.h's reduce16). Rows past n repeat the last one
 * (their sums are never stored), so the trip counts are constants and the sums stay in
 * registers, as in cpu_attention_f32.c's scores_avx512. */
static inline __attribute__((always_inline)) void scores_avx512(
    const bf16 *restrict q, int64_t q_head_stride, const int64_t nh, const bf16 *restrict k,
    int64_t pos_stride, int64_t n, const int64_t head_dim, float scale, float *restrict w,
    int64_t ws, const bf16 *pf, int64_t pf_n)
{
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t p0 = 0; p0 < n; p0 += 16) {
        const int64_t m = n - p0 < 16 ? n - p0 : 16;
        __m512 u[SCORE_HEADS][4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            __m512 t[SCORE_HEADS][4];
#pragma GCC unroll 4
            for (int h = 0; h < SCORE_HEADS; ++h)
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) t[h][j] = _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                const int64_t r = 4 * c + j < m ? 4 * c + j : m - 1;
                const bf16 *restrict kr = k + (p0 + r) * pos_stride;
                if (p0 + 4 * c + j < pf_n)
                    prefetch_rows(pf + (p0 + 4 * c + j) * pos_stride, 1, 0, head_dim * 2);
                for (int64_t d = 0; d < head_dim; d += 32) {
                    const __m512bh kv = as_bh(_mm512_loadu_si512(kr + d));
#pragma GCC unroll 4
                    for (int h = 0; h < SCORE_HEADS; ++h)
                        if (h < nh)
                            t[h][j] = _mm512_dpbf16_ps(
                                t[h][j], as_bh(_mm512_loadu_si512(q + h * q_head_stride + d)),
                                kv);
                }
            }
            scores_reduce4(u, t, c, nh);
        }
        scores_store16(w + p0, ws, u, nh, m, vscale);
    }
}

/* values_portable with vdpbf16ps, acc first scaled by corr[h] (the online softmax's
 * rescale, scale_rows's work folded into this pass): two positions' rows interleaved
 * (unpacklo/hi) once, then dotted with each head's weight pair. Lane m of acc's lo half
 * of 32 dimensions holds dimension 32c + 8(m/4) + m%4, of the hi half 32c + 8(m/4) + 4 +
 * m%4 (undone on output). An odd last position pairs with zeros. */
static inline __attribute__((always_inline)) void values_avx512(
    float *restrict acc, const bf16 *restrict v, int64_t pos_stride, const float *restrict w,
    int64_t ws, const int64_t nh, int64_t n, const int64_t head_dim,
    const float *restrict corr, const bf16 *pf, int64_t pf_n)
{
    /* 32 positions at a time: each head's weights rounded to bf16 once, 16 at a time (as
     * consecutive bf16 they are the pairs the dot products take, a zero past n), not once
     * per pair and 32 dimensions */
    for (int64_t p0 = 0; p0 < n; p0 += 32) {
        const int64_t np = n - p0 < 32 ? n - p0 : 32;
        int32_t pairs[SCORE_HEADS][16];
        for (int64_t h = 0; h < nh; ++h)
            for (int64_t c = 0; c < np; c += 16) {
                const int64_t left = np - c < 16 ? np - c : 16;
                const __m512 f = _mm512_maskz_loadu_ps((__mmask16)((1u << left) - 1u),
                                                       w + h * ws + p0 + c);
                _mm256_storeu_si256((__m256i *)(pairs[h] + c / 2), f32_to_bf16_x16(f));
            }
        /* at head_dim 64 both halves of the row at once: 4 chains per head, not 2 (the
         * dot products' latency set the pace) */
        const int64_t dc = head_dim == 64 ? 2 : 1;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 32 * dc) {
            __m512 lo[2][SCORE_HEADS], hi[2][SCORE_HEADS];
#pragma GCC unroll 2
            for (int e = 0; e < 2; ++e)
                if (e < dc)
                    for (int64_t h = 0; h < nh; ++h) {
                        /* the softmax's rescale, on the first pass of 32 positions */
                        const __m512 c = _mm512_set1_ps(p0 == 0 ? corr[h] : 1.0f);
                        const float *restrict ah = acc + h * head_dim + d0 + 32 * e;
                        lo[e][h] = _mm512_mul_ps(c, _mm512_loadu_ps(ah));
                        hi[e][h] = _mm512_mul_ps(c, _mm512_loadu_ps(ah + 16));
                    }
            for (int64_t p = 0; p < np; p += 2) {
                const int two = p + 1 < np;
                if (d0 == 0 && p0 + p < pf_n)
                    prefetch_rows(pf + (p0 + p) * pos_stride, p0 + p + 1 < pf_n ? 2 : 1,
                                  pos_stride * 2, head_dim * 2);
#pragma GCC unroll 2
                for (int e = 0; e < 2; ++e) {
                    if (e >= dc) break;
                    const bf16 *restrict vp = v + (p0 + p) * pos_stride + d0 + 32 * e;
                    const __m512i x0 = _mm512_loadu_si512(vp);
                    const __m512i x1 = two ? _mm512_loadu_si512(vp + pos_stride)
                                           : _mm512_setzero_si512();
                    const __m512bh xl = as_bh(_mm512_unpacklo_epi16(x0, x1));
                    const __m512bh xh = as_bh(_mm512_unpackhi_epi16(x0, x1));
                    for (int64_t h = 0; h < nh; ++h) {
                        const __m512bh pair = as_bh(_mm512_set1_epi32(pairs[h][p / 2]));
                        lo[e][h] = _mm512_dpbf16_ps(lo[e][h], pair, xl);
                        hi[e][h] = _mm512_dpbf16_ps(hi[e][h], pair, xh);
                    }
                }
            }
#pragma GCC unroll 2
            for (int e = 0; e < 2; ++e)
                if (e < dc)
                    for (int64_t h = 0; h < nh; ++h) {
                        float *restrict ah = acc + h * head_dim + d0 + 32 * e;
                        _mm512_storeu_ps(ah, lo[e][h]);
                        _mm512_storeu_ps(ah + 16, hi[e][h]);
                    }
        }
    }
}
#endif

/* Positions [begin, end) of one sequence (begin anywhere in its block, as for float32),
 * every head, into the running state m, l [heads], acc [heads * head_dim] (started here;
 * lanes permuted as values_avx512 says when `vector`); scores soft-capped at `softcap`
 * (0: not). Scratch: w [SCORE_HEADS * block_size], qf [heads *
 * head_dim] (the portable scores' queries), kvf [2 * block_size * head_dim] (a block's K
 * and V rows of one KV head, widened, for the portable path on AVX2). */
static inline __attribute__((always_inline)) void decode_range(
    const bf16 *restrict q, int64_t q_head_stride,
    const bf16 *restrict k_cache, const bf16 *restrict v_cache, const int32_t *restrict table,
    int64_t begin, int64_t end, int64_t kv_heads, int64_t group, const int64_t head_dim,
    int64_t block_size, float scale, float softcap, int vector, float *restrict m,
    float *restrict l, float *restrict acc, float *restrict w, float *restrict qf,
    float *restrict kvf)
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
    /* a block's rows from o (0 but where a window starts inside it) */
    for (int64_t pos0 = begin, n; pos0 < end; pos0 += n) {
        const int64_t blk = pos0 / block_size, o = pos0 - blk * block_size;
        const int64_t off = (int64_t)table[blk] * block_stride + o * pos_stride;
        n = end - pos0 < block_size - o ? end - pos0 : block_size - o;
        const int64_t ahead = (blk + DECODE_PREFETCH_BLOCKS) * block_size;
        const int64_t next_n = end - ahead < block_size ? end - ahead : block_size;
        const int64_t next = next_n > 0
            ? (int64_t)table[blk + DECODE_PREFETCH_BLOCKS] * block_stride : 0;
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            const bf16 *restrict kb = k_cache + off + kh * head_dim;
            const bf16 *restrict vb = v_cache + off + kh * head_dim;
            /* the block ahead: the vector kernels spread its rows' prefetches over their
             * own rows' loads (a burst of them stalled on the miss buffers) */
            const bf16 *pk = k_cache + next + kh * head_dim, *pv = v_cache + next + kh * head_dim;
            if (next_n > 0 && !vector) {
                prefetch_rows(pk, next_n, pos_stride * 2, head_dim * 2);
                prefetch_rows(pv, next_n, pos_stride * 2, head_dim * 2);
            }
            for (int64_t g0 = 0; g0 < group; g0 += SCORE_HEADS) {
                const int64_t nh = group - g0 < SCORE_HEADS ? group - g0 : SCORE_HEADS;
                const int64_t h0 = kh * group + g0;
                float *restrict a = acc + h0 * head_dim;
#ifdef __AVX512BF16__
                if (vector) {
                    const bf16 *restrict qh = q + h0 * q_head_stride;
                    const int64_t pf_n = g0 == 0 && next_n > 0 ? next_n : 0;
                    if (nh == 3)
                        scores_avx512(qh, q_head_stride, 3, kb, pos_stride, n, head_dim, scale,
                                      w, block_size, pk, pf_n);
                    else
                        scores_avx512(qh, q_head_stride, nh, kb, pos_stride, n, head_dim,
                                      scale, w, block_size, pk, pf_n);
                    softcap_block(w, block_size, nh, n, softcap);
                    online_softmax_block(w, block_size, nh, n, m + h0, l + h0, corr);
                    if (nh == 3)
                        values_avx512(a, vb, pos_stride, w, block_size, 3, n, head_dim, corr,
                                      pv, pf_n);
                    else
                        values_avx512(a, vb, pos_stride, w, block_size, nh, n, head_dim, corr,
                                      pv, pf_n);
                    continue;
                }
#endif
#ifdef SCORES_AVX2
                if (head_dim % 8 == 0) {
                    /* the block's rows of this KV head widened once, for every head of the
                     * group: the float32 kernel's AVX2 scores and values (decode_attention.h)
                     * on them, the weights rounded to bf16 in between (weight_bf16) */
                    float *restrict kf = kvf, *restrict vf_ = kvf + block_size * head_dim;
                    if (g0 == 0)
                        for (int64_t p = 0; p < n; ++p)
                            for (int64_t d = 0; d < head_dim; ++d) {
                                kf[p * head_dim + d] = bf16_to_f32(kb[p * pos_stride + d]);
                                vf_[p * head_dim + d] = bf16_to_f32(vb[p * pos_stride + d]);
                            }
                    if (nh == 3)
                        scores_avx2(qf + h0 * head_dim, head_dim, 3, kf, head_dim, n, head_dim,
                                    scale, w, block_size);
                    else
                        scores_avx2(qf + h0 * head_dim, head_dim, nh, kf, head_dim, n,
                                    head_dim, scale, w, block_size);
                    softcap_block(w, block_size, nh, n, softcap);
                    online_softmax_block(w, block_size, nh, n, m + h0, l + h0, corr);
                    for (int64_t h = 0; h < nh; ++h)
                        for (int64_t p = 0; p < n; ++p)
                            w[h * block_size + p] = weight_bf16(w[h * block_size + p]);
                    values_f32(a, vf_, head_dim, w, block_size, nh, n, head_dim, corr, NULL, 0,
                               0);
                    continue;
                }
#endif
                scores_portable(qf + h0 * head_dim, nh, kb, pos_stride, n, head_dim, scale, w,
                                block_size);
                softcap_block(w, block_size, nh, n, softcap);
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

/* One thread's part of the call's work: its scratch, the items shared out (an `omp for`
 * that every thread of the team reaches, no barrier after: the region's end, or the
 * caller's wait, is that barrier; a merge of split sequences keeps its own). 1 where
 * scratch memory failed, else 0. */
static int attention_share_bf16(
    const bf16 *query, int64_t q_row_stride, int64_t q_head_stride,
    const bf16 *k_cache, const bf16 *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int64_t *seq_ids, const int64_t *rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float softcap,
    bf16 *out, int64_t o_row_stride, int64_t o_head_stride, int vector, int64_t group,
    const decode_item *items, int64_t num_items, int split, float *parts)
{
    const int64_t state = num_heads * (2 + head_dim);
    float *ms = parts, *ls = parts + num_items * num_heads, *accs = ls + num_items * num_heads;
    int failed = 0;
    /* state, w, qf, the portable AVX2 path's widened K and V rows of a block */
    float *own = malloc(sizeof(float) * (size_t)(state + SCORE_HEADS * block_size
                                                 + num_heads * head_dim
                                                 + 2 * block_size * head_dim));
    const int ok = own && (!split || parts);
    /* every thread must reach the worksharing loops, even one without scratch; the
     * region's end is their barrier, and a merge's the one before it (nowait: a
     * decode step's attention waits once per layer, not twice) */
#pragma omp for schedule(dynamic, 1) nowait
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
        float *kvf = qf + num_heads * head_dim;
        if (head_dim == 64)
            decode_range(q, q_head_stride, k_cache, v_cache, table, it.begin, it.end,
                         num_kv_heads, group, 64, block_size, scale, softcap, vector, m, l,
                         acc, w, qf, kvf);
        else
            decode_range(q, q_head_stride, k_cache, v_cache, table, it.begin, it.end,
                         num_kv_heads, group, head_dim, block_size, scale, softcap, vector,
                         m, l, acc, w, qf, kvf);
        if (whole)
            write_out(acc, l, num_heads, head_dim, vector, out + row * o_row_stride,
                      o_head_stride);
    }
    if (split) { /* the same for every thread */
#pragma omp barrier
        /* every part is done */
#pragma omp for schedule(dynamic, 1) nowait
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
    return failed;
}

/* Like paged_decode_attention_f32, with bf16 query, caches and output; `impl` one of
 * loraplex_bf16_impls (BF16_AVX512 needs head_dim % 32 == 0, else the portable one runs);
 * window and softcap as there (the capped scores float32, as the uncapped).
 * Returns 0, -1 when scratch memory could not be allocated, -2 for an impl not compiled. */
int paged_decode_attention_bf16(
    const bf16 *query, int64_t q_row_stride, int64_t q_head_stride,
    const bf16 *k_cache, const bf16 *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens_all, const int64_t *seq_ids, const int64_t *rows,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale,
    bf16 *out, int64_t o_row_stride, int64_t o_head_stride, int num_threads, int impl,
    int64_t window, float softcap)
{
    if (!(loraplex_bf16_impls() & (1 << impl))) return -2;
    const int vector = impl == BF16_AVX512 && head_dim % 32 == 0;
    const int64_t group = num_heads / num_kv_heads;
    int64_t num_items = 0;
    int split = 0;
    /* called by every thread of a region (num_threads 0): a sequence per item, none split */
    decode_item *items = decode_items(seq_lens_all, seq_ids, num_seqs, block_size,
                                      num_threads ? num_threads : 1, window, &num_items,
                                      &split);
    if (!items) return -1;
    /* a split sequence's parts keep their states here until merged (as for float32) */
    const int64_t state = num_heads * (2 + head_dim);
    float *parts = split ? malloc(sizeof(float) * (size_t)(num_items * state)) : NULL;
    int failed = split && !parts;
#define SHARE                                                                           \
    attention_share_bf16(query, q_row_stride, q_head_stride, k_cache, v_cache,          \
        block_tables, table_stride, seq_ids, rows, num_heads, num_kv_heads, head_dim,   \
        block_size, scale, softcap, out, o_row_stride, o_head_stride, vector, group,    \
        items, num_items, split, parts)
    if (num_threads == 0) { /* every thread of the caller's region calls it */
        failed |= SHARE;
    } else {
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        failed |= SHARE;
    }
#undef SHARE
    free(parts);
    free(items);
    return failed ? -1 : 0;
}
