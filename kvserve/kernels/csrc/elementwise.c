/* Row-wise ops of the Llama layer for the CPU backend, each one pass where torch takes
 * several ops: the RMS norm (eight ops; 4x faster at 1 to 1,024 rows of the default
 * model's 576), the rotary embedding of the q and k heads (ten), and the store of a step's
 * K or V rows at their pool slots (an index_copy_ that moved 1.4 GB/s here).
 *
 * They round where torch's ops round, so that they give torch's results for the same
 * inputs: the RMS norm normalises in float32, rounds to the model dtype, then multiplies
 * by the weight (one more rounding), as transformers' LlamaRMSNorm does (up to the order of
 * a float32 sum); the rotary rounds each product and then the sum, as x1*cos - x2*sin does
 * in the model dtype (bit for bit: no fused multiply-add, see below).  Rows are split over
 * the OpenMP threads (torch's runtime).  Built with decode_attention.c
 * (kvserve/kernels/native/loader.py); plain C.  (A fused SiLU-and-multiply was tried and dropped:
 * no faster than torch's two ops at 32 rows or 1,024.)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"


#define DEFINE_ROWWISE(SUFFIX, T, LOAD, STORE, ROUND)                                            \
int kvs_rms_norm_##SUFFIX(const T *x, const T *weight, T *out, int64_t rows, int64_t dim,      \
                          int64_t x_stride, float eps) {                                       \
    _Pragma("omp parallel for schedule(static) if (rows * dim >= 65536)")                       \
    for (int64_t r = 0; r < rows; r++) {                                                        \
        const T *xr = x + r * x_stride;                                                         \
        T *o = out + r * dim;                                                                   \
        float ss = 0.f;                                                                         \
        for (int64_t i = 0; i < dim; i++) { const float v = LOAD(xr[i]); ss += v * v; }        \
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);                                   \
        for (int64_t i = 0; i < dim; i++) o[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(xr[i]) * inv)); \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_ROWWISE(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_ROWWISE(f32, float, f32_id, f32_id, f32_id)

/* Rotary embedding, rotate-half layout: token t's `heads` heads of `d` values at
 * src + t * src_stride are rotated by position positions[t] (cos and sin from float32
 * tables [table_rows, d/2], rounded to the model dtype first as torch's .to() does) into
 * out [tokens, heads, d].  Returns 1 + t for a position outside the tables (nothing
 * written for it), else 0.  No contraction to FMA: torch rounds each product. */
#define DEFINE_ROTARY(SUFFIX, T, LOAD, STORE, ROUND)                                             \
__attribute__((optimize("fp-contract=off")))                                                    \
int kvs_rotary_##SUFFIX(const T *src, int64_t src_stride, T *out, const float *cos_tab,          \
                        const float *sin_tab, int64_t table_rows, const int64_t *positions,     \
                        int64_t tokens, int64_t heads, int64_t d) {                            \
    const int64_t half = d / 2;                                                                 \
    int bad = 0;                                                                                \
    _Pragma("omp parallel for schedule(static) if (tokens * heads * d >= 65536)")               \
    for (int64_t t = 0; t < tokens; t++) {                                                      \
        const int64_t pos = positions[t];                                                       \
        if (pos < 0 || pos >= table_rows) {                                                     \
            _Pragma("omp atomic write")                                                         \
            bad = (int)t + 1;                                                                   \
            continue;                                                                           \
        }                                                                                       \
        const float *ct = cos_tab + pos * half, *st = sin_tab + pos * half;                     \
        for (int64_t h = 0; h < heads; h++) {                                                   \
            const T *x = src + t * src_stride + h * d;                                          \
            T *o = out + (t * heads + h) * d;                                                   \
            for (int64_t i = 0; i < half; i++) {                                                \
                const float c = ROUND(ct[i]), s = ROUND(st[i]);                                 \
                const float x1 = LOAD(x[i]), x2 = LOAD(x[i + half]);                            \
                o[i] = STORE(ROUND(x1 * c) - ROUND(x2 * s));                                    \
                o[i + half] = STORE(ROUND(x2 * c) + ROUND(x1 * s));                             \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    return bad;                                                                                 \
}

DEFINE_ROTARY(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_ROTARY(f32, float, f32_id, f32_id, f32_id)

/* dst[loc[t]] = the row_bytes at src + t * src_stride_bytes for each token t: a step's new
 * K or V rows into the pool (dst_rows slots of row_bytes).  Every slot is checked before
 * anything is written: returns 1 + t for a slot outside the pool (nothing written), else 0. */
int kvs_store_rows(const char *src, int64_t src_stride_bytes, char *dst, int64_t dst_rows,
                   const int64_t *loc, int64_t tokens, int64_t row_bytes) {
    for (int64_t t = 0; t < tokens; t++)
        if (loc[t] < 0 || loc[t] >= dst_rows) return (int)t + 1;
    _Pragma("omp parallel for schedule(static) if (tokens * row_bytes >= 262144)")
    for (int64_t t = 0; t < tokens; t++)
        memcpy(dst + loc[t] * row_bytes, src + t * src_stride_bytes, (size_t)row_bytes);
    return 0;
}

/* Greedy sampling's read of a step's logits x [rows, cols] (row r at x + r * stride), one
 * pass per row where torch took three (a float32 copy of bfloat16 logits, their max with its
 * index, their min for the finite check): index[r] the first column holding the row's
 * largest value (torch's argmax), finite[r] 1 when no value is NaN or infinite (else 0, and
 * index[r] 0).  Rows are split over the OpenMP threads. */
static inline uint32_t exp_bits_f32(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u & 0x7f800000u;
}
static inline uint32_t exp_bits_bf16(uint16_t h) { return ((uint32_t)h << 16) & 0x7f800000u; }

#define ARGMAX_BLOCK 256 /* columns per vector pass: the first index is sought in one block only */
#define DEFINE_ARGMAX(SUFFIX, T, LOAD)                                                            \
int kvs_row_argmax_##SUFFIX(const T *x, int64_t rows, int64_t cols, int64_t stride, int64_t *index, \
                            uint8_t *finite) {                                                   \
    _Pragma("omp parallel for schedule(static) if (rows * cols >= 65536)")                       \
    for (int64_t r = 0; r < rows; r++) {                                                         \
        const T *xr = x + r * stride;                                                            \
        float m = -INFINITY;                                                                     \
        int64_t at = 0; /* the first block whose largest value is m */                           \
        uint32_t bad = 0;                                                                        \
        for (int64_t b = 0; b < cols; b += ARGMAX_BLOCK) {                                       \
            const int64_t end = cols - b < ARGMAX_BLOCK ? cols : b + ARGMAX_BLOCK;               \
            float bm = -INFINITY;                                                                \
            _Pragma("omp simd reduction(max : bm) reduction(| : bad)") /* NaN rows are flagged */ \
            for (int64_t i = b; i < end; i++) {                                                  \
                const float v = LOAD(xr[i]);                                                     \
                bm = v > bm ? v : bm;                                                            \
                bad |= exp_bits_##SUFFIX(xr[i]) == 0x7f800000u;                                  \
            }                                                                                    \
            if (bm > m) {                                                                        \
                m = bm;                                                                          \
                at = b;                                                                          \
            }                                                                                    \
        }                                                                                        \
        if (bad) at = 0;                                                                         \
        else                                                                                     \
            while (at < cols - 1 && LOAD(xr[at]) != m) at++;                                     \
        index[r] = at;                                                                           \
        finite[r] = !bad;                                                                        \
    }                                                                                            \
    return 0;                                                                                    \
}

DEFINE_ARGMAX(bf16, uint16_t, bf16_to_f32)
DEFINE_ARGMAX(f32, float, f32_id)
