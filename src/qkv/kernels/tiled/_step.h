/* The native step, written once over the vectors of _simd.h and compiled per instruction
   set: _step512.c (AVX-512; with _bf16.h, bfloat16 too) and _step256.c (AVX2 + FMA, float32
   alone). What each function computes is the same on both; the AVX2 one keeps fewer rows
   or keys in registers at a time (_simd.h), and its sums may round differently.

   Forward: softmax(Q Kᵀ · scale + bias) V and its log-sum-exp, per tile of MR query rows
   over every key range of the job, one online softmax (a work item's tiles take each key
   step in turn, sharing its keys in cache); scores, softmax state and output in
   float32; with ALiBi slopes the scaled scores become s + slope · (kv_idx - q_idx), then
   with a soft-cap (cap > 0) cap · tanh(s / cap), before the bias or bounds mask them
   (modified). Backward, per block of KB keys of one head over all rows: S = Q Kᵀ · scale
   (modified) + bias, P = e^(S - lse), dP = dO Vᵀ, dS = P ∘ (dP - Delta) · scale (Delta =
   rowsum(dO ∘ O); with a soft-cap, · (1 - t²) too; ALiBi passes it); dV += Pᵀ dO
   and dK += dSᵀ Q in float32, dQ += dS K (in bfloat16, dS as hi + lo, the forward's ·V
   step). Work is skipped per 32-key block that no row of a tile may attend. */
#ifndef QKV_BF16
#define QKV_BF16 0
#endif

/* Rows r0.. of head (b, h)'s G·R rows of x (strides xs over B, H, G, R; `dim` wide) into
   MR rows of dst in the dtype the call computes in (half precision widened, 16 values at a
   time), pad32(dim) apart, zero past `rows` and past `dim`. */
TARGET static void load_rows(const Job *j, const void *x, const int64_t *xs, int64_t dim, int64_t b,
                             int64_t h, int64_t r0, int rows, void *dst) {
    size_t unit = j->f32 ? 4 : 2, size = (size_t)dim * unit, row = (size_t)pad32(dim) * unit;
    for (int i = 0; i < MR; i++) {
        int64_t g = (r0 + i) / j->R, r = (r0 + i) % j->R;
        char *to = (char *)dst + i * row;
        if (i >= rows) {
            memset(to, 0, row);
            continue;
        }
        const void *from = raw(j, x, b * xs[0] + h * xs[1] + g * xs[2] + r * xs[3]);
        if (!j->f32 || j->src == SRC_F32) { /* as stored, zeros past dim */
            memcpy(to, from, size);
            memset(to + size, 0, row - size);
            continue;
        }
        for (int64_t d = 0; d < pad32(dim); d += 16) { /* widened; none past dim: zeros */
            lanemask in = lanes(d, 0, dim);
            vf y = in == 0xffff ? vload_src(from, d, j->src) : vloadz_src(in, from, d, j->src);
            vstore((float *)to + d, y);
        }
    }
}

/* float32: S[i][jb..jb+32) = (q_i · k_n) · scale for the NR rows from i0 (qt's rows
   pad32(D) apart) and the 32 keys of the packed block kb (D, 32), and each row's running
   lane maximum rmax[i] taken over them. (The sums stay in local registers until the end: a
   vector type may alias anything, so sums kept in *S would be stored and reloaded at every
   step.) */
TARGET static inline __attribute__((always_inline)) void dots_rows(int64_t D, const float *qt,
                                                                   const float *kb, int64_t jb,
                                                                   vf scale, float S[MR][KT],
                                                                   vf *rmax, int i0, const int NR) {
    int64_t qs = pad32(D);
    vf acc[DOT_ROWS][2];
    for (int i = 0; i < NR; i++) acc[i][0] = acc[i][1] = vzero();
    for (int64_t d = 0; d < D; d++) {
        const float *ahead = kb + (d + AHEAD) * 32; /* past the block: the next one's */
        __builtin_prefetch(ahead), __builtin_prefetch(ahead + 16);
        for (int i = 0; i < NR; i++) {
            vf qb = vset1(qt[(i0 + i) * qs + d]);
            acc[i][0] = vfma(qb, vload(kb + d * 32), acc[i][0]);
            acc[i][1] = vfma(qb, vload(kb + d * 32 + 16), acc[i][1]);
        }
    }
    for (int i = 0; i < NR; i++) {
        const vf s0 = vmul(acc[i][0], scale), s1 = vmul(acc[i][1], scale);
        vstore(&S[i0 + i][jb], s0);
        vstore(&S[i0 + i][jb + 16], s1);
        if (rmax) rmax[i0 + i] = vmax(vmax(rmax[i0 + i], s0), s1);
    }
}

/* The MR rows, DOT_ROWS at a time. */
TARGET static void dots_f32(int64_t D, const float *qt, const float *kb, int64_t jb, vf scale,
                            float S[MR][KT], vf *rmax) {
    int i0 = 0;
    for (; i0 + DOT_ROWS <= MR; i0 += DOT_ROWS)
        dots_rows(D, qt, kb, jb, scale, S, rmax, i0, DOT_ROWS);
    if (MR % DOT_ROWS) dots_rows(D, qt, kb, jb, scale, S, rmax, i0, MR % DOT_ROWS);
}

/* float32: O[i] += P[i] · V over the keys n0..n0+last-1 (P's rows `ps` apart, V's rows
   vs[2] apart: float32, read in place, never past the call's last key nor past its `cols`
   columns; O's rows pad32(cols) apart), for the NR rows from i0 and NV 16-column vectors
   from c0. TAIL: the last vectors reach past `cols`, and V is read under a mask there.
   These keys' sum is taken apart and then added to O, so that the forward's float32 chain
   is one step's keys long, not a row's (one FMA a key into O gave the output 3.5–4 times
   the error of torch's kernel at T = 4,096 and 8,192). */
TARGET static inline __attribute__((always_inline)) void
pv_block_f32(const Job *j, const float *vp, int64_t n0, int64_t last, const int *live,
             const float *P, int64_t ps, float *O, int64_t cols, int i0, const int NR, int64_t c0,
             const int NV, const int TAIL) {
    int64_t os = pad32(cols);
    vf acc[PV_ROWS][PV_COLS];
    lanemask in[PV_COLS];
    for (int c = 0; c < NV; c++) in[c] = lanes(c0 + 16 * c, 0, cols);
    for (int i = 0; i < NR; i++)
        for (int c = 0; c < NV; c++) acc[i][c] = vzero();
    for (int64_t n32 = 0; n32 < last; n32 += 32) {
        if (!live[n32 / 32]) continue; /* P = 0 over the block */
        int64_t stop = last - n32 < 32 ? last - n32 : 32, step = j->vs[2];
        int64_t at = (n0 + n32) * step + c0;
        const float *pr = P + i0 * ps + n32;
        for (int64_t n = 0; n < stop; n++, at += step) {
            for (int c = 0; c < NV; c++) __builtin_prefetch(vp + at + AHEAD * step + 16 * c);
            for (int i = 0; i < NR; i++) {
                vf p = vset1(pr[i * ps + n]);
                for (int c = 0; c < NV; c++) /* V read by each FMA: it needs no register */
                    acc[i][c] =
                        vfma(p, TAIL ? vloadz(in[c], vp + at + 16 * c) : vload(vp + at + 16 * c),
                             acc[i][c]);
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int c = 0; c < NV; c++) {
            float *at = O + (i0 + i) * os + c0 + 16 * c;
            vstore(at, vadd(vload(at), acc[i][c]));
        }
}

/* The NR rows from i0 over every column: PV_COLS vectors at a time, then what is left
   (fewer vectors, the last one masked where `cols` ends inside it). */
TARGET static inline __attribute__((always_inline)) void
pv_rows(const Job *j, const float *vp, int64_t n0, int64_t last, const int *live, const float *P,
        int64_t ps, float *O, int64_t cols, int i0, const int NR) {
    int64_t c0 = 0;
    for (; c0 + 16 * PV_COLS <= cols; c0 += 16 * PV_COLS)
        pv_block_f32(j, vp, n0, last, live, P, ps, O, cols, i0, NR, c0, PV_COLS, 0);
    int64_t left = (cols - c0 + 15) / 16; /* 0 .. PV_COLS vectors */
    if (left == 1) pv_block_f32(j, vp, n0, last, live, P, ps, O, cols, i0, NR, c0, 1, 1);
    else if (left == 2) pv_block_f32(j, vp, n0, last, live, P, ps, O, cols, i0, NR, c0, 2, 1);
#if PV_COLS > 2
    else if (left == 3) pv_block_f32(j, vp, n0, last, live, P, ps, O, cols, i0, NR, c0, 3, 1);
    else if (left == 4) pv_block_f32(j, vp, n0, last, live, P, ps, O, cols, i0, NR, c0, 4, 1);
#endif
}

/* float32 O[i] += P[i] · V (float32: half-precision V is widened by the forward's pack, and
   the backward hands dQ's ·K float32 rows), the MR rows PV_ROWS at a time. */
TARGET static void pv_f32(const Job *j, const float *vp, int64_t n0, int64_t last, const int *live,
                          const float *P, int64_t ps, float *O, int64_t cols) {
    int i0 = 0;
    for (; i0 + PV_ROWS <= MR; i0 += PV_ROWS)
        pv_rows(j, vp, n0, last, live, P, ps, O, cols, i0, PV_ROWS);
    if (MR % PV_ROWS) pv_rows(j, vp, n0, last, live, P, ps, O, cols, i0, MR % PV_ROWS);
}

/* S[i][0..nk) = (q_i · k_n) · by for MR rows (qt, in the call's dtype, pad32(D) apart) and
   the nk keys from n0 (nk: a multiple of 32) packed D wide, -inf over the 32-key blocks not
   live (no row of the tile may attend to them); rmax[i], unless rmax is NULL: row i's lane
   maxima over them, in the order a pass over S would take them (the same bits, NaN too). */
TARGET static void scores(const Job *j, const void *qt, const void *kp, int64_t D, int64_t n0,
                          int64_t nk, const int *live, float by, float S[MR][KT], vf *rmax) {
    const vf scale = vset1(by), none = vset1(-INFINITY);
    for (int i = 0; rmax && i < MR; i++) rmax[i] = none;
    for (int64_t jb = 0; jb < nk; jb += 32) {
        const void *kb = elem(j, kp, (n0 + jb) / 32 * D * 32);
        if (!live[jb / 32])
            for (int i = 0; i < MR; i++) vstore(&S[i][jb], none), vstore(&S[i][jb + 16], none);
#if QKV_BF16
        else if (!j->f32) dots_bf16(D, qt, kb, jb, scale, S, rmax);
#endif
        else dots_f32(D, qt, kb, jb, scale, S, rmax);
    }
}

/* One row's P = e^(s - base) over the live 32-key blocks of its nk scores, stored at pf
   for ·V; returns Σ P. */
TARGET static float probs_f32(const float *s, int64_t nk, const int *live, float base, float *pf) {
    vf acc = vzero(), vb = vset1(base);
    for (int64_t n = 0; n < nk; n += 16) {
        if (!live[n / 32]) continue;
        vf p = exp_neg(vsub(vload(s + n), vb));
        vstore(pf + n, p);
        acc = vadd(acc, p);
    }
    return vsum(acc);
}

/* Which 32-key blocks of the nk keys from n0 are live: within [first, last) and allowed to
   one of the tile's `rows` rows (from r0, of batch b) by the row's bounds, or by the bias
   (the bias row of key n at br + n - lead), if there is one. */
TARGET static void live_blocks(const Job *j, int64_t b, const float *bias, int64_t r0, int rows,
                               int64_t n0, int64_t nk, int64_t first, int64_t last, int *live) {
    const vf none = vset1(-INFINITY);
    if (j->bounds) {
        for (int64_t sb = 0; sb < nk / 32; sb++) live[sb] = 0;
        for (int i = 0; i < rows; i++) {
            int64_t f, l;
            row_keys(j, b, r0 + i, n0, first, last, &f, &l);
            for (int64_t sb = f / 32; f < l && sb * 32 < l; sb++) live[sb] = 1;
        }
        return;
    }
    for (int64_t sb = 0; sb < nk / 32; sb++) {
        live[sb] = 0;
        for (int64_t n = sb * 32; n < sb * 32 + 32 && !live[sb]; n += 16) {
            lanemask in = lanes(n, first, last);
            if (!bias) live[sb] = in != 0;
            for (int i = 0; bias && in && i < rows && !live[sb]; i++) {
                const float *br = bias + (r0 + i) * j->bs[2] + n0 - j->lead;
                live[sb] = (vne(vloadz(in, br + n), none) & in) != 0;
            }
        }
    }
}

/* A row's 16 scaled scores x as the job's modification leaves them: plus the ALiBi term
   where it has slopes (`d`: the row's kv_idx - q_idx at the first of the 16 keys), then
   soft-capped where it has a cap (`cap`, `inv` = 1 / cap as vectors), *t = tanh(s / cap)
   for the backward's 1 - t². */
TARGET static inline __attribute__((always_inline)) vf modified(const Job *j, vf x, float slope,
                                                                int64_t d, vf cap, vf inv, vf *t) {
    if (j->slopes) x = vadd(x, vmul(vset1(slope), vadd(vset1((float)d), viota())));
    if (j->cap > 0.0f) {
        *t = vtanh(vmul(x, inv));
        x = vmul(cap, *t);
    }
    return x;
}

/* The 16 scores x plus the row's bias where it has one (br), -inf outside its keys (the
   lanes of `in`). */
TARGET static inline __attribute__((always_inline)) vf masked(vf x, const float *br, lanemask in) {
    if (!br && in == 0xffff) return x;   /* (no blend: AVX2 and NEON build its mask from bits) */
    if (br) x = vadd(x, vloadz(in, br)); /* 0 outside `in`, which the -inf then replaces */
    return vblend(in, vset1(-INFINITY), x);
}

/* Row `row` (of the G·R rows of head h)'s ALiBi slope, and its kv_idx - q_idx at key n0
   of the range from `begin`; 0s where the job has no slopes. */
static inline float alibi_of(const Job *j, int64_t h, int64_t row, int64_t n0, int64_t *d) {
    *d = j->begin + n0 - (j->qpos + row % j->R);
    return j->slopes ? j->slopes[h * j->G + row / j->R] : 0.0f;
}

/* to[0..n) = x[0..n) · by rounded to bfloat16 or float16 (kind: SRC_BF16, SRC_F16), to
   nearest even as torch rounds float32: the output written in the inputs' dtype, not in
   float32 to be rounded by a second pass. x is read in whole vectors (rows pad32 wide). */
TARGET static void narrowed_row(const float *x, float by, int64_t n, uint16_t *to, int kind) {
    const vf s = vset1(by);
    for (int64_t d = 0; d < n; d += 16) {
        uint16_t part[16]; /* the last, partial vector's values, copied after */
        uint16_t *at = n - d >= 16 ? to + d : part;
        vf y = vmul(vload(x + d), s);
        if (kind == SRC_BF16) vstore_bf16(at, y);
        else vstore_f16(at, y);
        if (at == part) memcpy(to + d, part, (size_t)(n - d) * sizeof *part);
    }
}

/* A tile of MR query rows (rows r0.. of the G·R rows of a head; rows past G·R are padding)
   between key steps: its rows in the call's dtype (qt), its outputs (O), and each row's
   running maximum m, sum l and the sum the ·V sees lp. */
typedef struct {
    int64_t r0;
    int rows;
    float *qt, *O, m[MR], l[MR], lp[MR];
} Tile;

/* The tile from row r0 of head (b, h), qt and O its storage (MR · MAX_D floats each): its
   rows loaded, nothing summed yet. */
TARGET static void tile_begin(const Job *j, int64_t b, int64_t h, int64_t r0, float *qt, float *O,
                              Tile *t) {
    int64_t GR = j->G * j->R;
    t->r0 = r0, t->rows = GR - r0 < MR ? (int)(GR - r0) : MR, t->qt = qt, t->O = O;
    load_rows(j, j->q, j->qs, j->D, b, h, r0, t->rows, qt);
    for (int i = 0; i < MR; i++) {
        t->m[i] = -INFINITY;
        t->l[i] = t->lp[i] = 0.0f;
    }
    memset(O, 0, sizeof(float) * MR * pad32(j->Dv));
}

/* One online-softmax step of tile t over the nk keys from n0 of the range j (kp: its keys
   packed, vp: its values, bias: the head's bias rows or NULL; first, last: the range's keys
   among them). */
TARGET static void tile_step(const Job *j, int64_t b, int64_t h, const void *kp, const void *vp,
                             const float *bias, int64_t n0, int64_t nk, int64_t first, int64_t last,
                             Tile *t) {
    const int64_t lead = j->lead, r0 = t->r0, os = pad32(j->Dv);
    const int rows = t->rows;
    float S[MR][KT], Pf[MR * KT]; /* scores; float32 P */
    float *O = t->O, *m = t->m, *l = t->l, *lp = t->lp;
    const size_t pad = (size_t)(MR - rows) * KT; /* padding rows enter ·V as P = 0 */
#if QKV_BF16
    bf16 Ph[MR * KT], Pl[MR * KT]; /* bfloat16 P: hi, lo */
    memset(Ph + rows * KT, 0, pad * sizeof *Ph), memset(Pl + rows * KT, 0, pad * sizeof *Pl);
#endif
    memset(Pf + rows * KT, 0, pad * sizeof *Pf);
    /* A 32-key block is live if one of the tile's rows may attend to one of its keys; the
       rest is skipped (-inf scores, no ·V). */
    int live[KT / 32];
    vf rmax[MR]; /* each row's lane maxima of its scores */
    live_blocks(j, b, bias, r0, rows, n0, nk, first, last, live);
    scores(j, t->qt, kp, j->D, n0, nk, live, j->scale, S, rmax);
    const vf cap = vset1(j->cap), inv = vset1(j->cap > 0.0f ? 1.0f / j->cap : 0.0f);
    for (int i = 0; i < rows; i++) { /* padding rows (i >= rows) are never written out */
        float *s = S[i];
        const float *br = bias ? bias + (r0 + i) * j->bs[2] + n0 - lead : NULL;
        int64_t kf, kl, d; /* the keys this row may see */
        row_keys(j, b, r0 + i, n0, first, last, &kf, &kl);
        float slope = alibi_of(j, h, r0 + i, n0, &d);
        /* A row that sees every key of the step, unmodified and unmasked, has its scores as
           they are: their maximum is the dots' (the causal rows off the diagonal: most of
           them). The others are modified and masked here. */
        const int plain = !j->slopes && !(j->cap > 0.0f) && !br && kf == 0 && kl == nk;
        vf mx = plain ? rmax[i] : vset1(-INFINITY);
        for (int64_t n = 0; n < nk && !plain; n += 16) {
            if (!live[n / 32]) continue;
            vf u = vzero(), x = modified(j, vload(s + n), slope, d + n, cap, inv, &u);
            x = masked(x, br ? br + n : NULL, lanes(n, kf, kl));
            vstore(s + n, x);
            mx = vmax(mx, x);
        }
        float mt = vhmax(mx), mnew = mt > m[i] ? mt : m[i];
        float base = mnew == -INFINITY ? 0.0f : mnew; /* nothing allowed yet: P = 0 */
        float alpha = m[i] == -INFINITY ? 0.0f : expf(m[i] - mnew);
        float sum, seen; /* out is normalised by the P ·V sees, lse keeps float32's */
#if QKV_BF16
        if (!j->f32)
            probs_bf16(s, nk, live, base, Ph + i * KT, j->parts == 2 ? Pl + i * KT : NULL, &sum,
                       &seen);
        else
#endif
            sum = seen = probs_f32(s, nk, live, base, Pf + i * KT);
        l[i] = l[i] * alpha + sum;
        lp[i] = j->parts == 2 ? l[i] : lp[i] * alpha + seen;
        m[i] = mnew;
        if (alpha != 1.0f) {
            vf va = vset1(alpha);
            for (int64_t c = 0; c < os; c += 16)
                vstore(O + i * os + c, vmul(vload(O + i * os + c), va));
        }
    }
#if QKV_BF16
    if (!j->f32) pv_bf16(j, vp, n0, nk, live, Ph, Pl, O, j->Dv);
    else
#endif
        pv_f32(j, vp, n0, last, live, Pf, KT, O, j->Dv);
}

/* Tile t's rows of out and lse, from what its steps summed. */
TARGET static void tile_end(const Job *j, int64_t b, int64_t h, const Tile *t) {
    const int64_t Dv = j->Dv, os = pad32(Dv);
    for (int i = 0; i < t->rows; i++) {
        int64_t g = (t->r0 + i) / j->R, r = (t->r0 + i) % j->R;
        int64_t at = b * j->os[0] + h * j->os[1] + g * j->os[2] + r * j->os[3];
        float inv = t->lp[i] > 0.0f ? 1.0f / t->lp[i] : 0.0f;
        if (j->dst == SRC_F32)
            for (int64_t d = 0; d < Dv; d++) ((float *)j->out)[at + d] = t->O[i * os + d] * inv;
        else narrowed_row(t->O + i * os, inv, Dv, (uint16_t *)j->out + at, j->dst);
        j->lse[b * j->ls[0] + h * j->ls[1] + g * j->ls[2] + r * j->ls[3]] =
            t->l[i] > 0.0f ? t->m[i] + logf(t->l[i]) : -INFINITY;
    }
}

/* One forward work item of a call: ROWS query rows of one (b, h), as ROWS / MR tiles that
   take each key step in turn, every key range of the job, one online softmax each, then
   out and lse. The tiles share each step's keys while they are in the core's cache: a tile
   that ran the whole key span alone before the next read a long span (causal T = 4,096:
   up to 2 MB of K and V a head) once a tile from the L3 cache. A row's sums are the same
   either way. */
TARGET void NAMED(qkv_forward_item)(const Job *job, int64_t it) {
    int64_t bh = it / job->tiles, r0 = (it % job->tiles) * ROWS, GR = job->G * job->R;
    int64_t b = bh / job->H, h = bh % job->H, D = job->D;
    float qt[ROWS / MR][MR * MAX_D], O[ROWS / MR][MR * MAX_D]; /* the tiles' rows, outputs */
    Tile tiles[ROWS / MR];
    int nt = 0;
    for (int64_t r = r0; r < r0 + ROWS && r < GR; r += MR, nt++)
        tile_begin(job, b, h, r, qt[nt], O[nt], &tiles[nt]);
    for (int64_t sg = 0; sg < job->nseg; sg++) {
        Job one = *job, *j = &one; /* the job over this range alone */
        const Seg *seg = &job->segs[sg];
        one.begin = seg->begin, one.lead = seg->lead, one.N = seg->N, one.bias = seg->bias;
        one.bounds = seg->bounds, one.bnb = seg->bnb;
        memcpy(one.bs, seg->bs, sizeof one.bs);
        int64_t lead = j->lead, end = lead + j->N, Np = (end + 31) / 32 * 32;
        const void *kp = elem(j, j->kp, b * j->ks[0] + h * j->ks[1] + j->begin * D);
        /* V in the dtype the call computes in (half precision widened by the pack) */
        const void *vp = elem(j, j->vp, b * j->vs[0] + h * j->vs[1] + j->begin * j->vs[2]);
        const float *bias = j->bias ? j->bias + b * j->bs[0] + h * j->bs[1] : NULL;
        for (int64_t n0 = 0; n0 < Np; n0 += KT) {
            int64_t nk = Np - n0 < KT ? Np - n0 : KT;
            int64_t first = lead > n0 ? lead - n0 : 0, last = end - n0 < nk ? end - n0 : nk;
            for (int k = 0; k < nt; k++)
                tile_step(j, b, h, kp, vp, bias, n0, nk, first, last, &tiles[k]);
        }
    }
    for (int k = 0; k < nt; k++) tile_end(job, b, h, &tiles[k]);
}

#if STEP_ROWS != 2 && MR == 8 /* the row dots hold no query rows: once per instruction set */
/* out[r] = Σ_d a[r][d] · b[r][d] for n contiguous rows of D values held as SRC, widened as
   they are loaded and summed in float32. */
TARGET static inline __attribute__((always_inline)) void
row_dots_src(const void *a, const void *b, int64_t n, int64_t D, float *out, const int SRC) {
    for (int64_t r = 0; r < n; r++) {
        vf acc = vzero();
        for (int64_t d = 0; d < D; d += 16) {
            const lanemask in = lanes(d, 0, D);
            const int64_t at = r * D + d;
            vf x = in == 0xffff ? vload_src(a, at, SRC) : vloadz_src(in, a, at, SRC);
            vf y = in == 0xffff ? vload_src(b, at, SRC) : vloadz_src(in, b, at, SRC);
            acc = vfma(x, y, acc);
        }
        out[r] = vsum(acc);
    }
}

/* The backward's Delta = rowsum(dO ∘ O) (row_dots_src) for any source: half precision is
   read as it is, with no float32 copies of dO and O. */
TARGET void NAMED(qkv_row_dots)(const void *a, const void *b, int64_t n, int64_t D, int src,
                                float *out) {
    if (src == SRC_BF16) row_dots_src(a, b, n, D, out, SRC_BF16);
    else if (src == SRC_F16) row_dots_src(a, b, n, D, out, SRC_F16);
    else row_dots_src(a, b, n, D, out, SRC_F32);
}

/* Whether the n values at x, held as SRC, are all finite: each widened as it is loaded and
   multiplied by 0 into four sums, which stay 0 unless a value is NaN or ±inf (0 · inf is
   NaN), looked at every 16,384 values so that the first chunk with one ends the pass. */
TARGET static inline __attribute__((always_inline)) int finite_src(const void *x, int64_t n,
                                                                   const int SRC) {
    const vf zero = vzero();
    for (int64_t i0 = 0; i0 < n; i0 += 1 << 14) {
        const int64_t i1 = n - i0 < 1 << 14 ? n : i0 + (1 << 14);
        vf acc[4] = {zero, zero, zero, zero};
        int64_t i = i0;
        for (; i + 64 <= i1; i += 64)
            for (int e = 0; e < 4; e++) acc[e] = vfma(vload_src(x, i + 16 * e, SRC), zero, acc[e]);
        for (; i < i1; i += 16) {
            const lanemask in = lanes(i, 0, i1);
            acc[0] = vfma(vloadz_src(in, x, i, SRC), zero, acc[0]);
        }
        if (!(vsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3]))) == 0.0f)) return 0;
    }
    return 1;
}

/* n rows of x (float32, xs apart, each read in whole vectors: pad32(D) readable) rounded
   to bfloat16 or float16 (kind) into the rows of `to`, ts apart, D values each: a backward
   pass's gradients in the inputs' dtype, from each head's float32 sums as the head ends. */
TARGET void NAMED(qkv_narrow_rows)(const float *x, int64_t xs, int64_t n, int64_t D, uint16_t *to,
                                   int64_t ts, int kind) {
    for (int64_t i = 0; i < n; i++) narrowed_row(x + i * xs, 1.0f, D, to + i * ts, kind);
}

/* The dispatch's check that Q, K and V hold no NaN or inf (finite_src) for any source, on
   the step's vectors: one thread, as row dots. */
TARGET int NAMED(qkv_finite)(const void *x, int64_t n, int src) {
    if (src == SRC_BF16) return finite_src(x, n, SRC_BF16);
    if (src == SRC_F16) return finite_src(x, n, SRC_F16);
    return finite_src(x, n, SRC_F32);
}
#endif

/* acc[n] += Σ_i w[i][n] · x[i] over the tile's rows, for the nk keys of the live blocks:
   OUTER_KEYS keys × 32 columns at a time, independent FMA chains that hide the FMA
   latency. x's rows and acc's are D = pad32 of a head dim long (zero past it). */
TARGET static void outer(const float W[MR][KB], const float *x, int64_t D, int rows,
                         const int *live, int64_t nk, float *acc) {
    for (int64_t n = 0; n < nk; n += OUTER_KEYS) {
        if (!live[n / 32]) continue;
        for (int64_t c = 0; c < D; c += 32) {
            vf a[OUTER_KEYS][2];
            for (int k = 0; k < OUTER_KEYS; k++)
                for (int e = 0; e < 2; e++) a[k][e] = vload(acc + (n + k) * D + c + 16 * e);
            for (int i = 0; i < rows; i++) {
                vf x0 = vload(x + i * D + c), x1 = vload(x + i * D + c + 16);
                for (int k = 0; k < OUTER_KEYS; k++) {
                    vf w = vset1(W[i][n + k]);
                    a[k][0] = vfma(w, x0, a[k][0]);
                    a[k][1] = vfma(w, x1, a[k][1]);
                }
            }
            for (int k = 0; k < OUTER_KEYS; k++)
                for (int e = 0; e < 2; e++) vstore(acc + (n + k) * D + c + 16 * e, a[k][e]);
        }
    }
}

/* acc[x] += part[x] and part[x] = 0 for the n floats from 0 (n a multiple of 16). */
TARGET static void fold(float *acc, float *part, int64_t n) {
    for (int64_t x = 0; x < n; x += 16) {
        vstore(acc + x, vadd(vload(acc + x), vload(part + x)));
        vstore(part + x, vzero());
    }
}

/* Keys n0..n0+31 of head (b, h) of p, held as SRC (float32 or half precision), packed at
   dst in float32's layout (D, 32) as pack32 does, 16 dims at a time: each key's 16 values
   loaded as one vector (half precision widened by it) into a 32 × 16 block that stays in
   L1, which is then written out transposed, a row of 32 keys a dim. (pack32 goes value by
   value, each store 32 floats past the last: the two timed in docs/benchmarks.md,
   "measurements behind code choices".) The widened rows are also
   kept at rows, D apart, if given (for dQ's ·K). */
TARGET static inline __attribute__((always_inline)) void
pack32_floats(const Pack *p, int64_t b, int64_t h, int64_t n0, int64_t T, int64_t D, float *dst,
              float *rows, const int SRC) {
    const int64_t unit = SRC == SRC_F32 ? 4 : 2;
    float block[32][16];
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const lanemask in = lanes(d0, 0, D);
        const int64_t nd = D - d0 < 16 ? D - d0 : 16;
        for (int64_t kk = 0; kk < 32; kk++) {
            const int64_t n = n0 + kk;
            const char *xr =
                (const char *)p->x + (b * p->xs[0] + h * p->xs[1] + n * p->xs[2]) * unit;
            vf x = vzero();
            if (n < T) x = in == 0xffff ? vload_src(xr, d0, SRC) : vloadz_src(in, xr, d0, SRC);
            vstore(block[kk], x);
            if (rows) memcpy(rows + kk * D + d0, block[kk], sizeof(float) * nd);
        }
        for (int64_t dd = 0; dd < nd; dd++)
            for (int64_t kk = 0; kk < 32; kk++) dst[(d0 + dd) * 32 + kk] = block[kk][dd];
    }
}

/* pack32_floats for the source src (SRC_F32, SRC_F16 or SRC_BF16), each a constant
   inside. */
TARGET static void pack32_float(const Pack *p, int64_t b, int64_t h, int64_t n0, int64_t T,
                                int64_t D, float *dst, float *rows, int src) {
    if (src == SRC_F16) pack32_floats(p, b, h, n0, T, D, dst, rows, SRC_F16);
    else if (src == SRC_BF16) pack32_floats(p, b, h, n0, T, D, dst, rows, SRC_BF16);
    else pack32_floats(p, b, h, n0, T, D, dst, rows, SRC_F32);
}

/* The forward's pack of one key block in float32's layout (_native.c's pack_block):
   pack32_float. */
TARGET void NAMED(qkv_pack32_float)(const Pack *p, int64_t b, int64_t h, int64_t n0, int64_t T,
                                    float *dst) {
    pack32_float(p, b, h, n0, T, p->D, dst, NULL, p->src);
}

/* One backward work item: the key block of KB keys from n0 (of the call's, counted from
   begin) of head (b, h), over all the call's rows. Its keys are packed here, into the
   thread's `scratch` (KEY_BLOCK_SCRATCH floats): no pass packs all of K and V beforehand.
   dq: this item's (G, R, D) share; dKa, dVa: its keys' (KB, pad32(D)) and (KB, pad32(Dv)).
   dK and dV sum over every row of the call that sees the key (G · R of them: 8,192 for 2
   query heads a key/value head over 4,096 queries): summed FOLD rows at a time, each sum
   then added in, so that no float32 chain runs the length of the call. One chain gave them
   2–4 times the rounding error of torch's blocked backward where every query sees the key
   (tests/kernels/test_native.py); a call's item that sees FOLD rows or fewer (a window)
   sums as before, at no cost. */
TARGET void NAMED(qkv_key_block)(const BJob *bj, int64_t b, int64_t h, int64_t n0, DqOut *dq,
                                 float *dKa, float *dVa, void *scratch) {
    const Job *j = &bj->f;
    int64_t D = j->D, Dv = j->Dv, GR = j->G * j->R, Dp = pad32(D), Dvp = pad32(Dv);
    int64_t lead = j->lead, end = lead + j->N, Np = (end + 31) / 32 * 32;
    int64_t nk = Np - n0 < KB ? Np - n0 : KB;
    int64_t first = lead > n0 ? lead - n0 : 0, last = end - n0 < nk ? end - n0 : nk;
    size_t size = j->f32 ? 4 : 2;
    char *kp = scratch, *vk = kp + KB * D * size, *kvb = vk + KB * Dv * size;
    float *dKc = (float *)scratch + 3 * KB * MAX_D, *dVc = dKc + KB * MAX_D; /* later rows' sums */
    /* float32: K's and V's rows loaded 16 values at a time (half precision widened), and
       half-precision K's rows kept in float32 (kvb) for dQ's ·K, which then reads them as
       they are */
    const int widen = j->f32 && j->src != SRC_F32;
    for (int64_t s = 0; s < nk; s += 32) { /* K and V from key begin + n0, zero past T */
        const int64_t at = j->begin + n0 + s;
        if (j->f32) { /* widened K's rows kept at kvb */
            pack32_float(&bj->k, b, h, at, bj->T, D, (float *)kp + s * D,
                         widen ? (float *)kvb + s * D : NULL, j->src);
            pack32_float(&bj->v, b, h, at, bj->T, Dv, (float *)vk + s * Dv, NULL, j->src);
        } else {
            pack32(&bj->k, b, h, at, bj->T, D, j->f32, kp + s * D * size);
            pack32(&bj->v, b, h, at, bj->T, Dv, j->f32, vk + s * Dv * size);
        }
        if (!j->f32) pack32(&bj->kv, b, h, at, bj->T, D, 0, kvb + s * D * size);
    }
    const void *kv = raw(j, j->vp, b * j->vs[0] + h * j->vs[1] + j->begin * j->vs[2]);
    Job kj = *j; /* dQ's ·K reads K as it is, or its rows widened above (D apart from n0) */
    const void *krows = widen ? (const void *)kvb : kv;
    if (widen) kj.vs[2] = D, kj.src = SRC_F32;
    const float *bias = j->bias ? j->bias + b * j->bs[0] + h * j->bs[1] : NULL;
    float qf[MR * MAX_D], df[MR * MAX_D], S[MR][KT], dP[MR][KT], P[MR][KB], dS[MR][KB];
#if QKV_BF16
    bf16 qt[MR * MAX_D], dt[MR * MAX_D], Dh[MR * KT], Dl[MR * KT];
    const void *qrows = j->f32 ? (void *)qf : qt, *drows = j->f32 ? (void *)df : dt;
#else
    const void *qrows = qf, *drows = df;
#endif
    float O[MR * MAX_D];
    memset(dKa, 0, sizeof(float) * KB * Dp);
    memset(dVa, 0, sizeof(float) * KB * Dvp);
    /* the first FOLD rows are summed in dKa and dVa, the later ones FOLD at a time in dKc and
       dVc (zeroed when first taken), each such sum then added in */
    float *sumK = dKa, *sumV = dVa;
    int64_t summed = 0; /* rows in sumK and sumV since they were last emptied */
    int64_t *span = dq->span;
    span[0] = span[1] = 0; /* dq's rows met: none yet */
    for (int64_t r0 = 0; r0 < GR; r0 += MR) {
        int rows = GR - r0 < MR ? (int)(GR - r0) : MR;
        int live[KT / 32], any = 0;
        live_blocks(j, b, bias, r0, rows, n0, nk, first, last, live);
        for (int64_t sb = 0; sb < nk / 32; sb++) any |= live[sb];
        if (!any) continue;
        load_rows(j, j->q, j->qs, D, b, h, r0, rows, (void *)qrows);
        load_rows(j, bj->dout, bj->dos, Dv, b, h, r0, rows, (void *)drows);
#if QKV_BF16
        for (int64_t x = 0; !j->f32 && x < MR * Dp; x++) { /* float32 copies for dK and dV */
            uint32_t u = (uint32_t)qt[x] << 16;
            memcpy(qf + x, &u, 4);
        }
        for (int64_t x = 0; !j->f32 && x < MR * Dvp; x++) {
            uint32_t u = (uint32_t)dt[x] << 16;
            memcpy(df + x, &u, 4);
        }
#endif
        scores(j, qrows, kp, D, 0, nk, live, j->scale, S, NULL);
        scores(j, drows, vk, Dv, 0, nk, live, 1.0f, dP, NULL);
        const vf zero = vzero(), scale = vset1(j->scale), one = vset1(1.0f);
        const vf cap = vset1(j->cap), inv = vset1(j->cap > 0.0f ? 1.0f / j->cap : 0.0f);
        for (int i = 0; i < MR; i++) {
            int64_t g = (r0 + i) / j->R, r = (r0 + i) % j->R;
            float lse = i < rows
                            ? bj->lse[b * bj->ls[0] + h * bj->ls[1] + g * bj->ls[2] + r * bj->ls[3]]
                            : -INFINITY;
            float delta =
                i < rows
                    ? bj->delta[b * bj->des[0] + h * bj->des[1] + g * bj->des[2] + r * bj->des[3]]
                    : 0.0f;
            const float *br = bias && i < rows ? bias + (r0 + i) * j->bs[2] + n0 - lead : NULL;
            int64_t kf, kl, d = 0; /* the keys this row may see */
            row_keys(j, b, r0 + i, n0, first, last, &kf, &kl);
            float slope = i < rows ? alibi_of(j, h, r0 + i, n0, &d) : 0.0f; /* (a real row) */
            for (int64_t n = 0; n < nk; n += 16) {
                vf p = zero, ds = zero;
                if (live[n / 32] && lse != -INFINITY) { /* a row with no key: P = 0 */
                    vf t = vzero(), x = modified(j, vload(&S[i][n]), slope, d + n, cap, inv, &t);
                    vf chain = j->cap > 0.0f ? vmul(scale, vsub(one, vmul(t, t))) : scale;
                    x = masked(x, br ? br + n : NULL, lanes(n, kf, kl));
                    p = exp_neg(vsub(x, vset1(lse)));
                    ds = vmul(vmul(p, vsub(vload(&dP[i][n]), vset1(delta))), chain);
                }
                vstore(&P[i][n], p);
                vstore(&dS[i][n], ds);
            }
        }
        outer(P, df, Dvp, rows, live, nk, sumV);
        outer(dS, qf, Dp, rows, live, nk, sumK);
        if ((summed += rows) >= FOLD) {
            if (sumK == dKa) { /* the first FOLD rows are in: the next go to dKc and dVc */
                memset(dKc, 0, sizeof(float) * KB * Dp);
                memset(dVc, 0, sizeof(float) * KB * Dvp);
                sumK = dKc, sumV = dVc;
            } else { /* FOLD rows' sums into the item's */
                fold(dKa, dKc, nk * Dp);
                fold(dVa, dVc, nk * Dvp);
            }
            summed = 0;
        }
        memset(O, 0, sizeof(float) * MR * Dp);
#if QKV_BF16
        if (!j->f32) { /* dS enters ·K as bfloat16 hi + lo */
            split_rows(dS, nk, Dh, Dl);
            pv_bf16(j, (const bf16 *)kvb, 0, nk, live, Dh, Dl, O, D);
        } else
#endif
            pv_f32(&kj, krows, widen ? 0 : n0, last, live, &dS[0][0], KB, O, D);
        /* the tile's rows of dq added in or written (each tile is met once); written, zeros
           over the rows of tiles that saw none of the keys since the last that did */
        if (span[1] == 0) span[0] = r0;
        for (int64_t row = span[1]; !dq->add && span[1] && row < r0; row++)
            memset(dq_row(dq, j->R, row), 0, sizeof(float) * D);
        for (int i = 0; i < rows; i++) {
            float *to = dq_row(dq, j->R, r0 + i);
            if (dq->add)
                for (int64_t d = 0; d < D; d++) to[d] += O[i * Dp + d];
            else
                for (int64_t d = 0; d < D; d++) to[d] = O[i * Dp + d];
        }
        span[1] = r0 + rows;
    }
    if (summed && sumK != dKa) {
        fold(dKa, dKc, nk * Dp);
        fold(dVa, dVc, nk * Dvp);
    }
}
