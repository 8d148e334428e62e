/* The native step for ARM64 NEON (float32; bfloat16 in BFDOT's dot products where the CPU
   has them, else widened as it is loaded, as float16 is): _step.h over _simd.h's quads of
   128-bit vectors. NEON is part of every ARM64 CPU; BFDOT is asked at run time. */
#include "_kernel.h"
#ifdef QKV_ARM
#define QKV_ISA 128
#include "_simd.h"
#include "_bf16.h"
#include "_step.h"
#endif
