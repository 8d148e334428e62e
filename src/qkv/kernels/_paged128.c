/* The paged decode step's vector item for ARM64 NEON: _paged_step.h over tiled/_simd.h's
   vectors. */
#include "_paged.h"
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_ISA 128
#include "tiled/_simd.h"
#include "_paged_step.h"
#endif
