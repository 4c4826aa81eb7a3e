/* Native CPU kernels for the small per-layer ops of the decoder, float32 and bfloat16:
 * RMSNorm (alone and fused with the residual add), neox RoPE on q and k fused with the
 * paged KV store, and SiLU-and-mul and GELU(tanh)-and-mul. Each does one pass per row where
 * the PyTorch reference (layer_ops_ref.py) makes several ops and temporaries.
 *
 * Numerics follow the reference: float32 math, and in bfloat16 a round to nearest even
 * wherever the reference rounds (its ops on bf16 tensors compute in float32 and round
 * each result). RoPE is compiled without FMA contraction so it matches the reference's
 * separate multiply and add bit for bit.
 *
 * Rows are split over `num_threads` OpenMP threads only when a call has enough work to pay
 * for waking them (GRAIN elements; a decode step's rows are far below it).
 */
#include <omp.h>

#include "common.h"
#include "bf16.h"
#include "kernels.h"

enum { GRAIN = 32768 };

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* ---- RMSNorm ------------------------------------------------------------------------ */

/* 1 / sqrt(mean(x^2) + eps) from the row's sum of squares, as the reference's
 * rsqrt(pow(2).mean() + eps) */
static inline float inv_rms(float sum_sq, int64_t hidden, float eps)
{
    return 1.0f / sqrtf(sum_sq / (float)hidden + eps);
}

/* out[r] = w * (x[r] * inv_rms(x[r])) */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                  int64_t out_stride, int64_t rows, int64_t hidden, float eps,
                  int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= GRAIN)
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict xr = x + r * x_stride;
        float *restrict o = out + r * out_stride;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < hidden; ++d) s += xr[d] * xr[d];
        const float inv = inv_rms(s, hidden, eps);
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) o[d] = w[d] * (xr[d] * inv);
    }
}

/* The normalised row rounded to bf16 before the weight multiply, as the reference's
 * `weight * xf.to(x.dtype)` */
void rms_norm_bf16(const bf16 *x, int64_t x_stride, const bf16 *w, bf16 *out,
                   int64_t out_stride, int64_t rows, int64_t hidden, float eps,
                   int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= GRAIN)
    for (int64_t r = 0; r < rows; ++r) {
        const bf16 *restrict xr = x + r * x_stride;
        bf16 *restrict o = out + r * out_stride;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < hidden; ++d) {
            const float v = bf16_to_f32(xr[d]);
            s += v * v;
        }
        const float inv = inv_rms(s, hidden, eps);
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d)
            o[d] = f32_to_bf16(bf16_to_f32(w[d]) * round_bf16(bf16_to_f32(xr[d]) * inv));
    }
}

/* residual[r] += x[r]; x[r] = w * (residual[r] * inv_rms(residual[r])), both in place */
void fused_add_rms_norm_f32(float *x, int64_t x_stride, float *residual, int64_t res_stride,
                            const float *w, int64_t rows, int64_t hidden, float eps,
                            int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= GRAIN)
    for (int64_t r = 0; r < rows; ++r) {
        float *restrict xr = x + r * x_stride;
        float *restrict res = residual + r * res_stride;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < hidden; ++d) {
            const float v = res[d] + xr[d];
            res[d] = v;
            s += v * v;
        }
        const float inv = inv_rms(s, hidden, eps);
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) xr[d] = w[d] * (res[d] * inv);
    }
}

/* The residual add rounded to bf16 (the reference adds bf16 tensors), the norm of that
 * rounded sum, rounded again before the weight multiply. */
void fused_add_rms_norm_bf16(bf16 *x, int64_t x_stride, bf16 *residual, int64_t res_stride,
                             const bf16 *w, int64_t rows, int64_t hidden, float eps,
                             int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= GRAIN)
    for (int64_t r = 0; r < rows; ++r) {
        bf16 *restrict xr = x + r * x_stride;
        bf16 *restrict res = residual + r * res_stride;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < hidden; ++d) {
            const bf16 h = f32_to_bf16(bf16_to_f32(res[d]) + bf16_to_f32(xr[d]));
            res[d] = h;
            const float v = bf16_to_f32(h);
            s += v * v;
        }
        const float inv = inv_rms(s, hidden, eps);
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d)
            xr[d] = f32_to_bf16(bf16_to_f32(w[d]) * round_bf16(bf16_to_f32(res[d]) * inv));
    }
}

/* ---- RoPE + KV store ---------------------------------------------------------------- */

/* Every slot in [-1, num_cache_slots): checked before anything is written. */
static int slots_in_range(const int64_t *slots, int64_t num_tokens, int64_t num_cache_slots)
{
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slots[t] < -1 || slots[t] >= num_cache_slots) return 0;
    return 1;
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* One head of neox RoPE in place: out = x * cos + rotate_half(x) * sin, where
 * rotate_half(x) = [-x2, x1], each product and the sum rounded as the reference does. */
static inline void rope_head_f32(float *restrict p, const float *restrict c,
                                 const float *restrict s, int64_t half)
{
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
        const float x1 = p[d], x2 = p[d + half];
        p[d] = x1 * c[d] + (-x2) * s[d];
        p[d + half] = x2 * c[d + half] + x1 * s[d + half];
    }
}

static inline void rope_head_bf16(bf16 *restrict p, const float *restrict c,
                                  const float *restrict s, int64_t half)
{
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
        const float x1 = bf16_to_f32(p[d]), x2 = bf16_to_f32(p[d + half]);
        p[d] = f32_to_bf16(x1 * c[d] + (-x2) * s[d]);
        p[d + half] = f32_to_bf16(x2 * c[d + half] + x1 * s[d + half]);
    }
}

/* qkv:   [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] rows qkv_stride apart:
 *        q heads, then k heads, then v heads; q and k are rotated in place
 * cos, sin: [num_tokens, head_dim] float32 rows cs_stride apart (each token's position)
 * slots: [num_tokens] flat cache slot (block * block_size + offset), -1 = do not store
 * k_cache, v_cache: [num_cache_slots, num_kv_heads, head_dim], contiguous; each stored
 *        token's rotated k and its v are written at its slot
 * Strides count elements of the tensor's type (elem bytes each). Returns 0, or -1
 * (nothing written) when a slot is outside [-1, num_cache_slots). */
static inline __attribute__((always_inline)) int rope_store_kv(
    char *qkv, int64_t qkv_stride, const float *cos, const float *sin, int64_t cs_stride,
    const int64_t *slots, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, char *k_cache, char *v_cache, int64_t num_cache_slots,
    int num_threads, const int is_bf16)
{
    if (!slots_in_range(slots, num_tokens, num_cache_slots)) return -1;
    const size_t elem = is_bf16 ? sizeof(bf16) : sizeof(float);
    const int64_t half = head_dim / 2, rotated = num_heads + num_kv_heads;
    const size_t kv_bytes = elem * (size_t)(num_kv_heads * head_dim);
#pragma omp parallel for num_threads(num_threads) \
    if (num_tokens * (rotated + num_kv_heads) * head_dim >= GRAIN)
    for (int64_t t = 0; t < num_tokens; ++t) {
        char *row = qkv + elem * (size_t)(t * qkv_stride);
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < rotated; ++h) {
            char *head = row + elem * (size_t)(h * head_dim);
            if (is_bf16)
                rope_head_bf16((bf16 *)head, c, s, half);
            else
                rope_head_f32((float *)head, c, s, half);
        }
        if (slots[t] >= 0) {
            const char *k = row + elem * (size_t)(num_heads * head_dim);
            memcpy(k_cache + kv_bytes * (size_t)slots[t], k, kv_bytes);
            memcpy(v_cache + kv_bytes * (size_t)slots[t], k + kv_bytes, kv_bytes);
        }
    }
    return 0;
}

int rope_store_kv_f32(float *qkv, int64_t qkv_stride, const float *cos, const float *sin,
                      int64_t cs_stride, const int64_t *slots, int64_t num_tokens,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      float *k_cache, float *v_cache, int64_t num_cache_slots, int num_threads)
{
    return rope_store_kv((char *)qkv, qkv_stride, cos, sin, cs_stride, slots, num_tokens,
                         num_heads, num_kv_heads, head_dim, (char *)k_cache, (char *)v_cache,
                         num_cache_slots, num_threads, 0);
}

int rope_store_kv_bf16(bf16 *qkv, int64_t qkv_stride, const float *cos, const float *sin,
                       int64_t cs_stride, const int64_t *slots, int64_t num_tokens,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       bf16 *k_cache, bf16 *v_cache, int64_t num_cache_slots, int num_threads)
{
    return rope_store_kv((char *)qkv, qkv_stride, cos, sin, cs_stride, slots, num_tokens,
                         num_heads, num_kv_heads, head_dim, (char *)k_cache, (char *)v_cache,
                         num_cache_slots, num_threads, 1);
}

#pragma GCC pop_options

/* ---- SiLU and mul, GELU and mul ---------------------------------------------------- */

/* Without trapping math: GCC vectorises neither floorf nor the clamps' compares otherwise
 * (no FP exception is ever read here, and the results are the same). */
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

/* exp over the range where silu needs it: exp_nonpositive's polynomial with 2^n up to
 * 2^127 (x is clamped to [-87, 88]; beyond, silu is 0 or x to float precision anyway). */
static inline float exp_clamped(float x)
{
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* silu(g) = g / (1 + exp(-g)), the reference's formula */
static inline float silu(float g) { return g / (1.0f + exp_clamped(-g)); }

/* gate_up: [rows, 2 * inter] (gate, then up) rows gu_stride apart
 * out:     [rows, inter] = silu(gate) * up */
void silu_and_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int64_t out_stride,
                      int64_t rows, int64_t inter, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= GRAIN)
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict g = gate_up + r * gu_stride, *restrict u = g + inter;
        float *restrict o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) o[i] = silu(g[i]) * u[i];
    }
}

/* x = silu(x), n floats */
static void silu_inplace(float *restrict x, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = silu(x[i]);
}

/* tanh as Cephes' tanhf (common.h's softcap_v, scalar here for the auto-vectoriser): an
 * odd polynomial below |y| = 0.625, (1 - e) / (1 + e) with e = exp(-2|y|) above */
static inline float tanh_f(float y)
{
    const float a = fabsf(y), z = a * a;
    const float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z
                           - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z
                         - 3.33332819422e-1f) * z * a + a;
    const float e = exp_clamped(-2.0f * a);
    const float t = a < 0.625f ? small : (1.0f - e) / (1.0f + e);
    return copysignf(t, y);
}

/* GELU, tanh approximation (PyTorch's approximate="tanh", Gemma's gelu_pytorch_tanh), as
 * PyTorch writes it: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), so that where
 * 1 + tanh cancels (g below about -3) it rounds as PyTorch's does, to its tanh's ulps. */
static inline float gelu_tanh(float g)
{
    const float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    return 0.5f * g * (1.0f + tanh_f(inner));
}

/* gate_up: [rows, 2 * inter] (gate, then up) rows gu_stride apart
 * out:     [rows, inter] = gelu_tanh(gate) * up */
void gelu_and_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int64_t out_stride,
                      int64_t rows, int64_t inter, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= GRAIN)
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict g = gate_up + r * gu_stride, *restrict u = g + inter;
        float *restrict o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) o[i] = gelu_tanh(g[i]) * u[i];
    }
}

static void gelu_inplace(float *restrict x, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = gelu_tanh(x[i]);
}

#pragma GCC pop_options

/* The activation's output rounded to bf16 before the multiply, as the reference's
 * `F.silu(gate) * up` (`F.gelu(gate, approximate="tanh") * up`) on bf16 tensors */
static inline __attribute__((always_inline)) void act_and_mul_bf16(
    const bf16 *gate_up, int64_t gu_stride, bf16 *out, int64_t out_stride, int64_t rows,
    int64_t inter, int num_threads, const int gelu)
{
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= GRAIN)
    for (int64_t r = 0; r < rows; ++r) {
        const bf16 *restrict g = gate_up + r * gu_stride, *restrict u = g + inter;
        bf16 *restrict o = out + r * out_stride;
        /* the activation on a float32 chunk: with the bf16 conversions in the same loop (or
         * under the options above) GCC vectorises none of it */
        float sg[256];
        for (int64_t i0 = 0; i0 < inter; i0 += 256) {
            const int64_t n = inter - i0 < 256 ? inter - i0 : 256;
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) sg[i] = bf16_to_f32(g[i0 + i]);
            if (gelu)
                gelu_inplace(sg, n);
            else
                silu_inplace(sg, n);
#pragma omp simd
            for (int64_t i = 0; i < n; ++i)
                o[i0 + i] = f32_to_bf16(round_bf16(sg[i]) * bf16_to_f32(u[i0 + i]));
        }
    }
}

void silu_and_mul_bf16(const bf16 *gate_up, int64_t gu_stride, bf16 *out, int64_t out_stride,
                       int64_t rows, int64_t inter, int num_threads)
{
    act_and_mul_bf16(gate_up, gu_stride, out, out_stride, rows, inter, num_threads, 0);
}

void gelu_and_mul_bf16(const bf16 *gate_up, int64_t gu_stride, bf16 *out, int64_t out_stride,
                       int64_t rows, int64_t inter, int num_threads)
{
    act_and_mul_bf16(gate_up, gu_stride, out, out_stride, rows, inter, num_threads, 1);
}

/* ---- Greedy argmax -------------------------------------------------------------------- */

/* The index of a row's first maximum, as torch's `max(dim=-1).indices`: a NaN counts as
 * the maximum (the first NaN wins); a row of -inf gives 0. Two passes, both vectorised: the
 * maximum (and whether there is a NaN), then the first element equal to it, found a block
 * at a time; a thread's part of a row stays in its L2 between them. */
enum { ARGMAX_BLOCK = 64 };

#define ARGMAX_PART(load)                                                                 \
    float m = -INFINITY;                                                                  \
    int nan = 0;                                                                          \
    _Pragma("omp simd reduction(max : m) reduction(| : nan)")                             \
    for (int64_t i = 0; i < n; ++i) {                                                     \
        const float v = load(x[i]);                                                       \
        m = v > m ? v : m;                                                                \
        nan |= v != v;                                                                    \
    }                                                                                     \
    for (int64_t b = 0; b < n; b += ARGMAX_BLOCK) {                                       \
        const int64_t e = n - b < ARGMAX_BLOCK ? n : b + ARGMAX_BLOCK;                    \
        int hit = 0;                                                                      \
        _Pragma("omp simd reduction(| : hit)")                                            \
        for (int64_t i = b; i < e; ++i) {                                                 \
            const float v = load(x[i]);                                                   \
            hit |= nan ? v != v : v == m;                                                 \
        }                                                                                 \
        if (hit)                                                                          \
            for (int64_t i = b; i < e; ++i) {                                             \
                const float v = load(x[i]);                                               \
                if (nan ? v != v : v == m) return i;                                      \
            }                                                                             \
    }                                                                                     \
    return 0;

static inline float load_f32(float v) { return v; }

/* x[0..n), n >= 1 */
static int64_t argmax_part_f32(const float *restrict x, int64_t n) { ARGMAX_PART(load_f32) }
static int64_t argmax_part_bf16(const bf16 *restrict x, int64_t n) { ARGMAX_PART(bf16_to_f32) }

#undef ARGMAX_PART

/* Whether a part's first maximum `v` (NaN counting as the maximum) beats the best of the
 * parts before it, `best`: only a strictly greater value or a first NaN does. */
static inline int argmax_beats(float v, float best)
{
    return best == best && (v != v || v > best);
}

/* x: [rows, n] rows x_stride apart, n >= 1; out: [rows] int64. With more than one thread
 * each takes the same share of every row's columns (as the skinny GEMM that wrote the
 * logits shares its outputs, so each reads what its own core wrote), and the shares'
 * maxima are combined in column order. */
#define ARGMAX_ROWS(T, part, load)                                                        \
    const int nt = num_threads;                                                           \
    int64_t *idx = nt < 2 || rows * n < GRAIN || n < 2 * ARGMAX_BLOCK                     \
        ? NULL : malloc(sizeof *idx * (size_t)(rows * nt));                               \
    if (idx == NULL) { /* one thread (or no memory for the shares) */                     \
        for (int64_t r = 0; r < rows; ++r) out[r] = part(x + r * x_stride, n);            \
        return;                                                                           \
    }                                                                                     \
    _Pragma("omp parallel num_threads(nt)")                                               \
    {                                                                                     \
        const int t = omp_get_thread_num(), team = omp_get_num_threads();                 \
        const int64_t lo = n * t / team, hi = n * (t + 1) / team;                         \
        for (int64_t r = 0; r < rows; ++r)                                                \
            idx[r * nt + t] = lo + part(x + r * x_stride + lo, hi - lo);                  \
        _Pragma("omp barrier")                                                            \
        _Pragma("omp for")                                                                \
        for (int64_t r = 0; r < rows; ++r) {                                              \
            const T *xr = x + r * x_stride;                                               \
            int64_t best = idx[r * nt];                                                   \
            for (int u = 1; u < team; ++u) {                                              \
                const int64_t i = idx[r * nt + u];                                        \
                if (argmax_beats(load(xr[i]), load(xr[best]))) best = i;                  \
            }                                                                             \
            out[r] = best;                                                                \
        }                                                                                 \
    }                                                                                     \
    free(idx);

void argmax_rows_f32(const float *x, int64_t x_stride, int64_t *out, int64_t rows, int64_t n,
                     int num_threads)
{
    ARGMAX_ROWS(float, argmax_part_f32, load_f32)
}

void argmax_rows_bf16(const bf16 *x, int64_t x_stride, int64_t *out, int64_t rows, int64_t n,
                      int num_threads)
{
    ARGMAX_ROWS(bf16, argmax_part_bf16, bf16_to_f32)
}

#undef ARGMAX_ROWS
