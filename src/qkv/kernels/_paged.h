/* What the paged decode step's translation units share (_paged.c: the Python module, the
   plain C item and AVX-512's many-heads item; _paged512.c, _paged256.c and _paged128.c: the
   vector item per instruction set, from _paged_step.h): a call's description, how its keys
   and values are stored, and the scalar helpers. Layouts: _paged.c's opening comment. */
#ifndef QKV_PAGED_H
#define QKV_PAGED_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_lanes.h"

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
    int64_t heads; /* key/value heads per item of the vector item (_paged_step.h); 0: one */
} Job;

/* The key/value heads one item of the vector item takes (the other items take one). */
static inline int64_t heads_per_item(const Job *j) { return j->heads > 1 ? j->heads : 1; }

/* A float8 e4m3 value as float32: its sign, and its 7 other bits placed as a float32's
   exponent and mantissa start, then scaled by 2^(127 - 7) — exact for normal and subnormal
   values alike (the float32 is subnormal exactly where the e4m3 one is). */
static inline float from_e4m3(uint8_t b) {
    return from_bits(((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7F) << 20)) * 0x1p120f;
}

/* The scale of key (k: 1) or value (0) row (page, t, hk): 1 where not quantized. */
static inline float row_scale(const Job *j, int k, int64_t page, int64_t t, int64_t hk) {
    const float *s = k ? j->ksc : j->vsc;
    const int64_t *ss = k ? j->kss : j->vss;
    return s ? s[page * ss[0] + t * ss[1] + hk * ss[2]] : 1.0f;
}

/* A row of D values as float32: the row itself (float32) or widened into buf. */
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

/* G heads' output sums acc (G × D_v) and weights' sums l zero, their maxima m -inf: an
   item's start, for the sums of its stretch of pages (begin) and its totals (fold). */
static inline void zero_sums(int64_t G, int64_t D_v, float *acc, float *l, float *m) {
    for (int64_t g = 0; g < G; g++) {
        for (int64_t d = 0; d < D_v; d++) acc[g * D_v + d] = 0.0f;
        l[g] = 0.0f;
        m[g] = -INFINITY;
    }
}

/* An item's start: its G query rows scaled into qf (G × D), outputs and sums zero, maxima
   -inf (zero_sums). buf: D floats of scratch. */
static inline void begin(const Job *j, int64_t b, int64_t hk, float *qf, float *acc, float *m,
                         float *l, float *buf) {
    const int64_t G = j->H / j->H_kv, D = j->D;
    for (int64_t g = 0; g < G; g++) {
        const float *src = row(j, j->q, b * j->qs[0] + (hk * G + g) * j->qs[1], D, buf);
        for (int64_t d = 0; d < D; d++) qf[g * D + d] = src[d] * j->scale;
    }
    zero_sums(G, j->D_v, acc, l, m);
}

/* Each head's output and log-sum-exp from its running sum l, maximum m and P·V in acc
   (a sink, if any, joins the sum here). */
static inline void finish(const Job *j, int64_t b, int64_t hk, const float *acc, const float *m,
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

/* Keys an item sums into its stretch's sums before it folds them into its totals (fold):
   the vector items' (whose sums are per page, then per stretch); the plain C item, whose
   sums run key by key, folds four times as often. Every fold reads the totals back from
   memory, which the pages read since have pushed out of the caches: folding every 512 keys
   made the int8 step 1.09–1.11× slower (Zen 4, H = 32 over 8); every 2,048 keys, with the
   totals placed after what each page reads, 1.003–1.008×.
   tests/kernels/c/test_paged.c builds with fewer, so that its short sequences fold too. */
#ifndef FOLD_KEYS
#define FOLD_KEYS 2048
#endif

/* Keys of a page the vector item scores, weighs and sums at a time (page_step): a long page
   (a KV cache's rows read as one page each: paged.decode_rows, or a pool of large pages)
   goes in parts of this many, so that its scores and widened rows stay in the caches. A
   4,096-key page in one part wrote and read back 2 MiB of widened values per head
   (figures: docs/kernels.md#the-paged-decode-kernel). A multiple of 16 dividing FOLD_KEYS
   (tests/kernels/c/test_paged.c builds with fewer, so that its pages go in parts). */
#ifndef PAGE_PART
#define PAGE_PART 64
#endif

/* Two levels of sums, so that no float32 chain runs the length of the sequence: an item
   sums a stretch of pages (FOLD_KEYS keys or so) into `part` (G × D_v) and `lp` (G) under
   the running maxima m, as one level did before, then adds them into its totals `acc` and
   `l`, kept under the maxima `mt` of the last fold (mt ≤ m: a running maximum only grows),
   rescaled to m; the stretch's sums start again from zero. One level gave 14–22 units of
   float32's epsilon × the largest output at 65,536 keys, two give 1.9–3.3 (the plain C
   item: 56–94 key by key, 3.8–5.0). */
static inline void fold(int64_t G, int64_t D_v, float *acc, float *l, float *mt, float *part,
                        float *lp, const float *m) {
    for (int64_t g = 0; g < G; g++) {
        const float alpha = mt[g] == m[g] ? 1.0f : expf(mt[g] - m[g]); /* (both -inf: 1) */
        for (int64_t d = 0; d < D_v; d++) {
            acc[g * D_v + d] = acc[g * D_v + d] * alpha + part[g * D_v + d];
            part[g * D_v + d] = 0.0f;
        }
        l[g] = l[g] * alpha + lp[g];
        lp[g] = 0.0f;
        mt[g] = m[g];
    }
}

/* The keys of a page the vector item takes at a time: the page's, at most PAGE_PART. */
static inline int64_t page_part(int64_t P) { return P < PAGE_PART ? P : PAGE_PART; }

/* The floats of scratch one thread's items need (`work`): the vector item's G query rows,
   output sums (the totals and the stretch's: fold) and padded score rows, a part of a page
   of widened rows and a row (page_part); the plain C item's query rows, sums, a page of
   scores and a row; or the many-heads item's (wide512, G >= 16) transposed queries and
   scores. NH: key/value heads per item (heads_per_item). */
static inline int64_t scratch_floats(int64_t G, int64_t D, int64_t D_v, int64_t P, int64_t NH) {
    const int64_t GV = (G + 15) / 16 * 16, PP = page_part(P), SP = (PP + 15) / 16 * 16;
    const int64_t narrow = NH * G * (D + 2 * D_v + SP) + PP * (D > D_v ? D : D_v) + D + D_v;
    const int64_t plain = G * (D + 2 * D_v + P) + D + D_v;
    const int64_t wide = D * GV + 2 * G * D_v + P * GV + D + D_v + 4 * GV + P * D_v;
    const int64_t most = narrow > plain ? narrow : plain;
    return most > wide ? most : wide;
}

/* The vector item per instruction set (_paged_step.h), one per storage kind (KV_*), for D and
   D_v multiples of 16: work as item's in _paged.c. */
typedef void (*Item)(const Job *, int64_t, int64_t, float *);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC visibility push(hidden)
extern const Item qkv_paged_avx512[4], qkv_paged_avx2[4];
extern const Item qkv_paged_avx512_wide[4]; /* 16 or more query heads per key/value head */
extern const Item qkv_paged_avx512_dots[4]; /* bfloat16 queries, with AVX512-BF16 */
#pragma GCC visibility pop
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC visibility push(hidden)
extern const Item qkv_paged_neon[4];
#ifdef QKV_SVE
extern const Item qkv_paged_sve[4]; /* SVE with 256-bit vectors (_paged_sve.c) */
#endif
#pragma GCC visibility pop
#endif
#endif
