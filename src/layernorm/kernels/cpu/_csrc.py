"""C source of the fused CPU kernels (built and loaded by :mod:`._native`).

Every op is one pass over memory per direction: a row (N ≤ a few thousand elements) is read once
from RAM for its statistics, and the second sweep that writes the output finds it in L1/L2. That is
the traffic of PyTorch's native layer-norm kernels (fwd: read x, write y; bwd: read dy and x, write
dx), where an eager composition of ATen ops makes 5–10 full passes. Rows are split evenly across
OpenMP threads; ``dweight``/``dbias`` are summed over each thread's rows into a private float64
buffer, and the buffers are added at the end (deterministic for a fixed thread count).

Statistics and row sums accumulate in ``acc_t`` = double whatever the input precision, so float32
results stay within a few ulps of a float64 reference for any N. The source is written once over
``scalar_t`` and ``SUF``; :func:`source` instantiates it for float32 and float64.

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

/* Mean and 1/sqrt(biased var + eps) of one row, two sweeps (the second hits cache): the centred
   sum of squares does not lose digits to cancellation the way E[x²] − μ² does. */
static void row_moments_SUF(const scalar_t* xr, i64 N, double eps, acc_t* mu, acc_t* r) {
    acc_t s = 0;
    #pragma omp simd reduction(+ : s)
    for (i64 j = 0; j < N; ++j) s += xr[j];
    const acc_t m = s / N;
    acc_t v = 0;
    #pragma omp simd reduction(+ : v)
    for (i64 j = 0; j < N; ++j) {
        const acc_t d = xr[j] - m;
        v += d * d;
    }
    *mu = m;
    *r = 1.0 / sqrt(v / N + eps);
}

static void ln_fwd_rows_SUF(const scalar_t* x, const scalar_t* w, const scalar_t* b, scalar_t* y,
                            scalar_t* mean, scalar_t* rstd, i64 lo, i64 hi, i64 N, double eps) {
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* xr = x + i * N;
        scalar_t* yr = y + i * N;
        acc_t m, r;
        row_moments_SUF(xr, N, eps, &m, &r);
        mean[i] = (scalar_t)m;
        rstd[i] = (scalar_t)r;
        if (w && b) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (scalar_t)((xr[j] - m) * r) * w[j] + b[j];
        } else if (w) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (scalar_t)((xr[j] - m) * r) * w[j];
        } else if (b) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (scalar_t)((xr[j] - m) * r) + b[j];
        } else {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (scalar_t)((xr[j] - m) * r);
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
   w may be NULL (gain 1); dx may be NULL; dwa/dba (float64 accumulators) may be NULL. The first
   sweep reads dy and x from memory for the row sums and the dw/db terms; the second, which writes
   dx, finds them in cache. */
static void ln_bwd_rows_SUF(const scalar_t* dy, const scalar_t* x, const scalar_t* mean,
                            const scalar_t* rstd, const scalar_t* w, scalar_t* dx, acc_t* dwa,
                            acc_t* dba, i64 lo, i64 hi, i64 N, int keep_mu, int keep_sigma) {
    const int need_sums = dx && (keep_mu || keep_sigma);
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* dyr = dy + i * N;
        const scalar_t* xr = x + i * N;
        const acc_t m = mean[i], r = rstd[i];
        acc_t sg = 0, sgx = 0;
        if (need_sums || dwa || dba) {
            /* Loop-invariant branches: the compiler emits one vector loop per combination. */
            #pragma omp simd reduction(+ : sg, sgx)
            for (i64 j = 0; j < N; ++j) {
                const acc_t d = dyr[j], xh = (xr[j] - m) * r;
                const acc_t g = w ? d * w[j] : d;
                sg += g;
                sgx += g * xh;
                if (dwa) dwa[j] += d * xh;
                if (dba) dba[j] += d;
            }
        }
        if (!dx) continue;
        const acc_t c1 = keep_mu ? sg / N : 0.0, c2 = keep_sigma ? sgx / N : 0.0;
        scalar_t* dxr = dx + i * N;
        if (w) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j)
                dxr[j] = (scalar_t)(r * ((acc_t)dyr[j] * w[j] - c1 - (xr[j] - m) * r * c2));
        } else {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j)
                dxr[j] = (scalar_t)(r * (dyr[j] - c1 - (xr[j] - m) * r * c2));
        }
    }
}

int ln_bwd_SUF(const scalar_t* dy, const scalar_t* x, const scalar_t* mean, const scalar_t* rstd,
               const scalar_t* w, scalar_t* dx, scalar_t* dw, scalar_t* db, i64 M, i64 N,
               int keep_mu, int keep_sigma, int nt) {
    if (nt < 1) nt = 1;
    acc_t *dwa = NULL, *dba = NULL;
    const i64 blocks = (dw ? 1 : 0) + (db ? 1 : 0);
    if (blocks) {
        acc_t* buf = zeroed_scratch(blocks * nt * N);
        if (!buf) return 1;
        dwa = dw ? buf : NULL;
        dba = db ? buf + (dw ? (i64)nt * N : 0) : NULL;
    }
    if (nt == 1) {
        ln_bwd_rows_SUF(dy, x, mean, rstd, w, dx, dwa, dba, 0, M, N, keep_mu, keep_sigma);
    } else {
        #pragma omp parallel num_threads(nt)
        {
            const int t = omp_get_thread_num();
            i64 lo, hi;
            row_block(M, omp_get_num_threads(), t, &lo, &hi);
            ln_bwd_rows_SUF(dy, x, mean, rstd, w, dx, dwa ? dwa + (i64)t * N : NULL,
                            dba ? dba + (i64)t * N : NULL, lo, hi, N, keep_mu, keep_sigma);
        }
    }
    if (dwa) {
        reduce_buffers(dwa, nt, N);
        for (i64 j = 0; j < N; ++j) dw[j] = (scalar_t)dwa[j];
    }
    if (dba) {
        reduce_buffers(dba, nt, N);
        for (i64 j = 0; j < N; ++j) db[j] = (scalar_t)dba[j];
    }
    return 0;
}

/* -------------------------------------------------------------------- RMSNorm ------------- */

static void rms_fwd_rows_SUF(const scalar_t* x, const scalar_t* w, scalar_t* y, scalar_t* rstd,
                             i64 lo, i64 hi, i64 N, double eps) {
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* xr = x + i * N;
        scalar_t* yr = y + i * N;
        acc_t ss = 0;
        #pragma omp simd reduction(+ : ss)
        for (i64 j = 0; j < N; ++j) ss += (acc_t)xr[j] * xr[j];
        const acc_t r = 1.0 / sqrt(ss / N + eps);
        rstd[i] = (scalar_t)r;
        if (w) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (scalar_t)(xr[j] * r) * w[j];
        } else {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) yr[j] = (scalar_t)(xr[j] * r);
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

static void rms_bwd_rows_SUF(const scalar_t* dy, const scalar_t* x, const scalar_t* rstd,
                             const scalar_t* w, scalar_t* dx, acc_t* dwa, i64 lo, i64 hi, i64 N) {
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* dyr = dy + i * N;
        const scalar_t* xr = x + i * N;
        const acc_t r = rstd[i];
        if (dwa) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) dwa[j] += dyr[j] * (xr[j] * r);
        }
        if (!dx) continue;
        acc_t sgx = 0;
        if (w) {
            #pragma omp simd reduction(+ : sgx)
            for (i64 j = 0; j < N; ++j) sgx += (acc_t)dyr[j] * w[j] * xr[j];
        } else {
            #pragma omp simd reduction(+ : sgx)
            for (i64 j = 0; j < N; ++j) sgx += (acc_t)dyr[j] * xr[j];
        }
        /* x̂·mean(g ⊙ x̂) = x · r²·Σ(g ⊙ x)/N */
        const acc_t c2 = sgx * r * r / N;
        scalar_t* dxr = dx + i * N;
        if (w) {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j)
                dxr[j] = (scalar_t)(r * ((acc_t)dyr[j] * w[j] - xr[j] * c2));
        } else {
            #pragma omp simd
            for (i64 j = 0; j < N; ++j) dxr[j] = (scalar_t)(r * (dyr[j] - xr[j] * c2));
        }
    }
}

int rms_bwd_SUF(const scalar_t* dy, const scalar_t* x, const scalar_t* rstd, const scalar_t* w,
                scalar_t* dx, scalar_t* dw, i64 M, i64 N, int nt) {
    if (nt < 1) nt = 1;
    acc_t* dwa = NULL;
    if (dw) {
        dwa = zeroed_scratch(nt * N);
        if (!dwa) return 1;
    }
    if (nt == 1) {
        rms_bwd_rows_SUF(dy, x, rstd, w, dx, dwa, 0, M, N);
    } else {
        #pragma omp parallel num_threads(nt)
        {
            const int t = omp_get_thread_num();
            i64 lo, hi;
            row_block(M, omp_get_num_threads(), t, &lo, &hi);
            rms_bwd_rows_SUF(dy, x, rstd, w, dx, dwa ? dwa + (i64)t * N : NULL, lo, hi, N);
        }
    }
    if (dwa) {
        reduce_buffers(dwa, nt, N);
        for (i64 j = 0; j < N; ++j) dw[j] = (scalar_t)dwa[j];
    }
    return 0;
}

/* -------------------------------------------------------------------- AdaNorm ------------- */

static void ada_fwd_rows_SUF(const scalar_t* x, scalar_t* z, scalar_t* mean, scalar_t* rstd,
                             i64 lo, i64 hi, i64 N, double eps, double k, double scale) {
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* xr = x + i * N;
        scalar_t* zr = z + i * N;
        acc_t m, r;
        row_moments_SUF(xr, N, eps, &m, &r);
        mean[i] = (scalar_t)m;
        rstd[i] = (scalar_t)r;
        #pragma omp simd
        for (i64 j = 0; j < N; ++j) {
            const acc_t yv = (xr[j] - m) * r;
            zr[j] = (scalar_t)(scale * (1.0 - k * yv) * yv);
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

static void ada_bwd_rows_SUF(const scalar_t* dz, const scalar_t* x, const scalar_t* mean,
                             const scalar_t* rstd, scalar_t* dx, i64 lo, i64 hi, i64 N, double k,
                             double scale) {
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* dzr = dz + i * N;
        const scalar_t* xr = x + i * N;
        scalar_t* dxr = dx + i * N;
        const acc_t m = mean[i], r = rstd[i];
        acc_t sd = 0, sdy = 0;
        #pragma omp simd reduction(+ : sd, sdy)
        for (i64 j = 0; j < N; ++j) {
            const acc_t yv = (xr[j] - m) * r;
            const acc_t d = dzr[j] * (scale * (1.0 - k * yv));  /* φ(y) held constant */
            sd += d;
            sdy += d * yv;
        }
        const acc_t c1 = sd / N, c2 = sdy / N;
        #pragma omp simd
        for (i64 j = 0; j < N; ++j) {
            const acc_t yv = (xr[j] - m) * r;
            const acc_t d = dzr[j] * (scale * (1.0 - k * yv));
            dxr[j] = (scalar_t)(r * (d - c1 - yv * c2));
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
