/* Definitions shared by every instantiation of the norm kernels (norms_impl.h). */
#ifndef LAYERNORM_NORMS_COMMON_H
#define LAYERNORM_NORMS_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

/* Orders a kernel's non-temporal stores (weakly ordered) before it returns, when it made any. */
static inline void stream_fence(int stream) {
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#else
    (void)stream;
#endif
}

/* Row sums run in LANES independent partial sums, two vectors of the build's widest registers
   (norms_impl.h: LANES = 2·VL, HALF = VL; 32 float32 lanes with AVX-512, 16 with AVX2): a single
   running sum would wait on the add latency every step and run at a fraction of the speed.
   Blocks of BLOCK_TERMS terms per lane (cpu_common.h); pairs of lanes are added (one more add)
   and the HALF results go into float64 partial sums, folded pairwise at the end of the row
   (row_lanes.h). */
/* The forwards' outputs, expressions of the loads L(p) (an element or a vector of the row xr,
   the gain w, the bias b) and the names in scope: the row's statistics mh + ml (μ as hi + lo)
   and rf (rstd), AdaNorm's C (c) and C·k (ck). One definition for the float kernels' rows and
   the half kernels' chunks of a row (norms_half_impl.h).
     layer norm  ((x − hi) − lo)·rstd, times w and plus b where the call has them
     RMSNorm     x·rstd, times w where the call has it
     AdaNorm     (C − C·k·x̂)·x̂, x̂ the layer norm's */
#define LN_XHAT(L) (((L(xr) - mh) - ml) * rf)
#define LN_Y_WB(L) (LN_XHAT(L) * L(w) + L(b))
#define LN_Y_W(L) (LN_XHAT(L) * L(w))
#define LN_Y_B(L) (LN_XHAT(L) + L(b))
#define RMS_Y(L) (L(xr) * rf)
#define RMS_Y_W(L) (L(xr) * rf * L(w))
#define ADA_Z(L) ((c - ck * LN_XHAT(L)) * LN_XHAT(L))
/* The layer-norm and RMSNorm backwards' input gradient, with the row's statistics mf (μ; 0 for
   RMSNorm) and rf (rstd) and its mean terms c1 = mean(g), c2 = mean(g ⊙ x̂) (0 where detached),
   g = dy ⊙ w: one definition for the float kernels' rows and the half kernels' chunks. */
#define LN_DX(L) (rf * (L(dyr) * L(w) - c1 - (L(xr) - mf) * rf * c2))

/* The forwards (norms_impl.h: group_stats; the half types' direct rows as well) run rows of at
   most NARROW_N elements in groups of ROW_GROUP: every row's sweeps, then the group's square
   roots and divisions as one vector each (unused lanes take 1), then every row's output. One
   row at a time, each row waited on its own square root and division (float64: some 30 cycles)
   before its output, most of a narrow row's time, and more than its sweeps up to a few hundred
   elements. The same operations on each row: the same bits. AMD EPYC Zen 5, one thread, float32
   layer norm, ms forward (fwd+bwd), rows one at a time / in groups: (100000, 32) 2.80-2.87 /
   2.42-2.49 (4.58-4.71 / 4.10-4.19), (50000, 64) 1.61-1.63 / 1.40-1.44 (2.78-2.87 / 2.60-2.66).
   AMD EPYC Zen 4, one thread, forward x torch's layer norm, one at a time / in groups of up to
   512 elements: (32768, 128) 0.96 / 0.76-0.81, (4096, 256) 1.01-1.05 / 0.77-0.79, the AVX2
   build (16384, 256) 1.06-1.07 / 0.80-0.81; level at 384 and 512 elements, and at 768 and 1024
   (eight rows fill the first-level cache) no steady gain (RESULTS.md, 2026-11-30). */
#define NARROW_N 512
#define ROW_GROUP 8

/* Rows whose dweight/dbias terms are summed in the input precision before a float64 flush
   (-DFLUSH=n for A/B: 64 measured 0.94-0.99 of the float32 backward's time at (32768, 128) to
   (2048, 1023), AMD EPYC Zen 3, one thread: not worth the longer float32 sums). */
#ifndef FLUSH
#define FLUSH 16
#endif

/* Whether a backward that sums dweight/dbias takes its rows of N elements in pairs, one sweep of
   both rows adding both rows' terms (row_pair_grad_sums), or one at a time: pairs for rows of
   more than PAIRED_ROWS_WIDE_N elements, and, with 32 vector registers (AVX-512), of up to
   PAIRED_ROWS_NARROW_N. The half kernels' backwards follow it, so that their bits stay the
   float32 kernels'. AMD EPYC Zen 4, float32 layer norm backward alone, ms one row at a time /
   in pairs, one thread (two): AVX-512 build (16384, 256) 0.78-0.83 (0.78-0.79), (8192, 384)
   0.74-0.76 (0.76-0.78), (8192, 512) 0.75-0.85 (0.82-0.88), (4096, 768) 0.93-0.94 (0.91-0.94),
   (4096, 1024) 1.02-1.13 (0.90), level at 128, while (50000, 64) took 1.16 and (2048, 2048) to
   (1024, 8192) 1.10-1.26; AVX2 build (16384, 256) 0.76-0.79, (8192, 512) 0.85-0.86, level at
   64, 128 and 1024, (2048, 4096) 1.06-1.07 (RESULTS.md, 2026-11-30). */
#ifndef PAIRED_ROWS_WIDE_N /* -DPAIRED_ROWS_WIDE_N=0: every row in pairs, as before */
#define PAIRED_ROWS_WIDE_N 768
#endif
#if VEC_REGISTERS >= 32
#define PAIRED_ROWS_NARROW_N 128
#else
#define PAIRED_ROWS_NARROW_N 0
#endif
static inline int paired_rows(i64 N) {
    return N > PAIRED_ROWS_WIDE_N || N <= PAIRED_ROWS_NARROW_N;
}

/* 1/N in float64, by which the kernels scale a row's sums into means (μ and the variance, Σx²/N,
   the backwards' mean(g) and mean(g·x̂)): a multiplication where a division by N, in each row's
   chain of dependent operations, left the row's next sweep or its output waiting on it (a float32
   layer norm forward at (100000, 32) or (32768, 128) in 0.93 of the time, one thread, AMD EPYC
   Zen 4; its backward at (50000, 64) in 0.95; AdaNorm's at (16384, 256) in 0.82). */
#define ROW_INV_N(N) (1.0 / (acc_t)(N))

/* Token pasting through one more macro level, so SUF is expanded before it is pasted. */
#define LN_CAT_(a, b) a##_##b
#define LN_CAT(a, b) LN_CAT_(a, b)

/* A zeroed float64 scratch buffer of n elements starting on a cache line (CACHE_LINE bytes),
   kept per calling thread and grown on demand: a fresh calloc of a few hundred KiB per backward
   is an mmap plus page faults every call. */
static __thread acc_t* scratch_buf = NULL;
static __thread i64 scratch_cap = 0;

static acc_t* zeroed_scratch(i64 n) {
    if (n > scratch_cap) {
        free(scratch_buf);
        const size_t bytes = ((size_t)n * sizeof(acc_t) + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE;
        scratch_buf = (acc_t*)aligned_alloc(CACHE_LINE, bytes);
        scratch_cap = scratch_buf ? n : 0;
        if (!scratch_buf) return NULL;
    }
    memset(scratch_buf, 0, (size_t)n * sizeof(acc_t));
    return scratch_buf;
}

/* The per-thread dweight/dbias sums of a backward, in one zeroed scratch buffer: float64 sums
   (dwa, dba) and the blocks of rows summed in the compute precision before each float64 flush
   (fwa, fba: elements of `esize` bytes), one slice of `stride` elements per thread in each.
   The stride is N rounded up to whole cache lines (16 elements: 64 bytes of float32, 128 of
   float64) and the buffer starts on a line, so no two threads write to one line. Slices of N
   elements from malloc's 16-byte alignment shared a line at each boundary between threads, and
   the threads' cores passed it back and forth on every pair of rows: float32 backward with
   dweight and dbias at (16384, 128), two threads, 1.6-2.8 ms against 0.8-1.1 ms with whole
   lines (dx alone 0.7-0.8 ms; AMD EPYC, AVX2; how much depends on where malloc put the buffer,
   which changes from one process to the next). */
typedef struct {
    acc_t* dwa;
    acc_t* dba;
    void* fwa;
    void* fba;
    i64 stride;
} grad_sums;

/* Fills *s (zeroed) for nt threads and rows of N; 0, or 2 when the buffer cannot be had. */
static int grad_sums_alloc(grad_sums* s, int nt, i64 N, size_t esize) {
    const i64 stride = (N + 15) / 16 * 16;
    const i64 nacc = 2 * (i64)nt * stride;
    const i64 nflt =
        (i64)((2 * (size_t)nt * (size_t)stride * esize + sizeof(acc_t) - 1) / sizeof(acc_t));
    acc_t* buf = zeroed_scratch(nacc + nflt);
    if (!buf) return 2;
    s->stride = stride;
    s->dwa = buf;
    s->dba = buf + (i64)nt * stride;
    s->fwa = buf + nacc;
    s->fba = (char*)s->fwa + (size_t)nt * (size_t)stride * esize;
    return 0;
}

/* Thread t's slices of the sums s holds (fwa/fba elements of `esize` bytes), or all NULL when it
   holds none (a zeroed grad_sums: no dw/db asked for). */
typedef struct {
    acc_t* dwa;
    acc_t* dba;
    void* fwa;
    void* fba;
} grad_slice;

static inline grad_slice grad_sums_slice(const grad_sums* s, i64 t, size_t esize) {
    grad_slice g = {NULL, NULL, NULL, NULL};
    if (!s->dwa) return g;
    const i64 off = t * s->stride;
    g.dwa = s->dwa + off;
    g.dba = s->dba + off;
    g.fwa = (char*)s->fwa + (size_t)off * esize;
    g.fba = (char*)s->fba + (size_t)off * esize;
    return g;
}

/* Sum per-thread float64 slices (nt of N elements, `stride` apart) into the first, in thread
   order. */
static void reduce_buffers(acc_t* buf, int nt, i64 N, i64 stride) {
    for (int t = 1; t < nt; ++t) {
        const acc_t* b = buf + (i64)t * stride;
        #pragma omp simd
        for (i64 j = 0; j < N; ++j) buf[j] += b[j];
    }
}

#endif
