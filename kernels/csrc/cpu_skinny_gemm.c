/* Skinny GEMMs on CPU: out[m, n] = x[m, :] . w[n, :] (+ bias[n]) for the few rows of a
 * decode step, float32 and bfloat16 (float32 sums, one rounding to bf16 at the end), read
 * straight from the plain [out, in] weight.
 *
 * At decode sizes (a few to a few dozen rows) a step's GEMMs read every base weight once
 * and do little else, so what they cost is how fast the weights stream from memory.
 * oneDNN's GEMMs (packed or plain) streamed the demo model's weights at 4-13 GB/s there
 * against the machine's 48-52 GB/s for a plain sum over as many bytes (AVX-512 EPYC,
 * benchmarks/skinny_gemm.py). Here each thread takes groups of NB consecutive weight rows
 * (output columns), reads each group from memory once, and multiplies it against every row
 * of x in chunks of MB rows: NB x MB sums of 16 lanes in registers, the group re-read from
 * L1 for each further chunk. A group's sums are reduced across lanes at the end, four at
 * a time.
 *
 * float32: one FMA per 16 weights and row. bfloat16: vdpbf16ps, one per 32 weights and
 * row, its pairs being consecutive values along `in` in both operands, which is the plain
 * layout. `in` needs no particular multiple: the last vector is masked. Compiled only with
 * AVX-512 (and AVX512_BF16 for bf16); `loraplex_skinny_impls` says which. */
#include <omp.h>
#include <stdint.h>

#include "bf16.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum { SKINNY_F32 = 1, SKINNY_BF16 = 2 };

int loraplex_skinny_impls(void)
{
    int impls = 0;
#ifdef __AVX512F__
    impls |= SKINNY_F32;
#endif
#ifdef __AVX512BF16__
    impls |= SKINNY_BF16;
#endif
    return impls;
}

#define NB 4 /* weight rows (output columns) per group */
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 2
#endif
#define MB 6 /* rows of x per chunk: NB * MB = 24 of the 32 vector registers hold sums */

#ifdef __AVX512F__
/* [sum(a), sum(b), sum(c), sum(d)] of four vectors of 16 floats. */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* per 128-bit lane: [a, b, a, b] and [c, d, c, d] partial sums */
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44),
                                      _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                   _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The sums of a group of nb <= NB weight rows against mb <= MB rows of x, stored to out
 * (with bias) as float32 (`out_f32`) or rounded to bf16. `dot` is the K loop. */
#define SKINNY_STORE(OUT_T, STORE_ONE)                                                    \
    _Pragma("GCC unroll 6")                                                             \
    for (int i = 0; i < MB; ++i) {                                                      \
        if (i >= mb) break;                                                             \
        float sums[NB];                                                                 \
        _mm_storeu_ps(sums, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));       \
        OUT_T *restrict o = out + i * ldo + n0;                                         \
        for (int j = 0; j < nb; ++j) {                                                  \
            const float v = sums[j] + (bias ? BIAS_AT(j) : 0.0f);                       \
            STORE_ONE;                                                                  \
        }                                                                               \
    }

static inline __attribute__((always_inline)) void group_f32(
    const float *restrict x, int64_t ldx, const float *restrict w, int64_t k,
    const float *restrict bias, float *restrict out, int64_t ldo, int64_t n0, int nb,
    const int mb, const char **pf, const int pf_lines)
{
    __m512 acc[MB][NB];
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const float *restrict wr[NB];
    for (int j = 0; j < NB; ++j) wr[j] = w + (n0 + (j < nb ? j : 0)) * k;
    for (int64_t p = 0; p < k; p += 16) {
        for (int l = 0; l < pf_lines; ++l) _mm_prefetch(*pf + 64 * l, _MM_HINT_T0);
        *pf += 64 * pf_lines;
        const __mmask16 m = k - p >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - p)) - 1);
        __m512 wv[NB];
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(m, wr[j] + p);
#pragma GCC unroll 6
        for (int i = 0; i < MB; ++i) {
            if (i < mb) {
                const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + p);
#pragma GCC unroll 4
                for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
            }
        }
    }
#define BIAS_AT(j) bias[n0 + (j)]
    SKINNY_STORE(float, o[j] = v)
#undef BIAS_AT
}
#endif

#ifdef __AVX512BF16__
static inline __attribute__((always_inline)) void group_bf16(
    const bf16 *restrict x, int64_t ldx, const bf16 *restrict w, int64_t k,
    const bf16 *restrict bias, bf16 *restrict out, int64_t ldo, int64_t n0, int nb,
    const int mb, const char **pf, const int pf_lines)
{
    __m512 acc[MB][NB];
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const bf16 *restrict wr[NB];
    for (int j = 0; j < NB; ++j) wr[j] = w + (n0 + (j < nb ? j : 0)) * k;
    for (int64_t p = 0; p < k; p += 32) {
        for (int l = 0; l < pf_lines; ++l) _mm_prefetch(*pf + 64 * l, _MM_HINT_T0);
        *pf += 64 * pf_lines;
        const __mmask32 m = k - p >= 32 ? (__mmask32)0xffffffffu
                                        : (__mmask32)((1u << (k - p)) - 1);
        __m512i wv[NB];
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_epi16(m, wr[j] + p);
#pragma GCC unroll 6
        for (int i = 0; i < MB; ++i) {
            if (i < mb) {
                const __m512i xv = _mm512_maskz_loadu_epi16(m, x + i * ldx + p);
#pragma GCC unroll 4
                for (int j = 0; j < NB; ++j)
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(xv), as_bh(wv[j]));
            }
        }
    }
#define BIAS_AT(j) bf16_to_f32(bias[n0 + (j)])
    SKINNY_STORE(bf16, o[j] = f32_to_bf16(v))
#undef BIAS_AT
}
#endif

/* One thread's share: groups g0 .. g1 of NB weight rows, every row of x for each. */
#define SKINNY_CHUNK(GROUP, MB_)                                                          \
    GROUP(x + r * ldx, ldx, w, k, bias, out + r * ldo, ldo, n0, nb, MB_, &pf, pf_lines)
#define SKINNY_RANGE(GROUP)                                                               \
    for (int64_t g = g0; g < g1; ++g) {                                                 \
        const int64_t n0 = g * NB;                                                      \
        const int nb = n - n0 < NB ? (int)(n - n0) : NB;                                \
        /* the group PREFETCH_GROUPS ahead is read into cache while this one computes,   \
         * spread over all of its chunks' K loops */                                     \
        const char *pf = (const char *)(w + (n0 + PREFETCH_GROUPS * NB) * k);           \
        const int64_t steps = ((k + VEC - 1) / VEC) * ((rows + MB - 1) / MB);           \
        const int pf_lines = (int)((NB * k * (int64_t)sizeof(*w) / 64 + steps) / steps); \
        int64_t r = 0;                                                                  \
        for (; r + MB <= rows; r += MB) SKINNY_CHUNK(GROUP, MB);                        \
        switch (rows - r) {                                                             \
        case 5: SKINNY_CHUNK(GROUP, 5); break;                                          \
        case 4: SKINNY_CHUNK(GROUP, 4); break;                                          \
        case 3: SKINNY_CHUNK(GROUP, 3); break;                                          \
        case 2: SKINNY_CHUNK(GROUP, 2); break;                                          \
        case 1: SKINNY_CHUNK(GROUP, 1); break;                                          \
        default: break;                                                                 \
        }                                                                               \
    }

/* The groups are split evenly over the threads, each thread's a contiguous run (whole
 * weight rows: the hardware prefetchers follow NB streams). */
#define SKINNY_PARALLEL(GROUP)                                                            \
    const int64_t groups = (n + NB - 1) / NB;                                           \
    _Pragma("omp parallel num_threads(num_threads)")                                     \
    {                                                                                   \
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();             \
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;                 \
        SKINNY_RANGE(GROUP)                                                             \
    }

/* out [rows, n] (row stride ldo) = x [rows, k] (row stride ldx) @ w[n, k]^T + bias (NULL:
 * none). Returns 0, or -2 where this build has no AVX-512. */
#define VEC 16
int skinny_linear_f32(const float *x, int64_t ldx, const float *w, const float *bias,
                      float *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                      int num_threads)
{
#ifdef __AVX512F__
    SKINNY_PARALLEL(group_f32)
    return 0;
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)out; (void)ldo; (void)rows; (void)n;
    (void)k; (void)num_threads;
    return -2;
#endif
}

#undef VEC
#define VEC 32
/* As skinny_linear_f32, bfloat16 tensors, float32 sums rounded once (with the bias). */
int skinny_linear_bf16(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias,
                       bf16 *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                       int num_threads)
{
#ifdef __AVX512BF16__
    SKINNY_PARALLEL(group_bf16)
    return 0;
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)out; (void)ldo; (void)rows; (void)n;
    (void)k; (void)num_threads;
    return -2;
#endif
}
