/* Native CPU kernel (float32): LoRA shrink + expand for many segments of one slot's tokens
 * (decode, and prefill runs up to meta.short_segment_limit) in one call. See
 * cpu_attention_f32.c for how the native kernels are built and called.
 */
#include "common.h"
#include "lora.h"

/* LoRA for 4 consecutive tokens of one slot at a time, so each weight value loaded serves
 * all four. Ranks come padded to a multiple of 8 (zero rows; common.h), so the shrink keeps
 * a tile of ranks x 4 tokens in registers (TILE_COLUMNS, common.h), a last tile whole
 * vectors and perhaps a half one; the expand keeps as many outputs
 * x 4 tokens, so each out row is read and written once. The expand runs per slice
 * (lora_slots.py: `slices`), over that slice's ranks and columns only: B^T is
 * block-diagonal over a packed projection's slices, and the blocks off the diagonal (2/3
 * of q/k/v's, 1/2 of gate/up's) are zero, so skipping them changes no sum and saves their
 * reads.
 *
 * The weights come in the tiled layout (lora_slots.py: `tiled_layout`), so that every
 * tile's weights are one contiguous run and the step's LoRA reads stream like the base
 * GEMM's: read in place, a tile of A^T [in, R] was TILE_COLUMNS values every R, and a tile
 * of B^T [R, out] one run of TILE_COLUMNS per rank, each in a different row (up to 96
 * strided streams at once), which ran at about half the streaming rate (AVX2 EPYC).
 *   A: per block of w = min(TILE_COLUMNS, R - k0) ranks from k0, A^T[:, k0:k0 + w] as
 *      [in, w], the blocks one after another (block k0 at in * k0).
 *   B: per slice (ranks kb..ke, columns lo..hi), one after another, per tile of
 *      wt = min(TILE_COLUMNS, hi - o0) columns from o0, B^T[kb:ke, o0:o0 + wt] as [ke - kb, wt]
 *      (tile o0 at the slice's start + (o0 - lo) * (ke - kb)).
 * x: a work item's rows, read in place; y: [LORA_ITEM_TOKENS, r] at most; slices:
 * num_slices x (first rank, end rank, first column, end column). A group of fewer than 4
 * tokens (a decode step's are one or two) multiplies only its own. */
#define LORA_TOKENS 4
/* Bytes ahead that the shrink and expand loops read into cache (each vector's line):
 * their weights are runs of 10-200 KB read once per decode step, from memory. In a float32
 * decode step replayed in the engine (Zen 5, 20 adapters) the LoRA's cost went down 5 %
 * with them; 1-4 KiB ahead measured the same. */
#define LORA_F32_PREFETCH_BYTES 2048

/* The shrink of nt <= 4 tokens (x rows ldx apart) for ranks k0 .. k0 + VL * nv + 8 * nh
 * (nv <= TILE_VECTORS, nh 0 or 1 and only with AVX-512; all constants where it is
 * inlined), from the block of A^T at k0 (rows of VL * nv + 8 * nh ranks, read in order),
 * the nt x (nv + nh) vectors of sums in registers. y[t * r + k] = x[t] . A^T[:, k]. Only
 * the group's own tokens are multiplied: a decode step's groups have a token or two.
 * `reuse` (a constant): the group is a full one of a work item of several (a prefill's,
 * whose later groups read the weights from cache), so each vector is held in a register
 * for the group's tokens (keep_in_register). An item of one group (a decode step's) reads
 * its weights from memory once, and ran as fast or faster left to the compiler's loads
 * (held, a decode step of 4 tokens per slot 8 % slower, benchmarks/lora_decode.py). */
static inline __attribute__((always_inline)) void shrink_ranks(
    const float *restrict x, int64_t ldx, int64_t in_features, const float *restrict at,
    int64_t r, int64_t k0, const int nv, const int nh, const int nt, const int reuse,
    float *restrict y)
{
    vf c[LORA_TOKENS][TILE_VECTORS];
    vh ch[LORA_TOKENS];
    const int width = VL * nv + HALF_RANKS * nh;
#pragma GCC unroll 4
    for (int t = 0; t < nt; ++t) {
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) c[t][j] = (vf){0};
        ch[t] = (vh){0};
    }
    const float *restrict block = at + in_features * k0;
    for (int64_t i = 0; i < in_features; ++i) {
        const float *restrict a = block + i * width;
#pragma GCC unroll 5
        for (int j = 0; j < nv + nh; ++j)
            __builtin_prefetch((const char *)(a + VL * j) + LORA_F32_PREFETCH_BYTES, 0, 3);
        vf av[TILE_VECTORS];
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) {
            av[j] = loadv(a + VL * j);
            if (reuse) keep_in_register(av[j]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; ++t) {
            const float v = x[t * ldx + i];
#pragma GCC unroll 4
            for (int j = 0; j < nv; ++j) c[t][j] += v * av[j];
            if (nh) {
                vh ah;
                memcpy(&ah, a + VL * nv, sizeof ah);
                ch[t] = fma_half(ch[t], v, ah);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; ++t) {
#pragma GCC unroll 4
        for (int j = 0; j < nv; ++j) memcpy(y + t * r + k0 + VL * j, &c[t][j], sizeof(vf));
        if (nh) memcpy(y + t * r + k0 + VL * nv, &ch[t], sizeof(vh));
    }
}

/* One group's shrink over every tile of ranks (r a multiple of 8), its nt tokens a
 * constant where it is inlined. */
static inline __attribute__((always_inline)) void shrink_group(
    const float *restrict x, int64_t ldx, int64_t in_features, const float *restrict at,
    int64_t r, const int nt, const int reuse, float *restrict y)
{
    int64_t k0 = 0;
    for (; k0 + TILE_COLUMNS <= r; k0 += TILE_COLUMNS)
        shrink_ranks(x, ldx, in_features, at, r, k0, TILE_VECTORS, 0, nt, reuse, y);
#define SHRINK_PART(X, Y, K0, NV, NH)                                                     \
    shrink_ranks(X, ldx, in_features, at, r, K0, NV, NH, nt, reuse, Y)
    LORA_SHRINK_LAST(SHRINK_PART, x, y, k0, r)
#undef SHRINK_PART
}

/* The expand of nt <= 4 tokens (a constant where it is inlined) into TILE_COLUMNS columns,
 * over ranks kb .. ke, from the tile's block `bt` ([ke - kb, TILE_COLUMNS], read in
 * order): og[t * out_stride + o] += y[t] . B^T[kb:ke, o], the nt x TILE_VECTORS vectors of
 * sums in registers; `reuse` as shrink_ranks. */
static inline __attribute__((always_inline)) void expand_tile(
    const float *restrict y, int64_t r, const float *restrict bt, int64_t kb, int64_t ke,
    float *restrict og, int64_t out_stride, const int nt, const int reuse)
{
    vf c[LORA_TOKENS][TILE_VECTORS];
#pragma GCC unroll 4
    for (int t = 0; t < nt; ++t)
#pragma GCC unroll 4
        for (int j = 0; j < TILE_VECTORS; ++j) c[t][j] = (vf){0};
    for (int64_t k = kb; k < ke; ++k) {
        const float *restrict b = bt + (k - kb) * TILE_COLUMNS;
#pragma GCC unroll 4
        for (int j = 0; j < TILE_VECTORS; ++j)
            __builtin_prefetch((const char *)(b + VL * j) + LORA_F32_PREFETCH_BYTES, 0, 3);
        vf bv[TILE_VECTORS];
#pragma GCC unroll 4
        for (int j = 0; j < TILE_VECTORS; ++j) {
            bv[j] = loadv(b + VL * j);
            if (reuse) keep_in_register(bv[j]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; ++t) {
            const float v = y[t * r + k];
#pragma GCC unroll 4
            for (int j = 0; j < TILE_VECTORS; ++j) c[t][j] += v * bv[j];
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; ++t)
#pragma GCC unroll 4
        for (int j = 0; j < TILE_VECTORS; ++j) {
            float *o = og + t * out_stride + VL * j;
            vf sum = loadv(o) + c[t][j];
            memcpy(o, &sum, sizeof sum);
        }
}

/* Up to LORA_ITEM_TOKENS consecutive tokens of one slot (lora.h), in groups of 4: each
 * tile of weights is read from memory once and then, from cache, for every group, so a
 * slot with many tokens in the step (one adapter's whole batch) reads its weights once,
 * not once per 4 tokens. x: the tokens' rows, ldx apart, read in place; y: [groups * 4,
 * r], each group's first rows (its tokens') written and read. */
static void lora_tokens(const float *restrict x, int64_t ldx, float *restrict out,
                        int64_t out_stride, int64_t nt, int64_t in_features,
                        const float *restrict at, const float *restrict bt, int64_t r,
                        const int64_t *restrict slices, int64_t num_slices, float *restrict y)
{
    const int64_t groups = (nt + LORA_TOKENS - 1) / LORA_TOKENS;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t ng = LORA_GROUP_TOKENS(nt, g);
        const float *restrict xg = x + g * LORA_TOKENS * ldx;
        float *restrict yg = y + g * LORA_TOKENS * r;
#define SHRINK(N, REUSE) shrink_group(xg, ldx, in_features, at, r, N, REUSE, yg)
        LORA_BY_GROUP(ng, groups, SHRINK);
#undef SHRINK
    }
    const float *restrict bs = bt; /* the slice's tiles */
    for (int64_t s = 0; s < num_slices; ++s) {
        const int64_t kb = slices[4 * s], ke = slices[4 * s + 1];
        const int64_t lo = slices[4 * s + 2], hi = slices[4 * s + 3];
        /* group after group along the whole tiles (common.h: the expand's order) */
        const int64_t full = lo + (hi - lo) / TILE_COLUMNS * TILE_COLUMNS;
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t o0 = lo; o0 < full; o0 += TILE_COLUMNS) {
                const float *restrict tile = bs + (o0 - lo) * (ke - kb);
                const float *restrict yg = y + g * LORA_TOKENS * r;
                float *restrict og = out + g * LORA_TOKENS * out_stride + o0;
                const int64_t ng = LORA_GROUP_TOKENS(nt, g);
#define EXPAND(N, REUSE) expand_tile(yg, r, tile, kb, ke, og, out_stride, N, REUSE)
                LORA_BY_GROUP(ng, groups, EXPAND);
#undef EXPAND
            }
        const int64_t o0 = full;
        const float *restrict b = bs + (o0 - lo) * (ke - kb); /* the last tile [ke - kb, wt] */
        const int64_t wt = hi - o0;
        for (int64_t t = 0; t < nt; ++t) /* the slice's last (hi - lo) % TILE_COLUMNS columns */
            for (int64_t o = 0; o < wt; ++o) {
                float acc = 0.0f;
                for (int64_t k = kb; k < ke; ++k) acc += y[t * r + k] * b[(k - kb) * wt + o];
                out[t * out_stride + o0 + o] += acc;
            }
        bs += (hi - lo) * (ke - kb);
    }
}

/* The tiled layout's tile width (lora_slots.py builds the layout the build reads). */
int loraplex_lora_tile(void) { return TILE_COLUMNS; }

/* LoRA shrink then expand for every token of every segment, accumulated into out:
 *   out[t, :n_out] += (x[t] @ At_s) @ Bt_s      for the tokens t of segment i (slot s)
 * At_s [in, r_s] holds every slice's A (transposed) and Bt_s [r_s, n_out] the block-diagonal
 * B with the LoRA scale folded in (transposed), r_s padded with zeros to a multiple of 8,
 * both in the tiled layout above (only the diagonal blocks of Bt_s);
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
    struct lora_call c = {x, x_stride, out, out_stride, in_features, n_out, seg_first,
                          seg_len, seg_slot, num_segs, at_ptrs, bt_ptrs, ranks, slice_table,
                          num_slices, max_slices, 0, num_threads, 0, 0, NULL};
    if (lora_f32_prepare(&c) != 0) return -1;
    int failed = 0;
#pragma omp parallel num_threads(lora_threads(&c, num_threads)) reduction(| : failed)
    failed |= lora_f32_team(&c);
    free(c.work);
    return failed ? -1 : 0;
}

/* The arguments of lora_segments_f32, shared by its team (lora.h). */
int lora_f32_prepare(struct lora_call *c)
{
    c->max_rank = 1;
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

/* One work item of a prepared call; `y`: the thread's scratch (lora_f32_team). */
static void lora_f32_item(const struct lora_call *c, int64_t w, void *y)
{
    const int64_t t = c->work[3 * w], nt = c->work[3 * w + 1], slot = c->work[3 * w + 2];
    lora_tokens((const float *)c->x + t * c->x_stride, c->x_stride,
                (float *)c->out + t * c->out_stride, c->out_stride, nt, c->in_features,
                (const float *)(intptr_t)c->at_ptrs[slot],
                (const float *)(intptr_t)c->bt_ptrs[slot], c->ranks[slot],
                c->slice_table + slot * c->max_slices * 4, c->num_slices[slot], y);
}

/* One thread's share of a prepared call (lora.h: lora_team_items). 1 where scratch memory
 * failed, else 0. */
int lora_f32_team(const struct lora_call *c)
{
    /* each group's rows of its tokens are written before they are read */
    float *y = malloc(sizeof(float) * (size_t)(c->item_rows * c->max_rank));
    const int failed = lora_team_items(c, lora_f32_item, y, y != NULL);
    free(y);
    return failed;
}
