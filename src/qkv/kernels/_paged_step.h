/* The paged decode step's vector item, written once over tiled/_simd.h's vectors and
   compiled per instruction set (_paged512.c, _paged256.c, _paged128.c), for D and D_v
   multiples of 16: per page, each key's G dot products (a quantized row's scale applied to
   its dot products), the page's weights by the vector exp (NaN stays NaN), then P·V (pv_page
   says where it reads the values). Both products can keep several heads' sums in registers
   at once, so one key or value vector loaded and widened serves them all. What it computes
   is the plain C item's (_paged.c); its sums may round differently.

   Compiled with QKV_PAGED_DOTS (_paged512_dots.c, for AVX-512 CPUs with AVX512-BF16), the
   item scores bfloat16 queries against bfloat16, int8 and e4m3 keys with bfloat16 dot
   products instead (score_dots): those keys are bfloat16 values exactly, so are the
   queries, and VDPBF16PS sums two exact products per lane — half the FMAs, the same sums
   to float32 rounding. */
#ifndef QKV_PAGED_DOTS
#define QKV_PAGED_DOTS 0
#endif
#if QKV_PAGED_DOTS
#undef TARGET
#define TARGET TARGET_BF16
#endif

/* Heads per register block: AVX-512's 32 registers hold 4 heads × 4 vectors of sums (and
   the 4 keys or column vectors they share); AVX2's 16 half-width ones and NEON's hold one.
   P·V blocks its heads for every storage kind. The scores block them for quantized keys
   only, whose widening the block then shares: float32 keys scored four heads at a time ran
   slower on Zen 4, bfloat16 ones no faster (docs/head-shapes.md, quantized caches). */
#if QKV_ISA == 512
#define PAGED_HEADS 4
#else
#define PAGED_HEADS 1
#endif
#define QUANTIZED(SRC) ((SRC) == SRC_I8 || (SRC) == SRC_E4M3) /* rows with a scale each */
#define SCORE_HEADS(SRC) (QUANTIZED(SRC) ? PAGED_HEADS : 1)

/* Runs BLOCK(g, NH) over heads 0..G-1 in blocks of MAX heads (MAX at most 4) and one block
   of the heads left over, NH a constant in each. */
#define HEAD_BLOCKS(G, MAX, BLOCK)                                                                 \
    do {                                                                                           \
        int64_t g_ = 0;                                                                            \
        for (; g_ + (MAX) <= (G); g_ += (MAX)) BLOCK(g_, MAX);                                     \
        if ((MAX) > 3 && (G) - g_ == 3) BLOCK(g_, 3);                                              \
        else if ((MAX) > 2 && (G) - g_ == 2) BLOCK(g_, 2);                                         \
        else if ((MAX) > 1 && (G) - g_ == 1) BLOCK(g_, 1);                                         \
    } while (0)

/* P·V of NH heads from head g0 over 64 columns from d: acc[g] += Σ_t w[g·wg + t·wt] · V_t,
   value row t read as SRC from element v0 + t·vt of v. The page's sum is taken apart and
   then added to acc, the item's sums of its current stretch of pages (fold adds those into
   its totals), so that no float32 chain runs the length of the sequence (one FMA a key into
   one sum gave 40–62 units of float32's epsilon of error at 65,536 keys). */
TARGET static inline __attribute__((always_inline)) void
pv_block(float *acc, const float *w, int64_t wg, int64_t wt, const void *v, int64_t v0, int64_t vt,
         int64_t n, int64_t D_v, int64_t g0, int64_t d, const int NH, const int SRC) {
    vf x[4 * 4]; /* NH ≤ 4 heads × 4 vectors (a fixed size: registers, not a stack array) */
    for (int g = 0; g < NH; g++)
        for (int c = 0; c < 4; c++) x[g * 4 + c] = vzero();
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = v0 + t * vt + d;
        if (NH == 1) { /* the values read by the FMAs, as AVX2's registers need */
            const vf p = vset1(w[g0 * wg + t * wt]);
            for (int c = 0; c < 4; c++) x[c] = vfma(p, vload_src(v, at + 16 * c, SRC), x[c]);
            continue;
        }
        vf vv[4]; /* read (widened) once for the block's heads */
        for (int c = 0; c < 4; c++) vv[c] = vload_src(v, at + 16 * c, SRC);
        for (int g = 0; g < NH; g++) {
            const vf p = vset1(w[(g0 + g) * wg + t * wt]);
            for (int c = 0; c < 4; c++) x[g * 4 + c] = vfma(p, vv[c], x[g * 4 + c]);
        }
    }
    for (int g = 0; g < NH; g++)
        for (int c = 0; c < 4; c++) {
            float *at = acc + (g0 + g) * D_v + d + 16 * c;
            vstore(at, vadd(vload(at), x[g * 4 + c]));
        }
}

/* P·V of all G heads, value rows as in pv_block: 64 columns at a time in registers, then
   the last columns 16 at a time. */
TARGET static inline __attribute__((always_inline)) void
pv_rows(float *acc, const float *w, int64_t wg, int64_t wt, const void *v, int64_t v0, int64_t vt,
        int64_t n, int64_t G, int64_t D_v, const int SRC) {
    const int64_t D64 = D_v / 64 * 64; /* columns in whole blocks of 64 */
#define PV_BLOCK(g, NH)                                                                            \
    for (int64_t d = 0; d < D64; d += 64) pv_block(acc, w, wg, wt, v, v0, vt, n, D_v, g, d, NH, SRC)
    HEAD_BLOCKS(G, PAGED_HEADS, PV_BLOCK);
#undef PV_BLOCK
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = D64; d < D_v; d += 16) {
            vf x = vzero();
            for (int64_t t = 0; t < n; t++)
                x = vfma(vset1(w[g * wg + t * wt]), vload_src(v, v0 + t * vt + d, SRC), x);
            vstore(acc + g * D_v + d, vadd(vload(acc + g * D_v + d), x));
        }
}

/* P·V for n keys of a page from slot t0: acc[g] += Σ_t w[g·wg + t·wt] · V[page, t0 + t, hk].
   Where V is not float32, one register block holds every head and each head's weights are
   one row (wt = 1, as page_step gives them), V's rows are read in place, a quantized row's
   scale folded into its weights 16 at a time (w changes); otherwise they are widened and
   scaled once into vpage, and each block reads them there (for float32 rows this copy ran
   faster on Zen 4 than reading them in place). */
TARGET static inline __attribute__((always_inline)) void
pv_page(const Job *j, int64_t page, int64_t t0, int64_t n, int64_t hk, float *acc, float *w,
        int64_t wg, int64_t wt, float *vpage, const int SRC) {
    const int64_t G = j->H / j->H_kv, D_v = j->D_v;
    const int64_t v0 = page * j->vs[0] + t0 * j->vs[1] + hk * j->vs[2];
    if (SRC != SRC_F32 && G <= PAGED_HEADS && wt == 1) {
        if (QUANTIZED(SRC)) {
            float sc[16];
            for (int64_t u = 0; u < n; u += 16) {
                for (int64_t t = 0; t < 16; t++)
                    sc[t] = u + t < n ? row_scale(j, 0, page, t0 + u + t, hk) : 0.0f;
                for (int64_t g = 0; g < G; g++)
                    vstore(w + g * wg + u, vmul(vload(w + g * wg + u), vload(sc)));
            }
        }
        pv_rows(acc, w, wg, wt, j->v, v0, j->vs[1], n, G, D_v, SRC);
        return;
    }
    for (int64_t t = 0; t < n; t++) {
        const vf sc = vset1(row_scale(j, 0, page, t0 + t, hk));
        for (int64_t d = 0; d < D_v; d += 16)
            vstore(vpage + t * D_v + d, vmul(vload_src(j->v, v0 + t * j->vs[1] + d, SRC), sc));
    }
    pv_rows(acc, w, wg, wt, vpage, 0, D_v, n, G, D_v, SRC_F32);
}

/* Scores t..t+3 of NH heads from head g0 into s (a head's row every SP floats): the lanes of
   each of the NH × 4 sums in a added up, times its key's ks. */
TARGET static inline __attribute__((always_inline)) void store_scores(const vf *a, const float *ks,
                                                                      int64_t g0, float *s,
                                                                      int64_t SP, int64_t t,
                                                                      const int NH) {
    for (int g = 0; g < NH; g++) {
        float sums[4];
        vsum4(a[g * 4], a[g * 4 + 1], a[g * 4 + 2], a[g * 4 + 3], sums);
        for (int u = 0; u < 4; u++) s[(g0 + g) * SP + t + u] = sums[u] * ks[u];
    }
}

/* The scores of NH heads from head g0 against keys t..t+3 (read as SRC from element
   k0 + t·kt of k), times the keys' scales ks, into s (a head's row every SP floats). */
TARGET static inline __attribute__((always_inline)) void
score_block(const void *k, int64_t k0, int64_t kt, int64_t t, const float *ks, const float *qf,
            int64_t D, int64_t g0, float *s, int64_t SP, const int NH, const int SRC) {
    vf a[4 * 4]; /* NH ≤ 4 heads × 4 keys */
    for (int g = 0; g < NH; g++)
        for (int u = 0; u < 4; u++) a[g * 4 + u] = vzero();
    for (int64_t d = 0; d < D; d += 16) {
        if (NH == 1) { /* the keys read by the FMAs, as AVX2's registers need */
            const vf qv = vload(qf + g0 * D + d);
            for (int u = 0; u < 4; u++)
                a[u] = vfma(qv, vload_src(k, k0 + (t + u) * kt + d, SRC), a[u]);
            continue;
        }
        vf kv[4];
        for (int u = 0; u < 4; u++) kv[u] = vload_src(k, k0 + (t + u) * kt + d, SRC);
        for (int g = 0; g < NH; g++) {
            const vf qv = vload(qf + (g0 + g) * D + d);
            for (int u = 0; u < 4; u++) a[g * 4 + u] = vfma(qv, kv[u], a[g * 4 + u]);
        }
    }
    store_scores(a, ks, g0, s, SP, t, NH);
}

#if QKV_PAGED_DOTS
/* As score_block, with bfloat16 dot products: the NH heads' bfloat16 query rows from head
   g0 (qh, a head every qg elements, not scaled) against keys t..t+3 as bfloat16 (read as
   they are, or widened from int8 or e4m3 and rounded: exact), 32 values at a time; ks: the
   keys' scales times the softmax scale. D: a multiple of 32. */
TARGET static inline __attribute__((always_inline)) void
score_dots(const void *k, int64_t k0, int64_t kt, int64_t t, const float *ks, const bf16 *qh,
           int64_t qg, int64_t D, int64_t g0, float *s, int64_t SP, const int NH, const int SRC) {
    vf a[4 * 4]; /* NH ≤ 4 heads × 4 keys */
    for (int g = 0; g < NH; g++)
        for (int u = 0; u < 4; u++) a[g * 4 + u] = vzero();
    for (int64_t d = 0; d < D; d += 32) {
        vbf kv[4];
        for (int u = 0; u < 4; u++) {
            const int64_t at = k0 + (t + u) * kt + d;
            kv[u] = SRC == SRC_BF16 ? vbf_load((const bf16 *)k + at)
                                    : vbf_round(vload_src(k, at, SRC), vload_src(k, at + 16, SRC));
        }
        for (int g = 0; g < NH; g++) {
            const vbf qv = vbf_load(qh + (g0 + g) * qg + d);
            for (int u = 0; u < 4; u++) a[g * 4 + u] = vdot(a[g * 4 + u], qv, kv[u]);
        }
    }
    store_scores(a, ks, g0, s, SP, t, NH);
}
#endif

/* The G × n scores of keys t0 .. t0 + n - 1 of a page into s (a head's row every SP
   floats): the t-th is read as SRC from element k0 + t·kt of k, then multiplied by its
   row's scale (slot t0 + t). qh: the heads' bfloat16 query rows (a head every qg
   elements), for score_dots; NULL: qf's. */
TARGET static inline __attribute__((always_inline)) void
page_scores(const Job *j, const void *k, int64_t k0, int64_t kt, int64_t page, int64_t t0,
            int64_t n, int64_t hk, const float *qf, const bf16 *qh, int64_t qg, float *s,
            int64_t SP, const int SRC) {
    const int64_t G = j->H / j->H_kv, D = j->D;
    const int dots = QKV_PAGED_DOTS && qh && SRC != SRC_F32 && D % 32 == 0;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) { /* 4 keys at a time, their loads shared by the heads */
        float ks[4];
        for (int u = 0; u < 4; u++) /* once */
            ks[u] = row_scale(j, 1, page, t0 + t + u, hk) * (dots ? j->scale : 1.0f);
#if QKV_PAGED_DOTS
        if (dots) {
#define SCORE_DOTS(g, NH) score_dots(k, k0, kt, t, ks, qh, qg, D, g, s, SP, NH, SRC)
            HEAD_BLOCKS(G, PAGED_HEADS, SCORE_DOTS);
#undef SCORE_DOTS
            continue;
        }
#endif
#define SCORE_BLOCK(g, NH) score_block(k, k0, kt, t, ks, qf, D, g, s, SP, NH, SRC)
        HEAD_BLOCKS(G, SCORE_HEADS(SRC), SCORE_BLOCK);
#undef SCORE_BLOCK
    }
    for (; t < n; t++) {
        const float ks = row_scale(j, 1, page, t0 + t, hk);
        for (int64_t g = 0; g < G; g++) {
            vf a = vzero();
            for (int64_t d = 0; d < D; d += 16)
                a = vfma(vload(qf + g * D + d), vload_src(k, k0 + t * kt + d, SRC), a);
            s[g * SP + t] = vsum(a) * ks;
        }
    }
}

/* Asks for `rows` rows of `bytes` bytes, `stride` bytes apart from `at`, a cache line at a
   time. */
static inline void prefetch_rows(const char *at, int64_t rows, int64_t stride, int64_t bytes) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t d = 0; d < bytes; d += 64) __builtin_prefetch(at + t * stride + d);
}

/* Asks for the rows page_step reads next: part (page, t0, n)'s value rows, read after its
   scores, and the key rows of the page's next part. Half-precision and quantized rows are
   widened as they are read, work enough per byte that the loads alone did not keep memory
   busy: a decode step over 32 sequences × 8,192 tokens in one page each (KVCache's layout,
   H = 8, D = 64) took 0.87× the time with int8 rows and 0.89× with bfloat16 ones (held to
   AVX2 0.88× and 0.79×), e4m3 the same; float32 rows, read at memory's speed already, went
   1.05× slower and go without (docs/kernels.md#the-paged-decode-kernel). */
TARGET static inline __attribute__((always_inline)) void
prefetch_part(const Job *j, int64_t page, int64_t t0, int64_t n, int64_t hk, const int SRC) {
    const int64_t size = SRC == SRC_BF16 || SRC == SRC_F16 ? 2 : 1; /* bytes per element */
    const int64_t next = t0 + n, rows = j->P - next < n ? j->P - next : n;
    const char *v = (const char *)j->v, *k = (const char *)j->k;
    prefetch_rows(v + size * (page * j->vs[0] + t0 * j->vs[1] + hk * j->vs[2]), n, size * j->vs[1],
                  size * j->D_v);
    prefetch_rows(k + size * (page * j->ks[0] + next * j->ks[1] + hk * j->ks[2]), rows,
                  size * j->ks[1], size * j->D);
}

/* n keys of a page from slot t0 (a part: page_part) for kv head hk, stored as SRC: the
   G × n scores into s (a head's row every SP floats), each head's maximum m and the rescale
   of its sum l and outputs acc, the weights, then P·V. On AVX2 and NEON, whose register
   blocks hold one head, where several heads share float8 keys the part's key rows are
   widened once into `page_buf` and scored from there (widening them per head cost more than
   the store: 0.76–0.87× the time with it, G = 4 and 8 held to AVX2); AVX-512's blocks of 4
   heads read them in place (the buffer took 1.10–1.28× the time at G = 8). `page_buf` then
   takes the part's values. */
TARGET static inline __attribute__((always_inline)) void
page_step(const Job *j, int64_t page, int64_t t0, int64_t n, int64_t hk, const float *qf,
          const bf16 *qh, float *acc, float *s, int64_t SP, float *m, float *l, float *page_buf,
          const int SRC) {
    const int64_t G = j->H / j->H_kv, D = j->D, D_v = j->D_v;
    const int64_t k0 = page * j->ks[0] + t0 * j->ks[1] + hk * j->ks[2];
    if (SRC != SRC_F32) prefetch_part(j, page, t0, n, hk, SRC);
    if (PAGED_HEADS == 1 && G > 1 && SRC == SRC_E4M3) {
        for (int64_t t = 0; t < n; t++)
            for (int64_t d = 0; d < D; d += 16)
                vstore(page_buf + t * D + d, vload_src(j->k, k0 + t * j->ks[1] + d, SRC));
        page_scores(j, page_buf, 0, D, page, t0, n, hk, qf, NULL, 0, s, SP, SRC_F32);
    } else page_scores(j, j->k, k0, j->ks[1], page, t0, n, hk, qf, qh, j->qs[1], s, SP, SRC);
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * SP;
        vf best = vset1(-INFINITY); /* the largest score per lane (a NaN is passed over) */
        for (int64_t t = 0; t < n; t += 16) {
            const lanemask live = lanes(t, 0, n);
            const vf x = vload(sg + t); /* (a row is SP long: past n, read and not used) */
            best = vblend(vge(x, best) & live, best, x);
        }
        const float top = vhmax(best), mx = top > m[g] ? top : m[g];
        if (mx > m[g]) { /* a new maximum: rescale what was summed under the old one */
            const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
            l[g] *= alpha;
            for (int64_t d = 0; d < D_v; d += 16)
                vstore(acc + g * D_v + d, vmul(vload(acc + g * D_v + d), vset1(alpha)));
            m[g] = mx;
        }
        if (m[g] == -INFINITY) { /* every score -inf (no weight) or NaN (NaN) */
            for (int64_t t = 0; t < n; t++) sg[t] = sg[t] == -INFINITY ? 0.0f : NAN;
            for (int64_t t = 0; t < n; t++) l[g] += sg[t];
            continue;
        }
        vf sum = vzero();
        for (int64_t t = 0; t < n; t += 16) {
            const lanemask live = lanes(t, 0, n);
            vf e = vexp(vsub(vloadz(live, sg + t), vset1(m[g])));
            e = vblend(live, vzero(), e);
            vstore(sg + t, e);
            sum = vadd(sum, e);
        }
        l[g] += vsum(sum);
    }
    pv_page(j, page, t0, n, hk, acc, s, SP, 1, page_buf, SRC);
}

/* One item: sequence b's key/value heads hk0 .. hk0 + heads_per_item(j) - 1, keys and
   values stored as SRC; work as item's. Page by page, each page for every head of the item
   before the next page: where a slot's heads lie side by side (torch's layout, (pages, P,
   H_kv, D)), the item then reads its pages as whole stretches of memory rather than one
   head's rows several kilobytes apart. Each head's arithmetic is the same either way. */
TARGET static inline __attribute__((always_inline)) void
paged_item(const Job *j, int64_t b, int64_t hk0, float *work, const int SRC) {
    const int64_t G = j->H / j->H_kv, D = j->D, D_v = j->D_v, P = j->P, NH = heads_per_item(j);
    const int64_t PP = page_part(P), SP = (PP + 15) / 16 * 16; /* scores, whole vectors */
    const int64_t DM = D > D_v ? D : D_v, per_head = G * (D + 2 * D_v + SP);
    /* head h's query rows (qf), the stretch's output sums (part), scores (s) and output
       totals (acc, read only by fold: last, after what each page reads) from
       work + h · per_head; maxima m, sums lp, l and the totals' maxima mt */
    float *page_buf = work + NH * per_head, m[NH * G], lp[NH * G], l[NH * G], mt[NH * G];
    for (int64_t h = 0; h < NH; h++) {
        float *qf = work + h * per_head, *part = qf + G * D, *acc = part + G * (D_v + SP);
        begin(j, b, hk0 + h, qf, part, m + h * G, lp + h * G, page_buf + PP * DM); /* (D past) */
        zero_sums(G, D_v, acc, l + h * G, mt + h * G);
    }
    const int64_t len = j->lengths[b];
    for (int64_t p0 = 0, page_i = 0, stretch = 0; p0 < len; p0 += P, page_i++) {
        const int64_t page = j->table[b * j->max_pages + page_i];
        const int64_t in_page = len - p0 < P ? len - p0 : P;
        for (int64_t t0 = 0; t0 < in_page; t0 += PP) { /* the page in parts of PP keys */
            const int64_t n = in_page - t0 < PP ? in_page - t0 : PP;
            stretch += n;
            for (int64_t h = 0; h < NH; h++) {
                float *qf = work + h * per_head, *part = qf + G * D, *s = part + G * D_v;
                float *acc = s + G * SP;
                const bf16 *qh = /* the bfloat16 query rows, where score_dots takes them */
                    QKV_PAGED_DOTS && j->bf16
                        ? (const bf16 *)j->q + b * j->qs[0] + (hk0 + h) * G * j->qs[1]
                        : NULL;
                const int64_t at = h * G;
                page_step(j, page, t0, n, hk0 + h, qf, qh, part, s, SP, m + at, lp + at, page_buf,
                          SRC);
                if (stretch >= FOLD_KEYS || p0 + t0 + n >= len)
                    fold(G, D_v, acc, l + at, mt + at, part, lp + at, m + at);
            }
            if (stretch >= FOLD_KEYS) stretch = 0;
        }
    }
    for (int64_t h = 0; h < NH; h++) {
        float *acc = work + h * per_head + G * (D + D_v + SP);
        finish(j, b, hk0 + h, acc, mt + h * G, l + h * G);
    }
}

/* The table `table` of `body` (an item taking its storage kind last) per storage kind, in
   KV_* order, the kind a constant inside each. */
#define PER_KIND(body, table)                                                                      \
    TARGET static void body##_f32(const Job *j, int64_t b, int64_t hk, float *w) {                 \
        body(j, b, hk, w, SRC_F32);                                                                \
    }                                                                                              \
    TARGET static void body##_bf16(const Job *j, int64_t b, int64_t hk, float *w) {                \
        body(j, b, hk, w, SRC_BF16);                                                               \
    }                                                                                              \
    TARGET static void body##_i8(const Job *j, int64_t b, int64_t hk, float *w) {                  \
        body(j, b, hk, w, SRC_I8);                                                                 \
    }                                                                                              \
    TARGET static void body##_e4m3(const Job *j, int64_t b, int64_t hk, float *w) {                \
        body(j, b, hk, w, SRC_E4M3);                                                               \
    }                                                                                              \
    const Item table[4] = {body##_f32, body##_bf16, body##_i8, body##_e4m3}

#if QKV_PAGED_DOTS
PER_KIND(paged_item, qkv_paged_avx512_dots);
#else
PER_KIND(paged_item, NAMED(qkv_paged));
#endif
