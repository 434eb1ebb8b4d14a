/* Definitions shared by every instantiation of the norm kernels (norms_impl.h). */
#ifndef LAYERNORM_NORMS_COMMON_H
#define LAYERNORM_NORMS_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
typedef double acc_t;

/* Row sums run in LANES independent partial sums, two vectors of the build's widest registers
   (norms_impl.h: LANES = 2·VL, HALF = VL; 32 float32 lanes with AVX-512, 16 with AVX2): a single
   running sum would wait on the add latency every step and run at a fraction of the speed.
   Blocks: each lane adds BLOCK_TERMS terms in the input precision, pairs of lanes are added (one
   more add) and the HALF results go into float64 partial sums, folded pairwise at the end of the
   row. A float32 row sum then carries the error of a float32 sum of BLOCK_TERMS + 1 terms at any
   N, where N / LANES sequential float32 adds per lane (an error growing with N) once cost 5.8
   units of y at N = 2^22 with an offset of 1e4. */
#define BLOCK_TERMS 16
#if defined(__AVX512F__)
#define NORM_VEC_BYTES 64
#define NORM_VEC_REGISTERS 32
#elif defined(__AVX__)
#define NORM_VEC_BYTES 32
#define NORM_VEC_REGISTERS 16
#else
#define NORM_VEC_BYTES 16
#define NORM_VEC_REGISTERS 16
#endif
/* Rows whose dweight/dbias terms are summed in the input precision before a float64 flush. */
#define FLUSH 16

/* Token pasting through one more macro level, so SUF is expanded before it is pasted. */
#define LN_CAT_(a, b) a##_##b
#define LN_CAT(a, b) LN_CAT_(a, b)

/* Rows [lo, hi) of M for thread tid of nt: contiguous blocks whose sizes differ by at most one. */
static void row_block(i64 M, int nt, int tid, i64* lo, i64* hi) {
    const i64 base = M / nt, rem = M % nt;
    *lo = tid * base + (tid < rem ? tid : rem);
    *hi = *lo + base + (tid < rem ? 1 : 0);
}

/* Sum of the n (a power of two) float64 partial sums, folded pairwise; destroys p. */
static inline acc_t fold_half(acc_t* p, int n) {
    for (int w = n / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) p[l] += p[l + w];
    return p[0];
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

/* Sum per-thread float64 buffers (nt blocks of N) into the first one, in thread order. */
static void reduce_buffers(acc_t* buf, int nt, i64 N) {
    for (int t = 1; t < nt; ++t) {
        const acc_t* b = buf + (i64)t * N;
        #pragma omp simd
        for (i64 j = 0; j < N; ++j) buf[j] += b[j];
    }
}

#endif
