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

/* The processor's cache line: the unit of the scratch buffers' alignment. */
#define CACHE_LINE 64

/* What a streamed output row (a run of contiguous output) writes by non-temporal stores: all of
   it when it is whole cache lines (STREAM_UNIT); else, when it takes at least
   STREAM_SPLIT_MIN_BYTES, its whole lines, the partial lines at its ends (which the rows before
   and after it share) by plain stores; a shorter run that is not whole lines goes out by plain
   stores alone (norms_impl.h ROW_OUT, half.h HALF_ROW_OUT). AMD EPYC Zen 3, AVX2 build, one
   thread, layer norm forward and backward with streamed outputs: a line written partly by each
   kind of store (the earlier rule, whole vectors streamed) took float32 (100000, 36) 2.4-2.6x,
   (50000, 100) 1.9x and (16384, 650) 1.3-1.5x the time of whole lines streamed; against plain
   stores, whole lines streamed took float32 (100000, 36) 1.5-1.8x and (50000, 100) 1.2-1.3x the
   time, (25000, 200) 0.84-1.0x, (16384, 500) 0.84-0.88x, (8192, 1300) 0.65-0.75x, and the
   bfloat16 backward's 512-byte parts of rows of 100-1300 elements 1.2-1.7x (RESULTS.md,
   2026-12-01). -DSTREAM_UNIT=VEC_BYTES -DSTREAM_SPLIT_MIN_BYTES=0 builds the earlier rule for
   A/B. */
#ifndef STREAM_UNIT
#define STREAM_UNIT CACHE_LINE
#endif
#ifndef STREAM_SPLIT_MIN_BYTES
#define STREAM_SPLIT_MIN_BYTES 768
#endif

/* The part [*head, *body_end) of a run of n elements of `size` bytes at dst that a streamed
   output writes by non-temporal stores (STREAM_UNIT): 0 and 0 for none. */
static inline void stream_body(const void* dst, i64 n, i64 size, i64* head, i64* body_end) {
    const i64 unit = STREAM_UNIT / size;
    i64 h = (i64)((STREAM_UNIT - (uintptr_t)dst % STREAM_UNIT) % STREAM_UNIT) / size;
    if (h > n) h = n;
    const i64 end = h + (n - h) / unit * unit;
    const int whole = h == 0 && end == n;
    if (!whole && n * size < STREAM_SPLIT_MIN_BYTES) {
        *head = *body_end = 0;
        return;
    }
    *head = h;
    *body_end = end;
}

/* The end of a block of `len` elements that starts at j, within the first nfull elements. */
static inline i64 block_end(i64 j, i64 len, i64 nfull) { return j + len < nfull ? j + len : nfull; }

/* Part `part` of `parts` of n items (rows, panels): contiguous, sizes differing by at most one. */
static inline void row_block(i64 n, int parts, int part, i64* lo, i64* hi) {
    const i64 base = n / parts, rem = n % parts;
    *lo = part * base + (part < rem ? part : rem);
    *hi = *lo + base + (part < rem ? 1 : 0);
}

#endif
