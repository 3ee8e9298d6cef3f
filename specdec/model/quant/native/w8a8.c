/* w8a8 GEMM for 1..many rows on x86-64 with AVX-512 VNNI: int8 weights (symmetric, one fp32 scale per output
 * channel) times int8 activations (symmetric, one scale per row), fp32 out. The arithmetic is the one of
 * specdec/model/quant/cpu_paths.py's w8a8_reference (and of oneDNN's int8 GEMM, which this replaces where it is
 * built), bit for bit:
 *
 *   per row m:     xs[m] = max|x[m, :]| / 127  (1 for a zero row; NaN when the row holds a NaN or an infinity)
 *                  xq[m,k] = round_half_even(x[m,k] / xs[m]) clamped to [-127, 127]
 *   per output n:  acc = sum_k q[n,k] * xq[m,k]       (exact in int32 for K < 66000)
 *                  y[m,n] = (float(acc) * w_scale[n]) * xs[m]   (+ bias[n]; then one rounding to bf16 if asked)
 *
 * vpdpbusd multiplies unsigned by signed bytes, so the weights are stored shifted, u = q + 128 in [1, 255], and the
 * activations broadcast as signed bytes: sum_k u * xq = acc + 128 * sum_k xq, and the row's sum is subtracted
 * (integers: exact). Every row's arithmetic is the same whatever the number of rows in the call.
 *
 * Weight layout (prepared by native.py's pack_w8a8), for N % 16 == 0 and K % 16 == 0:
 *   wu  uint8 [N/16, K/4, 16, 4]: tile t, chunk c, lane, b = q[16t + lane, 4c + b] + 128
 *   ws  fp32 [N]
 * Activations are quantised into chunk-major order, xq [K/4, M, 4], so that the rows of a pass sit at constant
 * offsets from one pointer (see w4a8.c). Memory-bound at one row; each further row costs one vpdpbusd per 64
 * weights, so a 5-row window reads the weight once and costs little more than a decode.
 */
#include "common.h"

static inline float load_x(const void *x, int x_bf16, int64_t i) {
    if (!x_bf16) return ((const float *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* xq chunk-major [K/4, M, 4]; xs [M]; xsum [M] = sum of the row's xq */
static void quantize_rows_w8(const void *x, int x_bf16, int64_t m_rows, int64_t k, int8_t *xq, float *xs,
                             int32_t *xsum) {
    for (int64_t m = 0; m < m_rows; m++) {
        float amax = 0.0f;
        int finite = 1;
        for (int64_t i = 0; i < k; i++) {
            const float a = fabsf(load_x(x, x_bf16, m * k + i));
            finite &= a <= INFINITY && !isinf(a); /* false for NaN and for an infinity */
            amax = a > amax ? a : amax;
        }
        const float s = !finite ? NAN : amax > 0.0f ? amax / 127.0f : 1.0f;
        int32_t isum = 0;
        for (int64_t i = 0; i < k; i++) {
            float v = nearbyintf(load_x(x, x_bf16, m * k + i) / s);
            v = finite ? (v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v)) : 0.0f;
            xq[((i / 4) * m_rows + m) * 4 + i % 4] = (int8_t)v;
            isum += (int32_t)v;
        }
        xs[m] = s;
        xsum[m] = isum;
    }
}

/* Rows m0..m0+R-1 of tile t in one pass over the tile's weights. P int32 chains per row hide vpdpbusd's latency
 * when there are few rows (P * R >= 4); integer sums are exact, so the split does not change the result. */
static inline __attribute__((always_inline)) void tile_rows_w8(const int R, int64_t t, int64_t m0, int64_t k,
                                                               const int8_t *xq, const float *xs,
                                                               const int32_t *xsum, const uint8_t *wu,
                                                               const float *ws, const float *bias, int64_t n,
                                                               void *y, int y_bf16, int64_t m_rows, int prefetch) {
    const int P = R >= 4 ? 1 : R == 1 ? 4 : 2;
    const int64_t chunks = k / 4;
    const uint8_t *wt = wu + t * chunks * 64;
    const int32_a *x4 = (const int32_a *)xq + m0;
    __m512i acc[ROWS][4]; /* fixed bounds (R and P are constants here): a variable-length array lived in memory */
#pragma GCC unroll 64
    for (int i = 0; i < R * P; i++) acc[i / P][i % P] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t c = 0; c < chunks; c += P) {
        if (prefetch)
            for (int p = 0; p < P; p++) _mm_prefetch((const char *)(wt + (c + p) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
        __m512i w[4];
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) w[p] = _mm512_loadu_si512((const void *)(wt + (c + p) * 64));
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) acc[r][p] = dpbusd_bcst(acc[r][p], w[p], x4 + (c + p) * m_rows + r);
    }
    const __m512 scale = _mm512_loadu_ps(ws + t * TILE_N);
    const __m512 bias_v = bias ? _mm512_loadu_ps(bias + t * TILE_N) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        __m512i total = acc[r][0];
        for (int p = 1; p < P; p++) total = _mm512_add_epi32(total, acc[r][p]);
        total = _mm512_sub_epi32(total, _mm512_set1_epi32(128 * xsum[m0 + r]));
        __m512 out = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(total), scale), _mm512_set1_ps(xs[m0 + r]));
        if (bias) out = _mm512_add_ps(out, bias_v);
        store_row(y, y_bf16, (m0 + r) * n + t * TILE_N, out);
    }
}

#define TILE_ROWS_W8(R)                                                                                              \
    static void tile_rows_w8_##R(int64_t t, int64_t m0, int64_t k, const int8_t *xq, const float *xs,             \
                                 const int32_t *xsum, const uint8_t *wu, const float *ws, const float *bias,       \
                                 int64_t n, void *y, int y_bf16, int64_t m_rows, int prefetch) {                   \
        tile_rows_w8(R, t, m0, k, xq, xs, xsum, wu, ws, bias, n, y, y_bf16, m_rows, prefetch);                     \
    }
TILE_ROWS_W8(1) TILE_ROWS_W8(2) TILE_ROWS_W8(3) TILE_ROWS_W8(4) TILE_ROWS_W8(5) TILE_ROWS_W8(6) TILE_ROWS_W8(7)
TILE_ROWS_W8(8) TILE_ROWS_W8(9) TILE_ROWS_W8(10) TILE_ROWS_W8(11) TILE_ROWS_W8(12) TILE_ROWS_W8(13)
TILE_ROWS_W8(14) TILE_ROWS_W8(15) TILE_ROWS_W8(16)
#undef TILE_ROWS_W8
typedef void tile_pass_w8_fn(int64_t, int64_t, int64_t, const int8_t *, const float *, const int32_t *,
                             const uint8_t *, const float *, const float *, int64_t, void *, int, int64_t, int);
static tile_pass_w8_fn *const tile_pass_w8[ROWS + 1] = {
    NULL,            tile_rows_w8_1,  tile_rows_w8_2,  tile_rows_w8_3,  tile_rows_w8_4,  tile_rows_w8_5,
    tile_rows_w8_6,  tile_rows_w8_7,  tile_rows_w8_8,  tile_rows_w8_9,  tile_rows_w8_10, tile_rows_w8_11,
    tile_rows_w8_12, tile_rows_w8_13, tile_rows_w8_14, tile_rows_w8_15, tile_rows_w8_16,
};

/* y [M, N] = w8a8(x [M, K]) (+ bias [N] fp32), x and y fp32 or bf16. Returns 0, or -1 when the scratch could not
 * be allocated. */
int specdec_w8a8_gemm(const void *x, int x_bf16, int64_t m_rows, int64_t k, const uint8_t *wu, const float *ws,
                      const float *bias, int64_t n, void *y, int y_bf16, int nthreads) {
    const int64_t tiles = n / TILE_N;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((m_rows * k + 63) / 64 * 64));
    float *xs = (float *)malloc((size_t)m_rows * sizeof(float));
    int32_t *xsum = (int32_t *)malloc((size_t)m_rows * sizeof(int32_t));
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return -1;
    }
    quantize_rows_w8(x, x_bf16, m_rows, k, xq, xs, xsum);
    const int64_t passes = (m_rows + ROWS - 1) / ROWS;

#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t p = 0, m0 = 0; p < passes; p++) {
            const int64_t rows = (m_rows - m0) / (passes - p);
            tile_pass_w8[rows](t, m0, k, xq, xs, xsum, wu, ws, bias, n, y, y_bf16, m_rows, p == 0);
            m0 += rows;
        }
    }
    free(xq), free(xs), free(xsum);
    return 0;
}
