/* One Llama decoder layer for a decode step of a few rows, in one call (issue 18).
 *
 * At one stream a decode step of the default model is 30 layers of about twenty small
 * operations each, and the Python between them (a torch op or a ctypes call per operation,
 * each a few microseconds) cost as much as the 4-bit products.  This file runs a whole
 * layer from C on the kernels the separate calls use, in the same order, so the numbers
 * are theirs (the SiLU is this file's, kvs_silu_mul, which the separate calls take too):
 *
 *   n = rms_norm(x)            -> qkv = n @ Wqkv.T (int4_mm)
 *   q, k = rotary(qkv)         -> k, v stored at the tokens' slots (store_rows)
 *   o = decode_attention(q)    -> x = x + o @ Wo.T
 *   n = rms_norm(x)            -> gate, up = n @ Wgate_up.T
 *   a = silu(gate) * up        -> x = x + a @ Wdown.T
 *
 * x [T, hidden] is updated in place.  Every token is one decode request (token t is batch
 * row t of the attention).  The 4-bit weights are int4_mm.c's layout; biases are not taken
 * (the caller keeps the separate calls for a model with them).  The additions and the SiLU
 * round as torch's ops in the model dtype do (bf16: each result rounded).  Scratch is
 * per thread and grows on demand.
 *
 * Returns 0, or (nothing after the failing stage is done; x may be half updated):
 *   KVS_LAYER_NO_SCRATCH   memory ran out
 *   KVS_LAYER_POSITION     a position outside the rotary tables (token *err)
 *   KVS_LAYER_SLOT         a slot outside the pool for the store (token *err; nothing stored)
 *   KVS_LAYER_ROW          a row of req_to_token or a length outside its bounds (row *err)
 *   KVS_LAYER_POOL         req_to_token names a slot outside the pool (row *err)
 *   KVS_LAYER_INT4         the 4-bit kernel refused (no kernel in this build, or a K it
 *                          does not take; its running out of memory is NO_SCRATCH)
 * Plain C, built with the other kernels (kvserve/kernels/native/loader.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "scratch.h"

enum {
    KVS_LAYER_NO_SCRATCH = 1,
    KVS_LAYER_POSITION = 2,
    KVS_LAYER_SLOT = 3,
    KVS_LAYER_ROW = 4,
    KVS_LAYER_POOL = 5,
    KVS_LAYER_INT4 = 6,
};

/* The kernels of the other files. */
int kvs_int4_mm(const void *x, int x_bf16, int64_t x_stride, int64_t m_rows, int64_t k,
                const uint8_t *nib, const uint16_t *wd, const uint16_t *wm, int64_t n_out,
                void *y, int y_bf16);
int kvs_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
                     int64_t x_stride, float eps);
int kvs_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                      int64_t dim, int64_t x_stride, float eps);
int kvs_rotary_f32(const float *src, int64_t src_stride, float *out, const float *cos_tab,
                   const float *sin_tab, int64_t table_rows, const int64_t *positions,
                   int64_t tokens, int64_t heads, int64_t d);
int kvs_rotary_bf16(const uint16_t *src, int64_t src_stride, uint16_t *out, const float *cos_tab,
                    const float *sin_tab, int64_t table_rows, const int64_t *positions,
                    int64_t tokens, int64_t heads, int64_t d);
int kvs_store_rows(const char *src, int64_t src_stride_bytes, char *dst, int64_t dst_rows,
                   const int64_t *loc, int64_t tokens, int64_t row_bytes);
int kvs_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                             const int32_t *req_to_token, int64_t r2t_rows, int64_t r2t_stride,
                             const int64_t *rows, const int64_t *lens, int64_t batch, int64_t hq,
                             int64_t hkv, int64_t d, int64_t size, float sm_scale);
int kvs_decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              uint16_t *out, const int32_t *req_to_token, int64_t r2t_rows,
                              int64_t r2t_stride, const int64_t *rows, const int64_t *lens,
                              int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t size,
                              float sm_scale);

/* A 4-bit weight [n, k] in int4_mm.c's layout. */
typedef struct {
    const uint8_t *nib;
    const uint16_t *d, *m;
    int64_t n, k;
} kvs_int4_weight;

/* One layer's weights (the norms in the model dtype). */
typedef struct {
    const void *input_norm, *post_norm;
    kvs_int4_weight qkv, o, gate_up, down;
    float eps;
} kvs_layer;

/* One step's shapes and attention inputs, shared by its layers. */
typedef struct {
    int64_t tokens, hidden, heads, kv_heads, head_dim, inter;
    const int64_t *positions;      /* [tokens] */
    const float *cos, *sin;        /* [table_rows, head_dim / 2] */
    int64_t table_rows;
    const int64_t *loc;            /* [tokens] the slots of the new K/V */
    const int32_t *req_to_token;   /* [r2t_rows, r2t_stride] */
    int64_t r2t_rows, r2t_stride;
    const int64_t *rows, *lens;    /* [tokens] each token's row of req_to_token and length */
    int64_t pool_size;             /* slots of one layer's cache */
    float sm_scale;
} kvs_step;

static inline float silu(float g) { return g / (1.f + expf(-g)); }

/* x [rows, dim] += y [rows, dim], each sum rounded to the model dtype. */
static void add_rows(void *x, const void *y, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *a = x;
        const uint16_t *b = y;
        for (int64_t i = 0; i < n; i++) a[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
    } else {
        float *a = x;
        const float *b = y;
        for (int64_t i = 0; i < n; i++) a[i] += b[i];
    }
}

/* out [rows, inter] = silu(gate) * up for gu [rows, 2 * inter] (gate first), rounding the
 * SiLU and then the product to the model dtype as torch's two ops do. */
static void silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf16) {
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gu + r * 2 * inter, *u = g + inter;
            uint16_t *o = (uint16_t *)out + r * inter;
            for (int64_t i = 0; i < inter; i++)
                o[i] = f32_to_bf16(round_bf16(silu(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
        } else {
            const float *g = (const float *)gu + r * 2 * inter, *u = g + inter;
            float *o = (float *)out + r * inter;
            for (int64_t i = 0; i < inter; i++) o[i] = silu(g[i]) * u[i];
        }
    }
}

/* silu_mul for the separate calls (llama.py's layer above the one-call step, prefill
 * included), so that a row's activation has these bits whichever path its step takes. */
void kvs_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter) {
    silu_mul(gu, out, rows, inter, 1);
}
void kvs_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter) {
    silu_mul(gu, out, rows, inter, 0);
}

static inline int mm(const kvs_int4_weight *w, const void *x, int64_t rows, void *y, int bf16) {
    const int rc = kvs_int4_mm(x, bf16, w->k, rows, w->k, w->nib, w->d, w->m, w->n, y, bf16);
    return rc == -2 ? KVS_LAYER_NO_SCRATCH : rc ? KVS_LAYER_INT4 : 0;
}

int kvs_decode_layer(void *x, int bf16, const kvs_layer *w, const kvs_step *s, void *k_cache,
                     void *v_cache, int64_t *err) {
    const int64_t t = s->tokens, h = s->hidden, d = s->head_dim, hq = s->heads, hkv = s->kv_heads;
    const int64_t qkv_n = (hq + 2 * hkv) * d, el = bf16 ? 2 : 4;
    if (t <= 0) return 0;
    /* scratch: normed [t, h], qkv [t, qkv_n], q [t, hq*d], k [t, hkv*d], o [t, hq*d],
     * proj [t, h], gate_up [t, 2 inter], act [t, inter] */
    const int64_t per_row = h + qkv_n + hq * d + hkv * d + hq * d + h + 3 * s->inter;
    char *buf = scratch((size_t)(t * per_row * el));
    if (!buf) return KVS_LAYER_NO_SCRATCH;
    char *normed = buf, *qkv = normed + t * h * el, *q = qkv + t * qkv_n * el;
    char *k = q + t * hq * d * el, *o = k + t * hkv * d * el, *proj = o + t * hq * d * el;
    char *gate_up = proj + t * h * el, *act = gate_up + t * 2 * s->inter * el;
    int rc;

    /* attention block */
    if (bf16) kvs_rms_norm_bf16(x, w->input_norm, (uint16_t *)normed, t, h, h, w->eps);
    else kvs_rms_norm_f32(x, w->input_norm, (float *)normed, t, h, h, w->eps);
    if ((rc = mm(&w->qkv, normed, t, qkv, bf16))) return rc;
    int bad = bf16
        ? kvs_rotary_bf16((const uint16_t *)qkv, qkv_n, (uint16_t *)q, s->cos, s->sin, s->table_rows,
                          s->positions, t, hq, d)
        : kvs_rotary_f32((const float *)qkv, qkv_n, (float *)q, s->cos, s->sin, s->table_rows,
                         s->positions, t, hq, d);
    if (!bad)
        bad = bf16
            ? kvs_rotary_bf16((const uint16_t *)qkv + hq * d, qkv_n, (uint16_t *)k, s->cos, s->sin,
                              s->table_rows, s->positions, t, hkv, d)
            : kvs_rotary_f32((const float *)qkv + hq * d, qkv_n, (float *)k, s->cos, s->sin,
                             s->table_rows, s->positions, t, hkv, d);
    if (bad) {
        *err = bad - 1;
        return KVS_LAYER_POSITION;
    }
    bad = kvs_store_rows(k, hkv * d * el, k_cache, s->pool_size, s->loc, t, hkv * d * el);
    if (!bad)
        bad = kvs_store_rows(qkv + (hq + hkv) * d * el, qkv_n * el, v_cache, s->pool_size, s->loc, t,
                             hkv * d * el);
    if (bad) {
        *err = bad - 1;
        return KVS_LAYER_SLOT;
    }
    bad = bf16
        ? kvs_decode_attention_bf16((const uint16_t *)q, k_cache, v_cache, (uint16_t *)o, s->req_to_token,
                                    s->r2t_rows, s->r2t_stride, s->rows, s->lens, t, hq, hkv, d,
                                    s->pool_size, s->sm_scale)
        : kvs_decode_attention_f32((const float *)q, k_cache, v_cache, (float *)o, s->req_to_token,
                                   s->r2t_rows, s->r2t_stride, s->rows, s->lens, t, hq, hkv, d,
                                   s->pool_size, s->sm_scale);
    if (bad) {
        *err = (bad < 0 ? -bad : bad) - 1;
        return bad < 0 ? KVS_LAYER_ROW : KVS_LAYER_POOL;
    }
    if ((rc = mm(&w->o, o, t, proj, bf16))) return rc;
    add_rows(x, proj, t * h, bf16);

    /* MLP block */
    if (bf16) kvs_rms_norm_bf16(x, w->post_norm, (uint16_t *)normed, t, h, h, w->eps);
    else kvs_rms_norm_f32(x, w->post_norm, (float *)normed, t, h, h, w->eps);
    if ((rc = mm(&w->gate_up, normed, t, gate_up, bf16))) return rc;
    silu_mul(gate_up, act, t, s->inter, bf16);
    if ((rc = mm(&w->down, act, t, proj, bf16))) return rc;
    add_rows(x, proj, t * h, bf16);
    return 0;
}
