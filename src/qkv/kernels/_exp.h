/* e^x for 16 float32 lanes (AVX-512F), shared by qkv's native kernels (_paged.c,
   tiled/_native.c): x = n·ln2 + r with ln2 in two parts (Cody-Waite, so r stays exact for
   large |x|), e^r by its degree-7 Taylor polynomial (|r| <= ln2/2: error under float32's
   rounding), scaled by 2^n. Inputs below -104 give exp(-104), 0 in float32 or its smallest
   subnormal; NaN stays NaN. */
#ifndef QKV_EXP_H
#define QKV_EXP_H
#include <immintrin.h>

static inline __attribute__((always_inline, target("avx512f"))) __m512 qkv_exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif
