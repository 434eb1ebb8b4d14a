/* The LN-LSTM, LN-GRU and LN-RNN (Elman) time-step kernels over one scalar type: included by
   rnn_step.c with scalar_t (float or double), SUF (f32 or f64), EXP and TANH defined; every
   external name ends in _SUF. Argument structs and prototypes come from layernorm_rnn_abi.h
   (from rnn_abi.py).

   One call does a step's work after the recurrent GEMM, for every row of the step, in one pass per
   row: the layer norm of hp = W_hh h_{t−1} (statistics in float64), the gates, the state update,
   the layer norm of c_t, and the stores backward needs. The backward call does the step's
   pointwise backward including the layer norms' dx. Rows are independent, so they are split
   across `threads` OpenMP threads.

   The optional masks (NULL = off; layernorm.recurrent._options) act inside the step: zoneout
   zh / zc mixes the previous state into the new one, h_t = zh·h_{t−1} + (1 − zh)·h̃_t (h̃_t, c̃_t
   the cell's own, which is what acts / tc / n keep for backward); recurrent dropout cm scales the
   candidate (row i of the state, as h). Backward splits the zoned state's gradient the same way:
   (1 − zh)·dh_t reaches the cell, zh·dh_t goes straight to h_{t−1}. Each row function is
   compiled once per set of masks given (`masks`, a constant bit set per instance): the branches
   on absent masks fold away and the loops vectorize, without masks as before they existed. */

#ifndef RNN_MASK_SWITCH_3
#define MASK_ZH 1
#define MASK_ZC 2
#define MASK_CM 4
/* Call body(A, ..., masks) with masks the constant bit set of the masks A gives. */
#define RNN_MASK_SWITCH_2(body, A, ...)                                    \
    switch (((A)->zh ? MASK_ZH : 0) | ((A)->cm ? MASK_CM : 0)) {           \
    case 0: body(A, __VA_ARGS__, 0); break;                                \
    case MASK_ZH: body(A, __VA_ARGS__, MASK_ZH); break;                    \
    case MASK_CM: body(A, __VA_ARGS__, MASK_CM); break;                    \
    default: body(A, __VA_ARGS__, MASK_ZH | MASK_CM); break;               \
    }
#define RNN_MASK_SWITCH_3(body, A, ...)                                                   \
    switch (((A)->zh ? MASK_ZH : 0) | ((A)->zc ? MASK_ZC : 0) | ((A)->cm ? MASK_CM : 0)) { \
    case 0: body(A, __VA_ARGS__, 0); break;                                               \
    case 1: body(A, __VA_ARGS__, 1); break;                                               \
    case 2: body(A, __VA_ARGS__, 2); break;                                               \
    case 3: body(A, __VA_ARGS__, 3); break;                                               \
    case 4: body(A, __VA_ARGS__, 4); break;                                               \
    case 5: body(A, __VA_ARGS__, 5); break;                                               \
    case 6: body(A, __VA_ARGS__, 6); break;                                               \
    default: body(A, __VA_ARGS__, 7); break;                                              \
    }
#endif

/*

   Per row, layer-norm dx with x̂ = (x − μ)·rstd and g = dy ⊙ w:
   dx = rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂)). */

#define FN(name) RNN_CAT(name, SUF)

/* The rows of a step kernel's struct `a`, ROW a statement over row i: in this thread without an
   OpenMP region where a->threads <= 1 (even a serial region costs a call per step), else split
   over a->threads threads; then the kernel returns 0. */
#ifndef STEP_ROWS
#define STEP_ROWS(ROW)                                                      \
    do {                                                                    \
        if (a->threads <= 1) {                                              \
            for (i64 i = 0; i < a->rows; ++i) ROW;                          \
            return 0;                                                       \
        }                                                                   \
        _Pragma("omp parallel for num_threads(a->threads) schedule(static)") \
        for (i64 i = 0; i < a->rows; ++i) ROW;                              \
        return 0;                                                           \
    } while (0)
#endif

/* Row sums as the norm kernels take them (norms_common.h): two vectors of partial sums in
   scalar_t, each lane adding BLOCK_TERMS (cpu_common.h) terms before the block's lanes go into
   float64 partial sums. A row of a step is short (G = 4H, H), so a sum in float64 throughout (a
   conversion and a half-width add per element) was half of the step kernel's layer-norm time.
   Unlike the norm kernels', a row's last N mod 2·SVL elements join the lanes too (sld_tail), so
   the same bits as theirs where a row is whole pairs of vectors. */
typedef scalar_t FN(svec) __attribute__((vector_size(VEC_BYTES), aligned(sizeof(scalar_t)),
                                         may_alias));
#define SVL ((i64)(VEC_BYTES / sizeof(scalar_t)))

static inline __attribute__((always_inline)) FN(svec) FN(sld)(const scalar_t* p) {
    return *(const FN(svec)*)p;
}

/* A row's float64 partial sums in registers (FN(lanes), FN(lanes_add), FN(lanes_fold)), as the
   norm kernels keep theirs. */
#define ROW_VEC FN(svec)
#include "row_lanes.h"
#undef ROW_VEC

/* row[j, N) in the first lanes of a vector (at most SVL of them) and `fill` in the others,
   reading nothing past row + N and forming no pointer past it (j >= N: every lane fill). A
   row's last N mod 2·SVL elements are one more pair of vectors of its sums this way, their
   other lanes filled so that they add zeros (x − c with fill c, dy with fill 0), where a scalar
   loop once added them one after another in float64, each add waiting on the last: a row of 16
   (the LN-LSTM's c_t at H = 16) was all tail, ~30 of 166 ns a row of its forward step,
   H = 100's rows of 400 and 100 had tails of 16 and 4 (AVX-512). The masked loads (AVX-512,
   AVX2) touch no memory past the row. */
static inline __attribute__((always_inline)) FN(svec) FN(sld_tail)(const scalar_t* row, i64 j,
                                                                  i64 N, scalar_t fill) {
    const i64 t = N - j;
    if (t <= 0) {
        FN(svec) all = {0};
        return all + fill;
    }
    const scalar_t* p = row + j;
    if (t >= SVL) return FN(sld)(p);
    FN(svec) v;
#if defined(__AVX512F__) && VEC_BYTES == 64
    if (sizeof(scalar_t) == 4) {
        const __mmask16 m = (__mmask16)((1u << t) - 1);
        const __m512 r = _mm512_mask_loadu_ps(_mm512_set1_ps((float)fill), m, (const void*)p);
        memcpy(&v, &r, sizeof v);
    } else {
        const __mmask8 m = (__mmask8)((1u << t) - 1);
        const __m512d r = _mm512_mask_loadu_pd(_mm512_set1_pd((double)fill), m, (const void*)p);
        memcpy(&v, &r, sizeof v);
    }
#elif defined(__AVX2__) && VEC_BYTES == 32
    if (sizeof(scalar_t) == 4) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)t),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 r = _mm256_blendv_ps(_mm256_set1_ps((float)fill),
                                          _mm256_maskload_ps((const float*)(const void*)p, m),
                                          _mm256_castsi256_ps(m));
        memcpy(&v, &r, sizeof v);
    } else {
        const __m256i m = _mm256_cmpgt_epi64(_mm256_set1_epi64x(t),
                                             _mm256_setr_epi64x(0, 1, 2, 3));
        const __m256d r = _mm256_blendv_pd(_mm256_set1_pd((double)fill),
                                           _mm256_maskload_pd((const double*)(const void*)p, m),
                                           _mm256_castsi256_pd(m));
        memcpy(&v, &r, sizeof v);
    }
#else
    for (i64 l = 0; l < SVL; ++l) v[l] = l < t ? p[l] : fill;
#endif
    return v;
}

/* The end of a row of N elements as its sums take it: its whole pairs of vectors, then, where
   N mod 2·SVL elements are left, one pair more (sld_tail). Its blocks (block_end) are at most
   BLOCK_TERMS pairs, so that each lane adds at most BLOCK_TERMS terms before the float64 partial
   sums take them (cpu_common.h), the tail's included. */
static inline i64 FN(padded)(i64 N) { return (N + 2 * SVL - 1) / (2 * SVL) * (2 * SVL); }

/* p0 += u, p1 += v (with sq, their squares). */
static inline __attribute__((always_inline)) void FN(pair_terms)(FN(svec) u, FN(svec) v, int sq,
                                                                 FN(svec) * p0, FN(svec) * p1) {
    if (sq) {
        *p0 += u * u;
        *p1 += v * v;
    } else {
        *p0 += u;
        *p1 += v;
    }
}

/* acc += the sums of (x − c) (with sq, (x − c)²) over the block [j, end) of a row of N elements
   (end <= padded(N)), each lane adding in scalar_t. */
static inline __attribute__((always_inline)) void FN(block_sums)(const scalar_t* x, i64 j, i64 end,
                                                                 i64 N, scalar_t c, int sq,
                                                                 FN(lanes) * acc) {
    const i64 full = N - N % (2 * SVL), whole = end < full ? end : full;
    FN(svec) p0 = {0}, p1 = {0};
    for (; j < whole; j += 2 * SVL)
        FN(pair_terms)(FN(sld)(x + j) - c, FN(sld)(x + j + SVL) - c, sq, &p0, &p1);
    if (j < end) /* the row's tail: the lanes past N are c, adding zeros */
        FN(pair_terms)(FN(sld_tail)(x, j, N, c) - c, FN(sld_tail)(x, j + SVL, N, c) - c, sq,
                       &p0, &p1);
    FN(lanes_add)(p0, p1, acc);
}

/* Σ (x − c) and, with sq, Σ (x − c)² over a row, blocked as above. A row of one block (up to
   BLOCK_TERMS · 2·SVL elements: every LN-LSTM row up to H = 128 with AVX-512) skips the blocks'
   bookkeeping. */
static inline acc_t FN(row_sum)(const scalar_t* x, i64 N, scalar_t c, int sq) {
    const i64 step = 2 * SVL, npad = FN(padded)(N);
    FN(lanes) acc = {{0}, {0}};
    if (npad <= BLOCK_TERMS * step) {
        FN(block_sums)(x, 0, npad, N, c, sq, &acc);
    } else {
        for (i64 j = 0; j < npad; j += BLOCK_TERMS * step)
            FN(block_sums)(x, j, block_end(j, BLOCK_TERMS * step, npad), N, c, sq, &acc);
    }
    return FN(lanes_fold)(acc);
}

/* The sums of n rows of one block each (N <= BLOCK_TERMS · 2·SVL) as row_sum finds them, out[k]
   for row k: each row's block sums into its float64 partial sums (lanes_add, from zero) and
   their two halves added (lanes_fold's first level), then lanes_fold's other levels (lane l plus
   lane l + w, w halving to 1) for ROW_HL rows at once, two vectors of rows a level, where
   lanes_fold takes a shuffle and an add a level for each row, on its row's dependency chain. The
   same adds of the same values: the same bits. An LN-LSTM forward step with gx normalized in it,
   128 rows in cache, one thread, Intel Xeon (bench_rnn_step.py --input-norm, seven runs): H = 32
   1-6% less time, H = 64 0-5% less, H = 128 level; the AVX2 build level to 6% less; inference at
   (T, B, I, H) = (100, 64, 32, 32) 1.27-1.34 / 1.12-1.28x torch.nn.LSTM's time (RESULTS.md,
   2026-11-29). */
#ifndef MOMENT_ROWS
#define MOMENT_ROWS 16 /* twice FWD_GROUP_MAX: a forward group's hp and gx rows in one call */
#endif
#define ROW_HL (STEP_LANES / 2) /* a row's float64 partial sums: lanes of FN(avec) */
_Static_assert(sizeof(FN(avec)) == ROW_HL * sizeof(acc_t), "STEP_LANES: scalar_t's lanes a vector");
#if ROW_HL == 8
#define FOLD_LEVEL(u, v, w)                                                                       \
    ((w) == 4   ? __builtin_shufflevector(u, v, 0, 1, 2, 3, 8, 9, 10, 11) +                      \
                      __builtin_shufflevector(u, v, 4, 5, 6, 7, 12, 13, 14, 15)                  \
     : (w) == 2 ? __builtin_shufflevector(u, v, 0, 1, 4, 5, 8, 9, 12, 13) +                      \
                      __builtin_shufflevector(u, v, 2, 3, 6, 7, 10, 11, 14, 15)                  \
                : __builtin_shufflevector(u, v, 0, 2, 4, 6, 8, 10, 12, 14) +                     \
                      __builtin_shufflevector(u, v, 1, 3, 5, 7, 9, 11, 13, 15))
#elif ROW_HL == 4
#define FOLD_LEVEL(u, v, w)                                                                       \
    ((w) == 2 ? __builtin_shufflevector(u, v, 0, 1, 4, 5) + __builtin_shufflevector(u, v, 2, 3, 6, 7) \
              : __builtin_shufflevector(u, v, 0, 2, 4, 6) + __builtin_shufflevector(u, v, 1, 3, 5, 7))
#elif ROW_HL == 2
#define FOLD_LEVEL(u, v, w) (__builtin_shufflevector(u, v, 0, 2) + __builtin_shufflevector(u, v, 1, 3))
#endif

/* Rows [0, n) of v (each a row's partial sums, halves added), n <= MOMENT_ROWS, folded into
   out[0, n): ROW_HL rows a vector after the levels (rows past n: zeros, their sums unused). */
static inline __attribute__((always_inline)) void FN(fold_rows)(const FN(avec) * v, int n,
                                                               acc_t* out) {
#if ROW_HL == 1
    for (int k = 0; k < n; ++k) out[k] = v[k][0];
#else
    FN(avec) lv[MOMENT_ROWS];
    const int m = (n + ROW_HL - 1) / ROW_HL * ROW_HL; /* whole vectors of rows */
    for (int k = 0; k < m; ++k) lv[k] = k < n ? v[k] : (FN(avec)){0};
#define FOLD_PASS(w, stride) \
    for (int k = 0; k + (stride) < m; k += 2 * (stride)) lv[k] = FOLD_LEVEL(lv[k], lv[k + (stride)], w);
#if ROW_HL == 8
    FOLD_PASS(4, 1) FOLD_PASS(2, 2) FOLD_PASS(1, 4)
#elif ROW_HL == 4
    FOLD_PASS(2, 1) FOLD_PASS(1, 2)
#else
    FOLD_PASS(1, 1)
#endif
#undef FOLD_PASS
    for (int q = 0; q < m; q += ROW_HL) memcpy(out + q, &lv[q], sizeof(FN(avec)));
#endif
}

/* Σ (x − c[k]) (with sq, Σ (x − c[k])²) of each of n rows x[k] of N elements, as row_sum finds
   them: rows of one block folded together (fold_rows), one row or longer rows each by row_sum. */
static inline __attribute__((always_inline)) void FN(sum_rows)(const scalar_t* const* x, int n,
                                                              i64 N, const scalar_t* c, int sq,
                                                              acc_t* out) {
    const i64 npad = FN(padded)(N);
    if (n == 1 || npad > BLOCK_TERMS * 2 * SVL) {
        for (int k = 0; k < n; ++k) out[k] = FN(row_sum)(x[k], N, c[k], sq);
        return;
    }
    FN(avec) v[MOMENT_ROWS];
    for (int k = 0; k < n; ++k) {
        FN(lanes) acc = {{0}, {0}};
        FN(block_sums)(x[k], 0, npad, N, c[k], sq, &acc);
        v[k] = acc.lo + acc.hi;
    }
    FN(fold_rows)(v, n, out);
}
#undef FOLD_LEVEL
#undef ROW_HL

/* μ and 1/sqrt(var + eps) of n <= MOMENT_ROWS rows x[0..n) of N elements each, as the norm
   kernels find them: the first sweep sums x − x0 (x0 the row's first element: a constant row has
   μ = x0 exactly), the second (x − hi)² with hi = μ rounded to scalar_t, and
   var = Σ(x − hi)²/N − (μ − hi)². A row's statistics are a chain of dependent sums, divisions and
   a square root; the rows' sweeps run one after another in straight-line code, so that their
   chains overlap, and the divisions and square roots of all rows are one vector each (the
   unused lanes take neutral values). The same bits as one row at a time. With the registers
   above, a step's 64 rows in cache, ns a row, before / after (benchmarks/bench_rnn_step.py, one
   thread, AMD EPYC Zen 4; RESULTS.md 2026-11-27): raw gx normalized in the step, AVX-512
   H = 32 217 / 196, H = 128 522 / 501; the AVX2 build H = 32 243 / 208, H = 128 656 / 644. */
#ifndef MOMENT_LANES /* a build setting */
#define MOMENT_LANES 8 /* the lanes of a group of up to this many rows (more: MOMENT_ROWS) */
#endif
static inline __attribute__((always_inline)) void FN(moments_group)(
    const scalar_t* const* x, int n, i64 N, double eps, acc_t* mu, acc_t* r, const int width) {
    const int lanes = n == 1 ? 1 : width; /* one row (a constant n): scalars */
    acc_t s[MOMENT_ROWS], v[MOMENT_ROWS], lo[MOMENT_ROWS];
    scalar_t x0[MOMENT_ROWS], hi[MOMENT_ROWS];
    for (int k = 0; k < lanes; ++k) s[k] = 0, v[k] = 0, x0[k] = 0;
    for (int k = 0; k < n; ++k) x0[k] = x[k][0];
    FN(sum_rows)(x, n, N, x0, 0, s);
    for (int k = 0; k < lanes; ++k) {
        s[k] = (acc_t)x0[k] + s[k] / (acc_t)N;
        hi[k] = (scalar_t)s[k];
        lo[k] = s[k] - (acc_t)hi[k];
    }
    FN(sum_rows)(x, n, N, hi, 1, v);
    for (int k = 0; k < lanes; ++k) {
        acc_t var = v[k] / (acc_t)N - lo[k] * lo[k];
        var = var < 0 ? 0 : var;
        v[k] = 1.0 / sqrt(var + eps);
    }
    for (int k = 0; k < n; ++k) {
        mu[k] = s[k];
        r[k] = v[k];
    }
}

/* The same for one row. */
static inline void FN(moments)(const scalar_t* x, i64 N, double eps, acc_t* mu, acc_t* r) {
    FN(moments_group)(&x, 1, N, eps, mu, r, 1);
}

/* The moments of n <= MOMENT_ROWS rows: as a group where a row is one block of the row sums,
   else one row at a time (rows of several blocks in groups: the AVX2 build's steps at H = 128
   and 256 took 1.04x as long as one row at a time, benchmarks/bench_rnn_step.py). */
static inline void FN(moments_rows)(const scalar_t* const* x, int n, i64 N, double eps, acc_t* mu,
                                    acc_t* r) {
    if (N <= BLOCK_TERMS * 2 * SVL) {
        if (n <= MOMENT_LANES)
            FN(moments_group)(x, n, N, eps, mu, r, MOMENT_LANES);
        else
            FN(moments_group)(x, n, N, eps, mu, r, MOMENT_ROWS);
        return;
    }
    for (int k = 0; k < n; ++k) FN(moments)(x[k], N, eps, &mu[k], &r[k]);
}

/* μ split as hi + lo in scalar_t, and rstd in scalar_t: the normalized value is then
   ((x − hi) − lo)·r, computed in scalar_t (x − hi is exact for x near μ). */
typedef struct {
    scalar_t hi, lo, r;
} FN(stats);

static inline FN(stats) FN(split)(acc_t m, acc_t r) {
    const scalar_t hi = (scalar_t)m;
    return (FN(stats)){hi, (scalar_t)(m - (acc_t)hi), (scalar_t)r};
}

/* One column's layer-norm gradient: rstd·(dy·w − cg − x̂·cgx), cg and cgx the row's two means. */
static inline __attribute__((always_inline)) scalar_t FN(ln_dx_at)(scalar_t d, scalar_t w,
                                                                   scalar_t xh, scalar_t rf,
                                                                   scalar_t cg, scalar_t cgx) {
    return rf * (d * w - cg - xh * cgx);
}

/* dx (=|+=) rstd·(g − cg − x̂·cgx) for accumulate (0|1); with sums, also sw += dy⊙x̂ and
   sb += dy (the gain's and bias's gradient terms of this row). Constant flags: each caller's
   loop is compiled for its own case (one pass, no reads of a dx that is not accumulated). */
static inline __attribute__((always_inline)) void FN(ln_dx_store)(
    const scalar_t* dy, const scalar_t* x, scalar_t mf, scalar_t rf, scalar_t cg, scalar_t cgx,
    const scalar_t* w, scalar_t* dx, i64 N, scalar_t* sw, scalar_t* sb, const int accumulate,
    const int sums) {
    #pragma omp simd
    for (i64 j = 0; j < N; ++j) {
        const scalar_t d = dy[j], xh = (x[j] - mf) * rf;
        const scalar_t v = FN(ln_dx_at)(d, w[j], xh, rf, cg, cgx);
        dx[j] = accumulate ? dx[j] + v : v;
        if (sums) {
            sw[j] += d * xh;
            sb[j] += d;
        }
    }
}

/* One step of a block of ln_dx's two sums at column j of a row of N (see padded), for the two
   vectors of dy there (d0, d1): g += dy⊙w, gx += dy⊙w⊙x̂, x̂ = (x − mf)·rf, in two accumulators
   each. At the row's tail (the constant flag tail: j + 2·SVL > N) the lanes past N read dy as 0
   (the caller's d0, d1, see dy_pair), w as 0 and x as mf: they add zeros. */
static inline __attribute__((always_inline)) void FN(ln_dx_terms)(
    FN(svec) d0, FN(svec) d1, const scalar_t* w, const scalar_t* x, scalar_t mf, scalar_t rf,
    i64 j, i64 N, const int tail, FN(svec) * g0, FN(svec) * g1, FN(svec) * gx0, FN(svec) * gx1) {
    const FN(svec) w0 = tail ? FN(sld_tail)(w, j, N, 0) : FN(sld)(w + j);
    const FN(svec) w1 = tail ? FN(sld_tail)(w, j + SVL, N, 0) : FN(sld)(w + j + SVL);
    const FN(svec) x0 = tail ? FN(sld_tail)(x, j, N, mf) : FN(sld)(x + j);
    const FN(svec) x1 = tail ? FN(sld_tail)(x, j + SVL, N, mf) : FN(sld)(x + j + SVL);
    const FN(svec) u = d0 * w0, v = d1 * w1;
    *g0 += u;
    *g1 += v;
    *gx0 += u * ((x0 - mf) * rf);
    *gx1 += v * ((x1 - mf) * rf);
}

/* dy's two vectors at column j of a row of N (with the constant flag tail, zeros past N: see
   ln_dx_terms). */
static inline __attribute__((always_inline)) void FN(dy_pair)(const scalar_t* dy, i64 j, i64 N,
                                                              const int tail, FN(svec) * d0,
                                                              FN(svec) * d1) {
    if (!tail) {
        *d0 = FN(sld)(dy + j);
        *d1 = FN(sld)(dy + j + SVL);
    } else {
        *d0 = FN(sld_tail)(dy, j, N, 0);
        *d1 = FN(sld_tail)(dy, j + SVL, N, 0);
    }
}

/* ln_dx's two means from the blocks' sums ag, agx. */
static inline __attribute__((always_inline)) void FN(ln_dx_means)(i64 N, FN(lanes) ag,
                                                                 FN(lanes) agx, scalar_t* cg,
                                                                 scalar_t* cgx) {
    *cg = (scalar_t)(FN(lanes_fold)(ag) / N);
    *cgx = (scalar_t)(FN(lanes_fold)(agx) / N);
}

/* dx (+)= rstd·(g − mean(g) − x̂·mean(g⊙x̂)), g = dy⊙w, x̂ = (x − m)·r, in scalar_t with the
   two means summed as row_sum does; sw, sb (NULL: none) add this row's dy⊙x̂ and dy. */
static inline void FN(ln_dx)(const scalar_t* dy, const scalar_t* x, acc_t m, acc_t r,
                             const scalar_t* w, scalar_t* dx, i64 N, int accumulate,
                             scalar_t* sw, scalar_t* sb) {
    const scalar_t mf = (scalar_t)m, rf = (scalar_t)r;
    const i64 step = 2 * SVL, nfull = N - N % step, npad = FN(padded)(N);
    FN(lanes) ag = {{0}, {0}}, agx = {{0}, {0}};
    for (i64 j = 0; j < npad;) {
        const i64 end = block_end(j, BLOCK_TERMS * step, npad);
        FN(svec) g0 = {0}, g1 = {0}, gx0 = {0}, gx1 = {0}, d0, d1;
        for (const i64 whole = end < nfull ? end : nfull; j < whole; j += step) {
            FN(dy_pair)(dy, j, N, 0, &d0, &d1);
            FN(ln_dx_terms)(d0, d1, w, x, mf, rf, j, N, 0, &g0, &g1, &gx0, &gx1);
        }
        if (j < end) { /* the row's tail */
            FN(dy_pair)(dy, j, N, 1, &d0, &d1);
            FN(ln_dx_terms)(d0, d1, w, x, mf, rf, j, N, 1, &g0, &g1, &gx0, &gx1);
            j += step;
        }
        FN(lanes_add)(g0, g1, &ag);
        FN(lanes_add)(gx0, gx1, &agx);
    }
    scalar_t cg, cgx;
    FN(ln_dx_means)(N, ag, agx, &cg, &cgx);
    if (sw && accumulate) FN(ln_dx_store)(dy, x, mf, rf, cg, cgx, w, dx, N, sw, sb, 1, 1);
    else if (sw) FN(ln_dx_store)(dy, x, mf, rf, cg, cgx, w, dx, N, sw, sb, 0, 1);
    else if (accumulate) FN(ln_dx_store)(dy, x, mf, rf, cg, cgx, w, dx, N, NULL, NULL, 1, 0);
    else FN(ln_dx_store)(dy, x, mf, rf, cg, cgx, w, dx, N, NULL, NULL, 0, 0);
}

/* A row's layer norm for its gradient: x, the gain w, μ and rstd as scalar_t (mf, rf), and the
   two means of ln_dx (cg, cgx). */
typedef struct {
    const scalar_t *x, *w;
    scalar_t mf, rf, cg, cgx;
} FN(ln_grad);

/* ln_dx2's output sweep: dx1 = LN 1's gradient, dy := LN 2's in place (dy read first); with
   sums (a constant flag, as ln_dx_store's), sw1, sb1, sw2, sb2 add this row's terms. */
static inline __attribute__((always_inline)) void FN(ln_dx2_store)(
    scalar_t* dy, const FN(ln_grad) * l1, scalar_t* dx1, const FN(ln_grad) * l2, i64 N,
    scalar_t* sw1, scalar_t* sb1, scalar_t* sw2, scalar_t* sb2, const int sums) {
    const FN(ln_grad) a = *l1, b = *l2;
    #pragma omp simd
    for (i64 j = 0; j < N; ++j) {
        const scalar_t d = dy[j], xh1 = (a.x[j] - a.mf) * a.rf, xh2 = (b.x[j] - b.mf) * b.rf;
        dx1[j] = FN(ln_dx_at)(d, a.w[j], xh1, a.rf, a.cg, a.cgx);
        dy[j] = FN(ln_dx_at)(d, b.w[j], xh2, b.rf, b.cg, b.cgx);
        if (sums) {
            sw1[j] += d * xh1;
            sb1[j] += d;
            sw2[j] += d * xh2;
            sb2[j] += d;
        }
    }
}

/* ln_dx of two layer norms of one gradient dy, each row's sums as ln_dx sums them (so the same
   bits): dx1 = LN(x1)'s (written), dy := LN(x2)'s gradient in place (the LN-LSTM's hp and raw gx,
   whose layer norms add into the same gate pre-activations); sums sw1, sb1, sw2, sb2 as ln_dx's
   (all NULL or none). One sweep of dy a pass where two calls made two: LN-LSTM training, ours /
   torch.nn.LSTM, two calls / one, one | two threads, (T, B, I, H) = (10, 512, 32, 32) 1.29 / 1.23
   | 1.36 / 1.23, (50, 32, 64, 128) 1.18 / 1.16 | 1.20 / 1.12, (30, 128, 64, 64) 1.05 / 1.05 |
   1.13 / 1.09, (100, 32, 128, 256) level (AMD EPYC Zen 4, RESULTS.md 2026-11-30). */
static inline void FN(ln_dx2)(scalar_t* dy, const scalar_t* x1, acc_t m1, acc_t r1,
                              const scalar_t* w1, scalar_t* dx1, const scalar_t* x2, acc_t m2,
                              acc_t r2, const scalar_t* w2, i64 N, scalar_t* sw1, scalar_t* sb1,
                              scalar_t* sw2, scalar_t* sb2) {
    const scalar_t mf1 = (scalar_t)m1, rf1 = (scalar_t)r1, mf2 = (scalar_t)m2, rf2 = (scalar_t)r2;
    const i64 step = 2 * SVL, nfull = N - N % step, npad = FN(padded)(N);
    FN(lanes) ag1 = {{0}, {0}}, agx1 = {{0}, {0}}, ag2 = {{0}, {0}}, agx2 = {{0}, {0}};
    for (i64 j = 0; j < npad;) {
        const i64 end = block_end(j, BLOCK_TERMS * step, npad);
        FN(svec) g10 = {0}, g11 = {0}, gx10 = {0}, gx11 = {0};
        FN(svec) g20 = {0}, g21 = {0}, gx20 = {0}, gx21 = {0}, d0, d1;
        for (const i64 whole = end < nfull ? end : nfull; j < whole; j += step) {
            FN(dy_pair)(dy, j, N, 0, &d0, &d1);
            FN(ln_dx_terms)(d0, d1, w1, x1, mf1, rf1, j, N, 0, &g10, &g11, &gx10, &gx11);
            FN(ln_dx_terms)(d0, d1, w2, x2, mf2, rf2, j, N, 0, &g20, &g21, &gx20, &gx21);
        }
        if (j < end) { /* the row's tail */
            FN(dy_pair)(dy, j, N, 1, &d0, &d1);
            FN(ln_dx_terms)(d0, d1, w1, x1, mf1, rf1, j, N, 1, &g10, &g11, &gx10, &gx11);
            FN(ln_dx_terms)(d0, d1, w2, x2, mf2, rf2, j, N, 1, &g20, &g21, &gx20, &gx21);
            j += step;
        }
        FN(lanes_add)(g10, g11, &ag1);
        FN(lanes_add)(gx10, gx11, &agx1);
        FN(lanes_add)(g20, g21, &ag2);
        FN(lanes_add)(gx20, gx21, &agx2);
    }
    scalar_t cg1, cgx1, cg2, cgx2;
    FN(ln_dx_means)(N, ag1, agx1, &cg1, &cgx1);
    FN(ln_dx_means)(N, ag2, agx2, &cg2, &cgx2);
    const FN(ln_grad) g1 = {x1, w1, mf1, rf1, cg1, cgx1}, g2 = {x2, w2, mf2, rf2, cg2, cgx2};
    if (sw1) FN(ln_dx2_store)(dy, &g1, dx1, &g2, N, sw1, sb1, sw2, sb2, 1);
    else FN(ln_dx2_store)(dy, &g1, dx1, &g2, N, NULL, NULL, NULL, NULL, 0);
}

/* Rows [i0, i0 + n) (n <= MOMENT_LANES) of x (G columns each) normalized into y (x itself: in
   place): columns [0, split) and [split, G) each with its own statistics, as the step normalizes
   hp (moments of the group, then ((v − hi) − lo)·r), gain w and bias b (NULL: ones / zeros). With
   stats, each row's mean (its scalar_t part, as the step kernels keep it) and 1/std of each block
   are kept, RNN_BLOCK_NORM_STATS a row (zeros for a second block of no columns, split = G). The
   one definition of a projection's block norm: inference's input_rows and training's
   block_norm_fwd. */
static inline void FN(normalize_blocks)(const scalar_t* x, scalar_t* y, i64 G, i64 split,
                                        const scalar_t* w, const scalar_t* b, double eps, i64 i0,
                                        int n, scalar_t* stats) {
    for (int q = 0; stats && q < n; ++q) { /* the second block's, where it has no columns */
        stats[(i0 + q) * RNN_BLOCK_NORM_STATS + 2] = 0;
        stats[(i0 + q) * RNN_BLOCK_NORM_STATS + 3] = 0;
    }
    i64 block = 0;
    for (i64 j0 = 0, j1 = split; j0 < G; j0 = j1, j1 = G, ++block) {
        const scalar_t* rows[MOMENT_LANES] = {0}; /* (all set below; GCC cannot tell) */
        acc_t m[MOMENT_LANES], r[MOMENT_LANES];
        for (int q = 0; q < n; ++q) rows[q] = x + (i0 + q) * G + j0;
        FN(moments_rows)(rows, n, j1 - j0, eps, m, r);
        for (int q = 0; q < n; ++q) {
            const scalar_t* xr = x + (i0 + q) * G;
            scalar_t* yr = y + (i0 + q) * G;
            const FN(stats) st = FN(split)(m[q], r[q]);
            if (stats) {
                scalar_t* kept = stats + (i0 + q) * RNN_BLOCK_NORM_STATS + 2 * block;
                kept[0] = st.hi;
                kept[1] = st.r;
            }
            if (w && b) {
                #pragma omp simd
                for (i64 j = j0; j < j1; ++j) yr[j] = ((xr[j] - st.hi) - st.lo) * st.r * w[j] + b[j];
            } else {
                #pragma omp simd
                for (i64 j = j0; j < j1; ++j)
                    yr[j] = ((xr[j] - st.hi) - st.lo) * st.r * (w ? w[j] : (scalar_t)1) +
                            (b ? b[j] : (scalar_t)0);
            }
        }
    }
}

/* Rows [lo, hi) of gx (G columns each), the sequence kernels' projection x W_ihᵀ of a step's
   inputs, finished in place: with layer_norm, columns [0, split) and [split, G) each normalized
   (normalize_blocks) with gain w0 and bias b0; without, b0 added. NULL w0 / b0: ones / zeros. */
void FN(input_rows)(scalar_t* gx, i64 G, i64 split, const scalar_t* w0, const scalar_t* b0,
                    double eps, int layer_norm, i64 lo, i64 hi) {
    if (!layer_norm) {
        for (i64 i = lo; b0 && i < hi; ++i) {
            scalar_t* v = gx + i * G;
            #pragma omp simd
            for (i64 j = 0; j < G; ++j) v[j] += b0[j];
        }
        return;
    }
    for (i64 i0 = lo; i0 < hi; i0 += MOMENT_LANES) /* the rows' statistics in groups */
        FN(normalize_blocks)(gx, gx, G, split, w0, b0, eps, i0,
                             hi - i0 < MOMENT_LANES ? (int)(hi - i0) : MOMENT_LANES, NULL);
}

static inline __attribute__((always_inline)) scalar_t FN(sigm)(scalar_t v) {
    return (scalar_t)1 / ((scalar_t)1 + EXP(-v));
}

/* The LN-LSTM forward runs a step's rows in groups of up to forward_group (rnn_step.c: FWD_GROUP
   unless rnn_set_forward_group says otherwise, at most FWD_GROUP_MAX), each group in four phases:
   the row statistics of hp (and of gx with w0) of every row, then each row's gates and c_t, the
   statistics of every row's c_t, then each row's output. A row's statistics are a chain of
   dependent adds, divisions and a square root (some 160 cycles for a row of 256 or 512 floats,
   more than their arithmetic); one row after another they ran back to back, where the rows of a
   group, independent, overlap. The same results; a row in cache, AMD EPYC (Zen 4), H = 64:
   360 -> 320 ns (groups of 2: 323, of 8: 338), H = 128: 582 -> 541 ns. (The backward's rows in
   such phases measured no faster: 221 -> 225 ns at H = 64.) On an AMD Zen 5 groups of eight took
   4-9% less in inference at H <= 64, level in training (RESULTS.md, 2026-11-27 22:20-00:40 UTC),
   hence the setting. */
_Static_assert(2 * FWD_GROUP_MAX <= MOMENT_ROWS, "a group's hp and gx rows: one moments_rows call");
_Static_assert(FWD_GROUP >= 1 && FWD_GROUP <= FWD_GROUP_MAX, "the default group within the most");

/* LN(hp)'s statistics of rows [i0, i0 + n) (and LN(gx)'s with w0), kept for backward, into
   sh / sx: the rows' moments in one group. */
static inline void FN(lstm_fwd_stats)(const FN(lstm_fwd_step_args) * A, i64 i0, i64 n, FN(stats) * sh,
                                      FN(stats) * sx) {
    const i64 G = 4 * A->H;
    const scalar_t* rows[2 * FWD_GROUP_MAX] = {0}; /* (all set below; GCC cannot tell) */
    acc_t m[2 * FWD_GROUP_MAX], r[2 * FWD_GROUP_MAX];
    for (i64 q = 0; q < n; ++q) {
        rows[q] = A->hp + kept_row(A->R, A->N, A->off + i0 + q, i0 + q) * G;
        if (A->w0) /* gx raw: its rows' statistics after hp's */
            rows[n + q] = A->gx + kept_row(A->X, A->N, A->off + i0 + q, i0 + q) * G;
    }
    FN(moments_rows)(rows, A->w0 ? (int)(2 * n) : (int)n, G, A->eps, m, r);
    for (i64 q = 0; q < n; ++q) {
        const i64 k = kept_row(A->R, A->N, A->off + i0 + q, i0 + q);
        sh[q] = FN(split)(m[q], r[q]);
        A->mh[k] = sh[q].hi;
        A->rh[k] = sh[q].r;
        if (A->w0) { /* gx's layer norm in the step, its statistics kept */
            sx[q] = FN(split)(m[n + q], r[n + q]);
            A->mx[k] = sx[q].hi;
            A->rx[k] = sx[q].r;
        }
    }
}

/* Row i's gates (order i, f, g, o, torch's) and c_t (cn), given its statistics. The gains and
   biases are always given (ones / zeros where the layer has none): unconditional loads keep the
   loops vectorized. */
static inline __attribute__((always_inline)) void FN(lstm_fwd_cell)(
    const FN(lstm_fwd_step_args) * A, i64 i, FN(stats) st, FN(stats) sx, const int masks) {
    const i64 H = A->H, G = 4 * H, row = A->off + i, k = kept_row(A->R, A->N, row, i);
    const scalar_t* hpr = A->hp + k * G;
    const scalar_t* gxr = A->gx + kept_row(A->X, A->N, row, i) * G;
    const scalar_t *w1 = A->w1, *b1 = A->b1;
    scalar_t* a = A->acts + k * G;
    if (A->layer_norm && A->w0) {
        const scalar_t *w0 = A->w0, *b0 = A->b0;
        #pragma omp simd
        for (i64 j = 0; j < G; ++j)
            a[j] = ((hpr[j] - st.hi) - st.lo) * st.r * w1[j] + b1[j] +
                   (((gxr[j] - sx.hi) - sx.lo) * sx.r * w0[j] + b0[j]);
    } else if (A->layer_norm) {
        #pragma omp simd
        for (i64 j = 0; j < G; ++j) a[j] = ((hpr[j] - st.hi) - st.lo) * st.r * w1[j] + b1[j] + gxr[j];
    } else {
        for (i64 j = 0; j < G; ++j) a[j] = hpr[j] + gxr[j];
    }
    #pragma omp simd
    for (i64 j = 0; j < 2 * H; ++j) a[j] = FN(sigm)(a[j]);
    #pragma omp simd
    for (i64 j = 2 * H; j < 3 * H; ++j) a[j] = TANH(a[j]);
    #pragma omp simd
    for (i64 j = 3 * H; j < G; ++j) a[j] = FN(sigm)(a[j]);
    scalar_t* cs = A->c + i * H;
    scalar_t* cp = A->cprev ? A->cprev + k * H : NULL;
    scalar_t* cnr = A->cn + k * H;
    const scalar_t* cm = (masks & MASK_CM) ? A->cm + i * H : NULL;
    if (cp) memcpy(cp, cs, (size_t)H * sizeof(scalar_t)); /* NULL: c_{t−1} is not kept */
    for (i64 j = 0; j < H; ++j) {
        const scalar_t cand = (masks & MASK_CM) ? a[2 * H + j] * cm[j] : a[2 * H + j];
        cnr[j] = a[H + j] * cs[j] + a[j] * cand;
    }
}

/* LN(c_t)'s statistics of rows [i0, i0 + n), kept for backward, into sc. */
static inline void FN(lstm_fwd_cell_stats)(const FN(lstm_fwd_step_args) * A, i64 i0, i64 n,
                                           FN(stats) * sc) {
    const scalar_t* rows[FWD_GROUP_MAX] = {0}; /* (all set below; GCC cannot tell) */
    acc_t m[FWD_GROUP_MAX], r[FWD_GROUP_MAX];
    for (i64 q = 0; q < n; ++q)
        rows[q] = A->cn + kept_row(A->R, A->N, A->off + i0 + q, i0 + q) * A->H;
    FN(moments_rows)(rows, (int)n, A->H, A->eps, m, r);
    for (i64 q = 0; q < n; ++q) {
        const i64 k = kept_row(A->R, A->N, A->off + i0 + q, i0 + q);
        sc[q] = FN(split)(m[q], r[q]);
        A->mc[k] = sc[q].hi;
        A->rc[k] = sc[q].r;
    }
}

/* Row i's carried state and output from c_t, given LN(c_t)'s statistics. */
static inline __attribute__((always_inline)) void FN(lstm_fwd_out)(
    const FN(lstm_fwd_step_args) * A, i64 i, FN(stats) st, const int masks) {
    const i64 H = A->H, G = 4 * H, row = A->off + i, k = kept_row(A->R, A->N, row, i);
    const scalar_t *w3 = A->w3, *b3 = A->b3;
    const scalar_t* a = A->acts + k * G;
    scalar_t* cs = A->c + i * H;
    const scalar_t* cnr = A->cn + k * H;
    scalar_t* tcr = A->tc + k * H;
    scalar_t* hs = A->h + i * H;
    scalar_t* hpv = A->hprev ? A->hprev + k * H : NULL; /* NULL: h_{t-1} is not kept */
    scalar_t* o = A->out + row * H;
    /* LN(c_t) into tc first, then tanh in place: separate loops so each one vectorizes. */
    if (A->layer_norm) {
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) tcr[j] = ((cnr[j] - st.hi) - st.lo) * st.r * w3[j] + b3[j];
    } else {
        for (i64 j = 0; j < H; ++j) tcr[j] = cnr[j];
    }
    const scalar_t* cown = A->normalize_cell_state ? tcr : cnr;
    if (masks & MASK_ZC) {
        const scalar_t* zc = A->zc + row * H;
        for (i64 j = 0; j < H; ++j) cs[j] = zc[j] * cs[j] + ((scalar_t)1 - zc[j]) * cown[j];
    } else {
        for (i64 j = 0; j < H; ++j) cs[j] = cown[j];
    }
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) tcr[j] = TANH(tcr[j]);
    const scalar_t* zh = (masks & MASK_ZH) ? A->zh + row * H : NULL;
    if (hpv) memcpy(hpv, hs, (size_t)H * sizeof(scalar_t));
    for (i64 j = 0; j < H; ++j) {
        const scalar_t hprev = hs[j], own = a[3 * H + j] * tcr[j];
        const scalar_t h = (masks & MASK_ZH) ? zh[j] * hprev + ((scalar_t)1 - zh[j]) * own : own;
        hs[j] = h;
        o[j] = h;
    }
}

/* Rows [i0, i0 + n) (n <= FWD_GROUP_MAX) by the phases above. */
static inline __attribute__((always_inline)) void FN(lstm_fwd_body)(
    const FN(lstm_fwd_step_args) * A, i64 i0, i64 n, const int masks) {
    const FN(stats) none = {0, 0, 1};
    FN(stats) sh[FWD_GROUP_MAX], sx[FWD_GROUP_MAX], sc[FWD_GROUP_MAX];
    for (i64 r = 0; r < n; ++r) sh[r] = sx[r] = sc[r] = none;
    if (A->layer_norm) FN(lstm_fwd_stats)(A, i0, n, sh, sx);
    for (i64 r = 0; r < n; ++r) FN(lstm_fwd_cell)(A, i0 + r, sh[r], sx[r], masks);
    if (A->layer_norm) FN(lstm_fwd_cell_stats)(A, i0, n, sc);
    for (i64 r = 0; r < n; ++r) FN(lstm_fwd_out)(A, i0 + r, sc[r], masks);
}

static inline void FN(lstm_fwd_group)(const FN(lstm_fwd_step_args) * A, i64 i0, i64 n) {
    RNN_MASK_SWITCH_3(FN(lstm_fwd_body), A, i0, n)
}

/* Rows [lo, hi) of a step whose rows the caller has checked (the sequence kernels' threads,
   each running its share of a step; see rnn_seq_impl.h). */
void FN(lstm_fwd_rows)(const FN(lstm_fwd_step_args) * a, i64 lo, i64 hi) {
    const i64 group = forward_group;
    for (i64 i = lo; i < hi; i += group) FN(lstm_fwd_group)(a, i, hi - i < group ? hi - i : group);
}

int FN(lstm_fwd_step)(const FN(lstm_fwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B) || !kept_rows_valid(a->R, a->N, a->B) ||
        !kept_rows_valid(a->X, a->N, a->B))
        return RNN_ERR_ROWS;
    if (!input_norm_valid(a->w0, a->b0 && a->mx && a->rx, a->layer_norm))
        return RNN_ERR_INPUT_NORM;
    if (a->threads <= 1) {
        FN(lstm_fwd_rows)(a, 0, a->rows);
        return 0;
    }
    STEP_ROWS(FN(lstm_fwd_group)(a, i, 1));
}

/* The backward rows functions read each row's kept buffers (written by the forward pass, a whole
   sequence of them: out of cache at most shapes) as the row begins, and the hardware
   prefetchers did not have them ready: at (T, B, I, H) = (100, 64, 64, 64) nearly half of the
   LN-LSTM backward rows' samples sat on the first load of a row's gate activations (perf, AMD
   EPYC Zen 5). Each row now asks for the row BWD_PREFETCH_ROWS ahead's reads (prefetch_l1):
   that call's training 1.34-1.40 -> 1.26-1.27x torch.nn.LSTM's time with one thread, 1.37 ->
   1.20 with two (ab_rnn.py --cflags, both orders; 1, 2 and 4 rows ahead alike; prefetching the next step's rows into L2 before the
   GEMM, or the forward's written rows, gained nothing; the GRU's and Elman's backward rows
   neither gained nor lost by it, and go without). */
#ifndef BWD_PREFETCH_ROWS /* a build setting; 0: none */
#define BWD_PREFETCH_ROWS 2
#endif

/* LN-LSTM backward of row i. In: dout (this step's output gradient), dh (gradient of h_t from
   later steps), dc (of the carried c_t). Out: dgates (of the gate pre-activations), dhp (of hp;
   with layer_norm = 0 not written: the caller passes dgates, which it then equals), dlc (of
   LN(c_t)), dc := gradient of c_{t−1}. Without zoneout of h, dh is left for the caller's GEMM to
   overwrite; with it, dh := zh·dh_t, the direct path of h_{t−1}, for the GEMM to add to. With
   zoneout of c, the direct path zc·dc_t waits in the i block of dgates (written last) until
   dc_{t−1} is formed. */
/* The carried c_{t−1} of a row when the forward kept no copy (cprev NULL; the caller asks for it
   only on steps of all B rows with the carried state c_t itself): c0 for the first step's rows,
   else c_t of the step before, B rows earlier forward in time and B rows later in reverse. */
static inline const scalar_t* FN(carried_before)(const FN(lstm_bwd_step_args) * A, i64 row, i64 i) {
    const i64 p = row_before(row, A->N, A->B, A->reverse);
    return p < 0 ? A->c0 + i * A->H : A->cn + p * A->H;
}

static inline __attribute__((always_inline)) void FN(lstm_bwd_body)(
    const FN(lstm_bwd_step_args) * A, i64 i, scalar_t* sums, const int masks) {
    const i64 H = A->H, G = 4 * H, row = A->off + i;
    const int normalize = A->layer_norm, carry_norm = A->normalize_cell_state;
    const scalar_t* dout = A->dout + row * H;
    scalar_t* dh = A->dh + i * H;
    scalar_t* dc = A->dc + i * H;
    const scalar_t* zh = (masks & MASK_ZH) ? A->zh + row * H : NULL;
    const scalar_t* zc = (masks & MASK_ZC) ? A->zc + row * H : NULL;
    const scalar_t* cm = (masks & MASK_CM) ? A->cm + i * H : NULL;
    const scalar_t* a = A->acts + row * G;
    const scalar_t* cp = A->cprev ? A->cprev + row * H : FN(carried_before)(A, row, i);
    const scalar_t* tc = A->tc + row * H;
    scalar_t* dg = A->dgates + row * G;
    scalar_t* dlc = A->dlc + row * H;
    if (masks & MASK_ZC) {
        for (i64 j = 0; j < H; ++j) {
            const scalar_t d = dc[j];
            dg[j] = zc[j] * d;
            dc[j] = ((scalar_t)1 - zc[j]) * d;
        }
    }
    if (masks & MASK_ZH) {
        for (i64 j = 0; j < H; ++j) {
            const scalar_t d = dh[j] + dout[j];
            dh[j] = zh[j] * d;
            dlc[j] = ((scalar_t)1 - zh[j]) * d; /* the cell's dh̃_t, read back just below */
        }
    }
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t dht = (masks & MASK_ZH) ? dlc[j] : dh[j] + dout[j];
        const scalar_t o = a[3 * H + j], t = tc[j];
        dg[3 * H + j] = dht * t * o * ((scalar_t)1 - o);
        scalar_t d = dht * o * ((scalar_t)1 - t * t);
        if (carry_norm) d += dc[j];
        dlc[j] = d;
    }
    if (normalize) {
        FN(ln_dx)(dlc, A->cn + row * H, A->mc[row], A->rc[row], A->w3, dc, H, !carry_norm,
                  sums ? sums + 2 * G : NULL, sums ? sums + 2 * G + H : NULL);
    } else {
        for (i64 j = 0; j < H; ++j) dc[j] = dlc[j] + (carry_norm ? (scalar_t)0 : dc[j]);
    }
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t dcn = dc[j];
        const scalar_t ig = a[j], fg = a[H + j], gg = a[2 * H + j];
        const scalar_t m = (masks & MASK_CM) ? cm[j] : (scalar_t)1;
        const scalar_t direct = (masks & MASK_ZC) ? dg[j] : (scalar_t)0;
        dg[j] = dcn * (gg * m) * ig * ((scalar_t)1 - ig);
        dg[H + j] = dcn * cp[j] * fg * ((scalar_t)1 - fg);
        dg[2 * H + j] = dcn * (ig * m) * ((scalar_t)1 - gg * gg);
        dc[j] = dcn * fg + direct;
    }
    if (normalize && A->w0) /* hp's, and in place (dg read first) the raw gx's */
        FN(ln_dx2)(dg, A->hp + row * G, A->mh[row], A->rh[row], A->w1, A->dhp + row * G,
                   A->gx + row * G, A->mx[row], A->rx[row], A->w0, G, sums,
                   sums ? sums + G : NULL, sums ? sums + 2 * G + 2 * H : NULL,
                   sums ? sums + 3 * G + 2 * H : NULL);
    else if (normalize)
        FN(ln_dx)(dg, A->hp + row * G, A->mh[row], A->rh[row], A->w1, A->dhp + row * G, G, 0,
                  sums, sums ? sums + G : NULL);
}

static inline void FN(lstm_bwd_row)(const FN(lstm_bwd_step_args) * A, i64 i, scalar_t* sums) {
    RNN_MASK_SWITCH_3(FN(lstm_bwd_body), A, i, sums)
}

/* Rows [lo, hi) of a step whose rows the caller has checked (the sequence kernels' threads,
   each running its share of a step; see rnn_seq_impl.h). With layer_norm and sums (NULL: none),
   each row's terms of the layer norms' parameter gradients are added to sums: LN(hp)'s gain and
   bias (G each), then LN(c_t)'s (H each), then with w0 LN(gx)'s (G each). */
void FN(lstm_bwd_rows)(const FN(lstm_bwd_step_args) * a, i64 lo, i64 hi, scalar_t* sums) {
    const i64 H = a->H, G = 4 * H, sz = (i64)sizeof(scalar_t);
    for (i64 i = lo; i < hi; ++i) {
        if (BWD_PREFETCH_ROWS && i + BWD_PREFETCH_ROWS < hi) {
            const i64 r = a->off + i + BWD_PREFETCH_ROWS;
            prefetch_l1(a->dout + r * H, H * sz);
            prefetch_l1(a->acts + r * G, G * sz);
            prefetch_l1(a->tc + r * H, H * sz);
            prefetch_l1(a->cn + r * H, H * sz);
            if (a->cprev) prefetch_l1(a->cprev + r * H, H * sz);
            if (a->layer_norm) prefetch_l1(a->hp + r * G, G * sz);
            if (a->layer_norm && a->w0) prefetch_l1(a->gx + r * G, G * sz);
        }
        FN(lstm_bwd_row)(a, i, sums);
    }
}

int FN(lstm_bwd_step)(const FN(lstm_bwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B) ||
        !carried_before_valid(a->cprev, a->c0, a->off, a->rows, a->N, a->B))
        return RNN_ERR_ROWS;
    if (!input_norm_valid(a->w0, a->gx && a->mx && a->rx, a->layer_norm))
        return RNN_ERR_INPUT_NORM;
    STEP_ROWS(FN(lstm_bwd_row)(a, i, NULL));
}

/* LN(hp_n) + b_hn at column j of a GRU row (hp + b_hn without layer norms): the forward's value,
   and the backward's where the forward kept none (the row statistics s found as the forward
   found them, so the value is the same to the bit). */
static inline scalar_t FN(ghn_value)(const scalar_t* hp, i64 j, i64 H, FN(stats) s,
                                     const scalar_t* w_n, const scalar_t* b_n,
                                     const scalar_t* b_hn, int normalize) {
    const scalar_t x = hp[2 * H + j];
    return normalize ? ((x - s.hi) - s.lo) * s.r * w_n[j] + b_n[j] + b_hn[j] : x + b_hn[j];
}

/* LN-GRU forward of row i (gates r, z, n; torch's layout). hp = W_hh h_{t−1} (raw), gx = LN(W_ih x)
   + b_ih + [b_hr, b_hz, 0]. The (r, z) block and the n block of hp get separate layer norms. b_hn
   and the gains and biases are always given (ones / zeros where the layer has none). */
static inline __attribute__((always_inline)) void FN(gru_fwd_body)(
    const FN(gru_fwd_step_args) * A, i64 i, const int masks) {
    const i64 H = A->H, G = 3 * H, row = A->off + i, k = kept_row(A->R, A->N, row, i);
    const scalar_t* hp = A->hp + k * G;
    const scalar_t* gx = A->gx + kept_row(A->X, A->N, row, i) * G;
    const scalar_t *w_rz = A->w_rz, *b_rz = A->b_rz, *w_n = A->w_n, *b_n = A->b_n;
    const scalar_t* b_hn = A->b_hn;
    scalar_t* rz = A->rz + k * 2 * H;
    scalar_t* ghn = A->ghn ? A->ghn + k * H : NULL; /* NULL: not kept */
    scalar_t* n = A->n + k * H;
    scalar_t* hs = A->h + i * H;
    scalar_t* hpv = A->hprev ? A->hprev + k * H : NULL; /* NULL: h_{t-1} is not kept */
    scalar_t* o = A->out + row * H;
    const scalar_t* zh = (masks & MASK_ZH) ? A->zh + row * H : NULL;
    const scalar_t* cm = (masks & MASK_CM) ? A->cm + i * H : NULL;
    const int normalize = A->layer_norm;
    FN(stats) s2 = {0, 0, 1};
    if (normalize) {
        acc_t m1, r1, m2, r2;
        FN(moments)(hp, 2 * H, A->eps, &m1, &r1);
        FN(moments)(hp + 2 * H, H, A->eps, &m2, &r2);
        const FN(stats) s1 = FN(split)(m1, r1);
        s2 = FN(split)(m2, r2);
        A->mh[k] = s1.hi;
        A->rh[k] = s1.r;
        A->mn[k] = s2.hi;
        A->rn[k] = s2.r;
        #pragma omp simd
        for (i64 j = 0; j < 2 * H; ++j)
            rz[j] = FN(sigm)(((hp[j] - s1.hi) - s1.lo) * s1.r * w_rz[j] + b_rz[j] + gx[j]);
    } else {
        #pragma omp simd
        for (i64 j = 0; j < 2 * H; ++j) rz[j] = FN(sigm)(hp[j] + gx[j]);
    }
    if (hpv) memcpy(hpv, hs, (size_t)H * sizeof(scalar_t));
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t v = FN(ghn_value)(hp, j, H, s2, w_n, b_n, b_hn, normalize);
        if (ghn) ghn[j] = v;
        const scalar_t nv = TANH(gx[2 * H + j] + rz[j] * v);
        n[j] = nv;
        const scalar_t hprev = hs[j];
        const scalar_t nm = (masks & MASK_CM) ? nv * cm[j] : nv;
        const scalar_t own = nm + rz[H + j] * (hprev - nm);
        const scalar_t h = (masks & MASK_ZH) ? zh[j] * hprev + ((scalar_t)1 - zh[j]) * own : own;
        hs[j] = h;
        o[j] = h;
    }
}

static inline void FN(gru_fwd_row)(const FN(gru_fwd_step_args) * A, i64 i) {
    RNN_MASK_SWITCH_2(FN(gru_fwd_body), A, i)
}

/* Rows [lo, hi) of a step whose rows the caller has checked (the sequence kernels' threads,
   each running its share of a step; see rnn_seq_impl.h). */
void FN(gru_fwd_rows)(const FN(gru_fwd_step_args) * a, i64 lo, i64 hi) {
    for (i64 i = lo; i < hi; ++i) FN(gru_fwd_row)(a, i);
}

int FN(gru_fwd_step)(const FN(gru_fwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B) || !kept_rows_valid(a->R, a->N, a->B) ||
        !kept_rows_valid(a->X, a->N, a->B))
        return RNN_ERR_ROWS;
    STEP_ROWS(FN(gru_fwd_row)(a, i));
}

/* h_{t−1} of a row when the forward kept no copy (hprev NULL; the caller asks for it only on
   steps of all B rows): h0 for the first step's rows, else the output of the step before. */
static inline const scalar_t* FN(h_before)(const FN(gru_bwd_step_args) * A, i64 row, i64 i) {
    const i64 p = row_before(row, A->N, A->B, A->reverse);
    return p < 0 ? A->h0 + i * A->H : A->y + p * A->H;
}

/* LN-GRU backward of row i. Out: dgx (of the input-side pre-activations), dgh (of LN(hp_rz) and of
   LN(hp_n) + b_hn), dhp (of hp; with layer_norm = 0 not written: the caller passes dgh, which it
   then equals), and dh := the part of the gradient of h_{t−1} that bypasses W_hh (the caller adds
   dhp·W_hh). */
static inline __attribute__((always_inline)) void FN(gru_bwd_body)(
    const FN(gru_bwd_step_args) * A, i64 i, scalar_t* sums, const int masks) {
    const i64 H = A->H, G = 3 * H, row = A->off + i;
    const scalar_t* dout = A->dout + row * H;
    scalar_t* dh = A->dh + i * H;
    const scalar_t* hpv = A->hprev ? A->hprev + row * H : FN(h_before)(A, row, i);
    const scalar_t* rz = A->rz + row * 2 * H;
    const scalar_t* n = A->n + row * H;
    const scalar_t* ghn = A->ghn ? A->ghn + row * H : NULL; /* NULL: recomputed below */
    const scalar_t* hp = A->hp + row * G;
    FN(stats) s2 = {0, 0, 1};
    if (!ghn && A->layer_norm) {
        acc_t m2, r2;
        FN(moments)(hp + 2 * H, H, A->eps, &m2, &r2);
        s2 = FN(split)(m2, r2);
    }
    scalar_t* dgx = A->dgx + row * G;
    scalar_t* dgh = A->dgh + kept_row(A->D, A->N, row, i) * G; /* D = B: a step's scratch */
    const scalar_t* zh = (masks & MASK_ZH) ? A->zh + row * H : NULL;
    const scalar_t* cm = (masks & MASK_CM) ? A->cm + i * H : NULL;
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t dzoned = dh[j] + dout[j];
        const scalar_t dht = (masks & MASK_ZH) ? ((scalar_t)1 - zh[j]) * dzoned : dzoned;
        const scalar_t r = rz[j], z = rz[H + j], nv = n[j];
        const scalar_t m = (masks & MASK_CM) ? cm[j] : (scalar_t)1;
        const scalar_t dn = dht * ((scalar_t)1 - z) * ((scalar_t)1 - nv * nv) * m;
        const scalar_t g = ghn ? ghn[j]
                               : FN(ghn_value)(hp, j, H, s2, A->w_n, A->b_n, A->b_hn, A->layer_norm);
        const scalar_t dr = dn * g * r * ((scalar_t)1 - r);
        const scalar_t dz = dht * (hpv[j] - nv * m) * z * ((scalar_t)1 - z);
        dgx[j] = dr;
        dgx[H + j] = dz;
        dgx[2 * H + j] = dn;
        dgh[j] = dr;
        dgh[H + j] = dz;
        dgh[2 * H + j] = dn * r;
        dh[j] = (masks & MASK_ZH) ? dht * z + zh[j] * dzoned : dht * z;
    }
    if (A->layer_norm) {
        scalar_t* dhp = A->dhp + row * G;
        FN(ln_dx)(dgh, hp, A->mh[row], A->rh[row], A->w_rz, dhp, 2 * H, 0, sums,
                  sums ? sums + G : NULL);
        FN(ln_dx)(dgh + 2 * H, hp + 2 * H, A->mn[row], A->rn[row], A->w_n, dhp + 2 * H, H, 0,
                  sums ? sums + 2 * H : NULL, sums ? sums + G + 2 * H : NULL);
    }
}

static inline void FN(gru_bwd_row)(const FN(gru_bwd_step_args) * A, i64 i, scalar_t* sums) {
    RNN_MASK_SWITCH_2(FN(gru_bwd_body), A, i, sums)
}

/* Rows [lo, hi) of a step whose rows the caller has checked (the sequence kernels' threads,
   each running its share of a step; see rnn_seq_impl.h). With layer_norm and sums (NULL: none),
   each row's terms of LN(hp)'s gain and bias gradients ((r, z) then n columns, G each) are
   added to sums. */
void FN(gru_bwd_rows)(const FN(gru_bwd_step_args) * a, i64 lo, i64 hi, scalar_t* sums) {
    for (i64 i = lo; i < hi; ++i) FN(gru_bwd_row)(a, i, sums);
}

int FN(gru_bwd_step)(const FN(gru_bwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B) || !GRU_BWD_ROWS_VALID(a, a->off, a->rows))
        return RNN_ERR_ROWS;
    STEP_ROWS(FN(gru_bwd_row)(a, i, NULL));
}

/* LN-RNN (Elman, Ba et al. Eq. 4) forward of row i: the pre-activation a = hp + gx replaces hp
   (backward's layer-norm input), the cell's own h̃_t = f(LN(a; w, b)) (f = tanh, or relu), and
   with zoneout h_t = zh·h_{t−1} + (1 − zh)·h̃_t (own keeps h̃_t; without zoneout out holds it).
   Without layer_norm gx already carries torch's biases and h̃_t = f(a). The gain and bias are
   always given (ones / zeros where the layer has none). */
static inline __attribute__((always_inline)) void FN(elman_fwd_body)(
    const FN(elman_fwd_step_args) * A, i64 i, const int masks) {
    const i64 H = A->H, row = A->off + i, k = kept_row(A->R, A->N, row, i);
    scalar_t* a = A->hp + k * H;
    const scalar_t* gx = A->gx + kept_row(A->X, A->N, row, i) * H;
    scalar_t* hs = A->h + i * H;
    scalar_t* o = A->out + row * H;
    scalar_t* own = A->own ? A->own + k * H : o;
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) a[j] += gx[j];
    if (A->layer_norm) {
        acc_t m, r;
        FN(moments)(a, H, A->eps, &m, &r);
        const FN(stats) st = FN(split)(m, r);
        A->mh[k] = st.hi;
        A->rh[k] = st.r;
        const scalar_t *w = A->w, *b = A->b;
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) own[j] = ((a[j] - st.hi) - st.lo) * st.r * w[j] + b[j];
    } else {
        memcpy(own, a, (size_t)H * sizeof(scalar_t));
    }
    if (A->relu) {
        /* v < 0, not v > 0, so that NaN passes through as torch's relu passes it */
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) own[j] = own[j] < 0 ? (scalar_t)0 : own[j];
    } else {
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) own[j] = TANH(own[j]);
    }
    if (A->hprev) memcpy(A->hprev + k * H, hs, (size_t)H * sizeof(scalar_t));
    if (masks & MASK_ZH) {
        const scalar_t* zh = A->zh + row * H;
        for (i64 j = 0; j < H; ++j) {
            const scalar_t h = zh[j] * hs[j] + ((scalar_t)1 - zh[j]) * own[j];
            hs[j] = h;
            o[j] = h;
        }
    } else {
        if (own != o) memcpy(o, own, (size_t)H * sizeof(scalar_t));
        memcpy(hs, o, (size_t)H * sizeof(scalar_t));
    }
}

static inline void FN(elman_fwd_row)(const FN(elman_fwd_step_args) * A, i64 i) {
    if (A->zh) FN(elman_fwd_body)(A, i, MASK_ZH);
    else FN(elman_fwd_body)(A, i, 0);
}

/* Rows [lo, hi) of a step whose rows the caller has checked (see lstm_fwd_rows). */
void FN(elman_fwd_rows)(const FN(elman_fwd_step_args) * a, i64 lo, i64 hi) {
    for (i64 i = lo; i < hi; ++i) FN(elman_fwd_row)(a, i);
}

int FN(elman_fwd_step)(const FN(elman_fwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B) || !kept_rows_valid(a->R, a->N, a->B) ||
        !kept_rows_valid(a->X, a->N, a->B))
        return RNN_ERR_ROWS;
    STEP_ROWS(FN(elman_fwd_row)(a, i));
}

/* LN-RNN backward of row i. In: dout (this step's output gradient), dh (of h_t from later
   steps). Out: dhp, the gradient of a (of hp and of gx alike); with zoneout of h dh := zh·dh_t,
   the direct path of h_{t−1}, for the caller's GEMM to add to (without, dh is left for it to
   overwrite). With sums (NULL: none) this row's terms of LN(a)'s gain and bias gradients are
   added: H each. */
static inline __attribute__((always_inline)) void FN(elman_bwd_body)(
    const FN(elman_bwd_step_args) * A, i64 i, scalar_t* sums, const int masks) {
    const i64 H = A->H, row = A->off + i;
    const scalar_t* dout = A->dout + row * H;
    const scalar_t* own = A->own + row * H;
    scalar_t* dh = A->dh + i * H;
    scalar_t* da = A->dhp + row * H;
    const scalar_t* zh = (masks & MASK_ZH) ? A->zh + row * H : NULL;
    const int relu = A->relu;
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t d = dh[j] + dout[j];
        const scalar_t dt = (masks & MASK_ZH) ? ((scalar_t)1 - zh[j]) * d : d;
        if (masks & MASK_ZH) dh[j] = zh[j] * d;
        const scalar_t v = own[j];
        /* a product, not a choice: NaN in dt reaches da as torch's mask product passes it */
        da[j] = relu ? dt * (scalar_t)(v > 0) : dt * ((scalar_t)1 - v * v);
    }
    if (A->layer_norm) /* in place: ln_dx reads each value before it writes it */
        FN(ln_dx)(da, A->hp + row * H, A->mh[row], A->rh[row], A->w, da, H, 0, sums,
                  sums ? sums + H : NULL);
}

static inline void FN(elman_bwd_row)(const FN(elman_bwd_step_args) * A, i64 i, scalar_t* sums) {
    if (A->zh) FN(elman_bwd_body)(A, i, sums, MASK_ZH);
    else FN(elman_bwd_body)(A, i, sums, 0);
}

/* Rows [lo, hi) of a step whose rows the caller has checked (see lstm_bwd_rows); with
   layer_norm and sums, LN(a)'s gain then bias gradient terms (H each) added to sums. */
void FN(elman_bwd_rows)(const FN(elman_bwd_step_args) * a, i64 lo, i64 hi, scalar_t* sums) {
    for (i64 i = lo; i < hi; ++i) FN(elman_bwd_row)(a, i, sums);
}

int FN(elman_bwd_step)(const FN(elman_bwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B)) return RNN_ERR_ROWS;
    STEP_ROWS(FN(elman_bwd_row)(a, i, NULL));
}

/* A GRU cell's call with gradients (layernorm.LayerNormGRUCell): B rows of one step, both raw
   projections gx = W_ih x and hp = W_hh h_{t−1} normalized here, each as the layers normalize it
   (the (r, z) block and the n block apart, statistics as moments finds them: the blocks of gx
   and hp two rows of one group, their chains overlapped), then the gates as gru_fwd_body computes
   them. stats keeps each row's means (scalar_t, as the step kernels keep them) and 1/std:
   gx (r, z), gx n, hp (r, z), hp n. One thread: a cell's call is a few rows. */
int FN(gru_cell_fwd)(const FN(gru_cell_fwd_args) * A) {
    const i64 H = A->H, G = 3 * H;
    const scalar_t *w_ih = A->w_ih, *b_ih = A->b_ih, *w_hh = A->w_hh, *b_hh = A->b_hh;
    for (i64 i = 0; i < A->B; ++i) {
        const scalar_t* gx = A->gx + i * G;
        const scalar_t* hp = A->hp + i * G;
        const scalar_t* h = A->h + i * H;
        scalar_t* rz = A->rz + i * 2 * H;
        scalar_t* n = A->n + i * H;
        scalar_t* ghn = A->ghn + i * H;
        scalar_t* out = A->out + i * H;
        scalar_t* st = A->stats + i * RNN_GRU_CELL_STATS;
        const scalar_t* blocks_rz[2] = {gx, hp};
        const scalar_t* blocks_n[2] = {gx + 2 * H, hp + 2 * H};
        acc_t m[4], r[4]; /* gx (r, z), hp (r, z), gx n, hp n */
        FN(moments_rows)(blocks_rz, 2, 2 * H, A->eps, m, r);
        FN(moments_rows)(blocks_n, 2, H, A->eps, m + 2, r + 2);
        const FN(stats) sx = FN(split)(m[0], r[0]), sh = FN(split)(m[1], r[1]);
        const FN(stats) sxn = FN(split)(m[2], r[2]), shn = FN(split)(m[3], r[3]);
        st[0] = sx.hi, st[1] = sx.r, st[2] = sxn.hi, st[3] = sxn.r;
        st[4] = sh.hi, st[5] = sh.r, st[6] = shn.hi, st[7] = shn.r;
        #pragma omp simd
        for (i64 j = 0; j < 2 * H; ++j) {
            const scalar_t a = ((gx[j] - sx.hi) - sx.lo) * sx.r * w_ih[j] + b_ih[j];
            const scalar_t b = ((hp[j] - sh.hi) - sh.lo) * sh.r * w_hh[j] + b_hh[j];
            rz[j] = FN(sigm)(a + b);
        }
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) {
            const i64 k = 2 * H + j;
            const scalar_t a = ((gx[k] - sxn.hi) - sxn.lo) * sxn.r * w_ih[k] + b_ih[k];
            const scalar_t g = ((hp[k] - shn.hi) - shn.lo) * shn.r * w_hh[k] + b_hh[k];
            ghn[j] = g;
            const scalar_t nv = TANH(a + rz[j] * g);
            n[j] = nv;
            out[j] = nv + rz[H + j] * (h[j] - nv);
        }
    }
    return 0;
}

/* Its backward: the gates' gradients as gru_bwd_body finds them (no masks), turned into the raw
   projections' by the four layer norms' backward in place, each row adding its terms of the
   gains' and biases' gradients to dparams (zeroed first; rows in order, so the same sums on
   every call). dh gets z ⊙ dout, the part of h_{t−1}'s gradient that bypasses W_hh. */
int FN(gru_cell_bwd)(const FN(gru_cell_bwd_args) * A) {
    const i64 H = A->H, G = 3 * H;
    scalar_t* sums = A->dparams; /* dw_ih, db_ih, dw_hh, db_hh: G each */
    memset(sums, 0, (size_t)(4 * G) * sizeof(scalar_t));
    for (i64 i = 0; i < A->B; ++i) {
        const scalar_t* dout = A->dout + i * H;
        const scalar_t* h = A->h + i * H;
        const scalar_t* rz = A->rz + i * 2 * H;
        const scalar_t* n = A->n + i * H;
        const scalar_t* ghn = A->ghn + i * H;
        const scalar_t* gx = A->gx + i * G;
        const scalar_t* hp = A->hp + i * G;
        const scalar_t* st = A->stats + i * RNN_GRU_CELL_STATS;
        scalar_t* dgx = A->dgx + i * G;
        scalar_t* dhp = A->dhp + i * G;
        scalar_t* dh = A->dh + i * H;
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) {
            const scalar_t d = dout[j], r = rz[j], z = rz[H + j], nv = n[j];
            const scalar_t dn = d * ((scalar_t)1 - z) * ((scalar_t)1 - nv * nv);
            const scalar_t dr = dn * ghn[j] * r * ((scalar_t)1 - r);
            const scalar_t dz = d * (h[j] - nv) * z * ((scalar_t)1 - z);
            dgx[j] = dr;
            dgx[H + j] = dz;
            dgx[2 * H + j] = dn;
            dhp[j] = dr;
            dhp[H + j] = dz;
            dhp[2 * H + j] = dn * r;
            dh[j] = d * z;
        }
        /* in place: ln_dx reads each value before it writes it */
        FN(ln_dx)(dgx, gx, st[0], st[1], A->w_ih, dgx, 2 * H, 0, sums, sums + G);
        FN(ln_dx)(dgx + 2 * H, gx + 2 * H, st[2], st[3], A->w_ih + 2 * H, dgx + 2 * H, H, 0,
                  sums + 2 * H, sums + G + 2 * H);
        FN(ln_dx)(dhp, hp, st[4], st[5], A->w_hh, dhp, 2 * H, 0, sums + 2 * G, sums + 3 * G);
        FN(ln_dx)(dhp + 2 * H, hp + 2 * H, st[6], st[7], A->w_hh + 2 * H, dhp + 2 * H, H, 0,
                  sums + 2 * G + 2 * H, sums + 3 * G + 2 * H);
    }
    return 0;
}

/* The LN-GRU's input side over all rows where autograd records it (training;
   layernorm.recurrent._fused.BlockNormalized): y = LN(x) of each row's column blocks [0, split)
   and [split, G) by normalize_blocks (the inference path's values to the bit), each block's
   statistics kept. Groups of rows shared out over the threads. */
int FN(block_norm_fwd)(const FN(block_norm_fwd_args) * A) {
    if (A->split > A->G) return RNN_ERR_PROJECTION;
    const i64 groups = (A->N + MOMENT_LANES - 1) / MOMENT_LANES;
    #pragma omp parallel for num_threads(A->threads) if (A->threads > 1) schedule(static)
    for (i64 g = 0; g < groups; ++g) {
        const i64 i0 = g * MOMENT_LANES;
        const int n = A->N - i0 < MOMENT_LANES ? (int)(A->N - i0) : MOMENT_LANES;
        FN(normalize_blocks)(A->x, A->y, A->G, A->split, A->w, A->b, A->eps, i0, n, A->stats);
    }
    return 0;
}

/* Its backward: dx = each block's layer-norm backward (ln_dx, as the step kernels take their
   own), dparams the gain's and bias's gradients summed over the rows as the norm kernels sum a
   row: BLOCK_NORM_CHUNK rows' terms in scalar_t, each chunk's sums added in acc_t (float64), so
   that a long sequence's sums do not grow an N-term float error. Each thread sums its own rows
   (a share fixed by the thread count), and the threads' sums are added in thread order: the
   same sums on every call with the same threads. */
#ifndef BLOCK_NORM_CHUNK
#define BLOCK_NORM_CHUNK 16
#endif
int FN(block_norm_bwd)(const FN(block_norm_bwd_args) * A) {
    const i64 N = A->N, G = A->G, split = A->split;
    if (split > G) return RNN_ERR_PROJECTION;
    const int nt = A->threads > 1 ? A->threads : 1;
    /* each thread's chunk sums (2G scalar_t) and running sums (2G acc_t), zeroed */
    const size_t per_thread = (size_t)(2 * G) * (sizeof(scalar_t) + sizeof(acc_t));
    char* scratch = (char*)calloc((size_t)nt, per_thread > 0 ? per_thread : 1);
    if (!scratch) return RNN_ERR_NOMEM;
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const i64 t = omp_get_thread_num(), T = omp_get_num_threads();
        const i64 lo = N * t / T, hi = N * (t + 1) / T;
        acc_t* total = (acc_t*)(scratch + (size_t)t * per_thread);
        scalar_t* chunk = (scalar_t*)(total + 2 * G);
        for (i64 c0 = lo; c0 < hi; c0 += BLOCK_NORM_CHUNK) {
            const i64 c1 = hi - c0 < BLOCK_NORM_CHUNK ? hi : c0 + BLOCK_NORM_CHUNK;
            memset(chunk, 0, (size_t)(2 * G) * sizeof(scalar_t));
            for (i64 i = c0; i < c1; ++i) {
                const scalar_t* dy = A->dy + i * G;
                const scalar_t* x = A->x + i * G;
                const scalar_t* st = A->stats + i * RNN_BLOCK_NORM_STATS;
                scalar_t* dx = A->dx + i * G;
                FN(ln_dx)(dy, x, st[0], st[1], A->w, dx, split, 0, chunk, chunk + G);
                if (split < G)
                    FN(ln_dx)(dy + split, x + split, st[2], st[3], A->w + split, dx + split,
                              G - split, 0, chunk + split, chunk + G + split);
            }
            #pragma omp simd
            for (i64 j = 0; j < 2 * G; ++j) total[j] += (acc_t)chunk[j];
        }
    }
    for (i64 j = 0; j < 2 * G; ++j) { /* threads that ran no rows added zeros */
        acc_t sum = 0;
        for (int t = 0; t < nt; ++t) sum += ((const acc_t*)(scratch + (size_t)t * per_thread))[j];
        A->dparams[j] = (scalar_t)sum;
    }
    free(scratch);
    return 0;
}

/* An LSTM cell's call with gradients (layernorm.LayerNormLSTMCell, carrying c_t): B rows of one
   step, both raw projections normalized here (their statistics as two rows of one group), the
   gates, c_t, LN(c_t) and h_t = σ(o) ⊙ tanh(LN(c_t)). gates keeps the activations, tc
   tanh(LN(c_t)), stats each row's means and 1/std: gx, hp, c_t. One thread. */
int FN(lstm_cell_fwd)(const FN(lstm_cell_fwd_args) * A) {
    const i64 H = A->H, G = 4 * H;
    const scalar_t *w_ih = A->w_ih, *b_ih = A->b_ih, *w_hh = A->w_hh, *b_hh = A->b_hh;
    for (i64 i = 0; i < A->B; ++i) {
        const scalar_t* gx = A->gx + i * G;
        const scalar_t* hp = A->hp + i * G;
        const scalar_t* c = A->c + i * H;
        scalar_t* gates = A->gates + i * G;
        scalar_t* c_out = A->c_out + i * H;
        scalar_t* tc = A->tc + i * H;
        scalar_t* h_out = A->h_out + i * H;
        scalar_t* st = A->stats + i * RNN_LSTM_CELL_STATS;
        const scalar_t* rows[2] = {gx, hp};
        acc_t m[2], r[2];
        FN(moments_rows)(rows, 2, G, A->eps, m, r);
        const FN(stats) sx = FN(split)(m[0], r[0]), sh = FN(split)(m[1], r[1]);
        st[0] = sx.hi, st[1] = sx.r, st[2] = sh.hi, st[3] = sh.r;
        #pragma omp simd
        for (i64 j = 0; j < G; ++j) {
            const scalar_t a = ((gx[j] - sx.hi) - sx.lo) * sx.r * w_ih[j] + b_ih[j];
            const scalar_t b = ((hp[j] - sh.hi) - sh.lo) * sh.r * w_hh[j] + b_hh[j];
            gates[j] = a + b;
        }
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) {
            const scalar_t ig = FN(sigm)(gates[j]), fg = FN(sigm)(gates[H + j]);
            const scalar_t gg = TANH(gates[2 * H + j]), og = FN(sigm)(gates[3 * H + j]);
            gates[j] = ig, gates[H + j] = fg, gates[2 * H + j] = gg, gates[3 * H + j] = og;
            c_out[j] = fg * c[j] + ig * gg;
        }
        acc_t mc, rc;
        FN(moments)(c_out, H, A->eps, &mc, &rc);
        const FN(stats) sc = FN(split)(mc, rc);
        st[4] = sc.hi, st[5] = sc.r;
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) {
            const scalar_t t = TANH(((c_out[j] - sc.hi) - sc.lo) * sc.r * A->w_c[j] + A->b_c[j]);
            tc[j] = t;
            h_out[j] = gates[3 * H + j] * t;
        }
    }
    return 0;
}

/* Its backward: LN(c_t)'s gradient from h_t's, c_t's (the carried gradient added), the gates'
   and c_{t−1}'s, then the projections' by their layer norms' backward in place, each row adding
   its terms of the gains' and biases' gradients to dparams and dcparams (zeroed first; rows in
   order). LN(c_t)'s gradient waits in dgx's first H columns until the gates' overwrite them. */
int FN(lstm_cell_bwd)(const FN(lstm_cell_bwd_args) * A) {
    const i64 H = A->H, G = 4 * H;
    scalar_t* sums = A->dparams; /* dw_ih, db_ih, dw_hh, db_hh: G each */
    scalar_t* csums = A->dcparams; /* dw_c, db_c: H each */
    memset(sums, 0, (size_t)(4 * G) * sizeof(scalar_t));
    memset(csums, 0, (size_t)(2 * H) * sizeof(scalar_t));
    for (i64 i = 0; i < A->B; ++i) {
        const scalar_t* dh = A->dh + i * H;
        const scalar_t* dc = A->dc + i * H;
        const scalar_t* c = A->c + i * H;
        const scalar_t* gates = A->gates + i * G;
        const scalar_t* tc = A->tc + i * H;
        const scalar_t* st = A->stats + i * RNN_LSTM_CELL_STATS;
        scalar_t* dgx = A->dgx + i * G;
        scalar_t* dhp = A->dhp + i * G;
        scalar_t* dct = A->dc_prev + i * H; /* c_t's gradient, then c_{t−1}'s in place */
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) {
            dgx[j] = dh[j] * gates[3 * H + j] * ((scalar_t)1 - tc[j] * tc[j]);
            dct[j] = dc[j];
        }
        FN(ln_dx)(dgx, A->c_out + i * H, st[4], st[5], A->w_c, dct, H, 1, csums, csums + H);
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) {
            const scalar_t ig = gates[j], fg = gates[H + j], gg = gates[2 * H + j];
            const scalar_t og = gates[3 * H + j], d = dct[j];
            const scalar_t di = d * gg * ig * ((scalar_t)1 - ig);
            const scalar_t df = d * c[j] * fg * ((scalar_t)1 - fg);
            const scalar_t dg = d * ig * ((scalar_t)1 - gg * gg);
            const scalar_t d_o = dh[j] * tc[j] * og * ((scalar_t)1 - og);
            dgx[j] = di, dgx[H + j] = df, dgx[2 * H + j] = dg, dgx[3 * H + j] = d_o;
            dhp[j] = di, dhp[H + j] = df, dhp[2 * H + j] = dg, dhp[3 * H + j] = d_o;
            dct[j] = d * fg;
        }
        /* in place: ln_dx reads each value before it writes it */
        FN(ln_dx)(dgx, A->gx + i * G, st[0], st[1], A->w_ih, dgx, G, 0, sums, sums + G);
        FN(ln_dx)(dhp, A->hp + i * G, st[2], st[3], A->w_hh, dhp, G, 0, sums + 2 * G,
                  sums + 3 * G);
    }
    return 0;
}

#undef SVL
#undef FN
