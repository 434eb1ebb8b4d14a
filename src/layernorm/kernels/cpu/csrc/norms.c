/* The fused norm kernels: layer norm (with DetachNorm), RMSNorm and AdaNorm, forward and
   backward, for float (suffix f32), double (f64), bfloat16 (bf16) and float16 (f16).
   norms_impl.h is written once over scalar_t and SUF and included once per type; the half types
   (norms_half_impl.h) run the float32 row functions on blocks of converted rows. The argument
   structs and prototypes come from layernorm_cpu_abi.h, generated from
   layernorm/kernels/cpu/abi.py. */
#include "layernorm_cpu_abi.h"
#include "norms_common.h"
#include "half.h"

#define scalar_t float
#define SUF f32
#include "norms_impl.h"
#undef scalar_t
#undef SUF

#define scalar_t double
#define SUF f64
#include "norms_impl.h"
#undef scalar_t
#undef SUF

#define half_t ln_bf16_t
#define SUF bf16
#define TO_F32 bf16_row_to_f32
#define FROM_F32 f32_row_to_bf16
#define ROW_KIND ROW_BF16
#define VEC_TO_F32 bf16_vec_to_f32
#define ONE_TO_F32 bf16_to_f32
#include "norms_half_impl.h"
#undef half_t
#undef SUF
#undef TO_F32
#undef FROM_F32
#undef ROW_KIND
#undef VEC_TO_F32
#undef ONE_TO_F32

#define half_t ln_f16_t
#define SUF f16
#define TO_F32 f16_row_to_f32
#define FROM_F32 f32_row_to_f16
#define ROW_KIND ROW_F16
#define VEC_TO_F32 f16_vec_to_f32
#define ONE_TO_F32 f16_to_f32
#include "norms_half_impl.h"
#undef half_t
#undef SUF
#undef TO_F32
#undef FROM_F32
#undef ROW_KIND
#undef VEC_TO_F32
#undef ONE_TO_F32
