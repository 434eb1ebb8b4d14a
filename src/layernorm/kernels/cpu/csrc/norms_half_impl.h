/* The norm kernels over one half type: included by norms.c after the float32 instantiation of
   norms_impl.h, with half_t (ln_bf16_t or ln_f16_t), SUF (bf16 or f16), TO_F32 and FROM_F32 (the
   row conversions of half.h), VEC_TO_F32 and ONE_TO_F32 (a vector's and an element's) and
   ROW_KIND (the row kind of norms_impl.h's sweeps) defined.

   Narrow rows (and AdaNorm's backward) convert a block of rows (see HALF_BLOCK_ELEMS in half.h)
   to float32, run the float32 kernel's own row function on it and round the result back to
   half_t; the forwards and the layer-norm and RMSNorm backwards of wider rows run the float32
   kernel's sweeps and expressions on the row where it lies, converting in registers (see
   DIRECT_MIN_N below). Statistics, gains, biases and their gradients are float32 (compute_t);
   with the half_params flag the gains and biases come in half_t, converted exactly once a call,
   and dweight goes back rounded once from its float32 sum (what a cast of the float32 result
   gives). So a half result is the float32 kernel's result on the exactly converted inputs,
   rounded once to nearest even: the float32 error model plus one rounding to the output type. */

#ifndef LAYERNORM_NORMS_HALF_ONCE
#define LAYERNORM_NORMS_HALF_ONCE

typedef int (*half_range_fn)(const void* args, i64 lo, i64 hi);
/* The float32 kernel's row function on one block of `rows` rows starting at row i: in[k] holds
   the k-th input's rows converted to float32, out receives the float32 result. */
typedef void (*half_block_fn)(const void* args, float* const* in, float* out, i64 i, i64 rows);

/* fn over rows [0, M), split as the float32 kernels split them; 0, or a failed call's status. */
static int half_parallel(const void* args, i64 M, int threads, half_range_fn fn) {
    if (threads <= 1) return fn(args, 0, M);
    int status = 0;
    #pragma omp parallel num_threads(threads)
    {
        i64 lo, hi;
        row_block(M, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        const int s = fn(args, lo, hi);
        if (s) {
            #pragma omp atomic write
            status = s;
        }
    }
    return status;
}

/* The float32 and float64 instances of cvt: their storage is their compute type. */
int cvt_f32(const cvt_args_f32* a) {
    const size_t n = (size_t)(a->M * a->N) * sizeof(float);
    if (n) {
        memcpy(a->xf, a->x, n);
        memcpy(a->y, a->yf, n);
    }
    return 0;
}

int cvt_f64(const cvt_args_f64* a) {
    const size_t n = (size_t)(a->M * a->N) * sizeof(double);
    if (n) {
        memcpy(a->xf, a->x, n);
        memcpy(a->y, a->yf, n);
    }
    return 0;
}

/* Elements from the first parameter vector of params_f32's allocation to the second: N rounded
   up to whole cache lines. */
static inline i64 half_param_stride(i64 N) { return (N + 15) / 16 * 16; }

/* The direct forwards (below): the narrowest row they take, their output chunk, their ops. */
#define DIRECT_MIN_N 65
#define OUT_CHUNK 256
enum { DIRECT_LN, DIRECT_RMS, DIRECT_ADA };
/* From this many columns the direct forwards read half gains and biases as they come, converting
   them in registers as x (the same values): their float32 copies, 8·N bytes, crowded x's rows out
   of the first-level cache. One thread, AMD EPYC Zen 4, float16 layer norm forward x torch's,
   float32 copies / in registers: (4096, 2048) 1.11 / 0.93, (2048, 4096) 1.08-1.14 / 0.90-0.91,
   (1024, 8192) 1.04 / 0.96; bfloat16 (2048, 4096) 0.94-1.03 / 0.81-0.88; narrower rows the
   other way: (4096, 768) 0.80 / 0.91, (1000, 1001) 0.78 / 0.94 (RESULTS.md, 2026-11-30). */
#define HALF_PARAMS_IN_REGISTERS_N 2048
/* Half values in a cache line. */
#define HALF_LINE 32
_Static_assert(HALF_PARAMS_IN_REGISTERS_N >= DIRECT_MIN_N, "a direct forward's width");

#endif

#define FN(name) LN_CAT(name, SUF)

int FN(cvt)(const FN(cvt_args)* a) {
    TO_F32(a->x, a->xf, a->M * a->N, NULL);
    FROM_F32(a->yf, a->y, a->M * a->N, 0);
    return 0;
}

/* Rows [lo, hi) of a kernel with one output row per input row (the forwards, AdaNorm's
   backward), in blocks: the rows of each of the n_in (1 or 2) inputs converted to float32, `run`
   on them, its output rounded back into y. */
static int FN(half_blocks)(const void* args, const half_t* const* inputs, int n_in, half_t* y,
                           i64 N, i64 lo, i64 hi, int stream, half_block_fn run) {
    const i64 R = half_block_rows(N, HALF_BLOCK_ELEMS);
    float* bufs[3];
    if (half_buffers(R * N, n_in + 1, bufs)) return 1;
    float* in[2] = {bufs[0], bufs[1]};
    float* out = bufs[n_in];
    for (i64 i = lo; i < hi; i += R) {
        const i64 rows = hi - i < R ? hi - i : R;
        const int ahead = i + 2 * R <= hi; /* a whole next block to prefetch (half_prefetch) */
        for (int k = 0; k < n_in; ++k)
            TO_F32(inputs[k] + i * N, in[k], rows * N,
                   ahead ? inputs[k] + (i + R) * N : NULL);
        run(args, in, out, i, rows);
        FROM_F32(out, y + i * N, rows * N, stream);
    }
    stream_fence(stream);
    return 0;
}

/* The float32 gain and bias of a call (either may be NULL): as given where half_params is 0
   (*owned then NULL), else converted exactly from half_t into one allocation of two vectors of
   N floats, half_param_stride(N) apart, *owned (freed by the caller), whose second a backward
   also uses for dweight's float32 sum. 0, or 1 when the allocation failed. */
static int FN(params_f32)(int half_params, const void** w, const void** b, i64 N,
                          float** owned) {
    *owned = NULL;
    if (!half_params) return 0;
    /* each on a cache line, as a tensor's: from malloc (16 bytes) every vector load of them
       straddled two lines (float16 layer norm forward at (2048, 4096): 1.5x the time) */
    const i64 stride = half_param_stride(N);
    void* p = NULL;
    if (posix_memalign(&p, 64, (size_t)(2 * stride) * sizeof(float))) return 1;
    float* buf = p;
    if (*w) {
        TO_F32(*w, buf, N, NULL);
        *w = buf;
    }
    if (*b) {
        TO_F32(*b, buf + stride, N, NULL);
        *b = buf + stride;
    }
    *owned = buf;
    return 0;
}

/* ------------------------------------------------------------------ forward --------------- */

/* The forwards of rows of DIRECT_MIN_N elements or more read each row where it lies: the
   statistics' sweeps load the half values and convert them in registers (row_variance_of and
   row_sum_sq_of of the float32 instance, ROW_KIND; rows of up to NARROW_N elements in groups, as
   the float32 forwards take them: norms_common.h), then the output goes out a chunk of OUT_CHUNK
   columns at a time (the float32 kernel's expression on the values converted in registers, rounded
   back), every buffer in the first-level cache. Converting whole blocks of rows first (half_blocks)
   wrote and read a float32 copy of every row, whose stores queued behind the output's (which miss
   the caches) and which no longer fit in the first-level cache past 2048 columns. The same
   arithmetic on the same values: the bits of half_blocks
   (test_half_forwards_are_the_float32_kernels_rounded_once). AMD EPYC Zen 4, x torch's layer norm
   forward, blocks / rows in place (with HALF_PARAMS_IN_REGISTERS_N), one thread: float16 layer norm
   (2048, 4096) 1.55-1.59 / 0.89-0.92, (16384, 256) 1.26-1.40 / 0.87-0.88, (4096, 768) 1.33-1.45 /
   0.81-0.83, AdaNorm (2048, 4096) 1.28-1.35 / 0.61-0.66; bfloat16 layer norm (2048, 4096) 1.18-1.26
   / 0.89-0.90; two threads alike (RESULTS.md, 2026-11-30). Narrower rows keep the blocks, whose
   float32 kernels take them in groups (norms_common.h: NARROW_N). */

/* A direct forward's arguments: the op's input and output, its gain and bias (NULL: none; in
   half_t where half_params is 1, else float32), its statistics (mean NULL for RMSNorm) and
   AdaNorm's constants. */
typedef struct {
    const half_t* x;
    half_t* y;
    const void* w;
    const void* b;
    float* mean;
    float* rstd;
    i64 N;
    double eps, k, scale;
    int op, half_params;
} FN(direct_job);

/* The loads of the output expressions (norms_common.h) in a chunk: x's half values converted in
   registers (a vector at k, or element k), the gain's and bias's float32 as they are. */
#define LOAD_VEC_K(p)                                                                           \
    _Generic((p), const half_t*: VEC_TO_F32((const half_t*)(const void*)(p) + k),               \
             const float*: f32_vec_load((const float*)(const void*)(p) + k))
#define LOAD_ONE_K(p)                                                                           \
    _Generic((p), const half_t*: ONE_TO_F32(((const half_t*)(const void*)(p))[k]),              \
             const float*: ((const float*)(const void*)(p))[k])
/* t[k] = EXPR for k in [0, n): whole vectors, then the rest one at a time. */
#define OUT_LOOP(EXPR)                                                                          \
    do {                                                                                        \
        i64 k = 0;                                                                              \
        for (; k + HALF_VF_LANES <= n; k += HALF_VF_LANES) {                                    \
            const half_vf v_ = EXPR(LOAD_VEC_K);                                                \
            memcpy(t + k, &v_, sizeof v_);                                                      \
        }                                                                                       \
        for (; k < n; ++k) t[k] = EXPR(LOAD_ONE_K);                                             \
    } while (0)

/* n <= OUT_CHUNK outputs of a row from its half elements xr and the gain w and bias b at the
   same columns (NULL: none; P: float32, or half_t converted in registers as x is), into t: the
   float32 kernels' expressions. */
#define DEFINE_OUT_CHUNK(NAME, P)                                                               \
    static inline __attribute__((always_inline)) void NAME(                                     \
        int op, const half_t* restrict xr, const P* restrict w, const P* restrict b, float mh,  \
        float ml, float rf, float c, float ck, float* restrict t, i64 n) {                     \
        if (op == DIRECT_ADA) OUT_LOOP(ADA_Z);                                                  \
        else if (op == DIRECT_RMS && w) OUT_LOOP(RMS_Y_W);                                      \
        else if (op == DIRECT_RMS) OUT_LOOP(RMS_Y);                                             \
        else if (w && b) OUT_LOOP(LN_Y_WB);                                                     \
        else if (w) OUT_LOOP(LN_Y_W);                                                           \
        else if (b) OUT_LOOP(LN_Y_B);                                                           \
        else OUT_LOOP(LN_XHAT);                                                                 \
    }
DEFINE_OUT_CHUNK(FN(out_chunk), float)
DEFINE_OUT_CHUNK(FN(out_chunk_half_params), half_t)
#undef DEFINE_OUT_CHUNK

/* The rows [lo, hi) of a direct forward whose gain and bias are P (float32 or half_t), by
   OUT_CHUNK_FN (one of the two above): a function for each, so that each row loop stays as lean
   as one kind alone (both kinds in one loop: float16 layer norm at (8192, 1024) 0.87-0.88 of
   torch's time against 0.76-0.81, one thread). */
#define DEFINE_DIRECT_RANGE(NAME, P, OUT_CHUNK_FN)                                              \
    static int NAME(const void* p, i64 lo, i64 hi) {                                            \
        const FN(direct_job)* jb = p;                                                           \
        const i64 N = jb->N;                                                                    \
        const float c = (float)jb->scale, ck = (float)(jb->scale * jb->k);                     \
        const P* w = jb->w;                                                                     \
        const P* b = jb->b;                                                                     \
        const int centred = jb->op != DIRECT_RMS, group = row_group_f32(N);                     \
        float t[OUT_CHUNK] __attribute__((aligned(64)));                                        \
        for (i64 i0 = lo; i0 < hi; i0 += group) {                                               \
            const int n = hi - i0 < group ? (int)(hi - i0) : group;                             \
            float gh[ROW_GROUP], gl[ROW_GROUP];                                                 \
            acc_t gr[ROW_GROUP];                                                                \
            group_stats_of_f32(jb->x, i0, n, N, jb->eps, centred, group, ROW_KIND, gh, gl, gr); \
            for (int q = 0; q < n; ++q) {                                                       \
                const i64 i = i0 + q;                                                           \
                const half_t* xrow = jb->x + i * N;                                             \
                half_t* yrow = jb->y + i * N;                                                   \
                const float mh = gh[q], ml = gl[q], rf = (float)gr[q];                          \
                if (centred) jb->mean[i] = mh;                                                  \
                jb->rstd[i] = rf;                                                               \
                for (i64 j = 0; j < N; j += OUT_CHUNK) {                                        \
                    const i64 n_ = N - j < OUT_CHUNK ? N - j : OUT_CHUNK;                       \
                    OUT_CHUNK_FN(jb->op, xrow + j, w ? w + j : NULL, b ? b + j : NULL, mh, ml,  \
                                 rf, c, ck, t, n_);                                             \
                    FROM_F32(t, yrow + j, n_, 0);                                               \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }
DEFINE_DIRECT_RANGE(FN(direct_range), float, FN(out_chunk))
DEFINE_DIRECT_RANGE(FN(direct_range_half_params), half_t, FN(out_chunk_half_params))
#undef DEFINE_DIRECT_RANGE

/* A direct forward over all rows, by the range function of its parameters' kind. */
static int FN(direct_run)(const FN(direct_job)* jb, i64 M, int threads) {
    return half_parallel(jb, M, threads,
                         jb->half_params ? FN(direct_range_half_params) : FN(direct_range));
}

static void FN(ln_fwd_block)(const void* p, float* const* in, float* out, i64 i, i64 rows) {
    const FN(ln_fwd_args)* a = p;
    const ln_fwd_args_f32 fa = {.x = in[0], .weight = a->weight, .bias = a->bias, .y = out,
                                .mean = a->mean + i, .rstd = a->rstd + i, .M = rows, .N = a->N,
                                .eps = a->eps, .threads = 1};
    ln_fwd_rows_f32(&fa, 0, rows);
}

static int FN(ln_fwd_range)(const void* p, i64 lo, i64 hi) {
    const FN(ln_fwd_args)* a = p;
    const half_t* in[] = {a->x};
    return FN(half_blocks)(p, in, 1, a->y, a->N, lo, hi, a->stream, FN(ln_fwd_block));
}

int FN(ln_fwd)(const FN(ln_fwd_args)* a) {
    if (a->N >= HALF_PARAMS_IN_REGISTERS_N) { /* half gains and biases as they come */
        const FN(direct_job) jb = {a->x, a->y, a->weight, a->bias, a->mean, a->rstd, a->N,
                                   a->eps, 0, 0, DIRECT_LN, a->half_params};
        return FN(direct_run)(&jb, a->M, a->threads);
    }
    FN(ln_fwd_args) f = *a; /* the same call with float32 parameters */
    float* owned;
    if (FN(params_f32)(a->half_params, &f.weight, &f.bias, a->N, &owned)) return 1;
    f.half_params = 0;
    const FN(direct_job) jb = {a->x, a->y, f.weight, f.bias, a->mean, a->rstd, a->N, a->eps, 0, 0,
                               DIRECT_LN, 0};
    const int status = a->N >= DIRECT_MIN_N
                           ? FN(direct_run)(&jb, a->M, a->threads)
                           : half_parallel(&f, f.M, f.threads, FN(ln_fwd_range));
    free(owned);
    return status;
}

static void FN(rms_fwd_block)(const void* p, float* const* in, float* out, i64 i, i64 rows) {
    const FN(rms_fwd_args)* a = p;
    const rms_fwd_args_f32 fa = {.x = in[0], .weight = a->weight, .y = out, .rstd = a->rstd + i,
                                 .M = rows, .N = a->N, .eps = a->eps, .threads = 1};
    rms_fwd_rows_f32(&fa, 0, rows);
}

static int FN(rms_fwd_range)(const void* p, i64 lo, i64 hi) {
    const FN(rms_fwd_args)* a = p;
    const half_t* in[] = {a->x};
    return FN(half_blocks)(p, in, 1, a->y, a->N, lo, hi, a->stream, FN(rms_fwd_block));
}

int FN(rms_fwd)(const FN(rms_fwd_args)* a) {
    if (a->N >= HALF_PARAMS_IN_REGISTERS_N) { /* a half gain as it comes */
        const FN(direct_job) jb = {a->x, a->y, a->weight, NULL, NULL, a->rstd, a->N, a->eps, 0, 0,
                                   DIRECT_RMS, a->half_params};
        return FN(direct_run)(&jb, a->M, a->threads);
    }
    FN(rms_fwd_args) f = *a; /* the same call with a float32 gain */
    const void* no_bias = NULL;
    float* owned;
    if (FN(params_f32)(a->half_params, &f.weight, &no_bias, a->N, &owned)) return 1;
    f.half_params = 0;
    const FN(direct_job) jb = {a->x, a->y, f.weight, NULL, NULL, a->rstd, a->N, a->eps, 0, 0,
                               DIRECT_RMS, 0};
    const int status = a->N >= DIRECT_MIN_N
                           ? FN(direct_run)(&jb, a->M, a->threads)
                           : half_parallel(&f, f.M, f.threads, FN(rms_fwd_range));
    free(owned);
    return status;
}

static void FN(ada_fwd_block)(const void* p, float* const* in, float* out, i64 i, i64 rows) {
    const FN(ada_fwd_args)* a = p;
    const ada_fwd_args_f32 fa = {.x = in[0], .z = out, .mean = a->mean + i, .rstd = a->rstd + i,
                                 .M = rows, .N = a->N, .eps = a->eps, .k = a->k,
                                 .scale = a->scale, .threads = 1};
    ada_fwd_rows_f32(&fa, 0, rows);
}

static int FN(ada_fwd_range)(const void* p, i64 lo, i64 hi) {
    const FN(ada_fwd_args)* a = p;
    const half_t* in[] = {a->x};
    return FN(half_blocks)(p, in, 1, a->z, a->N, lo, hi, a->stream, FN(ada_fwd_block));
}

int FN(ada_fwd)(const FN(ada_fwd_args)* a) {
    const FN(direct_job) jb = {a->x, a->z, NULL, NULL, a->mean, a->rstd, a->N, a->eps, a->k,
                               a->scale, DIRECT_ADA, 0};
    if (a->N >= DIRECT_MIN_N) return FN(direct_run)(&jb, a->M, a->threads);
    return half_parallel(a, a->M, a->threads, FN(ada_fwd_range));
}

/* ------------------------------------------------------------------ backward -------------- */

static void FN(ada_bwd_block)(const void* p, float* const* in, float* out, i64 i, i64 rows) {
    const FN(ada_bwd_args)* a = p;
    const ada_bwd_args_f32 fa = {.dz = in[0], .x = in[1], .mean = a->mean + i,
                                 .rstd = a->rstd + i, .dx = out, .M = rows, .N = a->N,
                                 .k = a->k, .scale = a->scale, .threads = 1};
    ada_bwd_rows_f32(&fa, 0, rows);
}

static int FN(ada_bwd_range)(const void* p, i64 lo, i64 hi) {
    const FN(ada_bwd_args)* a = p;
    const half_t* in[] = {a->dz, a->x};
    return FN(half_blocks)(p, in, 2, a->dx, a->N, lo, hi, a->stream, FN(ada_bwd_block));
}

int FN(ada_bwd)(const FN(ada_bwd_args)* a) {
    return half_parallel(a, a->M, a->threads, FN(ada_bwd_range));
}

/* The layer-norm and RMSNorm backwards (bwd_job_f32's contract, with half_t rows). */
typedef struct {
    const half_t* dy;
    const half_t* x;
    const float* mean;
    const float* rstd;
    const float* w;
    half_t* dx;
    float* dw;
    float* db;
    i64 M, N;
    int detach_mean, detach_std, threads, stream;
} FN(bwd_job);

/* Rows [lo, hi) of fewer than DIRECT_MIN_N elements (bwd_rows_range), converted a block at a
   time and handed to the float32 bwd_rows, which adds the block's dw/db terms to this thread's
   accumulators (flushed to float64 every FLUSH rows across blocks, and at hi). Blocks hold an
   even number of rows (16 or more at these widths and the default HALF_BLOCK_ELEMS), so the
   float32 code's pairs of rows never straddle two blocks: its bits, dweight's and dbias's too. */
static int FN(bwd_range)(const FN(bwd_job)* jb, acc_t* dwa, acc_t* dba, float* fwa, float* fba,
                         i64 lo, i64 hi) {
    const i64 N = jb->N;
    i64 R = half_block_rows(N, HALF_BLOCK_ELEMS);
    if (R > 1) R -= R % 2;
    int pending = 0;
    float* bufs[3];
    if (half_buffers(R * N, 3, bufs)) return 1;
    float *dyf = bufs[0], *xf = bufs[1], *dxf = bufs[2];
    for (i64 i = lo; i < hi; i += R) {
        const i64 rows = hi - i < R ? hi - i : R;
        const int ahead = i + 2 * R <= hi; /* a whole next block to prefetch (half_prefetch) */
        TO_F32(jb->dy + i * N, dyf, rows * N,
               ahead ? jb->dy + (i + R) * N : NULL);
        TO_F32(jb->x + i * N, xf, rows * N, ahead ? jb->x + (i + R) * N : NULL);
        const bwd_job_f32 fj = {.dy = dyf, .x = xf, .mean = jb->mean ? jb->mean + i : NULL,
                                .rstd = jb->rstd + i, .w = jb->w, .dx = jb->dx ? dxf : NULL,
                                .dw = NULL, .db = NULL, .M = rows, .N = N,
                                .detach_mean = jb->detach_mean, .detach_std = jb->detach_std,
                                .threads = 1};
        bwd_rows_f32(&fj, dwa, dba, fwa, fba, 0, rows, &pending, i + rows == hi);
        if (jb->dx) FROM_F32(dxf, jb->dx + i * N, rows * N, jb->stream);
    }
    stream_fence(jb->stream);
    return 0;
}

/* n <= OUT_CHUNK elements of a row's dx from its half dy and x elements and the float32 gain at
   the same columns, into t: the float32 kernels' expression (LN_DX). */
static inline __attribute__((always_inline)) void FN(dx_chunk)(
    const half_t* restrict dyr, const half_t* restrict xr, const float* restrict w, float mf,
    float rf, float c1, float c2, float* restrict t, i64 n) {
    OUT_LOOP(LN_DX);
}

/* Rows [lo, hi) of a backward of rows of DIRECT_MIN_N elements or more, read where they lie: the
   float32 instance's sums over the row kind (row_pair_grad_sums_of / row_grad_sums_of with
   ROW_KIND: the same rows in pairs (paired_rows), the same flushes every FLUSH rows and at hi
   as its bwd_rows), then dx a chunk of OUT_CHUNK columns at a time by the float32 expression on
   the values converted in registers, rounded back. Converting blocks of rows (bwd_range) wrote and
   read float32 copies of dy, x and dx: three rows of N floats, past the first-level cache from
   2048 columns on. The float32 kernel's bits, dweight's and dbias's too, where blocks of one row
   (rows past half a block) had summed them one row at a time
   (test_half_backwards_are_the_float32_kernels_rounded_once). */
static int FN(bwd_direct_range)(const FN(bwd_job)* jb, acc_t* dwa, acc_t* dba, float* fwa,
                                float* fba, i64 lo, i64 hi) {
    const i64 N = jb->N;
    const float* w = jb->w;
    const int need_sums = jb->dx && !(jb->detach_mean && jb->detach_std);
    const acc_t inv_n = ROW_INV_N(N);
    float t[OUT_CHUNK] __attribute__((aligned(64)));
    int pending = 0;
    for (i64 i = lo; i < hi;) {
        const int rows = (dwa && paired_rows(N) && i + 1 < hi) ? 2 : 1;
        float m[2], r[2];
        acc_t sg[2] = {0, 0}, sgx[2] = {0, 0};
        for (int k = 0; k < rows; ++k) {
            m[k] = jb->mean ? jb->mean[i + k] : 0;
            r[k] = jb->rstd[i + k];
        }
        const half_t *dy0 = jb->dy + i * N, *x0 = jb->x + i * N;
        if (rows == 2)
            row_pair_grad_sums_of_f32(dy0, x0, dy0 + N, x0 + N, w, m, r, N, fwa, fba, sg, sgx,
                                      ROW_KIND);
        else if (need_sums || dwa)
            row_grad_sums_of_f32(dy0, x0, w, m[0], r[0], N, fwa, fba, sg, sgx, ROW_KIND);
        pending += rows;
        if (dwa && (pending >= FLUSH || i + rows == hi)) {
            flush_sums_f32(dwa, dba, fwa, fba, N);
            pending = 0;
        }
        for (int k = 0; jb->dx && k < rows; ++k) {
            const half_t* dyr = dy0 + k * N;
            const half_t* xr = x0 + k * N;
            half_t* dxr = jb->dx + (i + k) * N;
            const float c1 = jb->detach_mean ? 0 : (float)(sg[k] * inv_n);
            const float c2 = jb->detach_std ? 0 : (float)(sgx[k] * inv_n);
            const i64 ahead = i + rows + k; /* the next rows' dy and x, asked for meanwhile */
            for (i64 j = 0; j < N; j += OUT_CHUNK) {
                const i64 n = N - j < OUT_CHUNK ? N - j : OUT_CHUNK;
                for (i64 q = 0; ahead < hi && q < n; q += HALF_LINE) {
                    __builtin_prefetch(jb->dy + ahead * N + j + q);
                    __builtin_prefetch(jb->x + ahead * N + j + q);
                }
                FN(dx_chunk)(dyr + j, xr + j, w + j, m[k], r[k], c1, c2, t, n);
                FROM_F32(t, dxr + j, n, jb->stream);
            }
        }
        i += rows;
    }
    stream_fence(jb->stream);
    return 0;
}

/* A backward's rows [lo, hi): read in place from DIRECT_MIN_N elements, else in blocks. */
static int FN(bwd_rows_range)(const FN(bwd_job)* jb, acc_t* dwa, acc_t* dba, float* fwa,
                              float* fba, i64 lo, i64 hi) {
    if (jb->N >= DIRECT_MIN_N) return FN(bwd_direct_range)(jb, dwa, dba, fwa, fba, lo, hi);
    return FN(bwd_range)(jb, dwa, dba, fwa, fba, lo, hi);
}

static int FN(bwd_run)(FN(bwd_job)* jb) {
    const i64 N = jb->N;
    const int nt = jb->threads < 1 ? 1 : jb->threads;
    if (!jb->w && !(jb->w = ones_f32(N))) return 1;
    /* per thread: float64 dw/db sums, then float32 blocks of rows (as bwd_run_f32) */
    grad_sums gs = {NULL, NULL, NULL, NULL, 0};
    if ((jb->dw || jb->db) && grad_sums_alloc(&gs, nt, N, sizeof(float))) return 2;
    int status = 0;
    if (nt == 1) {
        const grad_slice g = grad_sums_slice(&gs, 0, sizeof(float));
        status = FN(bwd_rows_range)(jb, g.dwa, g.dba, g.fwa, g.fba, 0, jb->M);
    } else {
        #pragma omp parallel num_threads(nt)
        {
            const i64 t = omp_get_thread_num();
            i64 lo, hi;
            row_block(jb->M, omp_get_num_threads(), (int)t, &lo, &hi);
            const grad_slice g = grad_sums_slice(&gs, t, sizeof(float));
            const int s = FN(bwd_rows_range)(jb, g.dwa, g.dba, g.fwa, g.fba, lo, hi);
            if (s) {
                #pragma omp atomic write
                status = s;
            }
        }
    }
    if (status) return status;
    if (jb->dw) {
        reduce_buffers(gs.dwa, nt, N, gs.stride);
        for (i64 j = 0; j < N; ++j) jb->dw[j] = (float)gs.dwa[j];
    }
    if (jb->db) {
        reduce_buffers(gs.dba, nt, N, gs.stride);
        for (i64 j = 0; j < N; ++j) jb->db[j] = (float)gs.dba[j];
    }
    return 0;
}

/* bwd_run with the job's weight and dweight in half_t where half_params is 1: the weight
   converted for the float32 code, dweight summed in float32 (the second half of the conversion's
   allocation) and rounded into the caller's half_t vector. */
static int FN(bwd_run_params)(FN(bwd_job)* jb, int half_params) {
    const void* w = jb->w;
    const void* no_bias = NULL;
    void* dweight = jb->dw;
    float* owned;
    if (FN(params_f32)(half_params && (w || dweight), &w, &no_bias, jb->N, &owned)) return 1;
    jb->w = w;
    if (owned && dweight) jb->dw = owned + half_param_stride(jb->N);
    const int status = FN(bwd_run)(jb);
    if (!status && owned && dweight) FROM_F32(jb->dw, dweight, jb->N, 0);
    free(owned);
    return status;
}

int FN(ln_bwd)(const FN(ln_bwd_args)* a) {
    FN(bwd_job) jb = {a->dy, a->x, a->mean, a->rstd, a->weight, a->dx, a->dweight, a->dbias,
                      a->M, a->N, a->detach_mean, a->detach_std, a->threads, a->stream};
    return FN(bwd_run_params)(&jb, a->half_params);
}

int FN(rms_bwd)(const FN(rms_bwd_args)* a) {
    FN(bwd_job) jb = {a->dy, a->x, NULL, a->rstd, a->weight, a->dx, a->dweight, NULL,
                      a->M, a->N, 1, 0, a->threads, a->stream};
    return FN(bwd_run_params)(&jb, a->half_params);
}

#undef OUT_LOOP
#undef LOAD_VEC_K
#undef LOAD_ONE_K
#undef FN
