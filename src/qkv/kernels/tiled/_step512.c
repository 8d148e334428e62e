/* The native step for AVX-512 (float32; bfloat16 with AVX512-BF16): _step.h over _simd.h's
   zmm vectors. Built without AVX-512 flags: each function carries its target, and
   _native.c calls it only where the CPU has the instructions. */
#include "_kernel.h"
#ifdef QKV_X86
#define QKV_ISA 512
#include "_simd.h"
#include "_bf16.h"
#include "_step.h"
#endif
