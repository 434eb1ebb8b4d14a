/* A row's float64 partial sums, shared by the norm kernels (norms_impl.h) and the recurrent step
   kernels (rnn_step_impl.h): both sum a row in blocks, each block in two vectors of scalar_t
   partial sums (one vector: VEC_BYTES), whose lanes then go into float64 partial sums, folded at
   the end of the row (cpu_common.h: BLOCK_TERMS).

   Included once per scalar type by each of them, with FN, scalar_t, acc_t and ROW_VEC (the
   vector type of VEC_BYTES of scalar_t) defined; no include guard for that reason.

   The float64 partial sums, lane l of a block's p0 + p1 into lane l of them, are two vectors of
   acc_t (lanes [0, L/2) and [L/2, L), L the lanes of ROW_VEC) held in registers. As one array of
   L scalars GCC kept them on the stack: each block's flush and the row's fold went through
   memory (a norm row of 32 float32 with AVX-512 spent half of its statistics there). The fold
   adds lane l + w into lane l for w = L/2 (the two vectors' sum), L/4, ..., 1, each level a
   loop of a constant trip count, so one vector add: as one loop over a varying width it stayed
   scalar adds through memory (an LN-LSTM row's layer norms, in cache: forward 620 -> 557 ns,
   backward 425 -> 361 ns). The same sums in the same order as the array's: the same bits. */

#define ROW_HALF_LANES ((i64)(VEC_BYTES / sizeof(scalar_t) / 2))
typedef scalar_t FN(hvec) __attribute__((vector_size(VEC_BYTES / 2), aligned(sizeof(scalar_t)),
                                         may_alias));
typedef acc_t FN(avec) __attribute__((vector_size(ROW_HALF_LANES * sizeof(acc_t))));
typedef struct {
    FN(avec) lo, hi;
} FN(lanes);

/* End of a block: acc += lane l of p0 + p1 (added in scalar_t), widened to acc_t. */
static inline __attribute__((always_inline)) void FN(lanes_add)(ROW_VEC p0, ROW_VEC p1,
                                                              FN(lanes) * acc) {
    const ROW_VEC p = p0 + p1;
    FN(hvec) lo, hi;
    memcpy(&lo, &p, sizeof lo);
    memcpy(&hi, (const char*)&p + sizeof lo, sizeof hi);
    acc->lo += __builtin_convertvector(lo, FN(avec));
    acc->hi += __builtin_convertvector(hi, FN(avec));
}

/* Σ of the partial sums, folded pairwise as above. */
static inline __attribute__((always_inline)) acc_t FN(lanes_fold)(FN(lanes) acc) {
    const FN(avec) v = acc.lo + acc.hi;
    acc_t a[ROW_HALF_LANES];
    memcpy(a, &v, sizeof a);
#define ROW_FOLD_LEVEL(w)          \
    if (2 * (w) <= ROW_HALF_LANES) \
        for (i64 l = 0; l < (w); ++l) a[l] += a[l + (w)];
    ROW_FOLD_LEVEL(16) ROW_FOLD_LEVEL(8) ROW_FOLD_LEVEL(4) ROW_FOLD_LEVEL(2) ROW_FOLD_LEVEL(1)
#undef ROW_FOLD_LEVEL
    return a[0];
}

#undef ROW_HALF_LANES
