/* The fused norm kernels: layer norm (with DetachNorm), RMSNorm and AdaNorm, forward and
   backward, for float (suffix f32) and double (f64). norms_impl.h is written once over scalar_t
   and SUF and included once per type; the argument structs and prototypes come from
   layernorm_cpu_abi.h, generated from layernorm/kernels/cpu/abi.py. */
#include "layernorm_cpu_abi.h"
#include "norms_common.h"

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
