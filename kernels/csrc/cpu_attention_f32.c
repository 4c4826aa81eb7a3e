/* Native CPU kernel (float32): paged decode attention straight from the block cache.
 *
 * The PyTorch reference gathers every sequence's K/V into a padded tensor in every layer
 * and then runs SDPA over it: three passes over memory, most of it padding when context
 * lengths vary. Here each sequence reads its own blocks once (decode_attention.h: K and V
 * of a block while it is hot, an online softmax), and nothing past its length is touched.
 *
 * The native kernels (this file, cpu_lora_f32.c and the bf16 ones) are compiled on first
 * use by loraplex_kernels.cpu_native (gcc -O3 -march=native -fopenmp) into one library
 * called through ctypes; OpenMP is the runtime torch already loaded (libgomp.so.1).
 */
#include "common.h"
#include "decode_attention.h"
#include "kernels.h"

/* Query heads scored together against each K row loaded (each head's q stays in
 * registers: 4 x head_dim / 16 vectors at head_dim 64). */
#define SCORE_HEADS 4

/* Scaled scores of `n` positions (K rows `k`, pos_stride apart) for `nh` <= SCORE_HEADS
 * query heads of one KV head: w[h * ws + p]. Portable: one dot product per (head,
 * position), four positions' chains at a time. */
static inline __attribute__((always_inline)) void scores_portable(
    const float *restrict q, int64_t q_head_stride, int64_t nh, const float *restrict k,
    int64_t pos_stride, int64_t n, const int64_t head_dim, float scale, float *restrict w,
    int64_t ws)
{
    int64_t p = 0;
    for (; p + 4 <= n; p += 4)
        for (int64_t h = 0; h < nh; ++h) {
            const float *restrict k0 = k + p * pos_stride, *restrict k1 = k0 + pos_stride,
                        *restrict k2 = k1 + pos_stride, *restrict k3 = k2 + pos_stride;
            const float *restrict qh = q + h * q_head_stride;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t d = 0; d < head_dim; ++d) {
                s0 += qh[d] * k0[d];
                s1 += qh[d] * k1[d];
                s2 += qh[d] * k2[d];
                s3 += qh[d] * k3[d];
            }
            float *restrict wh = w + h * ws + p;
            wh[0] = s0 * scale;
            wh[1] = s1 * scale;
            wh[2] = s2 * scale;
            wh[3] = s3 * scale;
        }
    for (; p < n; ++p)
        for (int64_t h = 0; h < nh; ++h) {
            const float *restrict kp = k + p * pos_stride;
            const float *restrict qh = q + h * q_head_stride;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kp[d];
            w[h * ws + p] = s * scale;
        }
}

#ifdef __AVX512F__
/* scores_portable with head_dim a multiple of 16: per K row, one FMA chain per head with
 * the 16 dimension lanes kept apart, reduced across 16 positions at once. Rows past n
 * repeat the last one (their sums are never stored): constant trip counts, so the sums
 * stay in registers (a bound of n on the rows kept them on the stack). */
static inline __attribute__((always_inline)) void scores_avx512(
    const float *restrict q, int64_t q_head_stride, const int64_t nh,
    const float *restrict k, int64_t pos_stride, int64_t n, const int64_t head_dim,
    float scale, float *restrict w, int64_t ws, const float *pf, int64_t pf_n)
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
                const float *restrict kr = k + (p0 + r) * pos_stride;
                if (p0 + 4 * c + j < pf_n)
                    prefetch_rows(pf + (p0 + 4 * c + j) * pos_stride, 1, 0, head_dim * 4);
                for (int64_t d = 0; d < head_dim; d += 16) {
                    const __m512 kv = _mm512_loadu_ps(kr + d);
#pragma GCC unroll 4
                    for (int h = 0; h < SCORE_HEADS; ++h)
                        if (h < nh)
                            t[h][j] = _mm512_fmadd_ps(
                                _mm512_loadu_ps(q + h * q_head_stride + d), kv, t[h][j]);
                }
            }
            scores_reduce4(u, t, c, nh);
        }
        scores_store16(w + p0, ws, u, nh, m, vscale);
    }
}
#endif

/* Positions [begin, end) of one sequence (begin anywhere in its block: a sliding window's
 * start, or a split part's block boundary), every head, into the running state m, l
 * [heads], acc [heads * head_dim] (started here); scores soft-capped at `softcap` (0:
 * not). Scratch: w [SCORE_HEADS * block_size]. `vector`: the AVX-512 (or AVX2) scores. */
static inline __attribute__((always_inline)) void decode_range(
    const float *restrict q, int64_t q_head_stride,
    const float *restrict k_cache, const float *restrict v_cache, const int32_t *restrict table,
    int64_t begin, int64_t end, int64_t kv_heads, int64_t group, const int64_t head_dim,
    int64_t block_size, float scale, float softcap, int vector, float *restrict m,
    float *restrict l, float *restrict acc, float *restrict w)
{
    const int64_t heads = kv_heads * group;
    const int64_t pos_stride = kv_heads * head_dim;
    const int64_t block_stride = block_size * pos_stride;
    for (int64_t h = 0; h < heads; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int64_t j = 0; j < heads * head_dim; ++j) acc[j] = 0.0f;
    float corr[SCORE_HEADS];
    prefetch_first_blocks(k_cache, v_cache, table, begin, end, block_size, block_stride * 4);
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
            const float *restrict kb = k_cache + off + kh * head_dim;
            const float *restrict vb = v_cache + off + kh * head_dim;
            /* the block ahead: the AVX-512 scores and the values spread its rows'
             * prefetches over their own rows' loads (a burst of them stalled on the miss
             * buffers); the other scores prefetch its K rows at once */
            const float *pk = k_cache + next + kh * head_dim, *pv = v_cache + next + kh * head_dim;
            int64_t pf_n = next_n > 0 ? next_n : 0;
#ifdef __AVX512F__
            const int spread_k = vector;
#else
            const int spread_k = 0;
#endif
            if (pf_n > 0 && !spread_k) prefetch_rows(pk, pf_n, pos_stride * 4, head_dim * 4);
            for (int64_t g0 = 0; g0 < group; g0 += SCORE_HEADS) {
                const int64_t nh = group - g0 < SCORE_HEADS ? group - g0 : SCORE_HEADS;
                const int64_t h0 = kh * group + g0;
                const float *restrict qh = q + h0 * q_head_stride;
#ifdef __AVX512F__
                if (vector && nh == SCORE_HEADS)
                    scores_avx512(qh, q_head_stride, SCORE_HEADS, kb, pos_stride, n, head_dim,
                                  scale, w, block_size, pk, pf_n);
                else if (vector && nh == 3)
                    scores_avx512(qh, q_head_stride, 3, kb, pos_stride, n, head_dim, scale,
                                  w, block_size, pk, pf_n);
                else if (vector)
                    scores_avx512(qh, q_head_stride, nh, kb, pos_stride, n, head_dim, scale,
                                  w, block_size, pk, pf_n);
                else
#elif defined(SCORES_AVX2)
                if (vector && nh == 3)
                    scores_avx2(qh, q_head_stride, 3, kb, pos_stride, n, head_dim, scale, w,
                                block_size);
                else if (vector)
                    scores_avx2(qh, q_head_stride, nh, kb, pos_stride, n, head_dim, scale, w,
                                block_size);
                else
#endif
                    scores_portable(qh, q_head_stride, nh, kb, pos_stride, n, head_dim,
                                    scale, w, block_size);
                softcap_block(w, block_size, nh, n, softcap);
                online_softmax_block(w, block_size, nh, n, m + h0, l + h0, corr);
                /* the demo model's group of 3 as a constant: its sums in registers */
                if (nh == 3)
                    values_f32(acc + h0 * head_dim, vb, pos_stride, w, block_size, 3, n,
                               head_dim, corr, pv, pf_n, pos_stride);
                else
                    values_f32(acc + h0 * head_dim, vb, pos_stride, w, block_size, nh, n,
                               head_dim, corr, pv, pf_n, pos_stride);
                pf_n = 0; /* the group's next heads: prefetched already */
            }
        }
    }
}

static inline void write_out(const float *restrict acc, const float *restrict l, int64_t heads,
                             int64_t head_dim, float *restrict o, int64_t o_head_stride)
{
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d)
            o[h * o_head_stride + d] = acc[h * head_dim + d] * inv;
    }
}

/* One thread's part of the call's work: its scratch, the items shared out (an `omp for`
 * that every thread of the team reaches, no barrier after: the region's end, or the
 * caller's wait, is that barrier; a merge of split sequences keeps its own). 1 where
 * scratch memory failed, else 0. */
static int attention_share_f32(
    const float *query, int64_t q_row_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int64_t *seq_ids, const int64_t *rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float softcap,
    float *out, int64_t o_row_stride, int64_t o_head_stride, int vector, int64_t group,
    const decode_item *items, int64_t num_items, int split, float *parts)
{
    const int64_t state = num_heads * (2 + head_dim);
    float *ms = parts, *ls = parts + num_items * num_heads, *accs = ls + num_items * num_heads;
    int failed = 0;
    float *own = malloc(sizeof(float) * (size_t)(state + SCORE_HEADS * block_size));
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
        const float *q = query + row * q_row_stride;
        const int whole = it.parts == 1;
        float *m = whole ? own : ms + j * num_heads;
        float *l = whole ? own + num_heads : ls + j * num_heads;
        float *acc = whole ? own + 2 * num_heads : accs + j * num_heads * head_dim;
        float *w = own + state;
        if (head_dim == 64)
            decode_range(q, q_head_stride, k_cache, v_cache, table, it.begin, it.end,
                         num_kv_heads, group, 64, block_size, scale, softcap, vector, m, l,
                         acc, w);
        else
            decode_range(q, q_head_stride, k_cache, v_cache, table, it.begin, it.end,
                         num_kv_heads, group, head_dim, block_size, scale, softcap, vector,
                         m, l, acc, w);
        if (whole)
            write_out(acc, l, num_heads, head_dim, out + row * o_row_stride, o_head_stride);
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
            write_out(acc, ls + j * num_heads, num_heads, head_dim,
                      out + rows[it.seq] * o_row_stride, o_head_stride);
        }
    }
    free(own);
    return failed;
}

/* query:  rows of [num_heads, head_dim], row r at query + r * q_row_stride (head stride
 *         q_head_stride, element stride 1)
 * k/v:    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 * block_tables: [num_all_seqs, table_stride] int32
 * seq_ids/rows/seq_lens_all: for each of num_seqs decode sequences, its index into the
 *         block tables and seq_lens, and its query (= output) row
 * out:    like query (o_row_stride, o_head_stride)
 * window: a sliding window of that many keys, the row's own included (0: every key);
 *         the blocks wholly before it are never read (their table entries may be stale)
 * softcap: scores s become softcap * tanh(s / softcap) (0: unchanged)
 * Returns 0, or -1 when scratch memory could not be allocated. */
int paged_decode_attention_f32(
    const float *query, int64_t q_row_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens_all, const int64_t *seq_ids, const int64_t *rows,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale,
    float *out, int64_t o_row_stride, int64_t o_head_stride, int num_threads,
    int64_t window, float softcap)
{
    const int64_t group = num_heads / num_kv_heads;
#ifdef __AVX512F__
    const int vector = head_dim % 16 == 0;
#elif defined(SCORES_AVX2)
    const int vector = head_dim % 8 == 0;
#else
    const int vector = 0;
#endif
    int64_t num_items = 0;
    int split = 0;
    /* called by every thread of a region (num_threads 0): a sequence per item, none split */
    decode_item *items = decode_items(seq_lens_all, seq_ids, num_seqs, block_size,
                                      num_threads ? num_threads : 1, window, &num_items,
                                      &split);
    if (!items) return -1;
    /* a split sequence's parts keep their states here until merged: m, l
     * [num_items, heads] and acc [num_items, heads, head_dim] */
    const int64_t state = num_heads * (2 + head_dim);
    float *parts = split ? malloc(sizeof(float) * (size_t)(num_items * state)) : NULL;
    int failed = split && !parts;
#define SHARE                                                                           \
    attention_share_f32(query, q_row_stride, q_head_stride, k_cache, v_cache,           \
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
