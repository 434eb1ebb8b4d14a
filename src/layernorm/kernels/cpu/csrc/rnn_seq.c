/* The recurrent layers' whole-sequence kernels (time loop and recurrent GEMMs in one call) and the
   recurrent weight's gradient, for float (suffix f32) and double (f64): rnn_seq_impl.h included
   once per type. They call the step kernels of rnn_step.c; the argument structs and prototypes
   come from layernorm_rnn_abi.h, generated from layernorm/kernels/cpu/rnn_abi.py. */
#include "rnn_common.h"

int rnn_vector_bytes(void) { return VEC_BYTES; }
int rnn_direct_rows(void) { return DIRECT_ROWS; }

/* The BLAS's Fortran ?gemm_ (column-major, every argument by address, LP64 int sizes), as the
   running PyTorch's own library exports it (MKL's: rnn.py looks it up). NULL: the packed tile. */
typedef void (*blas_gemm_f32)(const char*, const char*, const int*, const int*, const int*,
                              const float*, const float*, const int*, const float*, const int*,
                              const float*, float*, const int*);
typedef void (*blas_gemm_f64)(const char*, const char*, const int*, const int*, const int*,
                              const double*, const double*, const int*, const double*, const int*,
                              const double*, double*, const int*);
static blas_gemm_f32 blas_f32 = NULL;
static blas_gemm_f64 blas_f64 = NULL;

void rnn_set_blas(void* sgemm, void* dgemm) {
    blas_f32 = (blas_gemm_f32)sgemm;
    blas_f64 = (blas_gemm_f64)dgemm;
}

#define scalar_t float
#define SUF f32
#include "rnn_seq_impl.h"
#undef scalar_t
#undef SUF

#define scalar_t double
#define SUF f64
#include "rnn_seq_impl.h"
#undef scalar_t
#undef SUF
