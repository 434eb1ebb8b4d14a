/* Definitions shared by the norm kernels (norms.c) and the recurrent kernels (rnn_step.c,
   rnn_seq.c): the build target's vectors, the blocking of row sums, the split of work into
   contiguous parts. */
#ifndef LAYERNORM_CPU_COMMON_H
#define LAYERNORM_CPU_COMMON_H

#include <stdint.h>

typedef int64_t i64;
typedef double acc_t;

/* The widest vector the build's target (targets.py) has, and how many of them the register file
   holds. 64-byte GCC vectors on a target without AVX-512 compile to split code about 40x slower,
   so the width follows the target; whether the layers use the sequence kernels on a target is
   decided there too (Target.rnn_sequence). */
#if defined(__AVX512F__)
#define VEC_BYTES 64
#define VEC_REGISTERS 32
#elif defined(__AVX__)
#define VEC_BYTES 32
#define VEC_REGISTERS 16
#else
#define VEC_BYTES 16
#define VEC_REGISTERS 16
#endif

/* Row sums run in independent lanes (vectors of partial sums), each lane adding BLOCK_TERMS
   terms in the input precision before the block's lanes go into float64 partial sums: a float32
   row sum then carries the error of a float32 sum of BLOCK_TERMS + 1 terms at any N, where
   N / lanes sequential float32 adds per lane (an error growing with N) once cost 5.8 units of y
   at N = 2^22 with an offset of 1e4. */
#define BLOCK_TERMS 16

/* The end of a block of `len` elements that starts at j, within the first nfull elements. */
static inline i64 block_end(i64 j, i64 len, i64 nfull) { return j + len < nfull ? j + len : nfull; }

/* Part `part` of `parts` of n items (rows, panels): contiguous, sizes differing by at most one. */
static inline void row_block(i64 n, int parts, int part, i64* lo, i64* hi) {
    const i64 base = n / parts, rem = n % parts;
    *lo = part * base + (part < rem ? part : rem);
    *hi = *lo + base + (part < rem ? 1 : 0);
}

#endif
