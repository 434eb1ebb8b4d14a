/* The LN-LSTM, LN-GRU and LN-RNN time-step kernels for float (suffix f32) and double (f64).
   rnn_step_impl.h is written once over scalar_t, SUF, EXP and TANH and included once per type; the
   argument structs and prototypes come from layernorm_rnn_abi.h, generated from
   layernorm/kernels/cpu/rnn_abi.py. Both use the vectorizable exp/tanh of rnn_common.h. */
#include "rnn_common.h"

/* The LN-LSTM forward step's rows a group (rnn_step_impl.h FWD_GROUP_MAX; rnn.py decides by
   processor). */
#ifndef FWD_GROUP
#define FWD_GROUP RNN_FORWARD_GROUP_DEFAULT
#endif
#define FWD_GROUP_MAX RNN_FORWARD_GROUP_MAX
static int forward_group = FWD_GROUP;

int rnn_set_forward_group(int rows) {
    if (rows < 1 || rows > FWD_GROUP_MAX) return -1;
    forward_group = rows;
    return 0;
}

#define scalar_t float
#define SUF f32
#define EXP fast_expf
#define TANH fast_tanhf
#define STEP_LANES (VEC_BYTES / 4) /* scalar_t's lanes a vector, for the preprocessor */
#include "rnn_step_impl.h"
#undef scalar_t
#undef SUF
#undef EXP
#undef TANH
#undef STEP_LANES

#define scalar_t double
#define SUF f64
#define EXP fast_exp
#define TANH fast_tanh
#define STEP_LANES (VEC_BYTES / 8)
#include "rnn_step_impl.h"
#undef scalar_t
#undef SUF
#undef EXP
#undef TANH
#undef STEP_LANES
