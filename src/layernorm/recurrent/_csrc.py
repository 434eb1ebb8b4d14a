"""C source of the fused CPU time-step kernels of the LN-LSTM and LN-GRU (built by :mod:`._cstep`).

One call does a whole step's work after the recurrent GEMM, for every row of the step, in one pass
per row: the layer norm of ``hp = W_hh h_{t−1}`` (statistics in float64), the gates, the state
update, the layer norm of ``c_t``, and the stores that backward needs. The backward call does the
step's pointwise backward including the two layer-norm ``dx``s. An eager step is 15–30 ATen ops
each costing a few microseconds of dispatch on ``(B, 4H)`` tensors; here it is one C call.

Per row, layer-norm ``dx`` with ``x̂ = (x − μ)·rstd`` and ``g = dy ⊙ w``:
``dx = rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂))``.

The ``*_seq`` functions run a whole direction of a sequence in one call: per step the recurrent
GEMM ``h_{t−1} W_hhᵀ`` (forward) or ``dhp · W_hh`` (backward) with a register-tiled GEMM written
for these shapes (few rows, H to 4H columns), then the step kernel above.

The source is written once over ``scalar_t`` / ``SUF`` / ``EXP`` / ``TANH`` and instantiated for
float32 and float64 by :func:`source`. Rows are independent, so they are split across OpenMP threads
when a step is large enough to pay for waking them.
"""

from __future__ import annotations

_PRELUDE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>

typedef int64_t i64;
typedef double acc_t;

/* float32 exp without a libm call, so the gate loops vectorize: exp(x) = 2^n · e^r with
   n = round(x / ln 2), r = x − n·ln 2 (ln 2 split in two for exactness) and a degree-6 minimax
   polynomial for e^r on [−ln2/2, ln2/2] (the Cephes expf coefficients), max relative error about
   2 ulp. x is clamped so 2^n stays a normal float. */
static inline float fast_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x); /* a NaN passes through as NaN */
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* The sequence GEMM's vector: the widest the build's target (-march=native) has. 64-byte GCC
   vectors on a target without AVX-512 compile to split code about 40x slower, so the width
   follows the target; below 64 bytes the callers keep torch.mm (see _cstep.sequence_gemm). */
#if defined(__AVX512F__)
#define VEC_BYTES 64
#elif defined(__AVX__)
#define VEC_BYTES 32
#else
#define VEC_BYTES 16
#endif

int seq_gemm_vector_bytes(void) { return VEC_BYTES; }

/* Threads for `work` units split `parts` ways, at least `grain` units each, at most `nt`. */
static inline int threads_for(i64 work, i64 parts, i64 grain, int nt) {
    i64 n = work / grain;
    n = n < parts ? n : parts;
    n = n < nt ? n : nt;
    return n < 1 ? 1 : (int)n;
}

/* tanh(x) = sign(x)·(1 − e)/(1 + e), e = exp(−2|x|): absolute error about 1e-7. */
static inline float fast_tanhf(float x) {
    const float e = fast_expf(-2.0f * fabsf(x));
    const float t = (1.0f - e) / (1.0f + e);
    return x < 0 ? -t : t;
}
"""

_TEMPLATE = r"""
/* ------------------------------------------------------------------ scalar_t -------------- */

static inline void moments_SUF(const scalar_t* x, i64 N, double eps, acc_t* mu, acc_t* r) {
    acc_t s = 0;
    #pragma omp simd reduction(+ : s)
    for (i64 j = 0; j < N; ++j) s += x[j];
    const acc_t m = s / N;
    acc_t v = 0;
    #pragma omp simd reduction(+ : v)
    for (i64 j = 0; j < N; ++j) {
        const acc_t d = x[j] - m;
        v += d * d;
    }
    *mu = m;
    *r = 1.0 / sqrt(v / N + eps);
}

/* dx (+)= rstd·(g − mean(g) − x̂·mean(g⊙x̂)), g = dy⊙w (w may be NULL). */
static inline void ln_dx_SUF(const scalar_t* dy, const scalar_t* x, acc_t m, acc_t r,
                             const scalar_t* w, scalar_t* dx, i64 N, int accumulate) {
    acc_t sg = 0, sgx = 0;
    if (w) {
        #pragma omp simd reduction(+ : sg, sgx)
        for (i64 j = 0; j < N; ++j) {
            const acc_t g = (acc_t)dy[j] * w[j];
            sg += g;
            sgx += g * ((x[j] - m) * r);
        }
    } else {
        #pragma omp simd reduction(+ : sg, sgx)
        for (i64 j = 0; j < N; ++j) {
            const acc_t g = dy[j];
            sg += g;
            sgx += g * ((x[j] - m) * r);
        }
    }
    sg /= N;
    sgx /= N;
    /* Without accumulate, dx is an uninitialized buffer: never read it (0·NaN garbage = NaN). */
    if (!accumulate) {
        #pragma omp simd
        for (i64 j = 0; j < N; ++j) dx[j] = 0;
    }
    #pragma omp simd
    for (i64 j = 0; j < N; ++j) {
        const acc_t g = (acc_t)dy[j] * (w ? (acc_t)w[j] : 1.0);
        dx[j] += (scalar_t)(r * (g - sg - ((x[j] - m) * r) * sgx));
    }
}

static inline scalar_t sigm_SUF(scalar_t v) { return (scalar_t)1 / ((scalar_t)1 + EXP(-v)); }

/* LN-LSTM step forward, rows [lo, hi). Gate order i, f, g, o (torch). With normalize, the LN
   gains and biases w1, b1, w3, b3 must all be given (the caller passes ones / zeros for absent
   ones): unconditional loads keep the loops vectorizable. */
static void lstm_fwd_rows_SUF(
    const scalar_t* hp, const scalar_t* gx, const scalar_t* w1, const scalar_t* b1,
    const scalar_t* w3, const scalar_t* b3, scalar_t* h_state, scalar_t* c_state,
    scalar_t* out, scalar_t* hprev, scalar_t* cprev, scalar_t* acts, scalar_t* mh,
    scalar_t* rh, scalar_t* cn, scalar_t* mc, scalar_t* rc, scalar_t* tc,
    i64 lo, i64 hi, i64 H, double eps, int normalize, int carry_norm) {
    const i64 G = 4 * H;
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* hpr = hp + i * G;
        const scalar_t* gxr = gx + i * G;
        scalar_t* a = acts + i * G;
        acc_t m = 0, r = 1;
        if (normalize) {
            moments_SUF(hpr, G, eps, &m, &r);
            mh[i] = (scalar_t)m;
            rh[i] = (scalar_t)r;
            #pragma omp simd
            for (i64 j = 0; j < G; ++j)
                a[j] = (scalar_t)((hpr[j] - m) * r) * w1[j] + b1[j] + gxr[j];
        } else {
            for (i64 j = 0; j < G; ++j) a[j] = hpr[j] + gxr[j];
        }
        #pragma omp simd
        for (i64 j = 0; j < 2 * H; ++j) a[j] = sigm_SUF(a[j]);
        #pragma omp simd
        for (i64 j = 2 * H; j < 3 * H; ++j) a[j] = TANH(a[j]);
        #pragma omp simd
        for (i64 j = 3 * H; j < G; ++j) a[j] = sigm_SUF(a[j]);
        scalar_t* cs = c_state + i * H;
        scalar_t* cp = cprev + i * H;
        scalar_t* cnr = cn + i * H;
        for (i64 j = 0; j < H; ++j) {
            cp[j] = cs[j];
            cnr[j] = a[H + j] * cs[j] + a[j] * a[2 * H + j];
        }
        scalar_t* tcr = tc + i * H;
        scalar_t* hs = h_state + i * H;
        scalar_t* hpv = hprev + i * H;
        scalar_t* o = out + i * H;
        if (normalize) {
            moments_SUF(cnr, H, eps, &m, &r);
            mc[i] = (scalar_t)m;
            rc[i] = (scalar_t)r;
        }
        /* LN(c_t) into tc first, then tanh in place: separate loops so each one vectorizes. */
        if (normalize) {
            #pragma omp simd
            for (i64 j = 0; j < H; ++j) tcr[j] = (scalar_t)((cnr[j] - m) * r) * w3[j] + b3[j];
        } else {
            for (i64 j = 0; j < H; ++j) tcr[j] = cnr[j];
        }
        if (carry_norm) {
            for (i64 j = 0; j < H; ++j) cs[j] = tcr[j];
        } else {
            for (i64 j = 0; j < H; ++j) cs[j] = cnr[j];
        }
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) tcr[j] = TANH(tcr[j]);
        for (i64 j = 0; j < H; ++j) {
            const scalar_t h = a[3 * H + j] * tcr[j];
            hpv[j] = hs[j];
            hs[j] = h;
            o[j] = h;
        }
    }
}

void lstm_fwd_SUF(
    const scalar_t* hp, const scalar_t* gx, const scalar_t* w1, const scalar_t* b1,
    const scalar_t* w3, const scalar_t* b3, scalar_t* h_state, scalar_t* c_state,
    scalar_t* out, scalar_t* hprev, scalar_t* cprev, scalar_t* acts, scalar_t* mh,
    scalar_t* rh, scalar_t* cn, scalar_t* mc, scalar_t* rc, scalar_t* tc,
    i64 bs, i64 H, double eps, int normalize, int carry_norm, int nt) {
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 i = 0; i < bs; ++i)
        lstm_fwd_rows_SUF(hp, gx, w1, b1, w3, b3, h_state, c_state, out, hprev, cprev, acts,
                          mh, rh, cn, mc, rc, tc, i, i + 1, H, eps, normalize, carry_norm);
}

/* LN-LSTM step backward. In: dout (this step's output gradient), dh_state (gradient of h_t from
   later steps), dc_state (of the carried c_t). Out: dgates (of the gate pre-activations), dhp (of
   hp; not written without normalization, where it equals dgates), dlc (of LN(c_t)), dc_state :=
   gradient of c_{t−1}. dh_state is left for the caller's GEMM to overwrite. */
static void lstm_bwd_row_SUF(
    const scalar_t* dout, const scalar_t* dh, scalar_t* dc, const scalar_t* hp, acc_t mh,
    acc_t rh, const scalar_t* w1, const scalar_t* a, const scalar_t* cp, const scalar_t* cn,
    acc_t mc, acc_t rc, const scalar_t* w3, const scalar_t* tc, scalar_t* dg, scalar_t* dhp,
    scalar_t* dlc, i64 H, int normalize, int carry_norm) {
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t dht = dh[j] + dout[j];
        const scalar_t o = a[3 * H + j], t = tc[j];
        dg[3 * H + j] = dht * t * o * ((scalar_t)1 - o);
        scalar_t d = dht * o * ((scalar_t)1 - t * t);
        if (carry_norm) d += dc[j];
        dlc[j] = d;
    }
    if (normalize) {
        ln_dx_SUF(dlc, cn, mc, rc, w3, dc, H, !carry_norm);
    } else {
        for (i64 j = 0; j < H; ++j) dc[j] = dlc[j] + (carry_norm ? (scalar_t)0 : dc[j]);
    }
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t dcn = dc[j];
        const scalar_t ig = a[j], fg = a[H + j], gg = a[2 * H + j];
        dg[j] = dcn * gg * ig * ((scalar_t)1 - ig);
        dg[H + j] = dcn * cp[j] * fg * ((scalar_t)1 - fg);
        dg[2 * H + j] = dcn * ig * ((scalar_t)1 - gg * gg);
        dc[j] = dcn * fg;
    }
    if (normalize) ln_dx_SUF(dg, hp, mh, rh, w1, dhp, 4 * H, 0);
}

void lstm_bwd_SUF(
    const scalar_t* dout, const scalar_t* dh_state, scalar_t* dc_state, const scalar_t* hp,
    const scalar_t* mh, const scalar_t* rh, const scalar_t* w1, const scalar_t* acts,
    const scalar_t* cprev, const scalar_t* cn, const scalar_t* mc, const scalar_t* rc,
    const scalar_t* w3, const scalar_t* tc, scalar_t* dgates, scalar_t* dhp, scalar_t* dlc,
    i64 bs, i64 H, int normalize, int carry_norm, int nt) {
    const i64 G = 4 * H;
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 i = 0; i < bs; ++i)
        lstm_bwd_row_SUF(dout + i * H, dh_state + i * H, dc_state + i * H, hp + i * G,
                         normalize ? mh[i] : 0, normalize ? rh[i] : 1, w1, acts + i * G,
                         cprev + i * H, cn + i * H, normalize ? mc[i] : 0,
                         normalize ? rc[i] : 1, w3, tc + i * H, dgates + i * G,
                         dhp ? dhp + i * G : 0, dlc + i * H, H, normalize, carry_norm);
}

/* LN-GRU step forward (gates r, z, n; torch's layout). hp = W_hh h_{t−1} (raw), gx = LN(W_ih x)
   + b_ih + [b_hr, b_hz, 0]. The (r, z) block and the n block of hp get separate layer norms.
   b_hn, and with normalize the LN gains/biases, must be given (ones / zeros when absent). */
static void gru_fwd_row_SUF(
    const scalar_t* hp, const scalar_t* gx, const scalar_t* w_rz, const scalar_t* b_rz,
    const scalar_t* w_n, const scalar_t* b_n, const scalar_t* b_hn, scalar_t* hs, scalar_t* o,
    scalar_t* hpv, scalar_t* rz, scalar_t* n, scalar_t* ghn, scalar_t* mh, scalar_t* rh,
    scalar_t* mn, scalar_t* rn, i64 H, double eps, int normalize) {
    acc_t m1 = 0, r1 = 1, m2 = 0, r2 = 1;
    if (normalize) {
        moments_SUF(hp, 2 * H, eps, &m1, &r1);
        moments_SUF(hp + 2 * H, H, eps, &m2, &r2);
        *mh = (scalar_t)m1;
        *rh = (scalar_t)r1;
        *mn = (scalar_t)m2;
        *rn = (scalar_t)r2;
    }
    if (normalize) {
        #pragma omp simd
        for (i64 j = 0; j < 2 * H; ++j)
            rz[j] = sigm_SUF((scalar_t)((hp[j] - m1) * r1) * w_rz[j] + b_rz[j] + gx[j]);
        #pragma omp simd
        for (i64 j = 0; j < H; ++j)
            ghn[j] = (scalar_t)((hp[2 * H + j] - m2) * r2) * w_n[j] + b_n[j] + b_hn[j];
    } else {
        #pragma omp simd
        for (i64 j = 0; j < 2 * H; ++j) rz[j] = sigm_SUF(hp[j] + gx[j]);
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) ghn[j] = hp[2 * H + j] + b_hn[j];
    }
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t v = ghn[j];
        const scalar_t nv = TANH(gx[2 * H + j] + rz[j] * v);
        n[j] = nv;
        const scalar_t hprev = hs[j];
        hpv[j] = hprev;
        const scalar_t h = nv + rz[H + j] * (hprev - nv);
        hs[j] = h;
        o[j] = h;
    }
}

void gru_fwd_SUF(
    const scalar_t* hp, const scalar_t* gx, const scalar_t* w_rz, const scalar_t* b_rz,
    const scalar_t* w_n, const scalar_t* b_n, const scalar_t* b_hn, scalar_t* h_state,
    scalar_t* out, scalar_t* hprev, scalar_t* rz, scalar_t* n, scalar_t* ghn, scalar_t* mh,
    scalar_t* rh, scalar_t* mn, scalar_t* rn, i64 bs, i64 H, double eps, int normalize, int nt) {
    const i64 G = 3 * H;
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 i = 0; i < bs; ++i)
        gru_fwd_row_SUF(hp + i * G, gx + i * G, w_rz, b_rz, w_n, b_n, b_hn, h_state + i * H,
                        out + i * H, hprev + i * H, rz + i * 2 * H, n + i * H, ghn + i * H,
                        mh + i, rh + i, mn + i, rn + i, H, eps, normalize);
}

/* LN-GRU step backward. Out: dgx (of the input-side pre-activations), dgh (of LN(hp_rz) and of
   LN(hp_n) + b_hn), dhp (of hp; not written without normalization, where it equals dgh), and
   dh_state := the part of the gradient of h_{t−1} that bypasses W_hh (the caller adds dhp·W_hh). */
static void gru_bwd_row_SUF(
    const scalar_t* dout, scalar_t* dh, const scalar_t* hpv, const scalar_t* hp,
    const scalar_t* rz, const scalar_t* n, const scalar_t* ghn, acc_t mh, acc_t rh, acc_t mn,
    acc_t rn, const scalar_t* w_rz, const scalar_t* w_n, scalar_t* dgx, scalar_t* dgh,
    scalar_t* dhp, i64 H, int normalize) {
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t dht = dh[j] + dout[j];
        const scalar_t r = rz[j], z = rz[H + j], nv = n[j];
        const scalar_t dn = dht * ((scalar_t)1 - z) * ((scalar_t)1 - nv * nv);
        const scalar_t dr = dn * ghn[j] * r * ((scalar_t)1 - r);
        const scalar_t dz = dht * (hpv[j] - nv) * z * ((scalar_t)1 - z);
        dgx[j] = dr;
        dgx[H + j] = dz;
        dgx[2 * H + j] = dn;
        dgh[j] = dr;
        dgh[H + j] = dz;
        dgh[2 * H + j] = dn * r;
        dh[j] = dht * z;
    }
    if (normalize) {
        ln_dx_SUF(dgh, hp, mh, rh, w_rz, dhp, 2 * H, 0);
        ln_dx_SUF(dgh + 2 * H, hp + 2 * H, mn, rn, w_n, dhp + 2 * H, H, 0);
    }
}

void gru_bwd_SUF(
    const scalar_t* dout, scalar_t* dh_state, const scalar_t* hprev, const scalar_t* hp,
    const scalar_t* rz, const scalar_t* n, const scalar_t* ghn, const scalar_t* mh,
    const scalar_t* rh, const scalar_t* mn, const scalar_t* rn, const scalar_t* w_rz,
    const scalar_t* w_n, scalar_t* dgx, scalar_t* dgh, scalar_t* dhp, i64 bs, i64 H,
    int normalize, int nt) {
    const i64 G = 3 * H;
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 i = 0; i < bs; ++i)
        gru_bwd_row_SUF(dout + i * H, dh_state + i * H, hprev + i * H, hp + i * G, rz + i * 2 * H,
                        n + i * H, ghn + i * H, normalize ? mh[i] : 0, normalize ? rh[i] : 1,
                        normalize ? mn[i] : 0, normalize ? rn[i] : 1, w_rz, w_n, dgx + i * G,
                        dgh + i * G, dhp ? dhp + i * G : 0, H, normalize);
}

/* The same kernels with their pointer arguments packed: p[] holds the base addresses of the
   buffers (in the order of the unpacked signature; 0 for an absent one) and a step's rows start
   at row `off` of the (N, ·) buffers. One foreign call with 8 arguments instead of 24: at small
   batch sizes the call overhead is a large part of a step. */
#define ROWS_SUF(k, cols) (p[k] ? (scalar_t*)(intptr_t)p[k] + off * (cols) : (scalar_t*)0)
#define BASE_SUF(k) ((scalar_t*)(intptr_t)p[k])

void lstm_fwd_at_SUF(const i64* p, i64 off, i64 bs, i64 H, double eps, int normalize,
                     int carry_norm, int nt) {
    const i64 G = 4 * H;
    lstm_fwd_SUF(ROWS_SUF(0, G), ROWS_SUF(1, G), BASE_SUF(2), BASE_SUF(3), BASE_SUF(4),
                 BASE_SUF(5), BASE_SUF(6), BASE_SUF(7), ROWS_SUF(8, H), ROWS_SUF(9, H),
                 ROWS_SUF(10, H), ROWS_SUF(11, G), ROWS_SUF(12, 1), ROWS_SUF(13, 1),
                 ROWS_SUF(14, H), ROWS_SUF(15, 1), ROWS_SUF(16, 1), ROWS_SUF(17, H), bs, H, eps,
                 normalize, carry_norm, nt);
}

void lstm_bwd_at_SUF(const i64* p, i64 off, i64 bs, i64 H, int normalize, int carry_norm,
                     int nt) {
    const i64 G = 4 * H;
    lstm_bwd_SUF(ROWS_SUF(0, H), BASE_SUF(1), BASE_SUF(2), ROWS_SUF(3, G), ROWS_SUF(4, 1),
                 ROWS_SUF(5, 1), BASE_SUF(6), ROWS_SUF(7, G), ROWS_SUF(8, H), ROWS_SUF(9, H),
                 ROWS_SUF(10, 1), ROWS_SUF(11, 1), BASE_SUF(12), ROWS_SUF(13, H),
                 ROWS_SUF(14, G), ROWS_SUF(15, G), ROWS_SUF(16, H), bs, H, normalize, carry_norm,
                 nt);
}

void gru_fwd_at_SUF(const i64* p, i64 off, i64 bs, i64 H, double eps, int normalize, int nt) {
    const i64 G = 3 * H;
    gru_fwd_SUF(ROWS_SUF(0, G), ROWS_SUF(1, G), BASE_SUF(2), BASE_SUF(3), BASE_SUF(4),
                BASE_SUF(5), BASE_SUF(6), BASE_SUF(7), ROWS_SUF(8, H), ROWS_SUF(9, H),
                ROWS_SUF(10, 2 * H), ROWS_SUF(11, H), ROWS_SUF(12, H), ROWS_SUF(13, 1),
                ROWS_SUF(14, 1), ROWS_SUF(15, 1), ROWS_SUF(16, 1), bs, H, eps, normalize, nt);
}

void gru_bwd_at_SUF(const i64* p, i64 off, i64 bs, i64 H, int normalize, int nt) {
    const i64 G = 3 * H;
    gru_bwd_SUF(ROWS_SUF(0, H), BASE_SUF(1), ROWS_SUF(2, H), ROWS_SUF(3, G), ROWS_SUF(4, 2 * H),
                ROWS_SUF(5, H), ROWS_SUF(6, H), ROWS_SUF(7, 1), ROWS_SUF(8, 1), ROWS_SUF(9, 1),
                ROWS_SUF(10, 1), BASE_SUF(11), BASE_SUF(12), ROWS_SUF(13, G), ROWS_SUF(14, G),
                ROWS_SUF(15, G), bs, H, normalize, nt);
}

/* ------------------------------------------------------------------ whole sequences -------- */

/* The recurrent GEMMs C[M, N] (=|+=) A[M, K] · B[K, N]: B and C row-major (leading dimensions
   ldb, ldc), A[i, k] at A + i·sar + k·sak (so Aᵀ of a row-major matrix is read in place, as the
   weight gradient needs). A step's GEMM is small (M = the step's rows, often 8–64): through
   torch.mm it costs a dispatch and MKL's small-M path. Here a tile of up to GEMM_MR rows × nv
   vectors of columns keeps its accumulators in registers over all of K; B is read once per row
   tile. The weight gradient's K (all rows of the sequence) is long, so it runs in chunks of
   GEMM_KC values of k, each chunk of B staying in L1 while every row tile passes over it.
   Products are summed in scalar_t in order of k (chunk after chunk), as a BLAS does: only float
   rounding differs from torch.mm. */
#define GEMM_MR 8
#define GEMM_KC 128
typedef scalar_t vec_SUF
    __attribute__((vector_size(VEC_BYTES), aligned(sizeof(scalar_t)), may_alias));
#define VL_SUF ((i64)(VEC_BYTES / sizeof(scalar_t)))

static inline __attribute__((always_inline)) void gemm_tile_SUF(
    const scalar_t* A, i64 sar, i64 sak, const scalar_t* B, i64 ldb, scalar_t* C, i64 ldc, i64 K,
    i64 mr, const int nv, const int full, int accumulate) {
    vec_SUF acc[GEMM_MR][2];
    const i64 rows = full ? GEMM_MR : mr;
    for (i64 r = 0; r < rows; ++r)
        for (int v = 0; v < nv; ++v) acc[r][v] = (vec_SUF){0};
    for (i64 k = 0; k < K; ++k) {
        vec_SUF b[2];
        for (int v = 0; v < nv; ++v) b[v] = *(const vec_SUF*)(B + k * ldb + v * VL_SUF);
        for (i64 r = 0; r < rows; ++r) {
            const scalar_t a = A[r * sar + k * sak];
            for (int v = 0; v < nv; ++v) acc[r][v] += a * b[v];
        }
    }
    for (i64 r = 0; r < rows; ++r)
        for (int v = 0; v < nv; ++v) {
            vec_SUF* c = (vec_SUF*)(C + r * ldc + v * VL_SUF);
            if (accumulate) *c += acc[r][v];
            else *c = acc[r][v];
        }
}

/* All of C for the given K, its column tiles split across nt threads. */
static void gemm_SUF(i64 M, i64 N, i64 K, const scalar_t* A, i64 sar, i64 sak, const scalar_t* B,
                     i64 ldb, scalar_t* C, i64 ldc, int accumulate, int nt) {
    const i64 W = 2 * VL_SUF, tiles = (N + W - 1) / W;
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 t = 0; t < tiles; ++t) {
        const i64 j0 = t * W;
        const i64 w = N - j0 < W ? N - j0 : W;
        for (i64 i0 = 0; i0 < M; i0 += GEMM_MR) {
            const i64 mr = M - i0 < GEMM_MR ? M - i0 : GEMM_MR;
            const scalar_t* a = A + i0 * sar;
            scalar_t* c = C + i0 * ldc;
            i64 j = j0;
            if (w == W) {
                /* constant nv / full: each call compiles to its own register-resident tile */
                if (mr == GEMM_MR)
                    gemm_tile_SUF(a, sar, sak, B + j, ldb, c + j, ldc, K, mr, 2, 1, accumulate);
                else
                    gemm_tile_SUF(a, sar, sak, B + j, ldb, c + j, ldc, K, mr, 2, 0, accumulate);
                continue;
            }
            if (w >= VL_SUF) {
                gemm_tile_SUF(a, sar, sak, B + j, ldb, c + j, ldc, K, mr, 1, 0, accumulate);
                j += VL_SUF;
            }
            for (; j < j0 + w; ++j) /* the last < VL columns */
                for (i64 r = 0; r < mr; ++r) {
                    scalar_t s = 0;
                    for (i64 k = 0; k < K; ++k) s += a[r * sar + k * sak] * B[k * ldb + j];
                    c[r * ldc + j] = accumulate ? c[r * ldc + j] + s : s;
                }
        }
    }
}

/* The recurrent weight's gradient over all rows of a sequence: dw (G, H) = dhpᵀ · hprev with
   dhp (N, G) and hprev (N, H) row-major. */
void weight_grad_SUF(const scalar_t* dhp, const scalar_t* hprev, i64 N, i64 G, i64 H,
                     scalar_t* dw, int nt, i64 ggrain) {
    if (N == 0) {
        for (i64 i = 0; i < G * H; ++i) dw[i] = 0;
        return;
    }
    const int threads = threads_for(G * H * N, (H + 2 * VL_SUF - 1) / (2 * VL_SUF), ggrain, nt);
    for (i64 k0 = 0; k0 < N; k0 += GEMM_KC) {
        const i64 kc = N - k0 < GEMM_KC ? N - k0 : GEMM_KC;
        gemm_SUF(G, H, kc, dhp + k0 * G, 1, G, hprev + k0 * H, H, dw, H, k0 > 0, threads);
    }
}

/* A whole direction of a sequence in one call: per step (steps[2s] = first row, steps[2s+1] =
   rows, in processing order) the recurrent GEMM hp = h_{t−1} · W_hhᵀ (wt = W_hhᵀ, (H, G)
   contiguous) into the step's hp rows, then the step kernel. Forward in time; the backward
   functions walk the steps in reverse: the step kernel, then dh_{t−1} (=|+=) dhp · W_hh (w =
   W_hh, (G, H)). `grain` is the step kernels' per-thread minimum of elements, `ggrain` the
   GEMM's of multiply-adds. Buffer slots are those of the *_at functions; without normalization
   dhp is the gate gradient buffer (slot 14). */
void lstm_fwd_seq_SUF(const i64* p, const i64* steps, i64 n, const scalar_t* wt, i64 H,
                      double eps, int normalize, int carry_norm, int nt, i64 grain, i64 ggrain) {
    const i64 G = 4 * H;
    for (i64 s = 0; s < n; ++s) {
        const i64 off = steps[2 * s], bs = steps[2 * s + 1];
        gemm_SUF(bs, G, H, BASE_SUF(6), H, 1, wt, G, ROWS_SUF(0, G), G, 0,
                 threads_for(bs * G * H, (G + 2 * VL_SUF - 1) / (2 * VL_SUF), ggrain, nt));
        lstm_fwd_at_SUF(p, off, bs, H, eps, normalize, carry_norm,
                        threads_for(bs * G, bs, grain, nt));
    }
}

void lstm_bwd_seq_SUF(const i64* p, const i64* steps, i64 n, const scalar_t* w, i64 H,
                      int normalize, int carry_norm, int nt, i64 grain, i64 ggrain) {
    const i64 G = 4 * H;
    const int k_dhp = normalize ? 15 : 14;
    for (i64 s = n - 1; s >= 0; --s) {
        const i64 off = steps[2 * s], bs = steps[2 * s + 1];
        lstm_bwd_at_SUF(p, off, bs, H, normalize, carry_norm, threads_for(bs * G, bs, grain, nt));
        gemm_SUF(bs, H, G, ROWS_SUF(k_dhp, G), G, 1, w, H, BASE_SUF(1), H, 0,
                 threads_for(bs * G * H, (H + 2 * VL_SUF - 1) / (2 * VL_SUF), ggrain, nt));
    }
}

void gru_fwd_seq_SUF(const i64* p, const i64* steps, i64 n, const scalar_t* wt, i64 H,
                     double eps, int normalize, int nt, i64 grain, i64 ggrain) {
    const i64 G = 3 * H;
    for (i64 s = 0; s < n; ++s) {
        const i64 off = steps[2 * s], bs = steps[2 * s + 1];
        gemm_SUF(bs, G, H, BASE_SUF(7), H, 1, wt, G, ROWS_SUF(0, G), G, 0,
                 threads_for(bs * G * H, (G + 2 * VL_SUF - 1) / (2 * VL_SUF), ggrain, nt));
        gru_fwd_at_SUF(p, off, bs, H, eps, normalize, threads_for(bs * G, bs, grain, nt));
    }
}

void gru_bwd_seq_SUF(const i64* p, const i64* steps, i64 n, const scalar_t* w, i64 H,
                     int normalize, int nt, i64 grain, i64 ggrain) {
    const i64 G = 3 * H;
    const int k_dhp = normalize ? 15 : 14;
    for (i64 s = n - 1; s >= 0; --s) {
        const i64 off = steps[2 * s], bs = steps[2 * s + 1];
        gru_bwd_at_SUF(p, off, bs, H, normalize, threads_for(bs * G, bs, grain, nt));
        gemm_SUF(bs, H, G, ROWS_SUF(k_dhp, G), G, 1, w, H, BASE_SUF(1), H, 1,
                 threads_for(bs * G * H, (H + 2 * VL_SUF - 1) / (2 * VL_SUF), ggrain, nt));
    }
}
"""

#: (C type, symbol suffix, exp, tanh) for each instantiation.
INSTANCES = (("float", "f32", "fast_expf", "fast_tanhf"), ("double", "f64", "exp", "tanh"))


def source() -> str:
    """The complete C translation unit: prelude plus the template for every scalar type."""
    parts = [_PRELUDE]
    for ctype, suffix, exp, tanh in INSTANCES:
        parts.append(
            _TEMPLATE.replace("scalar_t", ctype)
            .replace("SUF", suffix)
            .replace("EXP(", f"{exp}(")
            .replace("TANH(", f"{tanh}(")
        )
    return "\n".join(parts)
