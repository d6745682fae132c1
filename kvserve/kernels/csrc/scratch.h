/* Per-thread scratch and a typed store, for the CPU kernels (the C files beside it). */
#ifndef KVSERVE_SCRATCH_H
#define KVSERVE_SCRATCH_H
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* The calling thread's buffer of at least `bytes`, grown on demand and kept (a decode step
 * asks the same sizes layer after layer); NULL where memory ran out. Static: every file that
 * includes this has its own buffer, so a kernel that calls another's never shares one. */
static inline void *scratch(size_t bytes) {
    static __thread void *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        buf = malloc(bytes);
        cap = buf ? bytes : 0;
    }
    return buf;
}

/* y[i] = v, y bf16 when y_bf16, else float32. */
static inline void put(void *y, int y_bf16, int64_t i, float v) {
    if (y_bf16) ((uint16_t *)y)[i] = f32_to_bf16(v);
    else ((float *)y)[i] = v;
}
#endif
