/* The activation quantisation of w4a8.c and w8g.c: symmetric int8 per row and block of 32 inputs.
 *
 *   xs[m,b] = max|x[m, b*32 : b*32+32]| / 127  (1 for a zero block; NaN when the block holds a NaN or an infinity)
 *   xq[m,k] = round_half_even(x[m,k] / xs[m,b]) clamped to [-127, 127]
 *   xsum[m,b] = xs[m,b] * (sum of xq over the block)      (w4a8's offset term; skipped where xsum is NULL)
 *   isum16[m,h] = sum of xq over inputs 16h..16h+15        (w8g's shift correction; skipped where NULL)
 */
#ifndef SPECDEC_NATIVE_ACT_BLOCKS_H
#define SPECDEC_NATIVE_ACT_BLOCKS_H

#include "common.h"

#define BLOCK_K 32 /* inputs per activation block (one int8 scale per row and block) */

/* The activation quantisation of the header comment, 16 lanes at a time (a scalar loop here cost a third of an
 * in-cache 16-row call). Each step is the IEEE operation of the scalar arithmetic, so the results are the same bit
 * for bit: NaN inputs are skipped by the max (as `a > amax ? a : amax` does) and a block holding a NaN or an
 * infinity gets a NaN scale (below); the round follows the current rounding mode as nearbyintf does.
 * Outputs are block-major (xq [K/32, M, 32], xs and xsum [K/32, M]; isum16 [K/16, M], the integer sum of each 16
 * inputs, where asked) so that the rows of a pass lie at constant
 * offsets from one pointer: row-major, 16 rows needed 48 pointers and gcc spilled them in the inner loop. */
static __attribute__((unused)) void quantize_blocks(const void *x, int x_bf16, int64_t m_rows, int64_t k, int8_t *xq,
                                                    float *xs, float *xsum, int32_t *isum16) {
    const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    const int64_t blocks = k / BLOCK_K;
    for (int64_t m = 0; m < m_rows; m++) {
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = m * k + b * BLOCK_K, out = (b * m_rows + m) * BLOCK_K;
            __m512 v[2];
            for (int h = 0; h < 2; h++)
                v[h] = x_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                    _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at + 16 * h))), 16))
                              : _mm512_loadu_ps((const float *)x + at + 16 * h);
            __m512 amax_v = _mm512_setzero_ps();
            for (int h = 0; h < 2; h++)
                amax_v = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v[h]), abs_mask)),
                                       amax_v);
            const float amax = _mm512_reduce_max_ps(amax_v);
            /* a NaN or an infinity in the block makes its scale NaN, so the row's outputs are NaN - as the torch
             * reference's are - and the engine's non-finite check sees them (the max above skips NaN, and the
             * clamp and int conversion would turn it into finite garbage) */
            const __mmask16 nan = _mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) |
                                  _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q);
            const float s = (nan || isinf(amax)) ? NAN : amax > 0.0f ? amax / 127.0f : 1.0f;
            __m512i isum = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v[h], _mm512_set1_ps(s)),
                                                _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC); /* nearbyintf */
                q = _mm512_max_ps(lo, _mm512_min_ps(hi, q));
                const __m512i qi = _mm512_cvttps_epi32(q);
                _mm_storeu_si128((__m128i *)(xq + out + 16 * h), _mm512_cvtepi32_epi8(qi));
                if (isum16) isum16[(2 * b + h) * m_rows + m] = _mm512_reduce_add_epi32(qi);
                isum = _mm512_add_epi32(isum, qi);
            }
            xs[b * m_rows + m] = s;
            if (xsum) xsum[b * m_rows + m] = s * (float)_mm512_reduce_add_epi32(isum);
        }
    }
}

#endif
