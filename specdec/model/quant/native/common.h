/* What specdec's native CPU kernels (w4a8.c, w8a8.c) share: tile sizes, the prefetch distance, vpdpbusd with an
 * embedded activation broadcast, and the fp32 -> bf16 rounding of their outputs. */
#ifndef SPECDEC_NATIVE_COMMON_H
#define SPECDEC_NATIVE_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_N 16 /* outputs per tile: one zmm of fp32 / int32 lanes */
#define ROWS 16   /* rows per pass over a tile's weights: each count up to it has its own unrolled pass */
/* Software prefetch distance into the weight stream. The hardware prefetcher alone did not overlap the stream with
 * the compute of several rows (time was memory + compute); 2-4 KiB ahead did, 8 KiB and more was no better. */
#define PREFETCH_BYTES 4096

typedef int32_t int32_a __attribute__((may_alias, aligned(4)));

/* fp32 -> bf16, rounding to nearest even as torch does (NaN stays a quiet NaN) */
static inline __m256i float_to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
}

/* acc + the dot of 4 unsigned weight bytes per int32 lane of w with the 4 signed activation bytes at x, broadcast
 * to every lane by vpdpbusd's embedded {1to16} (gcc does not fold _mm512_set1_epi32 into it: a separate
 * vpbroadcastd each time) */
static inline __m512i dpbusd_bcst(__m512i acc, __m512i w, const int32_a *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* y[at..at+15] = out, as fp32 or (y_bf16) rounded to bf16 */
static inline void store_row(void *y, int y_bf16, int64_t at, __m512 out) {
    if (y_bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), float_to_bf16(out));
    else
        _mm512_storeu_ps((float *)y + at, out);
}

#endif
