/* The native step for AVX2 + FMA + F16C (float32; bfloat16 and float16 widened to it as
   they are loaded): _step.h over _simd.h's pairs of ymm vectors, for x86-64 CPUs without
   AVX-512; on others _native.c may pin it (QKV_NATIVE_ISA) to test and measure it. */
#include "_kernel.h"
#ifdef QKV_X86
#define QKV_ISA 256
#include "_simd.h"
#include "_step.h"
#endif
