/* A row sum's float64 partial sums, the template the norm kernels (norms_impl.h) and the recurrent
   step kernels (rnn_step_impl.h) share: included once per instantiation, after FN, scalar_t,
   acc_t, VEC_BYTES and ROW_SUMS_VEC (the vector type of VEC_BYTES of scalar_t the row loops add
   in) are defined.

   A row sum runs in two vectors of scalar_t partial sums, each lane adding at most BLOCK_TERMS
   (cpu_common.h) terms; at the end of each block the two are added lane by lane and the result
   goes into float64 partial sums (FN(flush): a vector add and conversions, where a full fold per
   block would cost as much as the block's own adds), folded pairwise at the row's end
   (FN(fold)). The float64 sums are native vectors of acc_t (two for float, one for double) so
   that they stay in registers: as an array of scalars GCC kept them on the stack, and the fold
   at a row's end waited on a store before each of its adds (a third of the statistics of a row
   of 32 floats, AMD EPYC, AVX-512). */

typedef acc_t FN(avec) __attribute__((vector_size(VEC_BYTES)));
#define ACC_VL ((i64)(VEC_BYTES / sizeof(acc_t)))
#define ACC_PARTS (sizeof(acc_t) / sizeof(scalar_t))
typedef scalar_t FN(pvec) __attribute__((vector_size(ACC_VL * sizeof(scalar_t))));
typedef int64_t FN(amask) __attribute__((vector_size(VEC_BYTES)));
typedef struct {
    FN(avec) v[ACC_PARTS];
} FN(acc);

/* acc lane l += lane l of p0 + p1 (added in scalar_t). */
static inline void FN(flush)(ROW_SUMS_VEC p0, ROW_SUMS_VEC p1, FN(acc) * acc) {
    const ROW_SUMS_VEC p = p0 + p1;
    for (i64 k = 0; k < (i64)ACC_PARTS; ++k) {
        FN(pvec) part;
        memcpy(&part, (const char*)&p + k * (i64)sizeof part, sizeof part);
        acc->v[k] += __builtin_convertvector(part, FN(avec));
    }
}

/* Σ of the partial sums folded pairwise, lane l += lane l + w for w = (lanes)/2, ..., 1: the first
   step adds a float row's two vectors; at each later one the lanes from w up hold sums that no
   later step reads. */
static inline acc_t FN(fold)(FN(acc) a) {
    FN(avec) v = a.v[0];
    for (i64 k = 1; k < (i64)ACC_PARTS; ++k) v += a.v[k];
    for (i64 w = ACC_VL / 2; w >= 1; w /= 2) {
        FN(amask) m;
        for (i64 l = 0; l < ACC_VL; ++l) m[l] = (l + w) % ACC_VL;
        v += __builtin_shuffle(v, m);
    }
    return v[0];
}

#undef ACC_VL
#undef ACC_PARTS
#undef ROW_SUMS_VEC
