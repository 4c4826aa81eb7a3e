/* The bfloat16 LoRA kernel as a team's share of a parallel region (cpu_lora_bf16.c), for
 * kernels that run it in their own region after other work (cpu_skinny_gemm.c). */
#ifndef LORAPLEX_CPU_LORA_H
#define LORAPLEX_CPU_LORA_H
#include <stdint.h>

#include "bf16.h"

struct lora_bf16_call {
    const bf16 *x;
    int64_t x_stride;
    bf16 *out;
    int64_t out_stride, in_features, n_out;
    const int64_t *seg_first, *seg_len, *seg_slot;
    int64_t num_segs;
    const int64_t *at_ptrs, *bt_ptrs, *ranks, *slice_table, *num_slices;
    int64_t max_slices;
    int impl;
    /* set by lora_bf16_prepare: the largest rank, the work items (free them) */
    int64_t max_rank, num_groups;
    int64_t *work;
};

/* 0; -1 out of memory; -2 an impl not compiled. */
int lora_bf16_prepare(struct lora_bf16_call *c);
/* Every thread of the region calls it once; 1 where scratch memory failed, else 0. */
int lora_bf16_team(const struct lora_bf16_call *c);

#endif
