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
#include <cpuid.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"
#include "lora.h"
#include "spin_barrier.h"

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

/* Whether a projection's GEMM reads the LoRA weights that come after it into cache as it
 * goes (lora.h: struct lora_prefetch), at 8 rows or more: by default on AMD's family 25
 * with AVX-512 (Zen 4), where it measured faster; below 8 rows the GEMM streams its
 * weights about as fast as memory gives them, so these reads would only share the bus.
 * Elsewhere off by default: on the Zen 5 and the Xeon with AMX, reads of the same weights
 * during the GEMM measured slower (docs/benchmarks.md, "Decode LoRA on CPU"), and the
 * AVX2 kinds were not measured with it (their builds leave it out).
 * loraplex_lora_read_ahead: 1 on, 0 off, 2 the CPU's default; -1 only reports. Returns
 * whether it is on now (set once per process by benchmarks and tests; read by every
 * projection). */
#ifdef __AVX512F__
static int read_ahead = -1; /* -1: not yet decided */

static int read_ahead_default(void)
{
    unsigned a, b, c, d, family = 0;
    /* "AuthenticAMD": the vendor string's first word, in ebx */
    if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && __get_cpuid(1, &a, &b, &c, &d)) {
        family = (a >> 8) & 0xfu;
        if (family == 0xfu) family += (a >> 20) & 0xffu;
    }
    return family == 0x19u;
}
#endif

int loraplex_lora_read_ahead(int mode)
{
#ifdef __AVX512F__
    if (mode == 0 || mode == 1) read_ahead = mode;
    else if (mode == 2 || read_ahead < 0) read_ahead = read_ahead_default();
    return read_ahead;
#else
    (void)mode;
    return 0;
#endif
}

static int64_t skinny_lora_prefetch_rows(void)
{
#ifdef __AVX512F__
    return (read_ahead < 0 ? loraplex_lora_read_ahead(-1) : read_ahead) ? 8 : INT64_MAX;
#else
    return INT64_MAX;
#endif
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
    const int mb, const char **pf, const int pf_lines, struct lora_prefetch *lpf,
    const int lpf_step)
{
    SKINNY_SETUP(float)
    for (int64_t p = 0; p < k; p += 16) {
        prefetch_ahead(pf, pf_lines);
        if (lpf_step) lora_prefetch_some(lpf, lpf_step);
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
    const int mb, const char **pf, const int pf_lines, struct lora_prefetch *lpf,
    const int lpf_step)
{
    SKINNY_SETUP(bf16)
    for (int64_t p = 0; p < k; p += 32) {
        prefetch_ahead(pf, pf_lines);
        if (lpf_step) lora_prefetch_some(lpf, lpf_step);
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
    const int mb, const char **pf, const int pf_lines, struct lora_prefetch *lpf,
    const int lpf_step)
{
    (void)lpf; /* skinny_lora_prefetch_rows: AVX-512 builds only */
    (void)lpf_step;
    SKINNY_AVX2_SUMS(float, LOAD_F32, tail_f32)
    SKINNY_AVX2_STORE(AS_F32, AS_F32)
}

static inline __attribute__((always_inline)) void group_bf16(
    const bf16 *restrict x, int64_t ldx, const bf16 *restrict w, int64_t k,
    const bf16 *restrict bias, bf16 *restrict out, int64_t ldo, int64_t n0, int nb,
    const int mb, const char **pf, const int pf_lines, struct lora_prefetch *lpf,
    const int lpf_step)
{
    (void)lpf; /* skinny_lora_prefetch_rows: AVX-512 builds only */
    (void)lpf_step;
    SKINNY_AVX2_SUMS(bf16, LOAD_BF16, tail_bf16)
    SKINNY_AVX2_STORE(bf16_to_f32, f32_to_bf16)
}

/* On AVX2, from XT_MIN_ROWS_* rows: the rows of x in vector lanes. Each thread transposes
 * x once per call into its scratch (x^T [k][rows rounded up to 8], float32; bf16 widened)
 * and broadcasts each weight value against up to three vectors of 8 rows:
 * out^T[n][rows] += w[n][p] * x^T[p][rows], 12 vectors of sums in registers, each output's
 * sum in k's order in its lane (no reduction across lanes), the weights read once, in
 * place (bf16 ones widened into the scratch once per group of 12 outputs, where the
 * dot-product groups above widen each weight vector once per chunk of rows). Those groups
 * need a load of x or w for every FMA at 4 x 3 (16 ymm registers hold the sums and the
 * weights, not x as well) and reduce 12 vectors per chunk. Measured on an AVX2 EPYC
 * (Zen 3), the demo model's 30 layers and head, 2 threads, weights from memory: float32
 * 1.1-1.2x at 16-64 rows and 0.85-0.9x at 8-12, bfloat16 1.4-1.75x at 8-64 rows and
 * behind below 8; so float32 takes it from 16 rows, bfloat16 from 8. Per pass: three
 * whole vectors of rows (24), or the whole vectors left and a last part vector of 5-7
 * rows; 1-4 rows past the whole vectors go to the dot-product groups. */
#define XT_MIN_ROWS_F32 16
#define XT_MIN_ROWS_BF16 8
#define XT_NO 12 /* outputs per group */
/* The group 2 ahead is fetched into L2 while one computes (1 or 4 ahead, or into L1,
 * measured the same). */
#define XT_PREFETCH_GROUPS 2

/* The sums of weight rows wr[0 .. no - 1] (float32, each k long) against rv vectors of
 * x^T (row stride ldt), into res[no][24]: no x rv = 12 vectors of sums in registers (no =
 * 12, 6, 4 at rv = 1, 2, 3), rv loads of x^T and no broadcasts per 12 FMAs. The empty asm
 * keeps each vector of x^T in a register (else it is loaded again for every FMA). */
static inline __attribute__((always_inline)) void xt_group(
    const float *const *restrict wr, const float *restrict xt, int64_t ldt, int64_t k,
    const int no, const int rv, float *restrict res, const char **pf, const char *pf_end)
{
    __m256 acc[12][3];
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j)
#pragma GCC unroll 3
        for (int v = 0; v < 3; ++v) acc[j][v] = _mm256_setzero_ps();
    for (int64_t p = 0; p < k; ++p) {
        if (*pf < pf_end) {
            _mm_prefetch(*pf, _MM_HINT_T1);
            *pf += 64;
        }
        __m256 xv[3];
#pragma GCC unroll 3
        for (int v = 0; v < 3; ++v)
            if (v < rv) {
                xv[v] = _mm256_load_ps(xt + p * ldt + 8 * v);
                __asm__("" : "+x"(xv[v]));
            }
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) {
            if (j < no) {
                const __m256 wb = _mm256_broadcast_ss(wr[j] + p);
#pragma GCC unroll 3
                for (int v = 0; v < 3; ++v)
                    if (v < rv) acc[j][v] = _mm256_fmadd_ps(wb, xv[v], acc[j][v]);
            }
        }
    }
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j)
#pragma GCC unroll 3
        for (int v = 0; v < 3; ++v)
            if (j < no && v < rv) _mm256_storeu_ps(res + j * 24 + 8 * v, acc[j][v]);
}
#endif

/* One thread's share: groups g0 .. g1 of NB weight rows, every row of x for each. */
#define SKINNY_CHUNK(GROUP, MB_)                                                          \
    GROUP(x + r * ldx, ldx, w, k, bias, out + r * ldo, ldo, n0, nb, MB_, &pf, pf_lines, lpf, \
          lpf_step)
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
        /* and the LoRA's weights, a group's share of them (lora_prefetch_spread) */     \
        const int lpf_step = lora_prefetch_per_step(lpf, steps);                        \
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
        if (lpf) lora_prefetch_spread(lpf, g1 - g0);                                    \
        SKINNY_RANGE(GROUP)                                                             \
    }
#define SKINNY_PARALLEL(THREAD)                                                           \
    _Pragma("omp parallel num_threads(num_threads)") THREAD

/* bfloat16: on AMX tiles where `xp` (skinny_amx_buffer) is set, the team packing x first
 * and the last thread taking the weight rows past the whole 16-row blocks; else the
 * AVX-512 BF16 (or AVX2) kernel. SKINNY_PACK_WAIT: the wait after the team's packing
 * (libgomp's barrier; skinny_team_bf16's, the step's spin barrier). */
#define SKINNY_PACK_WAIT _Pragma("omp barrier")
#define SKINNY_BF16_THREAD                                                                \
    if (xp) {                                                                           \
        const int t_ = omp_get_thread_num(), nt_ = omp_get_num_threads();               \
        const uint32_t *xs_ = xp;                                                       \
        if (rows <= SKINNY_AMX_OWN_ROWS) {                                              \
            uint32_t *own_ = xp + t_ * skinny_amx_packed(rows, k);                      \
            skinny_amx_pack(x, ldx, rows, k, own_, 0, 1);                               \
            xs_ = own_;                                                                 \
        } else {                                                                        \
            skinny_amx_pack(x, ldx, rows, k, xp, t_, nt_);                              \
            SKINNY_PACK_WAIT                                                            \
        }                                                                               \
        const int64_t done_ = skinny_amx_share(xs_, w, bias, out, ldo, rows, n, k, t_, nt_); \
        if (t_ == nt_ - 1) {                                                            \
            const int64_t g0 = done_ / NB, g1 = (n + NB - 1) / NB;                      \
            SKINNY_RANGE(group_bf16)                                                    \
        }                                                                               \
    } else SKINNY_BF16_GROUPS

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

#ifdef SKINNY_AVX2
/* A thread's scratch for x^T and widened bf16 weights (kept across calls, grown as
 * needed). NULL where it could not be allocated. */
static __thread float *xt_scratch;
static __thread size_t xt_scratch_floats;

static float *xt_buffer(size_t floats)
{
    if (floats > xt_scratch_floats) {
        free(xt_scratch);
        xt_scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        xt_scratch_floats = xt_scratch ? floats : 0;
    }
    return xt_scratch;
}

/* 8 x 8 floats transposed: r[i] holds row i, and column i after. */
static inline void transpose8(__m256 r[8])
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* x [rows, k] (row stride ldx) into xt [k, ldt] (ldt: rows rounded up to 8, the rest
 * zero), float32: whole 8 x 8 blocks in registers, the edges one value at a time. */
#define XT_TRANSPOSE(T, WIDEN)                                                            \
    {                                                                                   \
        const int64_t r8 = rows / 8 * 8, k8 = k / 8 * 8;                                \
        for (int64_t r = 0; r < r8; r += 8)                                             \
            for (int64_t p = 0; p < k8; p += 8) {                                       \
                __m256 b_[8];                                                           \
                for (int i = 0; i < 8; ++i) b_[i] = XT_LOAD8(T, x + (r + i) * ldx + p);  \
                transpose8(b_);                                                         \
                for (int i = 0; i < 8; ++i) _mm256_store_ps(xt + (p + i) * ldt + r, b_[i]); \
            }                                                                           \
        for (int64_t p = 0; p < k; ++p) {                                               \
            if (p >= k8)                                                                \
                for (int64_t r = 0; r < r8; ++r) xt[p * ldt + r] = WIDEN(x[r * ldx + p]); \
            for (int64_t r = r8; r < rows; ++r) xt[p * ldt + r] = WIDEN(x[r * ldx + p]); \
            for (int64_t r = rows; r < ldt; ++r) xt[p * ldt + r] = 0.0f;                \
        }                                                                               \
    }
#define XT_LOAD8(T, p)                                                                    \
    (sizeof(T) == sizeof(float) ? _mm256_loadu_ps((const float *)(const void *)(p))     \
                                : widen_bf16x8((const bf16 *)(const void *)(p)))

/* Rows r0 .. rows - 1 (at most 4) of the group at n0 (nb outputs) through the
 * dot-product groups, NB outputs and up to MB rows at a time. */
#define XT_DOT_CHUNK(GROUP, MB_)                                                          \
    GROUP(x + r * ldx, ldx, w, k, bias, out + r * ldo, ldo, n0 + s_, nb_, MB_, &pf, 0, NULL, 0)
#define XT_DOT_ROWS(GROUP)                                                                \
    for (int s_ = 0; s_ < nb; s_ += NB) {                                               \
        const int nb_ = nb - s_ < NB ? nb - s_ : NB;                                    \
        const char *pf = NULL;                                                          \
        for (int64_t r = r0; r < rows; r += MB) {                                       \
            const int64_t mb_ = rows - r < MB ? rows - r : MB;                          \
            if (mb_ == 3) XT_DOT_CHUNK(GROUP, 3);                                       \
            else if (mb_ == 2) XT_DOT_CHUNK(GROUP, 2);                                  \
            else XT_DOT_CHUNK(GROUP, 1);                                                \
        }                                                                               \
    }

/* One thread's share of the outputs, in groups of XT_NO, through xt_group (a group's
 * passes over the rows while its weights are in cache); each output stored through NARROW
 * with the bias (WIDEN: a value of T to float32). Where its scratch could not be
 * allocated the thread takes the same outputs through the dot-product groups (GROUP). */
#define XT_GROUP(NO, RV)                                                                  \
    xt_group(wr + s_, xt + r0, ldt, k, NO, RV, res + s_ * 24, &pf, pf_end)
#define XT_SHARE(T, GROUP, WIDEN, NARROW)                                                 \
    const int64_t units = (n + XT_NO - 1) / XT_NO;                                      \
    const int64_t t_ = omp_get_thread_num(), nt_ = omp_get_num_threads();              \
    const int64_t o0 = units * t_ / nt_ * XT_NO, o1_ = units * (t_ + 1) / nt_ * XT_NO;  \
    const int64_t o1 = o1_ < n ? o1_ : n;                                               \
    const int64_t ldt = (rows + 7) / 8 * 8;                                             \
    const int wide = sizeof(T) != sizeof(float); /* bf16 weights: widened per group */  \
    float *const xt = xt_buffer((size_t)(k * ldt + (wide ? XT_NO * k : 0)));             \
    if (!xt) {                                                                          \
        const int64_t g0 = o0 / NB, g1 = (o1 + NB - 1) / NB;                            \
        struct lora_prefetch *const lpf = NULL;                                         \
        SKINNY_RANGE(GROUP)                                                             \
        return;                                                                         \
    }                                                                                   \
    XT_TRANSPOSE(T, WIDEN)                                                              \
    float *const ww = xt + k * ldt;                                                     \
    float res[XT_NO * 24];                                                              \
    for (int64_t n0 = o0; n0 < o1; n0 += XT_NO) {                                       \
        const int nb = o1 - n0 < XT_NO ? (int)(o1 - n0) : XT_NO;                        \
        const float *wr[XT_NO];                                                         \
        /* the group XT_PREFETCH_GROUPS ahead, a line per value of k until it is in */   \
        const char *pf = (const char *)(w + (n0 + XT_PREFETCH_GROUPS * XT_NO) * k);     \
        const char *const pf_end = pf + XT_NO * k * (int64_t)sizeof(T);                 \
        for (int j = 0; j < XT_NO; ++j) {                                               \
            const T *src = w + (n0 + (j < nb ? j : 0)) * k;                             \
            if (wide) {                                                                 \
                for (int64_t p = 0; p < k; ++p) ww[j * k + p] = WIDEN(src[p]);          \
                wr[j] = ww + j * k;                                                     \
            } else {                                                                    \
                wr[j] = (const float *)(const void *)src;                               \
            }                                                                           \
        }                                                                               \
        for (int64_t r0 = 0; r0 < rows;) {                                              \
            /* whole vectors of rows, up to 3, and a last part vector of 5-7 rows; 1-4   \
             * rows past the whole vectors take the dot-product groups */               \
            const int64_t left = rows - r0;                                             \
            const int64_t q = left / 8, rest = left % 8;                                \
            const int rv = left >= 24 ? 3 : (int)(rest >= 5 ? q + 1 : q);               \
            const int64_t mr = left >= 24 ? 24 : rest >= 5 ? left : 8 * q;              \
            if (rv == 0) {                                                              \
                XT_DOT_ROWS(GROUP)                                                      \
                break;                                                                  \
            }                                                                           \
            const int no = rv == 3 ? 4 : rv == 2 ? 6 : 12;                              \
            for (int s_ = 0; s_ < XT_NO; s_ += no) {                                    \
                if (rv == 3) XT_GROUP(4, 3);                                            \
                else if (rv == 2) XT_GROUP(6, 2);                                       \
                else XT_GROUP(12, 1);                                                   \
            }                                                                           \
            for (int j = 0; j < nb; ++j) {                                              \
                const float b_ = bias ? WIDEN(bias[n0 + j]) : 0.0f;                     \
                for (int64_t i = 0; i < mr; ++i)                                        \
                    out[(r0 + i) * ldo + n0 + j] = NARROW(res[j * 24 + i] + b_);        \
            }                                                                           \
            r0 += mr;                                                                   \
        }                                                                               \
    }

static void xt_share_f32(const float *x, int64_t ldx, const float *w, const float *bias,
                         float *out, int64_t ldo, int64_t rows, int64_t n, int64_t k)
{
    XT_SHARE(float, group_f32, AS_F32, AS_F32)
}

static void xt_share_bf16(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias,
                          bf16 *out, int64_t ldo, int64_t rows, int64_t n, int64_t k)
{
    XT_SHARE(bf16, group_bf16, bf16_to_f32, f32_to_bf16)
}

#define SKINNY_F32_THREAD                                                                 \
    if (rows >= XT_MIN_ROWS_F32) xt_share_f32(x, ldx, w, bias, out, ldo, rows, n, k);        \
    else SKINNY_THREAD(group_f32)
#define SKINNY_BF16_GROUPS                                                                \
    if (rows >= XT_MIN_ROWS_BF16) xt_share_bf16(x, ldx, w, bias, out, ldo, rows, n, k);       \
    else SKINNY_THREAD(group_bf16)
#else
#define SKINNY_F32_THREAD SKINNY_THREAD(group_f32)
#define SKINNY_BF16_GROUPS SKINNY_THREAD(group_bf16)
#endif

int skinny_linear_f32(const float *x, int64_t ldx, const float *w, const float *bias,
                      float *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                      int num_threads)
{
#if defined(__AVX512F__) || defined(SKINNY_AVX2)
    struct lora_prefetch *const lpf = NULL;
    SKINNY_PARALLEL(SKINNY_F32_THREAD)
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
    uint32_t *const xp = skinny_amx_buffer(x, ldx, rows, n, k,
                                           rows <= SKINNY_AMX_OWN_ROWS ? num_threads : 1);
    struct lora_prefetch *const lpf = NULL;
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
#define SKINNY_LORA(THREAD, PREPARE, TEAM, IMPL, PAIRS)                                    \
    struct lora_call c = {x, ldx, out, ldo, k, n, seg_first, seg_len, seg_slot,         \
                          num_segs, at_ptrs, bt_ptrs, ranks, slice_table, num_slices,   \
                          max_slices, IMPL, num_threads, 0, 0, NULL};                   \
    const int status = PREPARE(&c);                                                     \
    if (status != 0) return status;                                                     \
    int failed = 0;                                                                     \
    struct spin_team team = {0}; /* the GEMM's outputs written before LoRA adds to them */ \
    _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)")               \
    {                                                                                   \
        struct lora_prefetch lpf_;                                                      \
        struct lora_prefetch *const lpf = rows >= skinny_lora_prefetch_rows() ? &lpf_ : NULL; \
        if (lpf) lora_prefetch_init(lpf, &c, PAIRS, omp_get_thread_num(), omp_get_num_threads()); \
        THREAD                                                                          \
        int phase = 0;                                                                  \
        spin_team_wait(&team, omp_get_num_threads(), &phase);                           \
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
    SKINNY_LORA(SKINNY_F32_THREAD, lora_f32_prepare, lora_f32_team, 0, 0)
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
    uint32_t *const xp = skinny_amx_buffer(x, ldx, rows, n, k,
                                           rows <= SKINNY_AMX_OWN_ROWS ? num_threads : 1);
    SKINNY_LORA(SKINNY_BF16_THREAD, lora_bf16_prepare, lora_bf16_team, impl, 1)
#else
    SKINNY_LORA_UNUSED;
    (void)impl;
    return -2;
#endif
}

/* One thread's part of skinny_lora_* (`c` NULL: of skinny_linear_*) inside a region whose
 * every thread calls it with the same arguments (cpu_decode_layers.c, a decode step's
 * layers in one region): its share of the GEMM, then, with LoRA, a spin barrier and its
 * share of the LoRA items (`c` prepared once for the step's segments, lora_for_projection);
 * no wait after it (the caller's). bfloat16: `xp` NULL or, where skinny_amx_takes, room
 * for one packed copy of x per thread: up to SKINNY_AMX_OWN_ROWS rows each thread packs its
 * own, past them the team packs the first together (a spin barrier after). Returns 1 where
 * LoRA scratch memory failed, -2 where the skinny GEMM is not compiled, else 0. */
#undef VEC
#define VEC VEC_F32
int skinny_team_f32(const float *x, int64_t ldx, const float *w, const float *bias,
                    float *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                    const struct lora_call *c, struct spin_team *team, int *phase)
{
#if defined(__AVX512F__) || defined(SKINNY_AVX2)
    struct lora_prefetch lpf_;
    struct lora_prefetch *const lpf = c && rows >= skinny_lora_prefetch_rows() ? &lpf_ : NULL;
    if (lpf) lora_prefetch_init(lpf, c, 0, omp_get_thread_num(), omp_get_num_threads());
    SKINNY_F32_THREAD
    if (!c) return 0;
    spin_team_wait(team, omp_get_num_threads(), phase);
    return lora_f32_team(c);
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)out; (void)ldo; (void)rows; (void)n;
    (void)k; (void)c; (void)team; (void)phase;
    return -2;
#endif
}

#undef VEC
#define VEC VEC_BF16
#undef SKINNY_PACK_WAIT
#define SKINNY_PACK_WAIT spin_team_wait(team, nt_, phase);
int skinny_team_bf16(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias,
                     bf16 *out, int64_t ldo, int64_t rows, int64_t n, int64_t k,
                     uint32_t *xp, const struct lora_call *c, struct spin_team *team,
                     int *phase)
{
#if defined(__AVX512BF16__) || defined(SKINNY_AVX2)
    struct lora_prefetch lpf_;
    struct lora_prefetch *const lpf = c && rows >= skinny_lora_prefetch_rows() ? &lpf_ : NULL;
    if (lpf) lora_prefetch_init(lpf, c, 1, omp_get_thread_num(), omp_get_num_threads());
    SKINNY_BF16_THREAD
    if (!c) return 0;
    spin_team_wait(team, omp_get_num_threads(), phase);
    return lora_bf16_team(c);
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)out; (void)ldo; (void)rows; (void)n;
    (void)k; (void)xp; (void)c; (void)team; (void)phase;
    return -2;
#endif
}
