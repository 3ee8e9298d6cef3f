/* w8g GEMM for 1..many rows on x86-64 with AVX-512 VNNI: int8 weights in groups of 16 or of a multiple of 32
 * inputs, one fp32 scale per group and, for groups of 32 or more, an optional fp32 offset (GGUF's Q8_0, Q5_0 and
 * Q6_K blocks as stored; Q5_1 and Q5_K with their offsets), times int8 activations
 * (symmetric, per row and block of 32 inputs: act_blocks.h, w4a8's quantisation), fp32 out.
 *
 * The arithmetic, which native.py's w8g_reference repeats in torch:
 *
 *   per row m and block b of 32 inputs: xs[m,b], xq[m,k] as act_blocks.h says
 *   per output n:  acc = 0; for each piece p of each block b, in order (a piece is the block for a group of 32 or
 *                  more, each half of the block for a group of 16; g = the group holding p):
 *                      dot = sum_{k in p} q[n,k] * xq[m,k]                  (exact int32)
 *                      acc = fma(float(dot), s[n,g] * xs[m,b], acc)
 *                      acc = fma(o[n,g], xsum[m,b], acc)                    (with offsets: xsum as act_blocks.h)
 *                  y[m,n] = acc (+ bias[n]; then one rounding to bf16 where asked)
 *
 * Every row's arithmetic is the same whatever the number of rows in the call: a row's output does not depend on
 * the others, bit for bit.
 *
 * vpdpbusd multiplies unsigned by signed bytes, so the weights are stored shifted, u = q + 128 in [0, 255], and the
 * shift is taken out of each piece's dot exactly: dot = sum u * xq - 128 * (sum of the piece's xq) (integers).
 *
 * Weight layout (prepared by native.py's pack_w8g), for N % 16 == 0 and K % 32 == 0:
 *   wu  uint8 [N/16, K/4, 16, 4]: tile t, chunk c, lane, b = q[16t + lane, 4c + b] + 128 (w8a8.c's layout)
 *   ws  fp32 [N/16, G, 16]: the scale of group g for the tile's 16 outputs; wo (or NULL) the same for offsets
 * A block is 8 chunks (8 x 64 bytes); up to 16 rows share one pass over a tile, as in w4a8.c.
 */
#include "act_blocks.h"

/* Rows m0..m0+R-1 of tile t in one pass over the tile's weights. R, HALVES (2: groups of 16, 1: groups of a
 * multiple of 32) and OFFS (offsets, with HALVES 1 only) are constants in each instance, so the loops unroll and
 * the row pointers are constant offsets. */
static inline __attribute__((always_inline)) void tile_rows_g(const int R, const int HALVES, const int OFFS,
                                                              int64_t t, int64_t m0, int64_t k, const int8_t *xq,
                                                              const float *xs, const float *xsum,
                                                              const int32_t *isum16, const uint8_t *wu,
                                                              const float *ws, const float *wo, const float *bias,
                                                              int64_t n, int64_t group, void *y, int y_bf16,
                                                              int64_t m_rows, int prefetch) {
    const int64_t blocks = k / BLOCK_K, groups = k / group;
    const int64_t blocks_per_group = HALVES == 2 ? 1 : group / BLOCK_K;
    const uint8_t *wt = wu + t * (k / 4) * 64;
    const float *wst = ws + t * groups * TILE_N;
    const float *wot = OFFS ? wo + t * groups * TILE_N : NULL;
    __m512 acc[ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (prefetch)
            for (int i = 0; i < 8; i++) _mm_prefetch((const char *)(wt + (b * 8 + i) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
        __m512i w[8]; /* w[i]: inputs 32b+4i..+3 of the tile's 16 outputs, shifted to unsigned */
        for (int i = 0; i < 8; i++) w[i] = _mm512_loadu_si512((const void *)(wt + (b * 8 + i) * 64));
        __m512 s[2], o = _mm512_setzero_ps();
        if (HALVES == 2) {
            s[0] = _mm512_loadu_ps(wst + (2 * b) * TILE_N);
            s[1] = _mm512_loadu_ps(wst + (2 * b + 1) * TILE_N);
        } else {
            s[0] = _mm512_loadu_ps(wst + (b / blocks_per_group) * TILE_N);
            if (OFFS) o = _mm512_loadu_ps(wot + (b / blocks_per_group) * TILE_N);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const int64_t at = b * m_rows + m0 + r;
            const int32_a *x4 = (const int32_a *)(xq + at * BLOCK_K); /* dword j: inputs 4j..4j+3 */
            const __m512 xsc = _mm512_set1_ps(xs[at]);
            __m512i p0 = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                p0 = dpbusd_bcst(p0, w[i], x4 + i);
                p1 = dpbusd_bcst(p1, w[i + 4], x4 + i + 4);
            }
            const int32_t sum0 = isum16[(2 * b) * m_rows + m0 + r], sum1 = isum16[(2 * b + 1) * m_rows + m0 + r];
            if (HALVES == 2) {
                const __m512i d0 = _mm512_sub_epi32(p0, _mm512_set1_epi32(128 * sum0));
                const __m512i d1 = _mm512_sub_epi32(p1, _mm512_set1_epi32(128 * sum1));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(s[0], xsc), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(s[1], xsc), acc[r]);
            } else {
                const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(p0, p1), _mm512_set1_epi32(128 * (sum0 + sum1)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s[0], xsc), acc[r]);
                if (OFFS) acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[at]), acc[r]);
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

#define TILE_ROWS_G(R, H, O)                                                                                         \
    static void tile_rows_g##H##O##_##R(int64_t t, int64_t m0, int64_t k, const int8_t *xq, const float *xs,        \
                                        const float *xsum, const int32_t *isum16, const uint8_t *wu,                \
                                        const float *ws, const float *wo, const float *bias, int64_t n,             \
                                        int64_t group, void *y, int y_bf16, int64_t m_rows, int prefetch) {         \
        tile_rows_g(R, H, O, t, m0, k, xq, xs, xsum, isum16, wu, ws, wo, bias, n, group, y, y_bf16, m_rows,          \
                    prefetch);                                                                                       \
    }
#define TILE_ROWS_ALL(R) TILE_ROWS_G(R, 1, 0) TILE_ROWS_G(R, 2, 0) TILE_ROWS_G(R, 1, 1)
TILE_ROWS_ALL(1) TILE_ROWS_ALL(2) TILE_ROWS_ALL(3) TILE_ROWS_ALL(4) TILE_ROWS_ALL(5) TILE_ROWS_ALL(6)
TILE_ROWS_ALL(7) TILE_ROWS_ALL(8) TILE_ROWS_ALL(9) TILE_ROWS_ALL(10) TILE_ROWS_ALL(11) TILE_ROWS_ALL(12)
TILE_ROWS_ALL(13) TILE_ROWS_ALL(14) TILE_ROWS_ALL(15) TILE_ROWS_ALL(16)
#undef TILE_ROWS_ALL
#undef TILE_ROWS_G
typedef void tile_pass_g_fn(int64_t, int64_t, int64_t, const int8_t *, const float *, const float *, const int32_t *,
                            const uint8_t *, const float *, const float *, const float *, int64_t, int64_t, void *,
                            int, int64_t, int);
#define PASSES(H, O)                                                                                                  \
    {NULL, tile_rows_g##H##O##_1, tile_rows_g##H##O##_2, tile_rows_g##H##O##_3, tile_rows_g##H##O##_4,              \
     tile_rows_g##H##O##_5, tile_rows_g##H##O##_6, tile_rows_g##H##O##_7, tile_rows_g##H##O##_8,                    \
     tile_rows_g##H##O##_9, tile_rows_g##H##O##_10, tile_rows_g##H##O##_11, tile_rows_g##H##O##_12,                 \
     tile_rows_g##H##O##_13, tile_rows_g##H##O##_14, tile_rows_g##H##O##_15, tile_rows_g##H##O##_16}
/* [0]: groups of 32k, [1]: groups of 16, [2]: groups of 32k with offsets */
static tile_pass_g_fn *const tile_pass_g[3][ROWS + 1] = {PASSES(1, 0), PASSES(2, 0), PASSES(1, 1)};
#undef PASSES

/* y [M, N] = w8g(x [M, K]) (+ bias [N] fp32), x and y fp32 or bf16. group: 16 or a multiple of 32 dividing K; wo:
 * the offsets or NULL (offsets need a group of 32k). Returns 0, or -1 when the scratch buffers could not be
 * allocated (or offsets come with a group of 16). */
int specdec_w8g_gemm(const void *x, int x_bf16, int64_t m_rows, int64_t k, const uint8_t *wu, const float *ws,
                     const float *wo, const float *bias, int64_t n, int64_t group, void *y, int y_bf16,
                     int nthreads) {
    if (wo && group == 16) return -1;
    const int64_t blocks = k / BLOCK_K, tiles = n / TILE_N;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((m_rows * k + 63) / 64 * 64));
    float *xs = (float *)malloc((size_t)(m_rows * blocks) * sizeof(float));
    float *xsum = wo ? (float *)malloc((size_t)(m_rows * blocks) * sizeof(float)) : NULL;
    int32_t *isum16 = (int32_t *)malloc((size_t)(m_rows * blocks * 2) * sizeof(int32_t));
    if (!xq || !xs || !isum16 || (wo && !xsum)) {
        free(xq), free(xs), free(xsum), free(isum16);
        return -1;
    }
    quantize_blocks(x, x_bf16, m_rows, k, xq, xs, xsum, isum16);
    const int kind = wo ? 2 : group == 16 ? 1 : 0;
    const int64_t passes = (m_rows + ROWS - 1) / ROWS;

#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t p = 0, m0 = 0; p < passes; p++) {
            const int64_t rows = (m_rows - m0) / (passes - p);
            tile_pass_g[kind][rows](t, m0, k, xq, xs, xsum, isum16, wu, ws, wo, bias, n, group, y, y_bf16, m_rows,
                                    p == 0);
            m0 += rows;
        }
    }
    free(xq), free(xs), free(xsum), free(isum16);
    return 0;
}
