/* Skinny GEMMs on CPU: out[m, n] = x[m, :] . w[n, :] (+ bias[n]) for the few rows of a
 * decode step, float32 and bfloat16 (float32 sums, one rounding to bf16 at the end), read
 * straight from the plain [out, in] weight.
 *
 * At decode sizes (a few to a few dozen rows) a step's GEMMs read every base weight once
 * and do little else, so what they cost is how fast the weights stream from memory.
 * oneDNN's GEMMs (packed or plain) streamed the demo model's weights at 4-14 GB/s there
 * where a plain sum over as many bytes read 25-50 GB/s (AVX-512 EPYC, 2 threads,
 * benchmarks/skinny_gemm.py). Here each thread takes groups of NB consecutive weight rows
 * (output columns), reads each group from memory once, and multiplies it against every row
 * of x in chunks of MB rows: NB x MB sums of 16 lanes in registers, the group re-read from
 * L1 for each further chunk. A group's sums are reduced across lanes at the end, four at
 * a time.
 *
 * float32: one FMA per 16 weights and row. bfloat16: vdpbf16ps, one per 32 weights and
 * row, its pairs being consecutive values along `in` in both operands, which is the plain
 * layout. `in` needs no particular multiple: the last vector is masked.
 *
 * Without AVX-512, on AVX2 with FMA (e.g. AMD Zen 2/3, Intel before Ice Lake): the same
 * groups in vectors of 8 floats, NB x MB sums in 12 of the 16 ymm registers. bfloat16
 * weights and rows are widened to float32 as they are loaded (a bf16 is a float32's upper
 * half: products exact, sums float32), so a decode step streams half the bytes of its
 * float32 weights; the sums are rounded to bf16 as torch rounds. `loraplex_skinny_impls`
 * says what a build holds. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"
#include "lora.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define SKINNY_AVX2 1
#endif

/* SKINNY_BF16: AVX-512 BF16 dot products (the bf16 kernels' avx512_bf16 implementation);
 * SKINNY_BF16_WIDEN: bf16 widened to float32 (AVX2), whatever bf16 implementation the
 * other kernels run. */
enum { SKINNY_F32 = 1, SKINNY_BF16 = 2, SKINNY_BF16_WIDEN = 4 };

int loraplex_skinny_impls(void)
{
    int impls = 0;
#if defined(__AVX512F__) || defined(SKINNY_AVX2)
    impls |= SKINNY_F32;
#endif
#ifdef __AVX512BF16__
    impls |= SKINNY_BF16;
#endif
#ifdef SKINNY_AVX2
    impls |= SKINNY_BF16_WIDEN;
#endif
    return impls;
}

#define NB 4 /* weight rows (output columns) per group */
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 2
#endif
#ifdef SKINNY_AVX2
#define MB 3 /* rows of x per chunk: NB * MB = 12 of the 16 ymm registers hold sums */
#else
#define MB 6 /* rows of x per chunk: NB * MB = 24 of the 32 vector registers hold sums */
#endif

#if defined(__AVX512F__) || defined(SKINNY_AVX2)
/* The next `lines` cache lines of a group PREFETCH_GROUPS ahead. */
static inline void prefetch_ahead(const char **pf, int lines)
{
    for (int l = 0; l < lines; ++l) _mm_prefetch(*pf + 64 * l, _MM_HINT_T0);
    *pf += 64 * lines;
}
#endif

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

/* The sums of a group of nb <= NB weight rows against mb <= MB rows of x, reduced four
 * outputs at a time, the bias `b4` added, stored through STORE(o, mask, sums). */
#define SKINNY_STORE(STORE)                                                               \
    _Pragma("GCC unroll 6")                                                             \
    for (int i = 0; i < MB; ++i) {                                                      \
        if (i >= mb) break;                                                             \
        const __m128 v = _mm_add_ps(reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), b4); \
        STORE(out + i * ldo + n0, (__mmask8)((1u << nb) - 1), v);                       \
    }

/* A group's sums (NB x MB vectors, zeroed) and its NB weight rows (past nb: row n0 again,
 * read but not stored). */
#define SKINNY_SETUP(T)                                                                   \
    __m512 acc[MB][NB];                                                                 \
    _Pragma("GCC unroll 6") for (int i = 0; i < MB; ++i)                                \
        _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps(); \
    const T *restrict wr[NB];                                                           \
    for (int j = 0; j < NB; ++j) wr[j] = w + (n0 + (j < nb ? j : 0)) * k;


static inline __attribute__((always_inline)) void group_f32(
    const float *restrict x, int64_t ldx, const float *restrict w, int64_t k,
    const float *restrict bias, float *restrict out, int64_t ldo, int64_t n0, int nb,
    const int mb, const char **pf, const int pf_lines)
{
    SKINNY_SETUP(float)
    for (int64_t p = 0; p < k; p += 16) {
        prefetch_ahead(pf, pf_lines);
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
    const __mmask8 nm = (__mmask8)((1u << nb) - 1);
    const __m128 b4 = bias ? _mm_maskz_loadu_ps(nm, bias + n0) : _mm_setzero_ps();
#define STORE_F32(o, mask, v) _mm_mask_storeu_ps(o, mask, v)
    SKINNY_STORE(STORE_F32)
#undef STORE_F32
}
#endif

#ifdef __AVX512BF16__
static inline __attribute__((always_inline)) void group_bf16(
    const bf16 *restrict x, int64_t ldx, const bf16 *restrict w, int64_t k,
    const bf16 *restrict bias, bf16 *restrict out, int64_t ldo, int64_t n0, int nb,
    const int mb, const char **pf, const int pf_lines)
{
    SKINNY_SETUP(bf16)
    for (int64_t p = 0; p < k; p += 32) {
        prefetch_ahead(pf, pf_lines);
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
    const __mmask8 nm = (__mmask8)((1u << nb) - 1);
    const __m128 b4 = bias ? _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(
                                 _mm_maskz_loadu_epi16(nm, bias + n0)), 16))
                           : _mm_setzero_ps();
    /* round to nearest even, as torch; vcvtneps2bf16 also flushes denormals to zero */
#define STORE_BF16(o, mask, v) _mm_mask_storeu_epi16(o, mask, (__m128i)_mm_cvtneps_pbh(v))
    SKINNY_STORE(STORE_BF16)
#undef STORE_BF16
}
#endif

#ifdef SKINNY_AVX2
/* [sum(a), sum(b), sum(c), sum(d)] of four vectors of 8 floats. */
static inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    /* per 128-bit half: [a01, a23, b01, b23], then [a0-3, b0-3, c0-3, d0-3] */
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

static inline __m256 widen_bf16x8(const bf16 *p)
{
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The last k - p < 8 values of a row, zero-padded to a vector (AVX2 has no masked
 * 16-bit loads; float32 goes through the same copy for one code path). */
static inline __m256 tail_f32(const float *p, int64_t n)
{
    float v[8] = {0};
    for (int64_t i = 0; i < n; ++i) v[i] = p[i];
    return _mm256_loadu_ps(v);
}

static inline __m256 tail_bf16(const bf16 *p, int64_t n)
{
    bf16 v[8] = {0};
    for (int64_t i = 0; i < n; ++i) v[i] = p[i];
    return widen_bf16x8(v);
}

#define LOAD_F32(p) _mm256_loadu_ps(p)
#define LOAD_BF16(p) widen_bf16x8(p)

/* A group's sums over the whole of k: full vectors of 8, then the tail (k % 8 values),
 * NB weight rows (past nb: row n0 again, read but not stored) against mb rows of x. */
#define SKINNY_AVX2_SUMS(T, LOAD, TAIL)                                                   \
    __m256 acc[MB][NB];                                                                 \
    _Pragma("GCC unroll 3") for (int i = 0; i < MB; ++i)                                \
        _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps(); \
    const T *restrict wr[NB];                                                           \
    for (int j = 0; j < NB; ++j) wr[j] = w + (n0 + (j < nb ? j : 0)) * k;               \
    int64_t p = 0;                                                                      \
    for (; p + 8 <= k; p += 8) {                                                        \
        prefetch_ahead(pf, pf_lines);                                                   \
        __m256 wv[NB];                                                                  \
        _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) wv[j] = LOAD(wr[j] + p);   \
        _Pragma("GCC unroll 3") for (int i = 0; i < MB; ++i) {                          \
            if (i < mb) {                                                               \
                const __m256 xv = LOAD(x + i * ldx + p);                                \
                _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j)                    \
                    acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);                  \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
    if (p < k) {                                                                        \
        __m256 wv[NB];                                                                  \
        for (int j = 0; j < NB; ++j) wv[j] = TAIL(wr[j] + p, k - p);                    \
        for (int i = 0; i < MB && i < mb; ++i) {                                        \
            const __m256 xv = TAIL(x + i * ldx + p, k - p);                             \
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
        }                                                                               \
    }

/* The group's sums reduced four outputs at a time, the bias added (WIDEN: a bias value to
 * float), stored through NARROW (float to the output's type). */
#define SKINNY_AVX2_STORE(WIDEN, NARROW)                                                  \
    float b4[4] = {0};                                                                  \
    for (int j = 0; j < nb && bias; ++j) b4[j] = WIDEN(bias[n0 + j]);                   \
    const __m128 bv = _mm_loadu_ps(b4);                                                 \
    for (int i = 0; i < MB && i < mb; ++i) {                                            \
        float v[4];                                                                     \
        _mm_storeu_ps(v, _mm_add_ps(reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), bv)); \
        for (int j = 0; j < nb; ++j) out[i * ldo + n0 + j] = NARROW(v[j]);              \
    }
#define AS_F32(v) (v)

static inline __attribute__((always_inline)) void group_f32(
    const float *restrict x, int64_t ldx, const float *restrict w, int64_t k,
    const float *restrict bias, float *restrict out, int64_t ldo, int64_t n0, int nb,
    const int mb, const char **pf, const int pf_lines)
{
    SKINNY_AVX2_SUMS(float, LOAD_F32, tail_f32)
    SKINNY_AVX2_STORE(AS_F32, AS_F32)
}

static inline __attribute__((always_inline)) void group_bf16(
    const bf16 *restrict x, int64_t ldx, const bf16 *restrict w, int64_t k,
    const bf16 *restrict bias, bf16 *restrict out, int64_t ldo, int64_t n0, int nb,
    const int mb, const char **pf, const int pf_lines)
{
    SKINNY_AVX2_SUMS(bf16, LOAD_BF16, tail_bf16)
    SKINNY_AVX2_STORE(bf16_to_f32, f32_to_bf16)
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
        /* at least one: no rows (a step that samples nothing) or k = 0 compute nothing */ \
        const int64_t steps_ = ((k + VEC - 1) / VEC) * ((rows + MB - 1) / MB);          \
        const int64_t steps = steps_ > 0 ? steps_ : 1;                                  \
        const int pf_lines = (int)((NB * k * (int64_t)sizeof(*w) / 64 + steps) / steps); \
        int64_t r = 0;                                                                  \
        for (; r + MB <= rows; r += MB) SKINNY_CHUNK(GROUP, MB);                        \
        switch (rows - r) { /* fewer than MB */                                         \
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
#define SKINNY_THREAD(GROUP)                                                              \
    {                                                                                   \
        const int64_t groups = (n + NB - 1) / NB;                                       \
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();             \
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;                 \
        SKINNY_RANGE(GROUP)                                                             \
    }
#define SKINNY_PARALLEL(THREAD)                                                           \
    _Pragma("omp parallel num_threads(num_threads)") THREAD

/* bfloat16: on AMX tiles where `xp` (skinny_amx_buffer) is set, the team packing x first
 * and the last thread taking the weight rows past the whole 16-row blocks; else the
 * AVX-512 BF16 (or AVX2) kernel. */
#define SKINNY_BF16_THREAD                                                                \
    if (xp) {                                                                           \
        const int t_ = omp_get_thread_num(), nt_ = omp_get_num_threads();               \
        skinny_amx_pack(x, ldx, rows, k, xp, t_, nt_);                                  \
        _Pragma("omp barrier")                                                          \
        const int64_t done_ = skinny_amx_share(xp, w, bias, out, ldo, rows, n, k, t_, nt_); \
        if (t_ == nt_ - 1) {                                                            \
            const int64_t g0 = done_ / NB, g1 = (n + NB - 1) / NB;                      \
            SKINNY_RANGE(group_bf16)                                                    \
        }                                                                               \
    } else SKINNY_THREAD(group_bf16)

/* Values per step of k, by dtype (only spreads the prefetches): VEC is set to one of them
 * before each function. */
#ifdef SKINNY_AVX2
#define VEC_F32 8
#define VEC_BF16 8
#else
#define VEC_F32 16
#define VEC_BF16 32
#endif

/* out [rows, n] (row stride ldo) = x [rows, k] (row stride ldx) @ w[n, k]^T + bias (NULL:
 * none). Returns 0, or -2 where this build has neither AVX-512 nor AVX2 with FMA. */
#define VEC VEC_F32
int skinny_linear_f32(const float *x, int64_t ldx, const float *w, const float *bias,
                      float *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                      int num_threads)
{
#if defined(__AVX512F__) || defined(SKINNY_AVX2)
    SKINNY_PARALLEL(SKINNY_THREAD(group_f32))
    return 0;
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)out; (void)ldo; (void)rows; (void)n;
    (void)k; (void)num_threads;
    return -2;
#endif
}

#undef VEC
#define VEC VEC_BF16
/* As skinny_linear_f32, bfloat16 tensors, float32 sums rounded once (with the bias). */
int skinny_linear_bf16(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias,
                       bf16 *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                       int num_threads)
{
#if defined(__AVX512BF16__) || defined(SKINNY_AVX2)
    uint32_t *const xp = skinny_amx_buffer(x, ldx, rows, n, k);
    SKINNY_PARALLEL(SKINNY_BF16_THREAD)
    return 0;
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)out; (void)ldo; (void)rows; (void)n;
    (void)k; (void)num_threads;
    return -2;
#endif
}

/* skinny_linear_* and then the LoRA of lora_segments_* added to its output, in one
 * parallel region: a decode step's projection wakes the team once, not twice (between
 * regions libgomp's idle threads sleep after a short spin, loraplex/openmp.py, and waking
 * them took about as long as a decode step's LoRA). Returns as lora_segments_*. */
#define SKINNY_LORA(THREAD, PREPARE, TEAM, IMPL)                                             \
    struct lora_call c = {x, ldx, out, ldo, k, n, seg_first, seg_len, seg_slot,         \
                          num_segs, at_ptrs, bt_ptrs, ranks, slice_table, num_slices,   \
                          max_slices, IMPL, num_threads, 0, 0, NULL};                   \
    const int status = PREPARE(&c);                                                     \
    if (status != 0) return status;                                                     \
    int failed = 0;                                                                     \
    _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)")               \
    {                                                                                   \
        THREAD                                                                          \
        _Pragma("omp barrier")                                                          \
        failed |= TEAM(&c);                                                             \
    }                                                                                   \
    free(c.work);                                                                       \
    return failed ? -1 : 0;

#define SKINNY_LORA_UNUSED                                                                \
    (void)x; (void)ldx; (void)w; (void)bias; (void)out; (void)ldo; (void)rows; (void)n;  \
    (void)k; (void)seg_first; (void)seg_len; (void)seg_slot; (void)num_segs;            \
    (void)at_ptrs; (void)bt_ptrs; (void)ranks; (void)slice_table; (void)num_slices;     \
    (void)max_slices; (void)num_threads

#undef VEC
#define VEC VEC_F32
int skinny_lora_f32(const float *x, int64_t ldx, const float *w, const float *bias,
                    float *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                    SKINNY_LORA_ARGS)
{
#if defined(__AVX512F__) || defined(SKINNY_AVX2)
    SKINNY_LORA(SKINNY_THREAD(group_f32), lora_f32_prepare, lora_f32_team, 0)
#else
    SKINNY_LORA_UNUSED;
    return -2;
#endif
}

#undef VEC
#define VEC VEC_BF16
int skinny_lora_bf16(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias,
                     bf16 *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                     SKINNY_LORA_ARGS, int impl)
{
#if defined(__AVX512BF16__) || defined(SKINNY_AVX2)
    uint32_t *const xp = skinny_amx_buffer(x, ldx, rows, n, k);
    SKINNY_LORA(SKINNY_BF16_THREAD, lora_bf16_prepare, lora_bf16_team, impl)
#else
    SKINNY_LORA_UNUSED;
    (void)impl;
    return -2;
#endif
}
