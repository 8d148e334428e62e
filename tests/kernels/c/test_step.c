/* qkv's native step (src/qkv/kernels/tiled/_step.h) against float64 references, with no
   Python: one forward and one backward call per case, for every step this machine runs —
   x86-64: AVX-512 and AVX2 (both register blockings) where the CPU has them; ARM64: NEON
   (both; tests/kernels/test_toolchains.py runs it under qemu-user on an x86 machine).
   Cases: head dims on and off the vectors (D_v apart from D), inputs in float32, bfloat16
   and float16 (widened as the step loads them), rows masked by bounds (one row with no
   key), ALiBi with a soft-cap, GQA rows; bfloat16 in the CPU's bfloat16 dot products where
   the step has them and the CPU runs them (AVX512-BF16; BFDOT on ARM64); half-precision
   outputs rounded by the step as float32's round; a call of 600 rows, whose backward
   items sum dK and dV over more than FOLD rows; and the backward's
   Delta (row_dots) in each dtype and head dim. Prints a line per case and exits 1 if any is out of
   tolerance.

   Legend: B batch · H key/value heads · G query heads per key/value head · R query rows ·
   T keys · D head dim of Q and K · Dv of V. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../../src/qkv/kernels/_cpu.h"
#include "../../../src/qkv/kernels/tiled/_kernel.h"

typedef void (*Forward)(const Job *, int64_t);
typedef void (*Backward)(const BJob *, int64_t, int64_t, int64_t, DqOut *, float *, float *,
                         void *);
typedef void (*RowDots)(const void *, const void *, int64_t, int64_t, int, float *);
typedef struct {
    const char *name;
    int isa;
    Forward forward;
    Backward backward;
    RowDots row_dots;
    int dots; /* runs bfloat16 in bfloat16 dot products on this CPU */
} Step;

static uint64_t state = 88172645463325252ull;

static double normal(void) { /* Box-Muller over xorshift64 */
    double u[2];
    for (int i = 0; i < 2; i++) {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        u[i] = ((double)(state >> 11) + 0.5) / 9007199254740992.0;
    }
    return sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]);
}

/* A value exact in the source dtype, stored at x[i] in it; returns the value. bfloat16: a
   float32 with its low 16 bits cleared. float16: m · 2^-9 for an integer |m| < 2048 (exact
   in float16's 11 bits), encoded here from its sign, exponent and mantissa. */
static double store(void *x, int64_t i, int src, double want) {
    if (src == SRC_F32) return ((float *)x)[i] = (float)want;
    if (src == SRC_BF16) {
        float f = (float)want;
        uint32_t u;
        memcpy(&u, &f, 4);
        u &= 0xffff0000u;
        ((uint16_t *)x)[i] = (uint16_t)(u >> 16);
        memcpy(&f, &u, 4);
        return f;
    }
    long m = lround(want * 512.0);
    m = m > 2047 ? 2047 : m < -2047 ? -2047 : m;
    uint16_t bits = m < 0 ? 0x8000u : 0;
    unsigned long a = (unsigned long)labs(m);
    if (a) {
        int e = 0;
        while ((a >> e) > 1) e++;                              /* a = 2^e · (1 + f) */
        uint16_t mant = (uint16_t)(((a << 10) >> e) & 0x3ffu); /* exact: e <= 10 */
        bits |= (uint16_t)((e - 9 + 15) << 10) | mant;
    }
    ((uint16_t *)x)[i] = bits;
    return (double)m / 512.0;
}

/* float32 rounded to bfloat16 or float16 to nearest even, one value at a time (the
   reference for the step's vector stores of a half-precision output). */
static uint16_t rounded(float f, int dst) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t a = u & 0x7fffffffu;
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    if (dst == SRC_BF16)
        return a > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)
                               : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    if (a > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* 65520 and up: inf */
    if (a < 0x38800000u) return sign | (uint16_t)nearbyint(fabsf(f) * 16777216.0); /* 2^-24s */
    uint32_t h = ((a >> 23) - 112) << 10 | ((a >> 13) & 0x3ffu), rest = a & 0x1fffu;
    return sign | (uint16_t)(h + (rest > 0x1000u || (rest == 0x1000u && (h & 1u))));
}

typedef struct {
    int64_t H, G, R, T, D, Dv;
    int src, bounds, mod;
    int dots; /* bfloat16 in bfloat16 dot products, K and V packed in their pairs */
} Case;

/* The reference score of row (h, g, r) for key n, as the step modifies it (ALiBi, then the
   soft-cap); *t: tanh(s / cap) where there is a cap. */
static double score(const Case *c, const double *q, const double *k, double scale, double slope,
                    int64_t r, int64_t n, double cap, double *t) {
    double s = 0;
    for (int64_t d = 0; d < c->D; d++) s += q[d] * k[n * c->D + d];
    s = s * scale + slope * (double)(n - (5 + r));
    if (cap > 0) {
        *t = tanh(s / cap);
        s = cap * *t;
    }
    return s;
}

static int run_case(const Step *st, const Case *c) {
    const int64_t B = 1, H = c->H, G = c->G, R = c->R, T = c->T, D = c->D, Dv = c->Dv;
    const int64_t rows = B * H * G * R, Nt = (T + 31) / 32 * 32 + 32;
    const double scale = (c->mod ? 3.0 : 1.0) / sqrt((double)D), cap = c->mod ? 2.5 : 0.0;
    size_t unit = c->src == SRC_F32 ? 4 : 2;
    void *q = malloc(rows * D * unit), *k = malloc(B * H * T * D * unit);
    void *v = malloc(B * H * T * Dv * unit), *dout = malloc(rows * Dv * unit);
    double *qd = malloc(sizeof(double) * rows * D), *kd = malloc(sizeof(double) * B * H * T * D);
    double *vd = malloc(sizeof(double) * B * H * T * Dv);
    double *dod = malloc(sizeof(double) * rows * Dv);
    for (int64_t i = 0; i < rows * D; i++) qd[i] = store(q, i, c->src, normal());
    for (int64_t i = 0; i < B * H * T * D; i++) kd[i] = store(k, i, c->src, normal());
    for (int64_t i = 0; i < B * H * T * Dv; i++) vd[i] = store(v, i, c->src, normal());
    for (int64_t i = 0; i < rows * Dv; i++) dod[i] = store(dout, i, c->src, normal());
    float slopes[64];
    for (int64_t i = 0; i < H * G; i++) slopes[i] = c->mod ? 0.05f * (float)(i + 1) : 0.0f;
    int32_t bounds[2 * 64];
    for (int64_t r = 0; r < R; r++) /* row 0 sees no key; the others a window */
        bounds[2 * r] = (int32_t)(r * 3 - 10), bounds[2 * r + 1] = r ? (int32_t)(r * 5 + 3) : 0;

    /* The reference: out, lse, and the gradients for dO, in float64. */
    double *out = calloc(rows * Dv, sizeof(double)), *lse = malloc(sizeof(double) * rows);
    double *dq = calloc(rows * D, sizeof(double)), *dk = calloc(B * H * T * D, sizeof(double));
    double *dv = calloc(B * H * T * Dv, sizeof(double)), *s = malloc(sizeof(double) * T);
    double *tt = malloc(sizeof(double) * T);
    for (int64_t h = 0; h < H; h++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t r = 0; r < R; r++) {
                int64_t row = (h * G + g) * R + r, lo = 0, hi = T;
                if (c->bounds) lo = bounds[2 * r] > 0 ? bounds[2 * r] : 0, hi = bounds[2 * r + 1];
                hi = hi < T ? hi : T;
                const double *qr = qd + row * D, *kh = kd + h * T * D, *vh = vd + h * T * Dv;
                double mx = -INFINITY, sum = 0;
                for (int64_t n = lo; n < hi; n++) {
                    s[n] = score(c, qr, kh, scale, slopes[h * G + g], r, n, cap, &tt[n]);
                    mx = s[n] > mx ? s[n] : mx;
                }
                for (int64_t n = lo; n < hi; n++) sum += exp(s[n] - mx);
                lse[row] = sum > 0 ? mx + log(sum) : -INFINITY;
                double delta = 0;
                for (int64_t n = lo; n < hi; n++)
                    for (int64_t d = 0; d < Dv; d++)
                        out[row * Dv + d] += exp(s[n] - lse[row]) * vh[n * Dv + d];
                for (int64_t d = 0; d < Dv; d++) delta += dod[row * Dv + d] * out[row * Dv + d];
                for (int64_t n = lo; n < hi; n++) {
                    double p = exp(s[n] - lse[row]), dp = 0;
                    for (int64_t d = 0; d < Dv; d++) dp += dod[row * Dv + d] * vh[n * Dv + d];
                    double ds = p * (dp - delta) * scale * (cap > 0 ? 1 - tt[n] * tt[n] : 1);
                    for (int64_t d = 0; d < D; d++) {
                        dq[row * D + d] += ds * kh[n * D + d];
                        dk[(h * T + n) * D + d] += ds * qr[d];
                    }
                    for (int64_t d = 0; d < Dv; d++)
                        dv[(h * T + n) * Dv + d] += p * dod[row * Dv + d];
                }
            }

    /* The step's forward: K packed (float32, widened; or in bfloat16 pairs), V in float32
       rows (half precision widened, as native.pack does) or packed in its pairs. */
    const int f32 = !c->dots;
    const size_t cu = f32 ? 4 : 2; /* what the step computes in */
    char *kp = calloc(B * H * Nt * D, cu), *vpk = f32 ? NULL : calloc(B * H * Nt * Dv, 2);
    float *vw = f32 ? malloc(sizeof(float) * B * H * T * Dv) : NULL;
    for (int64_t i = 0; f32 && i < B * H * T * Dv; i++) vw[i] = widened(v, i, c->src);
    Pack pk = {k, {H * T * D, T * D, D}, NULL, 0, D, c->src};
    Pack pv = {v, {H * T * Dv, T * Dv, Dv}, NULL, 1, Dv, c->src};
    for (int64_t h = 0; h < H; h++)
        for (int64_t nb = 0; nb < Nt / 32; nb++) {
            pack32(&pk, 0, h, nb * 32, T, D, f32, kp + (h * (Nt / 32) + nb) * 32 * D * cu);
            if (!f32)
                pack32(&pv, 0, h, nb * 32, T, Dv, 0, vpk + (h * (Nt / 32) + nb) * 32 * Dv * 2);
        }
    float *got = calloc(rows * Dv, sizeof(float)), *got_lse = malloc(sizeof(float) * rows);
    float lsef[64 * 64], delta[64 * 64];
    Seg seg = {0, 0, T, NULL, {0, 0, 0}, c->bounds ? bounds : NULL, 0};
    Job j;
    memset(&j, 0, sizeof j);
    j.q = q, j.kp = kp, j.vp = f32 ? (void *)vw : (void *)vpk, j.out = got, j.lse = got_lse;
    int64_t qs[4] = {H * G * R * D, G * R * D, R * D, D},
            os[4] = {H * G * R * Dv, G * R * Dv, R * Dv, Dv};
    int64_t ls[4] = {H * G * R, G * R, R, 1};
    memcpy(j.qs, qs, sizeof qs), memcpy(j.os, os, sizeof os), memcpy(j.ls, ls, sizeof ls);
    j.ks[0] = H * Nt * D, j.ks[1] = Nt * D;
    j.vs[0] = H * (f32 ? T : Nt) * Dv, j.vs[1] = (f32 ? T : Nt) * Dv, j.vs[2] = Dv;
    j.B = B, j.H = H, j.G = G, j.R = R, j.D = D, j.Dv = Dv;
    j.N = T, j.scale = (float)scale, j.cap = (float)cap, j.slopes = c->mod ? slopes : NULL;
    j.qpos = 5, j.parts = 2, j.f32 = f32, j.src = c->src, j.isa = st->isa;
    j.tiles = (G * R + ROWS - 1) / ROWS, j.items = B * H * j.tiles, j.segs = &seg, j.nseg = 1;
    for (int64_t it = 0; it < j.items; it++) st->forward(&j, it);
    /* Half-precision inputs: the output again, written in their dtype by the step, each
       value rounded as the float32 one rounds. */
    int rounding_ok = 1, ok_span = 1; /* (ok_span: the backward's dQ rows where it says) */
    if (c->src != SRC_F32) {
        uint16_t *half = malloc(sizeof(uint16_t) * rows * Dv);
        Job jh = j;
        jh.out = half, jh.dst = c->src;
        for (int64_t it = 0; it < jh.items; it++) st->forward(&jh, it);
        for (int64_t i = 0; i < rows * Dv; i++) rounding_ok &= half[i] == rounded(got[i], c->src);
        free(half);
    }

    /* The step's backward, key block by key block, its shares summed here. */
    for (int64_t i = 0; i < rows; i++) {
        lsef[i] = (float)lse[i];
        delta[i] = 0;
        for (int64_t d = 0; d < Dv; d++) delta[i] += (float)(dod[i * Dv + d] * out[i * Dv + d]);
    }
    BJob bj;
    memset(&bj, 0, sizeof bj);
    bj.f = j;
    bj.f.vp = k, bj.f.vs[0] = H * T * D, bj.f.vs[1] = T * D, bj.f.vs[2] = D;
    bj.f.bounds = c->bounds ? bounds : NULL;
    bj.dout = dout;
    memcpy(bj.dos, os, sizeof os);
    bj.k = pk;
    bj.v = (Pack){v, {H * T * Dv, T * Dv, Dv}, NULL, 0, Dv, c->src};
    bj.kv = (Pack){k, {H * T * D, T * D, D}, NULL, 1, D, c->src}; /* K in value pairs */
    bj.T = T, bj.lse = lsef, bj.delta = delta;
    memcpy(bj.ls, ls, sizeof ls), memcpy(bj.des, ls, sizeof ls);
    int64_t blocks = ((T + 31) / 32 * 32 + KB - 1) / KB;
    float *gdq = calloc(rows * D, sizeof(float)), *gdk = calloc(B * H * T * D, sizeof(float));
    float *gdv = calloc(B * H * T * Dv, sizeof(float));
    float *share = malloc(sizeof(float) * G * R * D), *dKa = malloc(sizeof(float) * KB * pad32(D));
    float *dVa = malloc(sizeof(float) * KB * pad32(Dv));
    void *scratch = malloc(KEY_BLOCK_SCRATCH * sizeof(float));
    for (int64_t h = 0; h < H; h++)
        for (int64_t kb = 0; kb < blocks; kb++) {
            /* dQ added into gdq itself (as a whole-head work item does), or, for every other
               head, written to a share that starts as NaN: a row the step says it wrote and
               did not, or one it wrote outside what it says, fails */
            if (h % 2) {
                DqOut in = {gdq + h * G * R * D, R * D, D, 1, {0, 0}};
                st->backward(&bj, 0, h, kb * KB, &in, dKa, dVa, scratch);
            } else {
                DqOut out = {share, R * D, D, 0, {-1, -1}};
                for (int64_t i = 0; i < G * R * D; i++) share[i] = NAN;
                st->backward(&bj, 0, h, kb * KB, &out, dKa, dVa, scratch);
                const int64_t *span = out.span;
                for (int64_t i = span[0] * D; i < span[1] * D; i++)
                    gdq[h * G * R * D + i] += share[i];
                for (int64_t i = 0; i < G * R * D; i++)
                    ok_span &= (i >= span[0] * D && i < span[1] * D) || isnan(share[i]);
            }
            for (int64_t n = 0; n < KB && kb * KB + n < T; n++) {
                for (int64_t d = 0; d < D; d++)
                    gdk[(h * T + kb * KB + n) * D + d] += dKa[n * pad32(D) + d];
                for (int64_t d = 0; d < Dv; d++)
                    gdv[(h * T + kb * KB + n) * Dv + d] += dVa[n * pad32(Dv) + d];
            }
        }

    /* Compared: float32 arithmetic against float64 (sums of up to T terms). In bfloat16 dot
       products P and dS enter their matmuls as bfloat16 hi + lo, about 16 bits: the
       tolerances of float32 still hold (their errors are ~1e-5 of values near 1). */
    double worst[5] = {0, 0, 0, 0, 0};
    for (int64_t i = 0; i < rows * Dv; i++) worst[0] = fmax(worst[0], fabs(got[i] - out[i]));
    for (int64_t i = 0; i < rows; i++) {
        int both = isinf(lse[i]) && isinf(got_lse[i]) && lse[i] < 0 && got_lse[i] < 0;
        worst[1] = fmax(worst[1], both ? 0 : fabs(got_lse[i] - lse[i]));
    }
    for (int64_t i = 0; i < rows * D; i++) worst[2] = fmax(worst[2], fabs(gdq[i] - dq[i]));
    for (int64_t i = 0; i < B * H * T * D; i++) worst[3] = fmax(worst[3], fabs(gdk[i] - dk[i]));
    for (int64_t i = 0; i < B * H * T * Dv; i++) worst[4] = fmax(worst[4], fabs(gdv[i] - dv[i]));
    const double tol[5] = {2e-5, 2e-5, 1e-4, 1e-4, 1e-4};
    int ok = 1;
    for (int i = 0; i < 5; i++) ok &= worst[i] <= tol[i]; /* (NaN fails) */
    ok &= rounding_ok && ok_span;
    const char *src = c->src == SRC_F32 ? "float32" : c->src == SRC_BF16 ? "bfloat16" : "float16";
    printf("%s %-6s %-8s%s D=%3lld Dv=%3lld G=%lld%s%s: out %.1e lse %.1e dq %.1e dk %.1e "
           "dv %.1e%s%s\n",
           ok ? "ok  " : "FAIL", st->name, src, c->dots ? " dots" : "", (long long)D, (long long)Dv,
           (long long)G, c->bounds ? " bounds" : "", c->mod ? " alibi+softcap" : "", worst[0],
           worst[1], worst[2], worst[3], worst[4], rounding_ok ? "" : " (rounded output differs)",
           ok_span ? "" : " (dq rows outside the span)");
    free(q), free(k), free(v), free(dout), free(qd), free(kd), free(vd), free(dod), free(out);
    free(lse), free(dq), free(dk), free(dv), free(s), free(tt), free(kp), free(got);
    free(got_lse), free(gdq), free(gdk), free(gdv), free(share), free(dKa), free(dVa);
    free(scratch), free(vpk), free(vw);
    return ok;
}

/* The backward's Delta (the step's row_dots) over 7 rows of D values held as src, against
   float64's sums of the same values: within float32 rounding of the sum of |products|. */
static int run_row_dots(const Step *st, int src, int64_t D) {
    const int64_t n = 7;
    const size_t unit = src == SRC_F32 ? 4 : 2;
    void *a = malloc(n * D * unit), *b = malloc(n * D * unit);
    double *ad = malloc(sizeof(double) * n * D), *bd = malloc(sizeof(double) * n * D);
    for (int64_t i = 0; i < n * D; i++) ad[i] = store(a, i, src, normal());
    for (int64_t i = 0; i < n * D; i++) bd[i] = store(b, i, src, normal());
    float out[7];
    st->row_dots(a, b, n, D, src, out);
    double worst = 0;
    for (int64_t r = 0; r < n; r++) {
        double want = 0, size = 0;
        for (int64_t d = 0; d < D; d++) {
            want += ad[r * D + d] * bd[r * D + d];
            size += fabs(ad[r * D + d] * bd[r * D + d]);
        }
        worst = fmax(worst, fabs(out[r] - want) / (size + 1e-300));
    }
    const int ok = worst <= 1e-6;
    printf("%s %-6s row_dots src %d D=%3lld: %.1e of the |products|\n", ok ? "ok  " : "FAIL",
           st->name, src, (long long)D, worst);
    free(a), free(b), free(ad), free(bd);
    return ok;
}

static int n_dots(const Step *steps, int n) {
    int found = 0;
    for (int i = 0; i < n; i++) found += steps[i].dots;
    return found;
}

int main(void) {
    Step steps[5];
    int n = 0;
#if defined(QKV_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        steps[n++] = (Step){"avx512",
                            ISA_AVX512,
                            qkv_forward_item_avx512,
                            qkv_key_block_avx512,
                            qkv_row_dots_avx512,
                            __builtin_cpu_supports("avx512bf16")};
    if (n) /* its second blocking: tiles of 16 query rows */
        steps[n++] = (Step){"avx512/16",
                            ISA_AVX512,
                            qkv_forward_item_avx512_rows16,
                            qkv_key_block_avx512_rows16,
                            qkv_row_dots_avx512,
                            steps[0].dots};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        steps[n++] = (Step){
            "avx2", ISA_AVX2, qkv_forward_item_avx2, qkv_key_block_avx2, qkv_row_dots_avx2, 0};
        steps[n++] = (Step){"avx2/2",
                            ISA_AVX2,
                            qkv_forward_item_avx2_rows2,
                            qkv_key_block_avx2_rows2, /* the other register blocking */
                            qkv_row_dots_avx2,
                            0};
    }
#elif defined(QKV_ARM)
#ifdef QKV_NEON_BF16
    const int bfdot = qkv_cpu_bf16();
#else
    const int bfdot = 0;
#endif
    steps[n++] = (Step){
        "neon", ISA_NEON, qkv_forward_item_neon, qkv_key_block_neon, qkv_row_dots_neon, bfdot};
    steps[n++] =
        (Step){"neon/2",          ISA_NEON, qkv_forward_item_neon_rows2, qkv_key_block_neon_rows2,
               qkv_row_dots_neon, bfdot};
#ifdef QKV_SVE
    if (qkv_cpu_sve256()) { /* SVE with 256-bit vectors: its step too, both blockings */
#ifdef QKV_NEON_BF16
        const int svdot = qkv_cpu_sve_bf16();
#else
        const int svdot = 0;
#endif
        steps[n++] = (Step){
            "sve", ISA_SVE, qkv_forward_item_sve, qkv_key_block_sve, qkv_row_dots_sve, svdot};
        steps[n++] =
            (Step){"sve/2",          ISA_SVE, qkv_forward_item_sve_rows2, qkv_key_block_sve_rows2,
                   qkv_row_dots_sve, svdot};
    }
#endif
#endif
    if (!n) {
        printf("FAIL no step runs on this CPU\n");
        return 1;
    }
    const int64_t dims[][2] = {{64, 64}, {17, 33}, {80, 48}, {192, 128}};
    int failed = 0, cases = 0;
    for (int i = 0; i < n; i++)
        for (int src = SRC_F32; src <= SRC_F16; src++)
            for (int d = 0; d < 4; d++)
                for (int variant = 0; variant < 3; variant++) {
                    Case c = {2,   variant == 2 ? 2 : 1, 37,          75, dims[d][0], dims[d][1],
                              src, variant == 1,         variant == 2};
                    failed += !run_case(&steps[i], &c);
                    cases++;
                }
    /* a call of G · R = 600 rows: each backward item sums dK and dV over its first FOLD
       rows, then over the rest apart, and adds that in */
    for (int i = 0; i < n; i++)
        for (int src = SRC_F32; src <= SRC_F16; src++, cases++) {
            Case c = {1, 2, 300, 75, 64, 64, src, 0, 0};
            failed += !run_case(&steps[i], &c);
        }
    /* bfloat16 in the CPU's dot products: even head dims (pairs), V's columns on and off
       the vectors */
    const int64_t even[][2] = {{64, 64}, {30, 94}, {80, 48}, {192, 128}};
    for (int i = 0; i < n; i++)
        for (int d = 0; steps[i].dots && d < 4; d++)
            for (int variant = 0; variant < 3; variant++, cases++) {
                Case c = {2,        variant == 2 ? 2 : 1, 37,           75, even[d][0], even[d][1],
                          SRC_BF16, variant == 1,         variant == 2, 1};
                failed += !run_case(&steps[i], &c);
            }
    for (int i = 0; i < n; i++) /* and the call of 600 rows */
        if (steps[i].dots) {
            Case c = {1, 2, 300, 75, 64, 64, SRC_BF16, 0, 0, 1};
            failed += !run_case(&steps[i], &c);
            cases++;
        }
    printf("%d steps in bfloat16 dot products\n", n_dots(steps, n));
    for (int i = 0; i < n; i++) /* the backward's Delta, on and off the vectors */
        for (int src = SRC_F32; src <= SRC_F16; src++)
            for (int d = 0; d < 4; d++, cases++)
                failed += !run_row_dots(&steps[i], src, dims[d][0]);
    printf("%d of %d cases within tolerance\n", cases - failed, cases);
    return failed ? 1 : 0;
}
