/* w4a8 GEMM for 1..many rows on x86-64 with AVX-512 VNNI: int4 weights (asymmetric, per group of >= 32 inputs,
 * fp16 scale and offset) times int8 activations (symmetric, per row and block of 32 inputs), fp32 out.
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
 *   ws, wo  fp16 [N/16, G, 16]: scale and offset of group g for the tile's 16 outputs
 * One 64-byte load gives 8 inputs x 16 outputs; vpdpbusd multiplies the unsigned nibbles by 4 broadcast signed
 * activation bytes and adds 4 products into each output's int32 lane.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_N 16
#define BLOCK_K 32
#define ROWS 16 /* rows per pass over a tile's weights: their accumulators stay in registers / L1 */

typedef int32_t int32_a __attribute__((may_alias, aligned(4)));

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16, rounding to nearest even as torch does (NaN stays a quiet NaN) */
static inline __m256i float_to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
}

static void quantize_rows(const void *x, int x_bf16, int64_t m_rows, int64_t k, int8_t *xq, float *xs, float *xsum) {
    int64_t blocks = k / BLOCK_K;
    float xb[BLOCK_K];
    for (int64_t m = 0; m < m_rows; m++) {
        for (int64_t b = 0; b < blocks; b++) {
            for (int i = 0; i < BLOCK_K; i++)
                xb[i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[m * k + b * BLOCK_K + i])
                               : ((const float *)x)[m * k + b * BLOCK_K + i];
            float amax = 0.0f;
            for (int i = 0; i < BLOCK_K; i++) {
                float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
            }
            float s = amax > 0.0f ? amax / 127.0f : 1.0f;
            int32_t isum = 0;
            int8_t *qb = xq + m * k + b * BLOCK_K;
            for (int i = 0; i < BLOCK_K; i++) {
                float v = nearbyintf(xb[i] / s);
                v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
                qb[i] = (int8_t)v;
                isum += (int32_t)v;
            }
            xs[m * blocks + b] = s;
            xsum[m * blocks + b] = s * (float)isum;
        }
    }
}

/* y [M, N] = w4a8(x [M, K]) (+ bias [N] fp32, added to the fp32 result), x and y fp32 or bf16 (x_bf16, y_bf16:
 * y rounded once from fp32, to nearest even). group: the weight group size (a multiple of 32 dividing K).
 * Returns 0, or -1 when the scratch buffers could not be allocated. */
int specdec_w4a8_gemm(const void *x, int x_bf16, int64_t m_rows, int64_t k, const uint8_t *wq, const uint16_t *ws,
                      const uint16_t *wo, const float *bias, int64_t n, int64_t group, void *y, int y_bf16,
                      int nthreads) {
    const int64_t blocks = k / BLOCK_K, groups = k / group, tiles = n / TILE_N, chunks = k / 8;
    const int64_t blocks_per_group = group / BLOCK_K;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((m_rows * k + 63) / 64 * 64));
    float *xs = (float *)malloc((size_t)(m_rows * blocks) * sizeof(float));
    float *xsum = (float *)malloc((size_t)(m_rows * blocks) * sizeof(float));
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return -1;
    }
    quantize_rows(x, x_bf16, m_rows, k, xq, xs, xsum);
    const __m512i nibble = _mm512_set1_epi8(0x0F);

#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *wt = wq + t * chunks * 64;
        const uint16_t *wst = ws + t * groups * TILE_N, *wot = wo + t * groups * TILE_N;
        for (int64_t m0 = 0; m0 < m_rows; m0 += ROWS) {
            const int64_t rows = m_rows - m0 < ROWS ? m_rows - m0 : ROWS;
            __m512 acc[ROWS];
            for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t g = b / blocks_per_group;
                const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wst + g * TILE_N)));
                const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wot + g * TILE_N)));
                __m512i w[8]; /* w[2i]: inputs 32b+8i..+3, w[2i+1]: inputs 32b+8i+4..+7, as unsigned bytes */
                for (int i = 0; i < 4; i++) {
                    __m512i v = _mm512_loadu_si512((const void *)(wt + (b * 4 + i) * 64));
                    w[2 * i] = _mm512_and_si512(v, nibble);
                    w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                }
                for (int r = 0; r < rows; r++) {
                    const int8_t *xr = xq + (m0 + r) * k + b * BLOCK_K;
                    /* four independent int32 chains (vpdpbusd's latency, not its throughput, bounds one chain);
                     * integer sums are exact, so how they are split does not change the result */
                    const int32_a *x4 = (const int32_a *)xr; /* 4 activation bytes per dword, broadcast */
                    __m512i part[4];
                    for (int i = 0; i < 4; i++) {
                        part[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i], _mm512_set1_epi32(x4[i]));
                        part[i] = _mm512_dpbusd_epi32(part[i], w[i + 4], _mm512_set1_epi32(x4[i + 4]));
                    }
                    const __m512i dot = _mm512_add_epi32(_mm512_add_epi32(part[0], part[1]),
                                                         _mm512_add_epi32(part[2], part[3]));
                    const float xsc = xs[(m0 + r) * blocks + b], xsm = xsum[(m0 + r) * blocks + b];
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(xsc)), acc[r]);
                    acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsm), acc[r]);
                }
            }
            const __m512 bias_v = bias ? _mm512_loadu_ps(bias + t * TILE_N) : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++) {
                const __m512 out = bias ? _mm512_add_ps(acc[r], bias_v) : acc[r];
                const int64_t at = (m0 + r) * n + t * TILE_N;
                if (y_bf16)
                    _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), float_to_bf16(out));
                else
                    _mm512_storeu_ps((float *)y + at, out);
            }
        }
    }
    free(xq), free(xs), free(xsum);
    return 0;
}
