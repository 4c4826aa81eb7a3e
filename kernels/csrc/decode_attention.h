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

#ifdef __AVX512F__
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

/* One item per sequence, or, when there are fewer sequences than threads, each long
 * enough sequence cut into up to ceil(threads / num_seqs) ranges of whole blocks.
 * *split set when any sequence was cut. NULL when out of memory. */
static inline decode_item *decode_items(const int32_t *seq_lens_all, const int64_t *seq_ids,
                                        int64_t num_seqs, int64_t block_size,
                                        int num_threads, int64_t *num_items, int *split)
{
    const int64_t want = num_seqs < num_threads ? (num_threads + num_seqs - 1) / num_seqs : 1;
    decode_item *items = malloc(sizeof(decode_item) * (size_t)(num_seqs * want + 1));
    if (!items) return NULL;
    int64_t n = 0;
    *split = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t len = seq_lens_all[seq_ids[i]];
        const int64_t blocks = (len + block_size - 1) / block_size;
        int64_t parts = blocks / DECODE_MIN_SPLIT_BLOCKS;
        parts = parts < want ? parts : want;
        parts = parts < 1 ? 1 : parts;
        *split |= parts > 1;
        for (int64_t k = 0; k < parts; ++k) {
            const int64_t b0 = blocks * k / parts, b1 = blocks * (k + 1) / parts;
            const int64_t end = b1 * block_size < len ? b1 * block_size : len;
            items[n + k] = (decode_item){i, b0 * block_size, end, k, parts};
        }
        n += parts;
    }
    *num_items = n;
    return items;
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
 * before the loop that prefetches ahead of itself starts */
static inline void prefetch_first_blocks(const void *k_cache, const void *v_cache,
                                         const int32_t *table, int64_t begin, int64_t end,
                                         int64_t block_size, int64_t block_bytes)
{
    for (int64_t j = 0; j < DECODE_PREFETCH_BLOCKS; ++j) {
        const int64_t pos0 = begin + j * block_size;
        if (pos0 >= end) break;
        const int64_t n = end - pos0 < block_size ? end - pos0 : block_size;
        const int64_t off = (int64_t)table[pos0 / block_size] * block_bytes;
        prefetch_rows((const char *)k_cache + off, 1, 0, block_bytes / block_size * n);
        prefetch_rows((const char *)v_cache + off, 1, 0, block_bytes / block_size * n);
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

#endif

#endif
