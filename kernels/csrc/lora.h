/* The LoRA kernels as a team's share of a parallel region (cpu_lora_f32.c,
 * cpu_lora_bf16.c), for kernels that run them in their own region after other work
 * (cpu_skinny_gemm.c). */
#ifndef LORAPLEX_CPU_LORA_H
#define LORAPLEX_CPU_LORA_H
#include <stdint.h>

#include "bf16.h"

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

/* TILE_COLUMNS of this build: the width of the tiled layout's blocks (cpu_lora_f32.c). */
int loraplex_lora_tile(void);

/* 0; -1 out of memory; -2 an impl not compiled. */
int lora_f32_prepare(struct lora_call *c);
int lora_bf16_prepare(struct lora_call *c);
/* Every thread of the region calls it once, as the region's last work: its loop has no
 * barrier after it (nowait), the region's end is that barrier (one wait fewer per
 * projection of a decode step). 1 where scratch memory failed, else 0. */
int lora_f32_team(const struct lora_call *c);
int lora_bf16_team(const struct lora_call *c);

#endif
