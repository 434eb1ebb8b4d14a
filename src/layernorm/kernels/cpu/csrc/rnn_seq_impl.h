/* The recurrent layers' whole-sequence kernels over one scalar type: included by rnn_seq.c with
   scalar_t and SUF defined; every external name ends in _SUF.

   A *_seq kernel runs a whole direction of a sequence in one call: per step the recurrent GEMM
   h_{t−1} W_hhᵀ (forward) or dhp · W_hh (backward), then the step kernel of rnn_step.c on a copy
   of the step arguments with the step's rows (off, rows) and threads filled in.

   The recurrent GEMMs C[M, N] (=|+=) A[M, K] · B[K, N]: A[i, k] at A + i·sar + k·sak (so Aᵀ of a
   row-major matrix is read in place, as the weight gradient needs), C row-major (leading
   dimension ldc). A step's GEMM is small (M = the step's rows, often 4–64): through torch.mm it
   costs a dispatch and MKL's small-M path. Here B (the recurrent weight, constant over the
   sequence) is first packed into panels of NR = 2 vectors of columns, each panel K rows of NR
   contiguous values: a tile then reads its panel sequentially, where B's own rows (4H floats
   apart: a multiple of 4 KiB at H = 256) would all fall into the same few L1 sets. A tile of up to
   GEMM_MR rows × NR columns keeps its 2·GEMM_MR accumulators in registers over all of K, and every
   row tile passes over a panel while it is in cache. A tile's accumulators are its independent
   FMA chains: a few rows leave the FMA units idle (1 row at AVX2 with 2 chains, 27 GFLOP/s, against
   about 105 from 5 rows up, AMD EPYC, one thread). So the rows of C are split into row tiles of
   near-equal size when each then keeps at least GEMM_BALANCED rows (AVX2: M = 7 → 4 + 3 rather
   than 6 + 1, 85–91 against 69–77 GFLOP/s; M = 8 → 4 + 4, 93–95 against 80–88), else into full
   tiles first, and up to GEMM_WIDE_MR rows a tile spans two panels (below).

   GEMM_MR follows the register file: 14 rows (28 accumulators) of 32 zmm registers with AVX-512,
   6 rows (12) of 16 ymm/xmm registers with AVX2 and SSE, leaving room for the panel's two vectors
   and the broadcast value of A (8 rows there spill to the stack: that tile ran at 63 GFLOP/s;
   16 rows spill with AVX-512). On an Intel Xeon (two 512-bit FMA units) the 14-row tile ran at
   1.0–1.2x the 8-row one's rate from 16 rows up, most at H = 650 where each pass over a panel
   (K·NR floats, 333 KB at K = 2600) comes from L2 and more rows share it; 10 and 12 rows fell
   between (RESULTS.md, 2026-11-26).
   A 4 × 3 tile (also 12 chains) was tried for AVX2 and ran at about 0.7× this one's rate at
   M = 32: GCC keeps its three panel vectors in memory, 16 loads per 12 FMAs.

   The weight gradient's K (all rows of the sequence) is long, so it runs in chunks of GEMM_KC
   values of k, each chunk packed, its panels staying in L1 while every row tile passes over them.
   Products are summed in scalar_t in order of k (chunk after chunk), as a BLAS does: only float
   rounding differs from torch.mm. */

#define FN(name) RNN_CAT(name, SUF)
/* A build may set GEMM_MR, GEMM_BALANCED, GEMM_PREFETCH and GEMM_PACK_A with -D, as
   bench_rnn_gemm.py --variant does to compare tiles on one processor; both instantiations (f32,
   f64) use the same. */
#ifndef GEMM_MR
#if VEC_BYTES >= 64
#define GEMM_MR 14
#else
#define GEMM_MR 6
#endif
#endif
#ifndef GEMM_BALANCED
#define GEMM_BALANCED (GEMM_MR / 2)
#endif
#if GEMM_MR < 6 || GEMM_MR > 16 || GEMM_MR % 2
#error "GEMM_MR must be even, from 6 to 16 (tile_rows has a case for each row count up to it)"
#endif
/* The row counts of a tile, 1 to GEMM_MR: C(R) for each (the tiles' switches). */
#ifndef GEMM_ROW_CASES
#define GEMM_ROWS_6(C) C(1) C(2) C(3) C(4) C(5) C(6)
#define GEMM_ROWS_10(C) GEMM_ROWS_6(C) C(7) C(8) C(9) C(10)
#define GEMM_ROWS_14(C) GEMM_ROWS_10(C) C(11) C(12) C(13) C(14)
#if GEMM_MR == 6
#define GEMM_ROW_CASES(C) GEMM_ROWS_6(C)
#elif GEMM_MR == 8
#define GEMM_ROW_CASES(C) GEMM_ROWS_6(C) C(7) C(8)
#elif GEMM_MR == 10
#define GEMM_ROW_CASES(C) GEMM_ROWS_10(C)
#elif GEMM_MR == 12
#define GEMM_ROW_CASES(C) GEMM_ROWS_10(C) C(11) C(12)
#elif GEMM_MR == 14
#define GEMM_ROW_CASES(C) GEMM_ROWS_14(C)
#else
#define GEMM_ROW_CASES(C) GEMM_ROWS_14(C) C(15) C(16)
#endif
#endif
#define GEMM_KC 128
/* A tile asks for its panel's cache lines GEMM_PREFETCH values of k ahead (0: left to the
   hardware prefetchers). On an Intel Xeon (AVX-512, one thread) 16 ahead (2 KiB a panel) took the
   GEMMs at H = 650 (K·NR floats a panel: 83 KB forward, 333 KB backward, streamed from L2) from
   1.25–1.74x MKL's time to 1.06–1.60x (8 ahead: 1.17–1.55x, and the LN-LSTM's inference 2–6%
   faster; RESULTS.md, 2026-11-26 11:04); below H = 512 within the run's spread. Not measured to
   help with AVX2. */
#ifndef GEMM_PREFETCH
#if VEC_BYTES >= 64
#define GEMM_PREFETCH 16
#else
#define GEMM_PREFETCH 0
#endif
#endif

/* A's rows a multiple of 4 KiB apart share one set of L1, GEMM_L1_WAYS lines: a tile of more
   rows than that reads them from a copy spread a cache line apart (spread_block). */
#ifndef GEMM_L1_WAYS
#define GEMM_L1_WAYS 8
#endif
#ifndef GEMM_SPREAD_A
#define GEMM_SPREAD_A (GEMM_MR > GEMM_L1_WAYS)
#endif
#ifndef RNN_SEQ_SPREAD
#define RNN_SEQ_SPREAD
/* The bytes from one row to the next of a copy whose rows of `row_bytes` (a stride of A) would
   share one set of L1: one cache line more where spreading is on and they would, else as many. */
static inline i64 spread_row_bytes(i64 row_bytes) {
    return GEMM_SPREAD_A && row_bytes % 4096 == 0 ? row_bytes + 64 : row_bytes;
}
#endif

/* Keep two loaded vectors in registers: left to itself GCC folds the panel's loads into every
   row's FMA (a memory operand each), 2·rows loads of B per k instead of 2; the 4-row AVX2 tile
   then issued 12 loads per 8 FMAs and ran below the FMA units' rate. An empty asm that takes
   and gives back the values in vector registers makes the loaded values the operands. */
#if defined(__x86_64__) && defined(__AVX512F__)
#define IN_REGISTERS(u, v) __asm__("" : "+v"(u), "+v"(v))
#define IN_REGISTER(u) __asm__("" : "+v"(u))
#elif defined(__x86_64__)
#define IN_REGISTERS(u, v) __asm__("" : "+x"(u), "+x"(v))
#define IN_REGISTER(u) __asm__("" : "+x"(u))
#else
#define IN_REGISTERS(u, v) ((void)0)
#define IN_REGISTER(u) ((void)0)
#endif

typedef scalar_t FN(vec) __attribute__((vector_size(VEC_BYTES), aligned(sizeof(scalar_t)),
                                        may_alias));
#define VL ((i64)(VEC_BYTES / sizeof(scalar_t)))
#define NR (2 * VL)

static inline i64 FN(panels)(i64 N) { return (N + NR - 1) / NR; }

/* Ask for the cache lines of panel row k + GEMM_PREFETCH (past the panel's end: the next one's). */
static inline __attribute__((always_inline)) void FN(prefetch_panel)(const scalar_t* P, i64 k) {
#if GEMM_PREFETCH > 0
    for (i64 j = 0; j < NR; j += 64 / (i64)sizeof(scalar_t))
        __builtin_prefetch(P + (k + GEMM_PREFETCH) * NR + j, 0, 3);
#else
    (void)P;
    (void)k;
#endif
}

/* Buffers for packed panels, kept per calling thread and grown on demand (a fresh allocation of
   megabytes per call is an mmap plus page faults every time): one slot for each weight a
   sequence kernel packs (the recurrent weight, the input weight of a forward kernel's projection,
   torch.nn.LSTM's projection W_hr), then one for each of their GEMMs' inputs rounded to bfloat16
   (half_gemm: weight slot + WEIGHT_SLOTS), then GEMM_PACK_A's copy of A, then the staged rows of
   a training forward's two GEMMs (see stage_rows). NULL when one cannot grow. */
#ifndef RNN_SEQ_SLOTS
#define RNN_SEQ_SLOTS
enum {
    SLOT_W_HH, SLOT_W_IH, SLOT_W_HR, WEIGHT_SLOTS,
    SLOT_PACK_A = 2 * WEIGHT_SLOTS, SLOT_STAGE_H, SLOT_STAGE_X, SLOT_SPREAD_A, SLOTS
};
#endif
static __thread scalar_t* FN(pack_buf)[SLOTS];
static __thread i64 FN(pack_cap)[SLOTS];

static scalar_t* FN(pack_buffer)(i64 n, int slot) {
    if (n > FN(pack_cap)[slot]) {
        free(FN(pack_buf)[slot]);
        void* p = NULL;
        FN(pack_buf)[slot] = posix_memalign(&p, 64, (size_t)n * sizeof(scalar_t)) == 0 ? p : NULL;
        FN(pack_cap)[slot] = FN(pack_buf)[slot] ? n : 0;
    }
    return FN(pack_buf)[slot];
}

/* Pack B[K, N] (row-major, leading dimension ldb) into panels: panel p at P + p·K·NR holds
   columns [p·NR, p·NR + NR) as K rows of NR values, zero past column N. */
static void FN(pack_panels)(const scalar_t* B, i64 ldb, i64 K, i64 N, scalar_t* P, int nt) {
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 p = 0; p < FN(panels)(N); ++p) {
        const i64 j0 = p * NR, w = N - j0 < NR ? N - j0 : NR;
        scalar_t* dst = P + p * K * NR;
        for (i64 k = 0; k < K; ++k) {
            const scalar_t* src = B + k * ldb + j0;
            for (i64 jj = 0; jj < w; ++jj) dst[k * NR + jj] = src[jj];
            for (i64 jj = w; jj < NR; ++jj) dst[k * NR + jj] = 0;
        }
    }
}

/* The VL x VL block v[0..VL) (row r in v[r]) transposed in place. Level b swaps the
   off-diagonal b x b blocks of rows i and i + b (i without bit b): element (i, p) with bit b of p
   set trades places with (i + b, p − b), which swaps bit b of the row index with bit b of the
   column index; after every level, v[c] holds column c. Each swap is two shuffles of two vectors
   (__builtin_shufflevector: constant lanes, so SEQ_LANES, the lanes for the preprocessor). */
#define TR_LO(b, p) (((p) & (b)) ? SEQ_LANES + (p) - (b) : (p))
#define TR_HI(b, p) (((p) & (b)) ? SEQ_LANES + (p) : (p) + (b))
#if SEQ_LANES == 16
#define TR_SHUF(a, c, F, b)                                                                       \
    __builtin_shufflevector(a, c, F(b, 0), F(b, 1), F(b, 2), F(b, 3), F(b, 4), F(b, 5), F(b, 6), \
                            F(b, 7), F(b, 8), F(b, 9), F(b, 10), F(b, 11), F(b, 12), F(b, 13),   \
                            F(b, 14), F(b, 15))
#elif SEQ_LANES == 8
#define TR_SHUF(a, c, F, b)                                                                       \
    __builtin_shufflevector(a, c, F(b, 0), F(b, 1), F(b, 2), F(b, 3), F(b, 4), F(b, 5), F(b, 6), \
                            F(b, 7))
#elif SEQ_LANES == 4
#define TR_SHUF(a, c, F, b) __builtin_shufflevector(a, c, F(b, 0), F(b, 1), F(b, 2), F(b, 3))
#elif SEQ_LANES == 2
#define TR_SHUF(a, c, F, b) __builtin_shufflevector(a, c, F(b, 0), F(b, 1))
#else
#error "rnn_seq_impl.h: a vector of 2, 4, 8 or 16 lanes"
#endif
#define TR_LEVEL(v, b)                                                                            \
    for (i64 i = 0; i < VL; ++i)                                                                  \
        if (!(i & (b))) {                                                                         \
            const FN(vec) lo = (v)[i], hi = (v)[i + (b)];                                         \
            (v)[i] = TR_SHUF(lo, hi, TR_LO, b);                                                   \
            (v)[i + (b)] = TR_SHUF(lo, hi, TR_HI, b);                                             \
        }
static inline __attribute__((always_inline)) void FN(transpose_block)(FN(vec) * v) {
    TR_LEVEL(v, 1)
#if SEQ_LANES >= 4
    TR_LEVEL(v, 2)
#endif
#if SEQ_LANES >= 8
    TR_LEVEL(v, 4)
#endif
#if SEQ_LANES >= 16
    TR_LEVEL(v, 8)
#endif
}
#undef TR_LEVEL
#undef TR_SHUF
#undef TR_HI
#undef TR_LO

/* Pack B = Wᵀ, W[N, K] row-major (B[k, j] = W[j, k]), into panels as pack_panels does: the
   forward GEMMs multiply by W_hhᵀ (and W_ihᵀ), read here from W itself (no transposed copy per
   call). A full panel's rows go VL x VL blocks at a time, each block of W loaded as VL vectors,
   transposed in registers and stored as VL vectors; the rest (a last partial panel, the K % VL
   last rows) element by element, PACK_T_KC rows of the panel at a time so that the lines written
   stay in L1. One element a load and a store, the packing of W_hh and W_ih was 11.5% of an
   LN-LSTM inference call at (35, 20, 650, 650) (AMD EPYC Zen 5, one thread); at (M, K, N) =
   (8, 1024, 3072) the matmul kernel took 2.6 ms, nearly all of it the packing. */
#ifndef PACK_T_KC
#define PACK_T_KC 64
#endif
static void FN(pack_panels_t)(const scalar_t* W, i64 K, i64 N, scalar_t* P, int nt) {
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 p = 0; p < FN(panels)(N); ++p) {
        const i64 j0 = p * NR, w = N - j0 < NR ? N - j0 : NR;
        scalar_t* dst = P + p * K * NR;
        const i64 kv = w == NR ? K - K % VL : 0; /* rows of the panel done in blocks */
        for (i64 k0 = 0; k0 < kv; k0 += VL)
            for (i64 h = 0; h < NR; h += VL) {
                FN(vec) v[VL];
                for (i64 r = 0; r < VL; ++r) v[r] = *(const FN(vec)*)(W + (j0 + h + r) * K + k0);
                FN(transpose_block)(v);
                for (i64 c = 0; c < VL; ++c) *(FN(vec)*)(dst + (k0 + c) * NR + h) = v[c];
            }
        for (i64 k0 = kv; k0 < K; k0 += PACK_T_KC) {
            const i64 k1 = K - k0 < PACK_T_KC ? K : k0 + PACK_T_KC;
            for (i64 jj = 0; jj < NR; ++jj) {
                const scalar_t* src = W + (j0 + jj) * K; /* row j0 + jj of W: column of B */
                if (jj < w)
                    for (i64 k = k0; k < k1; ++k) dst[k * NR + jj] = src[k];
                else
                    for (i64 k = k0; k < k1; ++k) dst[k * NR + jj] = 0;
            }
        }
    }
}

/* GEMM_PACK_A=1 (a build setting, off by default): gemm_part first copies each row tile's rows
   of A k-major into a buffer of its thread (A[k·rows + r]), so that a tile broadcasts its A values
   from one pointer at constant offsets. With A read in place (A + r·sar + k·sak) GCC keeps a
   pointer per row: the 14-row AVX-512 tile has more than the 16 general registers hold and
   reloads four of them from the stack on every k (22 loads per 28 FMAs instead of 16). The copy
   costs M·K values a call. AMD EPYC (one 512-bit FMA a cycle), bench_rnn_gemm.py --variant
   packa=-DGEMM_PACK_A=1: 0.93–1.04 of the default's GFLOP/s at H = 128 and 256 forward,
   0.81–1.09 backward, 1.0–1.18 at H = 650; the layers (ab_rnn.py --cflags) level (±0.04) at
   three shapes (RESULTS.md). On a processor with two 512-bit FMA units a cycle (Intel Xeon) the
   loads are twice the share of the loop's time; not measured there yet. */
#ifndef GEMM_PACK_A
#define GEMM_PACK_A 0
#endif
#if GEMM_PACK_A /* sar = 0: A as packed (the loops are unswitched on it) */
#define TILE_A(A, sar, sak, rows, r, k) \
    ((sar) ? (A)[(r) * (sar) + (k) * (sak)] : (A)[(k) * (rows) + (r)])
#else
#define TILE_A(A, sar, sak, rows, r, k) ((A)[(r) * (sar) + (k) * (sak)])
#endif

/* One tile: `rows` rows of C (a constant in each call of tile_rows, so the loops over rows and
   vectors unroll and the accumulators stay in registers), the first w <= NR columns of a panel. */
static inline __attribute__((always_inline)) void FN(gemm_tile)(
    const scalar_t* A, i64 sar, i64 sak, const scalar_t* P, i64 K, const int rows, scalar_t* C,
    i64 ldc, i64 w, int accumulate) {
    FN(vec) acc[GEMM_MR][2];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = (FN(vec)){0};
    for (i64 k = 0; k < K; ++k) {
        FN(prefetch_panel)(P, k);
        FN(vec) b0 = *(const FN(vec)*)(P + k * NR), b1 = *(const FN(vec)*)(P + k * NR + VL);
        IN_REGISTERS(b0, b1);
        for (int r = 0; r < rows; ++r) {
            const scalar_t a = TILE_A(A, sar, sak, rows, r, k);
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
        }
    }
    if (w == NR) {
        for (int r = 0; r < rows; ++r)
            for (int v = 0; v < 2; ++v) {
                FN(vec)* c = (FN(vec)*)(C + r * ldc + v * VL);
                if (accumulate) *c += acc[r][v];
                else *c = acc[r][v];
            }
        return;
    }
    for (int r = 0; r < rows; ++r) { /* the last panel: only its first w columns exist in C */
        const scalar_t* out = (const scalar_t*)acc[r];
        for (i64 j = 0; j < w; ++j) C[r * ldc + j] = accumulate ? C[r * ldc + j] + out[j] : out[j];
    }
}

/* Up to GEMM_WIDE_MR rows (a batch of 1–4 sequences) a tile takes two adjacent full panels at
   once: 4·rows accumulators instead of 2·rows, so that a 4-row step still has 16 independent
   FMA chains (the 4 × 2-vector tile ran at about 0.7× the 8-row tile's rate), and each broadcast
   value of A feeds four FMAs. The panels stay as packed: two sequential streams. With 16 vector
   registers (AVX2, SSE) up to 2 rows: 8 accumulators, 4 panel vectors and the broadcast value. */
#if GEMM_MR >= 8
#define GEMM_WIDE_MR 4
#else
#define GEMM_WIDE_MR 2
#endif
static inline __attribute__((always_inline)) void FN(gemm_tile_wide)(
    const scalar_t* A, i64 sar, i64 sak, const scalar_t* P, i64 K, const int rows, scalar_t* C,
    i64 ldc, int accumulate) {
    FN(vec) acc[GEMM_WIDE_MR][4];
    const scalar_t* Q = P + K * NR; /* the next panel */
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = (FN(vec)){0};
    for (i64 k = 0; k < K; ++k) {
        FN(prefetch_panel)(P, k);
        FN(prefetch_panel)(Q, k);
        FN(vec) b0 = *(const FN(vec)*)(P + k * NR), b1 = *(const FN(vec)*)(P + k * NR + VL);
        FN(vec) b2 = *(const FN(vec)*)(Q + k * NR), b3 = *(const FN(vec)*)(Q + k * NR + VL);
        IN_REGISTERS(b0, b1);
        IN_REGISTERS(b2, b3);
        for (int r = 0; r < rows; ++r) {
            const scalar_t a = TILE_A(A, sar, sak, rows, r, k);
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
            acc[r][2] += a * b2;
            acc[r][3] += a * b3;
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < 4; ++v) {
            FN(vec)* c = (FN(vec)*)(C + r * ldc + v * VL);
            if (accumulate) *c += acc[r][v];
            else *c = acc[r][v];
        }
}

#define WIDE_CASE(R) \
    case R: FN(gemm_tile_wide)(A, sar, sak, P, K, R, C, ldc, accumulate); return;

#if GEMM_WIDE_MR >= 4
#define GEMM_WIDE_CASES(C) C(1) C(2) C(3) C(4)
#else
#define GEMM_WIDE_CASES(C) C(1) C(2)
#endif

static void FN(tile_rows_wide)(int rows, const scalar_t* A, i64 sar, i64 sak, const scalar_t* P,
                               i64 K, scalar_t* C, i64 ldc, int accumulate) {
    switch (rows) {
        GEMM_WIDE_CASES(WIDE_CASE)
        default: return;
    }
}
#undef WIDE_CASE

#define TILE_CASE(R) \
    case R: FN(gemm_tile)(A, sar, sak, P, K, R, C, ldc, w, accumulate); return;

static void FN(tile_rows)(int rows, const scalar_t* A, i64 sar, i64 sak, const scalar_t* P, i64 K,
                          scalar_t* C, i64 ldc, i64 w, int accumulate) {
    switch (rows) {
        GEMM_ROW_CASES(TILE_CASE)
        default: return;
    }
}
#undef TILE_CASE

#if SEQ_HALF_GEMM
/* The bfloat16 GEMM of a sequence call whose struct sets half_gemm (a bfloat16 layer, computed in
   float32): C[M, N] (=|+=) bf16(A) · B with AVX512-BF16 dot products (vdpbf16ps: products of
   bfloat16 pairs summed into float32 lanes), at twice the float FMA's multiply-adds per
   instruction. B is a bfloat16 layer's weight, every value a bfloat16 exactly, so only A (h_{t−1},
   dhp, or the step's inputs, which are bfloat16 too) is rounded: to nearest even, as
   torch.nn.LSTM's bfloat16 GEMMs take their inputs. The instruction treats subnormal inputs as
   zero and flushes subnormal results.

   B is packed into panels of NR columns as the float tile's, each panel holding K2 = ⌈K/2⌉ rows of
   NR 32-bit lanes: B[2kk, j] in the low half of lane j of row kk, B[2kk + 1, j] in its high half
   (zero past K and N). A row of A is rounded into ⌈K/2⌉ such pairs (bfloat16 values in order). */
/* A thread's rounded A is written as bfloat16 values and read as their pairs. */
typedef uint32_t half_pair __attribute__((may_alias));

static inline uint32_t half_pack2(float lo, float hi) {
    return (uint32_t)f32_to_bf16(lo) | (uint32_t)f32_to_bf16(hi) << 16;
}

/* B[k, j] = W[j·K + k] (transposed: forward, W [N, K]) or W[k·N + j] (backward, W [K, N]) into
   pair panels at Q, each read in its own order (a row of W, or two rows of B, at a time). */
static void half_pack_panels(const float* W, i64 K, i64 N, int transposed, uint32_t* Q, int nt) {
    const i64 K2 = (K + 1) / 2, even = K / 2;
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 p = 0; p < (N + NR - 1) / NR; ++p) {
        const i64 j0 = p * NR, w = N - j0 < NR ? N - j0 : NR;
        uint32_t* dst = Q + p * K2 * NR;
        if (transposed) {
            for (i64 jj = 0; jj < w; ++jj) {
                const float* row = W + (j0 + jj) * K;
                for (i64 kk = 0; kk < even; ++kk)
                    dst[kk * NR + jj] = half_pack2(row[2 * kk], row[2 * kk + 1]);
                if (K % 2) dst[even * NR + jj] = half_pack2(row[K - 1], 0.0f);
            }
        } else {
            for (i64 kk = 0; kk < even; ++kk) {
                const float *r0 = W + 2 * kk * N + j0, *r1 = r0 + N;
                for (i64 jj = 0; jj < w; ++jj) dst[kk * NR + jj] = half_pack2(r0[jj], r1[jj]);
            }
            if (K % 2)
                for (i64 jj = 0; jj < w; ++jj)
                    dst[even * NR + jj] = half_pack2(W[(K - 1) * N + j0 + jj], 0.0f);
        }
        for (i64 kk = 0; kk < K2; ++kk) /* past column N: zero */
            for (i64 jj = w; jj < NR; ++jj) dst[kk * NR + jj] = 0;
    }
}

/* One tile of `rows` rows (a constant per inlined copy) × the first w <= NR columns of panel Q. */
static inline __attribute__((always_inline)) void half_tile(const half_pair* A2, i64 ld2,
                                                            i64 K2, const uint32_t* Q,
                                                            const int rows, float* C, i64 ldc,
                                                            i64 w, int accumulate) {
    __m512 acc[GEMM_MR][2];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (i64 kk = 0; kk < K2; ++kk) {
        FN(prefetch_panel)((const float*)Q, kk);
        __m512i b0 = _mm512_load_si512((const void*)(Q + kk * NR));
        __m512i b1 = _mm512_load_si512((const void*)(Q + kk * NR + VL));
        IN_REGISTERS(b0, b1);
        for (int r = 0; r < rows; ++r) {
            const __m512i a = _mm512_set1_epi32((int)A2[r * ld2 + kk]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)a, (__m512bh)b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)a, (__m512bh)b1);
        }
    }
    for (int r = 0; r < rows; ++r) {
        float out[NR];
        _mm512_storeu_ps(out, acc[r][0]);
        _mm512_storeu_ps(out + VL, acc[r][1]);
        float* c = C + r * ldc;
        if (w == NR) {
            for (i64 j = 0; j < NR; ++j) c[j] = accumulate ? c[j] + out[j] : out[j];
        } else { /* the last panel: only its first w columns exist in C */
            for (i64 j = 0; j < w; ++j) c[j] = accumulate ? c[j] + out[j] : out[j];
        }
    }
}

/* Up to GEMM_WIDE_MR rows, two adjacent full panels at once (as gemm_tile_wide): 4·rows
   independent accumulators instead of 2·rows. */
static inline __attribute__((always_inline)) void half_tile_wide(const half_pair* A2, i64 ld2,
                                                                 i64 K2, const uint32_t* Q,
                                                                 const int rows, float* C,
                                                                 i64 ldc, int accumulate) {
    __m512 acc[GEMM_WIDE_MR][4];
    const uint32_t* Q2 = Q + K2 * NR; /* the next panel */
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (i64 kk = 0; kk < K2; ++kk) {
        FN(prefetch_panel)((const float*)Q, kk);
        FN(prefetch_panel)((const float*)Q2, kk);
        __m512i b0 = _mm512_load_si512((const void*)(Q + kk * NR));
        __m512i b1 = _mm512_load_si512((const void*)(Q + kk * NR + VL));
        __m512i b2 = _mm512_load_si512((const void*)(Q2 + kk * NR));
        __m512i b3 = _mm512_load_si512((const void*)(Q2 + kk * NR + VL));
        IN_REGISTERS(b0, b1);
        IN_REGISTERS(b2, b3);
        for (int r = 0; r < rows; ++r) {
            const __m512i a = _mm512_set1_epi32((int)A2[r * ld2 + kk]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)a, (__m512bh)b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)a, (__m512bh)b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], (__m512bh)a, (__m512bh)b2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], (__m512bh)a, (__m512bh)b3);
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < 4; ++v) {
            float* c = C + r * ldc + v * VL;
            const __m512 t = accumulate ? _mm512_add_ps(_mm512_loadu_ps(c), acc[r][v]) : acc[r][v];
            _mm512_storeu_ps(c, t);
        }
}

#define HALF_WIDE_CASE(R) \
    case R: half_tile_wide(A2, ld2, K2, Q, R, C, ldc, accumulate); return;

static void half_tile_rows_wide(int rows, const half_pair* A2, i64 ld2, i64 K2, const uint32_t* Q,
                                float* C, i64 ldc, int accumulate) {
    switch (rows) {
        GEMM_WIDE_CASES(HALF_WIDE_CASE)
        default: return;
    }
}
#undef HALF_WIDE_CASE

#define HALF_CASE(R) \
    case R: half_tile(A2, ld2, K2, Q, R, C, ldc, w, accumulate); return;

static void half_tile_rows(int rows, const half_pair* A2, i64 ld2, i64 K2, const uint32_t* Q,
                           float* C, i64 ldc, i64 w, int accumulate) {
    switch (rows) {
        GEMM_ROW_CASES(HALF_CASE)
        default: return;
    }
}
#undef HALF_CASE

/* A[M, K] (row-major, leading dimension lda) rounded to bfloat16 into A2, ⌈K/2⌉ pairs a row (an
   odd K's last pair zero in its high half), row i from pair i·ld2 (half_rows_apart). */
static void half_round_rows(i64 M, i64 K, const float* A, i64 lda, uint16_t* A2, i64 ld2) {
    for (i64 i = 0; i < M; ++i) {
        f32_row_to_bf16(A + i * lda, A2 + 2 * i * ld2, K, 0);
        if (K % 2) A2[2 * i * ld2 + K] = 0;
    }
}

/* The pairs from one rounded row of A to the next, for ⌈K/2⌉ pairs a row (spread_row_bytes). */
static inline i64 half_rows_apart(i64 K2) { return spread_row_bytes(K2 * 4) / 4; }

#if SEQ_AMX
/* The same GEMM on the AMX tiles, for processors that have them (rnn_set_amx): a tile register
   holds up to 16 rows of 64 bytes, and TDPBF16PS adds a tile of A's pairs (rows × 16 pairs) times
   one of B's (16 pair rows × 16 columns) into a float tile (rows × 16 columns), 8192 multiply-adds
   an instruction. The pair panels and A's pairs are laid out as the tiles read them: a panel's
   row kk holds column j's pair (B[2kk, j], B[2kk + 1, j]) in lane j, so each panel of NR = 32
   columns is two B tiles side by side (stride NR lanes), and A's rows of K2 pairs are A tiles as
   they are. Tiles: 0, 1 the two column halves of C; 2, 3, 4 A and the two B of a block of 16
   pairs; 5, 6, 7 the same for the last K2 % 16 pairs. One configuration per row count (16, or
   the last block's rows): loaded at every call, since other code of the process (oneDNN) loads
   its own between ours. The same sums as half_tile in another order (the tiles add a row's pairs
   in blocks of 16), and as it, subnormal operands are zero and subnormal results flushed. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;
_Static_assert(sizeof(amx_config) == 64, "the tile configuration is 64 bytes");
_Static_assert(NR == 32, "a pair panel is two tiles of 16 columns");

#define AMX_ROWS 16
#define AMX_PAIRS 16
/* A last panel of fewer than NR columns goes through a thread's buffer of AMX_ROWS × NR floats. */
static __thread float amx_edge[AMX_ROWS * NR] __attribute__((aligned(64)));

static void amx_configure(int rows, int rest) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; ++t) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64; /* C */
    c.rows[2] = (uint8_t)rows, c.colsb[2] = AMX_PAIRS * 4;                   /* A */
    for (int t = 3; t < 5; ++t) c.rows[t] = AMX_PAIRS, c.colsb[t] = 64;     /* B */
    if (rest) {
        c.rows[5] = (uint8_t)rows, c.colsb[5] = (uint16_t)(rest * 4);
        for (int t = 6; t < 8; ++t) c.rows[t] = (uint8_t)rest, c.colsb[t] = 64;
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

/* Rows [i0, i0 + rows) of C's panels [lo, hi), the tiles configured for `rows` (see above). */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_rows(
    i64 i0, int rows, i64 N, i64 K2, const half_pair* A2, i64 ld2, const uint32_t* Q, float* C,
    i64 ldc, int accumulate, i64 lo, i64 hi) {
    const i64 full = K2 - K2 % AMX_PAIRS;
    const half_pair* a = A2 + i0 * ld2;
    for (i64 p = lo; p < hi; ++p) {
        const i64 j0 = p * NR, w = N - j0 < NR ? N - j0 : NR;
        const uint32_t* q = Q + p * K2 * NR;
        float* c = C + i0 * ldc + j0;
        float* out = c; /* where the tiles are loaded from and stored to */
        i64 ld = ldc;
        if (w < NR) { /* past column N: the thread's edge buffer, copied to C after */
            out = amx_edge, ld = NR;
            for (int r = 0; r < rows; ++r)
                for (i64 j = 0; j < NR; ++j)
                    amx_edge[r * NR + j] = accumulate && j < w ? c[r * ldc + j] : 0;
        }
        if (accumulate || w < NR) {
            _tile_loadd(0, out, ld * 4);
            _tile_loadd(1, out + 16, ld * 4);
        } else {
            _tile_zero(0);
            _tile_zero(1);
        }
        for (i64 kb = 0; kb < full; kb += AMX_PAIRS) {
            _tile_loadd(2, a + kb, ld2 * 4);
            _tile_loadd(3, q + kb * NR, NR * 4);
            _tile_loadd(4, q + kb * NR + 16, NR * 4);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        if (full < K2) {
            _tile_loadd(5, a + full, ld2 * 4);
            _tile_loadd(6, q + full * NR, NR * 4);
            _tile_loadd(7, q + full * NR + 16, NR * 4);
            _tile_dpbf16ps(0, 5, 6);
            _tile_dpbf16ps(1, 5, 7);
        }
        _tile_stored(0, out, ld * 4);
        _tile_stored(1, out + 16, ld * 4);
        if (w < NR)
            for (int r = 0; r < rows; ++r)
                for (i64 j = 0; j < w; ++j) c[r * ldc + j] = amx_edge[r * NR + j];
    }
}

/* Part `part` of `parts` of C[M, N] (=|+=) A2 · B on the tiles: a contiguous share of the panels,
   in blocks of AMX_ROWS rows. The tile state is released after (no other code finds it held). */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_gemm_part(
    i64 M, i64 N, i64 K2, const half_pair* A2, i64 ld2, const uint32_t* Q, float* C, i64 ldc,
    int accumulate, int part, int parts) {
    i64 lo, hi;
    row_block((N + NR - 1) / NR, parts, part, &lo, &hi);
    if (M <= 0 || lo >= hi) return;
    int configured = 0;
    for (i64 i0 = 0; i0 < M; i0 += AMX_ROWS) {
        const int rows = M - i0 < AMX_ROWS ? (int)(M - i0) : AMX_ROWS;
        if (rows != configured) amx_configure(rows, (int)(K2 % AMX_PAIRS)), configured = rows;
        amx_rows(i0, rows, N, K2, A2, ld2, Q, C, ldc, accumulate, lo, hi);
    }
    _tile_release();
}
#endif
#endif

/* The operands of C[M, N] (=|+=) A[M, K] · B with B in panels: A[i, k] at A + i·sar + k·sak and
   the float panels P (K rows of NR values each), or with Q (SEQ_HALF_GEMM) A rounded to bfloat16
   pairs A2 and B in pair panels Q (⌈K/2⌉ rows each). */
typedef struct {
    const scalar_t* A;
    i64 sar, sak, K;
    const scalar_t* P;
#if SEQ_HALF_GEMM
    const half_pair* A2;
    const uint32_t* Q;
    i64 ld2; /* pairs from one row of A2 to the next */
#endif
    scalar_t* C;
    i64 ldc;
    int accumulate;
#if GEMM_PACK_A
    int packed; /* A copied by gemm_part: a tile's rows from A + i0·K, A[k·rows + r] */
#endif
} FN(gemm_ops);

/* A tile of `rows` rows from row i0 at panel p (column j): w <= NR columns of it, or (wide) it and
   the next panel, both full. */
static inline void FN(tile_at)(const FN(gemm_ops) * g, int rows, i64 i0, i64 p, i64 j, i64 w,
                               int wide) {
    scalar_t* c = g->C + i0 * g->ldc + j;
#if SEQ_HALF_GEMM
    if (g->Q) {
        const i64 K2 = (g->K + 1) / 2;
        const half_pair* a = g->A2 + i0 * g->ld2;
        const uint32_t* q = g->Q + p * K2 * NR;
        if (wide) half_tile_rows_wide(rows, a, g->ld2, K2, q, c, g->ldc, g->accumulate);
        else half_tile_rows(rows, a, g->ld2, K2, q, c, g->ldc, w, g->accumulate);
        return;
    }
#endif
#if GEMM_PACK_A
    const i64 sar = g->packed ? 0 : g->sar; /* 0: TILE_A's packed layout */
    const scalar_t* a = g->A + i0 * (g->packed ? g->K : g->sar);
#else
    const i64 sar = g->sar;
    const scalar_t* a = g->A + i0 * sar;
#endif
    const scalar_t* P = g->P + p * g->K * NR;
    if (wide) FN(tile_rows_wide)(rows, a, sar, g->sak, P, g->K, c, g->ldc, g->accumulate);
    else FN(tile_rows)(rows, a, sar, g->sak, P, g->K, c, g->ldc, w, g->accumulate);
}

/* The tiles of C[M, N] (=|+=) A · B (the operands g) of part `part` of `parts`: a contiguous
   share of the panels (pairs of panels up to GEMM_WIDE_MR rows). */
static void FN(gemm_tiles)(i64 M, i64 N, const FN(gemm_ops) * g, int part, int parts) {
    const i64 np = FN(panels)(N);
    i64 lo, hi;
    if (M <= GEMM_WIDE_MR) { /* pairs of full panels by the wide tile, any rest by the narrow */
        row_block((np + 1) / 2, parts, part, &lo, &hi);
        for (i64 q = lo; q < hi; ++q) {
            const i64 j0 = 2 * q * NR;
            if (N - j0 >= 2 * NR) {
                FN(tile_at)(g, (int)M, 0, 2 * q, j0, NR, 1);
                continue;
            }
            for (i64 p = 2 * q; p < np; ++p) {
                const i64 j = p * NR, w = N - j < NR ? N - j : NR;
                FN(tile_at)(g, (int)M, 0, p, j, w, 0);
            }
        }
        return;
    }
    const i64 tiles = (M + GEMM_MR - 1) / GEMM_MR;
    /* near-equal row tiles when each keeps at least GEMM_BALANCED rows, else full tiles first */
    const int balanced = M / tiles >= GEMM_BALANCED;
    row_block(np, parts, part, &lo, &hi);
    for (i64 p = lo; p < hi; ++p) {
        const i64 j0 = p * NR, w = N - j0 < NR ? N - j0 : NR;
        i64 i0 = 0;
        for (i64 t = 0; t < tiles; ++t) {
            const i64 rows = balanced ? M / tiles + (t < M % tiles ? 1 : 0)
                                      : (M - i0 < GEMM_MR ? M - i0 : GEMM_MR);
            FN(tile_at)(g, (int)rows, i0, p, j0, w, 0);
            i0 += rows;
        }
    }
}

/* A tile reads one value of each of its rows at a time, every row a stream of its own. Rows a
   multiple of 4 KiB apart fall in one set of L1 (64 sets of 64-byte lines on current x86 cores,
   8 ways on AMD's, 12 on recent Intel's): the 14-row AVX-512 tile's rows evicted one another, and
   the panel's lines with them. A GEMM whose A is such (the recurrent step at H = 1024, the
   backward's dhp at H = 256: G = 4H floats a row) and whose tiles have more rows than
   GEMM_L1_WAYS runs on a copy of A in the calling thread's buffer (SLOT_SPREAD_A), each row one
   cache line further on: in blocks of rows of at most GEMM_SPREAD_BYTES, the copy of each made just before
   its tiles (K values a row, against K·N multiply-adds). AMD EPYC (Zen 4), one thread, M = 256,
   GFLOP/s: (K, N) = (1024, 4096) 78 → 98, (4096, 1024) 72 → 98, (1024, 256) 83 → 102, as
   GEMM_PACK_A's 101, 95, 95 (bench_rnn_gemm.py). The 6-row AVX2 tile lost nothing to the sets
   there (104 against 99 with the copy), so it reads A in place. */
#define GEMM_SPREAD_BYTES (2 << 20)

#if !GEMM_PACK_A
/* The rows of each block of A that gemm_part copies with its rows spread (near-equal blocks of
   at most GEMM_SPREAD_BYTES), or 0 where A is read in place. */
static i64 FN(spread_block)(i64 M, const FN(gemm_ops) * g) {
    const i64 stride = g->sar * (i64)sizeof(scalar_t);
    if (M <= GEMM_L1_WAYS || g->sak != 1 || spread_row_bytes(stride) == stride) return 0;
#if SEQ_HALF_GEMM
    if (g->Q) return 0; /* the tiles read A2, rounded in a buffer of their own */
#endif
    const i64 row_bytes = spread_row_bytes(g->K * (i64)sizeof(scalar_t));
    const i64 blocks = (M * row_bytes + GEMM_SPREAD_BYTES - 1) / GEMM_SPREAD_BYTES;
    return (M + blocks - 1) / blocks;
}
#endif

/* Part `part` of `parts` of C[M, N] (=|+=) A · B (the operands g), A read in place, packed
   (GEMM_PACK_A) or spread (spread_block). */
static void FN(gemm_part)(i64 M, i64 N, const FN(gemm_ops) * g, int part, int parts) {
    if (M <= 0) return;
#if GEMM_PACK_A
    FN(gemm_ops) gp = *g;
#if SEQ_HALF_GEMM
    if (!g->Q)
#endif
    {
        scalar_t* Ap = FN(pack_buffer)(M * g->K, SLOT_PACK_A); /* NULL: A read in place */
        const i64 tiles = M <= GEMM_WIDE_MR ? 1 : (M + GEMM_MR - 1) / GEMM_MR;
        const int balanced = M <= GEMM_WIDE_MR || M / tiles >= GEMM_BALANCED;
        i64 i0 = 0;
        for (i64 t = 0; Ap && t < tiles; ++t) {
            const i64 rows = balanced ? M / tiles + (t < M % tiles ? 1 : 0)
                                      : (M - i0 < GEMM_MR ? M - i0 : GEMM_MR);
            scalar_t* dst = Ap + i0 * g->K;
            for (i64 r = 0; r < rows; ++r) {
                const scalar_t* src = g->A + (i0 + r) * g->sar;
                for (i64 k = 0; k < g->K; ++k) dst[k * rows + r] = src[k * g->sak];
            }
            i0 += rows;
        }
        if (Ap) {
            gp.A = Ap;
            gp.packed = 1;
            g = &gp;
        }
    }
#else
    const i64 block = FN(spread_block)(M, g);
    const i64 lda = spread_row_bytes(g->K * (i64)sizeof(scalar_t)) / (i64)sizeof(scalar_t);
    scalar_t* spread = block ? FN(pack_buffer)(block * lda, SLOT_SPREAD_A) : NULL;
    if (spread) { /* NULL: A read in place */
        FN(gemm_ops) gs = *g;
        gs.A = spread;
        gs.sar = lda;
        for (i64 i0 = 0; i0 < M; i0 += block) {
            const i64 m = M - i0 < block ? M - i0 : block;
            for (i64 i = 0; i < m; ++i)
                memcpy(spread + i * lda, g->A + (i0 + i) * g->sar,
                       (size_t)g->K * sizeof(scalar_t));
            gs.C = g->C + i0 * g->ldc;
            FN(gemm_tiles)(m, N, &gs, part, parts);
        }
        return;
    }
#endif
    FN(gemm_tiles)(M, N, g, part, parts);
}

/* C[M, N] (=|+=) A[M, K] · B with B packed by pack_panels; the panels split across nt threads. */
static void FN(gemm)(i64 M, i64 N, i64 K, const scalar_t* A, i64 sar, i64 sak, const scalar_t* P,
                     scalar_t* C, i64 ldc, int accumulate, int nt) {
    const FN(gemm_ops) g = {.A = A, .sar = sar, .sak = sak, .K = K, .P = P, .C = C, .ldc = ldc,
                            .accumulate = accumulate};
    if (nt <= 1) { /* no parallel region: its entry costs a step of a short sequence */
        FN(gemm_part)(M, N, &g, 0, 1);
        return;
    }
    #pragma omp parallel num_threads(nt)
    FN(gemm_part)(M, N, &g, omp_get_thread_num(), omp_get_num_threads());
}

/* dw rows [lo, hi) of weight_grad: each block of GEMM_KC rows of hprev packed into the calling
   thread's panels, then multiplied by that share of dhpᵀ, the panels shared among nt threads. */
static int FN(weight_grad_rows)(const FN(weight_grad_args) * a, i64 lo, i64 hi, int nt) {
    const i64 N = a->N, G = a->G, H = a->H;
    scalar_t* P = FN(pack_buffer)(GEMM_KC * FN(panels)(H) * NR, SLOT_W_HH);
    if (!P) return RNN_ERR_NOMEM;
    for (i64 k0 = 0; k0 < N; k0 += GEMM_KC) {
        const i64 kc = N - k0 < GEMM_KC ? N - k0 : GEMM_KC;
        FN(pack_panels)(a->hprev + k0 * H, H, kc, H, P, 1);
        FN(gemm)(hi - lo, H, kc, a->dhp + k0 * G + lo, 1, G, P, a->dw + lo * H, H, k0 > 0, nt);
    }
    return 0;
}

/* The threads of weight_grad share out hprev's panels of columns, packed once per block of rows;
   with fewer panels than threads (H <= NR: one panel, the LN-LSTM's small states) the rows of dw
   instead, each thread packing the panels itself (K·H values a block, against the K·H·G/threads
   multiply-adds it then runs). Each dw value is the same sum in the same order either way. AMD
   EPYC Zen 5, (N, G, H) = (10240, 128, 32), (10240, 128, 16): one thread 0.40, 0.41 ms, two by
   the rows 0.26, 0.27 (torch.mm on two: 0.52, 0.33); by two panels at (6400, 256, 64) 0.90 ->
   0.59. */
int FN(weight_grad)(const FN(weight_grad_args) * a) {
    const i64 N = a->N, G = a->G, H = a->H;
    if (N == 0) {
        for (i64 i = 0; i < G * H; ++i) a->dw[i] = 0;
        return 0;
    }
    const int threads = threads_for(G * H * N, FN(panels)(H), a->gemm_grain, a->threads);
    const int by_rows = threads_for(G * H * N, G / GEMM_MR, a->gemm_grain, a->threads);
    if (by_rows > threads) {
        int failed = 0;
        #pragma omp parallel num_threads(by_rows) reduction(| : failed)
        {
            i64 lo, hi;
            row_block(G, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
            failed |= hi > lo && FN(weight_grad_rows)(a, lo, hi, 1) != 0;
        }
        return failed ? RNN_ERR_NOMEM : 0;
    }
    return FN(weight_grad_rows)(a, 0, G, threads);
}

/* C[M, N] = A[M, K] · Wᵀ with A row-major (leading dimension K) and W[N, K] read as stored: every
   output the dot product of a row of A and a row of W. The forward GEMM of a sequence of at most
   DIRECT_ROWS rows in all its steps (a decoder's token for a batch of up to 8): packing W_hhᵀ
   reads W and writes all of it again, a transpose of scalar stores that costs more than the
   products of those rows (T = 1, batch 8, H = 512: 0.6× the time of the LN-LSTM call). Past them
   the packed GEMM is faster (batch 16: 0.9×, batch 64: 0.7×; two steps of 16: 0.7×), as every
   block of W here reads all of A again. A block of DOT_M rows of A × DOT_N rows of W keeps
   DOT_M·DOT_N vector accumulators over K, each loaded vector feeding DOT_N or DOT_M FMAs; lanes
   are summed at the end, so only the rounding differs from the packed GEMM. */
#define DOT_M 4
#if VEC_BYTES >= 64
#define DOT_N 4
#else
#define DOT_N 2 /* 16 registers: 2·4 accumulators, 4 + 2 loaded vectors */
#endif
/* One row of A (a decoder's token for a batch of one): DOT_WIDE rows of W at a time, so that
   DOT_WIDE independent FMA chains hide the FMA latency (DOT_N chains left it waiting on each
   sum) and as many streams of W are read at once. */
#define DOT_WIDE 8
#define DOT_ACC (DOT_M * DOT_N > DOT_WIDE ? DOT_M * DOT_N : DOT_WIDE)

/* The sums of the lanes of four vectors: two rounds of shuffles fold them into one vector whose
   quarters hold each one's partial sums (VL/4 lanes each), then those are added. Summing each
   vector's lanes on its own (a store and VL − 1 scalar adds) took longer than the FMAs of a
   4 × 4 block at K = 256 (the direct GEMM of a decoder call ran at 44 GFLOP/s). */
typedef __typeof__(_Generic((scalar_t)0, float: (int32_t)0, default: (int64_t)0)) FN(lane_t);
typedef FN(lane_t) FN(ivec) __attribute__((vector_size(VEC_BYTES)));
#define QUARTER (VL >= 4 ? VL / 4 : 1)

/* The two rounds of shuffles of sum4 (at least four lanes): quarter q of the result holds
   vector q's QUARTER partial sums. */
static inline FN(vec) FN(fold4)(FN(vec) v0, FN(vec) v1, FN(vec) v2, FN(vec) v3) {
    FN(ivec) lo, hi, qa, qb;
    for (i64 l = 0; l < VL; ++l) {
        /* round 1: halves of each pair's vectors added, the first's into the lower half */
        lo[l] = (FN(lane_t))(l < VL / 2 ? l : VL + l - VL / 2);
        hi[l] = (FN(lane_t))(lo[l] + VL / 2);
        /* round 2: quarter q of the result holds vector q's partial sums */
        const i64 q = l / QUARTER, j = l % QUARTER;
        qa[l] = (FN(lane_t))((q >= 2 ? VL : 0) + (q % 2) * (VL / 2) + j);
        qb[l] = (FN(lane_t))(qa[l] + QUARTER);
    }
    const FN(vec) x01 = __builtin_shuffle(v0, v1, lo) + __builtin_shuffle(v0, v1, hi);
    const FN(vec) x23 = __builtin_shuffle(v2, v3, lo) + __builtin_shuffle(v2, v3, hi);
    return __builtin_shuffle(x01, x23, qa) + __builtin_shuffle(x01, x23, qb);
}

static inline void FN(sum4)(FN(vec) v0, FN(vec) v1, FN(vec) v2, FN(vec) v3, scalar_t* out) {
    if (VL < 4) { /* two lanes (portable float64): nothing to fold */
        const FN(vec) v[4] = {v0, v1, v2, v3};
        for (int q = 0; q < 4; ++q) {
            scalar_t t[VL];
            memcpy(t, &v[q], sizeof t);
            out[q] = 0;
            for (i64 l = 0; l < VL; ++l) out[q] += t[l];
        }
        return;
    }
    const FN(vec) y = FN(fold4)(v0, v1, v2, v3);
    scalar_t t[VL];
    memcpy(t, &y, sizeof t);
    for (int q = 0; q < 4; ++q) {
        scalar_t sum = t[q * QUARTER];
        for (i64 j = 1; j < QUARTER; ++j) sum += t[q * QUARTER + j];
        out[q] = sum;
    }
}

/* The sixteen sums of a 4 × 4 block's accumulators, acc[r·4 + c] into out[r·4 + c], where a
   vector has sixteen lanes (AVX-512 float32; other widths take sum4): fold4 of each column's
   four accumulators (quarter r of y_c: acc[r·4 + c]'s four partial sums), then two more
   rounds of shuffles within the quarters give one vector of the sixteen sums. Four sum4 had
   finished with sixteen scalar sums of four lanes, as many instructions as a block's
   multiply-adds at K = 128. */
static inline void FN(sum4x4)(const FN(vec) * acc, scalar_t* out) {
    FN(vec) y[4];
    for (int c = 0; c < 4; ++c) y[c] = FN(fold4)(acc[c], acc[4 + c], acc[8 + c], acc[12 + c]);
    FN(ivec) a3, b3, a4, b4;
    for (i64 l = 0; l < VL; ++l) {
        const i64 q = l / 4, p = l % 4, other = p < 2 ? 0 : VL;
        /* round 3: lanes 0, 1 of quarter q fold the first vector's quarter (lanes j, j + 2),
           lanes 2, 3 the second's */
        a3[l] = (FN(lane_t))(other + q * 4 + p % 2);
        b3[l] = (FN(lane_t))(a3[l] + 2);
        /* round 4: lane p of quarter q is column p's sum, from the first result (p < 2) or the
           second, its lanes (p % 2)·2 and the next */
        a4[l] = (FN(lane_t))(other + q * 4 + (p % 2) * 2);
        b4[l] = (FN(lane_t))(a4[l] + 1);
    }
    const FN(vec) u01 = __builtin_shuffle(y[0], y[1], a3) + __builtin_shuffle(y[0], y[1], b3);
    const FN(vec) u23 = __builtin_shuffle(y[2], y[3], a3) + __builtin_shuffle(y[2], y[3], b3);
    const FN(vec) z = __builtin_shuffle(u01, u23, a4) + __builtin_shuffle(u01, u23, b4);
    memcpy(out, &z, sizeof z);
}

/* One k-block of dot_block: each loaded vector an operand of rm (rn) FMAs from a register
   (folded into every FMA as a memory operand, what GCC does otherwise, a 4 × 4 block issued 32
   loads per 16 FMAs, two a cycle's worth where the FMAs take one); the first block (`first`, a
   constant in each inlined copy) sets the accumulators instead of adding to them. */
static inline __attribute__((always_inline)) void FN(dot_step)(
    FN(vec) * acc, const scalar_t* A, const scalar_t* W, i64 K, i64 k, const int rm,
    const int rn, const int first) {
    FN(vec) w[DOT_ACC];
    for (int c = 0; c < rn; ++c) {
        w[c] = *(const FN(vec)*)(W + c * K + k);
        IN_REGISTER(w[c]);
    }
    for (int r = 0; r < rm; ++r) {
        FN(vec) a = *(const FN(vec)*)(A + r * K + k);
        IN_REGISTER(a);
        for (int c = 0; c < rn; ++c) acc[r * rn + c] = first ? a * w[c] : acc[r * rn + c] + a * w[c];
    }
}

static inline __attribute__((always_inline)) void FN(dot_block)(
    const scalar_t* A, const scalar_t* W, i64 K, const int rm, const int rn, scalar_t* C,
    i64 ldc) {
    /* The accumulators start as the first k-block's products rather than zeros: the array
       (too large for GCC to keep in registers as a whole) was cleared by a memset call per
       block, 8.9% of a one-step LN-LSTM cell call at (B, I, H) = (8, 64, 128). The ones past
       rm·rn that sum4 reads (to a multiple of four) are zeros. */
    FN(vec) acc[DOT_ACC + 3];
    for (int i = rm * rn; i < ((rm * rn + 3) & ~3); ++i) acc[i] = (FN(vec)){0};
    const i64 kv = K - K % VL;
    if (kv > 0) {
        FN(dot_step)(acc, A, W, K, 0, rm, rn, 1);
        for (i64 k = VL; k < kv; k += VL) FN(dot_step)(acc, A, W, K, k, rm, rn, 0);
    } else {
        for (int i = 0; i < rm * rn; ++i) acc[i] = (FN(vec)){0};
    }
    scalar_t sums[DOT_ACC + 3];
    if (VL == 16 && rm == 4 && rn == 4)
        FN(sum4x4)(acc, sums);
    else
        for (int i = 0; i < rm * rn; i += 4) FN(sum4)(acc[i], acc[i + 1], acc[i + 2], acc[i + 3], sums + i);
    for (int r = 0; r < rm; ++r)
        for (int c = 0; c < rn; ++c) {
            scalar_t sum = sums[r * rn + c];
            for (i64 k = kv; k < K; ++k) sum += A[r * K + k] * W[c * K + k];
            C[r * ldc + c] = sum;
        }
}
#undef QUARTER

#define DOT_CASE(R)                                                     \
    case R:                                                             \
        if (rn == DOT_N) FN(dot_block)(A, W, K, R, DOT_N, C, ldc);      \
        else FN(dot_block)(A, W, K, R, 1, C, ldc);                      \
        return;

/* One block, with rm (the rows of A left, at most DOT_M) and rn (DOT_N or, past the last full
   block of W's rows, 1) constants in each inlined copy, so that the loops unroll and the
   accumulators stay in registers. */
static void FN(dot_rows)(int rm, int rn, const scalar_t* A, const scalar_t* W, i64 K,
                         scalar_t* C, i64 ldc) {
    if (rm == 1 && rn == DOT_WIDE) {
        FN(dot_block)(A, W, K, 1, DOT_WIDE, C, ldc);
        return;
    }
    switch (rm) {
        DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4)
        default: return;
    }
}
#undef DOT_CASE

static void FN(gemm_nt_direct)(i64 M, i64 N, i64 K, const scalar_t* A, const scalar_t* W,
                               scalar_t* C, i64 ldc, int nt) {
    const int bn = M == 1 ? DOT_WIDE : DOT_N; /* rows of W a block */
    const i64 full = N / bn;
    #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (i64 b = 0; b < full + N % bn; ++b) {
        const i64 j = b < full ? b * bn : full * bn + (b - full); /* then W's rows one by one */
        for (i64 i = 0; i < M; i += DOT_M) {
            const int rm = M - i < DOT_M ? (int)(M - i) : DOT_M;
            FN(dot_rows)(rm, b < full ? bn : 1, A + i * K, W + j * K, K, C + i * ldc + j, ldc);
        }
    }
}

/* How a forward time loop's GEMMs read a weight: packed (0), or as stored, by the dot kernel above
   (AS_STORED_DOT), by MKL's sgemm (AS_STORED_MKL: float, where rnn.py set it), or as the
   struct's bfloat16 weights (AS_STORED_HALF: FN(half_weights)). */
#ifndef RNN_SEQ_AS_STORED
#define RNN_SEQ_AS_STORED
enum { AS_STORED_DOT = 1, AS_STORED_MKL = 2, AS_STORED_HALF = 3 };
#endif

#if SEQ_PACKED_GEMM
/* Whether every size of a forward call's GEMMs (all_rows in all) fits MKL's int. */
static int FN(fits_mkl_int)(const FN(rnn_seq_fwd_args) * s, i64 all_rows, i64 G, i64 H) {
    const i64 sizes[] = {all_rows, G, H, s->I, s->P};
    int fits = 1;
    for (int i = 0; i < 5; ++i) fits &= sizes[i] <= INT_MAX;
    return fits;
}
#endif

/* How a forward call of these steps (all_rows in all, projected rows of P units) reads its
   weights: the bfloat16 ones where the struct gives them (half_weights_valid held); by the dot
   kernel up to DIRECT_ROWS rows; by MKL's sgemm for one step of more rows (float, products not
   rounded to bfloat16, sizes within MKL's int); else packed. */
static int FN(as_stored)(const FN(rnn_seq_fwd_args) * s, i64 all_rows, i64 G, i64 H) {
    if (s->w_half) return AS_STORED_HALF;
    if (all_rows <= DIRECT_ROWS) return AS_STORED_DOT;
#if SEQ_PACKED_GEMM
    if (mkl_sgemm && s->n_steps == 1 && !s->half_gemm && FN(fits_mkl_int)(s, all_rows, G, H))
        return AS_STORED_MKL;
#else
    (void)s, (void)G, (void)H;
#endif
    return 0;
}

/* A forward call's bfloat16 weights (the struct's w_half, w_ih_half: a bfloat16 layer's one step
   computed in float32, x and h_{t−1} exactly bfloat16 values) as its GEMMs take them: by MKL's
   gemm_bf16bf16f32 (read once for the call: a setter call may clear it), A's values narrowed to
   bfloat16 into a16 (exactly), where rnn.py set it and the sizes fit MKL's int; else each weight
   widened to float32 once (w, w_ih), then the dot kernel. The products are exact either way and
   summed in float32, in an order of the GEMM's choosing (MKL's may treat subnormal bfloat16 inputs
   as zero, as the AMX tiles do). */
typedef struct {
#if SEQ_PACKED_GEMM
    mkl_half_gemm_fn gemm;
#endif
    uint16_t* a16;                /* with gemm: the step's A rows as bfloat16 */
    const scalar_t *w, *w_ih;     /* without gemm: the weights widened */
} FN(half_weights);

/* b for the call's rows (all_rows) of at most max(I, P) columns; 0 when a buffer cannot grow. */
static int FN(half_weights_init)(FN(half_weights) * b, const FN(rnn_seq_fwd_args) * s,
                                 i64 all_rows, i64 G, i64 H) {
    *b = (FN(half_weights)){0};
#if SEQ_PACKED_GEMM
    const mkl_half_gemm_fn gemm = mkl_half_gemm;
    if (gemm && FN(fits_mkl_int)(s, all_rows, G, H)) {
        const i64 cols = s->I > s->P ? s->I : s->P;
        b->gemm = gemm;
        b->a16 = (uint16_t*)FN(pack_buffer)((all_rows * cols + 1) / 2, SLOT_PACK_A);
        return b->a16 != NULL;
    }
    float* w = FN(pack_buffer)(G * s->P, SLOT_W_HH);
    float* w_ih = s->w_ih_half ? FN(pack_buffer)(G * s->I, SLOT_W_IH) : NULL;
    if (!w || (s->w_ih_half && !w_ih)) return 0;
    bf16_row_to_f32(s->w_half, w, G * s->P, NULL);
    if (w_ih) bf16_row_to_f32(s->w_ih_half, w_ih, G * s->I, NULL);
    b->w = w;
    b->w_ih = w_ih;
    return 1;
#else
    (void)s, (void)all_rows, (void)G, (void)H;
    return 0; /* half_weights_valid refuses w_half for this type */
#endif
}

/* C[M, N] = A[M, K] · Wᵀ for a GEMM of FN(half_weights) b: W16 [N, K] the bfloat16 weight as
   stored, W its widened copy in b (NULL with b->gemm). */
static void FN(gemm_half)(const FN(half_weights) * b, i64 M, i64 N, i64 K, const scalar_t* A,
                          const uint16_t* W16, const scalar_t* W, scalar_t* C, i64 ldc, int nt) {
#if SEQ_PACKED_GEMM
    if (b->gemm) {
        if (M <= 0 || N <= 0) return;
        f32_row_to_bf16(A, b->a16, M * K, 0); /* exact: A's values are bfloat16 */
        /* column-major as sgemm's in gemm_as_stored */
        const int m = (int)N, n = (int)M, k = (int)K, lda = k > 0 ? k : 1, ld = (int)ldc;
        const float one = 1.0f, zero = 0.0f;
        b->gemm("T", "N", &m, &n, &k, &one, W16, &lda, b->a16, &lda, &zero, C, &ld);
        return;
    }
#endif
    (void)b, (void)W16;
    FN(gemm_nt_direct)(M, N, K, A, W, C, ldc, nt);
}

/* C[M, N] = A[M, K] · Wᵀ, W [N, K] and A read as stored (`how`: FN(as_stored)'s). */
static void FN(gemm_as_stored)(int how, i64 M, i64 N, i64 K, const scalar_t* A,
                               const scalar_t* W, scalar_t* C, i64 ldc, int nt) {
#if SEQ_PACKED_GEMM
    const mkl_sgemm_fn sgemm = mkl_sgemm; /* read once: a setter call may clear it */
    if (how == AS_STORED_MKL && sgemm) {
        /* column-major: Cᵀ[N, M] = W[N, K] · Aᵀ, W's and A's rows its K-long columns (a
           leading dimension of at least 1, as BLAS checks, where K = 0) */
        const int m = (int)N, n = (int)M, k = (int)K, lda = k > 0 ? k : 1, ld = (int)ldc;
        const float one = 1.0f, zero = 0.0f; /* beta 0: C is not read */
        if (M > 0 && N > 0) sgemm("T", "N", &m, &n, &k, &one, W, &lda, A, &lda, &zero, C, &ld);
        return;
    }
#endif
    (void)how;
    FN(gemm_nt_direct)(M, N, K, A, W, C, ldc, nt);
}

/* A sequence kernel's weight B[K, N], packed into buffer `slot`: backward B = W_hh itself
   (row-major [K, N]); forward (transposed = 1) B = W_hhᵀ or W_ihᵀ, read from W [N, K]. NULL when
   the buffer cannot grow. */
static const scalar_t* FN(packed_weight)(const scalar_t* w, i64 K, i64 N, int transposed, int nt,
                                         int slot) {
    scalar_t* P = FN(pack_buffer)(K * FN(panels)(N) * NR, slot);
    if (P && transposed) FN(pack_panels_t)(w, K, N, P, nt);
    else if (P) FN(pack_panels)(w, N, K, N, P, nt);
    return P;
}

/* A sequence kernel's weight as its GEMMs take it, B[K, N] of C = A · B: forward (transposed)
   W_hhᵀ or W_ihᵀ read from W [N, K], backward W_hh [K, N] itself. Packed into the tile's panels,
   or by MKL's packed GEMM (float, where rnn.py set it: rnn_set_packed_gemm) when the caller runs
   each GEMM on one thread, the whole sequence or a thread's own rows of the batch: MKL's packed B
   cannot be shared out by columns as the panels are. */
typedef struct {
    const scalar_t* panels; /* the tile's, or NULL */
    const float* mkl;       /* MKL's packed B, or NULL */
    mkl_compute_fn compute; /* taken at packing: a later rnn_set_packed_gemm does not reach it */
    const uint32_t* half;   /* bfloat16 pair panels (half_gemm), or NULL */
    uint16_t* half_a; /* with half: each thread's rounded A, half_a_rows rows of half_rows_apart */
    i64 half_a_rows, K, N;
} FN(weight);

/* Pack W into buffer `slot` as b, for the GEMMs of a sequence call of batch B whose threads
   form a team of `team` (by_rows: each carries its own rows of the batch through every step).
   By MKL where rnn.py set its entry points (float) and each GEMM runs on one thread (alone, or
   by rows: MKL's packed B cannot be shared out by columns as the panels are), packed for calls
   of a thread's rows; else into the tile's panels with nt threads. 0 when the buffer cannot grow
   (the caller returns RNN_ERR_NOMEM). */
static int FN(weight_init)(FN(weight) * b, const scalar_t* w, i64 K, i64 N, int transposed,
                           i64 B, int team, int by_rows, int nt, int slot, int half) {
    *b = (FN(weight)){NULL, NULL, NULL, NULL, NULL, 0, K, N};
#if SEQ_HALF_GEMM
    if (half) { /* every thread of a team or of a GEMM's own region (at most nt) rounds A */
        const i64 K2 = (K + 1) / 2, threads = team > nt ? team : nt, rows = B < 1 ? 1 : B;
        uint32_t* Q = (uint32_t*)FN(pack_buffer)(K2 * FN(panels)(N) * NR, slot);
        uint16_t* A2 = (uint16_t*)FN(pack_buffer)(threads * rows * half_rows_apart(K2),
                                                  slot + WEIGHT_SLOTS);
        if (!Q || !A2) return 0;
        half_pack_panels(w, K, N, transposed, Q, nt);
        b->half = Q;
        b->half_a = A2;
        b->half_a_rows = rows;
        return 1;
    }
#else
    (void)half;
#endif
#if SEQ_PACKED_GEMM
    /* the entry points read once, together: a setter call may clear them at any time */
    const mkl_pack_size_fn pack_size = mkl_pack_size;
    const mkl_pack_fn pack = mkl_pack;
    const mkl_compute_fn compute = mkl_compute;
    if ((team == 1 || by_rows) && pack_size && pack && compute && B <= INT_MAX && K <= INT_MAX &&
        N <= INT_MAX) {
        const i64 rows = by_rows ? (B + team - 1) / team : B;
        const int m = rows < 1 ? 1 : (int)rows;
        const size_t bytes = pack_size(CBLAS_B_MATRIX, m, (int)N, (int)K);
        float* P = FN(pack_buffer)((i64)((bytes + sizeof(float) - 1) / sizeof(float)), slot);
        if (!P) return 0;
        pack(CBLAS_ROW_MAJOR, CBLAS_B_MATRIX, transposed ? CBLAS_TRANS : CBLAS_NO_TRANS, m,
             (int)N, (int)K, 1.0f, w, (int)(transposed ? K : N), P);
        b->mkl = P;
        b->compute = compute;
        return 1;
    }
#else
    (void)B, (void)team, (void)by_rows;
#endif
    b->panels = FN(packed_weight)(w, K, N, transposed, nt, slot);
    return b->panels != NULL;
}

/* Part `part` of `parts` of C[M, N] (=|+=) A[M, K] · B, A row-major with leading dimension lda:
   a contiguous share of the panels; MKL's packed B only as one part (weight_init's callers). */
static void FN(wgemm_part)(const FN(weight) * b, i64 M, const scalar_t* A, i64 lda, scalar_t* C,
                           i64 ldc, int accumulate, int part, int parts) {
#if SEQ_PACKED_GEMM
    if (b->mkl) {
        /* beta 0: C is not read (BLAS), so an unwritten buffer's NaN does not reach it */
        if (M > 0)
            b->compute(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_PACKED, (int)M, (int)b->N,
                       (int)b->K, A, (int)lda, b->mkl, (int)b->N, accumulate ? 1.0f : 0.0f, C,
                       (int)ldc);
        return;
    }
#endif
    FN(gemm_ops) g = {.A = A, .sar = lda, .sak = 1, .K = b->K, .P = b->panels, .C = C,
                      .ldc = ldc, .accumulate = accumulate};
#if SEQ_HALF_GEMM
    if (b->half) { /* A rounded into the calling thread's pairs, then the pair panels */
        const i64 K2 = (b->K + 1) / 2, ld2 = half_rows_apart(K2);
        uint16_t* A2 = b->half_a + 2 * omp_get_thread_num() * b->half_a_rows * ld2;
        half_round_rows(M, b->K, A, lda, A2, ld2);
#if SEQ_AMX
        if (amx_on) {
            amx_gemm_part(M, b->N, K2, (const half_pair*)A2, ld2, b->half, C, ldc, accumulate,
                          part, parts);
            return;
        }
#endif
        g.A2 = (const half_pair*)A2;
        g.Q = b->half;
        g.ld2 = ld2;
    }
#endif
    FN(gemm_part)(M, b->N, &g, part, parts);
}

/* C[M, N] (=|+=) A[M, K] · B: MKL's packed GEMM, or the panels split across nt threads. */
static void FN(wgemm)(const FN(weight) * b, i64 M, const scalar_t* A, i64 lda, scalar_t* C,
                      i64 ldc, int accumulate, int nt) {
    if (b->mkl || nt <= 1) { /* MKL's packed B: one part */
        FN(wgemm_part)(b, M, A, lda, C, ldc, accumulate, 0, 1);
        return;
    }
    #pragma omp parallel num_threads(nt)
    FN(wgemm_part)(b, M, A, lda, C, ldc, accumulate, omp_get_thread_num(), omp_get_num_threads());
}

/* Threads of a step's GEMM over `cols` output columns and of its step kernel. */
static inline int FN(gemm_threads)(i64 rows, i64 cols, i64 inner, i64 grain, int nt) {
    return threads_for(rows * cols * inner, FN(panels)(cols), grain, nt);
}

/* y[M, N] = x[M, K] · Wᵀ (transposed: W [N, K] as stored) or x · W (W [K, N]): the input
   projection of all rows where it runs before a time loop, or its input gradient after one. W is
   packed once into the tile's panels (slot 0: no sequence kernel runs meanwhile on this thread),
   as a time loop packs W_ih, and the panels are shared out among the threads. */
int FN(matmul)(const FN(matmul_args) * a) {
    const i64 M = a->M, K = a->K, N = a->N;
    if (a->transposed ? (a->R != N || a->C != K) : (a->R != K || a->C != N))
        return RNN_ERR_PROJECTION;
    if (M == 0 || N == 0) return 0;
    if (K == 0) {
        for (i64 i = 0; i < M * N; ++i) a->y[i] = 0;
        return 0;
    }
    const int nt = FN(gemm_threads)(M, N, K, a->gemm_grain, a->threads);
    FN(weight) wb;
    if (!FN(weight_init)(&wb, a->w, K, N, a->transposed, M, nt, 0, nt, SLOT_W_HH, a->half_gemm))
        return RNN_ERR_NOMEM;
    FN(wgemm)(&wb, M, a->x, K, a->y, N, 0, nt);
    return 0;
}

/* The step kernels' rows (rnn_step_impl.h), for the threads of a sequence call. */
void FN(lstm_fwd_rows)(const FN(lstm_fwd_step_args) * a, i64 lo, i64 hi);
void FN(lstm_bwd_rows)(const FN(lstm_bwd_step_args) * a, i64 lo, i64 hi, scalar_t* sums);
void FN(gru_fwd_rows)(const FN(gru_fwd_step_args) * a, i64 lo, i64 hi);
void FN(gru_bwd_rows)(const FN(gru_bwd_step_args) * a, i64 lo, i64 hi, scalar_t* sums);
void FN(elman_fwd_rows)(const FN(elman_fwd_step_args) * a, i64 lo, i64 hi);
void FN(elman_bwd_rows)(const FN(elman_bwd_step_args) * a, i64 lo, i64 hi, scalar_t* sums);
void FN(input_rows)(scalar_t* gx, i64 G, i64 split, const scalar_t* w0, const scalar_t* b0,
                    double eps, int layer_norm, i64 lo, i64 hi);


/* The layer norms' parameter-gradient sums of a backward call (rnn_abi.py, _LN_GRADS). Each thread
   adds its rows' terms to its own scalar_t partials (the rows functions' sums) and moves them into
   its float64 totals every BLOCK_TERMS rows it has run, as the norm kernels sum dw and db (a
   scalar_t sum of at most BLOCK_TERMS terms per value, then float64); at the end the threads'
   totals are added in thread order, so that a team of the same size gives the same result. */
typedef struct {
    scalar_t* part; /* per thread, `stride` apart: partial sums of the rows since the last move */
    double* total;  /* per thread, `stride` apart */
    i64 n, stride;  /* sums per thread (0: none asked), spacing (whole 64-byte lines) */
} FN(grad_sums);

/* 0, or RNN_ERR_NOMEM (nothing allocated). */
static int FN(grad_sums_init)(FN(grad_sums) * g, i64 n, int team) {
    g->n = n;
    g->stride = (n + 15) / 16 * 16; /* whole 64-byte lines of float and of double per thread */
    g->part = NULL;
    g->total = NULL;
    if (!n) return 0;
    void *p = NULL, *q = NULL;
    const size_t count = (size_t)(g->stride * team);
    if (posix_memalign(&p, 64, count * sizeof(scalar_t)) || posix_memalign(&q, 64, count * 8)) {
        free(p);
        return RNN_ERR_NOMEM;
    }
    g->part = p;
    g->total = q;
    memset(p, 0, count * sizeof(scalar_t));
    memset(q, 0, count * 8);
    return 0;
}

static inline scalar_t* FN(grad_sums_part)(const FN(grad_sums) * g, int tid) {
    return g->n ? g->part + tid * g->stride : NULL;
}

/* After a thread's rows: every BLOCK_TERMS rows (and with last), its partials into its totals. */
static inline void FN(grad_sums_add)(const FN(grad_sums) * g, int tid, i64 rows, i64* pending,
                                     int last) {
    if (!g->n) return;
    *pending += rows;
    if (*pending < BLOCK_TERMS && !(last && *pending)) return;
    scalar_t* part = g->part + tid * g->stride;
    double* total = g->total + tid * g->stride;
    #pragma omp simd
    for (i64 j = 0; j < g->n; ++j) {
        total[j] += (double)part[j];
        part[j] = 0;
    }
    *pending = 0;
}

/* The threads' totals, in thread order, into the outputs: out[o] (NULL: skipped) takes the
   next n[o] sums; then frees the buffers. */
#define GRAD_SUMS_OUTS 3
/* Sums per thread: those of every output when any is asked for (summed), else none. */
static inline i64 FN(grad_sums_count)(int summed, const i64* n) {
    i64 total = 0;
    for (int o = 0; summed && o < GRAD_SUMS_OUTS; ++o) total += n[o];
    return total;
}
static void FN(grad_sums_finish)(FN(grad_sums) * g, int team, scalar_t* const* out,
                                 const i64* n) {
    if (g->n) {
        for (int t = 1; t < team; ++t)
            for (i64 j = 0; j < g->n; ++j) g->total[j] += g->total[t * g->stride + j];
        for (i64 o = 0, first = 0; o < GRAD_SUMS_OUTS && first < g->n; first += n[o++])
            for (i64 j = 0; out[o] && j < n[o]; ++j) out[o][j] = (scalar_t)g->total[first + j];
    }
    free(g->part);
    free(g->total);
}

/* torch.nn.LSTM's projection in a forward time loop (rnn_abi.py, _RECURRENT_PROJECTION): part
   `part` of `parts` of the step's rows [lo, hi) of h_t = h~_t W_hrᵀ, from the step kernel's
   output rows h~ (hu: (N, H), the step beginning at row off) into the carried state hr, the
   next step's GEMM input. */
static void FN(project_part)(const FN(weight) * wrb, const scalar_t* hu,
                             const FN(rnn_seq_fwd_args) * s, i64 off, i64 lo, i64 hi, int part,
                             int parts) {
    const i64 H = wrb->K, P = s->P;
    FN(wgemm_part)(wrb, hi - lo, hu + (off + lo) * H, H, s->hr + lo * P, P, 0, part, parts);
}

/* The step's rows [lo, hi) of the projected state, copied to the output rows out_r. */
static void FN(projected_rows_out)(const FN(rnn_seq_fwd_args) * s, i64 off, i64 lo, i64 hi) {
    if (hi > lo)
        memcpy(s->out_r + (off + lo) * s->P, s->hr + lo * s->P,
               (size_t)((hi - lo) * s->P) * sizeof(scalar_t));
}

/* A training forward keeps hp and gx for every row of the sequence (R = N, X = N): memory the
   call has not touched yet, which the step's GEMMs wrote tile by tile, a few columns of many rows
   at a time, the tiles waiting on the writes. Those GEMMs write the step's rows into a buffer of
   B rows instead (stage_rows; it stays in cache from one step to the next), and each thread
   copies its rows to the kept ones in one sequential pass before it reads them (unstage): the
   same values. LN-LSTM forward with gradients, x torch.nn.LSTM's, before / after, one | two
   threads: (T, B, I, H) = (50, 32, 64, 128) 1.28 / 1.16 | 1.20 / 1.09, (30, 128, 64, 64)
   1.39 / 1.31 | 1.37 / 1.25, (100, 32, 128, 256) 0.89 / 0.84 | 0.80 / 0.76; forward and backward
   0-5% less (AMD EPYC Zen 4, RESULTS.md 2026-11-30). NULL where the GEMM writes the kept rows
   itself: inference (the kept buffers are B rows already), one step, no memory. */
static inline scalar_t* FN(stage_rows)(i64 kept, i64 N, i64 B, i64 G, int slot) {
    return kept == N && N > B ? FN(pack_buffer)(B * G, slot) : NULL;
}

/* Rows [lo, hi) of a step's staged GEMM output (stage_rows; NULL: none) into its kept rows. */
static inline void FN(unstage)(const scalar_t* stage, scalar_t* kept, i64 lo, i64 hi, i64 G) {
    if (stage && hi > lo)
        memcpy(kept + lo * G, stage + lo * G, (size_t)((hi - lo) * G) * sizeof(scalar_t));
}

/* The time loops, the same for every cell; they expand inside a *_seq kernel with its step
   struct a, sequence struct s, gate rows G and `step`, a copy of *a that each step's rows and
   threads are written into.

   Forward: per step the recurrent GEMM h_{t−1} W_hhᵀ into the step's rows of hp (with kept
   buffers of B rows, rows [0, rows)), then the cell's step kernel STEP_FN. With the input
   projection (s->x, inference), first the step's x rows times W_ihᵀ into gx's B rows, finished
   by input_rows (its layer norms) just before each row's step: gx never leaves the cache. With
   torch.nn.LSTM's projection (s->w_hr, the LSTM's inference: TAKES_W_HR), the step kernel's
   output rows hold h~_t (H units), a GEMM (project_part) turns them into h_t = W_hr h~_t (P
   units) in the carried state hr, the recurrent GEMM's input, and each step's rows of hr are
   copied to out_r.

   With more than one thread for some step (the grains decide, as for one step), the whole time
   loop is one parallel region. Where batch_split (rnn_common.h) allows, each thread runs its
   own rows of the batch through every step, GEMMs and ROWS_FN, and never waits; else its
   threads take a share of each step's GEMM (panels) and of its rows (ROWS_FN), and meet at a
   team_barrier after each, instead of a fork-join per GEMM and per step kernel. All steps are
   checked before the region (nothing returns from inside it). */
#define TEAM_MAX(u, v) ((u) > (v) ? (u) : (v))
#define FORWARD_IN_TIME(STEP_FN, ROWS_FN, STEP_NORMALIZES_GX, TAKES_W_HR)                         \
    do {                                                                                          \
        if (!kept_rows_valid(a->R, a->N, a->B)) return RNN_ERR_ROWS;                              \
        if (!projection_valid(s->x, s->w_ih, s->split, G, a->X, a->N, a->B) ||                    \
            !recurrent_projection_valid(s->w_hr, s->hr, s->out_r, s->P, a->H, (TAKES_W_HR), a->R, \
                                        a->B, a->zh) ||                                           \
            !half_weights_valid(s->w_half, s->w_ih_half, s->x, s->w_hr, s->n_steps,               \
                                sizeof(scalar_t) == sizeof(float)))                               \
            return RNN_ERR_PROJECTION;                                                            \
        const i64 H = a->H, I = s->I, P = s->P;                                                   \
        /* the state the recurrent GEMM reads: h_{t−1} (P = H), or its projection */              \
        scalar_t* const state = s->w_hr ? s->hr : a->h;                                           \
        /* the GEMMs' rows staged (training), in the calling thread's buffers */                  \
        scalar_t* const stage_hp = FN(stage_rows)(a->R, a->N, a->B, G, SLOT_STAGE_H);            \
        scalar_t* const stage_gx =                                                                \
            s->x ? FN(stage_rows)(a->X, a->N, a->B, G, SLOT_STAGE_X) : NULL;                     \
        i64 all_rows = 0; /* checked step by step below; here only the choice of GEMM */          \
        int team = 1;                                                                             \
        for (i64 k = 0; k < s->n_steps; ++k) {                                                    \
            const i64 rows = s->steps[2 * k + 1];                                                 \
            all_rows += rows;                                                                     \
            team = TEAM_MAX(team, FN(gemm_threads)(rows, G, P, s->gemm_grain, s->threads));       \
            team = TEAM_MAX(team, threads_for(rows * G, rows, s->grain, s->threads));             \
            if (s->x)                                                                             \
                team = TEAM_MAX(team, FN(gemm_threads)(rows, G, I, s->gemm_grain, s->threads));   \
            if (s->w_hr)                                                                          \
                team = TEAM_MAX(team, FN(gemm_threads)(rows, P, H, s->gemm_grain, s->threads));   \
        }                                                                                         \
        const int direct = FN(as_stored)(s, all_rows, G, H); /* 0: weights packed */              \
        FN(half_weights) hw = {0};                                                                \
        if (direct == AS_STORED_HALF && !FN(half_weights_init)(&hw, s, all_rows, G, H))           \
            return RNN_ERR_NOMEM;                                                                 \
        team = team_cap(team);                                                                    \
        const i64 packed = ((P + (s->x ? I : 0)) * FN(panels)(G) +                                \
                            (s->w_hr ? H * FN(panels)(P) : 0)) * NR * (i64)sizeof(scalar_t);      \
        const int by_rows =                                                                       \
            batch_split(s->steps, s->n_steps, a->B, team, packed, batch_split_bytes);             \
        FN(weight) wb = {0}, wxb = {0}, wrb = {0}; /* unless direct */                            \
        if (!direct &&                                                                            \
            (!FN(weight_init)(&wb, s->w, P, G, 1, a->B, team, by_rows, s->threads, SLOT_W_HH,     \
                              s->half_gemm >= 2) ||                                               \
             (s->x && !FN(weight_init)(&wxb, s->w_ih, I, G, 1, a->B, team, by_rows,               \
                                       s->threads, SLOT_W_IH, s->half_gemm >= 1)) ||              \
             (s->w_hr && !FN(weight_init)(&wrb, s->w_hr, H, P, 1, a->B, team, by_rows,            \
                                          s->threads, SLOT_W_HR, s->half_gemm >= 2))))            \
            return RNN_ERR_NOMEM;                                                                 \
        if (team > 1 && !direct) {                                                                \
            for (i64 k = 0; k < s->n_steps; ++k)                                                  \
                if (!rows_in_range(s->steps[2 * k], s->steps[2 * k + 1], a->N, a->B))             \
                    return RNN_ERR_ROWS;                                                          \
            team_barrier bar;                                                                     \
            team_init(&bar);                                                                      \
            _Pragma("omp parallel num_threads(team)")                                             \
            {                                                                                     \
                const int tid = omp_get_thread_num(), nth = omp_get_num_threads();                \
                __typeof__(step) mine = step;                                                     \
                i64 lo, hi; /* by_rows: this thread's rows of the batch */                        \
                row_block(a->B, nth, tid, &lo, &hi);                                              \
                for (i64 k = 0; by_rows && hi > lo && k < s->n_steps; ++k) {                      \
                    mine.off = s->steps[2 * k];                                                   \
                    mine.rows = s->steps[2 * k + 1];                                              \
                    scalar_t* hp = a->hp + kept_row(a->R, a->N, mine.off, 0) * G;                 \
                    scalar_t* gx = a->gx + kept_row(a->X, a->N, mine.off, 0) * G;                 \
                    if (s->x) {                                                                   \
                        FN(wgemm_part)(&wxb, hi - lo, s->x + (mine.off + lo) * I, I,              \
                                       (stage_gx ? stage_gx : gx) + lo * G, G, 0, 0, 1);          \
                        FN(unstage)(stage_gx, gx, lo, hi, G);                                     \
                    } else {                                                                      \
                        prefetch_l2(gx + lo * G, (hi - lo) * G * (i64)sizeof(scalar_t));          \
                    }                                                                             \
                    FN(wgemm_part)(&wb, hi - lo, state + lo * P, P,                               \
                                   (stage_hp ? stage_hp : hp) + lo * G, G, 0, 0, 1);              \
                    FN(unstage)(stage_hp, hp, lo, hi, G);                                         \
                    if (s->x && !(STEP_NORMALIZES_GX))                                            \
                        FN(input_rows)(gx, G, s->split, s->w0, s->b0, a->eps, a->layer_norm, lo,  \
                                       hi);                                                       \
                    ROWS_FN(&mine, lo, hi);                                                       \
                    if (s->w_hr) {                                                                \
                        FN(project_part)(&wrb, a->out, s, mine.off, lo, hi, 0, 1);                \
                        FN(projected_rows_out)(s, mine.off, lo, hi);                              \
                    }                                                                             \
                }                                                                                 \
                for (i64 k = 0; !by_rows && k < s->n_steps; ++k) {                                \
                    mine.off = s->steps[2 * k];                                                   \
                    mine.rows = s->steps[2 * k + 1];                                              \
                    scalar_t* hp = a->hp + kept_row(a->R, a->N, mine.off, 0) * G;                 \
                    scalar_t* gx = a->gx + kept_row(a->X, a->N, mine.off, 0) * G;                 \
                    const int gnt = FN(gemm_threads)(mine.rows, G, P, s->gemm_grain, nth);        \
                    if (s->x) {                                                                   \
                        const int xnt = FN(gemm_threads)(mine.rows, G, I, s->gemm_grain, nth);    \
                        if (tid < xnt)                                                            \
                            FN(wgemm_part)(&wxb, mine.rows, s->x + mine.off * I, I,               \
                                           stage_gx ? stage_gx : gx, G, 0, tid, xnt);             \
                    } else if (tid == 0) {                                                        \
                        prefetch_l2(gx, mine.rows * G * (i64)sizeof(scalar_t));                   \
                    }                                                                             \
                    if (tid < gnt)                                                                \
                        FN(wgemm_part)(&wb, mine.rows, state, P, stage_hp ? stage_hp : hp, G,     \
                                       0, tid, gnt);                                              \
                    team_wait(&bar, nth);                                                         \
                    const int rnt = threads_for(mine.rows * G, mine.rows, s->grain, nth);         \
                    if (tid < rnt) {                                                              \
                        row_block(mine.rows, rnt, tid, &lo, &hi);                                 \
                        FN(unstage)(stage_gx, gx, lo, hi, G); /* all written: the wait above */   \
                        FN(unstage)(stage_hp, hp, lo, hi, G);                                     \
                        if (s->x && !(STEP_NORMALIZES_GX))                                        \
                            FN(input_rows)(gx, G, s->split, s->w0, s->b0, a->eps, a->layer_norm,  \
                                           lo, hi);                                               \
                        ROWS_FN(&mine, lo, hi);                                                   \
                    }                                                                             \
                    team_wait(&bar, nth);                                                         \
                    if (s->w_hr) { /* hr's rows written by panels, then read by row blocks */     \
                        const int pnt = FN(gemm_threads)(mine.rows, P, H, s->gemm_grain, nth);    \
                        if (tid < pnt)                                                            \
                            FN(project_part)(&wrb, a->out, s, mine.off, 0, mine.rows, tid, pnt);  \
                        team_wait(&bar, nth);                                                     \
                        /* the copy only reads hr, as the next step's first GEMM: no wait */      \
                        row_block(mine.rows, nth, tid, &lo, &hi);                                 \
                        FN(projected_rows_out)(s, mine.off, lo, hi);                              \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            return 0;                                                                             \
        }                                                                                         \
        for (i64 k = 0; k < s->n_steps; ++k) {                                                    \
            step.off = s->steps[2 * k];                                                           \
            step.rows = s->steps[2 * k + 1];                                                      \
            if (!rows_in_range(step.off, step.rows, a->N, a->B)) return RNN_ERR_ROWS;             \
            scalar_t* hp = a->hp + kept_row(a->R, a->N, step.off, 0) * G;                         \
            scalar_t* gx = a->gx + kept_row(a->X, a->N, step.off, 0) * G;                         \
            scalar_t* const hp_out = stage_hp ? stage_hp : hp; /* the GEMMs' rows */              \
            if (s->x) {                                                                           \
                const scalar_t* xr = s->x + step.off * I;                                         \
                const int xnt = FN(gemm_threads)(step.rows, G, I, s->gemm_grain, s->threads);     \
                scalar_t* const gx_out = stage_gx ? stage_gx : gx;                                \
                if (direct == AS_STORED_HALF)                                                     \
                    FN(gemm_half)(&hw, step.rows, G, I, xr, s->w_ih_half, hw.w_ih, gx_out, G,     \
                                  xnt);                                                           \
                else if (direct)                                                                  \
                    FN(gemm_as_stored)(direct, step.rows, G, I, xr, s->w_ih, gx_out, G, xnt);     \
                else                                                                              \
                    FN(wgemm)(&wxb, step.rows, xr, I, gx_out, G, 0, xnt);                         \
                FN(unstage)(stage_gx, gx, 0, step.rows, G);                                       \
                if (!(STEP_NORMALIZES_GX))                                                        \
                    FN(input_rows)(gx, G, s->split, s->w0, s->b0, a->eps, a->layer_norm, 0,       \
                                   step.rows);                                                    \
            } else {                                                                              \
                prefetch_l2(gx, step.rows * G * (i64)sizeof(scalar_t));                           \
            }                                                                                     \
            const int gemm_nt = FN(gemm_threads)(step.rows, G, P, s->gemm_grain, s->threads);     \
            if (direct == AS_STORED_HALF)                                                         \
                FN(gemm_half)(&hw, step.rows, G, P, state, s->w_half, hw.w, hp_out, G, gemm_nt);  \
            else if (direct)                                                                      \
                FN(gemm_as_stored)(direct, step.rows, G, P, state, s->w, hp_out, G, gemm_nt);     \
            else                                                                                  \
                FN(wgemm)(&wb, step.rows, state, P, hp_out, G, 0, gemm_nt);                       \
            FN(unstage)(stage_hp, hp, 0, step.rows, G);                                           \
            step.threads = threads_for(step.rows * G, step.rows, s->grain, s->threads);           \
            STEP_FN(&step);                                                                       \
            if (s->w_hr) {                                                                        \
                const scalar_t* hu = a->out + step.off * H;                                       \
                const int pnt = FN(gemm_threads)(step.rows, P, H, s->gemm_grain, s->threads);     \
                if (direct)                                                                       \
                    FN(gemm_as_stored)(direct, step.rows, P, H, hu, s->w_hr, s->hr, P, pnt);      \
                else                                                                              \
                    FN(wgemm)(&wrb, step.rows, hu, H, s->hr, P, 0, pnt);                          \
                FN(projected_rows_out)(s, step.off, 0, step.rows);                                \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    } while (0)

/* Backward: every step checked first (VALID, an expression over `step`: nothing is touched when
   one fails), then per step in reverse the cell's rows ROWS_FN, which leave dhp (and add to the
   thread's grad_sums partials where SUMMED), and the GEMM dh (=|+=) dhp · W_hh (ACCUMULATE: +=
   where the step left the direct path of h_{t−1} in dh); with s->dx, also dx = dgx · W_ih of the
   step's rows (DGX: the kind's (N, G) gradient of gx, NULL where it takes no dx); with several
   threads, as one parallel region as forward. The sums go to the GRAD_SUMS_OUTS outputs OUTS
   (scalar_t* const[]) of N_OUT (i64[]) sums each, in order. */
#define BACKWARD_IN_TIME(ROWS_FN, VALID, ACCUMULATE, SUMMED, OUTS, N_OUT, DGX)                   \
    do {                                                                                          \
        const i64 H = a->H, I = s->I;                                                             \
        const scalar_t* dgx = (DGX);                                                              \
        if (!projection_grad_valid(s->w_ih, s->dx, dgx != NULL)) return RNN_ERR_PROJECTION;       \
        int team = 1;                                                                             \
        for (i64 k = 0; k < s->n_steps; ++k) {                                                    \
            step.off = s->steps[2 * k];                                                           \
            step.rows = s->steps[2 * k + 1];                                                      \
            if (!rows_in_range(step.off, step.rows, a->N, a->B) || !(VALID))                      \
                return RNN_ERR_ROWS;                                                              \
            team = TEAM_MAX(team, FN(gemm_threads)(step.rows, H, G, s->gemm_grain, s->threads));  \
            team = TEAM_MAX(team, threads_for(step.rows * G, step.rows, s->grain, s->threads));   \
            if (s->dx)                                                                            \
                team = TEAM_MAX(team, FN(gemm_threads)(step.rows, I, G, s->gemm_grain, s->threads)); \
        }                                                                                         \
        team = team_cap(team);                                                                    \
        const i64 packed = G * (FN(panels)(H) + (s->dx ? FN(panels)(I) : 0)) * NR *               \
                           (i64)sizeof(scalar_t);                                                 \
        const int by_rows =                                                                       \
            batch_split(s->steps, s->n_steps, a->B, team, packed, batch_split_bytes);             \
        FN(weight) wb, wib = {0}; /* W_hh and W_ih themselves: dh = dhp · W_hh, dx = dgx · W_ih */ \
        if (!FN(weight_init)(&wb, s->w, G, H, 0, a->B, team, by_rows, s->threads, 0,              \
                             s->half_gemm >= 2) ||                                                \
            (s->dx && !FN(weight_init)(&wib, s->w_ih, G, I, 0, a->B, team, by_rows, s->threads,   \
                                       1, 0))) /* x's gradient: not a recurrent product */       \
            return RNN_ERR_NOMEM;                                                                 \
        FN(grad_sums) sums;                                                                       \
        if (FN(grad_sums_init)(&sums, FN(grad_sums_count)((SUMMED), (N_OUT)), team))             \
            return RNN_ERR_NOMEM;                                                                 \
        if (team > 1) {                                                                           \
            team_barrier bar;                                                                     \
            team_init(&bar);                                                                      \
            _Pragma("omp parallel num_threads(team)")                                             \
            {                                                                                     \
                const int tid = omp_get_thread_num(), nth = omp_get_num_threads();                \
                __typeof__(step) mine = step;                                                     \
                scalar_t* part = FN(grad_sums_part)(&sums, tid);                                  \
                i64 lo, hi, pending = 0; /* by_rows: this thread's rows of the batch */           \
                row_block(a->B, nth, tid, &lo, &hi);                                              \
                for (i64 k = s->n_steps - 1; by_rows && hi > lo && k >= 0; --k) {                 \
                    mine.off = s->steps[2 * k];                                                   \
                    mine.rows = s->steps[2 * k + 1];                                              \
                    ROWS_FN(&mine, lo, hi, part);                                                 \
                    FN(grad_sums_add)(&sums, tid, hi - lo, &pending, 0);                          \
                    FN(wgemm_part)(&wb, hi - lo, a->dhp + (mine.off + lo) * G, G, a->dh + lo * H, \
                                   H, (ACCUMULATE), 0, 1);                                        \
                    if (s->dx)                                                                    \
                        FN(wgemm_part)(&wib, hi - lo, dgx + (mine.off + lo) * G, G,               \
                                       s->dx + (mine.off + lo) * I, I, 0, 0, 1);                  \
                }                                                                                 \
                for (i64 k = s->n_steps - 1; !by_rows && k >= 0; --k) {                           \
                    mine.off = s->steps[2 * k];                                                   \
                    mine.rows = s->steps[2 * k + 1];                                              \
                    const int rnt = threads_for(mine.rows * G, mine.rows, s->grain, nth);         \
                    if (tid < rnt) {                                                              \
                        row_block(mine.rows, rnt, tid, &lo, &hi);                                 \
                        ROWS_FN(&mine, lo, hi, part);                                             \
                        FN(grad_sums_add)(&sums, tid, hi - lo, &pending, 0);                      \
                    }                                                                             \
                    team_wait(&bar, nth);                                                         \
                    const int gnt = FN(gemm_threads)(mine.rows, H, G, s->gemm_grain, nth);        \
                    if (tid < gnt)                                                                \
                        FN(wgemm_part)(&wb, mine.rows, a->dhp + mine.off * G, G, a->dh, H,        \
                                       (ACCUMULATE), tid, gnt);                                   \
                    const int xnt = s->dx ? FN(gemm_threads)(mine.rows, I, G, s->gemm_grain, nth) \
                                          : 0;                                                    \
                    if (tid < xnt)                                                                \
                        FN(wgemm_part)(&wib, mine.rows, dgx + mine.off * G, G,                    \
                                       s->dx + mine.off * I, I, 0, tid, xnt);                     \
                    team_wait(&bar, nth);                                                         \
                }                                                                                 \
                FN(grad_sums_add)(&sums, tid, 0, &pending, 1);                                    \
            }                                                                                     \
        } else {                                                                                  \
            scalar_t* part = FN(grad_sums_part)(&sums, 0);                                        \
            i64 pending = 0;                                                                      \
            for (i64 k = s->n_steps - 1; k >= 0; --k) {                                           \
                step.off = s->steps[2 * k];                                                       \
                step.rows = s->steps[2 * k + 1];                                                  \
                ROWS_FN(&step, 0, step.rows, part);                                               \
                FN(grad_sums_add)(&sums, 0, step.rows, &pending, 0);                              \
                FN(wgemm)(&wb, step.rows, a->dhp + step.off * G, G, a->dh, H, (ACCUMULATE), 1);   \
                if (s->dx)                                                                        \
                    FN(wgemm)(&wib, step.rows, dgx + step.off * G, G, s->dx + step.off * I, I, 0, \
                              1);                                                                 \
            }                                                                                     \
            FN(grad_sums_add)(&sums, 0, 0, &pending, 1);                                          \
        }                                                                                         \
        FN(grad_sums_finish)(&sums, team, (OUTS), (N_OUT));                                       \
        return 0;                                                                                 \
    } while (0)

int FN(lstm_fwd_seq)(const FN(lstm_fwd_step_args) * a, const FN(rnn_seq_fwd_args) * s) {
    const i64 G = 4 * a->H;
    /* gx normalized in the step is raw: given, or projected by the kernel (into every row,
       X = N, kept for backward; or into a step's B rows, inference) with no normalization or
       bias of its own (the sequence struct's w0, b0 NULL) */
    const int raw_gx = !s->x || (!s->w0 && !s->b0);
    if (!input_norm_valid(a->w0, a->b0 && a->mx && a->rx && raw_gx, a->layer_norm))
        return RNN_ERR_INPUT_NORM;
    FN(lstm_fwd_step_args) step = *a;
    FORWARD_IN_TIME(FN(lstm_fwd_step), FN(lstm_fwd_rows), a->w0 != NULL, 1);
}

/* Without zoneout of h the LSTM step leaves dh to its GEMM to overwrite; with it the step leaves
   the direct path zh·dh_t there, and the GEMM adds to it. Without cprev, c_{t−1} must be
   derivable for every step (see carried_before in rnn_step_impl.h). */
int FN(lstm_bwd_seq)(const FN(lstm_bwd_step_args) * a, const FN(rnn_seq_bwd_args) * s) {
    const i64 G = 4 * a->H;
    FN(lstm_bwd_step_args) step = *a;
    if (!input_norm_valid(a->w0, a->gx && a->mx && a->rx, a->layer_norm))
        return RNN_ERR_INPUT_NORM;
    const int summed = a->layer_norm && (s->hp_grads || s->c_grads || s->x_grads);
    scalar_t* const outs[GRAD_SUMS_OUTS] = {s->hp_grads, s->c_grads, a->w0 ? s->x_grads : NULL};
    const i64 n_out[GRAD_SUMS_OUTS] = {2 * G, 2 * a->H, a->w0 ? 2 * G : 0};
    BACKWARD_IN_TIME(FN(lstm_bwd_rows),
                     carried_before_valid(a->cprev, a->c0, step.off, step.rows, a->N, a->B),
                     a->zh != NULL, summed, outs, n_out, a->dgates);
}

int FN(gru_fwd_seq)(const FN(gru_fwd_step_args) * a, const FN(rnn_seq_fwd_args) * s) {
    const i64 G = 3 * a->H;
    FN(gru_fwd_step_args) step = *a;
    FORWARD_IN_TIME(FN(gru_fwd_step), FN(gru_fwd_rows), 0, 0);
}

/* The GRU step leaves the direct path of h_{t−1} in dh, so its GEMM adds to dh. */
int FN(gru_bwd_seq)(const FN(gru_bwd_step_args) * a, const FN(rnn_seq_bwd_args) * s) {
    const i64 G = 3 * a->H;
    FN(gru_bwd_step_args) step = *a;
    scalar_t* const outs[GRAD_SUMS_OUTS] = {s->hp_grads, NULL, NULL};
    const i64 n_out[GRAD_SUMS_OUTS] = {2 * G, 0, 0};
    BACKWARD_IN_TIME(FN(gru_bwd_rows), GRU_BWD_ROWS_VALID(a, step.off, step.rows), 1,
                     a->layer_norm && s->hp_grads, outs, n_out, NULL);
}

/* The Elman step normalizes hp + gx as one: gx is given for every row (no projection x, whose
   rows input_rows would normalize on their own). */
int FN(elman_fwd_seq)(const FN(elman_fwd_step_args) * a, const FN(rnn_seq_fwd_args) * s) {
    const i64 G = a->H;
    if (s->x || s->w_ih) return RNN_ERR_PROJECTION;
    FN(elman_fwd_step_args) step = *a;
    FORWARD_IN_TIME(FN(elman_fwd_step), FN(elman_fwd_rows), 0, 0);
}

/* Without zoneout of h the Elman step leaves dh to its GEMM to overwrite; with it the step leaves
   the direct path zh·dh_t there, and the GEMM adds to it (as the LSTM's). */
int FN(elman_bwd_seq)(const FN(elman_bwd_step_args) * a, const FN(rnn_seq_bwd_args) * s) {
    const i64 G = a->H;
    FN(elman_bwd_step_args) step = *a;
    scalar_t* const outs[GRAD_SUMS_OUTS] = {s->hp_grads, NULL, NULL};
    const i64 n_out[GRAD_SUMS_OUTS] = {2 * G, 0, 0};
    BACKWARD_IN_TIME(FN(elman_bwd_rows), 1, a->zh != NULL, a->layer_norm && s->hp_grads, outs,
                     n_out, NULL);
}

#undef FORWARD_IN_TIME
#undef GRAD_SUMS_OUTS
#undef TEAM_MAX
#undef BACKWARD_IN_TIME
#undef DOT_M
#undef DOT_N
#undef DOT_WIDE
#undef DOT_ACC
#undef VL
#undef NR
#undef GEMM_KC
#undef GEMM_WIDE_MR
#undef GEMM_WIDE_CASES
#undef IN_REGISTERS
#undef FN
