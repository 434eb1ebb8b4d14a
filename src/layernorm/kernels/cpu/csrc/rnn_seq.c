/* The recurrent layers' whole-sequence kernels (time loop and recurrent GEMMs in one call) and the
   recurrent weight's gradient, for float (suffix f32) and double (f64): rnn_seq_impl.h included
   once per type. They call the step kernels of rnn_step.c; the argument structs and prototypes
   come from layernorm_rnn_abi.h, generated from layernorm/kernels/cpu/rnn_abi.py. */
#include "rnn_common.h"

int rnn_vector_bytes(void) { return VEC_BYTES; }
int rnn_direct_rows(void) { return DIRECT_ROWS; }

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
