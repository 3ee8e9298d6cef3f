/* Row-invariant bf16 GEMM for 1..many rows on x86-64 with AVX512_BF16: y [M, N] = x [M, K] @ W [N, K]^T, bf16
 * inputs, fp32 accumulation, fp32 or bf16 out. Built at first use by kernels/cpu/build.py and called through ctypes
 * (kernels/cpu/gemm.py).
 *
 * The arithmetic, which gemm.py's gemm_bf16_reference repeats in torch bit for bit:
 *
 *   per row m and output n: CHAINS fp32 accumulators a[0..CHAINS-1] = +0
 *       for each pair c = 0 .. K/2 - 1 in order, with j = c mod CHAINS:   (vdpbf16ps: products of bf16s are exact)
 *           a[j] = a[j] + x[m, 2c+1] * W[n, 2c+1]      (one fp32 rounding)
 *           a[j] = a[j] + x[m, 2c]   * W[n, 2c]        (one fp32 rounding)
 *       y[m, n] = a[0] + a[1]   (+ bias[n]; then one rounding to bf16 if asked)
 *   vdpbf16ps treats denormal inputs and results as zero (DAZ / FTZ) and rounds to nearest even.
 *
 * That sequence depends on nothing but row m and output n: the same whether the call has 1 row (a decode), 5 (a
 * verification window), 40 (a batch of windows) or 512 (a prefill chunk), and whatever the thread count (each output
 * tile is one thread's). This is what makes a speculative verification window compute, bit for bit, what a decode
 * computes (issue 33; oneDNN's bf16 GEMM changes its blocking with the number of rows).
 *
 * Weight layout (gemm.py's pack_bf16), for K % 2 == 0 and N padded to a multiple of 16 with zero rows:
 *   wp  uint16 [Np/16, K/2, 16, 2]: tile t, pair c, lane l, b = W[16t + l, 2c + b]
 * One 64-byte load holds one pair of inputs for the tile's 16 outputs; each row's pair of activations is broadcast
 * to the 16 lanes by vdpbf16ps's embedded {1to16}. Up to ROWS rows share one pass over a tile (their accumulators
 * in registers), so a window reads each weight once; the weight stream is prefetched as in w8a8.c.
 */
#include "bf16.h"
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TILE_N 16
#define ROWS 8   /* rows per pass: ROWS * CHAINS accumulators + CHAINS weight registers fit the 32 zmm */
#define CHAINS 2 /* accumulators per row (hide vdpbf16ps's latency at one row); part of the arithmetic above */
#define PREFETCH_BYTES 4096

typedef int32_t int32_a __attribute__((may_alias, aligned(2)));

/* acc + the bf16 pair products of w's lanes with the pair at x, broadcast to all 16 lanes */
static inline __m512 dpbf16_bcst(__m512 acc, __m512i w, const int32_a *x) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

static inline __attribute__((always_inline)) void tile_rows(const int R, int64_t t, int64_t m0, int64_t k,
                                                            const uint16_t *x, const uint16_t *wp,
                                                            const float *bias, int64_t n, void *y, int y_bf16,
                                                            int prefetch) {
    const int64_t pairs = k / 2;
    const uint16_t *wt = wp + t * pairs * 32;
    __m512 acc[ROWS][CHAINS];
#pragma GCC unroll 16
    for (int i = 0; i < R * CHAINS; i++) acc[i / CHAINS][i % CHAINS] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + CHAINS <= pairs; c += CHAINS) {
        if (prefetch)
            for (int p = 0; p < CHAINS; p++) _mm_prefetch((const char *)(wt + (c + p) * 32) + PREFETCH_BYTES, _MM_HINT_T0);
        __m512i w[CHAINS];
#pragma GCC unroll 4
        for (int p = 0; p < CHAINS; p++) w[p] = _mm512_loadu_si512((const void *)(wt + (c + p) * 32));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int p = 0; p < CHAINS; p++)
                acc[r][p] = dpbf16_bcst(acc[r][p], w[p], (const int32_a *)(x + (m0 + r) * k + 2 * (c + p)));
    }
    for (int p = 0; c < pairs; c++, p++) { /* the last pairs when K/2 is not a multiple of CHAINS: chain p = c mod CHAINS */
        const __m512i w = _mm512_loadu_si512((const void *)(wt + c * 32));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r][p] = dpbf16_bcst(acc[r][p], w, (const int32_a *)(x + (m0 + r) * k + 2 * c));
    }
    const int64_t col = t * TILE_N;
    const __mmask16 lanes = n - col >= TILE_N ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - col)) - 1);
    const __m512 bias_v = bias ? _mm512_maskz_loadu_ps(lanes, bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        __m512 out = acc[r][0];
        for (int p = 1; p < CHAINS; p++) out = _mm512_add_ps(out, acc[r][p]);
        if (bias) out = _mm512_add_ps(out, bias_v);
        if (y_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (m0 + r) * n + col, lanes, to_bf16(out));
        else
            _mm512_mask_storeu_ps((float *)y + (m0 + r) * n + col, lanes, out);
    }
}

#define TILE_ROWS(R)                                                                                                \
    static void tile_rows_##R(int64_t t, int64_t m0, int64_t k, const uint16_t *x, const uint16_t *wp,           \
                              const float *bias, int64_t n, void *y, int y_bf16, int prefetch) {                   \
        tile_rows(R, t, m0, k, x, wp, bias, n, y, y_bf16, prefetch);                                               \
    }
TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6) TILE_ROWS(7) TILE_ROWS(8)
#undef TILE_ROWS
typedef void tile_pass_fn(int64_t, int64_t, int64_t, const uint16_t *, const uint16_t *, const float *, int64_t,
                          void *, int, int);
static tile_pass_fn *const tile_pass[ROWS + 1] = {NULL,          tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4,
                                                  tile_rows_5,   tile_rows_6, tile_rows_7, tile_rows_8};

/* y [M, N] (fp32, or bf16 when y_bf16) = x [M, K] bf16 @ W^T (+ bias [N] fp32), W packed as above. K even. */
void specdec_gemm_bf16(const uint16_t *x, int64_t m_rows, int64_t k, const uint16_t *wp, const float *bias,
                       int64_t n, void *y, int y_bf16, int nthreads) {
    const int64_t tiles = (n + TILE_N - 1) / TILE_N;
    const int64_t passes = (m_rows + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t p = 0, m0 = 0; p < passes; p++) {
            const int64_t rows = (m_rows - m0) / (passes - p);
            tile_pass[rows](t, m0, k, x, wp, bias, n, y, y_bf16, p == 0);
            m0 += rows;
        }
    }
}
