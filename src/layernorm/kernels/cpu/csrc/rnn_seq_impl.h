/* The recurrent layers' whole-sequence kernels over one scalar type: included by rnn_seq.c with
   scalar_t and SUF defined; every external name ends in _SUF.

   A *_seq kernel runs a whole direction of a sequence in one call: per step the recurrent GEMM
   h_{t−1} W_hhᵀ (forward) or dhp · W_hh (backward), then the step kernel of rnn_step.c on a copy
   of the step arguments with the step's rows (off, rows) and threads filled in.

   The recurrent GEMMs C[M, N] (=|+=) A[M, K] · B[K, N]: B and C row-major (leading dimensions
   ldb, ldc), A[i, k] at A + i·sar + k·sak (so Aᵀ of a row-major matrix is read in place, as the
   weight gradient needs). A step's GEMM is small (M = the step's rows, often 8–64): through
   torch.mm it costs a dispatch and MKL's small-M path. Here a tile of up to GEMM_MR rows × nv
   vectors of columns keeps its accumulators in registers over all of K; B is read once per row
   tile. The weight gradient's K (all rows of the sequence) is long, so it runs in chunks of
   GEMM_KC values of k, each chunk of B staying in L1 while every row tile passes over it.
   Products are summed in scalar_t in order of k (chunk after chunk), as a BLAS does: only float
   rounding differs from torch.mm. */

#define FN(name) RNN_CAT(name, SUF)
#define GEMM_MR 8
#define GEMM_KC 128

typedef scalar_t FN(vec) __attribute__((vector_size(VEC_BYTES), aligned(sizeof(scalar_t)),
                                        may_alias));
#define VL ((i64)(VEC_BYTES / sizeof(scalar_t)))

static inline __attribute__((always_inline)) void FN(gemm_tile)(
    const scalar_t* A, i64 sar, i64 sak, const scalar_t* B, i64 ldb, scalar_t* C, i64 ldc, i64 K,
    i64 mr, const int nv, const int full, int accumulate) {
    FN(vec) acc[GEMM_MR][2];
    const i64 rows = full ? GEMM_MR : mr;
    for (i64 r = 0; r < rows; ++r)
        for (int v = 0; v < nv; ++v) acc[r][v] = (FN(vec)){0};
    for (i64 k = 0; k < K; ++k) {
        FN(vec) b[2];
        for (int v = 0; v < nv; ++v) b[v] = *(const FN(vec)*)(B + k * ldb + v * VL);
        for (i64 r = 0; r < rows; ++r) {
            const scalar_t a = A[r * sar + k * sak];
            for (int v = 0; v < nv; ++v) acc[r][v] += a * b[v];
        }
    }
    for (i64 r = 0; r < rows; ++r)
        for (int v = 0; v < nv; ++v) {
            FN(vec)* c = (FN(vec)*)(C + r * ldc + v * VL);
            if (accumulate) *c += acc[r][v];
            else *c = acc[r][v];
        }
}

/* All of C for the given K, its column tiles split across nt threads. */
static void FN(gemm)(i64 M, i64 N, i64 K, const scalar_t* A, i64 sar, i64 sak, const scalar_t* B,
                     i64 ldb, scalar_t* C, i64 ldc, int accumulate, int nt) {
    const i64 W = 2 * VL, tiles = (N + W - 1) / W;
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 t = 0; t < tiles; ++t) {
        const i64 j0 = t * W;
        const i64 w = N - j0 < W ? N - j0 : W;
        for (i64 i0 = 0; i0 < M; i0 += GEMM_MR) {
            const i64 mr = M - i0 < GEMM_MR ? M - i0 : GEMM_MR;
            const scalar_t* a = A + i0 * sar;
            scalar_t* c = C + i0 * ldc;
            i64 j = j0;
            if (w == W) {
                /* constant nv / full: each call compiles to its own register-resident tile */
                if (mr == GEMM_MR)
                    FN(gemm_tile)(a, sar, sak, B + j, ldb, c + j, ldc, K, mr, 2, 1, accumulate);
                else
                    FN(gemm_tile)(a, sar, sak, B + j, ldb, c + j, ldc, K, mr, 2, 0, accumulate);
                continue;
            }
            if (w >= VL) {
                FN(gemm_tile)(a, sar, sak, B + j, ldb, c + j, ldc, K, mr, 1, 0, accumulate);
                j += VL;
            }
            for (; j < j0 + w; ++j) /* the last < VL columns */
                for (i64 r = 0; r < mr; ++r) {
                    scalar_t s = 0;
                    for (i64 k = 0; k < K; ++k) s += a[r * sar + k * sak] * B[k * ldb + j];
                    c[r * ldc + j] = accumulate ? c[r * ldc + j] + s : s;
                }
        }
    }
}

int FN(weight_grad)(const FN(weight_grad_args) * a) {
    const i64 N = a->N, G = a->G, H = a->H;
    if (N == 0) {
        for (i64 i = 0; i < G * H; ++i) a->dw[i] = 0;
        return 0;
    }
    const int threads = threads_for(G * H * N, (H + 2 * VL - 1) / (2 * VL), a->gemm_grain,
                                    a->threads);
    for (i64 k0 = 0; k0 < N; k0 += GEMM_KC) {
        const i64 kc = N - k0 < GEMM_KC ? N - k0 : GEMM_KC;
        FN(gemm)(G, H, kc, a->dhp + k0 * G, 1, G, a->hprev + k0 * H, H, a->dw, H, k0 > 0, threads);
    }
    return 0;
}

/* Threads of a step's GEMM over `cols` output columns and of its step kernel. */
static inline int FN(gemm_threads)(i64 rows, i64 cols, i64 inner, i64 grain, int nt) {
    return threads_for(rows * cols * inner, (cols + 2 * VL - 1) / (2 * VL), grain, nt);
}

int FN(lstm_fwd_seq)(const FN(lstm_fwd_step_args) * a, const FN(rnn_seq_fwd_args) * s) {
    const i64 H = a->H, G = 4 * H;
    FN(lstm_fwd_step_args) step = *a;
    for (i64 k = 0; k < s->n_steps; ++k) {
        step.off = s->steps[2 * k];
        step.rows = s->steps[2 * k + 1];
        if (!rows_in_range(step.off, step.rows, a->N, a->B)) return RNN_ERR_ROWS;
        FN(gemm)(step.rows, G, H, a->h, H, 1, s->w, G, a->hp + step.off * G, G, 0,
                 FN(gemm_threads)(step.rows, G, H, s->gemm_grain, s->threads));
        step.threads = threads_for(step.rows * G, step.rows, s->grain, s->threads);
        FN(lstm_fwd_step)(&step);
    }
    return 0;
}

int FN(lstm_bwd_seq)(const FN(lstm_bwd_step_args) * a, const FN(rnn_seq_bwd_args) * s) {
    const i64 H = a->H, G = 4 * H;
    FN(lstm_bwd_step_args) step = *a;
    for (i64 k = s->n_steps - 1; k >= 0; --k) {
        step.off = s->steps[2 * k];
        step.rows = s->steps[2 * k + 1];
        if (!rows_in_range(step.off, step.rows, a->N, a->B)) return RNN_ERR_ROWS;
        step.threads = threads_for(step.rows * G, step.rows, s->grain, s->threads);
        FN(lstm_bwd_step)(&step);
        FN(gemm)(step.rows, H, G, a->dhp + step.off * G, G, 1, s->w, H, a->dh, H, 0,
                 FN(gemm_threads)(step.rows, H, G, s->gemm_grain, s->threads));
    }
    return 0;
}

int FN(gru_fwd_seq)(const FN(gru_fwd_step_args) * a, const FN(rnn_seq_fwd_args) * s) {
    const i64 H = a->H, G = 3 * H;
    FN(gru_fwd_step_args) step = *a;
    for (i64 k = 0; k < s->n_steps; ++k) {
        step.off = s->steps[2 * k];
        step.rows = s->steps[2 * k + 1];
        if (!rows_in_range(step.off, step.rows, a->N, a->B)) return RNN_ERR_ROWS;
        FN(gemm)(step.rows, G, H, a->h, H, 1, s->w, G, a->hp + step.off * G, G, 0,
                 FN(gemm_threads)(step.rows, G, H, s->gemm_grain, s->threads));
        step.threads = threads_for(step.rows * G, step.rows, s->grain, s->threads);
        FN(gru_fwd_step)(&step);
    }
    return 0;
}

/* The GRU step leaves the direct path of h_{t−1} in dh, so its GEMM adds to dh. */
int FN(gru_bwd_seq)(const FN(gru_bwd_step_args) * a, const FN(rnn_seq_bwd_args) * s) {
    const i64 H = a->H, G = 3 * H;
    FN(gru_bwd_step_args) step = *a;
    for (i64 k = s->n_steps - 1; k >= 0; --k) {
        step.off = s->steps[2 * k];
        step.rows = s->steps[2 * k + 1];
        if (!rows_in_range(step.off, step.rows, a->N, a->B)) return RNN_ERR_ROWS;
        step.threads = threads_for(step.rows * G, step.rows, s->grain, s->threads);
        FN(gru_bwd_step)(&step);
        FN(gemm)(step.rows, H, G, a->dhp + step.off * G, G, 1, s->w, H, a->dh, H, 1,
                 FN(gemm_threads)(step.rows, H, G, s->gemm_grain, s->threads));
    }
    return 0;
}

#undef VL
#undef GEMM_MR
#undef GEMM_KC
#undef FN
