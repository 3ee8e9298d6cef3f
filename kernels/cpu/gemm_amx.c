/* Row-invariant bf16 GEMM on x86-64 with AMX-BF16: y [M, N] = x [M, K] @ W [N, K]^T, bf16 inputs, fp32
 * accumulation, fp32 or bf16 out. Built at first use by kernels/cpu/build.py and called through ctypes
 * (kernels/cpu/gemm.py).
 *
 * The arithmetic: per row m and output n, one fp32 accumulator starting at +0, fed by tdpbf16ps one chunk of 32
 * inputs at a time, chunks in order (K padded with zeros to a multiple of 32); then + bias[n]; then one rounding to
 * bf16 if asked. Within a chunk the instruction's own order of additions applies (what gemm.py's reference checks).
 * An AMX tile multiply computes each row of its result from that row of A alone, so the sequence for (m, n) is the
 * same whatever the number of rows in the call - 1 (a decode, padded to a 16-row tile with zeros), 5 (a
 * verification window), 40 or 512 (a prefill chunk) - and whatever the thread count (each output column block is
 * one thread's). This is what makes a speculative verification window compute, bit for bit, what a decode computes
 * (issue 33; oneDNN's bf16 GEMM changes its blocking, and so its rounding, with the number of rows).
 *
 * Weight layout (gemm.py's pack_bf16), K padded to a multiple of 32 and N to a multiple of 16 with zeros:
 *   wp  uint16 [Np/16, Kp/2, 16, 2]: tile t, pair c, lane l, b = W[16t + l, 2c + b]
 * so the AMX B operand of tile t and chunk j (16 pairs x 16 lanes x 2, "VNNI" order) is 1 KiB of contiguous memory.
 * Activations are copied into a zero-padded [Mp, Kp] buffer (Mp a multiple of 16) when their shape needs it: the
 * padding rows are computed and thrown away; they do not touch the real rows' sums.
 * Blocking: 2 x 2 accumulator tiles (32 rows x 32 outputs), A tiles tmm4-5, B tiles tmm6-7.
 */
#include "bf16.h"
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PREFETCH_BYTES 4096

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Ask the kernel for AMX state (once per process; harmless to repeat). 0 on success. */
int specdec_amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

static void configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* rows [m0, m0 + rows) of the fp32 block c (16 x 16, stride 16) -> y columns [col, col + 16) (masked at n) */
static void write_out(const float *c, int64_t m0, int64_t rows, int64_t col, int64_t n, const float *bias,
                      void *y, int y_bf16) {
    const __mmask16 lanes = n - col >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - col)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes, bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_loadu_ps(c + r * 16);
        if (bias) v = _mm512_add_ps(v, b);
        if (y_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (m0 + r) * n + col, lanes, to_bf16(v));
        else
            _mm512_mask_storeu_ps((float *)y + (m0 + r) * n + col, lanes, v);
    }
}

/* y [M, N] = x [Mp, Kp] (bf16, zero-padded) @ W^T (+ bias) for column tiles t0 .. t0 + nt - 1 (nt 1 or 2) and
 * row blocks of 16 starting at m0 (mt 1 or 2 of them) */
#define BLOCK(MT, NT)                                                                                                 \
    static void block_##MT##NT(const uint16_t *x, int64_t kp, const uint16_t *wp, int64_t t0, int64_t m0,        \
                               int64_t m_rows, const float *bias, int64_t n, void *y, int y_bf16, int prefetch) { \
        const int64_t chunks = kp / 32, tile_elems = (kp / 2) * 32;                                               \
        const uint16_t *b0 = wp + t0 * tile_elems, *b1 = b0 + tile_elems;                                          \
        _tile_zero(0);                                                                                             \
        if (NT == 2) _tile_zero(1);                                                                                \
        if (MT == 2) _tile_zero(2);                                                                                \
        if (MT == 2 && NT == 2) _tile_zero(3);                                                                     \
        for (int64_t j = 0; j < chunks; j++) {                                                                     \
            if (prefetch) {                                                                                        \
                for (int p = 0; p < 16; p++) _mm_prefetch((const char *)(b0 + j * 512) + PREFETCH_BYTES + 64 * p,  \
                                                          _MM_HINT_T0);                                            \
                if (NT == 2)                                                                                       \
                    for (int p = 0; p < 16; p++)                                                                   \
                        _mm_prefetch((const char *)(b1 + j * 512) + PREFETCH_BYTES + 64 * p, _MM_HINT_T0);         \
            }                                                                                                      \
            _tile_loadd(4, x + m0 * kp + j * 32, kp * 2);                                                          \
            if (MT == 2) _tile_loadd(5, x + (m0 + 16) * kp + j * 32, kp * 2);                                      \
            _tile_loadd(6, b0 + j * 512, 64);                                                                      \
            if (NT == 2) _tile_loadd(7, b1 + j * 512, 64);                                                         \
            _tile_dpbf16ps(0, 4, 6);                                                                               \
            if (NT == 2) _tile_dpbf16ps(1, 4, 7);                                                                  \
            if (MT == 2) _tile_dpbf16ps(2, 5, 6);                                                                  \
            if (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);                                                       \
        }                                                                                                          \
        float c[16 * 16] __attribute__((aligned(64)));                                                             \
        const int64_t rows0 = m_rows - m0 < 16 ? m_rows - m0 : 16;                                                 \
        _tile_stored(0, c, 64);                                                                                    \
        write_out(c, m0, rows0, t0 * 16, n, bias, y, y_bf16);                                                      \
        if (NT == 2) {                                                                                             \
            _tile_stored(1, c, 64);                                                                                \
            write_out(c, m0, rows0, t0 * 16 + 16, n, bias, y, y_bf16);                                             \
        }                                                                                                          \
        if (MT == 2) {                                                                                             \
            const int64_t rows1 = m_rows - m0 - 16 < 16 ? m_rows - m0 - 16 : 16;                                   \
            _tile_stored(2, c, 64);                                                                                \
            write_out(c, m0 + 16, rows1, t0 * 16, n, bias, y, y_bf16);                                             \
            if (NT == 2) {                                                                                         \
                _tile_stored(3, c, 64);                                                                            \
                write_out(c, m0 + 16, rows1, t0 * 16 + 16, n, bias, y, y_bf16);                                    \
            }                                                                                                      \
        }                                                                                                          \
    }
BLOCK(1, 1) BLOCK(1, 2) BLOCK(2, 1) BLOCK(2, 2)
#undef BLOCK

/* y [M, N] (fp32, or bf16 when y_bf16) = x [M, K] bf16 @ W^T (+ bias [N] fp32), W packed as above with kp the
 * padded K. x is copied into a zero-padded [Mp, Kp] buffer when M % 16 or K % 32 is not 0. The process must have
 * been granted AMX state (specdec_amx_init, called once by gemm.py). Returns 0, or -1 when that buffer could not be
 * allocated. */
int specdec_gemm_amx(const uint16_t *x, int64_t m_rows, int64_t k, int64_t kp, const uint16_t *wp, const float *bias,
                     int64_t n, void *y, int y_bf16, int nthreads) {
    const int64_t tiles = (n + 15) / 16, pairs_of_tiles = (tiles + 1) / 2;
    const int64_t row_blocks = (m_rows + 15) / 16;
    uint16_t *padded = NULL;
    if (m_rows % 16 != 0 || k != kp) {
        padded = (uint16_t *)aligned_alloc(64, (size_t)(row_blocks * 16 * kp * 2 + 63) / 64 * 64);
        if (!padded) return -1;
        memset(padded, 0, (size_t)(row_blocks * 16 * kp * 2));
        for (int64_t m = 0; m < m_rows; m++) memcpy(padded + m * kp, x + m * k, (size_t)k * 2);
        x = padded;
    }
#pragma omp parallel num_threads(nthreads)
    {
        configure();
#pragma omp for schedule(static)
        for (int64_t pt = 0; pt < pairs_of_tiles; pt++) {
            const int64_t t0 = 2 * pt;
            const int two_cols = t0 + 1 < tiles;
            for (int64_t rb = 0; rb < row_blocks; rb += 2) {
                const int two_rows = rb + 1 < row_blocks, prefetch = rb == 0;
                if (two_rows && two_cols) block_22(x, kp, wp, t0, rb * 16, m_rows, bias, n, y, y_bf16, prefetch);
                else if (two_rows) block_21(x, kp, wp, t0, rb * 16, m_rows, bias, n, y, y_bf16, prefetch);
                else if (two_cols) block_12(x, kp, wp, t0, rb * 16, m_rows, bias, n, y, y_bf16, prefetch);
                else block_11(x, kp, wp, t0, rb * 16, m_rows, bias, n, y, y_bf16, prefetch);
            }
        }
        _tile_release();
    }
    free(padded);
    return 0;
}
