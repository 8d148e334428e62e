/* The vectors the native step is written in (_step.h), for the instruction set QKV_ISA its
   translation unit sets: vf, 16 float32 lanes, and lanemask, a bit per lane. With AVX-512
   (512) a vf is one zmm register and every operation one instruction; with AVX2 + FMA (256)
   a vf is two ymm registers, a masked load is VMASKMOVPS and a masked move a blend; with
   ARM64 NEON (128) four q registers, a masked load lane by lane and a masked move a bit
   select. Also the register blocking each allows: AVX-512 has 32 vector registers of 512
   bits, AVX2 16 of 256 and NEON 32 of 128, so the AVX2 and NEON steps keep fewer rows, keys
   or columns in registers at once. */
#ifndef QKV_SIMD_H
#define QKV_SIMD_H
#include <math.h>
#include "../_exp.h"
#include "../_lanes.h"

#ifndef STEP_ROWS
#define STEP_ROWS 3 /* AVX2's and NEON's query rows at a time (below) */
#endif

#if QKV_ISA == 512
#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define VI                                                                                         \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512dq,avx512vl")))
#if MR == 16
#define NAMED(x) x##_avx512_rows16
#else
#define NAMED(x) x##_avx512
#endif
#define DOT_ROWS 8   /* scores: rows × 32 keys of accumulators (16 zmm) */
#define PV_ROWS 8    /* P·V: rows × PV_COLS vectors of columns (16 zmm); 8 × 2, not 4 × 4: */
#define PV_COLS 2    /* the value rows a tile reads from L2 are half as many (docs/kernels.md) */
#define OUTER_KEYS 4 /* dK, dV: keys × 32 columns (8 zmm) */

typedef __m512 vf;
VI vf vzero(void) { return _mm512_setzero_ps(); }
VI vf vset1(float x) { return _mm512_set1_ps(x); }
VI vf vload(const float *p) { return _mm512_loadu_ps(p); }
VI void vstore(float *p, vf x) { _mm512_storeu_ps(p, x); }
VI vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
VI vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
VI vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
VI vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
VI vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
VI vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
VI vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); } /* a · b + c */
VI float vsum(vf x) { return _mm512_reduce_add_ps(x); }
/* The four sums of a, b, c, d's lanes into out[0..3], their reductions shared. */
VI void vsum4(vf a, vf b, vf c, vf d, float *out) {
    __m256 x[4];
    const __m512 v[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++)
        x[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
VI float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
/* The lanes of m from p, 0 in the others (which are not read). */
VI vf vloadz(lanemask m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
/* on in the lanes of m, off in the others. */
VI vf vblend(lanemask m, vf off, vf on) { return _mm512_mask_mov_ps(off, m, on); }
/* The lanes where a >= b; where a != b (neither NaN). */
VI lanemask vge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
VI lanemask vne(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
VI vf vexp(vf x) { return qkv_exp16(x); }
VI vf viota(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
/* 16 bfloat16 or float16 values from p, widened to float32. */
VI vf vload_bf16(const uint16_t *p) {
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
VI vf vload_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* 16 int8 values, or 16 float8 e4m3 ones, as float32. An e4m3 byte sign-extended to 16 bits
   and shifted left by 7 is a float16's bits but for bit 14 (the sign's copy, cleared): its
   exponent field and mantissa land on float16's, whose exponent bias is 8 more, so the
   float16, widened by the hardware, is the value times 2^-8 — exactly, subnormals included. */
VI vf vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
VI vf vload_e4m3(const uint8_t *p) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    h = _mm256_and_si256(h, _mm256_set1_epi16((short)0xBFFF));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

/* 16 float32 values rounded to bfloat16 (to nearest even, as torch rounds; a NaN stays a
   quiet NaN) or to float16, stored at p. */
VI void vstore_bf16(uint16_t *p, vf x) {
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    const __m512i even =
        _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, even), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
VI void vstore_f16(uint16_t *p, vf x) {
    _mm256_storeu_si256((__m256i *)p,
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* bfloat16 dot products (AVX512-BF16), for _bf16.h: a vbf holds 32 bfloat16 values, the
   pairs a vf's 16 lanes sum (VDPBF16PS). */
#define QKV_HAS_BF16 1
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define VB                                                                                         \
    static inline                                                                                  \
        __attribute__((always_inline, target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define BF_DOT_ROWS 8 /* scores: rows × 32 keys of sums (16 zmm) */
#define BF_PV_ROWS 4  /* P·V: rows × BF_PV_COLS vectors of columns (16 zmm) */
#define BF_PV_COLS 4
typedef __m512bh vbf;
VB vbf vbf_load(const bf16 *p) { return (__m512bh)_mm512_loadu_si512(p); }
/* The pairs of the lanes of m from p, 0 in the others (not read). */
VB vbf vbf_loadz(lanemask m, const bf16 *p) { return (__m512bh)_mm512_maskz_loadu_epi32(m, p); }
VB void vbf_store(bf16 *p, vbf x) { _mm512_storeu_si512(p, (__m512i)x); }
/* The pair at p in every lane. */
VB vbf vbf_pair(const bf16 *p) {
    int32_t pair;
    memcpy(&pair, p, 4);
    return (__m512bh)_mm512_set1_epi32(pair);
}
/* acc + the sums of a's and b's pairs, lane by lane. */
VB vf vdot(vf acc, vbf a, vbf b) { return _mm512_dpbf16_ps(acc, a, b); }
/* lo's lanes, then hi's, rounded to bfloat16 (to nearest, ties to even). */
VB vbf vbf_round(vf lo, vf hi) { return _mm512_cvtne2ps_pbh(hi, lo); }
/* Values 16 · half .. 16 · half + 15 of x as float32. */
VB vf vbf_widen(vbf x, const int half) {
    __m256i h =
        half ? _mm512_extracti64x4_epi64((__m512i)x, 1) : _mm512_castsi512_si256((__m512i)x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#elif QKV_ISA == 256
#define TARGET __attribute__((target("avx2,fma,f16c")))
#define VI static inline __attribute__((always_inline, target("avx2,fma,f16c")))
/* AVX2's register blocking (and NEON's) is compiled twice, and the machine's profile
   measures which runs faster (tiled/profile.py): STEP_ROWS query rows at a time, 3
   (_step256.c) or 2 (_step256_rows2.c: 8 ymm of sums, so the 4 of the key block stay in
   registers and no FMA reads memory, with fewer FMA chains in flight). Rows never share a
   sum, so the two give the same bits. */
#if STEP_ROWS == 2
#define NAMED(x) x##_avx2_rows2
#else
#define NAMED(x) x##_avx2
#endif
#define DOT_ROWS STEP_ROWS /* rows × 32 keys: 12 ymm for 3 (the 8 rows as 3, 3, 2) */
#define PV_ROWS STEP_ROWS  /* rows × 32 columns: 12 ymm for 3 (V read by the FMAs) */
#define PV_COLS 2
#define OUTER_KEYS 2 /* 2 keys × 32 columns: 8 ymm, and 4 for the row */

typedef struct {
    __m256 lo, hi;
} vf;
/* The 8 lanes of m's low byte as a ymm mask. */
VI __m256i ymask(unsigned m) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), bit), bit);
}
#define BOTH(f, a, b) ((vf){f((a).lo, (b).lo), f((a).hi, (b).hi)})
VI vf vzero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
VI vf vset1(float x) { return (vf){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
VI vf vload(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
VI void vstore(float *p, vf x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
VI vf vadd(vf a, vf b) { return BOTH(_mm256_add_ps, a, b); }
VI vf vsub(vf a, vf b) { return BOTH(_mm256_sub_ps, a, b); }
VI vf vmul(vf a, vf b) { return BOTH(_mm256_mul_ps, a, b); }
VI vf vmax(vf a, vf b) { return BOTH(_mm256_max_ps, a, b); }
VI vf vmin(vf a, vf b) { return BOTH(_mm256_min_ps, a, b); }
VI vf vdiv(vf a, vf b) { return BOTH(_mm256_div_ps, a, b); }
VI vf vfma(vf a, vf b, vf c) {
    return (vf){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
VI float vsum(vf x) {
    __m256 s = _mm256_add_ps(x.lo, x.hi);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
/* The four sums of a, b, c, d's lanes into out[0..3], their reductions shared. */
VI void vsum4(vf a, vf b, vf c, vf d, float *out) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi)),
                              _mm256_hadd_ps(_mm256_add_ps(c.lo, c.hi), _mm256_add_ps(d.lo, d.hi)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
VI float vhmax(vf x) {
    __m256 s = _mm256_max_ps(x.lo, x.hi);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
VI vf vloadz(lanemask m, const float *p) {
    return (vf){_mm256_maskload_ps(p, ymask(m)), _mm256_maskload_ps(p + 8, ymask(m >> 8))};
}
VI vf vblend(lanemask m, vf off, vf on) {
    return (vf){_mm256_blendv_ps(off.lo, on.lo, _mm256_castsi256_ps(ymask(m))),
                _mm256_blendv_ps(off.hi, on.hi, _mm256_castsi256_ps(ymask(m >> 8)))};
}
VI lanemask vcmp_bits(__m256 lo, __m256 hi) {
    return (lanemask)(_mm256_movemask_ps(lo) | _mm256_movemask_ps(hi) << 8);
}
VI lanemask vge(vf a, vf b) {
    return vcmp_bits(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ));
}
VI lanemask vne(vf a, vf b) {
    return vcmp_bits(_mm256_cmp_ps(a.lo, b.lo, _CMP_NEQ_OQ),
                     _mm256_cmp_ps(a.hi, b.hi, _CMP_NEQ_OQ));
}
VI vf vexp(vf x) { return (vf){qkv_exp8(x.lo), qkv_exp8(x.hi)}; }
VI vf viota(void) {
    return (vf){_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)};
}
VI __m256 bf16x8(const uint16_t *p) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
VI __m256 f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
/* 16 bfloat16 or float16 values from p, widened to float32. */
VI vf vload_bf16(const uint16_t *p) { return (vf){bf16x8(p), bf16x8(p + 8)}; }
VI vf vload_f16(const uint16_t *p) { return (vf){f16x8(p), f16x8(p + 8)}; }
VI __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* 8 float32 values as bfloat16 bits in 32-bit lanes (as AVX-512's vstore_bf16 rounds). */
VI __m256i bf16x8_bits(__m256 x) {
    const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
    const __m256i even =
        _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, even), 16);
    return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)),
                              _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
/* 16 float32 values rounded to bfloat16 or float16 (as AVX-512's), stored at p. */
VI void vstore_bf16(uint16_t *p, vf x) { /* the pack interleaves 64-bit quarters: reorder */
    const __m256i w = _mm256_packus_epi32(bf16x8_bits(x.lo), bf16x8_bits(x.hi));
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(w, 0xD8));
}
VI void vstore_f16(uint16_t *p, vf x) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(x.lo, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(x.hi, _MM_FROUND_TO_NEAREST_INT));
}
/* 16 int8 or float8 e4m3 values (as AVX-512's: e4m3 through float16's bits) as float32. */
VI vf vload_i8(const int8_t *p) { return (vf){i8x8(p), i8x8(p + 8)}; }
VI vf vload_e4m3(const uint8_t *p) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    h = _mm256_and_si256(h, _mm256_set1_epi16((short)0xBFFF));
    const __m256 by = _mm256_set1_ps(256.0f);
    return (vf){_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), by),
                _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), by)};
}
#elif QKV_ISA == 128
#define TARGET
#define VI static inline __attribute__((always_inline))
#if STEP_ROWS == 2 /* as AVX2's: compiled with 3 rows at a time and with 2 (_step128_rows2.c) */
#define NAMED(x) x##_neon_rows2
#else
#define NAMED(x) x##_neon
#endif
#define DOT_ROWS STEP_ROWS /* as AVX2's: the same register bytes (32 × 128 bits, 16 × 256) */
#define PV_ROWS STEP_ROWS
#define PV_COLS 2
#define OUTER_KEYS 2

typedef struct {
    float32x4_t q[4];
} vf;
#define EACH(expr)                                                                                 \
    vf out_;                                                                                       \
    for (int e_ = 0; e_ < 4; e_++) out_.q[e_] = (expr);                                            \
    return out_
VI vf vzero(void) { EACH(vdupq_n_f32(0.0f)); }
VI vf vset1(float x) { EACH(vdupq_n_f32(x)); }
VI vf vload(const float *p) { EACH(vld1q_f32(p + 4 * e_)); }
VI void vstore(float *p, vf x) {
    for (int e = 0; e < 4; e++) vst1q_f32(p + 4 * e, x.q[e]);
}
VI vf vadd(vf a, vf b) { EACH(vaddq_f32(a.q[e_], b.q[e_])); }
VI vf vsub(vf a, vf b) { EACH(vsubq_f32(a.q[e_], b.q[e_])); }
VI vf vmul(vf a, vf b) { EACH(vmulq_f32(a.q[e_], b.q[e_])); }
VI vf vmax(vf a, vf b) { EACH(vmaxq_f32(a.q[e_], b.q[e_])); }
VI vf vmin(vf a, vf b) { EACH(vminq_f32(a.q[e_], b.q[e_])); }
VI vf vdiv(vf a, vf b) { EACH(vdivq_f32(a.q[e_], b.q[e_])); }
VI vf vfma(vf a, vf b, vf c) { EACH(vfmaq_f32(c.q[e_], a.q[e_], b.q[e_])); } /* a · b + c */
VI float vsum(vf x) {
    return vaddvq_f32(vaddq_f32(vaddq_f32(x.q[0], x.q[1]), vaddq_f32(x.q[2], x.q[3])));
}
/* The four sums of a, b, c, d's lanes into out[0..3], their reductions shared. */
VI void vsum4(vf a, vf b, vf c, vf d, float *out) {
    const vf v[4] = {a, b, c, d};
    float32x4_t x[4];
    for (int i = 0; i < 4; i++)
        x[i] = vaddq_f32(vaddq_f32(v[i].q[0], v[i].q[1]), vaddq_f32(v[i].q[2], v[i].q[3]));
    vst1q_f32(out, vpaddq_f32(vpaddq_f32(x[0], x[1]), vpaddq_f32(x[2], x[3])));
}
VI float vhmax(vf x) {
    return vmaxvq_f32(vmaxq_f32(vmaxq_f32(x.q[0], x.q[1]), vmaxq_f32(x.q[2], x.q[3])));
}
/* The 4 lanes of m from bit `at` as a q-register mask; a mask's lanes as m's 4 bits. */
VI uint32x4_t qmask(unsigned m, int at) {
    const uint32x4_t bit = {1, 2, 4, 8};
    return vtstq_u32(vdupq_n_u32(m >> at), bit);
}
VI lanemask qbits(uint32x4_t lanes, int at) {
    const uint32x4_t bit = {1, 2, 4, 8};
    return (lanemask)(vaddvq_u32(vandq_u32(lanes, bit)) << at);
}
VI vf vloadz(lanemask m, const float *p) {
    float part[16] = {0};
    for (int e = 0; e < 16; e++)
        if (m >> e & 1) part[e] = p[e];
    return vload(part);
}
VI vf vblend(lanemask m, vf off, vf on) { EACH(vbslq_f32(qmask(m, 4 * e_), on.q[e_], off.q[e_])); }
VI lanemask vge(vf a, vf b) {
    lanemask m = 0;
    for (int e = 0; e < 4; e++) m |= qbits(vcgeq_f32(a.q[e], b.q[e]), 4 * e);
    return m;
}
VI lanemask vne(vf a, vf b) { /* ordered: a < b or a > b */
    lanemask m = 0;
    for (int e = 0; e < 4; e++)
        m |= qbits(vorrq_u32(vcltq_f32(a.q[e], b.q[e]), vcgtq_f32(a.q[e], b.q[e])), 4 * e);
    return m;
}
VI vf vexp(vf x) { EACH(qkv_exp4(x.q[e_])); }
VI vf viota(void) {
    vf x;
    for (int e = 0; e < 4; e++) x.q[e] = (float32x4_t){4 * e, 4 * e + 1, 4 * e + 2, 4 * e + 3};
    return x;
}
/* 16 bfloat16 or float16 values from p, widened to float32. */
VI vf vload_bf16(const uint16_t *p) {
    EACH(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * e_), 16)));
}
VI vf vload_f16(const uint16_t *p) {
    EACH(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * e_))));
}
/* 16 float32 values rounded to bfloat16 or float16 (as AVX-512's), stored at p. */
VI uint16x4_t bf16x4_bits(float32x4_t x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x), hi = vshrq_n_u32(u, 16);
    const uint32x4_t even = vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(hi, vdupq_n_u32(1)));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(u, even), 16);
    return vmovn_u32(vbslq_u32(vceqq_f32(x, x), r, vorrq_u32(hi, vdupq_n_u32(0x40))));
}
VI void vstore_bf16(uint16_t *p, vf x) {
    for (int e = 0; e < 4; e++) vst1_u16(p + 4 * e, bf16x4_bits(x.q[e]));
}
VI void vstore_f16(uint16_t *p, vf x) {
    for (int e = 0; e < 4; e++) vst1_u16(p + 4 * e, vreinterpret_u16_f16(vcvt_f16_f32(x.q[e])));
}
/* 16 int8 or float8 e4m3 values (as AVX-512's) as float32. */
VI vf vload_i8(const int8_t *p) {
    int8x16_t b = vld1q_s8(p);
    int16x8_t h[2] = {vmovl_s8(vget_low_s8(b)), vmovl_s8(vget_high_s8(b))};
    EACH(vcvtq_f32_s32(vmovl_s16(e_ % 2 ? vget_high_s16(h[e_ / 2]) : vget_low_s16(h[e_ / 2]))));
}
VI vf vload_e4m3(const uint8_t *p) {
    const int8x16_t b = vld1q_s8((const int8_t *)p);
    const int16x8_t keep = vdupq_n_s16((int16_t)0xBFFF);
    const int16x8_t h[2] = {vandq_s16(vshlq_n_s16(vmovl_s8(vget_low_s8(b)), 7), keep),
                            vandq_s16(vshlq_n_s16(vmovl_s8(vget_high_s8(b)), 7), keep)};
    EACH(vmulq_f32(vcvt_f32_f16(vreinterpret_f16_s16(e_ % 2 ? vget_high_s16(h[e_ / 2])
                                                            : vget_low_s16(h[e_ / 2]))),
                   vdupq_n_f32(256.0f)));
}

/* bfloat16 dot products (BFDOT, FEAT_BF16: asked of the CPU at run time), for _bf16.h, as
   AVX-512's: a vbf holds 32 bfloat16 values in four q registers, the pairs a vf's 16 lanes
   sum. Built by GCC alone (QKV_NEON_BF16): clang's arm_neon.h (14 here) declares the
   bfloat16 types only where the whole file is compiled for them, so a clang build widens
   bfloat16 instead. Half the rows
   and columns of AVX-512's blocking at a time: NEON has 32 registers of 128 bits. */
#ifdef QKV_NEON_BF16
#define QKV_HAS_BF16 1
#define TARGET_BF16 __attribute__((target("arch=armv8.2-a+bf16")))
#define VB static inline __attribute__((always_inline, target("arch=armv8.2-a+bf16")))
#define BF_DOT_ROWS 2 /* 2 rows × 32 keys: 16 q of sums, 8 of keys */
#define BF_PV_ROWS 2  /* 2 rows × 2 vectors: 16 q of sums, 8 of values */
#define BF_PV_COLS 2
typedef struct {
    bfloat16x8_t q[4];
} vbf;
VB vbf vbf_load(const bf16 *p) {
    vbf x;
    for (int e = 0; e < 4; e++) x.q[e] = vreinterpretq_bf16_u16(vld1q_u16(p + 8 * e));
    return x;
}
VB vbf vbf_loadz(lanemask m, const bf16 *p) {
    if (m == 0xffff) return vbf_load(p);
    bf16 part[32] = {0};
    for (int e = 0; e < 16; e++)
        if (m >> e & 1) part[2 * e] = p[2 * e], part[2 * e + 1] = p[2 * e + 1];
    return vbf_load(part);
}
VB void vbf_store(bf16 *p, vbf x) {
    for (int e = 0; e < 4; e++) vst1q_u16(p + 8 * e, vreinterpretq_u16_bf16(x.q[e]));
}
VB vbf vbf_pair(const bf16 *p) {
    uint32_t pair;
    memcpy(&pair, p, 4);
    vbf x;
    for (int e = 0; e < 4; e++) x.q[e] = vreinterpretq_bf16_u32(vdupq_n_u32(pair));
    return x;
}
VB vf vdot(vf acc, vbf a, vbf b) { EACH(vbfdotq_f32(acc.q[e_], a.q[e_], b.q[e_])); }
VB vbf vbf_round(vf lo, vf hi) {
    vbf x;
    for (int e = 0; e < 4; e++) {
        const vf *from = e < 2 ? &lo : &hi;
        x.q[e] =
            vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(from->q[2 * (e % 2)]), from->q[2 * (e % 2) + 1]);
    }
    return x;
}
VB vf vbf_widen(vbf x, const int half) {
    EACH(e_ % 2 ? vcvtq_high_f32_bf16(x.q[2 * half + e_ / 2])
                : vcvtq_low_f32_bf16(x.q[2 * half + e_ / 2]));
}
#endif
#elif QKV_ISA == 257
/* ARM64 SVE with 256-bit vectors (the translation unit compiled for SVE, and with
   -msve-vector-bits=256: _step_sve.c says how), run where the CPU's vectors are 256 bits
   (AWS Graviton3's): a vf is two of them, as AVX2's, fixed-length types so that they fit
   in structs and arrays; a masked load is a predicated one, a masked move a select. */
#include <arm_sve.h>
#define TARGET
#define VI static inline __attribute__((always_inline))
#if STEP_ROWS == 2 /* as AVX2's: compiled with 3 rows at a time and with 2 */
#define NAMED(x) x##_sve_rows2
#else
#define NAMED(x) x##_sve
#endif
#define DOT_ROWS STEP_ROWS /* as AVX2's and NEON's (SVE has their 32 registers of 256 bits: */
#define PV_ROWS STEP_ROWS  /* room to spare, not measured on SVE hardware) */
#define PV_COLS 2
#define OUTER_KEYS 2

typedef svfloat32_t sv8f __attribute__((arm_sve_vector_bits(256)));
typedef struct {
    sv8f lo, hi;
} vf;
#define ALL svptrue_b32()
#define BOTH(f, a, b) ((vf){f(ALL, (a).lo, (b).lo), f(ALL, (a).hi, (b).hi)})
/* Lane i's bit, 1 << i, in each of the 8 lanes. */
VI svuint32_t lane_bits(void) { return svlsl_u32_x(ALL, svdup_n_u32(1), svindex_u32(0, 1)); }
/* The 8 lanes of m's low byte as a predicate; a predicate's lanes as 8 bits. */
VI svbool_t pmask(unsigned m) {
    return svcmpne_n_u32(ALL, svand_u32_x(ALL, svdup_n_u32(m & 0xffu), lane_bits()), 0);
}
VI lanemask pbits(svbool_t p) { return (lanemask)svaddv_u32(p, lane_bits()); }
VI vf vzero(void) { return (vf){svdup_n_f32(0.0f), svdup_n_f32(0.0f)}; }
VI vf vset1(float x) { return (vf){svdup_n_f32(x), svdup_n_f32(x)}; }
VI vf vload(const float *p) { return (vf){svld1_f32(ALL, p), svld1_f32(ALL, p + 8)}; }
VI void vstore(float *p, vf x) { svst1_f32(ALL, p, x.lo), svst1_f32(ALL, p + 8, x.hi); }
VI vf vadd(vf a, vf b) { return BOTH(svadd_f32_x, a, b); }
VI vf vsub(vf a, vf b) { return BOTH(svsub_f32_x, a, b); }
VI vf vmul(vf a, vf b) { return BOTH(svmul_f32_x, a, b); }
VI vf vmax(vf a, vf b) { return BOTH(svmax_f32_x, a, b); }
VI vf vmin(vf a, vf b) { return BOTH(svmin_f32_x, a, b); }
VI vf vdiv(vf a, vf b) { return BOTH(svdiv_f32_x, a, b); }
VI vf vfma(vf a, vf b, vf c) { /* a · b + c, fused */
    return (vf){svmla_f32_x(ALL, c.lo, a.lo, b.lo), svmla_f32_x(ALL, c.hi, a.hi, b.hi)};
}
VI float vsum(vf x) { return svaddv_f32(ALL, svadd_f32_x(ALL, x.lo, x.hi)); }
/* The four sums of a, b, c, d's lanes into out[0..3]. */
VI void vsum4(vf a, vf b, vf c, vf d, float *out) {
    out[0] = vsum(a), out[1] = vsum(b), out[2] = vsum(c), out[3] = vsum(d);
}
VI float vhmax(vf x) { return svmaxv_f32(ALL, svmax_f32_x(ALL, x.lo, x.hi)); }
VI vf vloadz(lanemask m, const float *p) { /* (inactive lanes are not read) */
    return (vf){svld1_f32(pmask(m), p), svld1_f32(pmask(m >> 8), p + 8)};
}
VI vf vblend(lanemask m, vf off, vf on) {
    return (vf){svsel_f32(pmask(m), on.lo, off.lo), svsel_f32(pmask(m >> 8), on.hi, off.hi)};
}
VI lanemask vge(vf a, vf b) {
    return pbits(svcmpge_f32(ALL, a.lo, b.lo)) | pbits(svcmpge_f32(ALL, a.hi, b.hi)) << 8;
}
VI lanemask vne(vf a, vf b) { /* ordered: a < b or a > b */
    const svbool_t lo = svorr_b_z(ALL, svcmplt_f32(ALL, a.lo, b.lo), svcmpgt_f32(ALL, a.lo, b.lo));
    const svbool_t hi = svorr_b_z(ALL, svcmplt_f32(ALL, a.hi, b.hi), svcmpgt_f32(ALL, a.hi, b.hi));
    return pbits(lo) | pbits(hi) << 8;
}
VI vf vexp(vf x) { return (vf){qkv_exp_sve(x.lo), qkv_exp_sve(x.hi)}; }
VI vf viota(void) {
    return (vf){svcvt_f32_s32_x(ALL, svindex_s32(0, 1)), svcvt_f32_s32_x(ALL, svindex_s32(8, 1))};
}
/* 16 bfloat16 or float16 values from p, widened to float32: each loaded into the low half
   of a 32-bit lane (bfloat16 then shifted into the high half; float16 converted, which
   reads the low half). */
VI sv8f bf16x8(const uint16_t *p) {
    return svreinterpret_f32_u32(svlsl_n_u32_x(ALL, svld1uh_u32(ALL, p), 16));
}
VI sv8f f16x8(const uint16_t *p) {
    return svcvt_f32_f16_x(ALL, svreinterpret_f16_u32(svld1uh_u32(ALL, p)));
}
VI vf vload_bf16(const uint16_t *p) { return (vf){bf16x8(p), bf16x8(p + 8)}; }
VI vf vload_f16(const uint16_t *p) { return (vf){f16x8(p), f16x8(p + 8)}; }
/* 16 float32 values rounded to bfloat16 or float16 (as AVX-512's), stored at p: each
   result in the low half of a 32-bit lane (float16's conversion puts it there), stored
   16 bits a lane. */
VI void bf16x8_store(uint16_t *p, sv8f x) {
    const svuint32_t u = svreinterpret_u32_f32(x), hi = svlsr_n_u32_x(ALL, u, 16);
    const svuint32_t even = svadd_n_u32_x(ALL, svand_n_u32_x(ALL, hi, 1), 0x7fff);
    const svuint32_t r = svlsr_n_u32_x(ALL, svadd_u32_x(ALL, u, even), 16);
    svst1h_u32(ALL, p, svsel_u32(svcmpuo_f32(ALL, x, x), svorr_n_u32_x(ALL, hi, 0x40), r));
}
VI void vstore_bf16(uint16_t *p, vf x) { bf16x8_store(p, x.lo), bf16x8_store(p + 8, x.hi); }
VI void vstore_f16(uint16_t *p, vf x) {
    svst1h_u32(ALL, p, svreinterpret_u32_f16(svcvt_f16_f32_x(ALL, x.lo)));
    svst1h_u32(ALL, p + 8, svreinterpret_u32_f16(svcvt_f16_f32_x(ALL, x.hi)));
}
/* 16 int8 or float8 e4m3 values (as AVX-512's: e4m3 through float16's bits) as float32. */
VI vf vload_i8(const int8_t *p) {
    return (vf){svcvt_f32_s32_x(ALL, svld1sb_s32(ALL, p)),
                svcvt_f32_s32_x(ALL, svld1sb_s32(ALL, p + 8))};
}
VI sv8f e4m3x8(const uint8_t *p) {
    const svint32_t h =
        svand_n_s32_x(ALL, svlsl_n_s32_x(ALL, svld1sb_s32(ALL, (const int8_t *)p), 7),
                      0xBFFF); /* the float16's bits, in the low half */
    return svmul_n_f32_x(ALL, svcvt_f32_f16_x(ALL, svreinterpret_f16_s32(h)), 256.0f);
}
VI vf vload_e4m3(const uint8_t *p) { return (vf){e4m3x8(p), e4m3x8(p + 8)}; }

/* bfloat16 dot products (SVE's BFDOT, with FEAT_BF16: asked of the CPU at run time), for
   _bf16.h, as AVX-512's: a vbf holds 32 bfloat16 values in two vectors, the pairs a vf's
   16 lanes sum. GCC only, as NEON's (QKV_NEON_BF16). Half the rows of AVX-512's blocking:
   the same 32 registers, each half as wide. */
#ifdef QKV_NEON_BF16
#define QKV_HAS_BF16 1
#define TARGET_BF16 __attribute__((target("+bf16")))
#define VB static inline __attribute__((always_inline, target("+bf16")))
#define BF_DOT_ROWS 4 /* 4 rows × 32 keys: 16 vectors of sums, 4 of keys */
#define BF_PV_ROWS 2  /* 2 rows × 4 vectors: 16 vectors of sums, 8 of values */
#define BF_PV_COLS 4
typedef svbfloat16_t sv16b __attribute__((arm_sve_vector_bits(256)));
typedef struct {
    sv16b lo, hi;
} vbf;
#define ALL16 svptrue_b16()
VB vbf vbf_load(const bf16 *p) {
    return (vbf){svreinterpret_bf16_u16(svld1_u16(ALL16, p)),
                 svreinterpret_bf16_u16(svld1_u16(ALL16, p + 16))};
}
/* The 16 bfloat16 values of the 8 pairs of m's low byte, as a predicate. */
VB svbool_t pair_mask(unsigned m) {
    const svuint16_t bit =
        svlsl_u16_x(ALL16, svdup_n_u16(1), svlsr_n_u16_x(ALL16, svindex_u16(0, 1), 1));
    return svcmpne_n_u16(ALL16, svand_u16_x(ALL16, svdup_n_u16((uint16_t)(m & 0xffu)), bit), 0);
}
/* The pairs of the lanes of m from p, 0 in the others (not read). */
VB vbf vbf_loadz(lanemask m, const bf16 *p) {
    return (vbf){svreinterpret_bf16_u16(svld1_u16(pair_mask(m), p)),
                 svreinterpret_bf16_u16(svld1_u16(pair_mask(m >> 8), p + 16))};
}
VB void vbf_store(bf16 *p, vbf x) {
    svst1_u16(ALL16, p, svreinterpret_u16_bf16(x.lo));
    svst1_u16(ALL16, p + 16, svreinterpret_u16_bf16(x.hi));
}
/* The pair at p in every lane. */
VB vbf vbf_pair(const bf16 *p) {
    uint32_t pair;
    memcpy(&pair, p, 4);
    const sv16b x = svreinterpret_bf16_u32(svdup_n_u32(pair));
    return (vbf){x, x};
}
/* acc + the sums of a's and b's pairs, lane by lane. */
VB vf vdot(vf acc, vbf a, vbf b) {
    return (vf){svbfdot_f32(acc.lo, a.lo, b.lo), svbfdot_f32(acc.hi, a.hi, b.hi)};
}
/* 16 float32 values rounded to bfloat16 (to nearest, ties to even), in order: each
   conversion fills the even 16-bit halves, which UZP1 gathers. */
VB sv16b round16(vf x) {
    return svuzp1_bf16(svcvt_bf16_f32_x(ALL, x.lo), svcvt_bf16_f32_x(ALL, x.hi));
}
/* lo's lanes, then hi's, rounded to bfloat16. */
VB vbf vbf_round(vf lo, vf hi) { return (vbf){round16(lo), round16(hi)}; }
/* Values 16 · half .. 16 · half + 15 of x as float32: each bfloat16 zipped into the high
   half of a 32-bit lane. */
VB vf vbf_widen(vbf x, const int half) {
    const svuint16_t h = svreinterpret_u16_bf16(half ? x.hi : x.lo), zero = svdup_n_u16(0);
    return (vf){svreinterpret_f32_u16(svzip1_u16(zero, h)),
                svreinterpret_f32_u16(svzip2_u16(zero, h))};
}
#endif
#else
#error "QKV_ISA: 512, 256, 257 (SVE) or 128"
#endif

/* The 16 values from element i of p, which holds SRC (SRC_*), as float32: widened as they
   are loaded where they are half precision or quantized (unscaled). */
VI vf vload_src(const void *p, int64_t i, const int SRC) {
    if (SRC == SRC_F32) return vload((const float *)p + i);
    if (SRC == SRC_BF16) return vload_bf16((const uint16_t *)p + i);
    if (SRC == SRC_I8) return vload_i8((const int8_t *)p + i);
    if (SRC == SRC_E4M3) return vload_e4m3((const uint8_t *)p + i);
    return vload_f16((const uint16_t *)p + i);
}

/* The lanes of m from element i of p as vload_src reads them (float32, bfloat16 or float16),
   0 in the others (not read). */
VI vf vloadz_src(lanemask m, const void *p, int64_t i, const int SRC) {
    if (SRC == SRC_F32) return vloadz(m, (const float *)p + i);
    uint16_t part[16] = {0};
    for (int e = 0; e < 16; e++)
        if (m >> e & 1) part[e] = ((const uint16_t *)p)[i + e];
    return SRC == SRC_BF16 ? vload_bf16(part) : vload_f16(part);
}

/* e^x for x <= 0 (scores minus their running max); exactly 0 below -87, so that a masked
   key (-inf) weighs nothing and a row with none allowed keeps a sum of 0. */
#if QKV_ISA == 512
VI vf exp_neg(vf x) { return vblend(vge(x, vset1(-87.0f)), vzero(), vexp(x)); }
#elif QKV_ISA == 256
/* (AVX2, NEON and SVE: the comparison's lanes kept as a vector mask, which the exp is and-ed
   with, not turned into a lanemask's bits and back: 3% of the AVX2 step's causal forward) */
VI vf exp_neg(vf x) {
    const __m256 floor = _mm256_set1_ps(-87.0f);
    return (vf){_mm256_and_ps(_mm256_cmp_ps(x.lo, floor, _CMP_GE_OQ), qkv_exp8(x.lo)),
                _mm256_and_ps(_mm256_cmp_ps(x.hi, floor, _CMP_GE_OQ), qkv_exp8(x.hi))};
}
#elif QKV_ISA == 257
VI vf exp_neg(vf x) {
    const sv8f zero = svdup_n_f32(0.0f);
    return (vf){svsel_f32(svcmpge_n_f32(ALL, x.lo, -87.0f), qkv_exp_sve(x.lo), zero),
                svsel_f32(svcmpge_n_f32(ALL, x.hi, -87.0f), qkv_exp_sve(x.hi), zero)};
}
#else
VI vf exp_neg(vf x) {
    EACH(vreinterpretq_f32_u32(vandq_u32(vcgeq_f32(x.q[e_], vdupq_n_f32(-87.0f)),
                                         vreinterpretq_u32_f32(qkv_exp4(x.q[e_])))));
}
#endif

/* tanh(x) = 1 - 2 / (e^2x + 1) for finite x, clamped to ±9 first (tanh is ±1 in float32
   beyond): near 0 within a few units of 1's last place, as torch's sigmoid form in the
   PyTorch loop is. */
VI vf vtanh(vf x) {
    vf e = vexp(vmul(vset1(2.0f), vmin(vmax(x, vset1(-9.0f)), vset1(9.0f))));
    return vsub(vset1(1.0f), vdiv(vset1(2.0f), vadd(e, vset1(1.0f))));
}
#endif
