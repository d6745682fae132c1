/* y = x @ W.T for a weight in 4-bit groups (GGUF Q4_1's shape), on 8-bit activations, for
 * the small batches of decode (issue 18).
 *
 * The weight [N, K]: groups of 32 inputs per output row, w = d * q + m with q in 0..15 and
 * the group's scale d and minimum m in float16 (Q4_1 keeps exactly these). Stored as
 * `nib` [N, K / 2] bytes, 64 inputs per 32 bytes: byte j of a row's block b holds input
 * 64b + j in its low nibble and 64b + 32 + j in its high one; `d` and `m` [N, K / 32].
 * kvserve/model/quant.py packs it (`Int4Linear`).
 *
 * The activations are quantized per group of 32 to int8 with a float scale (dx, the group's
 * largest magnitude / 127, rounded to nearest even), as llama.cpp does for its Q4_1 dots. A
 * group's product is then integer: sum(w * x) = d * dx * sum(q * qx) + m * dx * sum(qx), and
 * one AVX-512 VNNI instruction (vpdpbusd, unsigned 4-bit codes times signed 8-bit
 * activations) multiplies 64 pairs. torch's int4 kernel (`_weight_int4pack_mm_for_cpu`)
 * converts every weight to float instead, which bounds decode at one to eight rows.
 *
 * Outputs are split over the OpenMP threads (torch's runtime) in blocks of 32; a thread takes
 * up to 8 activation rows (6 on AVX2) at a time through its block's weights, unpacking each
 * weight once for all of them. Built where the compiler targets
 * AVX-512 BW/VL and VNNI, or else AVX2 (two instructions, vpmaddubsw and vpmaddwd, for each
 * vpdpbusd, on the same layout read as 256-bit halves); elsewhere `kvs_int4_available` is 0
 * and torch's kernel runs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KVS_INT4 1 /* AVX-512 VNNI */
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define KVS_INT4 2 /* AVX2: vpmaddubsw + vpmaddwd where VNNI has one vpdpbusd */
#else
#define KVS_INT4 0
#endif

/* 1 where this build has the AVX-512 VNNI kernel, 2 the AVX2 one, 0 none. */
int kvs_int4_available(void) { return KVS_INT4; }

#if KVS_INT4

#define GROUP 32
#if KVS_INT4 == 1
#define ROWS 8   /* activation rows per pass over an output's weights */
#else
#define ROWS 6   /* AVX2: 6 16-bit and 6 float sums, with the weight halves, fit 16 registers */
#endif
#define NB 32    /* most outputs in a thread's block (kvs_int4_mm) */
#define BLOCK 16 /* groups per block: one per 32-bit lane of a 512-bit register */

/* Group g's 32 int8 activations `grp` into the row `q` in the weight's order: within each
 * block of 16 groups (inputs before `whole`), slice u (0..7) holds inputs 4u..4u+3 of each
 * group, group j at bytes 4j..4j+3; the groups after the last whole block in order. */
static inline void place_group(int8_t *q, int64_t g, int64_t whole, const int8_t *grp) {
    if (g * GROUP < whole) {
        int8_t *blk = q + g / BLOCK * GROUP * BLOCK;
        const int64_t j = g % BLOCK;
        for (int u = 0; u < 8; u++) memcpy(blk + u * 64 + 4 * j, grp + 4 * u, 4);
    } else {
        memcpy(q + g * GROUP, grp, GROUP);
    }
}

#if KVS_INT4 == 1

/* Sixteen consecutive inputs of an activation row as float32. */
static inline __m512 load16(const void *x, int bf16, int64_t i) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + i);
}

/* Each group of 32 of row x [K] to int8, its scale `dx` and dx * sum(q) `sx`, `q` in the
 * weight's order (place_group). */
static void quantize_row(const void *x, int bf16, int64_t k, int8_t *q, float *dx, float *sx) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const int64_t whole = k / (GROUP * BLOCK) * (GROUP * BLOCK);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const __m512 a = load16(x, bf16, g * GROUP), b = load16(x, bf16, g * GROUP + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(b, sign)));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        int8_t grp[GROUP];
        _mm_storeu_si128((__m128i *)grp, _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(grp + 16), _mm512_cvtsepi32_epi8(qb));
        place_group(q, g, whole, grp);
        dx[g] = d;
        sx[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

/* Output row n for activation rows [0, R) of `qx` (rows k apart): out[r] = sum over the
 * groups. `wd`/`wm` the row's group scales and minima (float16), dx/sx the rows' (float32,
 * `groups` apart). */
static inline __attribute__((always_inline)) void dot_rows(
    const int R, const uint8_t *nib, const uint16_t *wd, const uint16_t *wm, const int8_t *qx,
    const float *dx, const float *sx, int64_t k, float *out) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int64_t groups = k / GROUP, blocks = groups / BLOCK;
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i dot[ROWS];
        for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_loadu_si512((const void *)(nib + b * 256 + i * 64));
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = qx + r * k + b * 512 + i * 128;
                dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_loadu_si512((const void *)xr));
                dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_loadu_si512((const void *)(xr + 64)));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wd + b * BLOCK)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wm + b * BLOCK)));
        for (int r = 0; r < R; r++) {
            const float *dxr = dx + r * groups + b * BLOCK, *sxr = sx + r * groups + b * BLOCK;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_loadu_ps(dxr)), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(sxr), acc[r]);
        }
    }
    const int64_t tail = groups - blocks * BLOCK; /* even, < 16 */
    if (tail) {
        const __mmask16 mask = (__mmask16)((1u << tail) - 1);
        const int64_t g0 = blocks * BLOCK;
        const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, wd + g0));
        const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, wm + g0));
        const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        __m512 scale[ROWS]; /* lane g: d * dx of tail group g */
        for (int r = 0; r < R; r++) {
            scale[r] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(mask, dx + r * groups + g0));
            acc[r] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, sx + r * groups + g0), acc[r]);
        }
        for (int64_t p = 0; p < tail / 2; p++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(nib + blocks * 256 + p * 32));
            const __m512i w = _mm512_and_si512(
                _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1), low);
            /* lanes 0-7 of a product sum group 2p of the tail, lanes 8-15 group 2p + 1 */
            const __m512i pick = _mm512_add_epi32(first, _mm512_set1_epi32((int)(2 * p)));
            for (int r = 0; r < R; r++) {
                const __m512i xq = _mm512_loadu_si512((const void *)(qx + r * k + g0 * GROUP + p * 64));
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, scale[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

#else /* KVS_INT4 == 2 */

/* Each group of 32 of row x [K] to int8 (nearest even, as the AVX-512 path), its scale `dx`
 * and dx * sum(q) `sx`, in the weight's order (place_group). */
static void quantize_row(const void *x, int bf16, int64_t k, int8_t *q, float *dx, float *sx) {
    const int64_t whole = k / (GROUP * BLOCK) * (GROUP * BLOCK);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the packs' lane split */
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m256 v[4];
        for (int j = 0; j < 4; j++) {
            const int64_t i = g * GROUP + 8 * j;
            v[j] = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                              _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16))
                        : _mm256_loadu_ps((const float *)x + i);
        }
        const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], sign), _mm256_and_ps(v[1], sign)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], sign), _mm256_and_ps(v[3], sign)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256i qi[4]; /* nearest even under the default rounding, as nearbyintf */
        for (int j = 0; j < 4; j++) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
        const __m256i packed = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order);
        int8_t grp[GROUP];
        _mm256_storeu_si256((__m256i *)grp, packed);
        place_group(q, g, whole, grp);
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        dx[g] = d;
        sx[g] = d * (float)_mm_cvtsi128_si32(s4);
    }
}

/* u8 x s8 products summed four to a 32-bit lane, as vpdpbusd (no saturation: 15 * 127 * 2
 * fits 16 bits). */
static inline __m256i dot4(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

/* The pairs' sums of a block half (8 vpmaddubsw, each lane at most 15 * 127 * 2 in
 * magnitude) added in 16 bits (8 * 3810 < 32768: exact), then widened four to a 32-bit lane
 * once: a vpmaddwd per 256 weights where dot4 takes one per 64 (Zen 2 issues either on one
 * pipe). Integer sums are exact, so the lanes are dot4's. */
static inline __m256i widen4(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The groups after the last whole block (pairs) into acc[0..R). */
static inline __attribute__((always_inline)) void tail_rows(
    const int R, const uint8_t *nib, const uint16_t *wd, const uint16_t *wm, const int8_t *qx,
    const float *dx, const float *sx, int64_t k, __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int64_t groups = k / GROUP, blocks = groups / BLOCK;
    for (int64_t p = 0; p < (groups - blocks * BLOCK) / 2; p++) { /* the tail's group pairs */
        const int64_t g = blocks * BLOCK + 2 * p;
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(nib + blocks * 256 + p * 32));
        const __m256i wa = _mm256_and_si256(packed, low), wb = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        const float da = _cvtsh_ss(wd[g]), db = _cvtsh_ss(wd[g + 1]);
        const __m256 m = _mm256_setr_ps(_cvtsh_ss(wm[g]), _cvtsh_ss(wm[g + 1]), 0.f, 0.f, 0.f, 0.f, 0.f, 0.f);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = qx + r * k + g * GROUP;
            const float *dxr = dx + r * groups, *sxr = sx + r * groups;
            const __m256i sa = dot4(wa, _mm256_loadu_si256((const __m256i *)xr));
            const __m256i sb = dot4(wb, _mm256_loadu_si256((const __m256i *)(xr + GROUP)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa), _mm256_set1_ps(da * dxr[g]), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb), _mm256_set1_ps(db * dxr[g + 1]), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_setr_ps(sxr[g], sxr[g + 1], 0.f, 0.f, 0.f, 0.f, 0.f, 0.f), acc[r]);
        }
    }
}

/* The AVX-512 path's dot_rows on 256-bit registers: each 64-byte chunk of a block is two
 * halves, groups 0-7 and 8-15 of the block. */
static inline __attribute__((always_inline)) void dot_rows(
    const int R, const uint8_t *nib, const uint16_t *wd, const uint16_t *wm, const int8_t *qx,
    const float *dx, const float *sx, int64_t k, float *out) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int64_t groups = k / GROUP, blocks = groups / BLOCK;
    __m256 acc[ROWS]; /* updated by fused multiply-adds only: the same order for any R */
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++)
        for (int h = 0; h < 2; h++) {
            __m256i dot[ROWS]; /* 16-bit pair sums until widen4 */
            for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(nib + b * 256 + i * 64 + h * 32));
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = qx + r * k + b * 512 + i * 128 + h * 32;
                    dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)));
                    dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 64))));
                }
            }
            for (int r = 0; r < R; r++) dot[r] = widen4(dot[r]);
            const int64_t g = b * BLOCK + h * 8;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + g)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + g)));
            for (int r = 0; r < R; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d, _mm256_loadu_ps(dx + r * groups + g)), acc[r]);
                acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(sx + r * groups + g), acc[r]);
            }
        }
    tail_rows(R, nib, wd, wm, qx, dx, sx, k, acc);
    for (int r = 0; r < R; r++) out[r] = hsum256(acc[r]);
}

#define COLS 4 /* outputs per pass over one activation row */

/* dot_rows for one row and COLS outputs (weights `nib`, `wd`, `wm` of the first; the others
 * follow k/2 bytes and k/32 groups apart): four independent chains where one output alone
 * waits on its own adds. Each output gets the very operations dot_rows gives it, in the same
 * order, so the numbers are dot_rows' to the bit. */
static void dot_cols(const uint8_t *nib, const uint16_t *wd, const uint16_t *wm, const int8_t *qx,
                     const float *dx, const float *sx, int64_t k, float *out) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int64_t groups = k / GROUP, blocks = groups / BLOCK, half = k / 2;
    __m256 acc[COLS];
    for (int c = 0; c < COLS; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++)
        for (int h = 0; h < 2; h++) {
            __m256i dot[COLS]; /* 16-bit pair sums until widen4 */
            for (int c = 0; c < COLS; c++) dot[c] = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const int8_t *xr = qx + b * 512 + i * 128 + h * 32;
                const __m256i xlo = _mm256_loadu_si256((const __m256i *)xr);
                const __m256i xhi = _mm256_loadu_si256((const __m256i *)(xr + 64));
                for (int c = 0; c < COLS; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(nib + c * half + b * 256 + i * 64 + h * 32));
                    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    dot[c] = _mm256_add_epi16(dot[c], _mm256_maddubs_epi16(lo, xlo));
                    dot[c] = _mm256_add_epi16(dot[c], _mm256_maddubs_epi16(hi, xhi));
                }
            }
            for (int c = 0; c < COLS; c++) dot[c] = widen4(dot[c]);
            const int64_t g = b * BLOCK + h * 8;
            const __m256 dxv = _mm256_loadu_ps(dx + g), sxv = _mm256_loadu_ps(sx + g);
            for (int c = 0; c < COLS; c++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + c * groups + g)));
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + c * groups + g)));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[c]), _mm256_mul_ps(d, dxv), acc[c]);
                acc[c] = _mm256_fmadd_ps(m, sxv, acc[c]);
            }
        }
    for (int c = 0; c < COLS; c++) {
        tail_rows(1, nib + c * half, wd + c * groups, wm + c * groups, qx, dx, sx, k, acc + c);
        out[c] = hsum256(acc[c]);
    }
}

#endif

/* dot_rows for R (1..ROWS) rows, R a constant in each instance. */
static void dot_any(int R, const uint8_t *nib, const uint16_t *wd, const uint16_t *wm, const int8_t *qx,
                    const float *dx, const float *sx, int64_t k, float *out) {
    switch (R) {
        case 1: dot_rows(1, nib, wd, wm, qx, dx, sx, k, out); break;
        case 2: dot_rows(2, nib, wd, wm, qx, dx, sx, k, out); break;
        case 3: dot_rows(3, nib, wd, wm, qx, dx, sx, k, out); break;
        case 4: dot_rows(4, nib, wd, wm, qx, dx, sx, k, out); break;
        case 5: dot_rows(5, nib, wd, wm, qx, dx, sx, k, out); break;
        case 6: dot_rows(6, nib, wd, wm, qx, dx, sx, k, out); break;
#if ROWS > 6
        case 7: dot_rows(7, nib, wd, wm, qx, dx, sx, k, out); break;
        default: dot_rows(8, nib, wd, wm, qx, dx, sx, k, out); break;
#endif
    }
}

/* y [M, N] (bf16 when y_bf16, else float32) = x [M, K] (bf16 when x_bf16; rows x_stride
 * elements apart) @ W.T. 0 on success; -1 where K is not a positive multiple of 64, -2 where
 * memory ran out. */
int kvs_int4_mm(const void *x, int x_bf16, int64_t x_stride, int64_t m_rows, int64_t k,
                const uint8_t *nib, const uint16_t *wd, const uint16_t *wm, int64_t n_out,
                void *y, int y_bf16) {
    if (k % 64 != 0 || k <= 0) return -1;
    if (m_rows <= 0) return 0;
    const int64_t groups = k / GROUP;
    char *buf = scratch((size_t)(m_rows * k + 2 * m_rows * groups * (int64_t)sizeof(float)));
    if (!buf) return -2;
    float *dx = (float *)buf, *sx = dx + m_rows * groups;
    int8_t *qx = (int8_t *)(sx + m_rows * groups);
    #pragma omp parallel for schedule(static) if (m_rows * k >= 262144)
    for (int64_t r = 0; r < m_rows; r++)
        quantize_row((const char *)x + r * x_stride * (x_bf16 ? 2 : 4), x_bf16, k, qx + r * k,
                     dx + r * groups, sx + r * groups);

#if KVS_INT4 == 2
    if (m_rows == 1) { /* decode of one stream: COLS outputs at a time (dot_cols) */
        const int64_t first = n_out / COLS * COLS;
        #pragma omp parallel for schedule(static) if (n_out * k >= 65536)
        for (int64_t n = 0; n < n_out; n += COLS) {
            float out[COLS];
            if (n < first)
                dot_cols(nib + n * (k / 2), wd + n * groups, wm + n * groups, qx, dx, sx, k, out);
            else
                for (int c = 0; c < n_out - n; c++)
                    dot_rows(1, nib + (n + c) * (k / 2), wd + (n + c) * groups, wm + (n + c) * groups, qx,
                             dx, sx, k, out + c);
            for (int c = 0; c < COLS && n + c < n_out; c++) {
                put(y, y_bf16, n + c, out[c]);
            }
        }
        return 0;
    }
#endif
    /* Each thread takes blocks of up to NB outputs; in a block, ROWS rows at a time (their
     * 8-bit activations stay in L1) go through the block's weights (9-24 KB: L1/L2).
     * Streaming all rows past each output instead read the activations from L2 or further at
     * every output: 1.35x slower at 128 rows, 2x at 2,048 (AVX2 build, bench/int4_kernel.py).
     * The blocks come in a multiple of the threads, so each thread has as many; with one pass
     * of rows a block is one output (blocking buys nothing there). */
    int64_t nblocks = m_rows <= ROWS ? n_out : (n_out + NB - 1) / NB;
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
    nblocks = (nblocks + threads - 1) / threads * threads;
#endif
    const int64_t per = (n_out + nblocks - 1) / nblocks;
    nblocks = (n_out + per - 1) / per;
    #pragma omp parallel for schedule(static) if (n_out * k >= 65536)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n1 = nb * per + per < n_out ? nb * per + per : n_out;
        for (int64_t r0 = 0; r0 < m_rows; r0 += ROWS) {
            const int R = m_rows - r0 < ROWS ? (int)(m_rows - r0) : ROWS;
            for (int64_t n = nb * per; n < n1; n++) {
                float out[ROWS];
                dot_any(R, nib + n * (k / 2), wd + n * groups, wm + n * groups, qx + r0 * k, dx + r0 * groups,
                        sx + r0 * groups, k, out);
                for (int r = 0; r < R; r++) put(y, y_bf16, (r0 + r) * n_out + n, out[r]);
            }
        }
    }
    return 0;
}

#else

int kvs_int4_mm(const void *x, int x_bf16, int64_t x_stride, int64_t m_rows, int64_t k,
                const uint8_t *nib, const uint16_t *wd, const uint16_t *wm, int64_t n_out,
                void *y, int y_bf16) {
    (void)x; (void)x_bf16; (void)x_stride; (void)m_rows; (void)k; (void)nib; (void)wd; (void)wm;
    (void)n_out; (void)y; (void)y_bf16;
    return -3;
}

#endif
