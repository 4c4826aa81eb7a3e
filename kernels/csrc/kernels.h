/* The library's exported kernels that other kernels call: included by the files that
 * define them (so the compiler checks each definition against its declaration here) and
 * by cpu_decode_layers.c, which runs a decode step's layers through them. */
#ifndef LORAPLEX_KERNELS_H
#define LORAPLEX_KERNELS_H
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"

void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                  int64_t out_stride, int64_t rows, int64_t hidden, float eps,
                  int num_threads);
void rms_norm_bf16(const bf16 *x, int64_t x_stride, const bf16 *w, bf16 *out,
                   int64_t out_stride, int64_t rows, int64_t hidden, float eps,
                   int num_threads);
void fused_add_rms_norm_f32(float *x, int64_t x_stride, float *residual, int64_t res_stride,
                            const float *w, int64_t rows, int64_t hidden, float eps,
                            int num_threads);
void fused_add_rms_norm_bf16(bf16 *x, int64_t x_stride, bf16 *residual, int64_t res_stride,
                             const bf16 *w, int64_t rows, int64_t hidden, float eps,
                             int num_threads);
int rope_store_kv_f32(float *qkv, int64_t qkv_stride, const float *cos, const float *sin,
                      int64_t cs_stride, const int64_t *slots, int64_t num_tokens,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      float *k_cache, float *v_cache, int64_t num_cache_slots, int num_threads);
int rope_store_kv_bf16(bf16 *qkv, int64_t qkv_stride, const float *cos, const float *sin,
                       int64_t cs_stride, const int64_t *slots, int64_t num_tokens,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       bf16 *k_cache, bf16 *v_cache, int64_t num_cache_slots, int num_threads);
void silu_and_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int64_t out_stride,
                      int64_t rows, int64_t inter, int num_threads);
void silu_and_mul_bf16(const bf16 *gate_up, int64_t gu_stride, bf16 *out, int64_t out_stride,
                       int64_t rows, int64_t inter, int num_threads);
void gelu_and_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int64_t out_stride,
                      int64_t rows, int64_t inter, int num_threads);
void gelu_and_mul_bf16(const bf16 *gate_up, int64_t gu_stride, bf16 *out, int64_t out_stride,
                       int64_t rows, int64_t inter, int num_threads);

int paged_decode_attention_f32(
    const float *query, int64_t q_row_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens_all, const int64_t *seq_ids, const int64_t *rows,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale,
    float *out, int64_t o_row_stride, int64_t o_head_stride, int num_threads,
    int64_t window, float softcap);
int paged_decode_attention_bf16(
    const bf16 *query, int64_t q_row_stride, int64_t q_head_stride,
    const bf16 *k_cache, const bf16 *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens_all, const int64_t *seq_ids, const int64_t *rows,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale,
    bf16 *out, int64_t o_row_stride, int64_t o_head_stride, int num_threads, int impl,
    int64_t window, float softcap);

/* Prefill chunks' attention (cpu_prefill_attention.c): in a region of its own, or as one
 * thread's share of a region that runs other kernels too (cpu_decode_layers.c): the step's
 * work items, built once for all its layers (free them), each thread's scratch floats, and
 * the share, an orphaned `omp for` with no wait after it. */
int paged_prefill_attention(
    const void *query, int64_t q_row_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, const int64_t *seq_ids,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, void *out, int64_t o_row_stride, int64_t o_head_stride,
    int is_bf16, int num_threads, int impl, int64_t window, float softcap);
int64_t *prefill_attention_items(const int32_t *query_start_loc, const int64_t *seq_ids,
                                 int64_t num_seqs, int64_t num_kv_heads, int64_t *num_items);
size_t prefill_attention_scratch(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
int prefill_attention_team(
    const void *query, int64_t q_row_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float softcap, void *out, int64_t o_row_stride, int64_t o_head_stride, int is_bf16,
    int impl, const int64_t *items, int64_t num_items, float *scratch);

int skinny_linear_f32(const float *x, int64_t ldx, const float *w, const float *bias,
                      float *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                      int num_threads);
int skinny_linear_bf16(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias,
                       bf16 *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                       int num_threads);

/* the bfloat16 skinny GEMM on AMX tiles (cpu_skinny_amx.c): where skinny_amx_buffer gives
 * a buffer (`copies` packed copies of x), the team packs x into it (skinny_amx_pack, each
 * thread its share, then a barrier; or, up to SKINNY_AMX_OWN_ROWS rows, each thread all of
 * it into its own copy), and each thread multiplies its share of the whole 16-row weight
 * blocks (skinny_amx_share, which returns where they end); skinny_amx_enabled: whether
 * tiles are on (the LoRA kernel's long segments take them too, cpu_lora_bf16.c) */
int skinny_amx_enabled(void);
/* whether this GEMM takes tiles (skinny_amx_buffer's conditions but memory) */
int skinny_amx_takes(const bf16 *x, int64_t ldx, int64_t rows, int64_t n, int64_t k);
uint32_t *skinny_amx_buffer(const bf16 *x, int64_t ldx, int64_t rows, int64_t n, int64_t k,
                            int copies);
/* 32-bit pairs of one packed copy of x [rows, k] */
int64_t skinny_amx_packed(int64_t rows, int64_t k);
/* Up to this many rows each thread packs x into its own copy, with no barrier after: a
 * decode step's x is a few KiB, and a barrier's wait, where libgomp's idle thread has
 * gone to sleep, took longer than packing it twice. */
#define SKINNY_AMX_OWN_ROWS 64
void skinny_amx_pack(const bf16 *x, int64_t ldx, int64_t rows, int64_t k, uint32_t *xp,
                     int t, int nt);
int64_t skinny_amx_share(const uint32_t *xp, const bf16 *w, const bf16 *bias, bf16 *out,
                         int64_t ldo, int64_t rows, int64_t n, int64_t k, int t, int nt);

/* the LoRA arguments of skinny_lora_*: segments (first token, length, slot) and the
 * projection's slot tables, as lora_segments_* take them */
#define SKINNY_LORA_ARGS                                                                  \
    const int64_t *seg_first, const int64_t *seg_len, const int64_t *seg_slot,          \
        int64_t num_segs, const int64_t *at_ptrs, const int64_t *bt_ptrs,               \
        const int64_t *ranks, const int64_t *slice_table, const int64_t *num_slices,    \
        int64_t max_slices, int num_threads
int skinny_lora_f32(const float *x, int64_t ldx, const float *w, const float *bias,
                    float *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                    SKINNY_LORA_ARGS);
int skinny_lora_bf16(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias,
                     bf16 *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                     SKINNY_LORA_ARGS, int impl);

#endif
