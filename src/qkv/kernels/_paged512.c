/* The paged decode step's vector item for AVX-512: _paged_step.h over tiled/_simd.h's
   vectors; and AVX-512's own item for many query heads per key/value head. */
#include "_paged.h"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_ISA 512
#include "tiled/_simd.h"
#include "_paged_step.h"

/* The AVX-512 item for many query heads per key/value head (G >= 16: a cascade's shared
   prefix, whose "heads" are the whole batch's queries): Q held transposed (D × G), so each
   key scores 16 heads per vector with one broadcast per d and no horizontal sum; the
   softmax state is kept per 16 heads in vectors. */
TARGET static inline __attribute__((always_inline)) void
wide512(const Job *j, int64_t b, int64_t hk, float *work, const int SRC) {
    const int64_t G = j->H / j->H_kv, D = j->D, D_v = j->D_v, P = j->P;
    const int64_t GV = (G + 15) / 16 * 16;
    /* acc, l, mt: the totals; part, lp: the stretch's sums under m (fold) */
    float *qT = work, *acc = qT + D * GV, *part = acc + G * D_v, *sT = part + G * D_v,
          *kbuf = sT + P * GV, *vbuf = kbuf + D, *m = vbuf + D_v, *lp = m + GV, *l = lp + GV,
          *mt = l + GV, *vpage = mt + GV;
    for (int64_t i = 0; i < D * GV; i++) qT[i] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        const float *src = row(j, j->q, b * j->qs[0] + (hk * G + g) * j->qs[1], D, kbuf);
        for (int64_t d = 0; d < D; d++) qT[d * GV + g] = src[d] * j->scale;
    }
    for (int64_t i = 0; i < G * D_v; i++) part[i] = 0.0f;
    for (int64_t g = 0; g < GV; g++) m[g] = -INFINITY, lp[g] = 0.0f;
    zero_sums(G, D_v, acc, l, mt);
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), nan = _mm512_set1_ps(NAN);
    const int64_t len = j->lengths[b];
    for (int64_t p0 = 0, page_i = 0, stretch = 0; p0 < len; p0 += P, page_i++) {
        const int64_t page = j->table[b * j->max_pages + page_i];
        const int64_t n = len - p0 < P ? len - p0 : P;
        for (int64_t t = 0; t < n; t++) {
            const float *kr = kv_row(j, 1, page, t, hk, D, kbuf);
            for (int64_t gv = 0; gv < GV; gv += 16) { /* D is a multiple of 16 here */
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t d = 0; d < D; d += 4) {
                    const float *qd = qT + d * GV + gv;
                    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qd), _mm512_set1_ps(kr[d]), a0);
                    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qd + GV), _mm512_set1_ps(kr[d + 1]), a1);
                    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qd + 2 * GV), _mm512_set1_ps(kr[d + 2]),
                                         a2);
                    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qd + 3 * GV), _mm512_set1_ps(kr[d + 3]),
                                         a3);
                }
                _mm512_storeu_ps(sT + t * GV + gv,
                                 _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
            }
        }
        for (int64_t gv = 0; gv < GV; gv += 16) {
            const __m512 old = _mm512_loadu_ps(m + gv);
            __m512 mx = old;
            for (int64_t t = 0; t < n; t++)
                mx = _mm512_max_ps(_mm512_loadu_ps(sT + t * GV + gv), mx);
            /* lanes with some finite (or +inf) score so far; the others give no weight */
            const __mmask16 live = _mm512_cmp_ps_mask(mx, minus_inf, _CMP_GT_OQ);
            const __mmask16 grew = _mm512_cmp_ps_mask(mx, old, _CMP_GT_OQ);
            if (grew) {
                const __m512 alpha = _mm512_mask_blend_ps(grew, _mm512_set1_ps(1.0f),
                                                          qkv_exp16(_mm512_sub_ps(old, mx)));
                _mm512_storeu_ps(lp + gv, _mm512_mul_ps(_mm512_loadu_ps(lp + gv), alpha));
                float al[16];
                _mm512_storeu_ps(al, alpha);
                for (int64_t g = gv; g < gv + 16 && g < G; g++)
                    if ((grew >> (g - gv)) & 1)
                        for (int64_t d = 0; d < D_v; d += 16)
                            _mm512_storeu_ps(part + g * D_v + d,
                                             _mm512_mul_ps(_mm512_loadu_ps(part + g * D_v + d),
                                                           _mm512_set1_ps(al[g - gv])));
            }
            _mm512_storeu_ps(m + gv, mx);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const __m512 sc = _mm512_loadu_ps(sT + t * GV + gv);
                /* no live score yet: -inf weighs 0, NaN stays NaN */
                const __m512 dead =
                    _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sc, sc, _CMP_UNORD_Q), nan);
                const __m512 e = _mm512_mask_blend_ps(live, dead, qkv_exp16(_mm512_sub_ps(sc, mx)));
                _mm512_storeu_ps(sT + t * GV + gv, e);
                sum = _mm512_add_ps(sum, e);
            }
            _mm512_storeu_ps(lp + gv, _mm512_add_ps(_mm512_loadu_ps(lp + gv), sum));
        }
        pv_page(j, page, 0, n, hk, part, sT, 1, GV, vpage, SRC);
        stretch += n;
        if (stretch >= FOLD_KEYS || p0 + n >= len) {
            fold(G, D_v, acc, l, mt, part, lp, m);
            stretch = 0;
        }
    }
    finish(j, b, hk, acc, mt, l);
}

PER_KIND(wide512, qkv_paged_avx512_wide);
#endif
