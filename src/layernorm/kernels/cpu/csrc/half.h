/* Conversions between the half types (bfloat16, float16) and float32, and the per-thread float32
   row buffers of the half-precision kernels (norms_half_impl.h).

   half -> float32 is exact. float32 -> half rounds to nearest even, overflows to infinity, keeps
   subnormals (no flush to zero) and turns a NaN into a quiet NaN of the same sign: the results of
   torch's own casts, bit for bit, except for a NaN's payload. The processor's instructions are used
   where the build target has them (F16C or AVX-512F vcvtph2ps/vcvtps2ph for float16, AVX512-BF16
   vcvtneps2bf16 for bfloat16, AVX-512F/AVX2 shifts for bfloat16 -> float32 and integer rounding
   back); the portable functions below are the definition, used for tails and on other targets,
   and give identical bits. */
#ifndef LAYERNORM_HALF_H
#define LAYERNORM_HALF_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ------------------------------------------------------------------ portable definitions -- */

/* bfloat16 is the upper half of a float32. */
static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* Round to nearest even: add 0x7FFF plus the lowest kept bit, truncate. Carries run into the
   exponent (up to infinity) as they should; a NaN keeps its sign and top payload, made quiet. */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u));
    if (e != 0) return bits_f32(sign | ((e + 112u) << 23) | (m << 13));  /* rebias 15 -> 127 */
    return bits_f32(sign | f32_bits((float)m * 0x1p-24f));  /* subnormal (or zero): exact */
}

static inline uint16_t f32_to_f16(float f) {
    const uint32_t u = f32_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  /* NaN */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  /* >= 65520 rounds to infinity */
    if (a >= 0x38800000u) {  /* a normal float16 (>= 2^-14): rebias, round away 13 bits */
        const uint32_t r = a - 0x38000000u;
        return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
    }
    if (a <= 0x33000000u) return sign;  /* <= 2^-25: the tie at 2^-25 goes to even, 0 */
    /* a subnormal float16: the value in units of 2^-24, rounded to nearest even */
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u, shift = 126u - (a >> 23);
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return (uint16_t)(sign | q);
}

/* ------------------------------------------------------------------ rows ------------------ */

/* Ask for the line of 32 half values at pf + j to be brought into L2 (none when pf is NULL): the
   row converters take the same part of the next block's rows meanwhile, so that a block's input
   is in cache when its turn comes instead of each block's loads waiting on memory. */
static inline void half_prefetch(const uint16_t* pf, int64_t j) {
    if (pf && (j & 31) == 0) __builtin_prefetch(pf + j, 0, 2);
}

static inline void bf16_row_to_f32(const uint16_t* restrict src, float* restrict dst, int64_t n,
                                   const uint16_t* pf) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {
        half_prefetch(pf, j);
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + j)));
        _mm512_storeu_ps(dst + j, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
#elif defined(__AVX2__)
    for (; j + 8 <= n; j += 8) {
        half_prefetch(pf, j);
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(src + j)));
        _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
#endif
    for (; j < n; ++j) {
        half_prefetch(pf, j);
        dst[j] = bf16_to_f32(src[j]);
    }
}

/* A 16-value (256-bit) vector of half values to dst: by a non-temporal store with `stream` (dst
   then aligned to STREAM_UNIT bytes: HALF_ROW_OUT), else a plain one. */
#if defined(__AVX__)
static inline void half_store16(uint16_t* dst, __m256i v, int stream) {
    if (stream) _mm256_stream_si256((__m256i*)dst, v);
    else _mm256_storeu_si256((__m256i*)dst, v);
}
#endif

/* A row of n float32 values at src to half values at dst by STORES(src, dst, n, stream), a
   converter whose vector stores are non-temporal with `stream`: with `stream`, the part that
   stream_body (cpu_common.h) gives streamed, the rest by plain stores. */
#define HALF_ROW_OUT(STORES, src, dst, n, stream)                                              \
    do {                                                                                        \
        int64_t head_ = 0, body_end_ = 0;                                                       \
        if (stream) stream_body((dst), (n), (int64_t)sizeof(uint16_t), &head_, &body_end_);     \
        if (head_) STORES((src), (dst), head_, 0);                                              \
        if (body_end_ > head_) STORES((src) + head_, (dst) + head_, body_end_ - head_, 1);      \
        STORES((src) + body_end_, (dst) + body_end_, (n) - body_end_, 0);                       \
    } while (0)

static inline void f32_row_to_bf16_stores(const float* restrict src, uint16_t* restrict dst,
                                          int64_t n, int stream) {
    int64_t j = 0;
#if defined(__AVX512BF16__)
    /* vcvtneps2bf16 flushes float32 subnormals to zero; the few blocks holding one take the
       portable path instead. */
    const __m512 tiny = _mm512_set1_ps(0x1p-126f), zero = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(src + j);
        const __mmask16 sub = _mm512_cmp_ps_mask(_mm512_abs_ps(v), tiny, _CMP_LT_OQ) &
                              _mm512_cmp_ps_mask(v, zero, _CMP_NEQ_OQ);
        if (sub) {
            for (int l = 0; l < 16; ++l) dst[j + l] = f32_to_bf16(src[j + l]);
        } else {
            const __m256bh r = _mm512_cvtneps_pbh(v);
            __m256i bits;
            memcpy(&bits, &r, sizeof r);
            half_store16(dst + j, bits, stream);
        }
    }
#elif defined(__AVX512F__)
    /* f32_to_bf16 on sixteen lanes, then narrowed to 16 bits; a NaN, whose rounding would carry
       into the exponent, sends its sixteen to the portable path (the AVX2 loop below, with a
       NaN test and blend per lane, took 1.16-1.22x as long in the bfloat16 layer norm's
       forward, 1.08-1.18x in its backward: AMD Zen 5, (64, 4096) to (8192, 1024)). */
    const __m512i half_ulp = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(src + j);
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) {
            for (int l = 0; l < 16; ++l) dst[j + l] = f32_to_bf16(src[j + l]);
            continue;
        }
        const __m512i u = _mm512_castps_si512(v);
        const __m512i up = _mm512_add_epi32(half_ulp,
                                            _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
        /* a finite value or an infinity: u + up stays below 2^32, the result below 2^16 */
        half_store16(dst + j, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, up), 16)),
                     stream);
    }
#elif defined(__AVX2__)
    /* f32_to_bf16 on sixteen values at a time, then packed to 16 bits: the compiler's
       vectorization of the portable loop took 2.5x as long (a 1024-element row, AMD EPYC). A
       NaN, whose rounding would carry into the exponent, sends its sixteen to the portable
       path: one unordered compare finds it in either half (a NaN test and blend per lane took
       1.06-1.19x as long in the bfloat16 layer norm's forward, 1.03-1.12x in its backward:
       AMD Zen 5, (64, 4096) to (8192, 1024)). */
    const __m256i half_ulp = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    for (; j + 16 <= n; j += 16) {
        const __m256 lo = _mm256_loadu_ps(src + j), hi = _mm256_loadu_ps(src + j + 8);
        if (_mm256_movemask_ps(_mm256_cmp_ps(lo, hi, _CMP_UNORD_Q))) {
            for (int l = 0; l < 16; ++l) dst[j + l] = f32_to_bf16(src[j + l]);
            continue;
        }
        __m256i r[2];
        for (int h = 0; h < 2; ++h) {
            const __m256i u = _mm256_castps_si256(h ? hi : lo);
            const __m256i up = _mm256_add_epi32(half_ulp,
                                                _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
            /* a finite value or an infinity: u + up stays below 2^32 */
            r[h] = _mm256_srli_epi32(_mm256_add_epi32(u, up), 16);
        }
        /* values below 2^16, so no saturation; packus interleaves 128-bit lanes, permute
           restores the order */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
        half_store16(dst + j, packed, stream);
    }
#else
    (void)stream;
#endif
    #pragma omp simd
    for (int64_t k = j; k < n; ++k) dst[k] = f32_to_bf16(src[k]);
}

static inline void f32_row_to_bf16(const float* restrict src, uint16_t* restrict dst, int64_t n,
                                   int stream) {
    HALF_ROW_OUT(f32_row_to_bf16_stores, src, dst, n, stream);
}

static inline void f16_row_to_f32(const uint16_t* restrict src, float* restrict dst, int64_t n,
                                  const uint16_t* pf) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {
        half_prefetch(pf, j);
        _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + j))));
    }
#elif defined(__F16C__)
    for (; j + 8 <= n; j += 8) {
        half_prefetch(pf, j);
        _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + j))));
    }
#endif
    for (; j < n; ++j) {
        half_prefetch(pf, j);
        dst[j] = f16_to_f32(src[j]);
    }
}

static inline void f32_row_to_f16_stores(const float* restrict src, uint16_t* restrict dst,
                                         int64_t n, int stream) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16)
        half_store16(dst + j,
                     _mm512_cvtps_ph(_mm512_loadu_ps(src + j),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                     stream);
#elif defined(__F16C__)
    (void)stream; /* eight values a store: not streamed */
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i*)(dst + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + j),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    (void)stream;
#endif
    for (; j < n; ++j) dst[j] = f32_to_f16(src[j]);
}

static inline void f32_row_to_f16(const float* restrict src, uint16_t* restrict dst, int64_t n,
                                  int stream) {
    HALF_ROW_OUT(f32_row_to_f16_stores, src, dst, n, stream);
}

/* ------------------------------------------------------------------ vectors --------------- */
/* One vector of the build's width (VEC_BYTES) of float32 from the VEC_BYTES / 4 half values at
   src, converted as the row converters above convert (exactly): the loads of a sweep that reads
   a half row where it lies (norms_impl.h, row_variance_of) instead of a float32 copy of it. */
typedef float half_vf __attribute__((vector_size(VEC_BYTES)));
#define HALF_VF_LANES (VEC_BYTES / 4)
static inline __attribute__((always_inline)) half_vf bf16_vec_to_f32(const uint16_t* src) {
#if VEC_BYTES == 64 && defined(__AVX512F__)
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)src));
    return (half_vf)_mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
#elif VEC_BYTES == 32 && defined(__AVX2__)
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)src));
    return (half_vf)_mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
#else
    half_vf v;
    for (int l = 0; l < HALF_VF_LANES; ++l) v[l] = bf16_to_f32(src[l]);
    return v;
#endif
}
static inline __attribute__((always_inline)) half_vf f16_vec_to_f32(const uint16_t* src) {
#if VEC_BYTES == 64 && defined(__AVX512F__)
    return (half_vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)src));
#elif VEC_BYTES == 32 && defined(__F16C__)
    return (half_vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)src));
#else
    half_vf v;
    for (int l = 0; l < HALF_VF_LANES; ++l) v[l] = f16_to_f32(src[l]);
    return v;
#endif
}
/* The vector of float32 at p, which need not be aligned to its size. */
static inline __attribute__((always_inline)) half_vf f32_vec_load(const float* p) {
    half_vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
/* ------------------------------------------------------------------ row buffers ----------- */

/* Elements of float32 per block of rows the half kernels convert at once: a block's inputs and
   output stay in the first-level cache while the float32 row functions pass over them. The
   backwards with dw/db took blocks of 8192 elements while each block flushed its float32 dw/db
   sums to float64 (2048 was up to 2.7x slower then); they flush every FLUSH rows across blocks
   now, and with the buffers on cache lines, 1024 took 0.73-0.85 of 8192's time (bfloat16 layer
   norm at (8192, 1024), (32768, 256) and (4096, 768), 1 and 2 threads, AMD EPYC, AVX-512 with
   AVX512-BF16: the builds timed in turn in one process; 512 within 5% of 1024, 2048 between). */
#ifndef HALF_BLOCK_ELEMS
#define HALF_BLOCK_ELEMS 1024
#endif

/* count float32 buffers of n elements each (bufs[0], ..., bufs[count - 1]), kept per calling
   thread and grown on demand; 0, or 1 when the allocation fails. Each starts on a cache line (64
   bytes), so that the vectors of a row of a multiple of 16 elements never straddle two lines:
   from malloc (16-byte aligned) a 64-byte vector load or store touched two lines unless the
   address happened to fall on one, and the same kernel's time moved by up to 1.6x from one build
   (and buffer) to the next (bfloat16 forward, AVX-512, AMD EPYC). */
static __thread float* half_buf = NULL;
static __thread int64_t half_cap = 0;

static inline int half_buffers(int64_t n, int count, float** bufs) {
    const int64_t stride = (n + 15) / 16 * 16, need = stride * count;
    if (need > half_cap) {
        free(half_buf);
        void* p = NULL;
        half_buf = posix_memalign(&p, 64, (size_t)need * sizeof(float)) == 0 ? p : NULL;
        half_cap = half_buf ? need : 0;
    }
    if (!half_buf) return 1;
    for (int k = 0; k < count; ++k) bufs[k] = half_buf + k * stride;
    return 0;
}

/* Rows per block of rows of length N: as many as fit in elems, at least one. */
static inline int64_t half_block_rows(int64_t N, int64_t elems) {
    return N >= elems ? 1 : elems / N;
}

#endif
