/* Native CPU kernel: causal attention of prefill chunks (sequences with several new query
 * tokens) straight from the paged block cache, float32 and bfloat16 (float32 sums).
 *
 * The PyTorch reference gathers each chunk's K/V out of the blocks and runs SDPA once per
 * chunk and layer; at the offline workload's sizes (chunks of 32-512 tokens, 9 heads of
 * 64) SDPA's CPU kernel reached about 12 GFLOP/s in bfloat16 and float32 alike, most of it
 * per-call overhead, so prefill attention cost ~9 % of a run for a few GFLOP of work.
 *
 * Work item: one KV head of one sequence and a tile of PF_TILE consecutive query
 * positions, i.e. PF_TILE x group query rows that read the same keys. Keys come in chunks
 * of PF_KEYS positions: K transposed into a [head_dim][PF_KEYS] scratch (so scores are
 * vector FMAs with q[d] broadcast, PF_RB rows at a time, no horizontal sums), V as rows;
 * both converted to float32 once per chunk and shared by the tile's rows. Each row keeps
 * an online softmax (running max m, sum l, exp-weighted values acc; see
 * decode_attention.h). The mask is causal, aligned bottom-right: query i of a sequence
 * with q new tokens and seq_len positions sees keys 0 .. seq_len - q + i.
 */
#include "bf16.h"
#include "common.h"

#include <math.h>

#define PF_TILE 16
#define PF_KEYS 32
#define PF_NV (PF_KEYS / VL)
/* Query rows scored together against a chunk: 8 chains of vector sums (16 with 4-float
 * vectors), as many as keep both FMA units busy through the FMA latency. */
#define PF_RB (8 / PF_NV > 0 ? 8 / PF_NV : 1)
/* Values: two rows x PV_NV vectors of a row's dimensions per pass over the chunk's keys. */
#define PV_NV 4

typedef struct {
    int64_t seq, kv_head, q0, q1; /* query positions [q0, q1) of the chunk */
} prefill_item;

/* n elements at src (float32 or bfloat16) as float32 */
static inline void load_row(float *restrict dst, const void *restrict src, int64_t n,
                            int is_bf16)
{
    if (is_bf16) {
        const bf16 *restrict s = src;
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

static inline void store_row(void *restrict dst, const float *restrict src, float mul,
                             int64_t n, int is_bf16)
{
    if (is_bf16) {
        bf16 *restrict o = dst;
        for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(src[i] * mul);
    } else {
        float *restrict o = dst;
        for (int64_t i = 0; i < n; ++i) o[i] = src[i] * mul;
    }
}

typedef struct {
    const char *query, *k_cache, *v_cache;
    int64_t q_row_stride, q_head_stride; /* in elements */
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *seq_lens, *query_start_loc;
    int64_t num_kv_heads, group, head_dim, dim_padded, block_size;
    float scale;
    char *out;
    int64_t o_row_stride, o_head_stride;
    int is_bf16;
    size_t esize;
} prefill_args;

/* rows of a tile's scratch: its PF_TILE x group query rows, plus PF_RB - 1 zero rows that a
 * last, partial score block reads */
static inline int64_t tile_rows(const prefill_args *a) { return PF_TILE * a->group + PF_RB; }

/* Scratch of one thread, float32: q and acc [tile_rows][dim_padded], m, l and corr
 * [tile_rows], scores [tile_rows][PF_KEYS], kt [head_dim][PF_KEYS], v [PF_KEYS][dim_padded],
 * row [dim_padded]. */
static size_t scratch_floats(const prefill_args *a)
{
    const size_t rows = (size_t)tile_rows(a), dp = (size_t)a->dim_padded;
    return 2 * rows * dp + 3 * rows + rows * PF_KEYS + (size_t)a->head_dim * PF_KEYS
           + PF_KEYS * dp + dp;
}

/* Scores of PF_RB query rows (q, stride dp, already scaled) against the chunk's keys
 * (kt [d_n][PF_KEYS]) into s [PF_RB][PF_KEYS]: PF_RB x PF_NV sums in registers, q[d]
 * broadcast. */
static inline __attribute__((always_inline)) void score_block(
    const float *restrict q, int64_t dp, const float *restrict kt, int64_t d_n,
    float *restrict s)
{
    vf c[PF_RB][PF_NV] = {{{0}}};
    for (int64_t d = 0; d < d_n; ++d) {
        vf k[PF_NV];
        for (int v = 0; v < PF_NV; ++v) k[v] = loadv(kt + d * PF_KEYS + v * VL);
        for (int b = 0; b < PF_RB; ++b) {
            const float qd = q[b * dp + d];
            for (int v = 0; v < PF_NV; ++v) c[b][v] += qd * k[v];
        }
    }
    memcpy(s, c, sizeof c);
}

/* acc rows a0 and a1 (a1 NULL: one row) = acc * corr + w . v over the chunk's n keys, for
 * nv vectors of dimensions from d0 (nv a constant where inlined). */
static inline __attribute__((always_inline)) void values_block(
    float *restrict a0, float c0, const float *restrict w0, float *restrict a1, float c1,
    const float *restrict w1, const float *restrict vv, int64_t dp, int64_t n, int64_t d0,
    const int nv)
{
    vf o0[PV_NV], o1[PV_NV];
    for (int v = 0; v < nv; ++v) {
        o0[v] = loadv(a0 + d0 + v * VL) * c0;
        o1[v] = a1 ? loadv(a1 + d0 + v * VL) * c1 : o0[v];
    }
    for (int64_t j = 0; j < n; ++j) {
        const float p0 = w0[j], p1 = a1 ? w1[j] : 0.0f;
        for (int v = 0; v < nv; ++v) {
            const vf x = loadv(vv + j * dp + d0 + v * VL);
            o0[v] += p0 * x;
            o1[v] += p1 * x;
        }
    }
    for (int v = 0; v < nv; ++v) {
        memcpy(a0 + d0 + v * VL, &o0[v], sizeof(vf));
        if (a1) memcpy(a1 + d0 + v * VL, &o1[v], sizeof(vf));
    }
}

static void values_rows(float *restrict a0, float c0, const float *restrict w0,
                        float *restrict a1, float c1, const float *restrict w1,
                        const float *restrict vv, int64_t dp, int64_t n)
{
    int64_t d0 = 0;
    for (; d0 + PV_NV * VL <= dp; d0 += PV_NV * VL)
        values_block(a0, c0, w0, a1, c1, w1, vv, dp, n, d0, PV_NV);
    for (; d0 < dp; d0 += VL)
        values_block(a0, c0, w0, a1, c1, w1, vv, dp, n, d0, 1);
}

/* Online softmax of one row's chunk scores w (keys past nv masked): w becomes
 * exp(score - m_new) (0 where masked); m, l updated; returns exp(m_old - m_new), the factor
 * the row's acc is scaled by. */
static inline float softmax_row(float *restrict w, int64_t nv, float *restrict m,
                                float *restrict l)
{
    float bm = *m;
    for (int64_t j = 0; j < nv; ++j) bm = w[j] > bm ? w[j] : bm;
    vf vsum = {0};
    for (int v = 0; v < PF_NV; ++v) {
        vf e = exp_nonpositive_v(loadv(w + v * VL) - bm);
        for (int k = 0; k < VL; ++k)
            if (v * VL + k >= nv) e[k] = 0.0f;
        memcpy(w + v * VL, &e, sizeof e);
        vsum += e;
    }
    float sum = 0.0f;
    for (int k = 0; k < VL; ++k) sum += vsum[k];
    /* m = -inf (nothing seen yet): l and acc are zero, any factor keeps them so */
    const float corr = *m == bm ? 1.0f : exp_nonpositive(*m - bm);
    *l = *l * corr + sum;
    *m = bm;
    return corr;
}

static void prefill_tile(const prefill_args *a, const prefill_item it, float *scratch)
{
    const int64_t group = a->group, d_n = a->head_dim, dp = a->dim_padded;
    const int64_t rows = (it.q1 - it.q0) * group, all = tile_rows(a);
    float *restrict qs = scratch;
    float *restrict acc = qs + all * dp;
    float *restrict m = acc + all * dp;
    float *restrict l = m + all;
    float *restrict corr = l + all;
    float *restrict sc = corr + all;
    float *restrict kt = sc + all * PF_KEYS;
    float *restrict vv = kt + d_n * PF_KEYS;
    float *restrict tmp = vv + PF_KEYS * dp;

    const int64_t seq_len = a->seq_lens[it.seq];
    const int64_t first_row = a->query_start_loc[it.seq];
    const int64_t q_len = a->query_start_loc[it.seq + 1] - first_row;
    const int64_t ctx = seq_len - q_len; /* positions cached before the chunk */
    const int32_t *table = a->block_tables + it.seq * a->table_stride;

    /* q and acc, their padding and the spare rows past `rows` too */
    memset(qs, 0, sizeof(float) * (size_t)(2 * all * dp));
    memset(vv, 0, sizeof(float) * (size_t)(PF_KEYS * dp));
    for (int64_t qi = 0; qi < it.q1 - it.q0; ++qi)
        for (int64_t h = 0; h < group; ++h) {
            const int64_t r = qi * group + h;
            const char *src = a->query + ((first_row + it.q0 + qi) * a->q_row_stride
                                          + (it.kv_head * group + h) * a->q_head_stride)
                                             * (int64_t)a->esize;
            load_row(qs + r * dp, src, d_n, a->is_bf16);
            for (int64_t d = 0; d < d_n; ++d) qs[r * dp + d] *= a->scale;
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }

    const int64_t key_end = ctx + it.q1; /* the tile's last row sees keys below this */
    const int64_t row_bytes = d_n * (int64_t)a->esize;
    for (int64_t c0 = 0; c0 < key_end; c0 += PF_KEYS) {
        const int64_t n = key_end - c0 < PF_KEYS ? key_end - c0 : PF_KEYS;
        for (int64_t j = 0; j < PF_KEYS; ++j) {
            if (j >= n) { /* keys past the chunk's end: zero, never read from the cache */
                for (int64_t d = 0; d < d_n; ++d) kt[d * PF_KEYS + j] = 0.0f;
                memset(vv + j * dp, 0, sizeof(float) * (size_t)dp);
                continue;
            }
            const int64_t pos = c0 + j;
            const int64_t at = (((int64_t)table[pos / a->block_size] * a->block_size
                                 + pos % a->block_size) * a->num_kv_heads + it.kv_head)
                               * row_bytes;
            load_row(tmp, a->k_cache + at, d_n, a->is_bf16);
            for (int64_t d = 0; d < d_n; ++d) kt[d * PF_KEYS + j] = tmp[d];
            load_row(vv + j * dp, a->v_cache + at, d_n, a->is_bf16);
        }
        /* rows before r_lo see no key of this chunk (causal) */
        const int64_t qi_lo = c0 - ctx - it.q0 > 0 ? c0 - ctx - it.q0 : 0;
        const int64_t r_lo = qi_lo * group;
        for (int64_t r = r_lo; r < rows; r += PF_RB)
            score_block(qs + r * dp, dp, kt, d_n, sc + r * PF_KEYS);
        for (int64_t r = r_lo; r < rows; ++r) {
            const int64_t visible = ctx + it.q0 + r / group + 1 - c0;
            corr[r] = softmax_row(sc + r * PF_KEYS, visible < n ? visible : n, m + r, l + r);
        }
        int64_t r = r_lo;
        for (; r + 2 <= rows; r += 2)
            values_rows(acc + r * dp, corr[r], sc + r * PF_KEYS, acc + (r + 1) * dp,
                        corr[r + 1], sc + (r + 1) * PF_KEYS, vv, dp, n);
        if (r < rows)
            values_rows(acc + r * dp, corr[r], sc + r * PF_KEYS, NULL, 0.0f, NULL, vv, dp, n);
    }
    for (int64_t qi = 0; qi < it.q1 - it.q0; ++qi)
        for (int64_t h = 0; h < group; ++h) {
            const int64_t r = qi * group + h;
            char *dst = a->out + ((first_row + it.q0 + qi) * a->o_row_stride
                                  + (it.kv_head * group + h) * a->o_head_stride)
                                     * (int64_t)a->esize;
            store_row(dst, acc + r * dp, 1.0f / l[r], d_n, a->is_bf16);
        }
}

/* Attention of the query rows of sequences seq_ids (each with query_start_loc[s + 1] -
 * query_start_loc[s] new tokens, already stored in the cache) over their cached keys;
 * query and out [num_tokens, num_heads, head_dim] with unit last stride, the caches
 * [num_blocks, block_size, num_kv_heads, head_dim] contiguous; is_bf16: every tensor is
 * bfloat16, else float32. Returns 0, or -1 when scratch memory could not be allocated. */
int paged_prefill_attention(
    const void *query, int64_t q_row_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seq_ids,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, void *out, int64_t o_row_stride, int64_t o_head_stride,
    int is_bf16, int num_threads)
{
    const prefill_args a = {
        query, k_cache, v_cache, q_row_stride, q_head_stride, block_tables, table_stride,
        seq_lens, query_start_loc, num_kv_heads, num_heads / num_kv_heads, head_dim,
        (head_dim + VL - 1) / VL * VL, block_size, scale, out, o_row_stride, o_head_stride,
        is_bf16, is_bf16 ? sizeof(bf16) : sizeof(float)};
    int64_t num_items = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t s = seq_ids[i];
        num_items += (query_start_loc[s + 1] - query_start_loc[s] + PF_TILE - 1) / PF_TILE;
    }
    num_items *= num_kv_heads;
    prefill_item *items = malloc(sizeof(prefill_item) * (size_t)(num_items ? num_items : 1));
    if (!items) return -1;
    /* the last tiles of a chunk see the most keys: they go first, so the dynamic schedule
     * ends on short items */
    int64_t n = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t s = seq_ids[i];
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        for (int64_t q0 = (q_len - 1) / PF_TILE * PF_TILE; q0 >= 0; q0 -= PF_TILE)
            for (int64_t g = 0; g < num_kv_heads; ++g)
                items[n++] = (prefill_item){s, g, q0, q0 + PF_TILE < q_len ? q0 + PF_TILE
                                                                            : q_len};
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats(&a));
        /* every thread must reach the worksharing loop, even one without scratch */
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < num_items; ++j) {
            if (!scratch) {
                failed = 1;
                continue;
            }
            prefill_tile(&a, items[j], scratch);
        }
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}
