/* The recurrent kernels' GEMM on its own, for benchmarks/bench_rnn_gemm.py: this file includes the
   whole translation unit rnn_seq.c (its GEMM is static there) and adds one entry point that packs
   B and runs C = A · B, as a sequence kernel does per step. Not part of the package. */
#include "rnn_seq.c"

/* C[M, N] = A[M, K] · B[K, N], all row-major float32; B packed on every call when repack is 1,
   else once (the sequence kernels pack once per direction). Returns RNN_ERR_NOMEM or 0. */
int bench_gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* C,
                   int repack, int reps, int threads) {
    const float* P = NULL;
    for (int r = 0; r < reps; ++r) {
        if (repack || !P) P = packed_weight_f32(B, K, N, 0, threads, 0);
        if (!P) return RNN_ERR_NOMEM;
        gemm_f32(M, N, K, A, K, 1, P, C, N, 0, threads);
    }
    return 0;
}
