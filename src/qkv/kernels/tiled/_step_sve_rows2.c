/* The SVE step with 2 query rows in registers at a time instead of 3 (_simd.h): the other
   register blocking the machine's profile measures, as for AVX2 and NEON. */
#define STEP_ROWS 2
#include "_kernel.h"
#if defined(QKV_ARM) && defined(QKV_SVE)
#pragma GCC target("arch=armv8.2-a+sve")
#define QKV_ISA 257
#include "_simd.h"
#include "_bf16.h"
#include "_step.h"
#endif
