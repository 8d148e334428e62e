/* The paged decode step's vector item, written once over tiled/_simd.h's vectors and
   compiled per instruction set (_paged512.c, _paged256.c, _paged128.c), for D and D_v
   multiples of 16: per page, each key's G dot products (its row read as stored: widened, or
   dequantized and then scaled once), the page's weights by the vector exp (NaN stays NaN),
   then P·V with the page's value rows widened and scaled once into `vpage`. What it computes
   is the plain C item's (_paged.c); its sums may round differently. */

/* P·V for one page of n keys: acc[g] += Σ_t w[g·wg + t·wt] · V[page, t, hk], V's rows read
   (widened, scaled) once into vpage, each head's output row accumulated in registers 64
   floats at a time across the page's keys. */
TARGET static inline __attribute__((always_inline)) void
pv_page(const Job *j, int64_t page, int64_t n, int64_t hk, float *acc, const float *w, int64_t wg,
        int64_t wt, float *vpage, const int SRC) {
    const int64_t G = j->H / j->H_kv, D_v = j->D_v;
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = page * j->vs[0] + t * j->vs[1] + hk * j->vs[2];
        const vf s = vset1(row_scale(j, 0, page, t, hk));
        for (int64_t d = 0; d < D_v; d += 16)
            vstore(vpage + t * D_v + d, vmul(vload_src(j->v, at + d, SRC), s));
    }
    for (int64_t g = 0; g < G; g++) {
        float *a = acc + g * D_v;
        const float *wg_ = w + g * wg;
        int64_t d = 0;
        for (; d + 64 <= D_v; d += 64) {
            vf x[4];
            for (int c = 0; c < 4; c++) x[c] = vload(a + d + 16 * c);
            for (int64_t t = 0; t < n; t++) {
                const vf p = vset1(wg_[t * wt]);
                for (int c = 0; c < 4; c++)
                    x[c] = vfma(p, vload(vpage + t * D_v + d + 16 * c), x[c]);
            }
            for (int c = 0; c < 4; c++) vstore(a + d + 16 * c, x[c]);
        }
        for (; d < D_v; d += 16) {
            vf x = vload(a + d);
            for (int64_t t = 0; t < n; t++)
                x = vfma(vset1(wg_[t * wt]), vload(vpage + t * D_v + d), x);
            vstore(a + d, x);
        }
    }
}

/* One (sequence b, kv head hk) item, keys and values stored as SRC. work: as item's. */
TARGET static inline __attribute__((always_inline)) void
paged_item(const Job *j, int64_t b, int64_t hk, float *work, const int SRC) {
    const int64_t G = j->H / j->H_kv, D = j->D, D_v = j->D_v, P = j->P;
    const int64_t SP = (P + 15) / 16 * 16; /* a head's scores, padded to whole vectors */
    float *qf = work, *acc = qf + G * D, *s = acc + G * D_v, *vpage = s + G * SP;
    float m[G], l[G];
    begin(j, b, hk, qf, acc, m, l, vpage + P * D_v); /* (D floats past vpage) */
    const int64_t len = j->lengths[b];
    for (int64_t p0 = 0, page_i = 0; p0 < len; p0 += P, page_i++) {
        const int64_t page = j->table[b * j->max_pages + page_i];
        const int64_t n = len - p0 < P ? len - p0 : P;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) { /* 4 keys at a time: Q's loads and the sums shared */
            int64_t at[4];
            float ks[4], sums[4];
            for (int u = 0; u < 4; u++) {
                at[u] = page * j->ks[0] + (t + u) * j->ks[1] + hk * j->ks[2];
                ks[u] = row_scale(j, 1, page, t + u, hk); /* the row's scale, once */
            }
            for (int64_t g = 0; g < G; g++) {
                vf a[4] = {vzero(), vzero(), vzero(), vzero()};
                for (int64_t d = 0; d < D; d += 16) {
                    const vf qv = vload(qf + g * D + d);
                    for (int u = 0; u < 4; u++)
                        a[u] = vfma(qv, vload_src(j->k, at[u] + d, SRC), a[u]);
                }
                vsum4(a[0], a[1], a[2], a[3], sums);
                for (int u = 0; u < 4; u++) s[g * SP + t + u] = sums[u] * ks[u];
            }
        }
        for (; t < n; t++) {
            const int64_t at = page * j->ks[0] + t * j->ks[1] + hk * j->ks[2];
            const float ks = row_scale(j, 1, page, t, hk);
            for (int64_t g = 0; g < G; g++) {
                vf a = vzero();
                for (int64_t d = 0; d < D; d += 16)
                    a = vfma(vload(qf + g * D + d), vload_src(j->k, at + d, SRC), a);
                s[g * SP + t] = vsum(a) * ks;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + g * SP, mx = m[g];
            for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
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
                const lanemask live = n - t >= 16 ? 0xFFFF : (lanemask)((1u << (n - t)) - 1);
                vf e = vexp(vsub(vloadz(live, sg + t), vset1(m[g])));
                e = vblend(live, vzero(), e);
                vstore(sg + t, e);
                sum = vadd(sum, e);
            }
            l[g] += vsum(sum);
        }
        pv_page(j, page, n, hk, acc, s, SP, 1, vpage, SRC);
    }
    finish(j, b, hk, acc, m, l);
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

PER_KIND(paged_item, NAMED(qkv_paged));
