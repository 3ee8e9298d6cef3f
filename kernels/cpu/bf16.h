/* What the batch-invariant CPU kernels (gemm_amx.c, gemm_bf16.c, attention.c) share: bf16 <-> fp32 on 16 lanes. */
#ifndef SPECDEC_CPU_BF16_H
#define SPECDEC_CPU_BF16_H

#include <immintrin.h>
#include <stdint.h>

/* fp32 -> bf16, rounding to nearest even as torch does (NaN stays a quiet NaN) */
static inline __m256i to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 values at base + at, bf16 (widened exactly) or fp32 */
static inline __m512 load16(const void *base, int bf16, int64_t at) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at))), 16));
    return _mm512_loadu_ps((const float *)base + at);
}

#endif
