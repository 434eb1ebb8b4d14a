/* The processor's rate of AVX-512 float FMAs (vfmadd231ps) and AVX512-BF16 dot products
   (vdpbf16ps), for benchmarks/bf16_dot_rate.py: twelve independent accumulators each (more than
   either instruction's latency times its issue rate on the processors measured), so the loops run
   at the instruction's throughput. Not part of the package. */
#include <immintrin.h>
#include <stdint.h>

#define TWELVE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECLARE(i) __m512 a##i = _mm512_set1_ps((float)(i));
#define FOLD(i) + _mm512_reduce_add_ps(a##i)
#define FMA(i) a##i = _mm512_fmadd_ps(a##i, b, c);
#define DOT(i) a##i = _mm512_dpbf16_ps(a##i, b, c);

/* NAME(rounds): `rounds` rounds of twelve instructions OP on operands b, c of type T; returns
   the accumulators' sum (so no round is dropped). */
#define ROUNDS(NAME, T, B, C, OP)                               \
    float NAME(int64_t rounds) {                                \
        const T b = (B), c = (C);                               \
        TWELVE(DECLARE)                                         \
        for (int64_t n = 0; n < rounds; ++n) { TWELVE(OP) }     \
        return 0.0f TWELVE(FOLD);                               \
    }

ROUNDS(fma_rounds, __m512, _mm512_set1_ps(1.0f), _mm512_set1_ps(-0.5f), FMA)
/* 32 multiply-adds an instruction to the FMA's 16: pairs of 1.0 and of -0.5 */
ROUNDS(dot_rounds, __m512bh, (__m512bh)_mm512_set1_epi32(0x3f803f80),
       (__m512bh)_mm512_set1_epi32(0xbf00bf00), DOT)
