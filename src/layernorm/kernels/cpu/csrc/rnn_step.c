/* The LN-LSTM, LN-GRU and LN-RNN time-step kernels for float (suffix f32) and double (f64).
   rnn_step_impl.h is written once over scalar_t, SUF, EXP and TANH and included once per type; the
   argument structs and prototypes come from layernorm_rnn_abi.h, generated from
   layernorm/kernels/cpu/rnn_abi.py. float uses the vectorizable exp/tanh of rnn_common.h. */
#include "rnn_common.h"

#define scalar_t float
#define SUF f32
#define EXP fast_expf
#define TANH fast_tanhf
#include "rnn_step_impl.h"
#undef scalar_t
#undef SUF
#undef EXP
#undef TANH

#define scalar_t double
#define SUF f64
#define EXP exp
#define TANH tanh
#include "rnn_step_impl.h"
#undef scalar_t
#undef SUF
#undef EXP
#undef TANH
