/* What the native kernels' vectors (tiled/_simd.h) are told about the values they load and
   the lanes they mask: shared by the tiled step (tiled/_kernel.h) and the paged decode step
   (_paged.h). */
#ifndef QKV_LANES_H
#define QKV_LANES_H
#include <stdint.h>

/* What a kernel's inputs hold. float32 steps read bfloat16 and float16 as they are and widen
   them as they load them (no float32 copies); the paged step's quantized pages, int8 and
   float8 e4m3, likewise (before their rows' scales). */
enum { SRC_F32 = 0, SRC_BF16 = 1, SRC_F16 = 2, SRC_I8 = 3, SRC_E4M3 = 4 };

typedef uint16_t bf16;
typedef uint16_t lanemask; /* one bit per lane of 16 float32 */
#endif
