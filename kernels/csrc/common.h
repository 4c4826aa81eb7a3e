/* What the float32 and bfloat16 native kernels share. */
#ifndef LORAPLEX_CPU_COMMON_H
#define LORAPLEX_CPU_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp for x <= 0 (Cephes' single-precision polynomial, ~1 ulp on [-87, 0]); written out so
 * the softmax loop vectorises without -ffast-math. */
static inline float exp_nonpositive(float x)
{
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

/* LoRA work items: (first token, token count, slot) for every group of up to
 * `group` consecutive tokens of a segment; *num_groups set. NULL when out of memory. */
static inline int64_t *lora_work_items(const int64_t *seg_first, const int64_t *seg_len,
                                       const int64_t *seg_slot, int64_t num_segs,
                                       int64_t group, int64_t *num_groups)
{
    int64_t n = 0;
    for (int64_t i = 0; i < num_segs; ++i) n += (seg_len[i] + group - 1) / group;
    int64_t *work = malloc(sizeof(int64_t) * (size_t)(3 * (n ? n : 1)));
    if (!work) return NULL;
    for (int64_t i = 0, w = 0; i < num_segs; ++i)
        for (int64_t j = 0; j < seg_len[i]; j += group, ++w) {
            work[3 * w] = seg_first[i] + j;
            work[3 * w + 1] = seg_len[i] - j < group ? seg_len[i] - j : group;
            work[3 * w + 2] = seg_slot[i];
        }
    *num_groups = n;
    return work;
}

#endif
