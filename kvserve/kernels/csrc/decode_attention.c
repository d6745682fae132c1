/* Decode attention over kvserve's token-level KV pool, reading each request's slots in place.
 *
 * One query token per request (batch row b) attends to the first lens[b] tokens of its
 * request, whose K/V live at pool slots req_to_token[rows[b]][0 .. lens[b]-1].  The pool of
 * one layer is [size, Hkv, D]; the q heads of one KV group (Hq / Hkv of them) share each K/V
 * read.  Softmax runs online in float32, in base 2 (q is scaled by sm_scale * log2 e).
 *
 * Work is cut two ways.  Across heads: an item is one row's tile of whole KV groups (all of
 * them for the default model: at most TILE_Q q heads), so that it reads each slot's K and V
 * rows of its heads as one run of memory.  Along the tokens: chunks of CHUNK tokens (CHUNK / 2
 * for rows up to SHORT), fixed by the row's length alone.  A chunk gives a partial result
 * (per q head: the max of its scores, the sum of their powers, the unnormalized sum of the
 * weighted V rows), and an item's partials are merged in chunk order.  With many items each
 * OpenMP thread takes whole items, merging as it goes; with few (below SPLIT_BELOW per
 * thread: a batch of a few requests) the chunks themselves are spread over the threads
 * (flash-decoding's split along the keys) and merged after.  Both ways run the very same
 * chunk and merge code in the same order, so a row's result is the same bits whichever way
 * runs, however many threads there are and whatever else is in the batch.  The threads are
 * those of torch's OpenMP runtime, already loaded (torch.set_num_threads governs them).
 *
 * Within a chunk, blocks of BLOCK tokens: for each KV head, the block's scores, one
 * online-softmax step and the block's V rows.  head_dim 64 and 128 get fixed-length vector
 * code: AVX-512 BF16 dot products for bfloat16 caches where the CPU has them, AVX2 + FMA
 * otherwise (float32, and bfloat16 widened by a shift), with a vector exp2.  Other head dims,
 * and CPUs without AVX2, run plain C.
 *
 * Built at run time (kvserve/kernels/native/loader.py); plain C, no torch headers.  Returns 0;
 * -(1 + b) when batch row b's row of req_to_token or length is out of its bounds (nothing
 * is computed); 1 + b when row b holds a slot index outside the pool (the first such row;
 * nothing is read out of bounds; the output is then undefined).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "scratch.h"

#define BLOCK 64      /* tokens per online-softmax step */
#define CHUNK 64      /* tokens per partial result, at most BLOCK (one block: the AVX-512 chunk); half that up to SHORT */
#define SHORT 256     /* rows up to this length get chunks of CHUNK / 2, for a finer split */
#define FIXED_D 128   /* the largest head_dim with fixed-length vector code */
#define SPLIT_BELOW 8 /* spread the chunks over the threads below this many items per thread */
#define MAX_SCRATCH ((size_t)32 << 20) /* bytes of partials at most, else whole items */
#define TILE_Q 16     /* q heads per item at most */
#define MAX_GROUP 8   /* q heads per KV head at most (kvs_limits): an item holds whole groups */
#define MAX_D 256
#define PREFETCH 8    /* slots ahead that the plain and AVX-512 paths fetch */
#define LOG2E 1.44269504088896341f
_Static_assert(CHUNK <= BLOCK, "a chunk is one block (chunk_bf16_avx512)");

/* A partial result for q heads h = 0, 1, ...: m[h] the max score (base 2), l[h] the sum of
 * 2^(s - m[h]), acc[h * d + x] the sum of 2^(s - m[h]) v[x].  For `heads` q heads it lives
 * in heads * (d + 2) floats. */
typedef struct {
    float *m, *l, *acc;
} partial;

static inline partial partial_at(float *base, int64_t heads) {
    return (partial){base, base + heads, base + 2 * heads};
}

/* One chunk of one item. */
typedef struct {
    const char *q;        /* the item's first q head */
    const int32_t *slots; /* the chunk's first slot */
    int64_t n;            /* tokens in the chunk */
    int64_t avail;        /* slots that may be read from `slots` on (the chunk's and the row's after it) */
    int64_t g0, kv_heads; /* the item's KV heads */
} unit;

typedef struct call call;

/* A chunk's partial result for the unit's kv_heads * group q heads.  Returns 1 when a slot
 * is outside the pool. */
typedef int (*chunk_fn)(const call *c, const unit *u, partial out);

/* One call's arguments and its cut into items. */
struct call {
    chunk_fn chunk;
    int bf16;
    const char *q, *k_cache, *v_cache;
    char *out;
    const int32_t *req_to_token;
    int64_t r2t_stride;
    const int64_t *rows, *lens;
    int64_t batch, hq, hkv, group, d, size;
    int64_t tile, tiles; /* KV heads per item; items per row */
    float scale;
};

static inline __attribute__((always_inline)) float load1(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The portable chunk: any d up to MAX_D, plain C (the compiler vectorizes the loops where
 * d is a constant). */
static inline __attribute__((always_inline)) int chunk_plain(const call *c, const unit *u, partial out,
                                                             const int64_t d, const int bf16) {
    const int64_t es = bf16 ? 2 : 4, group = c->group, slot_elems = c->hkv * d;
    const void *kc = c->k_cache + u->g0 * d * es, *vc = c->v_cache + u->g0 * d * es;
    float qf[MAX_GROUP][MAX_D], s[MAX_GROUP][BLOCK], kf[BLOCK][MAX_D];
    int64_t base[BLOCK];
    for (int64_t h = 0; h < u->kv_heads * group; h++) {
        for (int64_t x = 0; x < d; x++) out.acc[h * d + x] = 0.f;
        out.m[h] = -INFINITY;
        out.l[h] = 0.f;
    }
    for (int64_t t0 = 0; t0 < u->n; t0 += BLOCK) {
        const int64_t nb = u->n - t0 < BLOCK ? u->n - t0 : BLOCK;
        for (int64_t t = 0; t < nb; t++) {
            const int64_t slot = u->slots[t0 + t];
            if (slot < 0 || slot >= c->size) return 1;
            base[t] = slot * slot_elems;
            if (t0 + t + PREFETCH < u->avail) { /* slots are scattered: fetch ahead of the loop */
                const int64_t ahead = u->slots[t0 + t + PREFETCH];
                if (ahead >= 0 && ahead < c->size)
                    for (int64_t x = 0; x < u->kv_heads * d * es; x += 64) {
                        __builtin_prefetch((const char *)kc + ahead * slot_elems * es + x);
                        __builtin_prefetch((const char *)vc + ahead * slot_elems * es + x);
                    }
            }
        }
        for (int64_t h = 0; h < u->kv_heads; h++) {
            float *m = out.m + h * group, *l = out.l + h * group, *acc = out.acc + h * group * d;
            for (int64_t j = 0; j < group; j++)
                for (int64_t x = 0; x < d; x++) qf[j][x] = load1(u->q, (h * group + j) * d + x, bf16) * (c->scale * LOG2E);
            for (int64_t t = 0; t < nb; t++)
                for (int64_t x = 0; x < d; x++) kf[t][x] = load1(kc, base[t] + h * d + x, bf16);
            for (int64_t j = 0; j < group; j++) {
                float mx = m[j];
                for (int64_t t = 0; t < nb; t++) {
                    float dot = 0.f;
                    for (int64_t x = 0; x < d; x++) dot += qf[j][x] * kf[t][x];
                    s[j][t] = dot;
                    mx = dot > mx ? dot : mx;
                }
                const float corr = exp2f(m[j] - mx);
                float sum = 0.f;
                for (int64_t t = 0; t < nb; t++) { s[j][t] = exp2f(s[j][t] - mx); sum += s[j][t]; }
                l[j] = l[j] * corr + sum;
                m[j] = mx;
                for (int64_t x = 0; x < d; x++) acc[j * d + x] *= corr;
            }
            for (int64_t t = 0; t < nb; t++)
                for (int64_t x = 0; x < d; x++) kf[t][x] = load1(vc, base[t] + h * d + x, bf16);
            for (int64_t j = 0; j < group; j++)
                for (int64_t t = 0; t < nb; t++) {
                    const float p = s[j][t];
                    for (int64_t x = 0; x < d; x++) acc[j * d + x] += p * kf[t][x];
                }
        }
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

/* 2^x for a vector, x <= 0 or -inf (softmax arguments): an integer power of two built in
 * the exponent bits times a degree-6 polynomial of the fraction in [-1/2, 1/2] (Cephes'
 * exp2f coefficients; relative error about 2e-7).  Below -126.5 (-inf too) it gives 0. */
static inline __m256 exp2_256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-127.f), x); /* a NaN stays a NaN */
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    /* 2^n from its exponent field; n = -127 gives the bits of 0 */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Eight values of a row as float32: bfloat16 widens by a 16-bit shift. */
static inline __attribute__((always_inline)) __m256 load8(const void *row, int64_t x, const int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + x))), 16));
    return _mm256_loadu_ps((const float *)row + x);
}

/* The sums of eight vectors as one vector: lane i holds the sum of a[i]'s lanes. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* The sums of four vectors: lane i holds the sum of a[i]'s lanes. */
static inline __m128 hsum4x8(const __m256 a[4]) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Scores, float32 rows: s[t .. t+7] = qf . k_{t+i} for one q head (eight independent sums,
 * each row read whole at once, which suits the memory best). */
static inline __attribute__((always_inline)) void scores8(float *s, const float *qf, const char *const *rows,
                                                          int64_t t, const int64_t d) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t x = 0; x < d; x += 8) {
        const __m256 qv = _mm256_load_ps(qf + x);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps((const float *)rows[t + i] + x), a[i]);
    }
    _mm256_store_ps(s + t, hsum8x8(a));
}

/* Scores, bfloat16 rows: s[j][t .. t+3] = qf[j] . k_{t+i} for NJ (1 to 3) q heads of a group,
 * each K vector widened once for all NJ heads (4 x NJ independent sums). */
static inline __attribute__((always_inline)) void scores4(float s[][BLOCK], float qf[][FIXED_D],
                                                          const char *const *rows, int64_t t, const int nj,
                                                          const int64_t d) {
    __m256 a[3][4];
    for (int j = 0; j < nj; j++)
        for (int i = 0; i < 4; i++) a[j][i] = _mm256_setzero_ps();
    for (int64_t x = 0; x < d; x += 8) {
        __m256 qv[3];
        for (int j = 0; j < nj; j++) qv[j] = _mm256_load_ps(&qf[j][x]);
        for (int i = 0; i < 4; i++) {
            const __m256 kv = load8(rows[t + i], x, 1);
            for (int j = 0; j < nj; j++) a[j][i] = _mm256_fmadd_ps(qv[j], kv, a[j][i]);
        }
    }
    for (int j = 0; j < nj; j++) _mm_store_ps(&s[j][t], hsum4x8(a[j]));
}

/* acc[x0 .. x0+63] = corr acc[x0 .. x0+63] + sum over t < n of p[t] v_t[x0 .. x0+63] for one
 * q head: eight accumulators in registers, each row's values read at once. */
static inline __attribute__((always_inline)) void weigh64(float *acc, int64_t x0, const float *p, float corr,
                                                          const char *const *rows, int64_t n, const int bf16) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + x0 + 8 * i), _mm256_set1_ps(corr));
    for (int64_t t = 0; t < n; t++) {
        const __m256 pt = _mm256_broadcast_ss(&p[t]);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(pt, load8(rows[t], x0 + 8 * i, bf16), a[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + x0 + 8 * i, a[i]);
}

/* The AVX2 chunk for d 64 or 128: for each block and KV head, the scores of the group's q
 * heads, one online-softmax step each, then the V rows weighted in.  (Reading each row whole,
 * eight of them at a time for the scores, measured best from memory on AMD Zen 2; bfloat16
 * trades that for widening each K vector once per three q heads.) */
static inline __attribute__((always_inline)) int chunk_avx2(const call *c, const unit *u, partial out,
                                                            const int64_t d, const int bf16) {
    const int64_t es = bf16 ? 2 : 4, row_bytes = d * es, slot_bytes = c->hkv * row_bytes;
    const int64_t group = c->group;
    const char *kc = c->k_cache + u->g0 * row_bytes, *vc = c->v_cache + u->g0 * row_bytes;
    float qf[MAX_GROUP][FIXED_D] __attribute__((aligned(32)));
    float s[MAX_GROUP][BLOCK] __attribute__((aligned(32)));
    float corr[MAX_GROUP];
    int64_t off[BLOCK];
    const char *krows[BLOCK], *vrows[BLOCK];
    const __m256 qscale = _mm256_set1_ps(c->scale * LOG2E);
    for (int64_t h = 0; h < u->kv_heads * group; h++) {
        for (int64_t x = 0; x < d; x += 8) _mm256_storeu_ps(out.acc + h * d + x, _mm256_setzero_ps());
        out.m[h] = -INFINITY;
        out.l[h] = 0.f;
    }
    for (int64_t t0 = 0; t0 < u->n; t0 += BLOCK) {
        const int64_t nb = u->n - t0 < BLOCK ? u->n - t0 : BLOCK, nb8 = (nb + 7) & ~(int64_t)7;
        /* the block's slots, checked (no software prefetch: the hardware's does better on
         * each slot's rows of the item's KV heads, one run of memory) */
        for (int64_t t = 0; t < nb; t++) {
            const int64_t slot = u->slots[t0 + t];
            if (slot < 0 || slot >= c->size) return 1;
            off[t] = slot * slot_bytes;
        }
        for (int64_t t = nb; t < nb8; t++) off[t] = off[0]; /* their scores are masked */
        for (int64_t g = 0; g < u->kv_heads; g++) {
            const int64_t h0 = g * group;
            float *m = out.m + h0, *l = out.l + h0, *acc = out.acc + h0 * d;
            for (int64_t t = 0; t < nb8; t++) {
                krows[t] = kc + off[t] + g * row_bytes;
                vrows[t] = vc + off[t] + g * row_bytes;
            }
            for (int64_t j = 0; j < group; j++)
                for (int64_t x = 0; x < d; x += 8)
                    _mm256_store_ps(&qf[j][x], _mm256_mul_ps(load8(u->q, (h0 + j) * d + x, bf16), qscale));
            /* the scores; padding tokens get -inf */
            if (bf16) {
                for (int64_t j0 = 0; j0 < group; j0 += 3)
                    for (int64_t t = 0; t < nb; t += 4) {
                        if (group - j0 >= 3) scores4(s + j0, qf + j0, krows, t, 3, d);
                        else if (group - j0 == 2) scores4(s + j0, qf + j0, krows, t, 2, d);
                        else scores4(s + j0, qf + j0, krows, t, 1, d);
                    }
            } else {
                for (int64_t j = 0; j < group; j++)
                    for (int64_t t = 0; t < nb; t += 8) scores8(s[j], qf[j], krows, t, d);
            }
            for (int64_t j = 0; j < group; j++)
                for (int64_t t = nb; t < nb8; t++) s[j][t] = -INFINITY;
            /* one online-softmax step per q head: s becomes the block's weights */
            for (int64_t j = 0; j < group; j++) {
                __m256 mx = _mm256_set1_ps(m[j]);
                for (int64_t t = 0; t < nb8; t += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(&s[j][t]));
                const float mnew = hmax256(mx);
                const __m256 mv = _mm256_set1_ps(mnew);
                __m256 sum = _mm256_setzero_ps();
                for (int64_t t = 0; t < nb8; t += 8) {
                    const __m256 p = exp2_256(_mm256_sub_ps(_mm256_load_ps(&s[j][t]), mv));
                    _mm256_store_ps(&s[j][t], p);
                    sum = _mm256_add_ps(sum, p);
                }
                corr[j] = exp2f(m[j] - mnew);
                l[j] = l[j] * corr[j] + hsum256(sum);
                m[j] = mnew;
            }
            /* the block's V rows weighted into each q head's accumulator */
            for (int64_t j = 0; j < group; j++)
                for (int64_t x0 = 0; x0 < d; x0 += 64) weigh64(acc + j * d, x0, s[j], corr[j], vrows, nb, bf16);
        }
    }
    return 0;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1

/* 2^x for a vector, x <= 0 or -inf (softmax arguments): an integer power (scalef) times a
 * degree-6 polynomial of the fraction (as exp2_256). */
static inline __m512 exp2_512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-150.f), x); /* 2^-150 is 0 in float32; -inf too */
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* The sums of sixteen vectors' lanes in one vector, a 16 x 16 transpose folded into 45
 * shuffles and adds: lane i holds the sum of a[4 (i % 4) + i / 4]'s lanes. */
static inline __attribute__((always_inline)) __m512 hsum16x16(const __m512 a[16]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: lanes 0-7 a[2i]'s, 8-15 a[2i + 1]'s */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* 128-bit quarters: quarter k a[4i + k]'s */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* quarter k: a[8i + k], a[8i + 4 + k], twice each */
        e[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]), _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

/* The bf16 chunk with AVX-512 BF16 dot products, d 64 or 128; a chunk is one block.  Per
 * KV head: each q head's scores sixteen tokens at a time (a token's dot product in the lanes
 * of one accumulator, sixteen of them summed across lanes at once), one softmax, then the
 * group's q heads weigh each V row in as it is widened.  A V row widens as its even and its
 * odd values (a shift and a mask of the same load), so the accumulators hold a head's d values
 * in that order until they are stored. */
static inline __attribute__((always_inline)) int chunk_bf16_avx512(const call *c, const unit *u, partial out,
                                                                   const int64_t d) {
    const int64_t jv = d == 64 ? 4 : 2; /* q heads weighing V at once: 16 accumulators in registers */
    const int64_t group = c->group, slot_elems = c->hkv * d, n = u->n, n16 = (n + 15) & ~(int64_t)15;
    const uint16_t *q = (const uint16_t *)u->q;
    const uint16_t *k_cache = (const uint16_t *)c->k_cache + u->g0 * d, *v_cache = (const uint16_t *)c->v_cache + u->g0 * d;
    float s[MAX_GROUP][BLOCK] __attribute__((aligned(64)));
    int64_t base[BLOCK];
    const __m512 sc = _mm512_set1_ps(c->scale * LOG2E), neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const int64_t tail = n - (n16 - 16); /* tokens in the last group of 16 */
    const __mmask16 last = (__mmask16)(tail == 16 ? 0xffff : (1u << tail) - 1u);
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = u->slots[t];
        if (slot < 0 || slot >= c->size) return 1;
        base[t] = slot * slot_elems;
        if (t + PREFETCH < u->avail) { /* slots are scattered: fetch ahead of the loop */
            const int64_t ahead = u->slots[t + PREFETCH];
            if (ahead >= 0 && ahead < c->size)
                for (int64_t x = 0; x < u->kv_heads * d; x += 32) {
                    _mm_prefetch((const char *)(k_cache + ahead * slot_elems + x), _MM_HINT_T0);
                    _mm_prefetch((const char *)(v_cache + ahead * slot_elems + x), _MM_HINT_T0);
                }
        }
    }
    for (int64_t t = n; t < n16; t++) base[t] = base[0]; /* read, their scores masked */
    for (int64_t h = 0; h < u->kv_heads; h++) {
        const uint16_t *kh = k_cache + h * d, *vh = v_cache + h * d;
        for (int64_t j = 0; j < group; j++) {
            const int64_t qh = h * group + j;
            __m512bh qv[FIXED_D / 32];
            for (int64_t v = 0; v < d / 32; v++) qv[v] = (__m512bh)_mm512_loadu_si512(q + qh * d + 32 * v);
            __m512 mv = neg_inf;
            for (int64_t t0 = 0; t0 < n16; t0 += 16) {
                __m512 a[16];
                for (int i = 0; i < 16; i++) {
                    const uint16_t *kr = kh + base[t0 + i];
                    __m512 dot = _mm512_setzero_ps();
                    for (int64_t v = 0; v < d / 32; v++)
                        dot = _mm512_dpbf16_ps(dot, qv[v], (__m512bh)_mm512_loadu_si512(kr + 32 * v));
                    a[(i % 4) * 4 + i / 4] = dot;
                }
                __m512 sv = _mm512_mul_ps(hsum16x16(a), sc);
                if (t0 + 16 == n16) sv = _mm512_mask_blend_ps(last, neg_inf, sv);
                _mm512_store_ps(&s[j][t0], sv);
                mv = _mm512_max_ps(mv, sv);
            }
            const float mx = _mm512_reduce_max_ps(mv);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t0 = 0; t0 < n16; t0 += 16) {
                const __m512 e = exp2_512(_mm512_sub_ps(_mm512_load_ps(&s[j][t0]), _mm512_set1_ps(mx)));
                _mm512_store_ps(&s[j][t0], e);
                sum = _mm512_add_ps(sum, e);
            }
            out.m[qh] = mx;
            out.l[qh] = _mm512_reduce_add_ps(sum);
        }
        for (int64_t j0 = 0; j0 < group; j0 += jv) {
            const int64_t nj = group - j0 < jv ? group - j0 : jv;
            __m512 acc[4][FIXED_D / 16]; /* [q head][even, odd values of each 32] */
            for (int j = 0; j < jv; j++)
                for (int64_t x = 0; x < d / 16; x++) acc[j][x] = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const uint16_t *vr = vh + base[t];
                __m512 vf[FIXED_D / 16];
                for (int64_t v = 0; v < d / 32; v++) {
                    const __m512i w = _mm512_loadu_si512(vr + 32 * v);
                    vf[2 * v] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                    vf[2 * v + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, odd));
                }
                for (int j = 0; j < jv; j++)
                    if (j < nj) {
                        const __m512 p = _mm512_set1_ps(s[j0 + j][t]);
                        for (int64_t x = 0; x < d / 16; x++) acc[j][x] = _mm512_fmadd_ps(p, vf[x], acc[j][x]);
                    }
            }
            for (int j = 0; j < nj; j++) {
                float *o = out.acc + (h * group + j0 + j) * d;
                for (int64_t v = 0; v < d / 32; v++) {
                    _mm512_storeu_ps(o + 32 * v, _mm512_permutex2var_ps(acc[j][2 * v], lo_idx, acc[j][2 * v + 1]));
                    _mm512_storeu_ps(o + 32 * v + 16, _mm512_permutex2var_ps(acc[j][2 * v], hi_idx, acc[j][2 * v + 1]));
                }
            }
        }
    }
    return 0;
}
#endif

/* The chunk functions, one per cache dtype, each choosing by d.  Never inlined: the item
 * and the split ways call the very same code, so that their results are the same bits. */
static __attribute__((noinline)) int chunk_f32(const call *c, const unit *u, partial out) {
#ifdef HAVE_AVX2
    if (c->d == 64) return chunk_avx2(c, u, out, 64, 0);
    if (c->d == 128) return chunk_avx2(c, u, out, 128, 0);
#else
    if (c->d == 64) return chunk_plain(c, u, out, 64, 0);
    if (c->d == 128) return chunk_plain(c, u, out, 128, 0);
#endif
    return chunk_plain(c, u, out, c->d, 0);
}

static __attribute__((noinline)) int chunk_bf16(const call *c, const unit *u, partial out) {
#if defined(HAVE_AVX512_BF16)
    if (c->d == 64) return chunk_bf16_avx512(c, u, out, 64);
    if (c->d == 128) return chunk_bf16_avx512(c, u, out, 128);
#elif defined(HAVE_AVX2)
    if (c->d == 64) return chunk_avx2(c, u, out, 64, 1);
    if (c->d == 128) return chunk_avx2(c, u, out, 128, 1);
#else
    if (c->d == 64) return chunk_plain(c, u, out, 64, 1);
    if (c->d == 128) return chunk_plain(c, u, out, 128, 1);
#endif
    return chunk_plain(c, u, out, c->d, 1);
}

/* run <- run merged with the next chunk's part, for `heads` q heads (a run's m of -inf, l
 * and acc of 0 take part as it is).  Never inlined, for the same bits both ways. */
static __attribute__((noinline)) void merge(partial run, partial part, int64_t heads, int64_t d) {
    for (int64_t h = 0; h < heads; h++) {
        const float m = run.m[h] > part.m[h] ? run.m[h] : part.m[h];
        const float a = exp2f(run.m[h] - m), b = exp2f(part.m[h] - m);
        run.l[h] = run.l[h] * a + part.l[h] * b;
        for (int64_t x = 0; x < d; x++) run.acc[h * d + x] = run.acc[h * d + x] * a + part.acc[h * d + x] * b;
        run.m[h] = m;
    }
}

/* A row's chunks: fixed by its length alone. */
static inline int64_t chunk_len(int64_t len) { return len <= SHORT ? CHUNK / 2 : CHUNK; }
static inline int64_t chunks_of(int64_t len) { return (len + chunk_len(len) - 1) / chunk_len(len); }

/* Tile i of row b's KV heads: its first KV head and how many. */
static inline int64_t tile_g0(const call *c, int64_t i) { return i * c->tile; }
static inline int64_t tile_heads(const call *c, int64_t i) {
    return c->hkv - i * c->tile < c->tile ? c->hkv - i * c->tile : c->tile;
}

static int run_chunk(const call *c, int64_t b, int64_t i, int64_t chunk, partial out) {
    const int64_t len = c->lens[b], step = chunk_len(len), t0 = chunk * step, g0 = tile_g0(c, i);
    const unit u = {c->q + (b * c->hq + g0 * c->group) * c->d * (c->bf16 ? 2 : 4),
                    c->req_to_token + c->rows[b] * c->r2t_stride + t0, len - t0 < step ? len - t0 : step,
                    len - t0, g0, tile_heads(c, i)};
    return c->chunk(c, &u, out);
}

/* out[b, tile i's q heads] = the merged run, normalized.  Never inlined, as merge. */
static __attribute__((noinline)) void finish(const call *c, int64_t b, int64_t i, partial run) {
    const int64_t off = (b * c->hq + tile_g0(c, i) * c->group) * c->d;
    for (int64_t h = 0; h < tile_heads(c, i) * c->group; h++) {
        const float inv = run.l[h] > 0.f ? 1.f / run.l[h] : 0.f;
        for (int64_t x = 0; x < c->d; x++) {
            const float o = run.acc[h * c->d + x] * inv;
            if (c->bf16) ((uint16_t *)c->out)[off + h * c->d + x] = f32_to_bf16(o);
            else ((float *)c->out)[off + h * c->d + x] = o;
        }
    }
}

/* Keeps the first batch row with a slot outside the pool. */
static void note_bad(int *bad, int64_t b) {
#pragma omp critical(kvs_decode_attention_bad)
    if (*bad == 0 || b + 1 < *bad) *bad = (int)b + 1;
}

/* Each thread takes whole items (row b, tile i), merging their chunks as it goes. */
static int attend_items(const call *c) {
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) if (c->batch * c->tiles > 1)
    for (int64_t item = 0; item < c->batch * c->tiles; item++) {
        const int64_t b = item / c->tiles, i = item % c->tiles, heads = tile_heads(c, i) * c->group;
        float run_buf[TILE_Q * (MAX_D + 2)], part_buf[TILE_Q * (MAX_D + 2)];
        const partial run = partial_at(run_buf, heads), part = partial_at(part_buf, heads);
        int oob = run_chunk(c, b, i, 0, run);
        for (int64_t k = 1; k < chunks_of(c->lens[b]) && !oob; k++) {
            oob = run_chunk(c, b, i, k, part);
            if (!oob) merge(run, part, heads, c->d);
        }
        if (oob) note_bad(&bad, b);
        else finish(c, b, i, run);
    }
    return bad;
}

/* The chunks of all items spread over the threads, their partials in parts (row b's from
 * unit first[b] on, chunk-major), then each item's partials merged in chunk order.  (Whole
 * items leave threads idle or unevenly loaded below a few items per thread: on 2 threads a
 * batch of 5 or 7 took 12-21% longer than split, one of 4 or 6 as long.) */
static int attend_split(const call *c, const int64_t *first, float *parts) {
    const int64_t units = first[c->batch], stride = c->tile * c->group * (c->d + 2);
    int bad = 0;
#pragma omp parallel
    {
#pragma omp for schedule(guided) /* each thread a run of consecutive chunks, then the rest */
        for (int64_t u = 0; u < units; u++) {
            int64_t b = 0, hi = c->batch - 1; /* the row b with first[b] <= u < first[b + 1] */
            while (b < hi) {
                const int64_t mid = (b + hi + 1) / 2;
                if (first[mid] <= u) b = mid;
                else hi = mid - 1;
            }
            const int64_t i = (u - first[b]) % c->tiles, k = (u - first[b]) / c->tiles;
            if (run_chunk(c, b, i, k, partial_at(parts + u * stride, tile_heads(c, i) * c->group)))
                note_bad(&bad, b);
        }
        int any_bad; /* after the loop's barrier: the same for every thread */
#pragma omp atomic read
        any_bad = bad;
        if (!any_bad) {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < c->batch * c->tiles; item++) {
                const int64_t b = item / c->tiles, i = item % c->tiles, heads = tile_heads(c, i) * c->group;
                const partial run = partial_at(parts + (first[b] + i) * stride, heads);
                for (int64_t k = 1; k < chunks_of(c->lens[b]); k++)
                    merge(run, partial_at(parts + (first[b] + k * c->tiles + i) * stride, heads), heads, c->d);
                finish(c, b, i, run);
            }
        }
    }
    return bad;
}

/* Both kernels: rows and lengths checked, then whole items or chunks spread. */
static int attend(chunk_fn chunk, int bf16, const void *q, const void *k_cache, const void *v_cache, void *out,
                  const int32_t *req_to_token, int64_t r2t_rows, int64_t r2t_stride, const int64_t *rows,
                  const int64_t *lens, int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t size,
                  float sm_scale) {
    for (int64_t b = 0; b < batch; b++)
        if (rows[b] < 0 || rows[b] >= r2t_rows || lens[b] < 1 || lens[b] > r2t_stride) return -(int)(b + 1);
    const int64_t group = hq / hkv, groups = TILE_Q / group > 1 ? TILE_Q / group : 1;
    const int64_t tile = groups < hkv ? groups : hkv;
    const call c = {chunk, bf16, q, k_cache, v_cache, out, req_to_token, r2t_stride, rows, lens,
                    batch, hq, hkv, group, d, size, tile, (hkv + tile - 1) / tile, sm_scale};
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    if (threads == 1 || batch * c.tiles >= SPLIT_BELOW * threads) return attend_items(&c);
    int64_t units = 0;
    for (int64_t b = 0; b < batch; b++) units += chunks_of(lens[b]) * c.tiles;
    if (units == batch * c.tiles) return attend_items(&c); /* one chunk per item: nothing to spread */
    const size_t bytes = (size_t)(batch + 1) * sizeof(int64_t) + (size_t)(units * tile * group * (d + 2)) * sizeof(float);
    int64_t *first = bytes <= MAX_SCRATCH ? scratch(bytes) : NULL;
    if (first == NULL) return attend_items(&c);
    first[0] = 0;
    for (int64_t b = 0; b < batch; b++) first[b + 1] = first[b] + chunks_of(lens[b]) * c.tiles;
    return attend_split(&c, first, (float *)(first + batch + 1));
}

int kvs_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                             const int32_t *req_to_token, int64_t r2t_rows, int64_t r2t_stride,
                             const int64_t *rows, const int64_t *lens, int64_t batch, int64_t hq,
                             int64_t hkv, int64_t d, int64_t size, float sm_scale) {
    return attend(chunk_f32, 0, q, k_cache, v_cache, out, req_to_token, r2t_rows, r2t_stride, rows, lens,
                  batch, hq, hkv, d, size, sm_scale);
}

int kvs_decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              uint16_t *out, const int32_t *req_to_token, int64_t r2t_rows,
                              int64_t r2t_stride, const int64_t *rows, const int64_t *lens, int64_t batch,
                              int64_t hq, int64_t hkv, int64_t d, int64_t size, float sm_scale) {
    return attend(chunk_bf16, 1, q, k_cache, v_cache, out, req_to_token, r2t_rows, r2t_stride, rows, lens,
                  batch, hq, hkv, d, size, sm_scale);
}

int kvs_limits(int64_t *max_group, int64_t *max_d) {
    *max_group = MAX_GROUP;
    *max_d = MAX_D;
    return 0;
}

/* 1 when this build has the AVX-512 BF16 path for bfloat16 caches. */
int kvs_avx512_bf16(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}
