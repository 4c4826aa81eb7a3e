/* Native CPU kernel: causal attention of prefill chunks (sequences with several new query
 * tokens) straight from the paged block cache, float32 and bfloat16 (float32 sums).
 *
 * The PyTorch reference gathers each chunk's K/V out of the blocks and runs SDPA once per
 * chunk and layer; at the offline workload's sizes (chunks of 32-512 tokens, 9 heads of
 * 64) SDPA's CPU kernel ran at 5-60 GFLOP/s in float32 and bfloat16 alike
 * (benchmarks/prefill_attention.py), and prefill attention took about 8 % of a bfloat16
 * run, the largest cost after the GEMMs and LoRA.
 *
 * Work item: one KV head of one sequence and a tile of PF_TILE consecutive query
 * positions, i.e. PF_TILE x group query rows that read the same keys, their q transposed
 * (a dimension's values of all rows side by side) and scaled once per item. Keys come in
 * chunks of PF_KEYS positions, K and V rows converted to float32 once per chunk. Scores
 * are computed transposed, a vector of VL query rows against PF_KB keys at a time (k[d]
 * broadcast, no horizontal sums), so the causal mask and the online softmax (running max
 * m, sum l, exp-weighted values acc; see decode_attention.h) run across rows in vector
 * lanes; the values are added per row, two rows per pass. The mask is causal, aligned
 * bottom-right: query i of a sequence with q new tokens and seq_len positions sees keys
 * 0 .. seq_len - q + i; with a sliding window of w keys only the last w of those (from
 * seq_len - q + i - w + 1), and an item's keys start at its first row's first, so that
 * nothing before the window is read (the engine may have released those blocks). With
 * soft-capping a score s is cap * tanh(s / cap) before the mask and the softmax.
 */
#include "bf16.h"
#include "common.h"
#include "kernels.h"

#include <math.h>

#define PF_TILE 16
#define PF_KEYS 16
/* keys scored together against one vector of query rows: 8 chains of vector sums, as many
 * as keep both FMA units busy through the FMA latency */
#define PF_KB 8
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
    int64_t num_kv_heads, group, head_dim, dim_padded, rows_padded, block_size;
    float scale;
    int64_t window; /* keys a row sees, its own included (0: all before it) */
    float softcap;  /* 0: scores as they are */
    char *out;
    int64_t o_row_stride, o_head_stride;
    int is_bf16;
    size_t esize;
    int dot_bf16; /* bfloat16 scores and values by AVX-512 BF16 dot products (*_bf16) */
} prefill_args;

/* Scratch of one thread, float32: qt [head_dim][rows_padded] (q transposed, scaled),
 * acc [rows_padded][dim_padded], m, l, corr and last [rows_padded], p [PF_KEYS][rows_padded],
 * k [PF_KEYS][head_dim], v [PF_KEYS][dim_padded]; with dot_bf16, 32-bit words: p's pairs
 * [PF_KEYS / 2][rows_padded] (and in qt's and v's room, q's and v's pairs). */
static size_t scratch_floats(const prefill_args *a)
{
    const size_t rp = (size_t)a->rows_padded, dp = (size_t)a->dim_padded;
    const size_t dn = (size_t)a->head_dim;
    return dn * rp + rp * dp + 4 * rp + PF_KEYS * rp + PF_KEYS * dn + PF_KEYS * dp
           + PF_KEYS / 2 * rp;
}

/* Scores of PF_KB keys (rows of k, head_dim apart) against VL query rows (qt's columns
 * r0.., stride rp) into p[j * rp + r0 ..]: PF_KB vectors of sums in registers, k[j][d]
 * broadcast. */
static inline __attribute__((always_inline)) void score_keys(
    const float *restrict qt, int64_t rp, int64_t r0, const float *restrict k, int64_t d_n,
    float *restrict p)
{
    vf c[PF_KB] = {{0}};
    for (int64_t d = 0; d < d_n; ++d) {
        const vf q = loadv(qt + d * rp + r0);
        for (int j = 0; j < PF_KB; ++j) c[j] += k[j * d_n + d] * q;
    }
    for (int j = 0; j < PF_KB; ++j) memcpy(p + j * rp + r0, &c[j], sizeof(vf));
}

#ifdef __AVX512BF16__
/* score_keys in bfloat16: the dot products of PF_KB keys' rows (bf16, in place in the
 * cache) with VL = 16 query rows by vdpbf16ps, two dimensions at a time, float32 sums
 * scaled after. qp: the rows' q as bf16 pairs, [head_dim / 2][rp] 32-bit words (word r of
 * pair i: q[r][2i], q[r][2i + 1]), unscaled; so every product is exact in float32 and the
 * sums differ from score_keys' only in their order. */
static inline __attribute__((always_inline)) void score_keys_bf16(
    const uint32_t *restrict qp, int64_t rp, int64_t r0, const bf16 *const *restrict k,
    int64_t pairs, float scale, float *restrict p)
{
    __m512 c[PF_KB];
    for (int j = 0; j < PF_KB; ++j) c[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; ++i) {
        const __m512bh q = as_bh(_mm512_loadu_si512(qp + i * rp + r0));
        for (int j = 0; j < PF_KB; ++j) {
            int32_t kw;
            memcpy(&kw, k[j] + 2 * i, sizeof kw);
            c[j] = _mm512_dpbf16_ps(c[j], q, as_bh(_mm512_set1_epi32(kw)));
        }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int j = 0; j < PF_KB; ++j) _mm512_storeu_ps(p + j * rp + r0, _mm512_mul_ps(c[j], sv));
}
#endif

/* acc rows a0 and a1 (a1 NULL: one row) = acc * corr + sum_j w[j * ws] v[j], over the
 * chunk's n keys, for nv vectors of dimensions from d0 (nv a constant where inlined). */
static inline __attribute__((always_inline)) void values_block(
    float *restrict a0, float c0, const float *restrict w0, float *restrict a1, float c1,
    const float *restrict w1, int64_t ws, const float *restrict vv, int64_t dp, int64_t n,
    int64_t d0, const int nv)
{
    vf o0[PV_NV], o1[PV_NV];
    for (int v = 0; v < nv; ++v) {
        o0[v] = loadv(a0 + d0 + v * VL) * c0;
        o1[v] = a1 ? loadv(a1 + d0 + v * VL) * c1 : o0[v];
    }
    for (int64_t j = 0; j < n; ++j) {
        const float p0 = w0[j * ws], p1 = a1 ? w1[j * ws] : 0.0f;
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
                        float *restrict a1, float c1, const float *restrict w1, int64_t ws,
                        const float *restrict vv, int64_t dp, int64_t n)
{
    int64_t d0 = 0;
    for (; d0 + PV_NV * VL <= dp; d0 += PV_NV * VL)
        values_block(a0, c0, w0, a1, c1, w1, ws, vv, dp, n, d0, PV_NV);
    for (; d0 < dp; d0 += VL)
        values_block(a0, c0, w0, a1, c1, w1, ws, vv, dp, n, d0, 1);
}

#ifdef __AVX512BF16__
/* values_block in bfloat16: pairs of keys at a time by vdpbf16ps, the weights w rounded to
 * bf16 pairs (32-bit words, ws apart per pair of keys; word: key 2i's weight, then key
 * 2i + 1's) against vp's pairs of value rows ([pairs][dp] words: dimension d of key 2i,
 * then of key 2i + 1). */
static inline __attribute__((always_inline)) void values_block_bf16(
    float *restrict a0, float c0, const uint32_t *restrict w0, float *restrict a1, float c1,
    const uint32_t *restrict w1, int64_t ws, const uint32_t *restrict vp, int64_t dp,
    int64_t pairs, int64_t d0, const int nv)
{
    __m512 o0[PV_NV], o1[PV_NV];
    for (int v = 0; v < nv; ++v) {
        o0[v] = _mm512_mul_ps(_mm512_loadu_ps(a0 + d0 + v * 16), _mm512_set1_ps(c0));
        o1[v] = a1 ? _mm512_mul_ps(_mm512_loadu_ps(a1 + d0 + v * 16), _mm512_set1_ps(c1))
                   : o0[v];
    }
    for (int64_t i = 0; i < pairs; ++i) {
        const __m512bh p0 = as_bh(_mm512_set1_epi32((int)w0[i * ws]));
        const __m512bh p1 = as_bh(_mm512_set1_epi32(a1 ? (int)w1[i * ws] : 0));
        for (int v = 0; v < nv; ++v) {
            const __m512bh x = as_bh(_mm512_loadu_si512(vp + i * dp + d0 + v * 16));
            o0[v] = _mm512_dpbf16_ps(o0[v], x, p0);
            o1[v] = _mm512_dpbf16_ps(o1[v], x, p1);
        }
    }
    for (int v = 0; v < nv; ++v) {
        _mm512_storeu_ps(a0 + d0 + v * 16, o0[v]);
        if (a1) _mm512_storeu_ps(a1 + d0 + v * 16, o1[v]);
    }
}

static void values_rows_bf16(float *restrict a0, float c0, const uint32_t *restrict w0,
                             float *restrict a1, float c1, const uint32_t *restrict w1,
                             int64_t ws, const uint32_t *restrict vp, int64_t dp, int64_t pairs)
{
    int64_t d0 = 0;
    for (; d0 + PV_NV * 16 <= dp; d0 += PV_NV * 16)
        values_block_bf16(a0, c0, w0, a1, c1, w1, ws, vp, dp, pairs, d0, PV_NV);
    for (; d0 < dp; d0 += 16)
        values_block_bf16(a0, c0, w0, a1, c1, w1, ws, vp, dp, pairs, d0, 1);
}

/* 16 words from two rows of n <= 16 bf16 each: word i = lo[i] | hi[i] << 16 (zeros past n) */
static inline __m512i pair_words(const bf16 *lo, const bf16 *hi, int64_t n)
{
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __m512i l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, lo));
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, hi));
    return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

/* The same from two vectors of 16 floats, each rounded to bf16 (nearest even; the
 * instruction flushes denormal weights to zero, unlike the decode kernel's bit-exact
 * f32_to_bf16_x16, which must match its portable path: here the portable path keeps the
 * weights float32, so there is nothing to match). */
static inline __m512i pair_words_f32(__m512 lo, __m512 hi)
{
    const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
    return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}
#endif

/* The online softmax of VL query rows from r0 over a chunk's n scores (pw, a key's rows rp
 * apart; keys c0 ..), soft-capped where softcap > 0: row r sees keys up to last[r] and,
 * `windowed`, above last[r] - window (floats, as last: exact below 2^24 positions); its
 * running max m and sum l updated, corr[r] the factor its acc must be scaled by, and the
 * scores turned into exp(s - m) in place (0 where unseen). `windowed` is a constant where
 * inlined. */
static inline __attribute__((always_inline)) void softmax_rows(
    float *restrict pw, int64_t rp, int64_t r0, int64_t n, int64_t c0,
    const float *restrict last, float *restrict m, float *restrict l, float *restrict corr,
    float softcap, const int windowed, float window)
{
    const vf lastv = loadv(last + r0);
    const vf firstv = lastv - window;
    if (softcap > 0.0f)
        for (int64_t j = 0; j < n; ++j) {
            const vf s = softcap_v(loadv(pw + j * rp + r0), softcap);
            memcpy(pw + j * rp + r0, &s, sizeof s);
        }
    vf mx = loadv(m + r0);
    for (int64_t j = 0; j < n; ++j) {
        vf s = loadv(pw + j * rp + r0);
        const vf key = (vf){0} + (float)(c0 + j);
        vi seen = key <= lastv;
        if (windowed) seen &= key > firstv;
        s = (vf)((seen & (vi)s) | (~seen & (vi)((vf){0} - INFINITY)));
        memcpy(pw + j * rp + r0, &s, sizeof s);
        const vi gt = mx > s;
        mx = (vf)((gt & (vi)mx) | (~gt & (vi)s));
    }
    const vf m_old = loadv(m + r0);
    /* m_old = -inf (nothing seen yet): l and acc are zero, any factor keeps them; but a row
     * whose window has not begun has mx = -inf too, and exp(-inf - -inf) is NaN: 1 there
     * (exp(0) = 1 wherever m_old = mx all the same) */
    vf cv = exp_nonpositive_v(m_old - mx);
    if (windowed) {
        const vi same = m_old == mx;
        cv = (vf)((same & (vi)((vf){0} + 1.0f)) | (~same & (vi)cv));
    }
    vf sum = {0};
    for (int64_t j = 0; j < n; ++j) {
        const vf s = loadv(pw + j * rp + r0);
        const vi seen = s > (vf){0} - INFINITY;
        const vf e = (vf)(seen & (vi)exp_nonpositive_v(s - mx));
        memcpy(pw + j * rp + r0, &e, sizeof e);
        sum += e;
    }
    const vf lv = loadv(l + r0) * cv + sum;
    memcpy(l + r0, &lv, sizeof lv);
    memcpy(m + r0, &mx, sizeof mx);
    memcpy(corr + r0, &cv, sizeof cv);
}

static void prefill_tile(const prefill_args *a, const prefill_item it, float *scratch)
{
    const int64_t group = a->group, d_n = a->head_dim, dp = a->dim_padded;
    const int64_t rows = (it.q1 - it.q0) * group;
    const int64_t rp = (rows + VL - 1) / VL * VL;
    float *restrict qt = scratch;
    float *restrict acc = qt + d_n * a->rows_padded;
    float *restrict m = acc + a->rows_padded * dp;
    float *restrict l = m + a->rows_padded;
    float *restrict corr = l + a->rows_padded;
    float *restrict last = corr + a->rows_padded;
    float *restrict pw = last + a->rows_padded;
    float *restrict kk = pw + PF_KEYS * a->rows_padded;
    float *restrict vv = kk + PF_KEYS * d_n;
    /* dot_bf16: p's pairs, and the chunk's value rows as pairs in vv's room */
    uint32_t *restrict pwb = (uint32_t *)(vv + PF_KEYS * dp);
    uint32_t *restrict vvp = (uint32_t *)vv;

    const int64_t seq_len = a->seq_lens[it.seq];
    const int64_t first_row = a->query_start_loc[it.seq];
    const int64_t q_len = a->query_start_loc[it.seq + 1] - first_row;
    const int64_t ctx = seq_len - q_len; /* positions cached before the chunk */
    const int32_t *table = a->block_tables + it.seq * a->table_stride;
    const int64_t window = a->window;
    /* the first key the tile's first row sees: none before it is read */
    const int64_t key_begin = window > 0 && ctx + it.q0 - window + 1 > 0
        ? ctx + it.q0 - window + 1 : 0;

    /* q's padding rows zero (dot_bf16: its pairs, half of qt's room); v's dimensions past
     * head_dim zero (dot_bf16 writes its pairs of value rows whole, every chunk) */
    memset(qt, 0, sizeof(float) * (size_t)((a->dot_bf16 ? d_n / 2 : d_n) * rp));
    memset(acc, 0, sizeof(float) * (size_t)(rp * dp));
    if (!a->dot_bf16) memset(vv, 0, sizeof(float) * (size_t)(PF_KEYS * dp));
    for (int64_t r = 0; r < rp; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        /* the last key row r sees; padding rows see every key (never written out) */
        last[r] = r < rows ? (float)(ctx + it.q0 + r / group) : 1e30f;
    }
    uint32_t *restrict qp = (uint32_t *)qt; /* dot_bf16: [d_n / 2][rp] pairs, in qt's room */
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = r / group, h = r % group;
        const char *src = a->query + ((first_row + it.q0 + qi) * a->q_row_stride
                                      + (it.kv_head * group + h) * a->q_head_stride)
                                         * (int64_t)a->esize;
        if (a->dot_bf16) {
            for (int64_t i = 0; i < d_n / 2; ++i) memcpy(qp + i * rp + r, src + 4 * i, 4);
            continue;
        }
        load_row(kk, src, d_n, a->is_bf16); /* kk: scratch row here */
        for (int64_t d = 0; d < d_n; ++d) qt[d * rp + r] = kk[d] * a->scale;
    }
    /* dot_bf16: the chunk's key rows in place in the cache (past the chunk's end, a row
     * of zeros: kk's, cleared) */
    const bf16 *krow[PF_KEYS], *vrow[PF_KEYS];
    if (a->dot_bf16) memset(kk, 0, sizeof(float) * (size_t)dp); /* dp >= d_n bf16 zeros */

    const int64_t key_end = ctx + it.q1; /* the tile's last row sees keys below this */
    const int64_t row_bytes = d_n * (int64_t)a->esize;
    for (int64_t c0 = key_begin; c0 < key_end; c0 += PF_KEYS) {
        const int64_t n = key_end - c0 < PF_KEYS ? key_end - c0 : PF_KEYS;
        for (int64_t j = 0; j < PF_KEYS; ++j) {
            if (j >= n) { /* keys past the chunk's end: zero, never read from the cache */
                if (a->dot_bf16) {
                    krow[j] = vrow[j] = (const bf16 *)kk;
                    continue;
                }
                memset(kk + j * d_n, 0, sizeof(float) * (size_t)d_n);
                memset(vv + j * dp, 0, sizeof(float) * (size_t)dp);
                continue;
            }
            const int64_t pos = c0 + j;
            const int64_t at = (((int64_t)table[pos / a->block_size] * a->block_size
                                 + pos % a->block_size) * a->num_kv_heads + it.kv_head)
                               * row_bytes;
            if (a->dot_bf16) {
                krow[j] = (const bf16 *)(a->k_cache + at);
                vrow[j] = (const bf16 *)(a->v_cache + at);
                continue;
            }
            load_row(kk + j * d_n, a->k_cache + at, d_n, a->is_bf16);
            load_row(vv + j * dp, a->v_cache + at, d_n, a->is_bf16);
        }
#ifdef __AVX512BF16__
        if (a->dot_bf16) /* value rows in pairs of keys, past n a zero row's */
            for (int64_t i = 0; i < (n + 1) / 2; ++i)
                for (int64_t d0 = 0; d0 < dp; d0 += 16)
                    _mm512_storeu_si512(vvp + i * dp + d0,
                                        pair_words(vrow[2 * i] + d0, vrow[2 * i + 1] + d0,
                                                   d_n - d0));
#endif
        /* rows before r_lo see no key of this chunk (causal), nor padding past n; with a
         * window, rows from r_end none either (their windows start past it), so the
         * scores stop at r_hi (r_end in whole vectors) and the values at r_end */
        const int64_t qi_lo = c0 - ctx - it.q0 > 0 ? c0 - ctx - it.q0 : 0;
        const int64_t r_lo = qi_lo * group / VL * VL;
        const int64_t qi_hi = window > 0 ? c0 + n - 1 + window - ctx - it.q0 : it.q1 - it.q0;
        const int64_t r_end = qi_hi < it.q1 - it.q0 ? qi_hi * group : rows;
        const int64_t r_hi = window > 0 ? (r_end + VL - 1) / VL * VL : rp;
        for (int64_t r0 = r_lo; r0 < r_hi; r0 += VL) {
            for (int64_t j0 = 0; j0 < n; j0 += PF_KB) {
#ifdef __AVX512BF16__
                if (a->dot_bf16) {
                    score_keys_bf16(qp, rp, r0, krow + j0, d_n / 2, a->scale, pw + j0 * rp);
                    continue;
                }
#endif
                score_keys(qt, rp, r0, kk + j0 * d_n, d_n, pw + j0 * rp);
            }
            /* online softmax, VL rows at once; the kernel without a window runs the
             * loops it ran before windows */
            if (window > 0)
                softmax_rows(pw, rp, r0, n, c0, last, m, l, corr, a->softcap, 1,
                             (float)window);
            else
                softmax_rows(pw, rp, r0, n, c0, last, m, l, corr, a->softcap, 0, 0.0f);
        }
        int64_t r = qi_lo * group;
#ifdef __AVX512BF16__
        if (a->dot_bf16) {
            const int64_t pairs = (n + 1) / 2; /* pw's row n: a zero key's score, weight of
                                                  a zero value row */
            for (int64_t i = 0; i < pairs; ++i)
                for (int64_t r0 = r_lo; r0 < r_hi; r0 += 16)
                    _mm512_storeu_si512(pwb + i * rp + r0,
                                        pair_words_f32(_mm512_loadu_ps(pw + 2 * i * rp + r0),
                                                       _mm512_loadu_ps(pw + (2 * i + 1) * rp + r0)));
            for (; r + 2 <= r_end; r += 2)
                values_rows_bf16(acc + r * dp, corr[r], pwb + r, acc + (r + 1) * dp,
                                 corr[r + 1], pwb + r + 1, rp, vvp, dp, pairs);
            if (r < r_end)
                values_rows_bf16(acc + r * dp, corr[r], pwb + r, NULL, 0.0f, NULL, rp, vvp, dp,
                                 pairs);
            continue;
        }
#endif
        for (; r + 2 <= r_end; r += 2)
            values_rows(acc + r * dp, corr[r], pw + r, acc + (r + 1) * dp, corr[r + 1],
                        pw + r + 1, rp, vv, dp, n);
        if (r < r_end)
            values_rows(acc + r * dp, corr[r], pw + r, NULL, 0.0f, NULL, rp, vv, dp, n);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = r / group, h = r % group;
        char *dst = a->out + ((first_row + it.q0 + qi) * a->o_row_stride
                              + (it.kv_head * group + h) * a->o_head_stride)
                                 * (int64_t)a->esize;
        store_row(dst, acc + r * dp, 1.0f / l[r], d_n, a->is_bf16);
    }
}

/* The work items of a step's prefill chunks (sequences seq_ids, each with
 * query_start_loc[s + 1] - query_start_loc[s] new tokens), as int64 quadruples (sequence,
 * KV head, first and end query position: prefill_item), for every layer of the step;
 * NULL without memory (free it). The last tiles of a chunk see the most keys: they go
 * first, so the dynamic schedule ends on short items. */
int64_t *prefill_attention_items(const int32_t *query_start_loc, const int64_t *seq_ids,
                                 int64_t num_seqs, int64_t num_kv_heads, int64_t *num_items)
{
    int64_t count = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t s = seq_ids[i];
        count += (query_start_loc[s + 1] - query_start_loc[s] + PF_TILE - 1) / PF_TILE;
    }
    count *= num_kv_heads;
    prefill_item *items = malloc(sizeof(prefill_item) * (size_t)(count ? count : 1));
    if (!items) return NULL;
    int64_t n = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t s = seq_ids[i];
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        for (int64_t q0 = (q_len - 1) / PF_TILE * PF_TILE; q0 >= 0; q0 -= PF_TILE)
            for (int64_t g = 0; g < num_kv_heads; ++g)
                items[n++] = (prefill_item){s, g, q0, q0 + PF_TILE < q_len ? q0 + PF_TILE
                                                                            : q_len};
    }
    *num_items = count;
    return (int64_t *)items;
}

static prefill_args make_args(
    const void *query, int64_t q_row_stride, int64_t q_head_stride, const void *k_cache,
    const void *v_cache, const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float softcap, void *out, int64_t o_row_stride, int64_t o_head_stride, int is_bf16,
    int impl)
{
    const int64_t group = num_heads / num_kv_heads;
    return (prefill_args){
        query, k_cache, v_cache, q_row_stride, q_head_stride, block_tables, table_stride,
        seq_lens, query_start_loc, num_kv_heads, group, head_dim,
        (head_dim + VL - 1) / VL * VL, (PF_TILE * group + VL - 1) / VL * VL, block_size,
        scale, window, softcap, out, o_row_stride, o_head_stride, is_bf16,
        is_bf16 ? sizeof(bf16) : sizeof(float),
        /* pairs of dimensions: an even head size (a row's last pair never passes its end) */
#ifdef __AVX512BF16__
        is_bf16 && impl == BF16_AVX512 && head_dim % 2 == 0
#else
        ((void)impl, 0)
#endif
    };
}

/* The float32 scratch one thread's items need (prefill_attention_team). */
size_t prefill_attention_scratch(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
{
    const prefill_args a = make_args(NULL, 0, 0, NULL, NULL, NULL, 0, NULL, NULL, num_heads,
                                     num_kv_heads, head_dim, 1, 1.0f, 0, 0.0f, NULL, 0, 0, 0,
                                     0);
    return scratch_floats(&a);
}

/* One thread's share of a call's items (prefill_attention_items), inside a parallel region
 * every thread of which calls it (an orphaned `omp for`, no wait after it): arguments as
 * paged_prefill_attention's, `scratch` prefill_attention_scratch floats (NULL: none could
 * be allocated). Returns 1 where this thread had items and no scratch, else 0. */
int prefill_attention_team(
    const void *query, int64_t q_row_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float softcap, void *out, int64_t o_row_stride, int64_t o_head_stride, int is_bf16,
    int impl, const int64_t *items, int64_t num_items, float *scratch)
{
    const prefill_args a = make_args(query, q_row_stride, q_head_stride, k_cache, v_cache,
                                     block_tables, table_stride, seq_lens, query_start_loc,
                                     num_heads, num_kv_heads, head_dim, block_size, scale,
                                     window, softcap, out, o_row_stride, o_head_stride,
                                     is_bf16, impl);
    const prefill_item *work = (const prefill_item *)items;
    int failed = 0;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t j = 0; j < num_items; ++j) {
        if (!scratch) {
            failed = 1;
            continue;
        }
        prefill_tile(&a, work[j], scratch);
    }
    return failed;
}

/* Attention of the query rows of sequences seq_ids (each with query_start_loc[s + 1] -
 * query_start_loc[s] new tokens, already stored in the cache) over their cached keys;
 * query and out [num_tokens, num_heads, head_dim] with unit last stride, the caches
 * [num_blocks, block_size, num_kv_heads, head_dim] contiguous; is_bf16: every tensor is
 * bfloat16, else float32; window and softcap as for paged_decode_attention_f32 (a row's
 * window ends at its own position). Returns 0, or -1 when scratch memory could not be
 * allocated. */
int paged_prefill_attention(
    const void *query, int64_t q_row_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seq_ids,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, void *out, int64_t o_row_stride, int64_t o_head_stride,
    int is_bf16, int num_threads, int impl, int64_t window, float softcap)
{
    int64_t num_items = 0;
    int64_t *items = prefill_attention_items(query_start_loc, seq_ids, num_seqs, num_kv_heads,
                                             &num_items);
    if (!items) return -1;
    const size_t floats = prefill_attention_scratch(num_heads, num_kv_heads, head_dim);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * floats);
        /* every thread must reach the worksharing loop, even one without scratch */
        failed |= prefill_attention_team(query, q_row_stride, q_head_stride, k_cache, v_cache,
                                         block_tables, table_stride, seq_lens,
                                         query_start_loc, num_heads, num_kv_heads, head_dim,
                                         block_size, scale, window, softcap, out, o_row_stride,
                                         o_head_stride, is_bf16, impl, items, num_items,
                                         scratch);
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}
