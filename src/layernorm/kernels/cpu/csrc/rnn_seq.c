/* The recurrent layers' whole-sequence kernels (time loop and recurrent GEMMs in one call) and the
   recurrent weight's gradient, for float (suffix f32) and double (f64): rnn_seq_impl.h included
   once per type. They call the step kernels of rnn_step.c; the argument structs and prototypes
   come from layernorm_rnn_abi.h, generated from layernorm/kernels/cpu/rnn_abi.py. */
#include "rnn_common.h"
#include "half.h"

int rnn_vector_bytes(void) { return VEC_BYTES; }
int rnn_direct_rows(void) { return DIRECT_ROWS; }

/* The packed weights' bytes up to which a team splits the batch's rows (batch_split). */
static i64 batch_split_bytes = RNN_BATCH_SPLIT_BYTES_DEFAULT;

int rnn_set_batch_split_bytes(int64_t bytes) {
    if (bytes < 0) return -1;
    batch_split_bytes = bytes;
    return 0;
}

/* MKL's packed GEMM (cblas_sgemm_pack_get_size, cblas_sgemm_pack, cblas_sgemm_compute) as the
   running PyTorch's own CPU library exports it; rnn.py looks the three up and decides where they
   are used. All NULL: the library's own tile. float only: no packed dgemm is exported. MKL_INT is
   int (LP64) and the CBLAS enums are ints. */
typedef size_t (*mkl_pack_size_fn)(int identifier, int m, int n, int k);
typedef void (*mkl_pack_fn)(int layout, int identifier, int trans, int m, int n, int k,
                            float alpha, const float* src, int ld, float* dest);
typedef void (*mkl_compute_fn)(int layout, int transa, int transb, int m, int n, int k,
                               const float* a, int lda, const float* b, int ldb, float beta,
                               float* c, int ldc);
static mkl_pack_size_fn mkl_pack_size = NULL;
static mkl_pack_fn mkl_pack = NULL;
static mkl_compute_fn mkl_compute = NULL;
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112, CBLAS_PACKED = 151,
       CBLAS_B_MATRIX = 162 };

int rnn_set_packed_gemm(void* pack_size, void* pack, void* compute) {
    if (!pack_size != !pack || !pack != !compute) return -1; /* all three or none */
    mkl_pack_size = (mkl_pack_size_fn)pack_size;
    mkl_pack = (mkl_pack_fn)pack;
    mkl_compute = (mkl_compute_fn)compute;
    return 0;
}

/* MKL's sgemm as the running PyTorch's CPU library exports it (the Fortran interface, LP64:
   int sizes, arguments by address, column-major), for the GEMMs of a forward call of one step
   (rnn_set_one_step_sgemm): they read the weights as stored, where packing a weight is a pass
   over it and another over its copy for the one GEMM that reads it. NULL: packed as in any
   other call. */
typedef void (*mkl_sgemm_fn)(const char* transa, const char* transb, const int* m, const int* n,
                             const int* k, const float* alpha, const float* a, const int* lda,
                             const float* b, const int* ldb, const float* beta, float* c,
                             const int* ldc);
static mkl_sgemm_fn mkl_sgemm = NULL;

int rnn_set_one_step_sgemm(void* sgemm) {
    mkl_sgemm = (mkl_sgemm_fn)sgemm;
    return 0;
}

/* MKL's gemm_bf16bf16f32 as the running PyTorch's CPU library exports it (the Fortran interface,
   LP64, as sgemm_ above; A and B bfloat16, C float32, products summed in float32), for the GEMMs
   of one step of a bfloat16 layer computed in float32 (the sequence struct's w_half and
   w_ih_half: its weights as stored, read where a float32 copy would be made for the call):
   rnn_set_one_step_half_gemm. NULL: the weights widened to float32 for the call. */
typedef void (*mkl_half_gemm_fn)(const char* transa, const char* transb, const int* m,
                                 const int* n, const int* k, const float* alpha,
                                 const uint16_t* a, const int* lda, const uint16_t* b,
                                 const int* ldb, const float* beta, float* c, const int* ldc);
static mkl_half_gemm_fn mkl_half_gemm = NULL;

int rnn_set_one_step_half_gemm(void* gemm) {
    mkl_half_gemm = (mkl_half_gemm_fn)gemm;
    return 0;
}

/* The float kernels' bfloat16 GEMMs (half_gemm) where the target has AVX512-BF16. */
#if defined(__AVX512BF16__)
#define SEQ_HALF_GEMM 1
#else
#define SEQ_HALF_GEMM 0
#endif
int rnn_half_gemm(void) { return SEQ_HALF_GEMM; }

/* The bfloat16 GEMMs on the AMX tiles (TDPBF16PS) where the processor has them (AMX-TILE and
   AMX-BF16) and Linux lets this process use them (the tile data is a state a process must ask
   for: arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA). rnn.py switches it on at load
   unless told not to (rnn_set_amx): 0 when set as asked, -1 when AMX was asked for and cannot be
   used (then it stays off). Set before the kernels run, not while they do. */
static int amx_on = 0;
#if SEQ_HALF_GEMM && defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SEQ_AMX 1
static int amx_usable(void) {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    if (!(edx & (1u << 22)) || !(edx & (1u << 24))) return 0; /* AMX-BF16, AMX-TILE */
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): 0 once granted (again: 0) */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
#else
#define SEQ_AMX 0
static int amx_usable(void) { return 0; }
#endif
int rnn_set_amx(int on) {
    if (!on) {
        amx_on = 0;
        return 0;
    }
    if (!amx_usable()) return -1;
    amx_on = 1;
    return 0;
}
int rnn_amx(void) { return amx_on; }

#define scalar_t float
#define SUF f32
#define SEQ_LANES (VEC_BYTES / 4) /* scalar_t's lanes a vector, for the preprocessor */
#define SEQ_PACKED_GEMM 1 /* the MKL path above exists for this type */
#include "rnn_seq_impl.h"
#undef scalar_t
#undef SUF
#undef SEQ_LANES
#undef SEQ_PACKED_GEMM
#undef SEQ_HALF_GEMM
#define SEQ_HALF_GEMM 0

#define scalar_t double
#define SUF f64
#define SEQ_LANES (VEC_BYTES / 8)
#define SEQ_PACKED_GEMM 0
#include "rnn_seq_impl.h"
#undef scalar_t
#undef SUF
#undef SEQ_LANES
#undef SEQ_PACKED_GEMM
#undef SEQ_HALF_GEMM
