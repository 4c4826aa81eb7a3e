/* Native CPU kernels (float32): paged decode attention straight from the block cache, and
 * LoRA shrink + expand for many short segments (decode tokens) in one call.
 *
 * The PyTorch reference gathers every sequence's K/V into a padded tensor in every layer
 * and then runs SDPA over it: three passes over memory, most of it padding when context
 * lengths vary. Here each sequence reads its own blocks once for the scores and once for
 * the values, and nothing past its length is touched.
 *
 * Compiled on first use by loraplex_kernels.cpu_native (gcc -O3 -march=native -fopenmp)
 * and called through ctypes; OpenMP is the runtime torch already loaded (libgomp.so.1).
 */
#include "common.h"

/* One sequence, every head: `kv_heads` groups of `group` query heads over the sequence's
 * `len` cached positions, reading each cached position's K (then V) row for all KV heads
 * at once, so each block is one contiguous read. `head_dim` is a compile-time constant at
 * the hot call site (64), so the inner loops unroll into whole vectors.
 * Scratch: scores [num_heads * len], acc [num_heads * head_dim]. */
static inline __attribute__((always_inline)) void decode_one(
    const float *restrict q, int64_t q_head_stride,
    const float *restrict k_cache, const float *restrict v_cache, const int32_t *restrict table,
    int64_t len, int64_t kv_heads, int64_t group, const int64_t head_dim, int64_t block_size,
    float scale, float *restrict scores, float *restrict acc, float *restrict o,
    int64_t o_head_stride)
{
    const int64_t heads = kv_heads * group;
    const int64_t pos_stride = kv_heads * head_dim;
    const int64_t block_stride = block_size * pos_stride;
    /* each query head's KV head, without a division in the inner loops */
    int64_t kv_of[heads];
    for (int64_t h = 0; h < heads; ++h) kv_of[h] = h / group;
    /* pass 1: scaled scores, head-major: scores[h * len + p] */
    for (int64_t pos0 = 0; pos0 < len; pos0 += block_size) {
        const float *restrict kb = k_cache + (int64_t)table[pos0 / block_size] * block_stride;
        const int64_t n = len - pos0 < block_size ? len - pos0 : block_size;
        int64_t p = 0;
        /* four positions at a time: four independent dot-product chains per head */
        for (; p + 4 <= n; p += 4) {
            for (int64_t h = 0; h < heads; ++h) {
                const float *restrict k0 = kb + p * pos_stride + kv_of[h] * head_dim;
                const float *restrict k1 = k0 + pos_stride;
                const float *restrict k2 = k1 + pos_stride;
                const float *restrict k3 = k2 + pos_stride;
                const float *restrict qh = q + h * q_head_stride;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t d = 0; d < head_dim; ++d) {
                    s0 += qh[d] * k0[d];
                    s1 += qh[d] * k1[d];
                    s2 += qh[d] * k2[d];
                    s3 += qh[d] * k3[d];
                }
                float *restrict sh = scores + h * len + pos0 + p;
                sh[0] = s0 * scale;
                sh[1] = s1 * scale;
                sh[2] = s2 * scale;
                sh[3] = s3 * scale;
            }
        }
        for (; p < n; ++p) {
            for (int64_t h = 0; h < heads; ++h) {
                const float *restrict k = kb + p * pos_stride + kv_of[h] * head_dim;
                const float *restrict qh = q + h * q_head_stride;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * k[d];
                scores[h * len + pos0 + p] = s * scale;
            }
        }
    }
    softmax_rows(scores, heads, len);
    /* pass 2: probability-weighted values */
    for (int64_t j = 0; j < heads * head_dim; ++j) acc[j] = 0.0f;
    for (int64_t pos0 = 0; pos0 < len; pos0 += block_size) {
        const float *restrict vb = v_cache + (int64_t)table[pos0 / block_size] * block_stride;
        const int64_t n = len - pos0 < block_size ? len - pos0 : block_size;
        int64_t p = 0;
        for (; p + 4 <= n; p += 4) {
            for (int64_t h = 0; h < heads; ++h) {
                const float *restrict v0 = vb + p * pos_stride + kv_of[h] * head_dim;
                const float *restrict v1 = v0 + pos_stride;
                const float *restrict v2 = v1 + pos_stride;
                const float *restrict v3 = v2 + pos_stride;
                const float *restrict sh = scores + h * len + pos0 + p;
                const float p0 = sh[0], p1 = sh[1], p2 = sh[2], p3 = sh[3];
                float *restrict a = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d)
                    a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
            }
        }
        for (; p < n; ++p) {
            for (int64_t h = 0; h < heads; ++h) {
                const float *restrict v = vb + p * pos_stride + kv_of[h] * head_dim;
                const float pr = scores[h * len + pos0 + p];
                float *restrict a = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += pr * v[d];
            }
        }
    }
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d) o[h * o_head_stride + d] = acc[h * head_dim + d];
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
    int64_t max_len = 1;
    for (int64_t i = 0; i < num_seqs; ++i)
        if (seq_lens_all[seq_ids[i]] > max_len) max_len = seq_lens_all[seq_ids[i]];
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_len));
        float *acc = malloc(sizeof(float) * (size_t)(num_heads * head_dim));
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
            const float *q = query + row * q_row_stride;
            float *o = out + row * o_row_stride;
            if (head_dim == 64)
                decode_one(q, q_head_stride, k_cache, v_cache, table, seq_lens_all[seq],
                           num_kv_heads, group, 64, block_size, scale, scores, acc, o,
                           o_head_stride);
            else
                decode_one(q, q_head_stride, k_cache, v_cache, table, seq_lens_all[seq],
                           num_kv_heads, group, head_dim, block_size, scale, scores, acc, o,
                           o_head_stride);
        }
        free(scores);
        free(acc);
    }
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
