/* The skinny GEMM's bfloat16 kernel on AMX (Intel Sapphire Rapids and later): out[m, n] =
 * x[m, :] . w[n, :] (+ bias[n]), float32 sums rounded once to bf16, the plain [out, in]
 * weight read in place, as cpu_skinny_gemm.c's AVX-512 BF16 kernel does.
 *
 * On a CPU with AMX the AVX-512 BF16 kernel is compute-bound from about 8 rows: on a 2-core
 * Xeon with AMX it ran the demo model's layers at 4.8 GB/s at 32 rows and 2.7 GB/s at 64,
 * behind oneDNN's AMX GEMM on its packed copy (benchmarks/skinny_gemm.py). A tile
 * multiply (TDPBF16PS) does 16 x 16 x 32 products, so at decode sizes the weights'
 * stream is what is left.
 *
 * The weight is the A operand: a tile is 16 weight rows of 32 values (64 bytes each, at the
 * weight's row stride), so no copy of it is made. x is the B operand, which AMX reads as
 * pairs along k: xp[block][k/2][16] 32-bit pairs, x's rows in blocks of 16 (rows past the
 * last zero), packed per call by the team (a gather per 16 pairs). A C tile is then
 * [16 weight rows x 16 rows of x] of float32 sums, written out transposed, the bias added,
 * rounded to bf16 as vcvtneps2bf16 rounds (nearest even, as torch).
 *
 * Tiles: C in tmm0-3, A in tmm4-5, B in tmm6-7, all 16 rows of 64 bytes. With one block of
 * x rows a weight read serves 4 C tiles of 4 weight blocks (64 weight rows in flight), with
 * two 2 x 2, with more one weight block against 4 blocks of x at a time. No software
 * prefetch: the tiles' loads streamed the weights at the rate of a plain sum without it
 * (1-16 rows), and prefetching the next run of blocks made them slower.
 *
 * Linux hands out AMX's tile state to a process only on request (arch_prctl
 * ARCH_REQ_XCOMP_PERM); `loraplex_skinny_amx(1)` asks once and turns the kernel on where
 * that succeeds. Only whole 16-row blocks of the weight and k a multiple of 32 take tiles;
 * the rest goes to the AVX-512 BF16 kernel (skinny_amx_buffer, cpu_skinny_gemm.c). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SKINNY_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static int use_amx; /* set once by loraplex_skinny_amx, read by every call */

/* enable 1: ask for AMX (once per process) and use it if granted; 0: stop using it;
 * -1: only report. Returns whether the skinny GEMM now runs bf16 on AMX. */
int loraplex_skinny_amx(int enable)
{
#ifdef SKINNY_AMX
    static int granted = -1;
    if (enable == 1 && granted < 0) {
        enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    if (enable >= 0) use_amx = enable == 1 && granted == 1;
    return use_amx;
#else
    (void)enable;
    return 0;
#endif
}

int skinny_amx_enabled(void) { return use_amx; }

int64_t skinny_amx_packed(int64_t rows, int64_t k)
{
    return (rows + 15) / 16 * (k / 2) * 16; /* 32-bit pairs, whole 64 bytes */
}

/* Whether this GEMM takes tiles: AMX on, a whole 16-row weight block, k a multiple of 32,
 * x's rows 4-byte aligned (pairs are read as 32-bit values). */
int skinny_amx_takes(const bf16 *x, int64_t ldx, int64_t rows, int64_t n, int64_t k)
{
    return use_amx && rows > 0 && n >= 16 && k > 0 && k % 32 == 0 && ldx % 2 == 0
           && ((uintptr_t)x & 3) == 0;
}

/* The calling thread's buffer for `copies` copies of x packed as pairs (skinny_amx_pack),
 * or NULL where this GEMM does not take tiles or there is no memory. */
uint32_t *skinny_amx_buffer(const bf16 *x, int64_t ldx, int64_t rows, int64_t n, int64_t k,
                            int copies)
{
    static __thread uint32_t *buf;
    static __thread int64_t cap;
    if (!skinny_amx_takes(x, ldx, rows, n, k)) return NULL;
    const int64_t need = skinny_amx_packed(rows, k) * copies;
    if (need > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)need * sizeof *buf);
        cap = buf ? need : 0;
    }
    return buf;
}

#ifdef SKINNY_AMX
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* x [rows, k] as B operands, this thread's share of the pair columns: xp[(j * k/2 + kk) *
 * 16 + i] = the pair x[16 j + i, 2 kk .. 2 kk + 1], zero past the last row. */
static void pack_x(const bf16 *x, int64_t ldx, int64_t rows, int64_t k, uint32_t *xp,
                   int t, int nt)
{
    const int64_t kh = k / 2, blocks = (rows + 15) / 16;
    const int64_t c0 = kh * t / nt, c1 = kh * (t + 1) / nt;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)(ldx / 2)));
    for (int64_t j = 0; j < blocks; ++j) {
        const int64_t left = rows - 16 * j;
        const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const int32_t *base = (const int32_t *)(x + 16 * j * ldx);
        uint32_t *dst = xp + j * kh * 16;
        for (int64_t c = c0; c < c1; ++c)
            _mm512_store_si512(dst + c * 16, _mm512_mask_i32gather_epi32(
                _mm512_setzero_si512(), m, idx, base + c, 4));
    }
}

/* 16 x 16 floats transposed in registers: r[i] holds row i, and column i after (four
 * rounds of 16 shuffles). */
static inline void transpose16(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}

/* C tile T (weight block `wb`, x block `xb`): out[16 xb + i, 16 wb + j] = C[j][i] + bias,
 * for the rows of x there are; C transposed in registers (a gather per row of out took
 * about a quarter of the GEMM's time at 128-512 rows). */
#define STORE_TILE(T, wb, xb)                                                             \
    do {                                                                                \
        _tile_stored(T, cbuf, 64);                                                      \
        const int64_t n0_ = (wb) * 16, r0_ = (xb) * 16;                                 \
        const __m512 b_ = bias ? load_bf16x16(bias + n0_) : _mm512_setzero_ps();        \
        __m512 c_[16];                                                                  \
        for (int j_ = 0; j_ < 16; ++j_) c_[j_] = _mm512_load_ps(cbuf + 16 * j_);        \
        transpose16(c_);                                                                \
        for (int i_ = 0; i_ < 16 && r0_ + i_ < rows; ++i_)                              \
            _mm256_storeu_si256((__m256i *)(out + (r0_ + i_) * ldo + n0_),              \
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c_[i_], b_))); \
    } while (0)

#define A_TILE(T, wb) _tile_loadd(T, w + (wb) * 16 * k + p, k * 2)
#define B_TILE(T, xb) _tile_loadd(T, xp + ((xb) * kh + p / 2) * 16, 64)
#endif

/* This thread's share of out's whole 16-row weight blocks (the caller has packed x with
 * skinny_amx_pack and passed a barrier). Returns the first weight row the tiles do not
 * cover (n rounded down to 16), for the AVX-512 kernel. */
int64_t skinny_amx_share(const uint32_t *xp, const bf16 *w, const bf16 *bias, bf16 *out,
                         int64_t ldo, int64_t rows, int64_t n, int64_t k, int t, int nt)
{
#ifdef SKINNY_AMX
    struct tile_config cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; ++i) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    float cbuf[256] __attribute__((aligned(64)));
    const int64_t kh = k / 2, xblocks = (rows + 15) / 16, wblocks = n / 16;
    /* weight blocks per unit of work: as many as C tiles the x blocks leave (more than
     * two x blocks: two, against two x blocks at a time). The threads share the blocks
     * evenly, a thread's last unit short where its blocks are not a whole number of
     * units: shared by whole units, 36 blocks (576 outputs) at one x block went 16 / 20
     * and 60 (960) 28 / 32, one thread waiting on the other at the next barrier. */
    const int64_t per = xblocks == 1 ? 4 : 2;
    const int64_t b0 = wblocks * t / nt, b1 = wblocks * (t + 1) / nt;
    for (int64_t wb = b0; wb < b1; wb += per) {
        const int64_t na = b1 - wb < per ? b1 - wb : per;
        if (xblocks == 1) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t p = 0; p < k; p += 32) {
                B_TILE(6, 0);
                A_TILE(4, wb); _tile_dpbf16ps(0, 4, 6);
                if (na > 1) { A_TILE(5, wb + 1); _tile_dpbf16ps(1, 5, 6); }
                if (na > 2) { A_TILE(4, wb + 2); _tile_dpbf16ps(2, 4, 6); }
                if (na > 3) { A_TILE(5, wb + 3); _tile_dpbf16ps(3, 5, 6); }
            }
            STORE_TILE(0, wb, 0);
            if (na > 1) STORE_TILE(1, wb + 1, 0);
            if (na > 2) STORE_TILE(2, wb + 2, 0);
            if (na > 3) STORE_TILE(3, wb + 3, 0);
        } else if (xblocks == 2) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t p = 0; p < k; p += 32) {
                B_TILE(6, 0); B_TILE(7, 1);
                A_TILE(4, wb); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                if (na > 1) { A_TILE(5, wb + 1); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
            }
            STORE_TILE(0, wb, 0);
            STORE_TILE(1, wb, 1);
            if (na > 1) { STORE_TILE(2, wb + 1, 0); STORE_TILE(3, wb + 1, 1); }
        } else {
            /* two weight blocks against two x blocks at a time, 2 x 2 C tiles: each tile
             * loaded serves two multiplies (one weight block against 4 x blocks, each x
             * tile read from L2 for one multiply, ran the layers at 1.18 TFLOP/s at 256
             * rows on the Xeon with AMX). The weight blocks stay in L1/L2 over the x
             * blocks. */
            for (int64_t xb = 0; xb < xblocks; xb += 2) {
                const int64_t nx = xblocks - xb < 2 ? xblocks - xb : 2;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t p = 0; p < k; p += 32) {
                    A_TILE(4, wb);
                    B_TILE(6, xb); _tile_dpbf16ps(0, 4, 6);
                    if (nx > 1) { B_TILE(7, xb + 1); _tile_dpbf16ps(1, 4, 7); }
                    if (na > 1) {
                        A_TILE(5, wb + 1); _tile_dpbf16ps(2, 5, 6);
                        if (nx > 1) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                STORE_TILE(0, wb, xb);
                if (nx > 1) STORE_TILE(1, wb, xb + 1);
                if (na > 1) STORE_TILE(2, wb + 1, xb);
                if (na > 1 && nx > 1) STORE_TILE(3, wb + 1, xb + 1);
            }
        }
    }
    _tile_release();
    return wblocks * 16;
#else
    (void)xp; (void)w; (void)bias; (void)out; (void)ldo; (void)rows; (void)n; (void)k;
    (void)t; (void)nt;
    return 0; /* never called: skinny_amx_buffer is NULL without AMX */
#endif
}

void skinny_amx_pack(const bf16 *x, int64_t ldx, int64_t rows, int64_t k, uint32_t *xp,
                     int t, int nt)
{
#ifdef SKINNY_AMX
    pack_x(x, ldx, rows, k, xp, t, nt);
#else
    (void)x; (void)ldx; (void)rows; (void)k; (void)xp; (void)t; (void)nt;
#endif
}
