/* Decode attention over kvserve's token-level KV pool, reading each request's slots in place.
 *
 * One query token per request (batch row b) attends to the first lens[b] tokens of its
 * request, whose K/V live at pool slots req_to_token[rows[b]][0 .. lens[b]-1].  The pool of
 * one layer is [size, Hkv, D]; the q heads of one KV group (Hq / Hkv of them) share each K/V
 * read.  Softmax runs online over blocks of BLOCK tokens in float32.  Work items are
 * (request, KV head) pairs, split over the OpenMP threads of the process (torch's runtime,
 * already loaded, so torch.set_num_threads governs it).  head_dim 64 and 128 get loops of
 * fixed length, which the compiler vectorizes for the CPU it builds on.
 *
 * Built at run time (kvserve/kernels/native.py); plain C, no torch headers.  Returns 0;
 * -(1 + b) when batch row b's row of req_to_token or length is out of its bounds (nothing
 * is computed); 1 + b when row b holds a slot index outside the pool (nothing is read out
 * of bounds; the output is then undefined).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define BLOCK 32
#define MAX_GROUP 8
#define MAX_D 256
#define PREFETCH 8

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1

/* exp(x) for a vector, x <= 0 or -inf (softmax arguments): 2^(x log2 e) split into an integer
 * power (scalef) and a degree-6 polynomial of the fraction; relative error about 2e-7. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f)); /* exp(-104) is 0 in float32; -inf too */
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* The bf16 item with AVX-512 BF16 dot products; D a multiple of 32, BLOCK a multiple of 16. */
static inline __attribute__((always_inline)) int item_bf16_avx512(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out,
    const int32_t *slots, int64_t len, int64_t hkv, int64_t g, int64_t group, const int64_t d,
    int64_t size, float sm_scale) {
    __m512bh qv[MAX_GROUP][MAX_D / 32];
    __m512 acc[MAX_GROUP][MAX_D / 16];
    float s[MAX_GROUP][BLOCK] __attribute__((aligned(64)));
    float m[MAX_GROUP], l[MAX_GROUP];
    const __m512 scale = _mm512_set1_ps(sm_scale);
    for (int64_t j = 0; j < group; j++) {
        for (int64_t v = 0; v < d / 32; v++) qv[j][v] = (__m512bh)_mm512_loadu_si512(q + j * d + 32 * v);
        for (int64_t c = 0; c < d / 16; c++) acc[j][c] = _mm512_setzero_ps();
        m[j] = -INFINITY;
        l[j] = 0.f;
    }
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;
        for (int64_t t = 0; t < n; t++) {
            const int64_t slot = slots[t0 + t];
            if (slot < 0 || slot >= size) return 1;
            const uint16_t *kr = k_cache + (slot * hkv + g) * d;
            if (t0 + t + PREFETCH < len) { /* slots are scattered: fetch ahead of the loop */
                const int64_t ahead = slots[t0 + t + PREFETCH];
                if (ahead >= 0 && ahead < size)
                    for (int64_t x = 0; x < d; x += 32) _mm_prefetch((const char *)(k_cache + (ahead * hkv + g) * d + x), _MM_HINT_T0);
            }
            for (int64_t x = 0; x < d; x += 32) _mm_prefetch((const char *)(v_cache + (slot * hkv + g) * d + x), _MM_HINT_T0);
            __m512bh kv[MAX_D / 32];
            for (int64_t v = 0; v < d / 32; v++) kv[v] = (__m512bh)_mm512_loadu_si512(kr + 32 * v);
            for (int64_t j = 0; j < group; j++) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t v = 0; v < d / 32; v++) a = _mm512_dpbf16_ps(a, qv[j][v], kv[v]);
                s[j][t] = _mm512_reduce_add_ps(a);
            }
        }
        for (int64_t t = n; t < BLOCK; t++)
            for (int64_t j = 0; j < group; j++) s[j][t] = -INFINITY;
        for (int64_t j = 0; j < group; j++) {
            __m512 mv = _mm512_set1_ps(m[j]);
            for (int64_t t = 0; t < BLOCK; t += 16)
                mv = _mm512_max_ps(mv, _mm512_mul_ps(_mm512_load_ps(&s[j][t]), scale));
            const float mx = _mm512_reduce_max_ps(mv);
            const float corr = expf(m[j] - mx);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < BLOCK; t += 16) {
                const __m512 e = exp512(_mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(&s[j][t]), scale),
                                                      _mm512_set1_ps(mx)));
                _mm512_store_ps(&s[j][t], e);
                sum = _mm512_add_ps(sum, e);
            }
            l[j] = l[j] * corr + _mm512_reduce_add_ps(sum);
            m[j] = mx;
            const __m512 cv = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < d / 16; c++) acc[j][c] = _mm512_mul_ps(acc[j][c], cv);
        }
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *vr = v_cache + ((int64_t)slots[t0 + t] * hkv + g) * d;
            __m512 vf[MAX_D / 16];
            for (int64_t c = 0; c < d / 16; c++)
                vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr + 16 * c))), 16));
            for (int64_t j = 0; j < group; j++) {
                const __m512 p = _mm512_set1_ps(s[j][t]);
                for (int64_t c = 0; c < d / 16; c++) acc[j][c] = _mm512_fmadd_ps(p, vf[c], acc[j][c]);
            }
        }
    }
    for (int64_t j = 0; j < group; j++) {
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        float o[MAX_D] __attribute__((aligned(64)));
        for (int64_t c = 0; c < d / 16; c++) _mm512_store_ps(o + 16 * c, _mm512_mul_ps(acc[j][c], _mm512_set1_ps(inv)));
        for (int64_t x = 0; x < d; x++) out[j * d + x] = f32_to_bf16(o[x]);
    }
    return 0;
}
#endif

/* One (request, KV head) item: returns 1 when a slot is outside the pool.  FAST_ITEM is the
 * item function for head_dim 64 and 128 (NAME itself where no faster one is built). */
#define DEFINE_ITEM(NAME, T, LOAD, STORE, FAST_ITEM)                                                     \
static inline __attribute__((always_inline)) int NAME(                                          \
    const T *q, const T *k_cache, const T *v_cache, T *out, const int32_t *slots, int64_t len,  \
    int64_t hkv, int64_t g, int64_t group, const int64_t d, int64_t size, float sm_scale) {     \
    float qf[MAX_GROUP][MAX_D], acc[MAX_GROUP][MAX_D], s[MAX_GROUP][BLOCK];                     \
    float m[MAX_GROUP], l[MAX_GROUP], kf[BLOCK][MAX_D];                                         \
    for (int64_t j = 0; j < group; j++) {                                                       \
        for (int64_t x = 0; x < d; x++) { qf[j][x] = LOAD(q[j * d + x]) * sm_scale; acc[j][x] = 0.f; } \
        m[j] = -INFINITY;                                                                       \
        l[j] = 0.f;                                                                             \
    }                                                                                           \
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {                                               \
        const int64_t n = len - t0 < BLOCK ? len - t0 : BLOCK;                                  \
        for (int64_t t = 0; t < n; t++) {                                                       \
            const int64_t slot = slots[t0 + t];                                                 \
            if (slot < 0 || slot >= size) return 1;                                             \
            const T *kr = k_cache + (slot * hkv + g) * d;                                       \
            if (t0 + t + PREFETCH < len) {                                                      \
                const int64_t ahead = slots[t0 + t + PREFETCH];                                 \
                if (ahead >= 0 && ahead < size)                                                 \
                    for (int64_t x = 0; x < d; x += 64 / (int64_t)sizeof(T))                    \
                        __builtin_prefetch(k_cache + (ahead * hkv + g) * d + x);                \
            }                                                                                   \
            for (int64_t x = 0; x < d; x += 64 / (int64_t)sizeof(T))                            \
                __builtin_prefetch(v_cache + (slot * hkv + g) * d + x);                         \
            for (int64_t x = 0; x < d; x++) kf[t][x] = LOAD(kr[x]);                             \
        }                                                                                       \
        for (int64_t j = 0; j < group; j++) {                                                   \
            float mx = m[j];                                                                    \
            for (int64_t t = 0; t < n; t++) {                                                   \
                float dot = 0.f;                                                                \
                for (int64_t x = 0; x < d; x++) dot += qf[j][x] * kf[t][x];                     \
                s[j][t] = dot;                                                                  \
                mx = dot > mx ? dot : mx;                                                       \
            }                                                                                   \
            const float corr = expf(m[j] - mx);                                                 \
            float sum = 0.f;                                                                    \
            for (int64_t t = 0; t < n; t++) { s[j][t] = expf(s[j][t] - mx); sum += s[j][t]; }   \
            l[j] = l[j] * corr + sum;                                                           \
            m[j] = mx;                                                                          \
            for (int64_t x = 0; x < d; x++) acc[j][x] *= corr;                                  \
        }                                                                                       \
        for (int64_t t = 0; t < n; t++) {                                                       \
            const T *vr = v_cache + ((int64_t)slots[t0 + t] * hkv + g) * d;                     \
            for (int64_t x = 0; x < d; x++) kf[t][x] = LOAD(vr[x]);                             \
        }                                                                                       \
        for (int64_t j = 0; j < group; j++)                                                     \
            for (int64_t t = 0; t < n; t++) {                                                   \
                const float p = s[j][t];                                                        \
                for (int64_t x = 0; x < d; x++) acc[j][x] += p * kf[t][x];                      \
            }                                                                                   \
    }                                                                                           \
    for (int64_t j = 0; j < group; j++) {                                                       \
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;                                        \
        for (int64_t x = 0; x < d; x++) out[j * d + x] = STORE(acc[j][x] * inv);                \
    }                                                                                           \
    return 0;                                                                                   \
}                                                                                               \
                                                                                                \
int kvs_##NAME(const T *q, const T *k_cache, const T *v_cache, T *out,                          \
               const int32_t *req_to_token, int64_t r2t_rows, int64_t r2t_stride,               \
               const int64_t *rows, const int64_t *lens, int64_t batch, int64_t hq, int64_t hkv, \
               int64_t d, int64_t size, float sm_scale) {                                       \
    const int64_t group = hq / hkv;                                                             \
    int bad = 0;                                                                                \
    for (int64_t b = 0; b < batch; b++)                                                         \
        if (rows[b] < 0 || rows[b] >= r2t_rows || lens[b] < 1 || lens[b] > r2t_stride)          \
            return -(int)(b + 1);                                                               \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                            \
    for (int64_t item = 0; item < batch * hkv; item++) {                                        \
        const int64_t b = item / hkv, g = item % hkv;                                           \
        const int32_t *slots = req_to_token + rows[b] * r2t_stride;                              \
        const int64_t off = (b * hq + g * group) * d;                                           \
        int oob;                                                                                \
        if (d == 64)                                                                            \
            oob = FAST_ITEM(q + off, k_cache, v_cache, out + off, slots, lens[b], hkv, g, group, 64, size, sm_scale); \
        else if (d == 128)                                                                      \
            oob = FAST_ITEM(q + off, k_cache, v_cache, out + off, slots, lens[b], hkv, g, group, 128, size, sm_scale); \
        else                                                                                    \
            oob = NAME(q + off, k_cache, v_cache, out + off, slots, lens[b], hkv, g, group, d, size, sm_scale); \
        if (oob) {                                                                              \
            _Pragma("omp atomic write")                                                         \
            bad = (int)b + 1;                                                                   \
        }                                                                                       \
    }                                                                                           \
    return bad;                                                                                 \
}

#ifdef HAVE_AVX512_BF16
DEFINE_ITEM(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16, item_bf16_avx512)
#else
DEFINE_ITEM(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16, decode_attention_bf16)
#endif
DEFINE_ITEM(decode_attention_f32, float, f32_id, f32_id, decode_attention_f32)

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
