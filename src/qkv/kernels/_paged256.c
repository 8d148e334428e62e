/* The paged decode step's vector item for AVX2 + FMA: _paged_step.h over tiled/_simd.h's
   vectors. */
#include "_paged.h"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_ISA 256
#include "tiled/_simd.h"
#include "_paged_step.h"
#endif
