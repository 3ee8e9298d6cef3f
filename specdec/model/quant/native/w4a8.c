/* w4a8 GEMM for 1..many rows on x86-64 with AVX-512 VNNI: int4 weights (asymmetric, per group of >= 32 inputs,
 * fp16 or fp32 scale and offset) times int8 activations (symmetric, per row and block of 32 inputs), fp32 out.
 *
 * Built at first use by specdec/model/quant/native.py (gcc -O3 -mavx512f -mavx512bw -mavx512vnni -mf16c -fopenmp)
 * and called through ctypes. The arithmetic, which native.py's w4a8_reference repeats in torch:
 *
 *   per row m and block b of 32 inputs:  xs[m,b] = max|x[m, b*32 : b*32+32]| / 127  (1 for a zero block)
 *                                        xq[m,k] = round_half_even(x[m,k] / xs[m,b]) clamped to [-127, 127]
 *                                        xsum[m,b] = xs[m,b] * (sum of xq[m,k] over the block)
 *   per output n:  acc = 0; for each block b in order (g = the weight group holding b):
 *                      acc = fma(float(sum_k q[n,k] * xq[m,k]), s[n,g] * xs[m,b], acc)   (exact int32 dot)
 *                      acc = fma(o[n,g], xsum[m,b], acc)
 *                  y[m,n] = acc
 *
 * Every row's arithmetic is the same whatever the number of rows in the call (one row or a verification window):
 * the output of a row does not depend on the others, bit for bit.
 *
 * Weight layout (prepared by native.py's pack_w4a8), for N % 16 == 0 and K % 32 == 0:
 *   wq  uint8 [N/16, K/8, 16, 4]: tile t holds outputs 16t..16t+15; chunk j holds inputs 8j..8j+7; byte
 *       (lane, b): low nibble q[16t+lane, 8j+b], high nibble q[16t+lane, 8j+4+b]
 *   ws, wo  fp16 (or fp32: scales_f32) [N/16, G, 16]: scale and offset of group g for the tile's 16 outputs
 * One 64-byte load gives 8 inputs x 16 outputs; vpdpbusd multiplies the unsigned nibbles by 4 broadcast signed
 * activation bytes and adds 4 products into each output's int32 lane.
 *
 * Per block and row the floor on Zen 4 is ~11 cycles in the vector multiply pipes (8 vpdpbusd, the s * xs multiply
 * and 2 FMAs); cvtdq2ps and the integer ops go to the other pipes. Up to 16 rows share one pass over a tile with
 * their accumulators in registers, and the weight stream is prefetched so that memory and compute overlap.
 */
#include "act_blocks.h"

/* 16 scales (or offsets) of a tile's group from element ``at``: fp16 (the compact form, exact for Q4_0 / Q4_1 and
 * what requantised weights hold) or fp32 (scales_f32: GGUF Q4_K's d * sc and dmin * m, exact only there) */
static inline __m512 load_scales(const void *w, int scales_f32, int64_t at) {
    return scales_f32 ? _mm512_loadu_ps((const float *)w + at)
                      : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at)));
}

/* Rows m0..m0+R-1 (of m_rows) of tile t in one pass over the tile's weights: each block's 8 weight vectors are
 * unpacked once for the R rows. R is a constant in each tile_rows_R, so the loops over rows unroll and the row
 * pointers are constant offsets (the old loop over a variable row count kept its accumulators in memory). Every
 * row does the same operations in the same order whatever R is. prefetch: fetch the stream PREFETCH_BYTES ahead
 * (the first pass; later passes find the tile in cache). Past the weight's end the prefetch is harmless. */
static inline __attribute__((always_inline)) void tile_rows(const int R, int64_t t, int64_t m0, int64_t k,
                                                            const int8_t *xq, const float *xs, const float *xsum,
                                                            const uint8_t *wq, const void *ws, const void *wo,
                                                            int scales_f32, const float *bias, int64_t n,
                                                            int64_t group, void *y, int y_bf16, int64_t m_rows,
                                                            int prefetch) {
    const int64_t groups = k / group, blocks_per_group = group / BLOCK_K;
    const uint8_t *wt = wq + t * (k / 8) * 64;
    const int64_t tile_at = t * groups * TILE_N; /* the tile's first scale / offset */
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS]; /* fixed bounds (R is a constant here): a variable-length array lives in memory */
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0, b = 0; g < groups; g++) {
        const __m512 s = load_scales(ws, scales_f32, tile_at + g * TILE_N);
        const __m512 o = load_scales(wo, scales_f32, tile_at + g * TILE_N);
        for (int64_t bg = 0; bg < blocks_per_group; bg++, b++) {
            if (prefetch)
                for (int i = 0; i < 4; i++)
                    _mm_prefetch((const char *)(wt + (b * 4 + i) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
            __m512i w[8]; /* w[2i]: inputs 32b+8i..+3, w[2i+1]: inputs 32b+8i+4..+7, as unsigned bytes */
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_loadu_si512((const void *)(wt + (b * 4 + i) * 64));
                w[2 * i] = _mm512_and_si512(v, nibble);
                w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const int64_t at = b * m_rows + m0 + r;
                const int32_a *x4 = (const int32_a *)(xq + at * BLOCK_K); /* dword j: inputs 4j..4j+3 */
                /* two int32 chains (the rows interleave, so more did not help); integer sums are exact, so the
                 * split does not change the result */
                __m512i p0 = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
                for (int i = 0; i < 4; i++) {
                    p0 = dpbusd_bcst(p0, w[i], x4 + i);
                    p1 = dpbusd_bcst(p1, w[i + 4], x4 + i + 4);
                }
                const __m512i dot = _mm512_add_epi32(p0, p1);
                const float xsc = xs[at], xsm = xsum[at];
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(xsc)), acc[r]);
                acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsm), acc[r]);
            }
        }
    }
    const __m512 bias_v = bias ? _mm512_loadu_ps(bias + t * TILE_N) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        const __m512 out = bias ? _mm512_add_ps(acc[r], bias_v) : acc[r];
        store_row(y, y_bf16, (m0 + r) * n + t * TILE_N, out);
    }
}

/* tile_rows for each R up to ROWS and each scale format, as functions of their own: inlined together into one
 * body, the 1- and 2-row loops ran ~10% slower (code placement). The format is a constant in each (F = 0: fp16,
 * the compact form; 1: fp32), so its branch folds away and the fp16 pass is the code it was before fp32 scales. */
#define TILE_ROWS(R, F)                                                                                               \
    static void tile_rows_##F##_##R(int64_t t, int64_t m0, int64_t k, const int8_t *xq, const float *xs,            \
                                    const float *xsum, const uint8_t *wq, const void *ws, const void *wo,           \
                                    const float *bias, int64_t n, int64_t group, void *y, int y_bf16,               \
                                    int64_t m_rows, int prefetch) {                                                  \
        tile_rows(R, t, m0, k, xq, xs, xsum, wq, ws, wo, F, bias, n, group, y, y_bf16, m_rows, prefetch);           \
    }
#define TILE_ROWS_BOTH(R) TILE_ROWS(R, 0) TILE_ROWS(R, 1)
TILE_ROWS_BOTH(1) TILE_ROWS_BOTH(2) TILE_ROWS_BOTH(3) TILE_ROWS_BOTH(4) TILE_ROWS_BOTH(5) TILE_ROWS_BOTH(6)
TILE_ROWS_BOTH(7) TILE_ROWS_BOTH(8) TILE_ROWS_BOTH(9) TILE_ROWS_BOTH(10) TILE_ROWS_BOTH(11) TILE_ROWS_BOTH(12)
TILE_ROWS_BOTH(13) TILE_ROWS_BOTH(14) TILE_ROWS_BOTH(15) TILE_ROWS_BOTH(16)
#undef TILE_ROWS_BOTH
#undef TILE_ROWS
typedef void tile_pass_fn(int64_t, int64_t, int64_t, const int8_t *, const float *, const float *, const uint8_t *,
                          const void *, const void *, const float *, int64_t, int64_t, void *, int, int64_t, int);
#define PASSES(F)                                                                                                     \
    {NULL, tile_rows_##F##_1, tile_rows_##F##_2, tile_rows_##F##_3, tile_rows_##F##_4, tile_rows_##F##_5,           \
     tile_rows_##F##_6, tile_rows_##F##_7, tile_rows_##F##_8, tile_rows_##F##_9, tile_rows_##F##_10,                \
     tile_rows_##F##_11, tile_rows_##F##_12, tile_rows_##F##_13, tile_rows_##F##_14, tile_rows_##F##_15,            \
     tile_rows_##F##_16}
static tile_pass_fn *const tile_pass[2][ROWS + 1] = {PASSES(0), PASSES(1)};
#undef PASSES

/* y [M, N] = w4a8(x [M, K]) (+ bias [N] fp32, added to the fp32 result), x and y fp32 or bf16 (x_bf16, y_bf16:
 * y rounded once from fp32, to nearest even). group: the weight group size (a multiple of 32 dividing K).
 * Returns 0, or -1 when the scratch buffers could not be allocated. */
int specdec_w4a8_gemm(const void *x, int x_bf16, int64_t m_rows, int64_t k, const uint8_t *wq, const void *ws,
                      const void *wo, int scales_f32, const float *bias, int64_t n, int64_t group, void *y, int y_bf16,
                      int nthreads) {
    const int64_t blocks = k / BLOCK_K, tiles = n / TILE_N;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((m_rows * k + 63) / 64 * 64));
    float *xs = (float *)malloc((size_t)(m_rows * blocks) * sizeof(float));
    float *xsum = (float *)malloc((size_t)(m_rows * blocks) * sizeof(float));
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return -1;
    }
    quantize_blocks(x, x_bf16, m_rows, k, xq, xs, xsum, NULL);
    /* rows go in passes of at most ROWS, as even as possible (33 rows: 11 + 11 + 11, 17 rows: 8 + 9) */
    const int64_t passes = (m_rows + ROWS - 1) / ROWS;

#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t p = 0, m0 = 0; p < passes; p++) {
            const int64_t rows = (m_rows - m0) / (passes - p);
            tile_pass[scales_f32 != 0][rows](t, m0, k, xq, xs, xsum, wq, ws, wo, bias, n, group, y, y_bf16, m_rows,
                                             p == 0);
            m0 += rows;
        }
    }
    free(xq), free(xs), free(xsum);
    return 0;
}
