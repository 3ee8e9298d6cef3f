/* Row-invariant paged attention on x86-64 with AVX-512: each query row's output is computed by the same sequence of
 * operations whatever the other rows of the call are - a decode, a row of a verification window, a row of a tree
 * window, a row of a prefill chunk, or a row in a batch of 64 - and whatever the thread count. Built at first use
 * by kernels/cpu/build.py and called through ctypes (kernels/cpu/attention.py, whose attention_invariant_reference
 * repeats the arithmetic in torch).
 *
 * The arithmetic, per query row and query head h (kv head h / (Hq / Hkv)):
 *   keys = the positions the row sees, in increasing position order (causal: 0 .. its own position; a tree row: the
 *          context before the tree window, then the window keys its mask row admits) - a compact list, so a tree
 *          node's ancestors come right after the context, exactly as they did when each was decoded in turn;
 *   s[j] = sum16(q * k_j) * scale, where the dot is: acc16 = 0; for each 16-wide chunk d of the head
 *          dimension in order, acc16 = fma(q[d], k_j[d], acc16); then sum16 = _mm512_reduce_add_ps(acc16) (one fixed
 *          tree of additions);
 *   m = max_j s[j];  p[j] = exp16(s[j] - m) (below: one polynomial, the same operations in every lane);
 *   l = 0, o = 0;  for j in order: l = l + p[j]; o = fma(p[j], v_j, o)  (per lane of the head dimension)
 *   out = o / l, rounded once to the output dtype.
 * q, k and v are read as bf16 or fp32 and widened to fp32 (exact). Nothing depends on how many rows, heads or
 * sequences share the call, or on which thread computes the row. Tree rows see exactly the keys their ancestors'
 * decodes saw, in the same order, so a tree window's row equals the decode of that path.
 */
#include "bf16.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

/* exp(x) for x <= 0, 16 lanes, each lane by the same operations (so a score's p does not depend on its lane):
 * x = n ln2 + r with n = round(x / ln2) and |r| <= ln2 / 2 (ln2 in two parts), exp(r) by its degree-6 Taylor
 * polynomial (Horner, fused multiply-adds; relative error below 2e-7), times 2^n by vscalefps (exact, gradual
 * underflow to 0). Inputs below -104 give 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-104.0f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.0f / 720.0f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(y, n));
}

/* The cache slots row t of sequence b sees, in position order; returns how many. */
static int64_t visible_slots(int64_t b, int64_t i, const int32_t *block_tables, int64_t max_blocks,
                             const int32_t *seq_lens, const int32_t *cu_q_lens, const uint8_t *tree_mask,
                             const int32_t *tree_indptr, int64_t block_size, int64_t *slots) {
    const int64_t ql = cu_q_lens[b + 1] - cu_q_lens[b], ctx = seq_lens[b];
    const int32_t *table = block_tables + b * max_blocks;
    int64_t n = 0;
#define SLOT(pos) ((int64_t)table[(pos) / block_size] * block_size + (pos) % block_size)
    if (tree_mask && tree_indptr[b + 1] > tree_indptr[b]) {
        const int64_t w = (tree_indptr[b + 1] - tree_indptr[b]) / ql;
        const uint8_t *row = tree_mask + tree_indptr[b] + i * w;
        for (int64_t pos = 0; pos < ctx - w; pos++) slots[n++] = SLOT(pos);
        for (int64_t j = 0; j < w; j++)
            if (row[j]) slots[n++] = SLOT(ctx - w + j);
    } else {
        const int64_t last = ctx - ql + i;
        for (int64_t pos = 0; pos <= last; pos++) slots[n++] = SLOT(pos);
    }
#undef SLOT
    return n;
}

/* out [T, Hq, D] = attention of q [T, Hq, D] over the paged caches [num_blocks, block_size, Hkv, D]. q / out share a
 * dtype (bf16 when io_bf16, else fp32), the caches theirs (cache_bf16). D % 16 == 0, D <= 256, Hq / Hkv <= 16.
 * Returns 0, or -1 when scratch could not be allocated. */
int specdec_paged_attention(const void *q, int64_t num_tokens, int64_t hq, int64_t hkv, int64_t d, int io_bf16,
                            const void *k_cache, const void *v_cache, int cache_bf16, int64_t block_size,
                            const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                            const int32_t *cu_q_lens, int64_t num_seqs, const uint8_t *tree_mask,
                            const int32_t *tree_indptr, float scale, void *out, int nthreads) {
    const int64_t group = hq / hkv, chunks = d / 16;
    int64_t max_ctx = 1;
    for (int64_t b = 0; b < num_seqs; b++) max_ctx = seq_lens[b] > max_ctx ? seq_lens[b] : max_ctx;
    int64_t *seq_of_row = (int64_t *)malloc((size_t)(num_tokens > 0 ? num_tokens : 1) * sizeof(int64_t));
    if (!seq_of_row) return -1;
    for (int64_t b = 0; b < num_seqs; b++)
        for (int64_t t = cu_q_lens[b]; t < cu_q_lens[b + 1]; t++) seq_of_row[t] = b;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t *slots = (int64_t *)malloc((size_t)max_ctx * sizeof(int64_t));
        float *scores = (float *)malloc((size_t)(max_ctx * group) * sizeof(float));
        if (!slots || !scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_tokens * hkv; item++) {
            if (!slots || !scores) continue;
            const int64_t t = item / hkv, g = item % hkv, b = seq_of_row[t];
            const int64_t n = visible_slots(b, t - cu_q_lens[b], block_tables, max_blocks, seq_lens, cu_q_lens,
                                            tree_mask, tree_indptr, block_size, slots);
            __m512 qv[MAX_GROUP][MAX_HEAD_DIM / 16];
            for (int64_t h = 0; h < group; h++)
                for (int64_t c = 0; c < chunks; c++) qv[h][c] = load16(q, io_bf16, (t * hq + g * group + h) * d + 16 * c);
            float m[MAX_GROUP];
            for (int64_t h = 0; h < group; h++) m[h] = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                const int64_t at = (slots[j] * hkv + g) * d;
                __m512 kv[MAX_HEAD_DIM / 16];
                for (int64_t c = 0; c < chunks; c++) kv[c] = load16(k_cache, cache_bf16, at + 16 * c);
                for (int64_t h = 0; h < group; h++) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t c = 0; c < chunks; c++) acc = _mm512_fmadd_ps(qv[h][c], kv[c], acc);
                    const float s = _mm512_reduce_add_ps(acc) * scale;
                    scores[h * n + j] = s;
                    m[h] = s > m[h] ? s : m[h];
                }
            }
            __m512 o[MAX_GROUP][MAX_HEAD_DIM / 16];
            float l[MAX_GROUP];
            for (int64_t h = 0; h < group; h++) {
                l[h] = 0.0f;
                for (int64_t c = 0; c < chunks; c++) o[h][c] = _mm512_setzero_ps();
            }
            for (int64_t h = 0; h < group; h++) { /* scores -> probabilities, in place, 16 at a time */
                const __m512 mv = _mm512_set1_ps(m[h]);
                for (int64_t j = 0; j < n; j += 16) {
                    const __mmask16 lanes = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
                    float *s = scores + h * n + j;
                    _mm512_mask_storeu_ps(s, lanes, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s), mv)));
                }
            }
            for (int64_t j = 0; j < n; j++) {
                const int64_t at = (slots[j] * hkv + g) * d;
                __m512 vv[MAX_HEAD_DIM / 16];
                for (int64_t c = 0; c < chunks; c++) vv[c] = load16(v_cache, cache_bf16, at + 16 * c);
                for (int64_t h = 0; h < group; h++) {
                    const float p = scores[h * n + j];
                    l[h] = l[h] + p;
                    const __m512 pv = _mm512_set1_ps(p);
                    for (int64_t c = 0; c < chunks; c++) o[h][c] = _mm512_fmadd_ps(pv, vv[c], o[h][c]);
                }
            }
            for (int64_t h = 0; h < group; h++) {
                const __m512 lv = _mm512_set1_ps(l[h]);
                const int64_t at = (t * hq + g * group + h) * d;
                for (int64_t c = 0; c < chunks; c++) {
                    const __m512 r = _mm512_div_ps(o[h][c], lv);
                    if (io_bf16)
                        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + 16 * c), to_bf16(r));
                    else
                        _mm512_storeu_ps((float *)out + at + 16 * c, r);
                }
            }
        }
        free(slots);
        free(scores);
    }
    free(seq_of_row);
    return failed ? -1 : 0;
}
