/* The LoRA kernels as a team's share of a parallel region (cpu_lora_f32.c,
 * cpu_lora_bf16.c), for kernels that run them in their own region after other work
 * (cpu_skinny_gemm.c). */
#ifndef LORAPLEX_CPU_LORA_H
#define LORAPLEX_CPU_LORA_H
#include <omp.h>
#include <stdint.h>

#include "bf16.h"
#include "spin_barrier.h"

/* The most tokens of one slot a work item takes (in groups of 4 kept in registers): the
 * item reads each tile of its slot's weights from memory once for all of them. Fewer
 * where that leaves the team short of work items (lora_item_tokens). */
#define LORA_ITEM_TOKENS 32

/* lora_segments_f32's or lora_segments_bf16's arguments (x and out float or bf16). */
struct lora_call {
    const void *x;
    int64_t x_stride;
    void *out;
    int64_t out_stride, in_features, n_out;
    const int64_t *seg_first, *seg_len, *seg_slot;
    int64_t num_segs;
    const int64_t *at_ptrs, *bt_ptrs, *ranks, *slice_table, *num_slices;
    int64_t max_slices;
    int impl; /* bf16 only */
    int num_threads; /* the team's size (lora_threads may run it smaller) */
    /* set by lora_*_prepare: the largest rank, the work items (free them), the most
     * tokens an item has, rounded up to whole groups of LORA_TOKENS (the rows of a
     * thread's scratch buffers: a decode step's items have 1-4 tokens, and buffers sized
     * for LORA_ITEM_TOKENS were hundreds of KiB zeroed per thread and projection) */
    int64_t max_rank, num_groups;
    int64_t *work;
    int64_t item_rows;
    int planned; /* lora_plan_items's team size, 0: the items claimed at run time */
};

/* Rows of scratch a prepared call's items need: their most tokens in whole groups. */
static inline int64_t lora_item_rows(const int64_t *work, int64_t num_groups, int64_t group)
{
    int64_t most = 1;
    for (int64_t g = 0; g < num_groups; ++g)
        if (work[3 * g + 1] > most) most = work[3 * g + 1];
    return (most + group - 1) / group * group;
}

/* The team size for a prepared call: a lone work item runs on the calling thread (waking
 * another costs more than it saves). */
static inline int lora_threads(const struct lora_call *c, int num_threads)
{
    return c->num_groups < num_threads ? (int)(c->num_groups ? c->num_groups : 1)
                                       : num_threads;
}

/* A prepared call's work items for another projection of the same step (the work depends
 * on the segments and the team only): this projection's tensors and slots, its largest
 * rank (at least `least`, as lora_*_prepare starts from). */
static inline struct lora_call lora_for_projection(
    const struct lora_call *base, const void *x, int64_t x_stride, void *out,
    int64_t out_stride, int64_t in_features, int64_t n_out, const int64_t *at_ptrs,
    const int64_t *bt_ptrs, const int64_t *ranks, const int64_t *slice_table,
    const int64_t *num_slices, int64_t max_slices, int64_t least)
{
    struct lora_call c = *base;
    c.x = x;
    c.x_stride = x_stride;
    c.out = out;
    c.out_stride = out_stride;
    c.in_features = in_features;
    c.n_out = n_out;
    c.at_ptrs = at_ptrs;
    c.bt_ptrs = bt_ptrs;
    c.ranks = ranks;
    c.slice_table = slice_table;
    c.num_slices = num_slices;
    c.max_slices = max_slices;
    c.max_rank = least;
    for (int64_t i = 0; i < c.num_segs; ++i)
        if (ranks[c.seg_slot[i]] > c.max_rank) c.max_rank = ranks[c.seg_slot[i]];
    return c;
}

/* The item after `g` that thread `me` owns (lora_plan_items), or num_groups. */
static inline int64_t lora_next_owned(const int64_t *work, int64_t num_groups, int me,
                                      int64_t g)
{
    const int64_t *owner = work + 3 * num_groups;
    for (++g; g < num_groups; ++g)
        if (owner[g] == me) break;
    return g;
}

/* The first LORA_START_LINES cache lines of a run of weights, read into cache ahead. */
#define LORA_START_LINES 16
static inline void lora_prefetch_start(const void *p)
{
    for (int l = 0; l < LORA_START_LINES; ++l)
        __builtin_prefetch((const char *)p + 64 * l, 0, 3);
}

/* Runs this thread's planned items (lora_plan_items) in order through `item`
 * (with `scratch`): before each, the first lines of its B and of the next one's A are read
 * into cache, so that neither run of weights begins with a wait on memory. In a float32
 * decode step replayed in the engine (Zen 5, 20 adapters) the step's LoRA cost 4 % less
 * than with the items claimed at run time (bfloat16: 4 % less). */
static inline void lora_own_items(const struct lora_call *c, int me,
                                  void (*item)(const struct lora_call *, int64_t, void *),
                                  void *scratch)
{
    for (int64_t g = lora_next_owned(c->work, c->num_groups, me, -1); g < c->num_groups;) {
        const int64_t next = lora_next_owned(c->work, c->num_groups, me, g);
        lora_prefetch_start((const void *)(intptr_t)c->bt_ptrs[c->work[3 * g + 2]]);
        if (next < c->num_groups)
            lora_prefetch_start((const void *)(intptr_t)c->at_ptrs[c->work[3 * next + 2]]);
        item(c, g, scratch);
        g = next;
    }
}

/* One thread's share of a prepared call's items, inside a parallel region: its own where
 * they were planned for this team (lora_plan_items), else claimed at run time by an
 * orphaned `omp for`, which every thread of the team then reaches. `ok`: the thread's
 * scratch was allocated. Returns 1 where it was not, else 0. */
static inline int lora_team_items(const struct lora_call *c,
                                  void (*item)(const struct lora_call *, int64_t, void *),
                                  void *scratch, int ok)
{
    if (c->planned == omp_get_num_threads()) {
        if (ok) lora_own_items(c, omp_get_thread_num(), item, scratch);
        return !ok;
    }
    int failed = 0;
#pragma omp for schedule(dynamic, 1) nowait /* the region ends after it */
    for (int64_t g = 0; g < c->num_groups; ++g) {
        if (!ok) {
            failed = 1;
            continue;
        }
        item(c, g, scratch);
    }
    return failed;
}

/* A thread's LoRA weights read into cache while its share of the projection's GEMM runs
 * (cpu_skinny_gemm.c): the items it will run after the GEMM (lora_team_items: its own where
 * planned, else every team-size-th), their A then their B, a line or two per step of the
 * GEMM's inner loop, so that the LoRA reads them from cache instead of waiting on memory
 * after the GEMM. */
#ifndef LORA_PREFETCH_HINT
#define LORA_PREFETCH_HINT 2 /* __builtin_prefetch's locality */
#endif
struct lora_prefetch {
    const struct lora_call *c;
    int me, nt, pairs;
    int64_t item;        /* the item being read, c->num_groups past the last */
    int part;            /* 0: its A, 1: its B */
    const char *p, *end; /* the run's next line, its end; p NULL when all are read */
    int64_t lines;       /* lines per GEMM group (lora_prefetch_spread) */
};

/* Elements of a slot's B in the tiled layout: its slices' diagonal blocks (bfloat16's
 * ranks in whole pairs). */
static inline int64_t lora_b_elems(const int64_t *slices, int64_t num_slices, int pairs)
{
    int64_t n = 0;
    for (int64_t s = 0; s < num_slices; ++s) {
        const int64_t kb = slices[4 * s], ke = slices[4 * s + 1];
        const int64_t rows = pairs ? 2 * ((ke + 1) / 2 - kb / 2) : ke - kb;
        n += rows * (slices[4 * s + 3] - slices[4 * s + 2]);
    }
    return n;
}

static inline int64_t lora_a_elems(const struct lora_call *c, int64_t slot, int pairs)
{
    return (pairs ? (c->in_features + 1) / 2 * 2 : c->in_features) * c->ranks[slot];
}

static inline int lora_prefetch_owns(const struct lora_prefetch *f, int64_t g)
{
    const struct lora_call *c = f->c;
    return c->planned == f->nt ? c->work[3 * c->num_groups + g] == f->me : g % f->nt == f->me;
}

/* Points f at its item's part (A or B), or at the next owned item's A. */
static inline void lora_prefetch_run(struct lora_prefetch *f)
{
    const struct lora_call *c = f->c;
    const int64_t elem = f->pairs ? 2 : 4;
    for (; f->item < c->num_groups; ++f->item, f->part = 0) {
        if (!lora_prefetch_owns(f, f->item)) continue;
        const int64_t slot = c->work[3 * f->item + 2];
        if (f->part == 0) {
            f->p = (const char *)(intptr_t)c->at_ptrs[slot];
            f->end = f->p + lora_a_elems(c, slot, f->pairs) * elem;
        } else {
            f->p = (const char *)(intptr_t)c->bt_ptrs[slot];
            f->end = f->p + lora_b_elems(c->slice_table + slot * c->max_slices * 4,
                                         c->num_slices[slot], f->pairs) * elem;
        }
        return;
    }
    f->p = f->end = NULL;
}

/* Thread `me` of a team of `nt`, about to run its share of a projection with LoRA `c`. */
static inline void lora_prefetch_init(struct lora_prefetch *f, const struct lora_call *c,
                                      int pairs, int me, int nt)
{
    *f = (struct lora_prefetch){c, me, nt, pairs, 0, 0, NULL, NULL, 0};
    lora_prefetch_run(f);
}

/* Spreads the thread's weights over its `groups` groups of the GEMM. */
static inline void lora_prefetch_spread(struct lora_prefetch *f, int64_t groups)
{
    const struct lora_call *c = f->c;
    int64_t elems = 0;
    for (int64_t g = 0; g < c->num_groups; ++g) {
        if (!lora_prefetch_owns(f, g)) continue;
        const int64_t slot = c->work[3 * g + 2];
        elems += lora_a_elems(c, slot, f->pairs)
                 + lora_b_elems(c->slice_table + slot * c->max_slices * 4,
                                c->num_slices[slot], f->pairs);
    }
    const int64_t lines = (elems * (f->pairs ? 2 : 4) + 63) / 64;
    f->lines = groups > 0 ? (lines + groups - 1) / groups : 0;
}

/* Lines per step of a group's inner loop (`steps` of them). */
static inline int lora_prefetch_per_step(const struct lora_prefetch *f, int64_t steps)
{
    if (!f || !f->p) return 0;
    return (int)((f->lines + steps - 1) / steps);
}

/* The next n lines. */
static inline void lora_prefetch_some(struct lora_prefetch *f, int n)
{
    for (int l = 0; l < n && f->p; ++l) {
        __builtin_prefetch(f->p, 0, LORA_PREFETCH_HINT);
        f->p += 64;
        if (f->p >= f->end) {
            if (f->part == 0) {
                f->part = 1;
            } else {
                f->part = 0;
                ++f->item;
            }
            lora_prefetch_run(f);
        }
    }
}

/* skinny_lora_* as one thread's part of a region every thread runs (cpu_skinny_gemm.c). */
int skinny_team_f32(const float *x, int64_t ldx, const float *w, const float *bias,
                    float *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                    const struct lora_call *c, struct spin_team *team, int *phase);
int skinny_team_bf16(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias,
                     bf16 *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                     uint32_t *xp, const struct lora_call *c, struct spin_team *team,
                     int *phase);

/* TILE_COLUMNS of this build: the width of the tiled layout's blocks (cpu_lora_f32.c). */
int loraplex_lora_tile(void);
/* The multiple a projection's summed LoRA rank is padded to in the tiled layout, for the
 * bfloat16 kernels (`bf16` 1) or float32's (cpu_lora_bf16.c). */
int loraplex_lora_rank_multiple(int bf16);

/* 0; -1 out of memory; -2 an impl not compiled. */
int lora_f32_prepare(struct lora_call *c);
int lora_bf16_prepare(struct lora_call *c);
/* Every thread of the region calls it once, as the region's last work: its loop has no
 * barrier after it (nowait), the region's end is that barrier (one wait fewer per
 * projection of a decode step). 1 where scratch memory failed, else 0. */
int lora_f32_team(const struct lora_call *c);
int lora_bf16_team(const struct lora_call *c);

#endif
