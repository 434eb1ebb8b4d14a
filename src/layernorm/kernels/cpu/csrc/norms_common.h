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
   and the HALF results go into float64 partial sums, folded pairwise at the end of the row. */
/* Rows whose dweight/dbias terms are summed in the input precision before a float64 flush. */
#define FLUSH 16

/* Token pasting through one more macro level, so SUF is expanded before it is pasted. */
#define LN_CAT_(a, b) a##_##b
#define LN_CAT(a, b) LN_CAT_(a, b)

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
