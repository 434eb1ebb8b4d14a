/* The processor's rate of AVX-512 float FMAs (vfmadd231ps) and AVX512-BF16 dot products
   (vdpbf16ps), for benchmarks/bf16_dot_rate.py: twelve independent accumulators each (more than
   either instruction's latency times its issue rate on the processors measured), so the loops run
   at the instruction's throughput. Not part of the package. */
#include <immintrin.h>
#include <stdint.h>

#define TWELVE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECLARE(i) __m512 a##i = _mm512_set1_ps((float)(i));
#define FOLD(i) + _mm512_reduce_add_ps(a##i)

/* `rounds` rounds of twelve FMAs; returns the accumulators' sum (so no round is dropped). */
float fma_rounds(int64_t rounds) {
    const __m512 b = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(-0.5f);
    TWELVE(DECLARE)
    for (int64_t n = 0; n < rounds; ++n) {
#define FMA(i) a##i = _mm512_fmadd_ps(a##i, b, c);
        TWELVE(FMA)
#undef FMA
    }
    return 0.0f TWELVE(FOLD);
}

/* The same with twelve bfloat16 dot products (32 multiply-adds each, to the FMA's 16). */
float dot_rounds(int64_t rounds) {
    const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80); /* pairs of 1.0 */
    const __m512bh c = (__m512bh)_mm512_set1_epi32(0xbf00bf00); /* pairs of -0.5 */
    TWELVE(DECLARE)
    for (int64_t n = 0; n < rounds; ++n) {
#define DOT(i) a##i = _mm512_dpbf16_ps(a##i, b, c);
        TWELVE(DOT)
#undef DOT
    }
    return 0.0f TWELVE(FOLD);
}
