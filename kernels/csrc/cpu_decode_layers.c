/* A step's decoder layers in one native call: a decode step's, or a step of decode rows and
 * prefill chunks small enough for the skinny GEMM (a prompt admitted while others decode,
 * the steps of continuous batching). For each layer the same kernels, in the same order
 * and on the same buffers' values, as the Python layer code runs one by one
 * (loraplex/model/llama.py), so the results are bit for bit the same; what goes is the
 * Python between them (measured ~15 % of a bfloat16 decode step: module calls, argument
 * checks, ctypes marshalling, seven small tensors per layer; a mixed step of 50-250 rows
 * spent ~14 ms in it on the Xeon with AMX, besides a parallel region per kernel).
 *
 * Per layer, x [rows, hidden] is the previous layer's MLP output and residual the stream
 * before it (layer 0 with `first` set: residual holds the embeddings, x is scratch):
 *
 *   x, residual = add_rms_norm(x, residual)          (layer 0 first: x = rms_norm(residual))
 *   qkv  = x @ Wqkv^T (+ bias) + LoRA                 skinny_lora / skinny_linear
 *   rope_store_kv(qkv -> this layer's K/V cache)     q rotated in place
 *   attn = paged_decode_attention(q's decode rows), paged_prefill_attention(its chunks)
 *   x    = attn @ Wo^T + LoRA
 *   x, residual = add_rms_norm(x, residual)
 *   gate_up = x @ Wgu^T + LoRA;  act = silu(gate) * up
 *   x    = act @ Wdown^T + LoRA
 *
 * The caller applies the final norm. Every table is int64, laid out as the structs below
 * (pointers as integers); decode_layer_fields / decode_step_fields give their sizes so the
 * Python side can check its layout against this one. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "lora.h"

enum { PROJ_QKV, PROJ_O, PROJ_GATE_UP, PROJ_DOWN, NUM_PROJ };

struct decode_proj {
    int64_t weight, bias;  /* [out, in] plain; bias [out] or 0 */
    int64_t at_ptrs, bt_ptrs, ranks, slice_table, num_slices, max_slices;  /* LoRA slots */
};

struct decode_layer {
    int64_t input_norm, post_attention_norm;  /* [hidden] */
    struct decode_proj proj[NUM_PROJ];
};

struct decode_step {
    int64_t rows, hidden, q_size, kv_size, inter;
    int64_t num_heads, num_kv_heads, head_dim, block_size, num_cache_slots;
    int64_t x, residual, qkv, attn, gate_up, act;  /* activations, rows-major, unit stride */
    int64_t cos, sin, cs_stride, slot_mapping;      /* float32 rope rows; int64 slots */
    int64_t block_tables, table_stride, seq_lens, seq_ids, seq_rows, num_seqs;
    int64_t query_start_loc, prefill_ids, num_prefill; /* int32 starts; prefill chunks' seqs */
    int64_t seg_first, seg_len, seg_slot, num_segs; /* LoRA segments; num_segs 0: none */
    int64_t first, bf16, impl, num_threads;
};

int decode_layer_fields(void) { return (int)(sizeof(struct decode_layer) / sizeof(int64_t)); }
int decode_step_fields(void) { return (int)(sizeof(struct decode_step) / sizeof(int64_t)); }

#define P(type, v) ((type)(intptr_t)(v))

/* out [rows, n] = in [rows, k] @ W^T (+ bias) + each segment's LoRA delta */
static int project(const struct decode_step *s, const struct decode_proj *p, int64_t in,
                   int64_t k, int64_t out, int64_t n)
{
    const int t = (int)s->num_threads;
    if (s->bf16) {
        const bf16 *x = P(const bf16 *, in), *w = P(const bf16 *, p->weight),
                   *b = P(const bf16 *, p->bias);
        bf16 *o = P(bf16 *, out);
        if (s->num_segs == 0) return skinny_linear_bf16(x, k, w, b, o, n, s->rows, n, k, t);
        return skinny_lora_bf16(x, k, w, b, o, n, s->rows, n, k, P(const int64_t *, s->seg_first),
                                P(const int64_t *, s->seg_len), P(const int64_t *, s->seg_slot),
                                s->num_segs, P(const int64_t *, p->at_ptrs),
                                P(const int64_t *, p->bt_ptrs), P(const int64_t *, p->ranks),
                                P(const int64_t *, p->slice_table),
                                P(const int64_t *, p->num_slices), p->max_slices, t,
                                (int)s->impl);
    }
    const float *x = P(const float *, in), *w = P(const float *, p->weight),
                *b = P(const float *, p->bias);
    float *o = P(float *, out);
    if (s->num_segs == 0) return skinny_linear_f32(x, k, w, b, o, n, s->rows, n, k, t);
    return skinny_lora_f32(x, k, w, b, o, n, s->rows, n, k, P(const int64_t *, s->seg_first),
                           P(const int64_t *, s->seg_len), P(const int64_t *, s->seg_slot),
                           s->num_segs, P(const int64_t *, p->at_ptrs),
                           P(const int64_t *, p->bt_ptrs), P(const int64_t *, p->ranks),
                           P(const int64_t *, p->slice_table), P(const int64_t *, p->num_slices),
                           p->max_slices, t);
}

static void norm(const struct decode_step *s, int64_t weight, float eps, int first)
{
    const int t = (int)s->num_threads;
    const int64_t h = s->hidden;
    if (s->bf16) {
        if (first)
            rms_norm_bf16(P(const bf16 *, s->residual), h, P(const bf16 *, weight),
                          P(bf16 *, s->x), h, s->rows, h, eps, t);
        else
            fused_add_rms_norm_bf16(P(bf16 *, s->x), h, P(bf16 *, s->residual), h,
                                    P(const bf16 *, weight), s->rows, h, eps, t);
    } else if (first) {
        rms_norm_f32(P(const float *, s->residual), h, P(const float *, weight),
                     P(float *, s->x), h, s->rows, h, eps, t);
    } else {
        fused_add_rms_norm_f32(P(float *, s->x), h, P(float *, s->residual), h,
                               P(const float *, weight), s->rows, h, eps, t);
    }
}

/* RoPE and the K/V store of every row, the decode rows' attention */
static int rope_decode_attention(const struct decode_step *s, int64_t k_cache,
                                 int64_t v_cache, float scale)
{
    const int t = (int)s->num_threads;
    const int64_t qkv_width = s->q_size + 2 * s->kv_size;
    const int32_t *tables = P(const int32_t *, s->block_tables);
    const int32_t *lens = P(const int32_t *, s->seq_lens);
    const int64_t *ids = P(const int64_t *, s->seq_ids), *rows = P(const int64_t *, s->seq_rows);
    if (s->bf16) {
        bf16 *qkv = P(bf16 *, s->qkv);
        if (rope_store_kv_bf16(qkv, qkv_width, P(const float *, s->cos), P(const float *, s->sin),
                               s->cs_stride, P(const int64_t *, s->slot_mapping), s->rows,
                               s->num_heads, s->num_kv_heads, s->head_dim, P(bf16 *, k_cache),
                               P(bf16 *, v_cache), s->num_cache_slots, t) != 0)
            return -3;
        if (s->num_seqs == 0) return 0;
        return paged_decode_attention_bf16(
            qkv, qkv_width, s->head_dim, P(const bf16 *, k_cache), P(const bf16 *, v_cache),
            tables, s->table_stride, lens, ids, rows, s->num_seqs, s->num_heads,
            s->num_kv_heads, s->head_dim, s->block_size, scale, P(bf16 *, s->attn), s->q_size,
            s->head_dim, t, (int)s->impl);
    }
    float *qkv = P(float *, s->qkv);
    if (rope_store_kv_f32(qkv, qkv_width, P(const float *, s->cos), P(const float *, s->sin),
                          s->cs_stride, P(const int64_t *, s->slot_mapping), s->rows,
                          s->num_heads, s->num_kv_heads, s->head_dim, P(float *, k_cache),
                          P(float *, v_cache), s->num_cache_slots, t) != 0)
        return -3;
    if (s->num_seqs == 0) return 0;
    return paged_decode_attention_f32(
        qkv, qkv_width, s->head_dim, P(const float *, k_cache), P(const float *, v_cache),
        tables, s->table_stride, lens, ids, rows, s->num_seqs, s->num_heads, s->num_kv_heads,
        s->head_dim, s->block_size, scale, P(float *, s->attn), s->q_size, s->head_dim, t);
}

/* this layer's attention: RoPE and the K/V store of every row, then the decode rows' and
 * the prefill chunks' attention */
static int attention(const struct decode_step *s, int64_t k_cache, int64_t v_cache,
                     float scale)
{
    const int status = rope_decode_attention(s, k_cache, v_cache, scale);
    if (status != 0 || s->num_prefill == 0) return status;
    return paged_prefill_attention(
        P(const void *, s->qkv), s->q_size + 2 * s->kv_size, s->head_dim,
        P(const void *, k_cache), P(const void *, v_cache), P(const int32_t *, s->block_tables),
        s->table_stride, P(const int32_t *, s->seq_lens), P(const int32_t *, s->query_start_loc),
        P(const int64_t *, s->prefill_ids), s->num_prefill, s->num_heads, s->num_kv_heads,
        s->head_dim, s->block_size, scale, P(void *, s->attn), s->q_size, s->head_dim,
        (int)s->bf16, (int)s->num_threads, (int)s->impl);
}

/* ---- the layers in one parallel region ------------------------------------------------
 *
 * Each kernel above opens its own parallel region, and the skinny GEMM + LoRA waits inside
 * its own: some 150 regions and 120 waits per step of the demo model. libgomp's idle
 * thread sleeps after GOMP_SPINCOUNT's short spin (loraplex/openmp.py), so most of those
 * were a futex wake (~200 context switches per step). Where the step allows (below), the
 * team is started once per step: every thread runs the layer loop, each kernel's work
 * shared as its region would share it (the same rows, weight blocks and work items, so
 * the same results bit for bit) and the waits between kernels are spin_team_wait's. */

/* this thread's rows of `rows` */
static void team_rows(int64_t rows, int64_t *r0, int64_t *r1)
{
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    *r0 = rows * t / nt;
    *r1 = rows * (t + 1) / nt;
}

static void norm_team(const struct decode_step *s, int64_t weight, float eps, int first)
{
    int64_t r0, r1;
    team_rows(s->rows, &r0, &r1);
    if (r1 <= r0) return;
    const int64_t h = s->hidden, n = r1 - r0;
    if (s->bf16) {
        bf16 *x = P(bf16 *, s->x) + r0 * h, *res = P(bf16 *, s->residual) + r0 * h;
        if (first) rms_norm_bf16(res, h, P(const bf16 *, weight), x, h, n, h, eps, 1);
        else fused_add_rms_norm_bf16(x, h, res, h, P(const bf16 *, weight), n, h, eps, 1);
    } else {
        float *x = P(float *, s->x) + r0 * h, *res = P(float *, s->residual) + r0 * h;
        if (first) rms_norm_f32(res, h, P(const float *, weight), x, h, n, h, eps, 1);
        else fused_add_rms_norm_f32(x, h, res, h, P(const float *, weight), n, h, eps, 1);
    }
}

static int project_team(const struct decode_step *s, const struct decode_proj *p, int64_t in,
                        int64_t k, int64_t out, int64_t n, const struct lora_call *base,
                        uint32_t *xp, struct spin_team *team, int *phase)
{
    /* the least max_rank as each dtype's lora_*_prepare sets it */
    struct lora_call c;
    if (base)
        c = lora_for_projection(base, P(const void *, in), k, P(void *, out), n, k, n,
                                P(const int64_t *, p->at_ptrs), P(const int64_t *, p->bt_ptrs),
                                P(const int64_t *, p->ranks), P(const int64_t *, p->slice_table),
                                P(const int64_t *, p->num_slices), p->max_slices,
                                s->bf16 ? 16 : 1);
    const struct lora_call *lc = base ? &c : NULL;
    if (s->bf16) {
        const bf16 *x = P(const bf16 *, in);
        return skinny_team_bf16(x, k, P(const bf16 *, p->weight), P(const bf16 *, p->bias),
                                P(bf16 *, out), n, s->rows, n, k,
                                xp && skinny_amx_takes(x, k, s->rows, n, k) ? xp : NULL, lc,
                                team, phase);
    }
    return skinny_team_f32(P(const float *, in), k, P(const float *, p->weight),
                           P(const float *, p->bias), P(float *, out), n, s->rows, n, k, lc,
                           team, phase);
}

static int rope_team(const struct decode_step *s, int64_t k_cache, int64_t v_cache)
{
    int64_t r0, r1;
    team_rows(s->rows, &r0, &r1);
    const int64_t w = s->q_size + 2 * s->kv_size;
    const float *cos = P(const float *, s->cos) + r0 * s->cs_stride;
    const float *sin = P(const float *, s->sin) + r0 * s->cs_stride;
    const int64_t *slots = P(const int64_t *, s->slot_mapping) + r0;
    int status = 0;
    if (r1 > r0 && s->bf16)
        status = rope_store_kv_bf16(P(bf16 *, s->qkv) + r0 * w, w, cos, sin, s->cs_stride, slots,
                                    r1 - r0, s->num_heads, s->num_kv_heads, s->head_dim,
                                    P(bf16 *, k_cache), P(bf16 *, v_cache), s->num_cache_slots,
                                    1);
    else if (r1 > r0)
        status = rope_store_kv_f32(P(float *, s->qkv) + r0 * w, w, cos, sin, s->cs_stride, slots,
                                   r1 - r0, s->num_heads, s->num_kv_heads, s->head_dim,
                                   P(float *, k_cache), P(float *, v_cache), s->num_cache_slots,
                                   1);
    return status != 0 ? -3 : 0;
}

/* the decode rows' attention, then the prefill chunks' (their items built once per step),
 * each thread its share of each */
static int attention_team(const struct decode_step *s, int64_t k_cache, int64_t v_cache,
                          float scale, const int64_t *pf_items, int64_t pf_num_items,
                          float *pf_scratch)
{
    const int64_t w = s->q_size + 2 * s->kv_size;
    const int32_t *tables = P(const int32_t *, s->block_tables);
    const int32_t *lens = P(const int32_t *, s->seq_lens);
    const int64_t *ids = P(const int64_t *, s->seq_ids), *rows = P(const int64_t *, s->seq_rows);
    int status = 0;
    if (s->num_seqs > 0 && s->bf16)
        status = paged_decode_attention_bf16(
            P(bf16 *, s->qkv), w, s->head_dim, P(const bf16 *, k_cache),
            P(const bf16 *, v_cache), tables, s->table_stride, lens, ids, rows, s->num_seqs,
            s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, scale,
            P(bf16 *, s->attn), s->q_size, s->head_dim, 0, (int)s->impl);
    else if (s->num_seqs > 0)
        status = paged_decode_attention_f32(
            P(float *, s->qkv), w, s->head_dim, P(const float *, k_cache),
            P(const float *, v_cache), tables, s->table_stride, lens, ids, rows, s->num_seqs,
            s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, scale,
            P(float *, s->attn), s->q_size, s->head_dim, 0);
    if (s->num_prefill == 0) return status;
    /* every thread reaches the prefill share's worksharing loop, whatever its status */
    const int failed = prefill_attention_team(
        P(const void *, s->qkv), w, s->head_dim, P(const void *, k_cache),
        P(const void *, v_cache), tables, s->table_stride, lens,
        P(const int32_t *, s->query_start_loc), s->num_heads, s->num_kv_heads, s->head_dim,
        s->block_size, scale, P(void *, s->attn), s->q_size, s->head_dim, (int)s->bf16,
        (int)s->impl, pf_items, pf_num_items, pf_scratch);
    return status != 0 ? status : failed ? -1 : 0;
}

static void silu_team(const struct decode_step *s)
{
    int64_t r0, r1;
    team_rows(s->rows, &r0, &r1);
    if (r1 <= r0) return;
    const int64_t i = s->inter;
    if (s->bf16)
        silu_and_mul_bf16(P(const bf16 *, s->gate_up) + r0 * 2 * i, 2 * i,
                          P(bf16 *, s->act) + r0 * i, i, r1 - r0, i, 1);
    else
        silu_and_mul_f32(P(const float *, s->gate_up) + r0 * 2 * i, 2 * i,
                         P(float *, s->act) + r0 * i, i, r1 - r0, i, 1);
}

/* Whether the step runs in one region: several threads, a thread per sequence at least
 * (a decode row's sequence split over threads merges its parts between two waits of its
 * own; a prefill chunk's tiles are items of their own), every KV slot in the cache
 * (checked here, before anything is written, as the per-kernel path checks it per layer).
 * On the Xeon with AMX a mixed step of 71-97 rows took 64-70 ms in a region per kernel,
 * one of 51-63 rows 36-40 ms in one region. */
static int team_fits(const struct decode_step *s)
{
    if (s->num_threads < 2 || s->num_seqs + s->num_prefill < s->num_threads) return 0;
    const int64_t *slots = P(const int64_t *, s->slot_mapping);
    for (int64_t r = 0; r < s->rows; ++r)
        if (slots[r] < 0 || slots[r] >= s->num_cache_slots) return 0;
    return 1;
}

static int decode_layers_team(const struct decode_layer *layers, int64_t num_layers,
                              const int64_t *kv_caches, const struct decode_step *s,
                              float eps, float scale)
{
    const int t = (int)s->num_threads;
    const int64_t h = s->hidden, qkv_width = s->q_size + 2 * s->kv_size;
    /* the step's LoRA work items, the same for every projection (lora_for_projection) */
    struct lora_call base = {0};
    const int lora = s->num_segs > 0;
    if (lora) {
        const struct decode_proj *p = &layers[0].proj[PROJ_QKV];
        base.seg_first = P(const int64_t *, s->seg_first);
        base.seg_len = P(const int64_t *, s->seg_len);
        base.seg_slot = P(const int64_t *, s->seg_slot);
        base.num_segs = s->num_segs;
        base.at_ptrs = P(const int64_t *, p->at_ptrs);
        base.bt_ptrs = P(const int64_t *, p->bt_ptrs);
        base.ranks = P(const int64_t *, p->ranks);
        base.slice_table = P(const int64_t *, p->slice_table);
        base.num_slices = P(const int64_t *, p->num_slices);
        base.max_slices = p->max_slices;
        base.impl = (int)s->impl;
        base.num_threads = t;
        const int status = s->bf16 ? lora_bf16_prepare(&base) : lora_f32_prepare(&base);
        if (status != 0) return status;
    }
    /* room for one packed copy of x per thread, the widest input's (bf16 on AMX) */
    uint32_t *xp = NULL;
    if (s->bf16 && skinny_amx_enabled()) {
        int64_t widest = h > s->q_size ? h : s->q_size;
        widest = widest > s->inter ? widest : s->inter;
        const int64_t words = skinny_amx_packed(s->rows, widest) * t;
        xp = aligned_alloc(64, (size_t)((words * 4 + 63) / 64 * 64));
    }
    /* the prefill chunks' attention items, the same for every layer */
    int64_t pf_num_items = 0, *pf_items = NULL;
    if (s->num_prefill > 0) {
        pf_items = prefill_attention_items(P(const int32_t *, s->query_start_loc),
                                           P(const int64_t *, s->prefill_ids), s->num_prefill,
                                           s->num_kv_heads, &pf_num_items);
        if (!pf_items) {
            free(xp);
            free(base.work);
            return -1;
        }
    }
    const size_t pf_floats = s->num_prefill > 0
        ? prefill_attention_scratch(s->num_heads, s->num_kv_heads, s->head_dim) : 0;
    struct spin_team team = {0};
    atomic_int failed = 0;
#pragma omp parallel num_threads(t)
    {
        const int nt = omp_get_num_threads();
        int phase = 0;
        float *pf_scratch = pf_floats ? malloc(sizeof(float) * pf_floats) : NULL;
        const struct lora_call *c = lora ? &base : NULL;
/* a kernel's status, then the wait after it; every thread leaves the loop together */
#define STEP(CALL)                                                                      \
        {                                                                               \
            const int st_ = (CALL);                                                     \
            if (st_ != 0) atomic_store(&failed, st_ > 0 ? -1 : st_);                    \
            spin_team_wait(&team, nt, &phase);                                          \
            if (atomic_load(&failed) != 0) break;                                       \
        }
        for (int64_t l = 0; l < num_layers; ++l) {
            const struct decode_layer *layer = &layers[l];
            const int64_t kc = kv_caches[2 * l], vc = kv_caches[2 * l + 1];
            STEP((norm_team(s, layer->input_norm, eps, l == 0 && s->first), 0))
            STEP(project_team(s, &layer->proj[PROJ_QKV], s->x, h, s->qkv, qkv_width, c, xp,
                              &team, &phase))
            STEP(rope_team(s, kc, vc))
            STEP(attention_team(s, kc, vc, scale, pf_items, pf_num_items, pf_scratch))
            STEP(project_team(s, &layer->proj[PROJ_O], s->attn, s->q_size, s->x, h, c, xp,
                              &team, &phase))
            STEP((norm_team(s, layer->post_attention_norm, eps, 0), 0))
            STEP(project_team(s, &layer->proj[PROJ_GATE_UP], s->x, h, s->gate_up,
                              2 * s->inter, c, xp, &team, &phase))
            STEP((silu_team(s), 0))
            STEP(project_team(s, &layer->proj[PROJ_DOWN], s->act, s->inter, s->x, h, c, xp,
                              &team, &phase))
        }
#undef STEP
        free(pf_scratch);
    }
    free(pf_items);
    free(xp);
    free(base.work);
    return atomic_load(&failed);
}

/* layers [num_layers], kv_caches [num_layers][2] (K and V of each layer). Returns 0, -1
 * when a kernel could not allocate its scratch memory, -2 when the skinny GEMM is not
 * compiled for the dtype, -3 when a KV slot lies outside the cache (nothing of that
 * layer's K/V written; earlier layers' were). */
int decode_layers(const struct decode_layer *layers, int64_t num_layers,
                  const int64_t *kv_caches, const struct decode_step *s, float eps,
                  float scale)
{
    if (team_fits(s)) return decode_layers_team(layers, num_layers, kv_caches, s, eps, scale);
    const int64_t h = s->hidden, qkv_width = s->q_size + 2 * s->kv_size;
    for (int64_t l = 0; l < num_layers; ++l) {
        const struct decode_layer *layer = &layers[l];
        int status;
        norm(s, layer->input_norm, eps, l == 0 && s->first);
        if ((status = project(s, &layer->proj[PROJ_QKV], s->x, h, s->qkv, qkv_width)) != 0)
            return status;
        if ((status = attention(s, kv_caches[2 * l], kv_caches[2 * l + 1], scale)) != 0)
            return status;
        if ((status = project(s, &layer->proj[PROJ_O], s->attn, s->q_size, s->x, h)) != 0)
            return status;
        norm(s, layer->post_attention_norm, eps, 0);
        if ((status = project(s, &layer->proj[PROJ_GATE_UP], s->x, h, s->gate_up,
                              2 * s->inter)) != 0)
            return status;
        if (s->bf16)
            silu_and_mul_bf16(P(const bf16 *, s->gate_up), 2 * s->inter, P(bf16 *, s->act),
                              s->inter, s->rows, s->inter, (int)s->num_threads);
        else
            silu_and_mul_f32(P(const float *, s->gate_up), 2 * s->inter, P(float *, s->act),
                             s->inter, s->rows, s->inter, (int)s->num_threads);
        if ((status = project(s, &layer->proj[PROJ_DOWN], s->act, s->inter, s->x, h)) != 0)
            return status;
    }
    return 0;
}
