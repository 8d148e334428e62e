/* The NEON step with 2 query rows in registers at a time instead of 3 (_simd.h): the other
   register blocking the machine's profile measures, for cores where it runs faster. */
#define STEP_ROWS 2
#include "_kernel.h"
#ifdef QKV_ARM
#define QKV_ISA 128
#include "_simd.h"
#include "_bf16.h"
#include "_step.h"
#endif
