/* The AVX-512 step with tiles of 16 query rows instead of 8 (MR, _kernel.h): each key block
   it loads serves twice the rows. The other blocking the machine's profile measures. */
#define MR 16
#include "_kernel.h"
#ifdef QKV_X86
#define QKV_ISA 512
#include "_simd.h"
#include "_bf16.h"
#include "_step.h"
#endif
