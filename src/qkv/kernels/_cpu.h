/* The CPU features the kernels' steps are compiled for, asked of the CPU at run time, once
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

/* AVX512-BF16's bfloat16 dot products (VDPBF16PS), with the AVX-512 above. */
static inline int qkv_cpu_bf16(void) {
    return qkv_cpu_avx512() && __builtin_cpu_supports("avx512bf16");
}

/* AVX2, FMA and F16C (half-precision conversions): what the 8-lane step uses. */
static inline int qkv_cpu_avx2(void) {
    unsigned a, b, c, d;
    int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    __builtin_cpu_init();
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>

/* BFDOT and the other bfloat16 instructions of FEAT_BF16 (HWCAP2_BF16, bit 14; named here
   for C libraries whose headers predate it). */
static inline int qkv_cpu_bf16(void) { return (getauxval(AT_HWCAP2) >> 14) & 1; }

/* SVE with 256-bit vectors, what the SVE step is compiled for (HWCAP_SVE, bit 22; then
   the vector length, in bytes, the process runs with: PR_SVE_GET_VL, 51). Asked at run
   time, never of the compiler: in a unit compiled for fixed 256-bit vectors, svcntb() is
   the constant 32. Asked once (a system call), every thread with the same answer. */
static inline int qkv_cpu_sve256(void) {
    static int found = -1;
    if (found < 0) {
        const int vl = (getauxval(AT_HWCAP) >> 22) & 1 ? prctl(51, 0, 0, 0, 0) : -1;
        found = vl >= 0 && (vl & 0xffff) == 32;
    }
    return found;
}

/* SVE's BFDOT (HWCAP2_SVEBF16, bit 12). */
static inline int qkv_cpu_sve_bf16(void) { return (getauxval(AT_HWCAP2) >> 12) & 1; }
#elif defined(__aarch64__)
static inline int qkv_cpu_bf16(void) { return 0; } /* not asked: the widened path runs */
static inline int qkv_cpu_sve256(void) { return 0; }
static inline int qkv_cpu_sve_bf16(void) { return 0; }
#endif

#endif
