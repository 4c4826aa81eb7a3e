/* What the float32 and bfloat16 paged decode attention kernels share: the running
 * (online) softmax over one block's scores, and the work plan that splits a sequence over
 * several threads when a batch has fewer sequences than threads.
 *
 * Each sequence is read in one pass, block by block, K then V of the same block while it
 * is hot (flash decoding): per query head a running max m, a running sum l of
 * exp(score - m) and the exp-weighted sum of values acc; when a later block raises the
 * max, l and acc are rescaled by exp(m_old - m_new). A split sequence's parts each keep
 * such a state and are merged the same way. The output is acc / l.
 */
#ifndef LORAPLEX_DECODE_ATTENTION_H
#define LORAPLEX_DECODE_ATTENTION_H
#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* A split part covers at least this many blocks: below it the merge and the extra
 * barrier cost about what the second thread saves. */
#define DECODE_MIN_SPLIT_BLOCKS 4

/* One block of `n` scaled scores for `nh` query heads (w: rows of stride ws) into
 * exp(score - m_new) in place; m, l updated; corr[h] = exp(m_old - m_new), the factor the
 * head's acc must be scaled by before this block's values are added. */
static inline void online_softmax_block(float *restrict w, int64_t ws, int64_t nh, int64_t n,
                                        float *restrict m, float *restrict l,
                                        float *restrict corr)
{
#ifdef __AVX512F__
    /* masked vectors of 16 scores, the max and the sum reduced as trees: the loop below
     * left a block's 16 exps to 15 dependent scalar adds (and its max to a ymm loop and
     * a scalar tail), a quarter of the bf16 kernel's time with its K/V in cache */
    for (int64_t h = 0; h < nh; ++h) {
        float *restrict wh = w + h * ws;
        const __m512 none = _mm512_set1_ps(-INFINITY);
        __m512 vmax = none;
        for (int64_t p = 0; p < n; p += 16) {
            const __mmask16 k = n - p < 16 ? (__mmask16)((1u << (n - p)) - 1u) : 0xffff;
            vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(none, k, wh + p));
        }
        const float block_max = _mm512_reduce_max_ps(vmax);
        const float bm = m[h] > block_max ? m[h] : block_max;
        const __m512 vbm = _mm512_set1_ps(bm);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t p = 0; p < n; p += 16) {
            const __mmask16 k = n - p < 16 ? (__mmask16)((1u << (n - p)) - 1u) : 0xffff;
            const __m512 e = (__m512)exp_nonpositive_v(
                (vf)_mm512_sub_ps(_mm512_mask_loadu_ps(none, k, wh + p), vbm));
            _mm512_mask_storeu_ps(wh + p, k, e);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, e));
        }
        /* m = -inf (nothing seen yet): l and acc are zero, any factor keeps them so */
        corr[h] = m[h] == bm ? 1.0f : exp_nonpositive(m[h] - bm);
        l[h] = l[h] * corr[h] + _mm512_reduce_add_ps(vsum);
        m[h] = bm;
    }
#else
    for (int64_t h = 0; h < nh; ++h) {
        float *restrict wh = w + h * ws;
        float bm = m[h];
#pragma omp simd reduction(max : bm)
        for (int64_t p = 0; p < n; ++p) bm = wh[p] > bm ? wh[p] : bm;
        vf vsum = {0};
        int64_t p = 0;
        for (; p + VL <= n; p += VL) {
            const vf e = exp_nonpositive_v(loadv(wh + p) - bm);
            memcpy(wh + p, &e, sizeof e);
            vsum += e;
        }
        float sum = 0.0f;
        for (int k = 0; k < VL; ++k) sum += vsum[k];
        for (; p < n; ++p) {
            const float e = exp_nonpositive(wh[p] - bm);
            wh[p] = e;
            sum += e;
        }
        /* m = -inf (nothing seen yet): l and acc are zero, any factor keeps them so */
        corr[h] = m[h] == bm ? 1.0f : exp_nonpositive(m[h] - bm);
        l[h] = l[h] * corr[h] + sum;
        m[h] = bm;
    }
#endif
}

static inline void scale_rows(float *restrict acc, int64_t nh, int64_t head_dim,
                              const float *restrict corr)
{
    for (int64_t h = 0; h < nh; ++h) {
        if (corr[h] == 1.0f) continue;
        float *restrict a = acc + h * head_dim;
        const float c = corr[h];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] *= c;
    }
}

/* The work: item j covers positions [begin, end) of decode sequence `seq` (its index in
 * seq_ids), part `part` of `parts`; a sequence's parts are consecutive items. */
typedef struct {
    int64_t seq, begin, end, part, parts;
} decode_item;

/* The first position a decode row of a sequence of `len` positions attends to: with a
 * sliding window of `window` keys (0: none) the last `window` only. The blocks before it
 * may have been released and reused (their table entries stale), so nothing before it is
 * read. */
static inline int64_t decode_first(int64_t len, int64_t window)
{
    return window > 0 && len > window ? len - window : 0;
}

/* One item per sequence, or, when there are fewer sequences than threads, each long
 * enough sequence cut into up to ceil(threads / num_seqs) ranges of whole blocks (the
 * first from the window's start, decode_first, which need not be a block's).
 * *split set when any sequence was cut. NULL when out of memory. */
static inline decode_item *decode_items(const int32_t *seq_lens_all, const int64_t *seq_ids,
                                        int64_t num_seqs, int64_t block_size,
                                        int num_threads, int64_t window, int64_t *num_items,
                                        int *split)
{
    const int64_t want = num_seqs < num_threads ? (num_threads + num_seqs - 1) / num_seqs : 1;
    decode_item *items = malloc(sizeof(decode_item) * (size_t)(num_seqs * want + 1));
    if (!items) return NULL;
    int64_t n = 0;
    *split = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t len = seq_lens_all[seq_ids[i]];
        const int64_t first = decode_first(len, window), blk0 = first / block_size;
        const int64_t blocks = (len + block_size - 1) / block_size - blk0;
        int64_t parts = blocks / DECODE_MIN_SPLIT_BLOCKS;
        parts = parts < want ? parts : want;
        parts = parts < 1 ? 1 : parts;
        *split |= parts > 1;
        for (int64_t k = 0; k < parts; ++k) {
            const int64_t b0 = blk0 + blocks * k / parts, b1 = blk0 + blocks * (k + 1) / parts;
            const int64_t end = b1 * block_size < len ? b1 * block_size : len;
            items[n + k] = (decode_item){i, k == 0 ? first : b0 * block_size, end, k, parts};
        }
        n += parts;
    }
    *num_items = n;
    return items;
}

/* softcap_v (common.h) of one block's scaled scores, n of each of nh heads (rows of w,
 * ws apart), in place, before the online softmax takes them; cap 0: none */
static inline void softcap_block(float *restrict w, int64_t ws, int64_t nh, int64_t n,
                                 float cap)
{
    if (cap > 0.0f)
        for (int64_t h = 0; h < nh; ++h) softcap_row(w + h * ws, n, cap);
}

/* Folds the states of parts 1..parts-1 into part 0's: m, l [parts, heads], acc [parts,
 * heads, head_dim]. */
static inline void merge_parts(float *restrict m, float *restrict l, float *restrict acc,
                               int64_t parts, int64_t heads, int64_t head_dim)
{
    for (int64_t h = 0; h < heads; ++h) {
        float mx = m[h];
        for (int64_t k = 1; k < parts; ++k) mx = m[k * heads + h] > mx ? m[k * heads + h] : mx;
        float lsum = 0.0f;
        float *restrict a0 = acc + h * head_dim;
        for (int64_t k = 0; k < parts; ++k) {
            const float c = m[k * heads + h] == mx ? 1.0f
                                                   : exp_nonpositive(m[k * heads + h] - mx);
            lsum += l[k * heads + h] * c;
            const float *restrict ak = acc + (k * heads + h) * head_dim;
            if (k == 0) {
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a0[d] *= c;
            } else {
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a0[d] += c * ak[d];
            }
        }
        m[h] = mx;
        l[h] = lsum;
    }
}

/* Software prefetch of the block DECODE_PREFETCH_BLOCKS ahead, into L2 (prefetcht1): block
 * tables make blocks non-contiguous, beyond the hardware prefetcher's reach, and a
 * prefetch into L1 stalls on L1's few miss buffers (it measured no faster than none). */
#define DECODE_PREFETCH_BLOCKS 2

static inline void prefetch_rows(const void *base, int64_t rows, int64_t row_stride_bytes,
                                 int64_t row_bytes)
{
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < row_bytes; b += 64)
            __builtin_prefetch((const char *)base + r * row_stride_bytes + b, 0, 2);
}

/* the first DECODE_PREFETCH_BLOCKS blocks of positions [begin, end), whole (all KV heads),
 * before the loop that prefetches ahead of itself starts; the first from begin, which a
 * sliding window puts anywhere in its block */
static inline void prefetch_first_blocks(const void *k_cache, const void *v_cache,
                                         const int32_t *table, int64_t begin, int64_t end,
                                         int64_t block_size, int64_t block_bytes)
{
    const int64_t row_bytes = block_bytes / block_size;
    int64_t pos0 = begin;
    for (int64_t j = 0; j < DECODE_PREFETCH_BLOCKS && pos0 < end; ++j) {
        const int64_t blk = pos0 / block_size, o = pos0 - blk * block_size;
        const int64_t n = end - pos0 < block_size - o ? end - pos0 : block_size - o;
        const int64_t off = (int64_t)table[blk] * block_bytes + o * row_bytes;
        prefetch_rows((const char *)k_cache + off, 1, 0, row_bytes * n);
        prefetch_rows((const char *)v_cache + off, 1, 0, row_bytes * n);
        pos0 += n;
    }
}

#ifdef __AVX512F__
/* Four vectors of 16 partial sums -> per 128-bit lane c: [sum of a's lane c, of b's, c's,
 * d's]. Then reduce16 turns four of those (positions 0-3, 4-7, 8-11, 12-15) into one
 * vector whose lane p is position p's whole sum: a transpose folded into the additions,
 * so 16 positions cost 15 vector adds instead of 16 horizontal reductions. */
static inline __m512 reduce4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d ab2 = _mm512_castps_pd(ab), cd2 = _mm512_castps_pd(cd);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab2, cd2)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(ab2, cd2)));
}

static inline __m512 reduce16(__m512 u0, __m512 u1, __m512 u2, __m512 u3)
{
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88),
                                    _mm512_shuffle_f32x4(u0, u1, 0xdd));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, 0x88),
                                    _mm512_shuffle_f32x4(u2, u3, 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88),
                         _mm512_shuffle_f32x4(w0, w1, 0xdd));
}

/* The end of both dtypes' AVX-512 scores for 16 positions, in two parts: each head's four
 * sums of group c (4 positions) reduce4'd into u[h][c] as the group is done ... */
static inline __attribute__((always_inline)) void scores_reduce4(__m512 (*u)[4],
                                                                  __m512 (*t)[4], int c,
                                                                  int64_t nh)
{
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h)
        if (h < nh) u[h][c] = reduce4(t[h][0], t[h][1], t[h][2], t[h][3]);
}

/* ... then, after the four groups, u[h] reduced to the 16 scores, scaled, and the first m
 * stored at w[h * ws]. */
static inline __attribute__((always_inline)) void scores_store16(float *restrict w, int64_t ws,
                                                                  __m512 (*u)[4], int64_t nh,
                                                                  int64_t m, __m512 vscale)
{
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h)
        if (h < nh)
            _mm512_mask_storeu_ps(
                w + h * ws, (__mmask16)((1u << m) - 1u),
                _mm512_mul_ps(reduce16(u[h][0], u[h][1], u[h][2], u[h][3]), vscale));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SCORES_AVX2 1

/* Four vectors of 8 partial sums -> their 4 whole sums, in order. */
static inline __m128 hsum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d)
{
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* cpu_attention_f32.c's scores_portable with head_dim a multiple of 8, for AVX2 (16
 * ymm): 4 positions x up to 3 heads of FMA chains with the 8 dimension lanes kept apart
 * (12 ymm), reduced 4 positions at once; more heads take another pass over the K rows
 * (from L1). The portable loop reduced every (head, position) dot product on its own and
 * ran at a quarter of this. The portable bfloat16 kernel runs it on a block's rows
 * widened to float32. */
static inline __attribute__((always_inline)) void scores_avx2(
    const float *restrict q, int64_t q_head_stride, const int64_t nh,
    const float *restrict k, int64_t pos_stride, int64_t n, const int64_t head_dim,
    float scale, float *restrict w, int64_t ws)
{
    const __m128 vscale = _mm_set1_ps(scale);
    for (int64_t h0 = 0; h0 < nh; h0 += 3) {
        const int64_t hn = nh - h0 < 3 ? nh - h0 : 3;
        const float *restrict qh = q + h0 * q_head_stride;
        for (int64_t p0 = 0; p0 < n; p0 += 4) {
            const int64_t m = n - p0 < 4 ? n - p0 : 4;
            /* rows past n repeat the last one (their sums are dropped): constant trip
             * counts, so the 12 sums stay in registers */
            const float *restrict kr[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) kr[j] = k + (p0 + (j < m ? j : m - 1)) * pos_stride;
            __m256 t[3][4];
#pragma GCC unroll 3
            for (int h = 0; h < 3; ++h)
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) t[h][j] = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 8) {
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) {
                    const __m256 kv = _mm256_loadu_ps(kr[j] + d);
#pragma GCC unroll 3
                    for (int h = 0; h < 3; ++h)
                        if (h < hn)
                            t[h][j] = _mm256_fmadd_ps(
                                _mm256_loadu_ps(qh + h * q_head_stride + d), kv, t[h][j]);
                }
            }
#pragma GCC unroll 3
            for (int h = 0; h < 3; ++h) {
                if (h >= hn) break;
                const __m128 sc = _mm_mul_ps(hsum4_avx2(t[h][0], t[h][1], t[h][2], t[h][3]),
                                             vscale);
                float *restrict wh = w + (h0 + h) * ws + p0;
                if (m == 4) {
                    _mm_storeu_ps(wh, sc);
                } else {
                    float tmp[4];
                    _mm_storeu_ps(tmp, sc);
                    for (int64_t j = 0; j < m; ++j) wh[j] = tmp[j];
                }
            }
        }
    }
}
#endif

/* acc[h * head_dim + d] = corr[h] * acc[h * head_dim + d] + sum_p w[h * ws + p] *
 * v[p * pos_stride + d] for the nh heads of one KV head (the online softmax's rescale
 * folded into the values' pass over acc). At head_dim 64 (the demo model's) a head's 64
 * sums stay in registers for the whole block, its V rows read from L1 after the first
 * head: 1.17x the whole kernel on the AVX2 EPYC against loading and storing them every
 * four rows, as other head sizes still do (docs/benchmarks.md, "Decode attention on
 * CPU"). */
static inline __attribute__((always_inline)) void values_f32(
    float *restrict acc, const float *restrict v, int64_t pos_stride, const float *restrict w,
    int64_t ws, int64_t nh, int64_t n, const int64_t head_dim, const float *restrict corr,
    const float *pf, int64_t pf_n, int64_t pf_stride)
{
    /* the V rows of the block ahead (pf_n of them, pf_stride apart), one per row read here,
     * for the first head (a burst of them stalled on the miss buffers) */
#if VL == 16
    /* with AVX-512 every head's sums (nh <= 4: 16 zmm) at once, a V row loaded once for
     * all of them: one head at a time, a head's 4 sums were 4 chains of dependent FMAs,
     * one position after another (the latency, not the FMA units, set the pace) */
    if (head_dim == 64) {
        vf a[4][4];
#pragma GCC unroll 4
        for (int h = 0; h < 4; ++h)
            if (h < nh)
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) a[h][j] = corr[h] * loadv(acc + h * 64 + VL * j);
        for (int64_t p = 0; p < n; ++p) {
            if (p < pf_n) prefetch_rows(pf + p * pf_stride, 1, 0, 64 * 4);
            const float *restrict vp = v + p * pos_stride;
            vf r[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) r[j] = loadv(vp + VL * j);
#pragma GCC unroll 4
            for (int h = 0; h < 4; ++h)
                if (h < nh) {
                    const float pr = w[h * ws + p];
#pragma GCC unroll 4
                    for (int j = 0; j < 4; ++j) a[h][j] += pr * r[j];
                }
        }
#pragma GCC unroll 4
        for (int h = 0; h < 4; ++h)
            if (h < nh)
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) memcpy(acc + h * 64 + VL * j, &a[h][j], sizeof(vf));
        return;
    }
#endif
    if (head_dim == 64) {
        for (int64_t h = 0; h < nh; ++h) {
            vf a[64 / VL];
            float *restrict ah = acc + h * 64;
#pragma GCC unroll 16
            for (int j = 0; j < 64 / VL; ++j) a[j] = corr[h] * loadv(ah + VL * j);
            const float *restrict wh = w + h * ws;
            for (int64_t p = 0; p < n; ++p) {
                if (h == 0 && p < pf_n) prefetch_rows(pf + p * pf_stride, 1, 0, 64 * 4);
                const float pr = wh[p];
                const float *restrict vp = v + p * pos_stride;
#pragma GCC unroll 16
                for (int j = 0; j < 64 / VL; ++j) a[j] += pr * loadv(vp + VL * j);
            }
#pragma GCC unroll 16
            for (int j = 0; j < 64 / VL; ++j) memcpy(ah + VL * j, &a[j], sizeof(vf));
        }
        return;
    }
    scale_rows(acc, nh, head_dim, corr);
    if (pf_n > 0) prefetch_rows(pf, pf_n, pf_stride * 4, head_dim * 4);
    int64_t p = 0;
    for (; p + 4 <= n; p += 4) {
        const float *restrict v0 = v + p * pos_stride, *restrict v1 = v0 + pos_stride,
                    *restrict v2 = v1 + pos_stride, *restrict v3 = v2 + pos_stride;
        for (int64_t h = 0; h < nh; ++h) {
            const float *restrict wh = w + h * ws + p;
            const float p0 = wh[0], p1 = wh[1], p2 = wh[2], p3 = wh[3];
            float *restrict a = acc + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d)
                a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
        }
    }
    for (; p < n; ++p)
        for (int64_t h = 0; h < nh; ++h) {
            const float *restrict vp = v + p * pos_stride;
            const float pr = w[h * ws + p];
            float *restrict a = acc + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += pr * vp[d];
        }
}

#endif
