/* The norm kernels over one scalar type: included by norms.c with scalar_t (float or double) and
   SUF (f32 or f64) defined; every external name ends in _SUF.

   Per row, with x̂ = (x − μ)·rstd and g = dy ⊙ w:

     layer norm   dx = rstd · (g − a·mean(g) − b·x̂·mean(g ⊙ x̂))   a = 0 if μ detached, b = 0 if σ
     RMSNorm      dx = rstd · (g − x̂·mean(g ⊙ x̂))                 x̂ = x·rstd
     AdaNorm      d  = dz ⊙ C·(1 − k·x̂),  dx = rstd · (d − mean(d) − x̂·mean(d ⊙ x̂))
     all          dw = Σ_rows dy ⊙ x̂,  db = Σ_rows dy

   Statistics. μ is found in two sweeps (the second finds the row in cache). The first sums
   x − x0, x0 = the row's first element, so μ = x0 + Σ(x − x0)/N in float64 (every /N here is a
   product with 1/N: ROW_INV_N); on a constant row every term is exactly 0 and μ = x0 exactly. μ
   is kept as hi + lo, hi = μ rounded to scalar_t; the second sweep sums (x − hi)², exact in
   scalar_t for x near hi, and
   var = Σ(x − hi)²/N − lo²  (= Σ(x − μ)²/N, since Σ(x − hi) = N·lo). A constant row thus has
   μ = x, var = 0 and y = bias exactly. The forward computes (x − hi) − lo, so y carries the
   rounding of a subtraction of the exact mean, not of a rounded one. Every sum is blocked (see
   BLOCK_TERMS in cpu_common.h). */

#define FN(name) LN_CAT(name, SUF)

/* A vector of N ones, kept per calling thread: a missing gain becomes w = 1, so every backward
   loop has a single form instead of one per combination of optional arguments. On a cache line,
   as a tensor's gain is (see half_buffers in half.h). */
static __thread scalar_t* FN(ones_buf) = NULL;
static __thread i64 FN(ones_cap) = 0;

static const scalar_t* FN(ones)(i64 n) {
    if (n > FN(ones_cap)) {
        free(FN(ones_buf));
        void* p = NULL;
        FN(ones_buf) = posix_memalign(&p, 64, (size_t)n * sizeof(scalar_t)) == 0 ? p : NULL;
        FN(ones_cap) = FN(ones_buf) ? n : 0;
        if (!FN(ones_buf)) return NULL;
        for (i64 j = 0; j < n; ++j) FN(ones_buf)[j] = 1;
    }
    return FN(ones_buf);
}

/* The partial sums are two vectors of VL values (LANES = 2·VL lanes, HALF = VL), held in
   registers as vector types: written as arrays of LANES scalars, GCC kept them on the stack when
   they took more than a few registers (AVX2: zeroed with rep stos and added to through memory,
   a third of the statistics' time at N = 256). */
typedef scalar_t FN(vec) __attribute__((vector_size(VEC_BYTES), aligned(sizeof(scalar_t)),
                                        may_alias));
/* TAIL_VECTOR_STEP: a row's sums (statistics, the backwards' sums) take a whole vector left past
   their blocks of two vectors in one vector step, where the scalar tail adds into float64 one
   element at a time, a dependent chain (48-element rows: the backward in 0.75-0.81 of the time).
   Under a branch hint: out of the way of the rows that have no such vector. -DNO_TAIL_VEC=1
   leaves it to the scalar tail, as before (benchmarks/ab_norm_kernels.py). */
#ifndef NO_TAIL_VEC
#define NO_TAIL_VEC 0
#endif
/* Whether a row of N elements has a whole vector left past its blocks, which end at nfull. */
#define TAIL_VEC_LEFT(N, nfull) __builtin_expect(!NO_TAIL_VEC && (N) - (nfull) >= VL, 0)
#define VL ((i64)(VEC_BYTES / sizeof(scalar_t)))
#define LANES (2 * VL)
#define HALF VL
#define BLOCK (BLOCK_TERMS * LANES)

static inline FN(vec) FN(ld)(const scalar_t* p) { return *(const FN(vec)*)p; }

/* A non-temporal store of one vector to p, aligned to VEC_BYTES: the line goes to memory without
   first being read into the cache, as a plain store's line is (a third of the memory traffic of
   writing an output larger than the caches). A plain store where the target has none. */
static inline void FN(st_stream)(scalar_t* p, FN(vec) v) {
#if defined(__AVX512F__)
    if (sizeof(scalar_t) == 4) _mm512_stream_ps((float*)p, (__m512)v);
    else _mm512_stream_pd((double*)p, (__m512d)v);
#elif defined(__AVX__)
    if (sizeof(scalar_t) == 4) _mm256_stream_ps((float*)p, (__m256)v);
    else _mm256_stream_pd((double*)p, (__m256d)v);
#elif defined(__SSE2__)
    if (sizeof(scalar_t) == 4) _mm_stream_ps((float*)p, (__m128)v);
    else _mm_stream_pd((double*)p, (__m128d)v);
#else
    *(FN(vec)*)p = v;
#endif
}

/* The loads of an output expression (ROW_OUT): element j, or the vector at j. */
#define LOAD_ONE(p) (p)[j]
#define LOAD_VEC(p) FN(ld)((p) + j)

/* Writes one output row: dst[j] = EXPR(L) for j in [0, n), where EXPR is an expression of the
   loads L(p), written once for scalars and vectors (GCC broadcasts scalar operands). With
   `stream`, the row's whole cache lines go out by non-temporal stores (stream_body in
   cpu_common.h: none for a short row that is not whole lines) and the rows that pf0/pf1 point
   at (NULL: none), the next rows' inputs, are prefetched meanwhile, so that the next row's
   first sweep reads them from cache while this row's stores drain; a row read from memory and
   then written kept a single core's memory traffic in one direction at a time. The partial
   lines at the row's ends, and every row without `stream`, take a plain vectorized loop. The stores of a kernel that streamed are ordered before it returns (stream_fence). */
#define ROW_OUT(dst, n, stream, pf0, pf1, EXPR)                                                \
    do {                                                                                        \
        scalar_t* restrict out_ = (dst);                                                        \
        const scalar_t *pf0_ = (pf0), *pf1_ = (pf1);                                            \
        const i64 n_ = (n);                                                                     \
        i64 head_ = 0, body_end_ = 0;                                                           \
        if (stream) {                                                                           \
            stream_body(out_, n_, (i64)sizeof(scalar_t), &head_, &body_end_);                   \
            _Pragma("omp simd")                                                                 \
            for (i64 j = 0; j < head_; ++j) out_[j] = EXPR(LOAD_ONE);                           \
            for (i64 j = head_; j < body_end_; j += VL) {                                       \
                if (pf0_) __builtin_prefetch(pf0_ + j);                                         \
                if (pf1_) __builtin_prefetch(pf1_ + j);                                         \
                FN(st_stream)(out_ + j, EXPR(LOAD_VEC));                                        \
            }                                                                                   \
        }                                                                                       \
        _Pragma("omp simd")                                                                     \
        for (i64 j = body_end_; j < n_; ++j) out_[j] = EXPR(LOAD_ONE);                          \
    } while (0)

/* A row's float64 partial sums in registers (FN(lanes), FN(lanes_add), FN(lanes_fold)). */
#define ROW_VEC FN(vec)
#include "row_lanes.h"
#undef ROW_VEC

/* How a row's elements are stored, for the sweeps that read them (row_variance_of): as
   scalar_t, or (the float32 instance only) as bfloat16 / float16 converted to float32 in
   registers, exactly (half.h), so that the half kernels' forwards read a row where it lies. */
#ifndef ROW_SCALAR
#define ROW_SCALAR 0
#define ROW_BF16 1
#define ROW_F16 2
#endif

/* The vector at element j of a row of that kind, and element j alone. */
static inline __attribute__((always_inline)) FN(vec) FN(ld_kind)(const void* p, i64 j,
                                                                 const int kind) {
    if (sizeof(scalar_t) == 4 && kind == ROW_BF16)
        return (FN(vec))bf16_vec_to_f32((const uint16_t*)p + j);
    if (sizeof(scalar_t) == 4 && kind == ROW_F16)
        return (FN(vec))f16_vec_to_f32((const uint16_t*)p + j);
    return FN(ld)((const scalar_t*)p + j);
}

static inline __attribute__((always_inline)) scalar_t FN(at_kind)(const void* p, i64 j,
                                                                  const int kind) {
    if (kind == ROW_BF16) return (scalar_t)bf16_to_f32(((const uint16_t*)p)[j]);
    if (kind == ROW_F16) return (scalar_t)f16_to_f32(((const uint16_t*)p)[j]);
    return ((const scalar_t*)p)[j];
}

/* Σ x² over one row of the given kind. */
static inline __attribute__((always_inline)) acc_t FN(row_sum_sq_of)(const void* xr, i64 N,
                                                                     const int kind) {
    const i64 nfull = N - N % LANES;
    FN(lanes) sa = {{0}, {0}};
    for (i64 j = 0; j < nfull;) {
        const i64 end = block_end(j, BLOCK, nfull);
        FN(vec) p0 = {0}, p1 = {0};
        for (; j < end; j += LANES) {
            const FN(vec) u = FN(ld_kind)(xr, j, kind), v = FN(ld_kind)(xr, j + VL, kind);
            p0 += u * u;
            p1 += v * v;
        }
        FN(lanes_add)(p0, p1, &sa);
    }
    i64 tail = nfull;
    if (TAIL_VEC_LEFT(N, nfull)) { /* see TAIL_VECTOR_STEP */
        const FN(vec) u = FN(ld_kind)(xr, nfull, kind), zero = {0};
        FN(lanes_add)(u * u, zero, &sa);
        tail += VL;
    }
    acc_t s = 0;
    for (i64 j = tail; j < N; ++j) {
        const scalar_t x = FN(at_kind)(xr, j, kind);
        s += (acc_t)x * x;
    }
    return s + FN(lanes_fold)(sa);
}

/* μ (as hi + lo) and the variance of one row xr of the given kind; see the statistics note at
   the top. The second sweep finds the row in cache. The same arithmetic for every kind: a half
   row gives the bits its float32 copy gives. */
static inline __attribute__((always_inline)) acc_t FN(row_variance_of)(const void* xr, i64 N,
                                                                       scalar_t* hi, scalar_t* lo,
                                                                       const int kind) {
    const scalar_t x0 = FN(at_kind)(xr, 0, kind);
    const i64 nfull = N - N % LANES;
    FN(lanes) sa = {{0}, {0}}, sb = {{0}, {0}};
    for (i64 j = 0; j < nfull;) {
        const i64 end = block_end(j, BLOCK, nfull);
        FN(vec) p0 = {0}, p1 = {0};
        for (; j < end; j += LANES) {
            p0 += FN(ld_kind)(xr, j, kind) - x0;
            p1 += FN(ld_kind)(xr, j + VL, kind) - x0;
        }
        FN(lanes_add)(p0, p1, &sa);
    }
    const int tail_vec = TAIL_VEC_LEFT(N, nfull);
    const i64 tail = tail_vec ? nfull + VL : nfull;
    if (tail_vec) { /* see TAIL_VECTOR_STEP */
        const FN(vec) zero = {0};
        FN(lanes_add)(FN(ld_kind)(xr, nfull, kind) - x0, zero, &sa);
    }
    acc_t s = 0;
    for (i64 j = tail; j < N; ++j) s += (scalar_t)(FN(at_kind)(xr, j, kind) - x0);
    const acc_t mu = (acc_t)x0 + (s + FN(lanes_fold)(sa)) * ROW_INV_N(N);
    const scalar_t h = (scalar_t)mu;
    const acc_t dl = mu - (acc_t)h;
    for (i64 j = 0; j < nfull;) {
        const i64 end = block_end(j, BLOCK, nfull);
        FN(vec) p0 = {0}, p1 = {0};
        for (; j < end; j += LANES) {
            const FN(vec) u = FN(ld_kind)(xr, j, kind) - h, v = FN(ld_kind)(xr, j + VL, kind) - h;
            p0 += u * u;
            p1 += v * v;
        }
        FN(lanes_add)(p0, p1, &sb);
    }
    if (tail_vec) {
        const FN(vec) u = FN(ld_kind)(xr, nfull, kind) - h, zero = {0};
        FN(lanes_add)(u * u, zero, &sb);
    }
    acc_t sdd = 0;
    for (i64 j = tail; j < N; ++j) {
        const acc_t d = (scalar_t)(FN(at_kind)(xr, j, kind) - h);
        sdd += d * d;
    }
    acc_t var = (sdd + FN(lanes_fold)(sb)) * ROW_INV_N(N) - dl * dl;
    if (var < 0) var = 0;
    *hi = h;
    *lo = (scalar_t)dl;
    return var;
}

/* Rows a forward takes as a group (NARROW_N, norms_common.h). */
static inline int FN(row_group)(i64 N) { return N <= NARROW_N ? ROW_GROUP : 1; }

/* The statistics of the n rows from row i0 of x, rows of N elements of the given kind, of a
   group of `group` (FN(row_group)): with `centred`, μ as hi + lo into gh/gl and
   r = 1/sqrt(var + eps), else (RMSNorm) r = 1/sqrt(Σx²/N + eps) and gh = gl = 0, into gr. */
static inline __attribute__((always_inline)) void FN(group_stats_of)(
    const void* x, i64 i0, int n, i64 N, double eps, const int centred, int group,
    const int kind, scalar_t* gh, scalar_t* gl, acc_t* gr) {
    const i64 bytes = kind == ROW_SCALAR ? (i64)sizeof(scalar_t) : 2; /* an element's */
    for (int k = 0; k < ROW_GROUP; ++k) gr[k] = 1;
    for (int k = 0; k < n; ++k) {
        const void* xr = (const char*)x + (i0 + k) * N * bytes;
        if (centred) {
            gr[k] = FN(row_variance_of)(xr, N, &gh[k], &gl[k], kind) + eps;
        } else {
            gr[k] = FN(row_sum_sq_of)(xr, N, kind) * ROW_INV_N(N) + eps;
            gh[k] = gl[k] = 0;
        }
    }
    if (group == ROW_GROUP) {
        for (int k = 0; k < ROW_GROUP; ++k) gr[k] = 1.0 / sqrt(gr[k]);
    } else {
        gr[0] = 1.0 / sqrt(gr[0]);
    }
}

static inline __attribute__((always_inline)) void FN(group_stats)(
    const scalar_t* x, i64 i0, int n, i64 N, double eps, const int centred, int group,
    scalar_t* gh, scalar_t* gl, acc_t* gr) {
    FN(group_stats_of)(x, i0, n, N, eps, centred, group, ROW_SCALAR, gh, gl, gr);
}

/* Σ g and Σ g·x̂ over one row of the given kind (g = dy ⊙ w, x̂ = (x − m)·r); with fwa/fba, also
   adds the row's dy ⊙ x̂ and dy to the weight/bias accumulators in the same sweep. The half
   kernels' backwards read their rows where they lie through it (ROW_BF16, ROW_F16). */
static inline __attribute__((always_inline)) void FN(row_grad_sums_of)(
    const void* dyr, const void* xr, const scalar_t* restrict w, scalar_t m, scalar_t r, i64 N,
    scalar_t* restrict fwa, scalar_t* restrict fba, acc_t* sg, acc_t* sgx, const int kind) {
    const i64 nfull = N - N % LANES;
    FN(lanes) sa = {{0}, {0}}, sb = {{0}, {0}};
    for (i64 j = 0; j < nfull;) {
        const i64 end = block_end(j, BLOCK, nfull);
        FN(vec) g0 = {0}, g1 = {0}, gx0 = {0}, gx1 = {0};
        for (; j < end; j += LANES)
            for (i64 h = 0; h < LANES; h += VL) {
                const FN(vec) d = FN(ld_kind)(dyr, j + h, kind);
                const FN(vec) xh = (FN(ld_kind)(xr, j + h, kind) - m) * r;
                const FN(vec) g = d * FN(ld)(w + j + h);
                if (h == 0) {
                    g0 += g;
                    gx0 += g * xh;
                } else {
                    g1 += g;
                    gx1 += g * xh;
                }
                if (fwa) {
                    *(FN(vec)*)(fwa + j + h) += d * xh;
                    *(FN(vec)*)(fba + j + h) += d;
                }
            }
        FN(lanes_add)(g0, g1, &sa);
        FN(lanes_add)(gx0, gx1, &sb);
    }
    i64 tail = nfull;
    if (TAIL_VEC_LEFT(N, nfull)) { /* see TAIL_VECTOR_STEP */
        const i64 j = nfull;
        const FN(vec) d = FN(ld_kind)(dyr, j, kind);
        const FN(vec) xh = (FN(ld_kind)(xr, j, kind) - m) * r;
        const FN(vec) g = d * FN(ld)(w + j), zero = {0};
        FN(lanes_add)(g, zero, &sa);
        FN(lanes_add)(g * xh, zero, &sb);
        if (fwa) {
            *(FN(vec)*)(fwa + j) += d * xh;
            *(FN(vec)*)(fba + j) += d;
        }
        tail += VL;
    }
    acc_t tg = 0, tgx = 0;
    for (i64 j = tail; j < N; ++j) {
        const scalar_t d = FN(at_kind)(dyr, j, kind);
        const scalar_t xh = (FN(at_kind)(xr, j, kind) - m) * r, g = d * w[j];
        tg += g;
        tgx += (acc_t)g * xh;
        if (fwa) {
            fwa[j] += d * xh;
            fba[j] += d;
        }
    }
    *sg = tg + FN(lanes_fold)(sa);
    *sgx = tgx + FN(lanes_fold)(sb);
}

static void FN(row_grad_sums)(const scalar_t* restrict dyr, const scalar_t* restrict xr,
                              const scalar_t* restrict w, scalar_t m, scalar_t r, i64 N,
                              scalar_t* restrict fwa, scalar_t* restrict fba, acc_t* sg,
                              acc_t* sgx) {
    FN(row_grad_sums_of)(dyr, xr, w, m, r, N, fwa, fba, sg, sgx, ROW_SCALAR);
}

/* row_grad_sums for two rows at once, when dw/db are wanted: each accumulator element is loaded
   and stored once per pair of rows instead of once per row. Eight vectors of partial sums: with
   16 vector registers (AVX2, SSE) they are one vector per sum (PAIR_LANES = VL lanes) and blocks
   are half as long, so that each lane still adds BLOCK_TERMS terms before the float64 flush;
   two vectors per sum there spilled to the stack. */
#if VEC_REGISTERS >= 32
#define PAIR_V 2
#else
#define PAIR_V 1
#endif

static inline __attribute__((always_inline)) void FN(row_pair_grad_sums_of)(
    const void* dy0, const void* x0, const void* dy1, const void* x1, const scalar_t* restrict w,
    const scalar_t* m, const scalar_t* r, i64 N, scalar_t* restrict fwa, scalar_t* restrict fba,
    acc_t* sg, acc_t* sgx, const int kind) {
    const scalar_t m0 = m[0], r0 = r[0], m1 = m[1], r1 = r[1];
    const i64 step = PAIR_V * VL, nfull = N - N % step;
    FN(lanes) a0 = {{0}, {0}}, b0 = {{0}, {0}}, a1 = {{0}, {0}}, b1 = {{0}, {0}};
    for (i64 j = 0; j < nfull;) {
        const i64 end = block_end(j, BLOCK_TERMS * step, nfull);
        FN(vec) pg0[PAIR_V] = {{0}}, pgx0[PAIR_V] = {{0}}, pg1[PAIR_V] = {{0}};
        FN(vec) pgx1[PAIR_V] = {{0}};
        for (; j < end; j += step)
            for (int v = 0; v < PAIR_V; ++v) {
                const i64 k = j + v * VL;
                const FN(vec) d0 = FN(ld_kind)(dy0, k, kind);
                const FN(vec) xh0 = (FN(ld_kind)(x0, k, kind) - m0) * r0;
                const FN(vec) d1 = FN(ld_kind)(dy1, k, kind);
                const FN(vec) xh1 = (FN(ld_kind)(x1, k, kind) - m1) * r1;
                const FN(vec) wk = FN(ld)(w + k), g0 = d0 * wk, g1 = d1 * wk;
                pg0[v] += g0;
                pgx0[v] += g0 * xh0;
                pg1[v] += g1;
                pgx1[v] += g1 * xh1;
                *(FN(vec)*)(fwa + k) += d0 * xh0 + d1 * xh1;
                *(FN(vec)*)(fba + k) += d0 + d1;
            }
        const FN(vec) zero = {0};
        FN(lanes_add)(pg0[0], PAIR_V > 1 ? pg0[PAIR_V - 1] : zero, &a0);
        FN(lanes_add)(pgx0[0], PAIR_V > 1 ? pgx0[PAIR_V - 1] : zero, &b0);
        FN(lanes_add)(pg1[0], PAIR_V > 1 ? pg1[PAIR_V - 1] : zero, &a1);
        FN(lanes_add)(pgx1[0], PAIR_V > 1 ? pgx1[PAIR_V - 1] : zero, &b1);
    }
    i64 tail = nfull;
    /* TAIL_VECTOR_STEP (steps of two vectors only) */
    if (PAIR_V > 1 && TAIL_VEC_LEFT(N, tail)) {
        const i64 k = tail;
        const FN(vec) d0 = FN(ld_kind)(dy0, k, kind);
        const FN(vec) xh0 = (FN(ld_kind)(x0, k, kind) - m0) * r0;
        const FN(vec) d1 = FN(ld_kind)(dy1, k, kind);
        const FN(vec) xh1 = (FN(ld_kind)(x1, k, kind) - m1) * r1;
        const FN(vec) wk = FN(ld)(w + k), g0 = d0 * wk, g1 = d1 * wk, zero = {0};
        FN(lanes_add)(g0, zero, &a0);
        FN(lanes_add)(g0 * xh0, zero, &b0);
        FN(lanes_add)(g1, zero, &a1);
        FN(lanes_add)(g1 * xh1, zero, &b1);
        *(FN(vec)*)(fwa + k) += d0 * xh0 + d1 * xh1;
        *(FN(vec)*)(fba + k) += d0 + d1;
        tail += VL;
    }
    acc_t tg0 = 0, tgx0 = 0, tg1 = 0, tgx1 = 0;
    for (i64 j = tail; j < N; ++j) {
        const scalar_t d0 = FN(at_kind)(dy0, j, kind), g0 = d0 * w[j];
        const scalar_t xh0 = (FN(at_kind)(x0, j, kind) - m0) * r0;
        const scalar_t d1 = FN(at_kind)(dy1, j, kind), g1 = d1 * w[j];
        const scalar_t xh1 = (FN(at_kind)(x1, j, kind) - m1) * r1;
        tg0 += g0;
        tgx0 += (acc_t)g0 * xh0;
        tg1 += g1;
        tgx1 += (acc_t)g1 * xh1;
        fwa[j] += d0 * xh0 + d1 * xh1;
        fba[j] += d0 + d1;
    }
    sg[0] = tg0 + FN(lanes_fold)(a0);
    sgx[0] = tgx0 + FN(lanes_fold)(b0);
    sg[1] = tg1 + FN(lanes_fold)(a1);
    sgx[1] = tgx1 + FN(lanes_fold)(b1);
}

static void FN(row_pair_grad_sums)(const scalar_t* restrict dy0, const scalar_t* restrict x0,
                                   const scalar_t* restrict dy1, const scalar_t* restrict x1,
                                   const scalar_t* restrict w, const scalar_t* m,
                                   const scalar_t* r, i64 N, scalar_t* restrict fwa,
                                   scalar_t* restrict fba, acc_t* sg, acc_t* sgx) {
    FN(row_pair_grad_sums_of)(dy0, x0, dy1, x1, w, m, r, N, fwa, fba, sg, sgx, ROW_SCALAR);
}
#undef PAIR_V

/* ------------------------------------------------------------------ layer norm forward ---- */

/* The row PF_ROWS after row i of a (·, N) tensor at p, within rows [.., hi); NULL past hi
   (-DPF_ROWS=n for A/B: 4 and 8 rows ahead measured level with 2, within ±5% but for one
   forward, at widths 48-1023, AMD EPYC Zen 3, one and two threads). */
#ifndef PF_ROWS
#define PF_ROWS 2
#endif
static inline const scalar_t* FN(ahead)(const scalar_t* p, i64 i, i64 hi, i64 N) {
    return i + PF_ROWS < hi ? p + (i + PF_ROWS) * N : NULL;
}

/* Rows [lo, hi) of a forward whose args `a` have x, N, eps and stream, in groups (FN(row_group)):
   each group's statistics (group_stats; `centred`: μ too, else RMSNorm's), then per row i the
   statement(s) after `centred`, with xr (the row), mh and ml (μ as hi + lo, 0 where not
   centred), rf (rstd) and pf (the row to prefetch while streaming: FN(ahead)) in scope; the
   streamed stores ordered at the end. */
#define FORWARD_ROWS_IN_GROUPS(a, lo, hi, centred, ...)                                          \
    do {                                                                                        \
        const int group_ = FN(row_group)((a)->N);                                               \
        for (i64 i0_ = (lo); i0_ < (hi); i0_ += group_) {                                       \
            const int n_ = (hi) - i0_ < group_ ? (int)((hi) - i0_) : group_;                     \
            scalar_t gh_[ROW_GROUP], gl_[ROW_GROUP];                                            \
            acc_t gr_[ROW_GROUP];                                                               \
            FN(group_stats)((a)->x, i0_, n_, (a)->N, (a)->eps, (centred), group_, gh_, gl_,     \
                            gr_);                                                               \
            for (int k_ = 0; k_ < n_; ++k_) {                                                   \
                const i64 i = i0_ + k_;                                                         \
                const scalar_t* restrict xr = (a)->x + i * (a)->N;                              \
                const scalar_t mh = gh_[k_], ml = gl_[k_], rf = (scalar_t)gr_[k_];              \
                const scalar_t* pf = (a)->stream ? FN(ahead)((a)->x, i, (hi), (a)->N) : NULL;   \
                __VA_ARGS__                                                                     \
            }                                                                                   \
        }                                                                                       \
        stream_fence((a)->stream);                                                              \
    } while (0)

static void FN(ln_fwd_rows)(const FN(ln_fwd_args)* a, i64 lo, i64 hi) {
    const i64 N = a->N;
    const scalar_t* restrict w = a->weight;
    const scalar_t* restrict b = a->bias;
    const int st = a->stream;
    FORWARD_ROWS_IN_GROUPS(a, lo, hi, 1, {
        scalar_t* restrict yr = a->y + i * N;
        a->mean[i] = mh;
        a->rstd[i] = rf;
        if (w && b) ROW_OUT(yr, N, st, pf, NULL, LN_Y_WB);
        else if (w) ROW_OUT(yr, N, st, pf, NULL, LN_Y_W);
        else if (b) ROW_OUT(yr, N, st, pf, NULL, LN_Y_B);
        else ROW_OUT(yr, N, st, pf, NULL, LN_XHAT);
    });
}

int FN(ln_fwd)(const FN(ln_fwd_args)* a) {
    if (a->threads <= 1) {
        FN(ln_fwd_rows)(a, 0, a->M);
        return 0;
    }
    #pragma omp parallel num_threads(a->threads)
    {
        i64 lo, hi;
        row_block(a->M, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        FN(ln_fwd_rows)(a, lo, hi);
    }
    return 0;
}

/* ------------------------------------------------------------------ shared backward ------- */

/* What the layer-norm and RMSNorm backwards share. mean = NULL means μ = 0 (RMSNorm, whose
   detach_mean is then 1: there is no mean term); w is never NULL (ones stand in); dx may be NULL;
   fwa/fba (per-row-block sums in scalar_t) and dwa/dba (float64) are all NULL or all set. */
typedef struct {
    const scalar_t* dy;
    const scalar_t* x;
    const scalar_t* mean;
    const scalar_t* rstd;
    const scalar_t* w;
    scalar_t* dx;
    scalar_t* dw;
    scalar_t* db;
    i64 M, N;
    int detach_mean, detach_std, threads, stream;
} FN(bwd_job);

/* dw/db: the rows summed in fwa/fba (scalar_t) moved into the float64 sums dwa/dba, fwa/fba
   zeroed. */
static inline void FN(flush_sums)(acc_t* restrict dwa, acc_t* restrict dba,
                                  scalar_t* restrict fwa, scalar_t* restrict fba, i64 N) {
    #pragma omp simd
    for (i64 j = 0; j < N; ++j) {
        dwa[j] += fwa[j];
        dba[j] += fba[j];
        fwa[j] = 0;
        fba[j] = 0;
    }
}

/* Rows [lo, hi). The first sweep reads dy and x from memory; the second, which writes dx, finds
   them in cache. *pending counts the rows added to fwa/fba since their last float64 flush, which
   happens every FLUSH rows and, with `last`, at hi: the half kernels hand their rows over a
   block at a time and flush at the end of their range only, so that a block of a few rows (to
   stay in cache) costs no flush of N float64 sums each. */
static void FN(bwd_rows)(const FN(bwd_job)* jb, acc_t* restrict dwa, acc_t* restrict dba,
                         scalar_t* restrict fwa, scalar_t* restrict fba, i64 lo, i64 hi,
                         int* pending_rows, int last) {
    const i64 N = jb->N;
    const scalar_t* restrict w = jb->w;
    scalar_t* restrict dx = jb->dx;
    const int need_sums = dx && !(jb->detach_mean && jb->detach_std);
    const acc_t inv_n = ROW_INV_N(N);
    int pending = *pending_rows;
    for (i64 i = lo; i < hi;) {
        const int rows = (dwa && paired_rows(N) && i + 1 < hi) ? 2 : 1;
        scalar_t m[2], r[2];
        acc_t sg[2] = {0, 0}, sgx[2] = {0, 0};
        for (int k = 0; k < rows; ++k) {
            m[k] = jb->mean ? jb->mean[i + k] : 0;
            r[k] = jb->rstd[i + k];
        }
        const scalar_t *dy0 = jb->dy + i * N, *x0 = jb->x + i * N;
        if (rows == 2)
            FN(row_pair_grad_sums)(dy0, x0, dy0 + N, x0 + N, w, m, r, N, fwa, fba, sg, sgx);
        else if (need_sums || dwa)
            FN(row_grad_sums)(dy0, x0, w, m[0], r[0], N, fwa, fba, sg, sgx);
        pending += rows;
        /* dw/db: FLUSH rows summed in the input precision, then moved into float64 (a float64
           add per element and row would cost as much as the rest of the sweep). */
        if (dwa && (pending >= FLUSH || (last && i + rows == hi))) {
            FN(flush_sums)(dwa, dba, fwa, fba, N);
            pending = 0;
        }
        for (int k = 0; dx && k < rows; ++k) {
            const scalar_t* restrict dyr = dy0 + k * N;
            const scalar_t* restrict xr = x0 + k * N;
            scalar_t* restrict dxr = dx + (i + k) * N;
            const scalar_t c1 = jb->detach_mean ? 0 : (scalar_t)(sg[k] * inv_n);
            const scalar_t c2 = jb->detach_std ? 0 : (scalar_t)(sgx[k] * inv_n);
            const scalar_t mf = m[k], rf = r[k];
            const scalar_t* pdy = jb->stream ? FN(ahead)(jb->dy, i + k, hi, N) : NULL;
            const scalar_t* px = jb->stream ? FN(ahead)(jb->x, i + k, hi, N) : NULL;
            ROW_OUT(dxr, N, jb->stream, pdy, px, LN_DX);
        }
        i += rows;
    }
    *pending_rows = pending;
    stream_fence(jb->stream);
}

static int FN(bwd_run)(FN(bwd_job)* jb) {
    const i64 N = jb->N;
    const int nt = jb->threads < 1 ? 1 : jb->threads;
    if (!jb->w && !(jb->w = FN(ones)(N))) return 1;
    /* Per thread: float64 dw/db sums, then blocks of rows in the input precision. Both always
       accumulate together: one loop form, and db costs one add. */
    grad_sums gs = {NULL, NULL, NULL, NULL, 0};
    if ((jb->dw || jb->db) && grad_sums_alloc(&gs, nt, N, sizeof(scalar_t))) return 2;
    if (nt == 1) {
        int pending = 0;
        const grad_slice g = grad_sums_slice(&gs, 0, sizeof(scalar_t));
        FN(bwd_rows)(jb, g.dwa, g.dba, g.fwa, g.fba, 0, jb->M, &pending, 1);
    } else {
        #pragma omp parallel num_threads(nt)
        {
            const i64 t = omp_get_thread_num();
            i64 lo, hi;
            int pending = 0;
            row_block(jb->M, omp_get_num_threads(), (int)t, &lo, &hi);
            const grad_slice g = grad_sums_slice(&gs, t, sizeof(scalar_t));
            FN(bwd_rows)(jb, g.dwa, g.dba, g.fwa, g.fba, lo, hi, &pending, 1);
        }
    }
    if (jb->dw) {
        reduce_buffers(gs.dwa, nt, N, gs.stride);
        for (i64 j = 0; j < N; ++j) jb->dw[j] = (scalar_t)gs.dwa[j];
    }
    if (jb->db) {
        reduce_buffers(gs.dba, nt, N, gs.stride);
        for (i64 j = 0; j < N; ++j) jb->db[j] = (scalar_t)gs.dba[j];
    }
    return 0;
}

int FN(ln_bwd)(const FN(ln_bwd_args)* a) {
    FN(bwd_job) jb = {a->dy, a->x, a->mean, a->rstd, a->weight, a->dx, a->dweight, a->dbias,
                      a->M, a->N, a->detach_mean, a->detach_std, a->threads, a->stream};
    return FN(bwd_run)(&jb);
}

/* ------------------------------------------------------------------------ RMSNorm -------- */

static void FN(rms_fwd_rows)(const FN(rms_fwd_args)* a, i64 lo, i64 hi) {
    const i64 N = a->N;
    const scalar_t* restrict w = a->weight;
    const int st = a->stream;
    FORWARD_ROWS_IN_GROUPS(a, lo, hi, 0, {
        scalar_t* restrict yr = a->y + i * N;
        (void)mh, (void)ml;
        a->rstd[i] = rf;
        if (w) ROW_OUT(yr, N, st, pf, NULL, RMS_Y_W);
        else ROW_OUT(yr, N, st, pf, NULL, RMS_Y);
    });
}

int FN(rms_fwd)(const FN(rms_fwd_args)* a) {
    if (a->threads <= 1) {
        FN(rms_fwd_rows)(a, 0, a->M);
        return 0;
    }
    #pragma omp parallel num_threads(a->threads)
    {
        i64 lo, hi;
        row_block(a->M, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        FN(rms_fwd_rows)(a, lo, hi);
    }
    return 0;
}

/* RMSNorm's backward is the layer-norm one with μ = 0 and no mean term (μ is not a variable). */
int FN(rms_bwd)(const FN(rms_bwd_args)* a) {
    FN(bwd_job) jb = {a->dy, a->x, NULL, a->rstd, a->weight, a->dx, a->dweight, NULL,
                      a->M, a->N, 1, 0, a->threads, a->stream};
    return FN(bwd_run)(&jb);
}

/* ------------------------------------------------------------------------ AdaNorm -------- */

static void FN(ada_fwd_rows)(const FN(ada_fwd_args)* a, i64 lo, i64 hi) {
    const i64 N = a->N;
    const scalar_t c = (scalar_t)a->scale, ck = (scalar_t)(a->scale * a->k);
    const int st = a->stream;
    FORWARD_ROWS_IN_GROUPS(a, lo, hi, 1, {
        scalar_t* restrict zr = a->z + i * N;
        a->mean[i] = mh;
        a->rstd[i] = rf;
        ROW_OUT(zr, N, st, pf, NULL, ADA_Z);
    });
}

int FN(ada_fwd)(const FN(ada_fwd_args)* a) {
    if (a->threads <= 1) {
        FN(ada_fwd_rows)(a, 0, a->M);
        return 0;
    }
    #pragma omp parallel num_threads(a->threads)
    {
        i64 lo, hi;
        row_block(a->M, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        FN(ada_fwd_rows)(a, lo, hi);
    }
    return 0;
}

static void FN(ada_bwd_rows)(const FN(ada_bwd_args)* a, i64 lo, i64 hi) {
    const i64 N = a->N, nfull = N - N % LANES;
    const scalar_t c = (scalar_t)a->scale, ck = (scalar_t)(a->scale * a->k);
    const acc_t inv_n = ROW_INV_N(N);
    const int tail_vec = TAIL_VEC_LEFT(N, nfull);
    const i64 tail = tail_vec ? nfull + VL : nfull;
    for (i64 i = lo; i < hi; ++i) {
        const scalar_t* restrict dzr = a->dz + i * N;
        const scalar_t* restrict xr = a->x + i * N;
        scalar_t* restrict dxr = a->dx + i * N;
        const scalar_t m = a->mean[i], r = a->rstd[i];
        FN(lanes) sa = {{0}, {0}}, sb = {{0}, {0}};
        for (i64 j = 0; j < nfull;) {
            const i64 end = block_end(j, BLOCK, nfull);
            FN(vec) pd[2] = {{0}}, pdy[2] = {{0}};
            for (; j < end; j += LANES)
                for (int v = 0; v < 2; ++v) {
                    const FN(vec) yv = (FN(ld)(xr + j + v * VL) - m) * r;
                    const FN(vec) d = FN(ld)(dzr + j + v * VL) * (c - ck * yv); /* φ(y) constant */
                    pd[v] += d;
                    pdy[v] += d * yv;
                }
            FN(lanes_add)(pd[0], pd[1], &sa);
            FN(lanes_add)(pdy[0], pdy[1], &sb);
        }
        if (tail_vec) { /* see TAIL_VECTOR_STEP */
            const FN(vec) yv = (FN(ld)(xr + nfull) - m) * r, zero = {0};
            const FN(vec) d = FN(ld)(dzr + nfull) * (c - ck * yv);
            FN(lanes_add)(d, zero, &sa);
            FN(lanes_add)(d * yv, zero, &sb);
        }
        acc_t sd = 0, sdy = 0;
        for (i64 j = tail; j < N; ++j) {
            const scalar_t yv = (xr[j] - m) * r;
            const scalar_t d = dzr[j] * (c - ck * yv);
            sd += d;
            sdy += (acc_t)d * yv;
        }
        const scalar_t c1 = (scalar_t)((sd + FN(lanes_fold)(sa)) * inv_n);
        const scalar_t c2 = (scalar_t)((sdy + FN(lanes_fold)(sb)) * inv_n);
        const scalar_t* pdz = a->stream ? FN(ahead)(a->dz, i, hi, N) : NULL;
        const scalar_t* px = a->stream ? FN(ahead)(a->x, i, hi, N) : NULL;
#define YV(L) ((L(xr) - m) * r)
#define D(L) (L(dzr) * (c - ck * YV(L)))
#define DX(L) (r * (D(L) - c1 - YV(L) * c2))
        ROW_OUT(dxr, N, a->stream, pdz, px, DX);
#undef YV
#undef D
#undef DX
    }
    stream_fence(a->stream);
}

int FN(ada_bwd)(const FN(ada_bwd_args)* a) {
    if (a->threads <= 1) {
        FN(ada_bwd_rows)(a, 0, a->M);
        return 0;
    }
    #pragma omp parallel num_threads(a->threads)
    {
        i64 lo, hi;
        row_block(a->M, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        FN(ada_bwd_rows)(a, lo, hi);
    }
    return 0;
}

#undef LOAD_ONE
#undef LOAD_VEC
#undef ROW_OUT
#undef PF_ROWS
#undef FORWARD_ROWS_IN_GROUPS
#undef TAIL_VEC_LEFT
#undef VL
#undef LANES
#undef HALF
#undef BLOCK
#undef FN
