/* Definitions shared by the recurrent kernels (rnn_step.c, rnn_seq.c) and every instantiation of
   their templates (rnn_step_impl.h, rnn_seq_impl.h). */
#ifndef LAYERNORM_RNN_COMMON_H
#define LAYERNORM_RNN_COMMON_H

#include <limits.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "layernorm_rnn_abi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h> /* the masked loads of a row's tail (rnn_step_impl.h: sld_tail) */
#endif

/* Up to this many rows in all its steps a forward sequence kernel reads W_hh and W_ih as stored
   instead of packing them (see gemm_nt_direct in rnn_seq_impl.h); rnn_direct_rows() tells
   Python. */
#ifndef DIRECT_ROWS
#define DIRECT_ROWS 8
#endif

/* Token pasting through one more macro level, so SUF is expanded before it is pasted. */
#define RNN_CAT_(a, b) a##_##b
#define RNN_CAT(a, b) RNN_CAT_(a, b)

/* fast_expf's clamp of x, as variables whose values the compiler may not assume (weak: another
   definition could replace them; nothing writes them). With the constants written in, GCC
   computed exp of the unclamped x and then selected the constants' own results for the lanes
   out of range: four compares, two ands and three blends a vector, where the clamp is one max
   and one min (which pass a NaN on, as the comparisons do). An LN-LSTM forward row in cache,
   AMD EPYC (Zen 4), H = 128: the gate loops' vector body 31 -> 23 instructions. */
__attribute__((weak, visibility("hidden"))) float fast_exp_lo = -87.0f;
__attribute__((weak, visibility("hidden"))) float fast_exp_hi = 88.0f;

/* float32 exp without a libm call, so the gate loops vectorize: exp(x) = 2^n · e^r with
   n = round(x / ln 2), r = x − n·ln 2 (ln 2 split in two for exactness) and a degree-6 minimax
   polynomial for e^r on [−ln2/2, ln2/2] (the Cephes expf coefficients), max relative error about
   2 ulp. x is clamped to [−87, 88] so 2^n stays a normal float. Always inlined, as fast_tanhf:
   called out of line (GCC's inliner gives up on a large enough caller) every gate loop that uses
   them becomes a call per element (an LN-LSTM forward step with groups of eight rows, AMD Zen 5:
   fast_tanhf a third of an inference call's samples, 1.53 -> 2.06x torch.nn.LSTM's time). */
static inline __attribute__((always_inline)) float fast_expf(float x) {
    x = x < fast_exp_lo ? fast_exp_lo : x; /* a NaN passes through as NaN */
    x = x > fast_exp_hi ? fast_exp_hi : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n from n's bits: n + 1.5·2^23 holds n in its low mantissa bits (|n| < 2^22), so n is not
       converted to an integer (undefined in C for a NaN's n, whose p is NaN already) */
    union { float f; uint32_t u; } t = {n + 0x1.8p23f}, scale;
    scale.u = (t.u - 0x4B400000u + 127u) << 23;
    return p * scale.f;
}

/* tanh(x) = sign(x)·(1 − e)/(1 + e), e = exp(−2|x|): absolute error about 1e-7. */
static inline __attribute__((always_inline)) float fast_tanhf(float x) {
    const float e = fast_expf(-2.0f * fabsf(x));
    const float t = (1.0f - e) / (1.0f + e);
    return x < 0 ? -t : t;
}

/* The float64 counterparts, so that the double gate loops vectorize too (with libm's exp and
   tanh called per element, 39% of an LN-LSTM float64 inference call went to them: AVX-512 build,
   (100, 32, 128, 256), Intel Xeon). expm1 of |r| <= ln2/2 by its Taylor polynomial of degree 13
   (the next term below 4e-18 of the result), as r + r²·q(r) so that a small r keeps its relative
   accuracy; exp(x) = 2^n · (1 + expm1(r)) with n = round(x / ln 2), r = x − n·ln 2 (ln 2 in
   fdlibm's two parts, n·ln2_hi exact), x clamped to [−708, 709] so that 2^n stays a normal double
   (an exp of less than e^−708 comes out as e^−708, 3e-308: below any gate's resolution); tanh
   from expm1(−2|x|). Within 1 ulp of libm's exp, 4 of its tanh and of the sigmoid over their
   ranges (tests/test_rnn_gate_math.py). NaN passes through each. */
__attribute__((weak, visibility("hidden"))) double fast_exp_lo_d = -708.0;
__attribute__((weak, visibility("hidden"))) double fast_exp_hi_d = 709.0;

static inline __attribute__((always_inline)) double expm1_reduced(double r) {
    double q = 1.0 / 6227020800.0;
    q = q * r + 1.0 / 479001600.0;
    q = q * r + 1.0 / 39916800.0;
    q = q * r + 1.0 / 3628800.0;
    q = q * r + 1.0 / 362880.0;
    q = q * r + 1.0 / 40320.0;
    q = q * r + 1.0 / 5040.0;
    q = q * r + 1.0 / 720.0;
    q = q * r + 1.0 / 120.0;
    q = q * r + 1.0 / 24.0;
    q = q * r + 1.0 / 6.0;
    q = q * r + 0.5;
    return r + r * r * q;
}

static inline __attribute__((always_inline)) double fast_exp(double x) {
    x = x < fast_exp_lo_d ? fast_exp_lo_d : x; /* a NaN passes through as NaN */
    x = x > fast_exp_hi_d ? fast_exp_hi_d : x;
    /* n rounded to nearest in the low mantissa bits of t (|n| < 2^51), as fast_expf does */
    const double t = x * 1.4426950408889634 + 0x1.8p52;
    const double n = t - 0x1.8p52;
    const double r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    union { double d; uint64_t u; } bits = {t}, scale;
    scale.u = (bits.u - 0x4338000000000000ull + 1023u) << 52;
    return (1.0 + expm1_reduced(r)) * scale.d;
}

/* expm1(y) for y <= 0: the polynomial near 0, else exp(y) − 1 (>= 0.29 in size there: no
   cancellation). */
static inline __attribute__((always_inline)) double fast_expm1_neg(double y) {
    return y > -0.34657359027997264 ? expm1_reduced(y) : fast_exp(y) - 1.0;
}

/* tanh(x) = sign(x)·|expm1(−2|x|)| / (2 + expm1(−2|x|)). */
static inline __attribute__((always_inline)) double fast_tanh(double x) {
    const double e = fast_expm1_neg(-2.0 * fabs(x));
    return copysign(fabs(e) / (2.0 + e), x);
}

/* Threads for `work` units split `parts` ways, at least `grain` units each, at most `nt`. */
static inline int threads_for(i64 work, i64 parts, i64 grain, int nt) {
    i64 n = work / grain;
    n = n < parts ? n : parts;
    n = n < nt ? n : nt;
    return n < 1 ? 1 : (int)n;
}

/* A barrier for the threads of one sequence call, which meet twice per time step (after the
   step's GEMM, after its rows). It spins (4096 pauses, some 100 µs: longer than a thread normally
   waits for the others' share of a step), then yields the CPU between checks, so that a thread
   waiting for one that has no CPU (more threads than cores) lets it run. With OpenMP's
   fork-join per step the threads went to sleep between steps here (libgomp throttles its
   spinning when it manages more threads than there are CPUs) and a wake-up cost more than a
   step's rows (LN-LSTM inference at (200, 16, 64, 256), 2 threads: splitting the rows' work over
   both made the call 18% slower).
   Sense by phase: a thread reads the phase before it arrives, the last to arrive resets the
   count and advances the phase. */
typedef struct {
    atomic_int count;
    atomic_int phase;
} team_barrier;

static inline void team_init(team_barrier* b) {
    atomic_init(&b->count, 0);
    atomic_init(&b->phase, 0);
}

static inline void team_wait(team_barrier* b, int n) {
    if (n <= 1) return;
    const int phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
        return;
    }
    for (long spins = 0; atomic_load_explicit(&b->phase, memory_order_acquire) == phase; ++spins) {
        if (spins < (1L << 12)) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

/* A team of at most as many threads as the process has CPUs: threads that wait by spinning for
   a thread without a CPU stall the call (4 threads on 2 CPUs: LN-LSTM inference at
   (200, 16, 64, 256) took 9x torch's time, against 1.2x when the team keeps to the CPUs). */
static inline int team_cap(int team) {
    const int cpus = omp_get_num_procs();
    return team < cpus ? team : (cpus < 1 ? 1 : cpus);
}

/* Whether a step's rows [off, off + rows) lie in the N rows of the sequence buffers and its
   first `rows` rows in the B rows of the state buffers: a step outside them is refused
   (RNN_ERR_ROWS) before any memory is touched. */
static inline int rows_in_range(i64 off, i64 rows, i64 N, i64 B) {
    return off >= 0 && rows >= 0 && rows <= B && off <= N - rows;
}

/* Ask for `bytes` bytes at p to be brought into L2 (prefetcht1, one per 64-byte line). The
   sequence kernels call it on a step's rows of gx before the step's GEMM: those rows are read
   once, straight from memory, and the GEMM's few microseconds hide the fetch that the step's
   pointwise code would otherwise wait for (it was a third of that code's time at 4 rows). */
static inline void prefetch_l2(const void* p, i64 bytes) {
    for (i64 i = 0; i < bytes; i += 64) __builtin_prefetch((const char*)p + i, 0, 2);
}

/* Ask for `bytes` bytes at p to be brought into L1 (prefetcht0, one per 64-byte line): the
   backward rows functions' reads of a row a few rows ahead (BWD_PREFETCH_ROWS). */
static inline void prefetch_l1(const void* p, i64 bytes) {
    for (i64 i = 0; i < bytes; i += 64) __builtin_prefetch((const char*)p + i, 0, 3);
}

/* A forward step's kept buffers (rnn_abi.py: R rows) hold every row of the sequence (R = N, for
   backward) or only the step's (R = B, inference: state row i, overwritten each step). */
/* Whether an LSTM backward step finds c_{t−1}: kept (cprev), or taken from the step before,
   which needs c0 and steps of all B rows (see carried_before in rnn_step_impl.h). */
static inline int carried_before_valid(const void* cprev, const void* c0, i64 off, i64 rows,
                                       i64 N, i64 B) {
    if (cprev) return 1;
    return c0 && B > 0 && rows == B && N % B == 0 && off % B == 0;
}
static inline int kept_rows_valid(i64 R, i64 N, i64 B) { return R == N || R == B; }
static inline i64 kept_row(i64 R, i64 N, i64 row, i64 i) { return R == N ? row : i; }
/* In a padded sequence (every step B rows), the row of the step before `row` in the order the
   steps ran (B rows earlier forward in time, B rows later in reverse), or -1 for the first step's
   rows, whose previous state is the initial one: where the backward takes a previous state (the
   LSTM's c_{t−1}, the GRU's h_{t−1}) from the step before instead of a kept copy. */
static inline i64 row_before(i64 row, i64 N, i64 B, int reverse) {
    if (reverse) return row >= N - B ? -1 : row + B;
    return row < B ? -1 : row - B;
}
/* The LN-GRU backward's dgh: N rows, or B (a step's scratch) only where layer norms make dhp a
   buffer of its own (without them dgh is dhp, which the caller reads after the loop). */
static inline int dgh_rows_valid(i64 D, i64 N, i64 B, int layer_norm) {
    return D == N || (D == B && layer_norm);
}
/* Whether a GRU backward step (struct pointer a) of rows [off, off + rows) finds its buffers:
   dgh of N rows or a scratch of B, h_{t−1} kept or taken from the step before (h0, y and steps
   of all B rows, as the LSTM's c_{t−1}). */
#define GRU_BWD_ROWS_VALID(a, off, rows)                                   \
    (dgh_rows_valid((a)->D, (a)->N, (a)->B, (a)->layer_norm) &&            \
     carried_before_valid((a)->hprev, (a)->y ? (a)->h0 : NULL, (off), (rows), (a)->N, (a)->B))

/* Whether a forward kernel's projection arguments agree (rnn_abi.py, _PROJECTION): none (gx of N
   rows given), or x and w_ih both, a split in (0, G], and gx of B rows written each step
   (inference) or of N rows, each step's kept (training). */
static inline int projection_valid(const void* x, const void* w_ih, i64 split, i64 G, i64 X,
                                   i64 N, i64 B) {
    if (!x) return !w_ih && X == N;
    return w_ih && split > 0 && split <= G && (X == B || X == N);
}

/* Whether a forward kernel's recurrent-projection arguments agree (rnn_abi.py,
   _RECURRENT_PROJECTION): none (P = H), or w_hr with hr and out_r for a kernel that takes it
   (the LSTM's: takes), in inference (R = B: kept buffers of the batch's rows, which a call of
   one step of all B rows, N = B, has either way) and without zoneout of h (zh, which would act
   on the projected units). */
static inline int recurrent_projection_valid(const void* w_hr, const void* hr, const void* out_r,
                                             i64 P, i64 H, int takes, i64 R, i64 B,
                                             const void* zh) {
    if (!w_hr) return !hr && !out_r && P == H;
    return takes && hr && out_r && R == B && !zh;
}

/* Whether a forward kernel's bfloat16 weights (rnn_abi.py, _HALF_WEIGHTS) agree: none, or w_half
   for a float kernel (is_float) of one step without w_hr, with w_ih_half exactly when x is given
   (every GEMM of the call then reads a bfloat16 weight: none reads the float ones). */
static inline int half_weights_valid(const void* w_half, const void* w_ih_half, const void* x,
                                     const void* w_hr, i64 n_steps, int is_float) {
    if (!w_half) return !w_ih_half;
    return is_float && n_steps == 1 && !w_hr && !x == !w_ih_half;
}

/* Whether a backward kernel's projection-gradient arguments agree (rnn_abi.py, _PROJECTION_GRAD):
   none, or w_ih and dx both, for a kernel that has dgx rows to multiply (has_dgx). */
static inline int projection_grad_valid(const void* w_ih, const void* dx, int has_dgx) {
    return !w_ih == !dx && (!dx || has_dgx);
}

/* Whether an LSTM kernel's input-side layer norm (rnn_abi.py, _INPUT_NORM_*) is off (no w0) or
   whole: w0 with `given` (forward: b0, mx and rx; backward: gx, mx and rx) and layer_norm. */
static inline int input_norm_valid(const void* w0, int given, int layer_norm) {
    return !w0 || (given && layer_norm);
}

/* Whether a team splits the sequence by batch rows instead of sharing every step: each thread
   then runs its own rows [lo, hi) of the batch through all steps, GEMMs included (row i of a
   step needs row i of the last step only), and the threads never wait for one another, where a
   shared step meets twice at a barrier and hands each step's GEMM output across cores. It
   takes every step to have all B rows (else the lower rows, in more steps, would load one
   thread), at least two rows per thread, and packed weights (`bytes`) within `limit`
   (rnn_set_batch_split_bytes; rnn.py sets it by processor): every thread then reads all of
   them every step, where past the limit the panel split, each thread reading its share of the
   panels, wins. */
static inline int batch_split(const i64* steps, i64 n_steps, i64 B, int team, i64 bytes,
                              i64 limit) {
    if (team < 2 || B < 2 * team || bytes > limit) return 0;
    for (i64 k = 0; k < n_steps; ++k)
        if (steps[2 * k + 1] != B) return 0;
    return 1;
}

#endif
