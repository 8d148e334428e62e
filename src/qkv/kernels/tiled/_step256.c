/* The native step for AVX2 + FMA (float32): _step.h over _simd.h's pairs of ymm vectors,
   for x86-64 CPUs without AVX-512; on others _native.c may pin it (QKV_NATIVE_ISA) to test
   and measure it. */
#include "_kernel.h"
#ifdef QKV_X86
#define QKV_ISA 256
#include "_simd.h"
#include "_step.h"
#endif
