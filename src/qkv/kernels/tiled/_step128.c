/* The native step for ARM64 NEON (float32; bfloat16 and float16 inputs widened as they are
   loaded): _step.h over _simd.h's quads of 128-bit vectors. NEON is part of every ARM64
   CPU, so nothing is asked at run time. */
#include "_kernel.h"
#ifdef QKV_ARM
#define QKV_ISA 128
#include "_simd.h"
#include "_step.h"
#endif
