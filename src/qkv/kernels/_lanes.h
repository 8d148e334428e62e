/* What the native kernels' vectors (tiled/_simd.h) are told about the values they load and
   the lanes they mask: shared by the tiled step (tiled/_kernel.h) and the paged decode step
   (_paged.h). */
#ifndef QKV_LANES_H
#define QKV_LANES_H
#include <stdint.h>
#include <string.h>

/* What a kernel's inputs hold. float32 steps read bfloat16 and float16 as they are and widen
   them as they load them (no float32 copies); the paged step's quantized pages, int8 and
   float8 e4m3, likewise (before their rows' scales). */
enum { SRC_F32 = 0, SRC_BF16 = 1, SRC_F16 = 2, SRC_I8 = 3, SRC_E4M3 = 4 };

typedef uint16_t bf16;
typedef uint16_t lanemask; /* one bit per lane of 16 float32 */

/* The lanes of the 16 values from n that lie in [first, last). */
static inline lanemask lanes(int64_t n, int64_t first, int64_t last) {
    int64_t lo = first - n, hi = last - n;
    lo = lo < 0 ? 0 : lo > 16 ? 16 : lo;
    hi = hi < 0 ? 0 : hi > 16 ? 16 : hi;
    return hi <= lo ? 0 : (lanemask)(((1u << hi) - 1) & ~((1u << lo) - 1));
}

/* float32 bits as a float (the scalar widenings below build their bits first). */
static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A bfloat16 value as float32 (exact: its bits are a float32's high half). */
static inline float widen(bf16 x) { return from_bits((uint32_t)x << 16); }

/* A float16 value as float32 (exact: subnormals, inf and NaN included). */
static inline float half_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return (sign ? -1.0f : 1.0f) * (float)m * 0x1p-24f; /* zero or subnormal */
    return from_bits(sign | (e == 0x1f ? 0x7f800000u : (e + 112) << 23) | m << 13);
}
#endif
