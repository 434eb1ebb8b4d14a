"""C source of the fused CPU kernels (built and loaded by :mod:`._native`).

Every op is one pass over memory per direction: a row (N ≤ a few thousand elements) is read once
from RAM for its statistics, and the second sweep that writes the output finds it in L1/L2. That is
the traffic of PyTorch's native layer-norm kernels (fwd: read x, write y; bwd: read dy and x, write
dx), where an eager composition of ATen ops makes 5–10 full passes. Rows are split evenly across
OpenMP threads; ``dweight``/``dbias`` are summed over each thread's rows into private buffers,
which are added in a fixed order at the end (deterministic for a fixed thread count).

Precision: row arithmetic runs in the input's precision (float32 vectors are twice as wide), but
every row sum is spread over LANES partial sums, folded pairwise and finished in float64
(``acc_t``), and the centred second sweep avoids the cancellation of E[x²] − μ². dweight/dbias
add blocks of FLUSH rows in the input precision, then accumulate the blocks in float64. Measured
float32 errors against a float64 reference are below those of PyTorch's own layer-norm kernels.
The source is written once over ``scalar_t`` and ``SUF``; :func:`source` instantiates it for
float32 and float64.

Per row, with ``x̂ = (x − μ)·rstd`` and ``g = dy ⊙ w``:

    layer norm   dx = rstd · (g − a·mean(g) − b·x̂·mean(g ⊙ x̂))   a, b = 0 when μ, σ are detached
    RMSNorm      dx = rstd · (g − x̂·mean(g ⊙ x̂))                 x̂ = x·rstd
    AdaNorm      d  = dz ⊙ C·(1 − k·x̂),  dx = rstd · (d − mean(d) − x̂·mean(d ⊙ x̂))
    all          dw = Σ_rows dy ⊙ x̂,  db = Σ_rows dy
"""

from __future__ import annotations

_PRELUDE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
typedef double acc_t;

/* Row sums run in LANES independent partial sums (4 AVX-512 registers of doubles): a single
   running sum would wait on the add latency every step and run at a quarter of the speed. */
#define LANES 32
/* Rows whose dweight/dbias terms are summed in the input precision before a float64 flush. */
#define FLUSH 16

/* Rows [lo, hi) of M for thread tid of nt: contiguous blocks whose sizes differ by at most one. */
static void row_block(i64 M, int nt, int tid, i64* lo, i64* hi) {
    i64 base = M / nt, rem = M % nt;
    *lo = tid * base + (tid < rem ? tid : rem);
    *hi = *lo + base + (tid < rem ? 1 : 0);
}

/* A zeroed float64 scratch buffer of n elements, kept per calling thread and grown on demand:
   a fresh calloc of a few hundred KiB per backward is an mmap plus page faults every call. */
static __thread acc_t* scratch_buf = NULL;
static __thread i64 scratch_cap = 0;

static acc_t* zeroed_scratch(i64 n) {
    if (n > scratch_cap) {
        free(scratch_buf);
        scratch_buf = (acc_t*)malloc((size_t)n * sizeof(acc_t));
        scratch_cap = scratch_buf ? n : 0;
        if (!scratch_buf) return NULL;
    }
    memset(scratch_buf, 0, (size_t)n * sizeof(acc_t));
    return scratch_buf;
}

/* Sum per-thread float64 buffers (nt blocks of N) into the first one. */
static void reduce_buffers(acc_t* buf, int nt, i64 N) {
    for (int t = 1; t < nt; ++t) {
        const acc_t* b = buf + (i64)t * N;
        #pragma omp simd
        for (i64 j = 0; j < N; ++j) buf[j] += b[j];
    }
}
"""

_TEMPLATE = r"""
/* ---------------------------------------------------------------- scalar_t ---------------- */

/* A vector of N ones, kept per calling thread: a missing gain becomes w = 1, so every backward
   loop has a single form instead of one per combination of optional arguments. */
static __thread scalar_t* ones_buf_SUF = NULL;
static __thread i64 ones_cap_SUF = 0;

static const scalar_t* ones_SUF(i64 n) {
    if (n > ones_cap_SUF) {
        free(ones_buf_SUF);
        ones_buf_SUF = (scalar_t*)malloc((size_t)n * sizeof(scalar_t));
        ones_cap_SUF = ones_buf_SUF ? n : 0;
        if (!ones_buf_SUF) return NULL;
        for (i64 j = 0; j < n; ++j) ones_buf_SUF[j] = 1;
    }
    return ones_buf_SUF;
}

/* Sum of the LANES partial sums, folded pairwise (log depth: a serial sum of 32 lanes would cost
   more than the sweep itself on short rows); destroys p. */
static inline acc_t fold_SUF(scalar_t* p) {
    for (int h = LANES / 2; h > 0; h /= 2)
        for (int l = 0; l < h; ++l) p[l] += p[l + h];
    return p[0];
}

/* Mean and 1/sqrt(biased var + eps) of one row, two sweeps (the second hits cache): the centred
   sum of squares does not lose digits to cancellation the way E[x²] − μ² does. */
static void row_moments_SUF(const scalar_t* restrict xr, i64 N, double eps, acc_t* mu, acc_t* r) {
    scalar_t ps[LANES] = {0};
    acc_t s = 0;
    i64 j = 0;
    for (; j + LANES <= N; j += LANES)
        for (int l = 0; l < LANES; ++l) ps[l] += xr[j + l];
    for (; j < N; ++j) s += xr[j];
    s += fold_SUF(ps);
    const acc_t m = s / N;
    const scalar_t mf = (scalar_t)m;
    scalar_t pv[LANES] = {0};
    acc_t v = 0;
    for (j = 0; j + LANES <= N; j += LANES)
        for (int l = 0; l < LANES; ++l) {
            const scalar_t d = xr[j + l] - mf;
            pv[l] += d * d;
        }
    for (; j < N; ++j) v += (xr[j] - m) * (xr[j] - m);
    v += fold_SUF(pv);
    *mu = m;
    *r = 1.0 / sqrt(v / N + eps);
}

/* Σ g and Σ g·x̂ over one row (g = dy ⊙ w, x̂ = (x − m)·r); with dwa/dba, also adds the row's
   dy ⊙ x̂ and dy to the weight/bias accumulators in the same sweep. */
static void row_grad_sums_SUF(const scalar_t* restrict dyr, const scalar_t* restrict xr,
                              const scalar_t* restrict w, acc_t m, acc_t r, i64 N,
                              scalar_t* restrict dwa, scalar_t* restrict dba, acc_t* sg,
                              acc_t* sgx) {
    scalar_t pg[LANES] = {0}, pgx[LANES] = {0};
    const scalar_t mf = (scalar_t)m, rf = (scalar_t)r;
    acc_t tg = 0, tgx = 0;
    i64 j = 0;
    if (dwa) {
        for (; j + LANES <= N; j += LANES)
            for (int l = 0; l < LANES; ++l) {
                const scalar_t d = dyr[j + l], xh = (xr[j + l] - mf) * rf, g = d * w[j + l];
                pg[l] += g;
                pgx[l] += g * xh;
                dwa[j + l] += d * xh;
                dba[j + l] += d;
            }
        for (; j < N; ++j) {
            const acc_t d = dyr[j], xh = (xr[j] - m) * r, g = d * w[j];
            tg += g;
            tgx += g * xh;
            dwa[j] += d * xh;
            dba[j] += d;
        }
    } else {
        for (; j + LANES <= N; j += LANES)
            for (int l = 0; l < LANES; ++l) {
                const scalar_t g = dyr[j + l] * w[j + l];
                pg[l] += g;
                pgx[l] += g * ((xr[j + l] - mf) * rf);
            }
        for (; j < N; ++j) {
            const acc_t g = (acc_t)dyr[j] * w[j];
            tg += g;
            tgx += g * ((xr[j] - m) * r);
        }
    }
    *sg = tg + fold_SUF(pg);
    *sgx = tgx + fold_SUF(pgx);
}

/* row_grad_sums for two rows at once, when dw/db are wanted: each accumulator element is loaded
   and stored once per pair of rows instead of once per row. */
static void row_pair_grad_sums_SUF(const scalar_t* restrict dy0, const scalar_t* restrict x0,
                                   const scalar_t* restrict dy1, const scalar_t* restrict x1,
                                   const scalar_t* restrict w, const acc_t* m, const acc_t* r,
                                   i64 N, scalar_t* restrict dwa, scalar_t* restrict dba,
                                   acc_t* sg, acc_t* sgx) {
    scalar_t pg0[LANES] = {0}, pgx0[LANES] = {0}, pg1[LANES] = {0}, pgx1[LANES] = {0};
    const scalar_t m0 = (scalar_t)m[0], r0 = (scalar_t)r[0];
    const scalar_t m1 = (scalar_t)m[1], r1 = (scalar_t)r[1];
    acc_t tg0 = 0, tgx0 = 0, tg1 = 0, tgx1 = 0;
    i64 j = 0;
    for (; j + LANES <= N; j += LANES)
        for (int l = 0; l < LANES; ++l) {
            const scalar_t d0 = dy0[j + l], xh0 = (x0[j + l] - m0) * r0, g0 = d0 * w[j + l];
            const scalar_t d1 = dy1[j + l], xh1 = (x1[j + l] - m1) * r1, g1 = d1 * w[j + l];
            pg0[l] += g0;
            pgx0[l] += g0 * xh0;
            pg1[l] += g1;
            pgx1[l] += g1 * xh1;
            dwa[j + l] += d0 * xh0 + d1 * xh1;
            dba[j + l] += d0 + d1;
        }
    for (; j < N; ++j) {
        const acc_t d0 = dy0[j], xh0 = (x0[j] - m[0]) * r[0], g0 = d0 * w[j];
        const acc_t d1 = dy1[j], xh1 = (x1[j] - m[1]) * r[1], g1 = d1 * w[j];
        tg0 += g0;
        tgx0 += g0 * xh0;
        tg1 += g1;
        tgx1 += g1 * xh1;
        dwa[j] += d0 * xh0 + d1 * xh1;
        dba[j] += d0 + d1;
    }
    sg[0] = tg0 + fold_SUF(pg0);
    sgx[0] = tgx0 + fold_SUF(pgx0);
    sg[1] = tg1 + fold_SUF(pg1);
    sgx[1] = tgx1 + fold_SUF(pgx1);
}

static void ln_fwd_rows_SUF(const scalar_t* restrict x, const scalar_t* restrict w,
                            const scalar_t* restrict b, scalar_t* restrict y,
                            scalar_t* restrict mean, scalar_t* restrict rstd, i64 lo, i64 hi,
                            i64 N, double eps) {
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* restrict xr = x + i * N;
        scalar_t* restrict yr = y + i * N;
        acc_t m, r;
        row_moments_SUF(xr, N, eps, &m, &r);
        const scalar_t mf = mean[i] = (scalar_t)m, rf = rstd[i] = (scalar_t)r;
        if (w && b) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (xr[j] - mf) * rf * w[j] + b[j];
        } else if (w) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (xr[j] - mf) * rf * w[j];
        } else if (b) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (xr[j] - mf) * rf + b[j];
        } else {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (xr[j] - mf) * rf;
        }
    }
}

void ln_fwd_SUF(const scalar_t* x, const scalar_t* w, const scalar_t* b, scalar_t* y,
                scalar_t* mean, scalar_t* rstd, i64 M, i64 N, double eps, int nt) {
    if (nt <= 1) {
        ln_fwd_rows_SUF(x, w, b, y, mean, rstd, 0, M, N, eps);
        return;
    }
    #pragma omp parallel num_threads(nt)
    {
        i64 lo, hi;
        row_block(M, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        ln_fwd_rows_SUF(x, w, b, y, mean, rstd, lo, hi, N, eps);
    }
}

/* Layer-norm backward over rows [lo, hi). keep_mu / keep_sigma select the DetachNorm variant;
   mean = NULL means μ = 0 (RMSNorm); w is never NULL (ones stand in); dx may be NULL; dwa and
   dba are both NULL or both set. The
   first sweep reads dy and x from memory; the second, which writes dx, finds them in cache. */
static void ln_bwd_rows_SUF(const scalar_t* restrict dy, const scalar_t* restrict x,
                            const scalar_t* restrict mean, const scalar_t* restrict rstd,
                            const scalar_t* restrict w, scalar_t* restrict dx,
                            acc_t* restrict dwa, acc_t* restrict dba, scalar_t* restrict fwa,
                            scalar_t* restrict fba, i64 lo, i64 hi, i64 N, int keep_mu,
                            int keep_sigma) {
    const int need_sums = dx && (keep_mu || keep_sigma);
    int pending = 0;  /* rows added to fwa/fba since the last float64 flush */
    for (i64 i = lo; i < hi;) {
        const int rows = (dwa && i + 1 < hi) ? 2 : 1;
        acc_t m[2], r[2], sg[2] = {0, 0}, sgx[2] = {0, 0};
        for (int k = 0; k < rows; ++k) {
            m[k] = mean ? mean[i + k] : 0.0;
            r[k] = rstd[i + k];
        }
        if (rows == 2)
            row_pair_grad_sums_SUF(dy + i * N, x + i * N, dy + (i + 1) * N, x + (i + 1) * N, w,
                                   m, r, N, fwa, fba, sg, sgx);
        else if (need_sums || dwa)
            row_grad_sums_SUF(dy + i * N, x + i * N, w, m[0], r[0], N, fwa, fba, sg, sgx);
        pending += rows;
        /* dw/db: FLUSH rows summed in the input precision, then moved into float64 (a float64
           add per element and row would cost as much as the rest of the sweep). */
        if (dwa && (pending >= FLUSH || i + rows == hi)) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) {
                dwa[j] += fwa[j];
                dba[j] += fba[j];
                fwa[j] = 0;
                fba[j] = 0;
            }
            pending = 0;
        }
        for (int k = 0; dx && k < rows; ++k) {
            const scalar_t* restrict dyr = dy + (i + k) * N;
            const scalar_t* restrict xr = x + (i + k) * N;
            scalar_t* restrict dxr = dx + (i + k) * N;
            const scalar_t c1 = keep_mu ? sg[k] / N : 0.0, c2 = keep_sigma ? sgx[k] / N : 0.0;
            const scalar_t mf = (scalar_t)m[k], rf = (scalar_t)r[k];
            #pragma omp simd
            for (i64 j = 0; j < N; ++j)
                dxr[j] = rf * (dyr[j] * w[j] - c1 - (xr[j] - mf) * rf * c2);
        }
        i += rows;
    }
}

int ln_bwd_SUF(const scalar_t* dy, const scalar_t* x, const scalar_t* mean, const scalar_t* rstd,
               const scalar_t* w, scalar_t* dx, scalar_t* dw, scalar_t* db, i64 M, i64 N,
               int keep_mu, int keep_sigma, int nt) {
    if (nt < 1) nt = 1;
    if (!w && !(w = ones_SUF(N))) return 1;
    /* Per thread: float64 dw/db sums, then blocks of rows in the input precision. Both always
       accumulate together: one loop form, and db costs one add. */
    acc_t *dwa = NULL, *dba = NULL;
    scalar_t *fwa = NULL, *fba = NULL;
    if (dw || db) {
        const i64 nacc = 2 * nt * N, nflt = (2 * nt * N * sizeof(scalar_t) + 7) / sizeof(acc_t);
        if (!(dwa = zeroed_scratch(nacc + nflt))) return 1;
        dba = dwa + (i64)nt * N;
        fwa = (scalar_t*)(dwa + nacc);
        fba = fwa + (i64)nt * N;
    }
    if (nt == 1) {
        ln_bwd_rows_SUF(dy, x, mean, rstd, w, dx, dwa, dba, fwa, fba, 0, M, N, keep_mu,
                        keep_sigma);
    } else {
        #pragma omp parallel num_threads(nt)
        {
            const i64 t = omp_get_thread_num();
            i64 lo, hi;
            row_block(M, omp_get_num_threads(), (int)t, &lo, &hi);
            if (dwa)
                ln_bwd_rows_SUF(dy, x, mean, rstd, w, dx, dwa + t * N, dba + t * N, fwa + t * N,
                                fba + t * N, lo, hi, N, keep_mu, keep_sigma);
            else
                ln_bwd_rows_SUF(dy, x, mean, rstd, w, dx, NULL, NULL, NULL, NULL, lo, hi, N,
                                keep_mu, keep_sigma);
        }
    }
    if (dw) {
        reduce_buffers(dwa, nt, N);
        for (i64 j = 0; j < N; ++j) dw[j] = (scalar_t)dwa[j];
    }
    if (db) {
        reduce_buffers(dba, nt, N);
        for (i64 j = 0; j < N; ++j) db[j] = (scalar_t)dba[j];
    }
    return 0;
}

/* -------------------------------------------------------------------- RMSNorm ------------- */

static void rms_fwd_rows_SUF(const scalar_t* restrict x, const scalar_t* restrict w,
                             scalar_t* restrict y, scalar_t* restrict rstd, i64 lo, i64 hi, i64 N,
                             double eps) {
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* restrict xr = x + i * N;
        scalar_t* restrict yr = y + i * N;
        scalar_t ps[LANES] = {0};
        acc_t ss = 0;
        i64 j = 0;
        for (; j + LANES <= N; j += LANES)
            for (int l = 0; l < LANES; ++l) ps[l] += xr[j + l] * xr[j + l];
        for (; j < N; ++j) ss += (acc_t)xr[j] * xr[j];
        ss += fold_SUF(ps);
        const scalar_t rf = rstd[i] = (scalar_t)(1.0 / sqrt(ss / N + eps));
        if (w) {
            #pragma omp simd
            for (j = 0; j < N; ++j) yr[j] = xr[j] * rf * w[j];
        } else {
            #pragma omp simd
            for (j = 0; j < N; ++j) yr[j] = xr[j] * rf;
        }
    }
}

void rms_fwd_SUF(const scalar_t* x, const scalar_t* w, scalar_t* y, scalar_t* rstd, i64 M, i64 N,
                 double eps, int nt) {
    if (nt <= 1) {
        rms_fwd_rows_SUF(x, w, y, rstd, 0, M, N, eps);
        return;
    }
    #pragma omp parallel num_threads(nt)
    {
        i64 lo, hi;
        row_block(M, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        rms_fwd_rows_SUF(x, w, y, rstd, lo, hi, N, eps);
    }
}

/* RMSNorm's backward is the layer-norm one with μ = 0 (mean = NULL) and no mean(g) term. */
int rms_bwd_SUF(const scalar_t* dy, const scalar_t* x, const scalar_t* rstd, const scalar_t* w,
                scalar_t* dx, scalar_t* dw, i64 M, i64 N, int nt) {
    return ln_bwd_SUF(dy, x, NULL, rstd, w, dx, dw, NULL, M, N, 0, 1, nt);
}

/* -------------------------------------------------------------------- AdaNorm ------------- */

static void ada_fwd_rows_SUF(const scalar_t* restrict x, scalar_t* restrict z,
                             scalar_t* restrict mean, scalar_t* restrict rstd, i64 lo, i64 hi,
                             i64 N, double eps, double k, double scale) {
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* restrict xr = x + i * N;
        scalar_t* restrict zr = z + i * N;
        acc_t m, r;
        row_moments_SUF(xr, N, eps, &m, &r);
        const scalar_t mf = mean[i] = (scalar_t)m, rf = rstd[i] = (scalar_t)r;
        const scalar_t c = (scalar_t)scale, ck = (scalar_t)(scale * k);
        #pragma omp simd
        for (i64 j = 0; j < N; ++j) {
            const scalar_t yv = (xr[j] - mf) * rf;
            zr[j] = (c - ck * yv) * yv;
        }
    }
}

void ada_fwd_SUF(const scalar_t* x, scalar_t* z, scalar_t* mean, scalar_t* rstd, i64 M, i64 N,
                 double eps, double k, double scale, int nt) {
    if (nt <= 1) {
        ada_fwd_rows_SUF(x, z, mean, rstd, 0, M, N, eps, k, scale);
        return;
    }
    #pragma omp parallel num_threads(nt)
    {
        i64 lo, hi;
        row_block(M, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        ada_fwd_rows_SUF(x, z, mean, rstd, lo, hi, N, eps, k, scale);
    }
}

static void ada_bwd_rows_SUF(const scalar_t* restrict dz, const scalar_t* restrict x,
                             const scalar_t* restrict mean, const scalar_t* restrict rstd,
                             scalar_t* restrict dx, i64 lo, i64 hi, i64 N, double k,
                             double scale) {
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* restrict dzr = dz + i * N;
        const scalar_t* restrict xr = x + i * N;
        scalar_t* restrict dxr = dx + i * N;
        const scalar_t m = mean[i], r = rstd[i];
        const scalar_t c = (scalar_t)scale, ck = (scalar_t)(scale * k);
        scalar_t pd[LANES] = {0}, pdy[LANES] = {0};
        acc_t sd = 0, sdy = 0;
        i64 j = 0;
        for (; j + LANES <= N; j += LANES)
            for (int l = 0; l < LANES; ++l) {
                const scalar_t yv = (xr[j + l] - m) * r;
                const scalar_t d = dzr[j + l] * (c - ck * yv);  /* φ(y) held constant */
                pd[l] += d;
                pdy[l] += d * yv;
            }
        for (; j < N; ++j) {
            const scalar_t yv = (xr[j] - m) * r;
            const scalar_t d = dzr[j] * (c - ck * yv);
            sd += d;
            sdy += (acc_t)d * yv;
        }
        sd += fold_SUF(pd);
        sdy += fold_SUF(pdy);
        const scalar_t c1 = sd / N, c2 = sdy / N;
        #pragma omp simd
        for (j = 0; j < N; ++j) {
            const scalar_t yv = (xr[j] - m) * r;
            const scalar_t d = dzr[j] * (c - ck * yv);
            dxr[j] = r * (d - c1 - yv * c2);
        }
    }
}

void ada_bwd_SUF(const scalar_t* dz, const scalar_t* x, const scalar_t* mean, const scalar_t* rstd,
                 scalar_t* dx, i64 M, i64 N, double k, double scale, int nt) {
    if (nt <= 1) {
        ada_bwd_rows_SUF(dz, x, mean, rstd, dx, 0, M, N, k, scale);
        return;
    }
    #pragma omp parallel num_threads(nt)
    {
        i64 lo, hi;
        row_block(M, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        ada_bwd_rows_SUF(dz, x, mean, rstd, dx, lo, hi, N, k, scale);
    }
}
"""

#: (C type, symbol suffix) for each instantiation; the suffix names the torch dtype.
INSTANCES = (("float", "f32"), ("double", "f64"))


def source() -> str:
    """The complete C translation unit: prelude plus the template for every scalar type."""
    parts = [_PRELUDE]
    for ctype, suffix in INSTANCES:
        parts.append(_TEMPLATE.replace("scalar_t", ctype).replace("SUF", suffix))
    return "\n".join(parts)
