/* Native CPU kernels (float32): paged decode attention straight from the block cache, and
 * LoRA shrink + expand for many short segments (decode tokens) in one call.
 *
 * The PyTorch reference gathers every sequence's K/V into a padded tensor in every layer
 * and then runs SDPA over it: three passes over memory, most of it padding when context
 * lengths vary. Here each sequence reads its own blocks once (decode_attention.h: K and V
 * of a block while it is hot, an online softmax), and nothing past its length is touched.
 *
 * Compiled on first use by loraplex_kernels.cpu_native (gcc -O3 -march=native -fopenmp)
 * and called through ctypes; OpenMP is the runtime torch already loaded (libgomp.so.1).
 */
#include "common.h"
#include "decode_attention.h"

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
 * the 16 dimension lanes kept apart, reduced across 16 positions at once. Rows past n are
 * never loaded (zeros stand in). */
static inline __attribute__((always_inline)) void scores_avx512(
    const float *restrict q, int64_t q_head_stride, const int64_t nh,
    const float *restrict k, int64_t pos_stride, int64_t n, const int64_t head_dim,
    float scale, float *restrict w, int64_t ws)
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
                const float *restrict kr = k + (p0 + 4 * c + j) * pos_stride;
                for (int64_t d = 0; d < head_dim; d += 16) {
                    const __m512 kv = _mm512_loadu_ps(kr + d);
                    for (int64_t h = 0; h < nh; ++h)
                        t[h][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * q_head_stride + d),
                                                  kv, t[h][j]);
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
#endif

/* acc[h * head_dim + d] += sum_p w[h * ws + p] * v[p * pos_stride + d] for the nh heads
 * of one KV head: each V row read once for all of them, four rows per acc update. */
static inline __attribute__((always_inline)) void values_f32(
    float *restrict acc, const float *restrict v, int64_t pos_stride, const float *restrict w,
    int64_t ws, int64_t nh, int64_t n, const int64_t head_dim)
{
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

/* Positions [begin, end) of one sequence (begin on a block boundary), every head, into
 * the running state m, l [heads], acc [heads * head_dim] (started here).
 * Scratch: w [SCORE_HEADS * block_size]. `vector`: the AVX-512 scores. */
static inline __attribute__((always_inline)) void decode_range(
    const float *restrict q, int64_t q_head_stride,
    const float *restrict k_cache, const float *restrict v_cache, const int32_t *restrict table,
    int64_t begin, int64_t end, int64_t kv_heads, int64_t group, const int64_t head_dim,
    int64_t block_size, float scale, int vector, float *restrict m, float *restrict l,
    float *restrict acc, float *restrict w)
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
    for (int64_t pos0 = begin; pos0 < end; pos0 += block_size) {
        const int64_t blk = pos0 / block_size;
        const int64_t off = (int64_t)table[blk] * block_stride;
        const int64_t n = end - pos0 < block_size ? end - pos0 : block_size;
        const int64_t ahead = pos0 + DECODE_PREFETCH_BLOCKS * block_size;
        const int64_t next_n = end - ahead < block_size ? end - ahead : block_size;
        const int64_t next = next_n > 0
            ? (int64_t)table[blk + DECODE_PREFETCH_BLOCKS] * block_stride : 0;
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            const float *restrict kb = k_cache + off + kh * head_dim;
            const float *restrict vb = v_cache + off + kh * head_dim;
            if (next_n > 0) {
                prefetch_rows(k_cache + next + kh * head_dim, next_n, pos_stride * 4,
                              head_dim * 4);
                prefetch_rows(v_cache + next + kh * head_dim, next_n, pos_stride * 4,
                              head_dim * 4);
            }
            for (int64_t g0 = 0; g0 < group; g0 += SCORE_HEADS) {
                const int64_t nh = group - g0 < SCORE_HEADS ? group - g0 : SCORE_HEADS;
                const int64_t h0 = kh * group + g0;
                const float *restrict qh = q + h0 * q_head_stride;
#ifdef __AVX512F__
                if (vector && nh == SCORE_HEADS)
                    scores_avx512(qh, q_head_stride, SCORE_HEADS, kb, pos_stride, n, head_dim,
                                  scale, w, block_size);
                else if (vector && nh == 3)
                    scores_avx512(qh, q_head_stride, 3, kb, pos_stride, n, head_dim, scale,
                                  w, block_size);
                else if (vector)
                    scores_avx512(qh, q_head_stride, nh, kb, pos_stride, n, head_dim, scale,
                                  w, block_size);
                else
#endif
                    scores_portable(qh, q_head_stride, nh, kb, pos_stride, n, head_dim,
                                    scale, w, block_size);
                online_softmax_block(w, block_size, nh, n, m + h0, l + h0, corr);
                scale_rows(acc + h0 * head_dim, nh, head_dim, corr);
                values_f32(acc + h0 * head_dim, vb, pos_stride, w, block_size, nh, n,
                           head_dim);
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

/* query:  rows of [num_heads, head_dim], row r at query + r * q_row_stride (head stride
 *         q_head_stride, element stride 1)
 * k/v:    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 * block_tables: [num_all_seqs, table_stride] int32
 * seq_ids/rows/seq_lens_all: for each of num_seqs decode sequences, its index into the
 *         block tables and seq_lens, and its query (= output) row
 * out:    like query (o_row_stride, o_head_stride)
 * Returns 0, or -1 when scratch memory could not be allocated. */
int paged_decode_attention_f32(
    const float *query, int64_t q_row_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens_all, const int64_t *seq_ids, const int64_t *rows,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale,
    float *out, int64_t o_row_stride, int64_t o_head_stride, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
#ifdef __AVX512F__
    const int vector = head_dim % 16 == 0;
#else
    const int vector = 0;
#endif
    int64_t num_items = 0;
    int split = 0;
    decode_item *items = decode_items(seq_lens_all, seq_ids, num_seqs, block_size,
                                      num_threads, &num_items, &split);
    if (!items) return -1;
    /* a split sequence's parts keep their states here until merged: m, l
     * [num_items, heads] and acc [num_items, heads, head_dim] */
    const int64_t state = num_heads * (2 + head_dim);
    float *parts = split ? malloc(sizeof(float) * (size_t)(num_items * state)) : NULL;
    float *ms = parts, *ls = parts + num_items * num_heads, *accs = ls + num_items * num_heads;
    int failed = split && !parts;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *own = malloc(sizeof(float) * (size_t)(state + SCORE_HEADS * block_size));
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
            const float *q = query + row * q_row_stride;
            const int whole = it.parts == 1;
            float *m = whole ? own : ms + j * num_heads;
            float *l = whole ? own + num_heads : ls + j * num_heads;
            float *acc = whole ? own + 2 * num_heads : accs + j * num_heads * head_dim;
            float *w = own + state;
            if (head_dim == 64)
                decode_range(q, q_head_stride, k_cache, v_cache, table, it.begin, it.end,
                             num_kv_heads, group, 64, block_size, scale, vector, m, l, acc, w);
            else
                decode_range(q, q_head_stride, k_cache, v_cache, table, it.begin, it.end,
                             num_kv_heads, group, head_dim, block_size, scale, vector, m, l,
                             acc, w);
            if (whole)
                write_out(acc, l, num_heads, head_dim, out + row * o_row_stride, o_head_stride);
        }
        if (split) { /* after the barrier above: every part is done */
#pragma omp for schedule(dynamic, 1)
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
    }
    free(parts);
    free(items);
    return failed ? -1 : 0;
}

/* LoRA for up to 4 consecutive tokens of one slot, so each weight row loaded serves all
 * four. Ranks come padded to a multiple of 16 (zero rows), so the shrink keeps up to 64
 * ranks x 4 tokens in registers; the expand keeps 64 outputs x 4 tokens, so each out row is read
 * and written once. The expand runs per slice (lora_slots.py: `slices`), over that slice's
 * ranks and columns only: B^T is block-diagonal over a packed projection's slices, and the
 * blocks off the diagonal (2/3 of q/k/v's, 1/2 of gate/up's) are zero, so skipping them
 * changes no sum and saves their reads. xb: the tokens' x rows, zero-padded to 4 [4, in];
 * y: [4, r]; slices: num_slices x (first rank, end rank, first column, end column). */
#define LORA_TOKENS 4

/* 16 floats as one vector (GCC vector extension: one zmm with AVX-512, two ymm with AVX2),
 * so that a tile's sums are named values the compiler keeps in registers; as arrays indexed
 * in loops they were kept on the stack (a load and a store around every FMA). */
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The shrink of 4 tokens for ranks k0 .. k0 + 16 * nv (nv <= 4, a constant where it is
 * inlined): each row of A^T's tile is read once, as one contiguous run of up to 256 bytes,
 * and the 4 x nv vectors of sums stay in registers. y[t * r + k] = xb[t] . A^T[:, k]. */
static inline __attribute__((always_inline)) void shrink_ranks(
    const float *restrict xb, int64_t in_features, const float *restrict at, int64_t r,
    int64_t k0, const int nv, float *restrict y)
{
    v16 c[LORA_TOKENS][4] = {{{0}}};
    for (int64_t i = 0; i < in_features; ++i) {
        const float *restrict a = at + i * r + k0;
        v16 av[4];
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) av[j] = load16(a + 16 * j);
#pragma GCC unroll 4
        for (int t = 0; t < LORA_TOKENS; ++t) {
            const float v = xb[t * in_features + i];
#pragma GCC unroll 4
            for (int j = 0; j < nv; ++j) c[t][j] += v * av[j];
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < LORA_TOKENS; ++t)
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) memcpy(y + t * r + k0 + 16 * j, &c[t][j], sizeof(v16));
}

/* The expand of 4 tokens into 64 columns from o0, over ranks kb .. ke: out[t, o0 + o] +=
 * y[t] . B^T[kb:ke, o0 + o], the 4 x 4 vectors of sums in registers. */
static inline void expand_64(const float *restrict y, int64_t r, const float *restrict bt,
                             int64_t n_out, int64_t kb, int64_t ke, int64_t o0,
                             float *restrict out, int64_t out_stride, int64_t nt)
{
    v16 c[LORA_TOKENS][4] = {{{0}}};
    for (int64_t k = kb; k < ke; ++k) {
        const float *restrict b = bt + k * n_out + o0;
        const v16 b0 = load16(b), b1 = load16(b + 16), b2 = load16(b + 32), b3 = load16(b + 48);
#pragma GCC unroll 4
        for (int t = 0; t < LORA_TOKENS; ++t) {
            const float v = y[t * r + k];
            c[t][0] += v * b0;
            c[t][1] += v * b1;
            c[t][2] += v * b2;
            c[t][3] += v * b3;
        }
    }
    for (int64_t t = 0; t < nt; ++t)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
            float *o = out + t * out_stride + o0 + 16 * j;
            v16 sum = load16(o) + c[t][j];
            memcpy(o, &sum, sizeof sum);
        }
}

static void lora_tokens(const float *restrict xb, float *restrict out, int64_t out_stride,
                        int64_t nt, int64_t in_features, int64_t n_out,
                        const float *restrict at, const float *restrict bt, int64_t r,
                        const int64_t *restrict slices, int64_t num_slices, float *restrict y)
{
    int64_t k0 = 0;
    for (; k0 + 64 <= r; k0 += 64) shrink_ranks(xb, in_features, at, r, k0, 4, y);
    switch ((r - k0) / 16) { /* r is a multiple of 16 */
    case 3: shrink_ranks(xb, in_features, at, r, k0, 3, y); break;
    case 2: shrink_ranks(xb, in_features, at, r, k0, 2, y); break;
    case 1: shrink_ranks(xb, in_features, at, r, k0, 1, y); break;
    default: break;
    }
    for (int64_t s = 0; s < num_slices; ++s) {
        const int64_t kb = slices[4 * s], ke = slices[4 * s + 1];
        const int64_t lo = slices[4 * s + 2], hi = slices[4 * s + 3];
        int64_t o0 = lo;
        for (; o0 + 64 <= hi; o0 += 64) expand_64(y, r, bt, n_out, kb, ke, o0, out, out_stride, nt);
        for (int64_t t = 0; t < nt; ++t) /* the slice's last (hi - lo) % 64 columns */
            for (int64_t o = o0; o < hi; ++o) {
                float acc = 0.0f;
                for (int64_t k = kb; k < ke; ++k) acc += y[t * r + k] * bt[k * n_out + o];
                out[t * out_stride + o] += acc;
            }
    }
}

/* LoRA shrink then expand for every token of every segment, accumulated into out:
 *   out[t, :n_out] += (x[t] @ At_s) @ Bt_s      for the tokens t of segment i (slot s)
 * At_s [in, r_s] holds every slice's A (transposed) and Bt_s [r_s, n_out] the block-diagonal
 * B with the LoRA scale folded in (transposed), r_s padded with zeros to a multiple of 16;
 * slot s's slices are slice_table[s * max_slices * 4 ...], num_slices[s] of them (first
 * rank, end rank, first column, end column each). Tokens of one segment are consecutive rows
 * seg_first[i] .. seg_first[i] + seg_len[i] - 1; rows outside every segment (base model)
 * are never touched. Weights come as per-slot addresses (at_ptrs, bt_ptrs, ranks).
 * Returns 0, or -1 when scratch memory could not be allocated. */
int lora_segments_f32(
    const float *x, int64_t x_stride, float *out, int64_t out_stride,
    int64_t in_features, int64_t n_out,
    const int64_t *seg_first, const int64_t *seg_len, const int64_t *seg_slot,
    int64_t num_segs, const int64_t *at_ptrs, const int64_t *bt_ptrs, const int64_t *ranks,
    const int64_t *slice_table, const int64_t *num_slices, int64_t max_slices,
    int num_threads)
{
    int64_t num_groups = 0, max_rank = 1;
    for (int64_t i = 0; i < num_segs; ++i)
        if (ranks[seg_slot[i]] > max_rank) max_rank = ranks[seg_slot[i]];
    int64_t *work = lora_work_items(seg_first, seg_len, seg_slot, num_segs, LORA_TOKENS,
                                    &num_groups);
    if (!work) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *y = malloc(sizeof(float) * (size_t)(LORA_TOKENS * max_rank));
        float *xb = calloc((size_t)(LORA_TOKENS * in_features), sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_groups; ++w) {
            if (!y || !xb) {
                failed = 1;
                continue;
            }
            const int64_t t = work[3 * w], nt = work[3 * w + 1], slot = work[3 * w + 2];
            for (int64_t j = 0; j < LORA_TOKENS; ++j)
                if (j < nt)
                    memcpy(xb + j * in_features, x + (t + j) * x_stride,
                           sizeof(float) * (size_t)in_features);
                else
                    memset(xb + j * in_features, 0, sizeof(float) * (size_t)in_features);
            lora_tokens(xb, out + t * out_stride, out_stride, nt, in_features, n_out,
                        (const float *)(intptr_t)at_ptrs[slot],
                        (const float *)(intptr_t)bt_ptrs[slot], ranks[slot],
                        slice_table + slot * max_slices * 4, num_slices[slot], y);
        }
        free(y);
        free(xb);
    }
    free(work);
    return failed ? -1 : 0;
}
