/* The native step for ARM64 SVE with 256-bit vectors (float32; bfloat16 in SVE's BFDOT where
   the CPU has it, else widened as it is loaded): _step.h over _simd.h's pairs of SVE vectors.
   Built where the compiler takes SVE for this file alone and fixed-length vectors
   (-msve-vector-bits=256, which setup.py passes with QKV_SVE where it works: GCC), run where
   the CPU has SVE with 256-bit vectors (asked at run time: Graviton3's); elsewhere NEON's. */
#include "_kernel.h"
#if defined(QKV_ARM) && defined(QKV_SVE)
#pragma GCC target("arch=armv8.2-a+sve")
#define QKV_ISA 257
#include "_simd.h"
#include "_bf16.h"
#include "_step.h"
#endif
