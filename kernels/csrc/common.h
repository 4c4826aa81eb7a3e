/* What the float32 and bfloat16 native kernels share. */
#ifndef LORAPLEX_CPU_COMMON_H
#define LORAPLEX_CPU_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* exp for x <= 0 (Cephes' single-precision polynomial, ~1 ulp on [-87, 0]); written out so
 * the softmax loop vectorises without -ffast-math. n = x / ln 2 rounded to nearest by the
 * 1.5 * 2^23 trick rather than floorf(. + 0.5), which gcc does not vectorise under the
 * default -ftrapping-math; exp_nonpositive_v below computes the same, VL lanes at once. */
#define EXP_ROUND 12582912.0f
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + EXP_ROUND) - EXP_ROUND;
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

/* LoRA tiles (cpu_lora_f32.c, and cpu_lora_bf16.c's portable kernel), and the softmax's
 * vector exp. `vf` is one machine vector of floats (GCC vector extension: a zmm of 16 with
 * AVX-512, a ymm of 8 with AVX, 4 otherwise), so that a tile's sums are named values the
 * compiler keeps in registers; as arrays indexed in loops they were kept on the stack (a
 * load and a store around every FMA), and so were 16-float vectors on AVX2, which GCC
 * splits through memory.
 *
 * A tile is 4 tokens x TILE_VECTORS vectors of sums: with AVX-512 64 ranks or columns, 16
 * of 32 zmm; with AVX2 16, 8 of 16 ymm (enough independent FMA chains for Zen 3's latency
 * and two FMA units). A shrink of more ranks reads x (from L1) once per tile. Ranks are
 * padded to a multiple of LORA_RANK_MULTIPLE (8; lora_slots.py pads the layout to what
 * loraplex_lora_rank_multiple says), so a last, part tile has whole vectors and, with
 * AVX-512, perhaps one half vector of 8 ranks (`vh`). Padding to 16 cost a rank-8 adapter
 * a quarter more bytes (its o and down A doubled), and a decode step's LoRA reads its
 * adapters' bytes at about the streaming rate. */
#if defined(__AVX512F__)
#define VL 16
#define TILE_VECTORS 4
#elif defined(__AVX__)
#define VL 8
#define TILE_VECTORS 2
#else /* SSE, NEON: 4-float vectors, 8 of their 16 (or 32) registers */
#define VL 4
#define TILE_VECTORS 2
#endif
#define TILE_COLUMNS (VL * TILE_VECTORS)
typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));
#define LORA_RANK_MULTIPLE 8
/* half a zmm: the 8 ranks of a last tile past its whole vectors (AVX-512 builds only; the
 * others' vectors divide 8, and their kernels never take a half) */
typedef float vh __attribute__((vector_size(8 * sizeof(float))));
typedef uint32_t vhu __attribute__((vector_size(8 * sizeof(uint32_t))));
#define HALF_RANKS 8

/* sum + v * a with one rounding, as the whole vectors' sums get: GCC left this one, a lone
 * token's half vector, as a multiply and an add. */
static inline vh fma_half(vh sum, float v, vh a)
{
#ifdef __AVX512F__
    return (vh)_mm256_fmadd_ps((__m256)a, _mm256_set1_ps(v), (__m256)sum);
#else
    return sum + v * a;
#endif
}
/* The whole vectors (NV) and half vectors (NH, 0 or 1) of a part tile of K8 x 8 ranks. */
#define LORA_PART_NV(K8) ((K8) * 8 / VL)
#define LORA_PART_NH(K8) ((K8) * 8 % VL / 8)

/* An opaque use of a vector just loaded, so that the compiler keeps it in a register for
 * the uses after it. Without it GCC loaded the LoRA kernels' weight vectors from memory
 * again for every token they multiply: a prefill group's expand had four loads of B per
 * vector (one per token) and its shrink one of A per token, where each is loaded once,
 * and a load port, not the multiplications, set the pace (a 2,048-token chunk's LoRA
 * 1.11x faster in bfloat16, 1.15x in float32, on the Zen 4; benchmarks/lora_prefill.py
 * --baseline). The kernels ask for it in the full groups of a work item of several
 * (`reuse`: a prefill's, whose weights the later groups read from cache); an item of one
 * group (a decode step's), its weights read once from memory, ran as fast or faster with
 * the compiler's loads. */
#if defined(__x86_64__) || defined(__i386__)
#define keep_in_register(v) __asm__("" : "+v"(v))
#else
#define keep_in_register(v) ((void)0)
#endif

static inline vf loadv(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

/* exp_nonpositive of VL lanes (GCC vector extension: no auto-vectoriser involved). */
static inline vf exp_nonpositive_v(vf x)
{
    const vi low = x < -87.0f; /* all ones where x < -87 */
    x = (vf)((low & (vi)((vf){0} - 87.0f)) | (~low & (vi)x));
    const vf n = (x * 1.44269504088896341f + EXP_ROUND) - EXP_ROUND;
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

/* Attention-logit soft-capping (Gemma 2): cap * tanh(s / cap) of VL scores, as the
 * reference computes it (divide, tanh, multiply). tanh as Cephes' tanhf: an odd
 * polynomial below |y| = 0.625, where (1 - e) / (1 + e) with e = exp(-2|y|) would lose
 * bits to the subtraction, that quotient above (e <= 1, so it never overflows); written
 * out, as exp_nonpositive_v, so it vectorises without -ffast-math (libm's tanhf is
 * scalar), within a few ulp of it. */
static inline vf softcap_v(vf s, float cap)
{
    const vf y = s / cap;
    const vu sign = (vu)y & 0x80000000u;
    const vf a = (vf)((vu)y & 0x7fffffffu);
    const vf z = a * a;
    const vf small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z
                        - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z
                      - 3.33332819422e-1f) * z * a + a;
    const vf e = exp_nonpositive_v((vf){0} - 2.0f * a);
    const vf large = (1.0f - e) / (1.0f + e);
    const vi below = a < 0.625f;
    const vf t = (vf)((below & (vi)small) | (~below & (vi)large));
    return (vf)((vu)t | sign) * cap;
}

/* softcap_v of n scores in place, VL at a time (the last ones through a padded vector) */
static inline void softcap_row(float *restrict w, int64_t n, float cap)
{
    int64_t p = 0;
    for (; p + VL <= n; p += VL) {
        const vf s = softcap_v(loadv(w + p), cap);
        memcpy(w + p, &s, sizeof s);
    }
    if (p < n) {
        float tail[VL] = {0};
        memcpy(tail, w + p, sizeof(float) * (size_t)(n - p));
        const vf s = softcap_v(loadv(tail), cap);
        memcpy(tail, &s, sizeof s);
        memcpy(w + p, tail, sizeof(float) * (size_t)(n - p));
    }
}

/* NAME(p, even, odd): a vector of pairs of bf16 values (p: two per lane of FLOATS) widened
 * to float32: *even gets the first of each pair, *odd the second (a bf16 is a float32's
 * upper half). load_pairs: VL pairs; load_pairs_half: 8, into half vectors. */
#define LOAD_PAIRS(NAME, FLOATS, WORDS)                                                   \
    static inline void NAME(const uint16_t *p, FLOATS *even, FLOATS *odd)              \
    {                                                                                   \
        WORDS u;                                                                        \
        memcpy(&u, p, sizeof u);                                                        \
        const WORDS e = u << 16, o = u & 0xffff0000u;                                   \
        memcpy(even, &e, sizeof e);                                                     \
        memcpy(odd, &o, sizeof o);                                                      \
    }
LOAD_PAIRS(load_pairs, vf, vu)
LOAD_PAIRS(load_pairs_half, vh, vhu)
#undef LOAD_PAIRS

/* The shrink of a work item's tokens, group of 4 by group (LORA_TOKENS, defined by the
 * kernel's file), tile of ranks by tile, so each tile of A is read from memory once and
 * from cache for the other groups. SHRINK(x, y, k0, nv, nh) is the kernel's shrink of one
 * group (x its rows, y its rows of ranks, nv vectors and nh half vectors of ranks from k0,
 * constants); X_STEP: a group's elements in x. The last tile is any multiple of 8 ranks
 * short of TILE_COLUMNS (LORA_SHRINK_LAST; none where TILE_COLUMNS is 8). */
#if TILE_COLUMNS == 64
#define LORA_SHRINK_LAST(SHRINK, X, Y, K0, R)                                             \
    switch (((R) - (K0)) / 8) {                                                         \
    case 7: SHRINK(X, Y, K0, LORA_PART_NV(7), LORA_PART_NH(7)); break;                  \
    case 6: SHRINK(X, Y, K0, LORA_PART_NV(6), LORA_PART_NH(6)); break;                  \
    case 5: SHRINK(X, Y, K0, LORA_PART_NV(5), LORA_PART_NH(5)); break;                  \
    case 4: SHRINK(X, Y, K0, LORA_PART_NV(4), LORA_PART_NH(4)); break;                  \
    case 3: SHRINK(X, Y, K0, LORA_PART_NV(3), LORA_PART_NH(3)); break;                  \
    case 2: SHRINK(X, Y, K0, LORA_PART_NV(2), LORA_PART_NH(2)); break;                  \
    case 1: SHRINK(X, Y, K0, LORA_PART_NV(1), LORA_PART_NH(1)); break;                  \
    default: break;                                                                     \
    }
#elif TILE_COLUMNS == 16
#define LORA_SHRINK_LAST(SHRINK, X, Y, K0, R)                                             \
    if ((R) - (K0) == 8) SHRINK(X, Y, K0, LORA_PART_NV(1), 0);
#elif TILE_COLUMNS == 8
#define LORA_SHRINK_LAST(SHRINK, X, Y, K0, R)
#else
#error "a part tile of this TILE_COLUMNS has no shrink"
#endif
#define LORA_SHRINK_GROUPS(SHRINK, XB, X_STEP, Y, R, GROUPS)                              \
    do {                                                                                \
        int64_t k0_ = 0;                                                                \
        for (; k0_ + TILE_COLUMNS <= (R); k0_ += TILE_COLUMNS)                          \
            for (int64_t g_ = 0; g_ < (GROUPS); ++g_)                                   \
                SHRINK((XB) + g_ * (X_STEP), (Y) + g_ * LORA_TOKENS * (R), k0_,         \
                       TILE_VECTORS, 0);                                                \
        for (int64_t g_ = 0; g_ < (GROUPS); ++g_) {                                     \
            LORA_SHRINK_LAST(SHRINK, (XB) + g_ * (X_STEP), (Y) + g_ * LORA_TOKENS * (R), \
                             k0_, R)                                                    \
        }                                                                               \
    } while (0)

/* The tokens of group g (of LORA_TOKENS, defined by the kernel's file) among a work
 * item's nt: LORA_TOKENS but for a last, part group. */
#define LORA_GROUP_TOKENS(NT, G)                                                          \
    ((NT) - (G) * LORA_TOKENS < LORA_TOKENS ? (NT) - (G) * LORA_TOKENS : LORA_TOKENS)

/* GROUP_CALL(n) with a group's token count NG (1-4) as the constant n, so that a kernel
 * inlined for it multiplies only those tokens (a decode step's groups have one or two). */
#define LORA_BY_TOKENS(NG, GROUP_CALL)                                                    \
    switch (NG) {                                                                       \
    case 1: GROUP_CALL(1); break;                                                       \
    case 2: GROUP_CALL(2); break;                                                       \
    case 3: GROUP_CALL(3); break;                                                       \
    default: GROUP_CALL(4); break;                                                      \
    }

/* LORA_BY_TOKENS with a second constant, `reuse`: 1 for a full group of a work item of
 * GROUPS > 1 groups (a prefill's, whose weights its groups read from cache after the first:
 * the kernels hold them in registers, keep_in_register), else 0. */
#define LORA_BY_GROUP(NG, GROUPS, GROUP_CALL)                                             \
    do {                                                                                \
        if ((GROUPS) > 1 && (NG) == LORA_TOKENS) {                                      \
            GROUP_CALL(LORA_TOKENS, 1);                                                 \
            break;                                                                      \
        }                                                                               \
        switch (NG) {                                                                   \
        case 1: GROUP_CALL(1, 0); break;                                                \
        case 2: GROUP_CALL(2, 0); break;                                                \
        case 3: GROUP_CALL(3, 0); break;                                                \
        default: GROUP_CALL(4, 0); break;                                               \
        }                                                                               \
    } while (0)

/* The expand's order, in every LoRA kernel: group after group of a work item's tokens,
 * each along all of a slice's tiles, so that a group's rows of out are read and written in
 * order. Tile after tile, each through all groups (the earlier order), touched every row of
 * the item per tile, strided by the output's width: a prefill's 32-token items waited on
 * those rows (1.1-1.3x in bfloat16, 1.2-1.4x in float32 for whole prefill segments). A
 * slice's tiles are a few KiB to tens of KiB and stay in cache for the groups after the
 * first. */

/* The tokens per LoRA work item: `most` (a multiple of `group`), halved while that leaves
 * fewer items than `want` (the team's threads), down to `group`. */
static inline int64_t lora_item_tokens(const int64_t *seg_len, int64_t num_segs,
                                       int64_t group, int64_t most, int64_t want)
{
    int64_t size = most;
    for (; size > group; size /= 2) {
        int64_t n = 0;
        for (int64_t i = 0; i < num_segs; ++i) n += (seg_len[i] + size - 1) / size;
        if (n >= want) break;
    }
    return size < group ? group : size;
}

/* LoRA work items: (first token, token count, slot) for every group of up to
 * `group` consecutive tokens of a segment; *num_groups set. NULL when out of memory. */
static inline int64_t *lora_work_items(const int64_t *seg_first, const int64_t *seg_len,
                                       const int64_t *seg_slot, int64_t num_segs,
                                       int64_t group, int64_t *num_groups)
{
    int64_t n = 0;
    for (int64_t i = 0; i < num_segs; ++i) n += (seg_len[i] + group - 1) / group;
    /* the items, then a block of n for lora_plan_items's owners */
    int64_t *work = malloc(sizeof(int64_t) * (size_t)(4 * (n ? n : 1)));
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

/* A work item's cost: its slot's weights (bytes in proportion to the rank), and its tokens. */
static inline int64_t lora_item_cost(const int64_t *item, const int64_t *ranks)
{
    return ranks[item[2]] * (8 + item[1]);
}

/* The work items ordered by their cost, largest first (a stable insertion sort: a step has
 * tens of items), so that a dynamic schedule ends on small ones: a decode item's cost is
 * its slot's weights (bytes in proportion to the rank), a prefill item's also its tokens.
 * Each item writes its own tokens' rows, so the order changes no result. */
static inline void lora_order_items(int64_t *work, int64_t num_groups, const int64_t *ranks)
{
    for (int64_t i = 1; i < num_groups; ++i) {
        int64_t item[3] = {work[3 * i], work[3 * i + 1], work[3 * i + 2]};
        const int64_t cost = lora_item_cost(item, ranks);
        int64_t j = i;
        for (; j > 0 && lora_item_cost(work + 3 * (j - 1), ranks) < cost; --j)
            memcpy(work + 3 * j, work + 3 * (j - 1), sizeof(int64_t) * 3);
        memcpy(work + 3 * j, item, sizeof item);
    }
}

/* A decode step's calls (up to LORA_PLAN_TOKENS tokens, the skinny GEMM's batches) share
 * their items out before the team starts: each item to the thread with the least cost so
 * far, costliest first (lora_order_items's order), so that a thread knows its next item
 * and reads the start of its weights into cache while this one computes (a decode item's
 * weights are a few runs of 10-200 KB from memory, each begun by a wait on its first
 * lines; lora.h: lora_own_items). The owners go to the block after the items
 * (lora_work_items). Returns the team size planned for, or 0 (the items then claimed at
 * run time). */
#define LORA_PLAN_TOKENS 64
static inline int lora_plan_items(int64_t *work, int64_t num_groups, const int64_t *ranks,
                                  int threads)
{
    int64_t tokens = 0;
    for (int64_t g = 0; g < num_groups; ++g) tokens += work[3 * g + 1];
    if (threads < 2 || threads > 64 || tokens > LORA_PLAN_TOKENS) return 0;
    int64_t load[64] = {0};
    int64_t *owner = work + 3 * num_groups;
    for (int64_t g = 0; g < num_groups; ++g) {
        int best = 0;
        for (int t = 1; t < threads; ++t)
            if (load[t] < load[best]) best = t;
        owner[g] = best;
        load[best] += lora_item_cost(work + 3 * g, ranks);
    }
    return threads;
}

#endif
