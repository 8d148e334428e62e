/* The paged decode step's vector item for ARM64 SVE with 256-bit vectors: _paged_step.h over
   tiled/_simd.h's vectors (built and chosen as tiled/_step_sve.c says). */
#include "_paged.h"
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__)) && defined(QKV_SVE)
#pragma GCC target("arch=armv8.2-a+sve")
#define QKV_ISA 257
#include "tiled/_simd.h"
#include "_paged_step.h"
#endif
