/* The paged decode step's vector item for AVX-512 CPUs with AVX512-BF16, for bfloat16
   queries: _paged_step.h with its scores taken by bfloat16 dot products (score_dots). */
#include "_paged.h"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_ISA 512
#define QKV_PAGED_DOTS 1
#include "tiled/_simd.h"
#include "_paged_step.h"
#endif
