/* qkv's native decode step over a paged KV cache: one query per sequence attends that
   sequence's keys where they lie, in its pages, read through its block table — no gather
   into a contiguous copy first (qkv/kernels/paged.py).

   Work: one item per (sequence, key/value head); the item's G = H / H_kv query heads share
   every key and value row it reads. Per page: the G × n scores, their maximum, one rescale
   of the running sum and output, then P·V. Scores, softmax state and output accumulate in
   float32: bfloat16 keys and values are widened as they are read, and quantized ones (int8,
   or float8 e4m3) are read in place, widened and multiplied by their row's scale (one
   float32 per token and key/value head) — no dequantized copy is made. A key with a NaN or an
   infinite score makes its row NaN, as plain arithmetic would; a sequence with no key gives
   out 0 and lse -inf (the sink's logit with sinks).

   Threads: one OpenMP parallel region per call on the pool torch has loaded, the items
   dealt one at a time (schedule dynamic): a thread that is descheduled on a busy machine
   holds up only the item it is on, the others take the rest. Each item's arithmetic is the
   same whichever thread runs it, so the result does not depend on the thread count.

   Layout. q: (B, H, D) with strides qs[0..1], D contiguous; pages k, v: element strides
   over (page, slot, kv head) ks/vs[0..2], D contiguous (qkv's pool (H_kv, pages, P, D) and
   torch's (pages, P, H_kv, D) both are); table: int32 (B, max_pages) contiguous; lengths:
   int32 (B,); sinks: float32 (H,) or NULL; out: float32 (B, H, D_v) contiguous; lse:
   float32 (B, H); quantized pages' scales: float32, element strides over (page, slot, kv
   head) kss/vss[0..2]. The hot loop is compiled for AVX-512, AVX2 and plain x86-64 and the
   loader picks the one this CPU runs (target_clones). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "_fields.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_X86 1
#include <immintrin.h>
#include "_exp.h"
#endif

typedef uint16_t bf16;

/* How keys and values are stored: as the queries' float32 or bfloat16, or quantized with a
   float32 scale per row (int8, symmetric; float8 e4m3, "fn": no infinities). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_F8 = 3 };

typedef struct {
    const void *q, *k, *v;
    const int32_t *table, *lengths;
    const float *sinks;
    float *out, *lse;
    int64_t qs[2], ks[3], vs[3];
    int64_t B, H, H_kv, D, D_v, P, max_pages;
    float scale;
    int bf16;               /* 1: q is bfloat16; 0: float32 */
    int kv;                 /* KV_*: how k and v are stored */
    const float *ksc, *vsc; /* quantized: the rows' scales; NULL otherwise */
    int64_t kss[3], vss[3];
} Job;

static inline float widen(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A float8 e4m3 value as float32: its sign, and its 7 other bits placed as a float32's
   exponent and mantissa start, then scaled by 2^(127 - 7) — exact for normal and subnormal
   values alike (the float32 is subnormal exactly where the e4m3 one is). */
static inline float from_e4m3(uint8_t b) {
    uint32_t u = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7F) << 20);
    float f;
    memcpy(&f, &u, 4);
    return f * 0x1p120f;
}

/* The scale of key (k: 1) or value (0) row (page, t, hk): 1 where not quantized. */
static inline float row_scale(const Job *j, int k, int64_t page, int64_t t, int64_t hk) {
    const float *s = k ? j->ksc : j->vsc;
    const int64_t *ss = k ? j->kss : j->vss;
    return s ? s[page * ss[0] + t * ss[1] + hk * ss[2]] : 1.0f;
}

/* A row of D values as float32: the row itself (float32) or widened into buf. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline const float *row(const Job *j, const void *base, int64_t at, int64_t n, float *buf) {
    if (!j->bf16) return (const float *)base + at;
    const bf16 *x = (const bf16 *)base + at;
    for (int64_t d = 0; d < n; d++) buf[d] = widen(x[d]);
    return buf;
}

/* Key (k: 1) or value (0) row (page, t, hk) of n values as float32: the row itself
   (float32), or widened into buf (bfloat16), or widened and scaled (int8, float8). */
static inline const float *kv_row(const Job *j, int k, int64_t page, int64_t t, int64_t hk,
                                  int64_t n, float *buf) {
    const void *base = k ? j->k : j->v;
    const int64_t *st = k ? j->ks : j->vs;
    const int64_t at = page * st[0] + t * st[1] + hk * st[2];
    if (j->kv == KV_F32) return (const float *)base + at;
    if (j->kv == KV_BF16) {
        const bf16 *x = (const bf16 *)base + at;
        for (int64_t d = 0; d < n; d++) buf[d] = widen(x[d]);
        return buf;
    }
    const float s = row_scale(j, k, page, t, hk);
    if (j->kv == KV_I8) {
        const int8_t *x = (const int8_t *)base + at;
        for (int64_t d = 0; d < n; d++) buf[d] = (float)x[d] * s;
    } else {
        const uint8_t *x = (const uint8_t *)base + at;
        for (int64_t d = 0; d < n; d++) buf[d] = from_e4m3(x[d]) * s;
    }
    return buf;
}

/* An item's start: its G query rows scaled into qf (G × D), outputs and sums zero, maxima
   -inf. buf: D floats of scratch. */
static void begin(const Job *j, int64_t b, int64_t hk, float *qf, float *acc, float *m, float *l,
                  float *buf) {
    const int64_t G = j->H / j->H_kv, D = j->D, D_v = j->D_v;
    for (int64_t g = 0; g < G; g++) {
        const float *src = row(j, j->q, b * j->qs[0] + (hk * G + g) * j->qs[1], D, buf);
        for (int64_t d = 0; d < D; d++) qf[g * D + d] = src[d] * j->scale;
        for (int64_t d = 0; d < D_v; d++) acc[g * D_v + d] = 0.0f;
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
}

/* Each head's output and log-sum-exp from its running sum l, maximum m and P·V in acc
   (a sink, if any, joins the sum here). */
static void finish(const Job *j, int64_t b, int64_t hk, const float *acc, const float *m,
                   const float *l) {
    const int64_t G = j->H / j->H_kv, D_v = j->D_v;
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = hk * G + g;
        float mg = m[g], lg = l[g], keep = 1.0f;
        if (j->sinks && j->sinks[h] == INFINITY) { /* the sink takes the whole row */
            keep = 0.0f;
            lg = 1.0f;
            mg = INFINITY;
        } else if (j->sinks) { /* a key with no value: in the sum, not in the output */
            const float sink = j->sinks[h], top = sink > mg ? sink : mg;
            keep = mg == -INFINITY ? 0.0f : expf(mg - top);
            lg = lg * keep + (sink == -INFINITY ? 0.0f : expf(sink - top));
            mg = top;
        }
        float *o = j->out + (b * j->H + h) * D_v;
        const float inv = lg > 0.0f ? keep / lg : lg != lg ? NAN : 0.0f;
        for (int64_t d = 0; d < D_v; d++) o[d] = acc[g * D_v + d] * inv;
        j->lse[b * j->H + h] = lg > 0.0f || lg != lg ? mg + logf(lg) : -INFINITY;
    }
}

/* One (sequence b, kv head h) item, in plain C for any sizes. work: per-thread scratch of
   G·(D + D_v + P) + D + D_v floats (or more). */
CLONES
static void item(const Job *j, int64_t b, int64_t hk, float *work) {
    const int64_t G = j->H / j->H_kv, D = j->D, D_v = j->D_v, P = j->P;
    float *qf = work, *acc = qf + G * D, *s = acc + G * D_v, *kbuf = s + G * P, *vbuf = kbuf + D;
    float m[G > 0 ? G : 1], l[G > 0 ? G : 1];
    begin(j, b, hk, qf, acc, m, l, kbuf);
    const int64_t len = j->lengths[b];
    for (int64_t p0 = 0, page_i = 0; p0 < len; p0 += P, page_i++) {
        const int64_t page = j->table[b * j->max_pages + page_i];
        const int64_t n = len - p0 < P ? len - p0 : P;
        for (int64_t t = 0; t < n; t++) {
            const float *kr = kv_row(j, 1, page, t, hk, D, kbuf);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qf + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * kr[d];
                s[g * P + t] = dot;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float mx = m[g];
            for (int64_t t = 0; t < n; t++) mx = s[g * P + t] > mx ? s[g * P + t] : mx;
            if (mx > m[g]) { /* a new maximum: rescale what was summed under the old one */
                const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
                l[g] *= alpha;
                for (int64_t d = 0; d < D_v; d++) acc[g * D_v + d] *= alpha;
                m[g] = mx;
            }
            /* Every score so far -inf: no weight (exp(-inf - -inf) would be NaN). */
            for (int64_t t = 0; t < n; t++)
                s[g * P + t] = m[g] == -INFINITY && s[g * P + t] == -INFINITY
                                   ? 0.0f
                                   : expf(s[g * P + t] - m[g]);
        }
        for (int64_t t = 0; t < n; t++) {
            const float *vr = kv_row(j, 0, page, t, hk, D_v, vbuf);
            for (int64_t g = 0; g < G; g++) {
                const float w = s[g * P + t];
                float *a = acc + g * D_v;
                l[g] += w;
#pragma omp simd
                for (int64_t d = 0; d < D_v; d++) a[d] += w * vr[d];
            }
        }
    }
    finish(j, b, hk, acc, m, l);
}

#ifdef QKV_X86
/* The AVX-512 item, for D and D_v multiples of 16: each key's G dot products in 16-float
   vectors, each page's n weights by a vector exp (degree-7 polynomial after the power-of-two
   split, within 2 ulp of expf; NaN stays NaN), P·V in 16-float vectors. */
#define AVX512 __attribute__((target("avx512f")))
#define ALWAYS static inline __attribute__((always_inline))

/* 16 values from base + at as float32, stored as `kind` (KV_*), unscaled. */
AVX512 ALWAYS __m512 load16(const void *base, int64_t at, const int kind) {
    if (kind == KV_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const bf16 *)base + at));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (kind == KV_I8) {
        __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)base + at));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
    if (kind == KV_F8) { /* as from_e4m3, 16 at a time */
        __m512i w =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + at)));
        __m512i sign = _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 24);
        __m512i rest = _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x7F)), 20);
        return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, rest)),
                             _mm512_set1_ps(0x1p120f));
    }
    return _mm512_loadu_ps((const float *)base + at);
}

/* P·V for one page of n keys: acc[g] += Σ_t w[g·wg + t·wt] · V[page, t, hk]. The page's
   V rows are read (widened) once into vpage; each head's output row is then accumulated
   in registers, 64 floats at a time, across the page's keys. */
AVX512 ALWAYS void pv512(const Job *j, int64_t page, int64_t n, int64_t hk, float *acc,
                         const float *w, int64_t wg, int64_t wt, float *vpage, const int kind) {
    const int64_t G = j->H / j->H_kv, D_v = j->D_v;
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = page * j->vs[0] + t * j->vs[1] + hk * j->vs[2];
        const __m512 s = _mm512_set1_ps(row_scale(j, 0, page, t, hk));
        for (int64_t d = 0; d < D_v; d += 16)
            _mm512_storeu_ps(vpage + t * D_v + d, _mm512_mul_ps(load16(j->v, at + d, kind), s));
    }
    for (int64_t g = 0; g < G; g++) {
        float *a = acc + g * D_v;
        const float *wg_ = w + g * wg;
        int64_t d = 0;
        for (; d + 64 <= D_v; d += 64) {
            __m512 a0 = _mm512_loadu_ps(a + d), a1 = _mm512_loadu_ps(a + d + 16),
                   a2 = _mm512_loadu_ps(a + d + 32), a3 = _mm512_loadu_ps(a + d + 48);
            for (int64_t t = 0; t < n; t++) {
                const __m512 x = _mm512_set1_ps(wg_[t * wt]);
                const float *v = vpage + t * D_v + d;
                a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v), a0);
                a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 16), a1);
                a2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 32), a2);
                a3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 48), a3);
            }
            _mm512_storeu_ps(a + d, a0), _mm512_storeu_ps(a + d + 16, a1);
            _mm512_storeu_ps(a + d + 32, a2), _mm512_storeu_ps(a + d + 48, a3);
        }
        for (; d < D_v; d += 16) {
            __m512 a0 = _mm512_loadu_ps(a + d);
            for (int64_t t = 0; t < n; t++)
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(wg_[t * wt]),
                                     _mm512_loadu_ps(vpage + t * D_v + d), a0);
            _mm512_storeu_ps(a + d, a0);
        }
    }
}

AVX512 ALWAYS void item512(const Job *j, int64_t b, int64_t hk, float *work, const int kind) {
    const int64_t G = j->H / j->H_kv, D = j->D, D_v = j->D_v, P = j->P;
    const int64_t SP = (P + 15) / 16 * 16; /* a head's scores, padded to whole vectors */
    float *qf = work, *acc = qf + G * D, *s = acc + G * D_v, *vpage = s + G * SP;
    float m[G], l[G];
    begin(j, b, hk, qf, acc, m, l, vpage + P * D_v); /* (D floats past vpage) */
    const int64_t len = j->lengths[b];
    for (int64_t p0 = 0, page_i = 0; p0 < len; p0 += P, page_i++) {
        const int64_t page = j->table[b * j->max_pages + page_i];
        const int64_t n = len - p0 < P ? len - p0 : P;
        for (int64_t t = 0; t < n; t++) {
            const int64_t at = page * j->ks[0] + t * j->ks[1] + hk * j->ks[2];
            const float ks = row_scale(j, 1, page, t, hk); /* the row's scale, once */
            for (int64_t g = 0; g < G; g++) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 16)
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + d), load16(j->k, at + d, kind),
                                        a);
                s[g * SP + t] = _mm512_reduce_add_ps(a) * ks;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + g * SP, mx = m[g];
            for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
            if (mx > m[g]) {
                const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
                l[g] *= alpha;
                for (int64_t d = 0; d < D_v; d += 16)
                    _mm512_storeu_ps(
                        acc + g * D_v + d,
                        _mm512_mul_ps(_mm512_loadu_ps(acc + g * D_v + d), _mm512_set1_ps(alpha)));
                m[g] = mx;
            }
            if (m[g] == -INFINITY) { /* every score -inf (no weight) or NaN (NaN) */
                for (int64_t t = 0; t < n; t++) sg[t] = sg[t] == -INFINITY ? 0.0f : NAN;
                for (int64_t t = 0; t < n; t++) l[g] += sg[t];
                continue;
            }
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t += 16) {
                const __mmask16 live = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
                __m512 e = qkv_exp16(
                    _mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + t), _mm512_set1_ps(m[g])));
                e = _mm512_maskz_mov_ps(live, e);
                _mm512_storeu_ps(sg + t, e);
                sum = _mm512_add_ps(sum, e);
            }
            l[g] += _mm512_reduce_add_ps(sum);
        }
        pv512(j, page, n, hk, acc, s, SP, 1, vpage, kind);
    }
    finish(j, b, hk, acc, m, l);
}

/* The AVX-512 item for many query heads per key/value head (G >= 16: a cascade's shared
   prefix, whose "heads" are the whole batch's queries): Q held transposed (D × G), so each
   key scores 16 heads per vector with one broadcast per d and no horizontal sum; the
   softmax state is kept per 16 heads in vectors. */
AVX512 ALWAYS void wide512(const Job *j, int64_t b, int64_t hk, float *work, const int kind) {
    const int64_t G = j->H / j->H_kv, D = j->D, D_v = j->D_v, P = j->P;
    const int64_t GV = (G + 15) / 16 * 16;
    float *qT = work, *acc = qT + D * GV, *sT = acc + G * D_v, *kbuf = sT + P * GV,
          *vbuf = kbuf + D, *m = vbuf + D_v, *l = m + GV, *vpage = l + GV;
    for (int64_t i = 0; i < D * GV; i++) qT[i] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        const float *src = row(j, j->q, b * j->qs[0] + (hk * G + g) * j->qs[1], D, kbuf);
        for (int64_t d = 0; d < D; d++) qT[d * GV + g] = src[d] * j->scale;
    }
    for (int64_t i = 0; i < G * D_v; i++) acc[i] = 0.0f;
    for (int64_t g = 0; g < GV; g++) m[g] = -INFINITY, l[g] = 0.0f;
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), nan = _mm512_set1_ps(NAN);
    const int64_t len = j->lengths[b];
    for (int64_t p0 = 0, page_i = 0; p0 < len; p0 += P, page_i++) {
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
                _mm512_storeu_ps(l + gv, _mm512_mul_ps(_mm512_loadu_ps(l + gv), alpha));
                float al[16];
                _mm512_storeu_ps(al, alpha);
                for (int64_t g = gv; g < gv + 16 && g < G; g++)
                    if ((grew >> (g - gv)) & 1)
                        for (int64_t d = 0; d < D_v; d += 16)
                            _mm512_storeu_ps(acc + g * D_v + d,
                                             _mm512_mul_ps(_mm512_loadu_ps(acc + g * D_v + d),
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
            _mm512_storeu_ps(l + gv, _mm512_add_ps(_mm512_loadu_ps(l + gv), sum));
        }
        pv512(j, page, n, hk, acc, sT, 1, GV, vpage, kind);
    }
    finish(j, b, hk, acc, m, l);
}

/* The items compiled once per storage kind (the kind a constant inside each). */
#define KINDS(name)                                                                                \
    AVX512 static void name##_f32(const Job *j, int64_t b, int64_t hk, float *w) {                 \
        name(j, b, hk, w, KV_F32);                                                                 \
    }                                                                                              \
    AVX512 static void name##_bf16(const Job *j, int64_t b, int64_t hk, float *w) {                \
        name(j, b, hk, w, KV_BF16);                                                                \
    }                                                                                              \
    AVX512 static void name##_i8(const Job *j, int64_t b, int64_t hk, float *w) {                  \
        name(j, b, hk, w, KV_I8);                                                                  \
    }                                                                                              \
    AVX512 static void name##_f8(const Job *j, int64_t b, int64_t hk, float *w) {                  \
        name(j, b, hk, w, KV_F8);                                                                  \
    }
KINDS(wide512)
KINDS(item512)

typedef void (*Item)(const Job *, int64_t, int64_t, float *);
static const Item WIDE[] = {wide512_f32, wide512_bf16, wide512_i8, wide512_f8};
static const Item NARROW[] = {item512_f32, item512_bf16, item512_i8, item512_f8};

static int has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
#endif

static PyObject *decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    unsigned long long q, k, v, table, lengths, sinks, out, lse, ksc, vsc;
    long long qs0, qs1, ks0, ks1, ks2, vs0, vs1, vs2, B, H, H_kv, D, D_v, P, max_pages, num_pages;
    long long kss[3], vss[3];
    double scale;
    int is_bf16, threads, kv;
    static char *names[] = {
        "q",     "k",     "v",        "table",      "lengths",   "sinks",       "out",     "lse",
        "sizes", "scale", "bfloat16", "kv_storage", "key_scale", "value_scale", "threads", NULL};
    if (PyTuple_GET_SIZE(args)) {
        PyErr_SetString(PyExc_TypeError, "decode takes named fields only");
        return NULL;
    }
    if (!parse_fields(kwargs ? kwargs : Py_None, "decode",
                      "$(KLL)(KLLL)(KLLL)(KLL)KKKK(LLLLLL)dii(KLLL)(KLLL)i", names, &q, &qs0, &qs1,
                      &k, &ks0, &ks1, &ks2, &v, &vs0, &vs1, &vs2, &table, &max_pages, &num_pages,
                      &lengths, &sinks, &out, &lse, &B, &H, &H_kv, &D, &D_v, &P, &scale, &is_bf16,
                      &kv, &ksc, &kss[0], &kss[1], &kss[2], &vsc, &vss[0], &vss[1], &vss[2],
                      &threads))
        return NULL;
    if (B < 0 || H_kv <= 0 || H <= 0 || H % H_kv || D <= 0 || D_v <= 0 || P <= 0 || max_pages < 0 ||
        threads < 1 || kv < KV_F32 || kv > KV_F8 || ((kv >= KV_I8) != (ksc && vsc))) {
        PyErr_SetString(PyExc_ValueError, "paged decode: sizes out of range");
        return NULL;
    }
    Job j = {(const void *)q,
             (const void *)k,
             (const void *)v,
             (const int32_t *)table,
             (const int32_t *)lengths,
             (const float *)sinks,
             (float *)out,
             (float *)lse,
             {qs0, qs1},
             {ks0, ks1, ks2},
             {vs0, vs1, vs2},
             B,
             H,
             H_kv,
             D,
             D_v,
             P,
             max_pages,
             (float)scale,
             is_bf16,
             kv,
             (const float *)ksc,
             (const float *)vsc,
             {kss[0], kss[1], kss[2]},
             {vss[0], vss[1], vss[2]}};
    /* The table and lengths, checked before anything is read through them: a length past
       the table or a page outside the pool returns False (the caller says which). */
    const int32_t *tab = (const int32_t *)table, *len = (const int32_t *)lengths;
    for (int64_t b = 0; b < B; b++) {
        if (len[b] < 0 || len[b] > max_pages * P) Py_RETURN_FALSE;
        for (int64_t i = 0; i < (len[b] + P - 1) / P; i++)
            if (tab[b * max_pages + i] < 0 || tab[b * max_pages + i] >= num_pages) Py_RETURN_FALSE;
    }
    const int64_t G = H / H_kv, items = B * H_kv;
    const int64_t GV = (G + 15) / 16 * 16, SP = (P + 15) / 16 * 16;
    const int64_t narrow = G * (D + D_v + SP) + P * D_v + D + D_v;
    const int64_t wide = D * GV + G * D_v + P * GV + D + D_v + 2 * GV + P * D_v;
    const size_t scratch = (size_t)(narrow > wide ? narrow : wide);
    void (*run)(const Job *, int64_t, int64_t, float *) = item;
#ifdef QKV_X86
    if (D % 16 == 0 && D_v % 16 == 0 && has_avx512()) {
        run = G >= 16 ? WIDE[kv] : NARROW[kv];
    }
#endif
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *work = malloc(scratch * sizeof(float));
        if (!work) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++)
            if (work) run(&j, i / H_kv, i % H_kv, work);
        free(work);
    }
    Py_END_ALLOW_THREADS if (failed) return PyErr_NoMemory();
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))decode, METH_VARARGS | METH_KEYWORDS,
     "decode(*, q=(ptr, *2 strides), k=(pages ptr, *3), v=(pages ptr, *3), "
     "table=(ptr, max_pages, num_pages), lengths, sinks (0: none), out, lse, "
     "sizes=(B, H, H_kv, D, D_v, P), scale, bfloat16 (q's dtype), kv_storage (0 float32, 1 "
     "bfloat16, 2 int8, 3 float8 e4m3), key_scale=(ptr|0, *3), value_scale=(ptr|0, *3), "
     "threads): one query per sequence over its pages, into out and lse (float32); False "
     "(nothing computed) if a length or a page it needs is out of range."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,
                                    "_paged",
                                    "qkv's native decode step over a paged KV cache.",
                                    -1,
                                    methods,
                                    NULL,
                                    NULL,
                                    NULL,
                                    NULL};

PyMODINIT_FUNC PyInit__paged(void) { return PyModule_Create(&module); }
