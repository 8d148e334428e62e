/* The x86 features the kernels' steps are compiled for, asked of the CPU at run time, once
   for both modules. F16C is read through cpuid: clang before 16 has no "f16c" for
   __builtin_cpu_supports, and failed to build the kernels on that one name. */
#ifndef QKV_CPU_H
#define QKV_CPU_H

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* AVX-512 F, BW, VL and DQ: what the 16-lane step uses. */
static inline int qkv_cpu_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

/* AVX2, FMA and F16C (half-precision conversions): what the 8-lane step uses. */
static inline int qkv_cpu_avx2(void) {
    unsigned a, b, c, d;
    int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    __builtin_cpu_init();
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

#endif
