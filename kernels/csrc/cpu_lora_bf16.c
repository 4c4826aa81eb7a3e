/* Native CPU kernels for bfloat16 tensors with float32 accumulation: the LoRA segments of
 * cpu_lora_f32.c over bf16 activations and LoRA weights, bf16 outputs, in the two
 * implementations of cpu_attention_bf16.c (portable; AVX-512 BF16 dot products). Both round
 * what the PyTorch reference rounds to bf16 (the shrink's output, the outputs), so they
 * differ from each other only in the order of fp32 additions.
 *
 * The vdpbf16ps operand wants pairs of consecutive bf16 values along the summed axis, so
 * the LoRA weights come pair-interleaved ("VNNI" layout), and tiled as in cpu_lora_f32.c
 * (lora_slots.py: `tiled_layout`), so that each tile's weights are one contiguous run:
 *   A: per block of w = min(TILE_COLUMNS, R - k0) ranks from k0 (at in2 * k0 * 2),
 *      [in2, w, 2] with [i2, k, j] = A^T[2 * i2 + j, k0 + k]   (in2 = ceil(in / 2), zero past in)
 *   B: per slice (ranks kb..ke, columns lo..hi; its pairs k2b = kb / 2 .. k2e = (ke + 1) / 2,
 *      rows of a neighbouring slice in a shared pair being zero in these columns), one after
 *      another, per tile of wt = min(TILE_COLUMNS, hi - o0) columns from o0 (at the slice's
 *      start + (o0 - lo) * (k2e - k2b) * 2), [k2e - k2b, wt, 2] with
 *      [p, o, j] = scaled B^T[2 * (k2b + p) + j, o0 + o]
 */
#include "bf16.h"
#include "common.h"
#include "kernels.h"
#include "lora.h"

/* ---- LoRA segments ---------------------------------------------------------------- */

#define LORA_TOKENS 4

/* The portable shrink of nt <= 4 tokens for ranks k0 .. k0 + VL * nv + 8 * nh (nt, nv <=
 * TILE_VECTORS and nh, 0 or 1 and only with AVX-512, constants where it is inlined),
 * cpu_lora_f32.c's tile over the pair-interleaved layout: a pair-row of A^T's tile is
 * widened in registers (load_pairs). y[t * r + k] = bf16-rounded xb[t] . A^T[:, k]. Only
 * the group's own tokens are multiplied: a decode step's groups have a token or two, and
 * four tokens' FMAs for one made this kernel compute-bound (9 GB/s of weights on the AVX2
 * EPYC). */
static inline __attribute__((always_inline)) void shrink_pairs(
    const float *restrict xb, int64_t in2, const bf16 *restrict at, int64_t r, int64_t k0,
    const int nv, const int nh, const int nt, float *restrict y)
{
    const int64_t w = 2 * in2;
    const int width = VL * nv + HALF_RANKS * nh;
    vf c[LORA_TOKENS][TILE_VECTORS] = {{{0}}};
    vh ch[LORA_TOKENS] = {{0}};
    const bf16 *restrict block = at + in2 * k0 * 2;
    for (int64_t i2 = 0; i2 < in2; ++i2) {
        const bf16 *restrict a = block + i2 * width * 2;
        vf even[TILE_VECTORS], odd[TILE_VECTORS];
        vh even_h = {0}, odd_h = {0};
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) load_pairs(a + 2 * VL * j, &even[j], &odd[j]);
        if (nh) load_pairs_half(a + 2 * VL * nv, &even_h, &odd_h);
#pragma GCC unroll 4
        for (int t = 0; t < nt; ++t) {
            const float xa = xb[t * w + 2 * i2], xc = xb[t * w + 2 * i2 + 1];
#pragma GCC unroll 4
            for (int j = 0; j < nv; ++j) c[t][j] += xa * even[j] + xc * odd[j];
            if (nh) ch[t] += xa * even_h + xc * odd_h;
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; ++t) {
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) memcpy(y + t * r + k0 + VL * j, &c[t][j], sizeof(vf));
        if (nh) memcpy(y + t * r + k0 + VL * nv, &ch[t], sizeof(vh));
        float *restrict yt = y + t * r + k0;
#pragma omp simd
        for (int k = 0; k < width; ++k) yt[k] = bf16_to_f32(f32_to_bf16(yt[k]));
    }
}

/* The portable expand of nt <= 4 tokens (a constant where it is inlined) into TILE_COLUMNS
 * columns from o0, over the pair-rows k2b .. k2e, from the tile's block `bt` ([k2e - k2b,
 * TILE_COLUMNS, 2], read in order): out[t, o0 + o] = bf16(out + y[t] . B^T[ranks, o0 + o]). */
static inline __attribute__((always_inline)) void expand_pairs(
    const float *restrict y, int64_t r, const bf16 *restrict bt, int64_t k2b, int64_t k2e,
    int64_t o0, bf16 *restrict out, int64_t out_stride, const int nt)
{
    vf c[LORA_TOKENS][TILE_VECTORS] = {{{0}}};
    for (int64_t k2 = k2b; k2 < k2e; ++k2) {
        const bf16 *restrict b = bt + (k2 - k2b) * TILE_COLUMNS * 2;
        vf even[TILE_VECTORS], odd[TILE_VECTORS];
#pragma GCC unroll 4
        for (int j = 0; j < TILE_VECTORS; ++j) load_pairs(b + 2 * VL * j, &even[j], &odd[j]);
#pragma GCC unroll 4
        for (int t = 0; t < nt; ++t) {
            const float ya = y[t * r + 2 * k2], yc = y[t * r + 2 * k2 + 1];
#pragma GCC unroll 4
            for (int j = 0; j < TILE_VECTORS; ++j) c[t][j] += ya * even[j] + yc * odd[j];
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; ++t) {
        float sums[TILE_COLUMNS];
        memcpy(sums, c[t], sizeof sums);
        bf16 *restrict ot = out + t * out_stride + o0;
#pragma omp simd
        for (int64_t o = 0; o < TILE_COLUMNS; ++o)
            ot[o] = f32_to_bf16(bf16_to_f32(ot[o]) + sums[o]);
    }
}

/* Up to LORA_ITEM_TOKENS consecutive tokens of one slot in groups of 4 (cpu_lora_f32.c's
 * lora_tokens), weights in the tiled pair-interleaved layout. xb: the tokens' rows widened
 * to fp32, nt rows of in2 * 2; y: [groups * 4, r], the shrink's
 * output, rounded to bf16 values. */
static void lora_tokens_portable(const float *restrict xb, bf16 *restrict out,
                                 int64_t out_stride, int64_t nt, int64_t in2,
                                 const bf16 *restrict at, const bf16 *restrict bt, int64_t r,
                                 const int64_t *restrict slices, int64_t num_slices,
                                 float *restrict y)
{
    const int64_t groups = (nt + LORA_TOKENS - 1) / LORA_TOKENS, w = 2 * in2;
    /* a group's tokens (1-4) as a constant: its rows are those from X on */
#define SHRINK(X, Y, K0, NV, NH)                                                          \
    switch (LORA_GROUP_TOKENS(nt, ((X) - xb) / (LORA_TOKENS * w))) {                    \
    case 1: shrink_pairs(X, in2, at, r, K0, NV, NH, 1, Y); break;                       \
    case 2: shrink_pairs(X, in2, at, r, K0, NV, NH, 2, Y); break;                       \
    case 3: shrink_pairs(X, in2, at, r, K0, NV, NH, 3, Y); break;                       \
    default: shrink_pairs(X, in2, at, r, K0, NV, NH, 4, Y); break;                      \
    }
    LORA_SHRINK_GROUPS(SHRINK, xb, LORA_TOKENS * w, y, r, groups);
#undef SHRINK
    const bf16 *restrict bs = bt; /* the slice's tiles */
    for (int64_t s = 0; s < num_slices; ++s) {
        /* the pairs holding the slice's ranks; a pair's other row is zero here */
        const int64_t k2b = slices[4 * s] / 2, k2e = (slices[4 * s + 1] + 1) / 2;
        const int64_t lo = slices[4 * s + 2], hi = slices[4 * s + 3], np = k2e - k2b;
        /* group after group along the whole tiles (common.h: the expand's order) */
        const int64_t full = lo + (hi - lo) / TILE_COLUMNS * TILE_COLUMNS;
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t o0 = lo; o0 < full; o0 += TILE_COLUMNS) {
                const int64_t t0 = g * LORA_TOKENS;
#define EXPAND(N) expand_pairs(y + t0 * r, r, bs + (o0 - lo) * np * 2, k2b, k2e, o0, \
                                 out + t0 * out_stride, out_stride, N)
                LORA_BY_TOKENS(LORA_GROUP_TOKENS(nt, g), EXPAND)
#undef EXPAND
            }
        const int64_t o0 = full;
        const bf16 *restrict b = bs + (o0 - lo) * np * 2; /* the last tile [np, wt, 2] */
        const int64_t wt = hi - o0;
        for (int64_t t = 0; t < nt; ++t) /* the slice's last (hi - lo) % TILE_COLUMNS columns */
            for (int64_t o = 0; o < wt; ++o) {
                float acc = 0.0f;
                for (int64_t p = 0; p < np; ++p)
                    acc += y[t * r + 2 * (k2b + p)] * bf16_to_f32(b[(p * wt + o) * 2])
                           + y[t * r + 2 * (k2b + p) + 1] * bf16_to_f32(b[(p * wt + o) * 2 + 1]);
                bf16 *ot = out + t * out_stride + o0 + o;
                *ot = f32_to_bf16(bf16_to_f32(*ot) + acc);
            }
        bs += (hi - lo) * np * 2;
    }
}

#ifdef __AVX512BF16__
#if TILE_COLUMNS != 64
#error "the AVX-512 BF16 LoRA tiles are 64 wide, as the tiled layout's"
#endif
/* Pair-rows ahead that the shrink and expand loops prefetch. Their weights are contiguous
 * runs read once per decode step (each adapter's, so from memory), and a decode step's
 * items are a token or two each: without it a thread waited on every line. Past a run's
 * end it prefetches whatever follows (a prefetch never faults). */
#ifndef LORA_PREFETCH_ROWS
#define LORA_PREFETCH_ROWS 16
#endif
/* The shrink of nt <= 8 tokens for ranks k0 .. k0 + 16 * nv + 8 * nh (nv <= 4, nh 0 or 1,
 * nt * nv <= 24; all constants where it is inlined), from the block of A^T at k0
 * (pair-rows of 16 * nv + 8 * nh ranks, read in order), the nt x nv zmm (and nt ymm) of
 * sums in registers. yb[t * r + k] = bf16(xb[t] . A^T[:, k]). A decode step's groups have
 * a token or two: only those are multiplied. A prefill's take two groups at once where the
 * ranks are few (below 64): with 4 tokens x 1 or 2 vectors the sums' dependency chains,
 * not the loads, set the pace. */
#define SHRINK_MAX_TOKENS 8
/* For a group of at most this many tokens (a decode step's one or two),
 * shrink_ranks_avx512 reads the two halves of A's block side by side, their sums in two
 * sets of registers added at the end: two runs of weights from memory in flight instead
 * of one. Replayed in the engine on the Xeon with AMX (13 bfloat16 decode steps of the
 * 20-adapter run, with expand_tile_avx512 at runs 2 and shrink_half_avx512's halves) the steps'
 * LoRA cost 1.07-1.10x less, its 104 MB a step read at 19.5 GB/s instead of 17.7-18.3. A
 * prefill's groups of 4-8 tokens, their weights in cache, ran 5 % slower so (the vector
 * kernel alone, AMX off). */
#define SHRINK_TWO_RUNS_TOKENS 2
/* One pair-row i2 of a block of A^T (at `a`, `width` ranks: nv vectors and nh halves) into
 * nt tokens' sums c / ch: its lines LORA_PREFETCH_ROWS pair-rows ahead prefetched. `reuse`
 * (a constant): a full group of a work item of several, each vector held in a register for
 * the tokens (cpu_lora_f32.c: shrink_ranks). */
static inline __attribute__((always_inline)) void shrink_pair_row(
    const bf16 *restrict xb, int64_t ldx, int64_t i2, const bf16 *restrict a, const int width,
    const int nv, const int nh, const int nt, const int reuse, __m512 (*restrict c)[4],
    __m256 *restrict ch)
{
#pragma GCC unroll 5
    for (int j = 0; j < nv + nh; ++j) /* a line (32 values) per whole vector */
        _mm_prefetch((const char *)(a + LORA_PREFETCH_ROWS * width * 2 + 32 * j), _MM_HINT_T0);
    __m512bh av[4];
    __m256bh ah = (__m256bh)_mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < nv; ++j) {
        av[j] = as_bh(_mm512_loadu_si512(a + 32 * j));
        if (reuse) keep_in_register(av[j]);
    }
    if (nh) ah = (__m256bh)_mm256_loadu_si256((const __m256i *)(a + 32 * nv));
#pragma GCC unroll 8
    for (int t = 0; t < nt; ++t) {
        const __m512bh xp = pair_at(xb + t * ldx + 2 * i2);
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) c[t][j] = _mm512_dpbf16_ps(c[t][j], xp, av[j]);
        if (nh)
            ch[t] = _mm256_dpbf16_ps(ch[t], (__m256bh)_mm512_castsi512_si256((__m512i)xp), ah);
    }
}

static inline __attribute__((always_inline)) void shrink_ranks_avx512(
    const bf16 *restrict xb, int64_t ldx, int64_t in2, const bf16 *restrict at, int64_t r,
    int64_t k0, const int nv, const int nh, const int nt, const int reuse, bf16 *restrict yb)
{
    __m512 c[SHRINK_MAX_TOKENS][4];
    __m256 ch[SHRINK_MAX_TOKENS];
    const int width = 16 * nv + 8 * nh; /* ranks; a pair-row is 4 * width bytes */
#pragma GCC unroll 8
    for (int t = 0; t < SHRINK_MAX_TOKENS; ++t) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) c[t][j] = _mm512_setzero_ps();
        ch[t] = _mm256_setzero_ps();
    }
    const bf16 *restrict block = at + in2 * k0 * 2;
    const int64_t row = width * 2; /* values per pair-row */
    int64_t i2 = 0;
    if (nt <= SHRINK_TWO_RUNS_TOKENS) {
        /* the block's two halves at once, the second's sums in registers of their own */
        __m512 d[SHRINK_MAX_TOKENS][4];
        __m256 dh[SHRINK_MAX_TOKENS];
#pragma GCC unroll 8
        for (int t = 0; t < SHRINK_MAX_TOKENS; ++t) {
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) d[t][j] = _mm512_setzero_ps();
            dh[t] = _mm256_setzero_ps();
        }
        const int64_t half = in2 / 2;
        for (; i2 < half; ++i2) {
            shrink_pair_row(xb, ldx, i2, block + i2 * row, width, nv, nh, nt, reuse, c, ch);
            shrink_pair_row(xb, ldx, i2 + half, block + (i2 + half) * row, width, nv, nh, nt,
                            reuse, d, dh);
        }
#pragma GCC unroll 8
        for (int t = 0; t < nt; ++t) {
#pragma GCC unroll 4
            for (int j = 0; j < nv; ++j) c[t][j] = _mm512_add_ps(c[t][j], d[t][j]);
            ch[t] = _mm256_add_ps(ch[t], dh[t]);
        }
        i2 = 2 * half;
    }
    for (; i2 < in2; ++i2)
        shrink_pair_row(xb, ldx, i2, block + i2 * row, width, nv, nh, nt, reuse, c, ch);
#pragma GCC unroll 8
    for (int t = 0; t < nt; ++t) {
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j)
            _mm256_storeu_si256((__m256i *)(yb + t * r + k0 + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(c[t][j]));
        if (nh)
            _mm_storeu_si128((__m128i *)(yb + t * r + k0 + 16 * nv),
                             (__m128i)_mm256_cvtneps_pbh(ch[t]));
    }
}

/* The shrink of nt <= 8 tokens (a constant where it is inlined) for a block of 8 ranks
 * alone (a rank-8 projection's, or what is left past whole tiles): shrink_ranks_avx512 with
 * nv 0 and nh 1, but its sums in two chains, over the block's first and second half (two
 * runs of weights, as SHRINK_TWO_RUNS_TOKENS), added at the end: one chain of half-vector
 * dot products waited on each one's latency (a rank-8 decode step read its weights no
 * faster than padded to 16 ranks). */
static inline __attribute__((always_inline)) void shrink_half_avx512(
    const bf16 *restrict xb, int64_t ldx, int64_t in2, const bf16 *restrict at, int64_t r,
    int64_t k0, const int nt, bf16 *restrict yb)
{
    __m256 c0[SHRINK_MAX_TOKENS], c1[SHRINK_MAX_TOKENS];
#pragma GCC unroll 8
    for (int t = 0; t < SHRINK_MAX_TOKENS; ++t) c0[t] = c1[t] = _mm256_setzero_ps();
    const bf16 *restrict block = at + in2 * k0 * 2; /* pair-rows of 8 ranks: 32 bytes */
    const int64_t half = in2 / 2;
    int64_t i2 = 0;
    for (; i2 < half; ++i2) { /* the two halves of the block at once: two runs */
        const bf16 *restrict a = block + i2 * 16, *restrict e = block + (i2 + half) * 16;
        /* as many bytes ahead as 16 ranks' pair-rows are, in each */
        _mm_prefetch((const char *)(a + LORA_PREFETCH_ROWS * 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(e + LORA_PREFETCH_ROWS * 32), _MM_HINT_T0);
        const __m256bh a0 = (__m256bh)_mm256_loadu_si256((const __m256i *)a);
        const __m256bh a1 = (__m256bh)_mm256_loadu_si256((const __m256i *)e);
#pragma GCC unroll 8
        for (int t = 0; t < nt; ++t) {
            int32_t p0, p1;
            memcpy(&p0, xb + t * ldx + 2 * i2, sizeof p0);
            memcpy(&p1, xb + t * ldx + 2 * (i2 + half), sizeof p1);
            c0[t] = _mm256_dpbf16_ps(c0[t], (__m256bh)_mm256_set1_epi32(p0), a0);
            c1[t] = _mm256_dpbf16_ps(c1[t], (__m256bh)_mm256_set1_epi32(p1), a1);
        }
    }
    i2 = 2 * half;
    if (i2 < in2) {
        const __m256bh a0 = (__m256bh)_mm256_loadu_si256((const __m256i *)(block + i2 * 16));
#pragma GCC unroll 8
        for (int t = 0; t < nt; ++t) {
            int32_t p0;
            memcpy(&p0, xb + t * ldx + 2 * i2, sizeof p0);
            c0[t] = _mm256_dpbf16_ps(c0[t], (__m256bh)_mm256_set1_epi32(p0), a0);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < nt; ++t)
        _mm_storeu_si128((__m128i *)(yb + t * r + k0),
                         (__m128i)_mm256_cvtneps_pbh(_mm256_add_ps(c0[t], c1[t])));
}

/* One group's shrink over every block of ranks (r a multiple of 8), its nt tokens a
 * constant where it is inlined; nt up to 8 (two groups), the blocks of 64 ranks then 4
 * tokens at a time. */
static inline __attribute__((always_inline)) void shrink_group_avx512(
    const bf16 *restrict xg, int64_t ldx, int64_t in2, const bf16 *restrict at, int64_t r,
    const int nt, const int reuse, bf16 *restrict yg)
{
    int64_t k0 = 0;
    for (; k0 + 64 <= r; k0 += 64) {
        shrink_ranks_avx512(xg, ldx, in2, at, r, k0, 4, 0, nt < 4 ? nt : 4, reuse, yg);
        if (nt > 4)
            shrink_ranks_avx512(xg + 4 * ldx, ldx, in2, at, r, k0, 4, 0, nt - 4, reuse,
                                yg + 4 * r);
    }
    /* two groups' sums of more than 3 vectors would not fit the registers: one by one */
#define SHRINK_PART(X, Y, K0, NV, NH)                                                     \
    do {                                                                                \
        if ((NV) == 0) {                                                                \
            shrink_half_avx512(X, ldx, in2, at, r, K0, nt, Y);                           \
        } else if (nt > 4 && (NV) + (NH) > 3) {                                         \
            shrink_ranks_avx512(X, ldx, in2, at, r, K0, NV, NH, 4, reuse, Y);           \
            shrink_ranks_avx512((X) + 4 * ldx, ldx, in2, at, r, K0, NV, NH, nt - 4,      \
                                reuse, (Y) + 4 * r);                                    \
        } else {                                                                        \
            shrink_ranks_avx512(X, ldx, in2, at, r, K0, NV, NH, nt, reuse, Y);          \
        }                                                                               \
    } while (0)
    LORA_SHRINK_LAST(SHRINK_PART, xg, yg, k0, r)
#undef SHRINK_PART
}

/* The expand of nt <= 4 tokens (a constant where it is inlined) into one tile of 64
 * columns, over the pair-rows k2b .. k2e of the tile's block ([k2e - k2b, 64, 2], read in
 * order): og[t * out_stride + o] = bf16(og + yg[t] . B^T[ranks, o]). With `runs` 2 (a
 * constant; nt <= 2) the same for a second tile, `tile2` into og2, side by side: two runs
 * of B from memory in flight (SHRINK_TWO_RUNS_TOKENS), each column's sum in the same
 * order. `reuse` as shrink_pair_row. */
static inline __attribute__((always_inline)) void expand_tile_avx512(
    const bf16 *restrict yg, int64_t r, const bf16 *restrict tile, const bf16 *restrict tile2,
    int64_t k2b, int64_t k2e, bf16 *restrict og, bf16 *restrict og2, int64_t out_stride,
    const int nt, const int runs, const int reuse)
{
    __m512 c[2][LORA_TOKENS][4];
    const bf16 *restrict tiles[2] = {tile, tile2};
    bf16 *restrict outs[2] = {og, og2};
#pragma GCC unroll 2
    for (int u = 0; u < runs; ++u)
#pragma GCC unroll 4
        for (int t = 0; t < nt; ++t)
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) c[u][t][j] = _mm512_setzero_ps();
    for (int64_t k2 = k2b; k2 < k2e; ++k2) {
        __m512bh bv[2][4];
#pragma GCC unroll 2
        for (int u = 0; u < runs; ++u) {
            const bf16 *restrict b = tiles[u] + (k2 - k2b) * 64 * 2;
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j)
                _mm_prefetch((const char *)(b + LORA_PREFETCH_ROWS * 64 * 2 + 32 * j),
                             _MM_HINT_T0);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                bv[u][j] = as_bh(_mm512_loadu_si512(b + 32 * j));
                if (reuse) keep_in_register(bv[u][j]);
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; ++t) {
            const __m512bh yp = pair_at(yg + t * r + 2 * k2);
#pragma GCC unroll 2
            for (int u = 0; u < runs; ++u)
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) c[u][t][j] = _mm512_dpbf16_ps(c[u][t][j], yp, bv[u][j]);
        }
    }
#pragma GCC unroll 2
    for (int u = 0; u < runs; ++u)
#pragma GCC unroll 4
        for (int t = 0; t < nt; ++t)
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                bf16 *ot = outs[u] + t * out_stride + 16 * j;
                const __m512 sum = _mm512_add_ps(load_bf16x16(ot), c[u][t][j]);
                _mm256_storeu_si256((__m256i *)ot, (__m256i)_mm512_cvtneps_pbh(sum));
            }
}

/* The slice's last (hi - lo) % 64 columns, wt of them from o0 (og = out + o0), for nt
 * tokens: the last tile b is [k2e - k2b, wt, 2]. */
static void expand_last_columns(const bf16 *restrict yb, int64_t r, const bf16 *restrict b,
                                int64_t k2b, int64_t k2e, int64_t wt, bf16 *restrict og,
                                int64_t out_stride, int64_t nt)
{
    for (int64_t t = 0; t < nt; ++t)
        for (int64_t o = 0; o < wt; ++o) {
            float acc = 0.0f;
            for (int64_t k = 2 * k2b; k < 2 * k2e; ++k)
                acc += bf16_to_f32(yb[t * r + k])
                       * bf16_to_f32(b[((k / 2 - k2b) * wt + o) * 2 + k % 2]);
            bf16 *ot = og + t * out_stride + o;
            *ot = f32_to_bf16(bf16_to_f32(*ot) + acc);
        }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* A long segment's whole blocks of 16 tokens on AMX tiles (where cpu_skinny_amx.c has
 * them turned on): TDPBF16PS multiplies 16 tokens by 16 ranks (the shrink) or 16 columns
 * (the expand) over 32 summed values at once, where vdpbf16ps does one token's 16. The
 * weights' pair-interleaved tiles are the B operand as they lie: a shrink tile is 16
 * pair-rows of A^T's block at 16 of its columns (row stride 4 * its width), an expand
 * tile np pair-rows of B^T's 64-column tile at 16 of them (row stride 256 bytes). The A
 * operand is 16 rows of xb (the shrink) or of yb at a slice's pairs (the expand). Sums in
 * float32, rounded where the vector kernel rounds (the shrink's output, out); the order of
 * the additions is the hardware's, so it differs from the vector kernel's in the last
 * bits. */
#define LORA_AMX 1
struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* C in tmm0-3 (16 x 16 float32); tmm4 an A operand of 16 rows of `pairs` pairs (at most
 * 16), tmm5-7 B operands of `pairs` rows of 16 pairs. */
static void amx_configure(int pairs)
{
    struct amx_config cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; ++i) {
        cfg.colsb[i] = (uint16_t)(i == 4 ? 4 * pairs : 64);
        cfg.rows[i] = (uint8_t)(i < 5 ? 16 : pairs);
    }
    _tile_loadconfig(&cfg);
}

/* C tile T rounded to bf16 into 16 rows of 16 values at dst (row stride ld). */
#define AMX_STORE_Y(T, dst, ld)                                                           \
    do {                                                                                \
        _tile_stored(T, cbuf, 64);                                                      \
        for (int i_ = 0; i_ < 16; ++i_)                                                 \
            _mm256_storeu_si256((__m256i *)((dst) + i_ * (ld)),                         \
                                (__m256i)_mm512_cvtneps_pbh(                            \
                                    _mm512_load_ps(cbuf + 16 * i_)));                   \
    } while (0)
/* C tile T added to 16 rows of 16 bf16 values at dst (row stride ld), rounded once. */
#define AMX_ADD_OUT(T, dst, ld)                                                           \
    do {                                                                                \
        _tile_stored(T, cbuf, 64);                                                      \
        for (int i_ = 0; i_ < 16; ++i_) {                                               \
            bf16 *o_ = (dst) + i_ * (ld);                                               \
            const __m512 s_ = _mm512_add_ps(load_bf16x16(o_),                           \
                                            _mm512_load_ps(cbuf + 16 * i_));            \
            _mm256_storeu_si256((__m256i *)o_, (__m256i)_mm512_cvtneps_pbh(s_));         \
        }                                                                               \
    } while (0)

/* Whether an item of nt tokens takes the tiles: a whole block of 16 at least, x's rows a
 * whole number of 32-value steps (they are read in place), and every slice 1-16 pairs
 * (up to 32 ranks: more would need two tile steps summed before out is rounded). */
static int amx_takes(int64_t nt, int64_t in, int64_t r, const int64_t *restrict slices,
                     int64_t num_slices)
{
    if (nt < 16 || in % 32 != 0 || r % 16 != 0 || !skinny_amx_enabled()) return 0;
    for (int64_t s = 0; s < num_slices; ++s)
        if ((slices[4 * s + 1] + 1) / 2 - slices[4 * s] / 2 > 16
            || slices[4 * s + 1] <= slices[4 * s])
            return 0;
    return 1;
}

/* nt (a multiple of 16) tokens of one slot where amx_takes, as lora_tokens_avx512, but x
 * read in place: rows of w values (a multiple of 32) at a stride of ldx. */
static void lora_blocks_amx(const bf16 *restrict x, int64_t ldx, bf16 *restrict out,
                            int64_t out_stride, int64_t nt, int64_t w, const bf16 *restrict at,
                            const bf16 *restrict bt, int64_t r, const int64_t *restrict slices,
                            int64_t num_slices, bf16 *restrict yb)
{
    float cbuf[256] __attribute__((aligned(64)));
    const int64_t in2 = w / 2;
    int pairs = 16;
    amx_configure(pairs);
    for (int64_t t0 = 0; t0 < nt; t0 += 16) /* the shrink: yb = bf16(xb . A^T) */
        for (int64_t k0 = 0; k0 < r; k0 += 64) {
            const int64_t wb = r - k0 < 64 ? r - k0 : 64, nv = wb / 16;
            const bf16 *restrict block = at + in2 * k0 * 2;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t p = 0; p < w; p += 32) {
                const bf16 *restrict a = block + p * wb; /* pair-row p / 2 */
                _tile_loadd(4, x + t0 * ldx + p, ldx * 2);
                _tile_loadd(5, a, wb * 4); _tile_dpbf16ps(0, 4, 5);
                if (nv > 1) { _tile_loadd(6, a + 32, wb * 4); _tile_dpbf16ps(1, 4, 6); }
                if (nv > 2) { _tile_loadd(7, a + 64, wb * 4); _tile_dpbf16ps(2, 4, 7); }
                if (nv > 3) { _tile_loadd(5, a + 96, wb * 4); _tile_dpbf16ps(3, 4, 5); }
            }
            bf16 *restrict y = yb + t0 * r + k0;
            AMX_STORE_Y(0, y, r);
            if (nv > 1) AMX_STORE_Y(1, y + 16, r);
            if (nv > 2) AMX_STORE_Y(2, y + 32, r);
            if (nv > 3) AMX_STORE_Y(3, y + 48, r);
        }
    const bf16 *restrict bs = bt; /* the slice's tiles */
    for (int64_t s = 0; s < num_slices; ++s) { /* the expand: out = bf16(out + yb . B^T) */
        const int64_t k2b = slices[4 * s] / 2, k2e = (slices[4 * s + 1] + 1) / 2;
        const int64_t lo = slices[4 * s + 2], hi = slices[4 * s + 3], np = k2e - k2b;
        if (np != pairs) amx_configure(pairs = (int)np);
        for (int64_t t0 = 0; t0 < nt; t0 += 16) {
            _tile_loadd(4, yb + t0 * r + 2 * k2b, r * 2);
            for (int64_t o0 = lo; o0 + 64 <= hi; o0 += 64) {
                const bf16 *restrict b = bs + (o0 - lo) * np * 2;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                _tile_loadd(5, b, 256); _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, b + 32, 256); _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, b + 64, 256); _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, b + 96, 256); _tile_dpbf16ps(3, 4, 5);
                bf16 *restrict og = out + t0 * out_stride + o0;
                AMX_ADD_OUT(0, og, out_stride);
                AMX_ADD_OUT(1, og + 16, out_stride);
                AMX_ADD_OUT(2, og + 32, out_stride);
                AMX_ADD_OUT(3, og + 48, out_stride);
            }
        }
        const int64_t o0 = lo + (hi - lo) / 64 * 64;
        expand_last_columns(yb, r, bs + (o0 - lo) * np * 2, k2b, k2e, hi - o0, out + o0,
                            out_stride, nt);
        bs += (hi - lo) * np * 2;
    }
    _tile_release();
}
#endif

/* The same with vdpbf16ps. xb: the tokens' bf16 rows (nt of them, at a stride of ldx), each
 * in2 pairs; yb: [groups * 4, r] bf16. */
static void lora_tokens_avx512(const bf16 *restrict xb, int64_t ldx, bf16 *restrict out,
                               int64_t out_stride, int64_t nt, int64_t in2,
                               const bf16 *restrict at, const bf16 *restrict bt, int64_t r,
                               const int64_t *restrict slices, int64_t num_slices,
                               bf16 *restrict yb)
{
    const int64_t groups = (nt + LORA_TOKENS - 1) / LORA_TOKENS;
    for (int64_t g = 0; g < groups; ++g) {
        const bf16 *restrict xg = xb + g * LORA_TOKENS * ldx;
        bf16 *restrict yg = yb + g * LORA_TOKENS * r;
        if (nt - g * LORA_TOKENS >= 2 * LORA_TOKENS) {
            /* this group and the next */
            shrink_group_avx512(xg, ldx, in2, at, r, 2 * LORA_TOKENS, 1, yg);
            ++g;
            continue;
        }
#define SHRINK(N, REUSE) shrink_group_avx512(xg, ldx, in2, at, r, N, REUSE, yg)
        LORA_BY_GROUP(LORA_GROUP_TOKENS(nt, g), groups, SHRINK);
#undef SHRINK
    }
    const bf16 *restrict bs = bt; /* the slice's tiles */
    for (int64_t s = 0; s < num_slices; ++s) {
        /* the pairs holding the slice's ranks; a pair's other row is zero here */
        const int64_t k2b = slices[4 * s] / 2, k2e = (slices[4 * s + 1] + 1) / 2;
        const int64_t lo = slices[4 * s + 2], hi = slices[4 * s + 3], np = k2e - k2b;
        /* group after group along the whole tiles (common.h: the expand's order) */
        const int64_t full = lo + (hi - lo) / 64 * 64;
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t ng = LORA_GROUP_TOKENS(nt, g), tiles = (full - lo) / 64;
            int64_t first = lo; /* the tiles left to the loop below */
            if (ng <= 2 && tiles >= 2) { /* the first and second half of the tiles at once */
                const int64_t half = tiles / 2;
                const bf16 *restrict yg = yb + g * LORA_TOKENS * r;
                bf16 *restrict og = out + g * LORA_TOKENS * out_stride + lo;
                for (int64_t i = 0; i < half; ++i) {
                    const bf16 *restrict t1 = bs + i * 64 * np * 2;
                    const bf16 *restrict t2 = bs + (i + half) * 64 * np * 2;
                    if (ng == 1)
                        expand_tile_avx512(yg, r, t1, t2, k2b, k2e, og + i * 64,
                                           og + (i + half) * 64, out_stride, 1, 2, 0);
                    else
                        expand_tile_avx512(yg, r, t1, t2, k2b, k2e, og + i * 64,
                                           og + (i + half) * 64, out_stride, 2, 2, 0);
                }
                first = lo + 2 * half * 64;
            }
            for (int64_t o0 = first; o0 < full; o0 += 64) {
                const bf16 *restrict tile = bs + (o0 - lo) * np * 2;
                const bf16 *restrict yg = yb + g * LORA_TOKENS * r;
                bf16 *restrict og = out + g * LORA_TOKENS * out_stride + o0;
#define EXPAND(N, REUSE)                                                                  \
    expand_tile_avx512(yg, r, tile, NULL, k2b, k2e, og, NULL, out_stride, N, 1, REUSE)
                LORA_BY_GROUP(ng, groups, EXPAND);
#undef EXPAND
            }
        }
        expand_last_columns(yb, r, bs + (full - lo) * np * 2, k2b, k2e, hi - full,
                            out + full, out_stride, nt);
        bs += (hi - lo) * np * 2;
    }
}
#endif

/* The multiple lora_slots.py pads a projection's summed LoRA rank to for this build
 * (`bf16`: for the bfloat16 kernels, else float32's): 8 (common.h), but 16 in bfloat16
 * where the AMX tiles are compiled in, whose shrink takes 16 ranks a tile (amx_takes
 * leaves other ranks to the vector kernel). */
int loraplex_lora_rank_multiple(int bf16)
{
#ifdef LORA_AMX
    if (bf16) return 16;
#else
    (void)bf16;
#endif
    return LORA_RANK_MULTIPLE;
}

/* The LoRA arguments of lora_segments_bf16, shared by its team (lora.h). */
int lora_bf16_prepare(struct lora_call *c)
{
    if (!(loraplex_bf16_impls() & (1 << c->impl))) return -2;
    c->max_rank = 16;
    for (int64_t i = 0; i < c->num_segs; ++i)
        if (c->ranks[c->seg_slot[i]] > c->max_rank) c->max_rank = c->ranks[c->seg_slot[i]];
    const int64_t size = lora_item_tokens(c->seg_len, c->num_segs, LORA_TOKENS,
                                          LORA_ITEM_TOKENS, c->num_threads);
    c->work = lora_work_items(c->seg_first, c->seg_len, c->seg_slot, c->num_segs, size,
                              &c->num_groups);
    if (!c->work) return -1;
    lora_order_items(c->work, c->num_groups, c->ranks);
    c->item_rows = lora_item_rows(c->work, c->num_groups, LORA_TOKENS);
    c->planned = lora_plan_items(c->work, c->num_groups, c->ranks, c->num_threads);
    return 0;
}

/* A thread's scratch for its work items (lora_bf16_team). */
struct bf16_scratch {
    float *y, *xf; /* y: fp32 [., R] (portable) or bf16 (vector); xf: [., w] fp32 (portable) */
    bf16 *xh;      /* [., w]: x's rows where they are not read in place */
    int copies;
};

/* One work item of a prepared call. */
static void lora_bf16_item(const struct lora_call *c, int64_t g, void *scratch)
{
    const struct bf16_scratch *sc = scratch;
    float *y = sc->y, *xf = sc->xf;
    bf16 *xh = sc->xh;
    const int copies = sc->copies;
    const int64_t in2 = (c->in_features + 1) / 2, w = 2 * in2;
    int64_t t = c->work[3 * g], nt = c->work[3 * g + 1];
    const int64_t slot = c->work[3 * g + 2];
    const bf16 *at = (const bf16 *)(intptr_t)c->at_ptrs[slot];
    const bf16 *bt = (const bf16 *)(intptr_t)c->bt_ptrs[slot];
    const int64_t *slices = c->slice_table + slot * c->max_slices * 4;
#ifdef LORA_AMX
    if (c->impl == BF16_AVX512 && amx_takes(nt, c->in_features, c->ranks[slot], slices,
                                            c->num_slices[slot])) {
        const int64_t done = nt / 16 * 16; /* whole blocks of 16 on tiles, x in place */
        lora_blocks_amx((const bf16 *)c->x + t * c->x_stride, c->x_stride,
                        (bf16 *)c->out + t * c->out_stride, c->out_stride, done,
                        c->in_features, at, bt, c->ranks[slot], slices,
                        c->num_slices[slot], (bf16 *)y);
        t += done;
        nt -= done;
        if (nt == 0) return;
    }
#endif
    /* the tokens' rows: in place where the AVX-512 kernel reads them (an even width:
     * its pairs never pass a row's end), else copied, an odd width padded with a zero
     * (copying a prefill item's 32 rows was ~6 % of a bfloat16 prefill's LoRA) */
    const bf16 *xr = (const bf16 *)c->x + t * c->x_stride;
    int64_t ldx = c->x_stride;
    if (copies) {
        for (int64_t j = 0; j < nt; ++j) {
            memcpy(xh + j * w, xr + j * c->x_stride, sizeof(bf16) * (size_t)c->in_features);
            if (w > c->in_features) xh[j * w + w - 1] = 0;
        }
        xr = xh;
        ldx = w;
    }
#ifdef __AVX512BF16__
    if (c->impl == BF16_AVX512) {
        lora_tokens_avx512(xr, ldx, (bf16 *)c->out + t * c->out_stride, c->out_stride, nt,
                           in2, at, bt, c->ranks[slot], slices, c->num_slices[slot],
                           (bf16 *)y);
        return;
    }
#endif
    for (int64_t i = 0; i < nt * w; ++i) xf[i] = bf16_to_f32(xh[i]); /* rows read */
    lora_tokens_portable(xf, (bf16 *)c->out + t * c->out_stride, c->out_stride, nt, in2,
                         at, bt, c->ranks[slot], slices, c->num_slices[slot], y);
}

/* One thread's share of a prepared call (lora.h: lora_team_items). Returns 1 when scratch
 * memory could not be allocated, else 0. */
int lora_bf16_team(const struct lora_call *c)
{
    const int64_t w = 2 * ((c->in_features + 1) / 2);
    /* per work item, c->item_rows rows at most, each written before it is read */
    const int portable = c->impl != BF16_AVX512;
    /* x's rows are copied by the portable kernel, and at an odd width */
    const int copies = portable || w != c->in_features;
    struct bf16_scratch sc = {
        malloc(sizeof(float) * (size_t)(c->item_rows * c->max_rank)),
        portable ? malloc(sizeof(float) * (size_t)(c->item_rows * w)) : NULL,
        copies ? malloc(sizeof(bf16) * (size_t)(c->item_rows * w)) : NULL, copies};
    const int failed = lora_team_items(c, lora_bf16_item, &sc,
                                       sc.y && (!portable || sc.xf) && (!copies || sc.xh));
    free(sc.y);
    free(sc.xf);
    free(sc.xh);
    return failed;
}

/* Like lora_segments_f32, with bf16 x, out and weights (the tiled pair-interleaved layout
 * above, R a multiple of 8, or of 16 where loraplex_lora_rank_multiple says so);
 * `impl` one of loraplex_bf16_impls.
 * Returns 0, -1 when scratch memory could not be allocated, -2 for an impl not compiled. */
int lora_segments_bf16(
    const bf16 *x, int64_t x_stride, bf16 *out, int64_t out_stride,
    int64_t in_features, int64_t n_out,
    const int64_t *seg_first, const int64_t *seg_len, const int64_t *seg_slot,
    int64_t num_segs, const int64_t *at_ptrs, const int64_t *bt_ptrs, const int64_t *ranks,
    const int64_t *slice_table, const int64_t *num_slices, int64_t max_slices,
    int num_threads, int impl)
{
    struct lora_call c = {x, x_stride, out, out_stride, in_features, n_out, seg_first,
                          seg_len, seg_slot, num_segs, at_ptrs, bt_ptrs, ranks, slice_table,
                          num_slices, max_slices, impl, num_threads, 0, 0, NULL};
    const int status = lora_bf16_prepare(&c);
    if (status != 0) return status;
    int failed = 0;
#pragma omp parallel num_threads(lora_threads(&c, num_threads)) reduction(| : failed)
    failed |= lora_bf16_team(&c);
    free(c.work);
    return failed ? -1 : 0;
}
