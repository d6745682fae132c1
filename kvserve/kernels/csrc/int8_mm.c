/* y = x @ W.T for a weight in 8-bit groups (GGUF Q8_0's shape), on 8-bit activations: the
 * model's output head, whose 49,152 x 576 int8 weights are the largest single read of a
 * decode step.
 *
 * The weight [N, K], K a multiple of 32: groups of 32 inputs per output row, w = d * q with
 * q in -127..127 and the group's scale d in float16 (Q8_0 keeps exactly these). Stored plain:
 * `q` [N, K] int8 row-major and `d` [N, K / 32] float16. kvserve/model/quant.py quantizes it
 * (`Int8Linear`).
 *
 * The activations are quantized per group of 32 to int8 with a float scale (dx, the group's
 * largest magnitude / 127, rounded to nearest even), as the 4-bit kernel (int4_mm.c) and
 * llama.cpp's Q8_0 dots do. A group's product is then integer: sum(w * x) = d * dx *
 * sum(q * qx). The multiply instructions take one unsigned operand, so each pair goes in as
 * |q| times qx with q's sign (|q| <= 128 and |qx| <= 127: two products fit 16 bits, for
 * AVX2's vpmaddubsw; AVX-512 VNNI's vpdpbusd sums four into 32 bits). Each group's 32-bit
 * sums become float and are scaled by d * dx into the output's float32 accumulator; torch's
 * int8 kernel (`_weight_int8pack_mm`) takes bfloat16 activations and converts every weight
 * to float instead.
 *
 * Rows of the output are split over the OpenMP threads (torch's runtime), each thread's in
 * order: one activation row (decode of one stream) streams the weights once, front to back,
 * with a software prefetch AHEAD of the multiplies (the hardware's alone left a third of the
 * memory bandwidth unused); a batch takes up to ROWS activation rows per pass over a weight
 * row, TILE weight rows at a time, so that each tile comes from memory once. Every output gets
 * the same operations in the same order whatever the batch (dot_rows), so a row's result does
 * not depend on the rows beside it. Built where the compiler targets AVX-512 BW/VL and VNNI,
 * or else AVX2 with F16C and FMA; elsewhere `kvs_int8_available` is 0 and torch's kernel runs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KVS_INT8 1 /* AVX-512 VNNI */
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define KVS_INT8 2 /* AVX2: vpsignb + vpmaddubsw + vpmaddwd where VNNI has one vpdpbusd */
#else
#define KVS_INT8 0
#endif

/* 1 where this build has the AVX-512 VNNI kernel, 2 the AVX2 one, 0 none. */
int kvs_int8_available(void) { return KVS_INT8; }

#if KVS_INT8

#define GROUP 32
#define ROWS 8 /* activation rows per pass over a weight row */
#define TILE 16 /* weight rows (9 KB at K = 576) per pass over a batch's activations */
#define AHEAD 4096 /* bytes of weights prefetched ahead of the ones multiplied */

#if KVS_INT8 == 1

#define SPAN 16 /* groups per step of the scales: one per lane of a 512-bit register */

/* Sixteen consecutive inputs of an activation row as float32. */
static inline __m512 load16(const void *x, int bf16, int64_t i) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + i);
}

/* Each group of 32 of row x [K] to int8 `q` (in order) and its scale `dx`. */
static void quantize_row(const void *x, int bf16, int64_t k, int8_t *q, float *dx) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        const __m512 a = load16(x, bf16, g * GROUP), b = load16(x, bf16, g * GROUP + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + g * GROUP), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(q + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
        dx[g] = amax / 127.f;
    }
}

/* out[r] = row r < R of `qx` (rows k apart, their scales `dx` groups apart) times the weight
 * row `w` (its scales `wd`). A step takes a pair of groups, one 512-bit register of weights:
 * the dot's lanes 0-7 sum the first group, 8-15 the second (an odd last group is the pair's
 * lower half, the upper half zero). The scales d * dx of SPAN groups are computed at once and
 * spread over a pair's lanes by a permute. */
static inline __attribute__((always_inline)) void dot_rows(
    const int R, const int8_t *w, const uint16_t *wd, const int8_t *qx, const float *dx, int64_t k,
    float *out) {
    const int64_t groups = k / GROUP;
    const __m512i zero = _mm512_setzero_si512();
    const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += SPAN) {
        const int64_t n = groups - g0 < SPAN ? groups - g0 : SPAN;
        const __mmask16 in = (__mmask16)((1u << n) - 1);
        const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, wd + g0));
        __m512 scale[ROWS]; /* lane j: d * dx of group g0 + j (0 past the last group) */
        for (int r = 0; r < R; r++) scale[r] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(in, dx + r * groups + g0));
        for (int64_t p = 0; 2 * p < n; p++) {
            const __mmask64 bytes = 2 * p + 1 < n ? ~(__mmask64)0 : (__mmask64)0xffffffffu;
            const __m512i pick = _mm512_add_epi32(first, _mm512_set1_epi32((int)(2 * p)));
            const int64_t at = (g0 + 2 * p) * GROUP;
            _mm_prefetch((const char *)(w + at + AHEAD), _MM_HINT_T0);
            const __m512i v = _mm512_maskz_loadu_epi8(bytes, w + at);
            const __m512i mag = _mm512_abs_epi8(v);
            const __mmask64 neg = _mm512_movepi8_mask(v);
            for (int r = 0; r < R; r++) {
                const __m512i xv = _mm512_maskz_loadu_epi8(bytes, qx + r * k + at);
                const __m512i dot = _mm512_dpbusd_epi32(zero, mag, _mm512_mask_sub_epi8(xv, neg, zero, xv));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, scale[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

#else /* KVS_INT8 == 2 */

#define SPAN 8 /* groups per step of the scales: one per lane of a 256-bit register */

/* Each group of 32 of row x [K] to int8 `q` (in order, nearest even as the AVX-512 path)
 * and its scale `dx`. */
static void quantize_row(const void *x, int bf16, int64_t k, int8_t *q, float *dx) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        float v[GROUP], amax = 0.f;
        for (int i = 0; i < GROUP; i++) {
            v[i] = bf16 ? bf16_to_f32(((const uint16_t *)x)[g * GROUP + i]) : ((const float *)x)[g * GROUP + i];
            amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < GROUP; i++) q[g * GROUP + i] = (int8_t)nearbyintf(v[i] * inv);
        dx[g] = amax / 127.f;
    }
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The AVX-512 path's dot_rows on 256-bit registers, one group per step: |q| (vpabsb) times
 * qx with q's sign (vpsignb), pairs summed to 16 bits (vpmaddubsw), then to 32 (vpmaddwd).
 * The scales d * dx of SPAN groups are computed at once into `scale` and broadcast from it. */
static inline __attribute__((always_inline)) void dot_rows(
    const int R, const int8_t *w, const uint16_t *wd, const int8_t *qx, const float *dx, int64_t k,
    float *out) {
    const int64_t groups = k / GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += SPAN) {
        const int64_t n = groups - g0 < SPAN ? groups - g0 : SPAN;
        float scale[ROWS][SPAN];
        for (int r = 0; r < R; r++) {
            const float *s = dx + r * groups + g0;
            if (n == SPAN)
                _mm256_storeu_ps(scale[r], _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + g0))),
                                                         _mm256_loadu_ps(s)));
            else /* the same products one at a time */
                for (int64_t j = 0; j < n; j++) scale[r][j] = _cvtsh_ss(wd[g0 + j]) * s[j];
        }
        for (int64_t j = 0; j < n; j++) {
            const int64_t at = (g0 + j) * GROUP;
            if (j % 2 == 0) _mm_prefetch((const char *)(w + at + AHEAD), _MM_HINT_T0); /* a line per pair */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + at));
            const __m256i mag = _mm256_abs_epi8(v);
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + r * k + at));
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(xv, v)), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[r][j]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum256(acc[r]);
}

#endif

/* y [M, N] (bf16 when y_bf16, else float32) = x [M, K] (bf16 when x_bf16; rows x_stride
 * elements apart) @ W.T for W = d * q (q int8 [N, K], d float16 [N, K / 32]). 0 on success;
 * -1 where K is not a positive multiple of 32, -2 where memory ran out. */
int kvs_int8_mm(const void *x, int x_bf16, int64_t x_stride, int64_t m_rows, int64_t k,
                const int8_t *q, const uint16_t *wd, int64_t n_out, void *y, int y_bf16) {
    if (k % GROUP != 0 || k <= 0) return -1;
    if (m_rows <= 0) return 0;
    const int64_t groups = k / GROUP;
    char *buf = scratch((size_t)(m_rows * k + m_rows * groups * (int64_t)sizeof(float)));
    if (!buf) return -2;
    float *dx = (float *)buf;
    int8_t *qx = (int8_t *)(dx + m_rows * groups);
    for (int64_t r = 0; r < m_rows; r++)
        quantize_row((const char *)x + r * x_stride * (x_bf16 ? 2 : 4), x_bf16, k, qx + r * k, dx + r * groups);

    /* A thread's weight rows in order, TILE at a time: one activation row streams them once
     * (decode of one stream), a batch reads each tile from memory once for all its rows. */
    #pragma omp parallel for schedule(static) if (n_out * k >= 65536)
    for (int64_t n0 = 0; n0 < n_out; n0 += TILE) {
        const int64_t n1 = n0 + TILE < n_out ? n0 + TILE : n_out;
        for (int64_t r0 = 0; r0 < m_rows; r0 += ROWS) {
            const int R = m_rows - r0 < ROWS ? (int)(m_rows - r0) : ROWS;
            const int8_t *xq = qx + r0 * k;
            const float *dxr = dx + r0 * groups;
            for (int64_t n = n0; n < n1; n++) {
                const int8_t *wn = q + n * k;
                const uint16_t *dn = wd + n * groups;
                float out[ROWS];
                switch (R) {
                    case 1: dot_rows(1, wn, dn, xq, dxr, k, out); break;
                    case 2: dot_rows(2, wn, dn, xq, dxr, k, out); break;
                    case 3: dot_rows(3, wn, dn, xq, dxr, k, out); break;
                    case 4: dot_rows(4, wn, dn, xq, dxr, k, out); break;
                    case 5: dot_rows(5, wn, dn, xq, dxr, k, out); break;
                    case 6: dot_rows(6, wn, dn, xq, dxr, k, out); break;
                    case 7: dot_rows(7, wn, dn, xq, dxr, k, out); break;
                    default: dot_rows(8, wn, dn, xq, dxr, k, out); break;
                }
                for (int r = 0; r < R; r++) put(y, y_bf16, (r0 + r) * n_out + n, out[r]);
            }
        }
    }
    return 0;
}

#else

int kvs_int8_mm(const void *x, int x_bf16, int64_t x_stride, int64_t m_rows, int64_t k,
                const int8_t *q, const uint16_t *wd, int64_t n_out, void *y, int y_bf16) {
    (void)x; (void)x_bf16; (void)x_stride; (void)m_rows; (void)k; (void)q; (void)wd; (void)n_out;
    (void)y; (void)y_bf16;
    return -3;
}

#endif
