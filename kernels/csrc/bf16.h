/* What the bfloat16 kernels share: the bf16 type and its conversions (as torch rounds),
 * the implementations a library can hold, and the AVX-512 BF16 operand helpers. */
#ifndef LORAPLEX_CPU_BF16_H
#define LORAPLEX_CPU_BF16_H
#include <stdint.h>
#include <string.h>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

typedef uint16_t bf16;

enum { BF16_PORTABLE = 0, BF16_AVX512 = 1 };

/* Bit i set: implementation i is compiled into this library (cpu_attention_bf16.c). */
int loraplex_bf16_impls(void);

static inline float bf16_to_f32(bf16 h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even, as torch does; NaN stays a (quiet) NaN */
static inline bf16 f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#ifdef __AVX512BF16__
static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

static inline __m512 load_bf16x16(const bf16 *p)
{
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512bh pair_at(const bf16 *p) /* p[0], p[1] broadcast */
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return as_bh(_mm512_set1_epi32(v));
}
#endif

#endif
