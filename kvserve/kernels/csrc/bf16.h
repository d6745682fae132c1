/* bfloat16 <-> float32 for the CPU kernels (the C files beside it). */
#ifndef KVSERVE_BF16_H
#define KVSERVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16); a NaN stays a NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_id(float f) { return f; }

/* f rounded to bfloat16 and back: where torch's bfloat16 ops round. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
#endif
