/* A step's decoder layers in one native call: a decode step's, or a step of decode rows and
 * prefill chunks small enough for the skinny GEMM (a prompt admitted while others decode,
 * the steps of continuous batching). For each layer the same kernels, in the same order
 * and on the same buffers' values, as the Python layer code runs one by one
 * (loraplex/model/decoder.py), so the results are bit for bit the same; what goes is the
 * Python between them (measured ~15 % of a bfloat16 decode step: module calls, argument
 * checks, ctypes marshalling, seven small tensors per layer; a mixed step of 50-250 rows
 * spent ~14 ms in it on the Xeon with AMX, besides a parallel region per kernel).
 *
 * Per layer, x [rows, hidden] is the previous layer's MLP output and residual the stream
 * before it (layer 0 with `first` set: residual holds the embeddings, x is scratch). A
 * Llama-shaped layer (the "pre" norm layout, SiLU, no q/k norms, residual scale 1):
 *
 *   x, residual = add_rms_norm(x, residual)          (layer 0 first: x = rms_norm(residual))
 *   qkv  = x @ Wqkv^T (+ bias) + LoRA                 skinny_lora / skinny_linear
 *   rope_store_kv(qkv -> this layer's K/V cache)     q rotated in place
 *   attn = paged_decode_attention(q's decode rows), paged_prefill_attention(its chunks)
 *          (with the layer's own sliding window and logit soft-cap; the scale is the
 *          step's)
 *   x    = attn @ Wo^T + LoRA
 *   x, residual = add_rms_norm(x, residual)
 *   gate_up = x @ Wgu^T + LoRA;  act = silu(gate) * up
 *   x    = act @ Wdown^T + LoRA
 *
 * What a layer row may change in that (each default leaves the steps above as they are):
 *
 *   qk_norm        RMSNorm of q and k in qkv before RoPE: of each head over head_dim
 *                  (Qwen3, Gemma 3) or of the whole q and k projections (OLMo 2)
 *   norm_layout    "sandwich" (Gemma 2/3): the attention's and the MLP's outputs normed
 *                  before their residual adds, the stream normed again before the MLP
 *                    tmp = attn @ Wo^T;  x = rms_norm(tmp);  x, residual = add_rms_norm(x,
 *                    residual) (pre-feedforward norm);  ... tmp = act @ Wdown^T;
 *                    x = rms_norm(tmp) (post-feedforward norm)
 *                  "post" (OLMo 2): no input norm, the sublayers read the stream itself
 *                    residual += x;  qkv = residual @ Wqkv^T ...;  tmp = attn @ Wo^T;
 *                    x = rms_norm(tmp);  residual += x;  gate_up = residual @ Wgu^T ...;
 *                    tmp = act @ Wdown^T;  x = rms_norm(tmp)
 *   activation     GELU (tanh) instead of SiLU (Gemma)
 *   residual_scale each sublayer's output times it before its residual add (Granite)
 *   rope           which of the step's cos/sin tables rotates this layer (Gemma 3's local
 *                  and global bases; SmolLM3's layers without RoPE: cos 1, sin 0)
 *
 * The caller applies the final norm. Every table is int64, laid out as the structs below
 * (pointers as integers); decode_layer_fields / decode_step_fields give their sizes so the
 * Python side can check its layout against this one. Fields are only ever added at the
 * end of each struct (benchmarks/decode_replay.py replays a step with an older library). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "lora.h"

enum { PROJ_QKV, PROJ_O, PROJ_GATE_UP, PROJ_DOWN, NUM_PROJ };
enum { QK_NORM_NONE, QK_NORM_HEAD, QK_NORM_PROJ };
enum { LAYOUT_PRE, LAYOUT_SANDWICH, LAYOUT_POST };
enum { ACT_SILU, ACT_GELU_TANH };

struct decode_proj {
    int64_t weight, bias;  /* [out, in] plain; bias [out] or 0 */
    int64_t at_ptrs, bt_ptrs, ranks, slice_table, num_slices, max_slices;  /* LoRA slots */
};

struct decode_layer {
    int64_t input_norm, post_attention_norm;  /* [hidden]; input_norm 0 in LAYOUT_POST */
    struct decode_proj proj[NUM_PROJ];
    int64_t window;  /* attention's sliding window in keys, 0: none (Gemma's and Mistral's
                        layers differ in it) */
    double softcap;  /* attention-logit soft-cap, 0: none (a float64 in its int64 field) */
    int64_t qk_norm;         /* QK_NORM_* */
    int64_t q_norm, k_norm;  /* [head_dim] each (QK_NORM_HEAD), [q_size], [kv_size] (PROJ) */
    int64_t norm_layout;     /* LAYOUT_* */
    int64_t pre_feedforward_norm, post_feedforward_norm;  /* [hidden], or 0 where none */
    int64_t activation;      /* ACT_* */
    double residual_scale;   /* 1: none */
    int64_t rope;            /* index of the layer's cos/sin in the step's `ropes` */
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
    int64_t ropes, num_ropes;  /* [num_ropes][2] (cos, sin) pointers, rows cs_stride apart;
                                  0: every layer's are cos and sin */
    int64_t tmp;  /* [rows, hidden] scratch for the sublayer outputs of the sandwich and
                     post layouts (0 where every layer is LAYOUT_PRE) */
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

/* ---- row-wise steps ---------------------------------------------------------------------
 *
 * Norms, adds, scales, q/k norms and the activation work row by row: each takes a range of
 * rows and the threads its kernels may open a region of (all rows and the step's threads
 * in a region per kernel; a thread's own rows and 1 in the one-region step, where such
 * steps back to back need no wait between them). */
struct rows {
    int64_t r0, r1;
    int threads;
};

static struct rows all_rows(const struct decode_step *s)
{
    return (struct rows){0, s->rows, (int)s->num_threads};
}

static size_t elem(const struct decode_step *s) { return s->bf16 ? sizeof(bf16) : sizeof(float); }

/* out rows = weight * in / rms(in) over `width` (rms_norm_f32/bf16) */
static void norm_rows(const struct decode_step *s, int64_t in, int64_t in_stride,
                      int64_t weight, int64_t out, int64_t out_stride, int64_t width, float eps,
                      struct rows r)
{
    if (r.r1 <= r.r0) return;
    const size_t e = elem(s);
    const void *x = P(const char *, in) + e * (size_t)(r.r0 * in_stride);
    void *o = P(char *, out) + e * (size_t)(r.r0 * out_stride);
    if (s->bf16)
        rms_norm_bf16(x, in_stride, P(const bf16 *, weight), o, out_stride, r.r1 - r.r0, width,
                      eps, r.threads);
    else
        rms_norm_f32(x, in_stride, P(const float *, weight), o, out_stride, r.r1 - r.r0, width,
                     eps, r.threads);
}

/* x, residual = rms_norm(x + residual), x + residual */
static void add_norm_rows(const struct decode_step *s, int64_t weight, float eps,
                          struct rows r)
{
    if (r.r1 <= r.r0) return;
    const int64_t h = s->hidden, n = r.r1 - r.r0;
    if (s->bf16)
        fused_add_rms_norm_bf16(P(bf16 *, s->x) + r.r0 * h, h, P(bf16 *, s->residual) + r.r0 * h,
                                h, P(const bf16 *, weight), n, h, eps, r.threads);
    else
        fused_add_rms_norm_f32(P(float *, s->x) + r.r0 * h, h, P(float *, s->residual) + r.r0 * h,
                               h, P(const float *, weight), n, h, eps, r.threads);
}

/* residual = x + residual, in the dtype (as PyTorch's add: float32 sum, bf16 rounded) */
static void add_rows(const struct decode_step *s, struct rows r)
{
    const int64_t h = s->hidden, lo = r.r0 * h, hi = r.r1 * h;
    if (s->bf16) {
        const bf16 *restrict x = P(const bf16 *, s->x);
        bf16 *restrict res = P(bf16 *, s->residual);
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i)
            res[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(res[i]));
    } else {
        const float *restrict x = P(const float *, s->x);
        float *restrict res = P(float *, s->residual);
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) res[i] = x[i] + res[i];
    }
}

/* x *= scale, as PyTorch's `x * scale` (the scale as a float32, bf16 rounded) */
static void scale_rows(const struct decode_step *s, double scale, struct rows r)
{
    const int64_t h = s->hidden, lo = r.r0 * h, hi = r.r1 * h;
    const float f = (float)scale;
    if (s->bf16) {
        bf16 *restrict x = P(bf16 *, s->x);
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * f);
    } else {
        float *restrict x = P(float *, s->x);
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) x[i] *= f;
    }
}

/* Before the attention: the input norm (or, in LAYOUT_POST, the residual add alone) */
static void layer_head(const struct decode_step *s, const struct decode_layer *layer, float eps,
                       int first, struct rows r)
{
    if (layer->norm_layout == LAYOUT_POST) {
        if (!first) add_rows(s, r);
    } else if (first) {
        norm_rows(s, s->residual, s->hidden, layer->input_norm, s->x, s->hidden, s->hidden, eps,
                  r);
    } else {
        add_norm_rows(s, layer->input_norm, eps, r);
    }
}

/* Between the attention and the MLP (the o projection wrote x in LAYOUT_PRE, tmp else) */
static void layer_middle(const struct decode_step *s, const struct decode_layer *layer,
                         float eps, struct rows r)
{
    const int64_t h = s->hidden;
    if (layer->norm_layout != LAYOUT_PRE)
        norm_rows(s, s->tmp, h, layer->post_attention_norm, s->x, h, h, eps, r);
    if (layer->residual_scale != 1.0) scale_rows(s, layer->residual_scale, r);
    if (layer->norm_layout == LAYOUT_PRE)
        add_norm_rows(s, layer->post_attention_norm, eps, r);
    else if (layer->norm_layout == LAYOUT_SANDWICH)
        add_norm_rows(s, layer->pre_feedforward_norm, eps, r);
    else
        add_rows(s, r);
}

/* After the MLP (the down projection wrote x in LAYOUT_PRE, tmp else) */
static int layer_has_tail(const struct decode_layer *layer)
{
    return layer->norm_layout != LAYOUT_PRE || layer->residual_scale != 1.0;
}

static void layer_tail(const struct decode_step *s, const struct decode_layer *layer, float eps,
                       struct rows r)
{
    const int64_t h = s->hidden;
    if (layer->norm_layout != LAYOUT_PRE)
        norm_rows(s, s->tmp, h, layer->post_feedforward_norm, s->x, h, h, eps, r);
    if (layer->residual_scale != 1.0) scale_rows(s, layer->residual_scale, r);
}

/* what the attention's and the MLP's projections read, and where o and down write */
static int64_t sublayer_in(const struct decode_step *s, const struct decode_layer *layer)
{
    return layer->norm_layout == LAYOUT_POST ? s->residual : s->x;
}

static int64_t sublayer_out(const struct decode_step *s, const struct decode_layer *layer)
{
    return layer->norm_layout == LAYOUT_PRE ? s->x : s->tmp;
}

/* RMSNorm of q and k in qkv, in place, by way of attn (free until the attention writes it):
 * each head over head_dim, or each whole projection, as the layer code's rms_norm calls */
static void qk_norm_rows(const struct decode_step *s, const struct decode_layer *layer,
                         float eps, struct rows r)
{
    if (layer->qk_norm == QK_NORM_NONE || r.r1 <= r.r0) return;
    const int64_t w = s->q_size + 2 * s->kv_size, hd = s->head_dim, q = s->q_size;
    const size_t e = elem(s);
    char *qkv = P(char *, s->qkv), *tmp = P(char *, s->attn);
    for (int part = 0; part < 2; ++part) {
        const int64_t off = part ? q : 0, width = part ? s->kv_size : q;
        const int64_t weight = part ? layer->k_norm : layer->q_norm;
        if (layer->qk_norm == QK_NORM_HEAD) {
#pragma omp parallel for num_threads(r.threads) \
    if (r.threads > 1 && (r.r1 - r.r0) * width >= 32768)
            for (int64_t t = r.r0; t < r.r1; ++t) {
                const struct rows heads = {0, width / hd, 1};
                norm_rows(s, s->qkv + (int64_t)e * (t * w + off), hd, weight,
                          s->attn + (int64_t)e * t * q, hd, hd, eps, heads);
            }
        } else {
            norm_rows(s, s->qkv + (int64_t)e * off, w, weight, s->attn, q, width, eps, r);
        }
        for (int64_t t = r.r0; t < r.r1; ++t)
            memcpy(qkv + e * (size_t)(t * w + off), tmp + e * (size_t)(t * q), e * (size_t)width);
    }
}

/* act = silu(gate) * up, or gelu_tanh(gate) * up */
static void act_rows(const struct decode_step *s, const struct decode_layer *layer,
                     struct rows r)
{
    if (r.r1 <= r.r0) return;
    const int64_t i = s->inter, n = r.r1 - r.r0;
    const int gelu = layer->activation == ACT_GELU_TANH;
    if (s->bf16) {
        const bf16 *gu = P(const bf16 *, s->gate_up) + r.r0 * 2 * i;
        bf16 *act = P(bf16 *, s->act) + r.r0 * i;
        (gelu ? gelu_and_mul_bf16 : silu_and_mul_bf16)(gu, 2 * i, act, i, n, i, r.threads);
    } else {
        const float *gu = P(const float *, s->gate_up) + r.r0 * 2 * i;
        float *act = P(float *, s->act) + r.r0 * i;
        (gelu ? gelu_and_mul_f32 : silu_and_mul_f32)(gu, 2 * i, act, i, n, i, r.threads);
    }
}

/* the layer's cos and sin rows (a table of the step's) */
static void layer_rope(const struct decode_step *s, const struct decode_layer *layer,
                       const float **cos, const float **sin)
{
    if (s->ropes == 0) {
        *cos = P(const float *, s->cos);
        *sin = P(const float *, s->sin);
        return;
    }
    const int64_t *tables = P(const int64_t *, s->ropes);
    *cos = P(const float *, tables[2 * layer->rope]);
    *sin = P(const float *, tables[2 * layer->rope + 1]);
}

/* RoPE and the K/V store of every row, the decode rows' attention */
static int rope_decode_attention(const struct decode_step *s, int64_t k_cache,
                                 int64_t v_cache, float scale, int64_t window, float softcap,
                                 const float *cos, const float *sin)
{
    const int t = (int)s->num_threads;
    const int64_t qkv_width = s->q_size + 2 * s->kv_size;
    const int32_t *tables = P(const int32_t *, s->block_tables);
    const int32_t *lens = P(const int32_t *, s->seq_lens);
    const int64_t *ids = P(const int64_t *, s->seq_ids), *rows = P(const int64_t *, s->seq_rows);
    if (s->bf16) {
        bf16 *qkv = P(bf16 *, s->qkv);
        if (rope_store_kv_bf16(qkv, qkv_width, cos, sin, s->cs_stride,
                               P(const int64_t *, s->slot_mapping), s->rows, s->num_heads,
                               s->num_kv_heads, s->head_dim, P(bf16 *, k_cache),
                               P(bf16 *, v_cache), s->num_cache_slots, t) != 0)
            return -3;
        if (s->num_seqs == 0) return 0;
        return paged_decode_attention_bf16(
            qkv, qkv_width, s->head_dim, P(const bf16 *, k_cache), P(const bf16 *, v_cache),
            tables, s->table_stride, lens, ids, rows, s->num_seqs, s->num_heads,
            s->num_kv_heads, s->head_dim, s->block_size, scale, P(bf16 *, s->attn), s->q_size,
            s->head_dim, t, (int)s->impl, window, softcap);
    }
    float *qkv = P(float *, s->qkv);
    if (rope_store_kv_f32(qkv, qkv_width, cos, sin, s->cs_stride,
                          P(const int64_t *, s->slot_mapping), s->rows, s->num_heads,
                          s->num_kv_heads, s->head_dim, P(float *, k_cache),
                          P(float *, v_cache), s->num_cache_slots, t) != 0)
        return -3;
    if (s->num_seqs == 0) return 0;
    return paged_decode_attention_f32(
        qkv, qkv_width, s->head_dim, P(const float *, k_cache), P(const float *, v_cache),
        tables, s->table_stride, lens, ids, rows, s->num_seqs, s->num_heads, s->num_kv_heads,
        s->head_dim, s->block_size, scale, P(float *, s->attn), s->q_size, s->head_dim, t,
        window, softcap);
}

/* this layer's attention: RoPE and the K/V store of every row, then the decode rows' and
 * the prefill chunks' attention */
static int attention(const struct decode_step *s, const struct decode_layer *layer,
                     int64_t k_cache, int64_t v_cache, float scale)
{
    const float softcap = (float)layer->softcap;
    const float *cos, *sin;
    layer_rope(s, layer, &cos, &sin);
    const int status = rope_decode_attention(s, k_cache, v_cache, scale, layer->window,
                                             softcap, cos, sin);
    if (status != 0 || s->num_prefill == 0) return status;
    return paged_prefill_attention(
        P(const void *, s->qkv), s->q_size + 2 * s->kv_size, s->head_dim,
        P(const void *, k_cache), P(const void *, v_cache), P(const int32_t *, s->block_tables),
        s->table_stride, P(const int32_t *, s->seq_lens), P(const int32_t *, s->query_start_loc),
        P(const int64_t *, s->prefill_ids), s->num_prefill, s->num_heads, s->num_kv_heads,
        s->head_dim, s->block_size, scale, P(void *, s->attn), s->q_size, s->head_dim,
        (int)s->bf16, (int)s->num_threads, (int)s->impl, layer->window, softcap);
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

/* this thread's rows, for a row-wise step of the one-region path */
static struct rows team_share(const struct decode_step *s)
{
    struct rows r = {0, 0, 1};
    team_rows(s->rows, &r.r0, &r.r1);
    return r;
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

/* this thread's rows of the q/k norms, RoPE and the K/V store */
static int rope_team(const struct decode_step *s, const struct decode_layer *layer,
                     float eps, int64_t k_cache, int64_t v_cache)
{
    const struct rows share = team_share(s);
    const int64_t r0 = share.r0, r1 = share.r1;
    qk_norm_rows(s, layer, eps, share);
    const int64_t w = s->q_size + 2 * s->kv_size;
    const float *cos, *sin;
    layer_rope(s, layer, &cos, &sin);
    cos += r0 * s->cs_stride;
    sin += r0 * s->cs_stride;
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
static int attention_team(const struct decode_step *s, const struct decode_layer *layer,
                          int64_t k_cache, int64_t v_cache, float scale,
                          const int64_t *pf_items, int64_t pf_num_items, float *pf_scratch)
{
    const int64_t window = layer->window;
    const float softcap = (float)layer->softcap;
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
            P(bf16 *, s->attn), s->q_size, s->head_dim, 0, (int)s->impl, window, softcap);
    else if (s->num_seqs > 0)
        status = paged_decode_attention_f32(
            P(float *, s->qkv), w, s->head_dim, P(const float *, k_cache),
            P(const float *, v_cache), tables, s->table_stride, lens, ids, rows, s->num_seqs,
            s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, scale,
            P(float *, s->attn), s->q_size, s->head_dim, 0, window, softcap);
    if (s->num_prefill == 0) return status;
    /* every thread reaches the prefill share's worksharing loop, whatever its status */
    const int failed = prefill_attention_team(
        P(const void *, s->qkv), w, s->head_dim, P(const void *, k_cache),
        P(const void *, v_cache), tables, s->table_stride, lens,
        P(const int32_t *, s->query_start_loc), s->num_heads, s->num_kv_heads, s->head_dim,
        s->block_size, scale, window, softcap, P(void *, s->attn), s->q_size, s->head_dim,
        (int)s->bf16, (int)s->impl, pf_items, pf_num_items, pf_scratch);
    return status != 0 ? status : failed ? -1 : 0;
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
            const int64_t in = sublayer_in(s, layer), out = sublayer_out(s, layer);
            const struct rows share = team_share(s);
            /* the previous layer's rows after its MLP, then this one's before attention:
             * each thread's own rows, so no wait between the two */
            if (l > 0 && layer_has_tail(&layers[l - 1]))
                layer_tail(s, &layers[l - 1], eps, share);
            STEP((layer_head(s, layer, eps, l == 0 && s->first, share), 0))
            STEP(project_team(s, &layer->proj[PROJ_QKV], in, h, s->qkv, qkv_width, c, xp,
                              &team, &phase))
            STEP(rope_team(s, layer, eps, kc, vc))
            STEP(attention_team(s, layer, kc, vc, scale, pf_items, pf_num_items, pf_scratch))
            STEP(project_team(s, &layer->proj[PROJ_O], s->attn, s->q_size, out, h, c, xp,
                              &team, &phase))
            STEP((layer_middle(s, layer, eps, share), 0))
            STEP(project_team(s, &layer->proj[PROJ_GATE_UP], in, h, s->gate_up,
                              2 * s->inter, c, xp, &team, &phase))
            STEP((act_rows(s, layer, share), 0))
            STEP(project_team(s, &layer->proj[PROJ_DOWN], s->act, s->inter, out, h, c, xp,
                              &team, &phase))
        }
        if (num_layers > 0 && atomic_load(&failed) == 0
            && layer_has_tail(&layers[num_layers - 1]))
            layer_tail(s, &layers[num_layers - 1], eps, team_share(s));
#undef STEP
        free(pf_scratch);
    }
    free(pf_items);
    free(xp);
    free(base.work);
    return atomic_load(&failed);
}

/* Every row's kinds known, the weights its kinds read present, its rope table in the step,
 * tmp present where a layout writes it: -4 otherwise (nothing run). */
static int table_valid(const struct decode_layer *layers, int64_t num_layers,
                       const struct decode_step *s)
{
    const int64_t num_ropes = s->ropes ? s->num_ropes : 1;
    for (int64_t l = 0; l < num_layers; ++l) {
        const struct decode_layer *y = &layers[l];
        if (y->qk_norm < QK_NORM_NONE || y->qk_norm > QK_NORM_PROJ
            || y->norm_layout < LAYOUT_PRE || y->norm_layout > LAYOUT_POST
            || y->activation < ACT_SILU || y->activation > ACT_GELU_TANH
            || y->rope < 0 || y->rope >= num_ropes || !y->post_attention_norm)
            return -4;
        if (y->qk_norm != QK_NORM_NONE && (!y->q_norm || !y->k_norm)) return -4;
        if (y->norm_layout != LAYOUT_POST && !y->input_norm) return -4;
        if (y->norm_layout == LAYOUT_SANDWICH && !y->pre_feedforward_norm) return -4;
        if (y->norm_layout != LAYOUT_PRE && (!y->post_feedforward_norm || !s->tmp)) return -4;
    }
    return 0;
}

/* layers [num_layers], kv_caches [num_layers][2] (K and V of each layer). Returns 0, -1
 * when a kernel could not allocate its scratch memory, -2 when the skinny GEMM is not
 * compiled for the dtype, -3 when a KV slot lies outside the cache (nothing of that
 * layer's K/V written; earlier layers' were), -4 when the tables do not hold together
 * (table_valid; nothing run). */
int decode_layers(const struct decode_layer *layers, int64_t num_layers,
                  const int64_t *kv_caches, const struct decode_step *s, float eps,
                  float scale)
{
    const int valid = table_valid(layers, num_layers, s);
    if (valid != 0) return valid;
    if (team_fits(s)) return decode_layers_team(layers, num_layers, kv_caches, s, eps, scale);
    const int64_t h = s->hidden, qkv_width = s->q_size + 2 * s->kv_size;
    const struct rows r = all_rows(s);
    for (int64_t l = 0; l < num_layers; ++l) {
        const struct decode_layer *layer = &layers[l];
        const int64_t in = sublayer_in(s, layer), out = sublayer_out(s, layer);
        int status;
        layer_head(s, layer, eps, l == 0 && s->first, r);
        if ((status = project(s, &layer->proj[PROJ_QKV], in, h, s->qkv, qkv_width)) != 0)
            return status;
        qk_norm_rows(s, layer, eps, r);
        if ((status = attention(s, layer, kv_caches[2 * l], kv_caches[2 * l + 1], scale)) != 0)
            return status;
        if ((status = project(s, &layer->proj[PROJ_O], s->attn, s->q_size, out, h)) != 0)
            return status;
        layer_middle(s, layer, eps, r);
        if ((status = project(s, &layer->proj[PROJ_GATE_UP], in, h, s->gate_up,
                              2 * s->inter)) != 0)
            return status;
        act_rows(s, layer, r);
        if ((status = project(s, &layer->proj[PROJ_DOWN], s->act, s->inter, out, h)) != 0)
            return status;
        if (layer_has_tail(layer)) layer_tail(s, layer, eps, r);
    }
    return 0;
}
