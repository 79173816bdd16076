// What the int8 decode products (int8_gemv.cpp) share beyond the activations: how the output
// rows are split over threads, the prefetch of the weights ahead of the rows computed, and the
// AVX2 loads and sums (the K-quant products, kquant_avx2.h, use them too).
//
// Threads: output rows are split into `threads` contiguous ranges with an OpenMP parallel loop.
// Built with -fopenmp, the library needs libgomp.so.1, the soname of the OpenMP runtime that
// PyTorch loads first, so these loops run on the same thread pool as torch's own intra-op loops
// (no second pool competing for the cores).
//
// Included by int8_gemv.cpp only: everything is in an anonymous namespace, as in one
// translation unit.

#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__)

inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

inline __m256i load32(const void* p) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// Hint that the n bytes at p (n <= 128) will be read soon; a prefetch past an array's end is
// ignored by the CPU, never a fault.
inline void prefetch(const void* p, int n) {
    const char* c = static_cast<const char*>(p);
    _mm_prefetch(c, _MM_HINT_T0);
    if (n > 64) _mm_prefetch(c + 64, _MM_HINT_T0);
}

#endif

// fn(u0, u1) over `threads` contiguous ranges of [0, units), one range per thread.
template <class Fn>
void split_units(int units, int threads, Fn fn) {
    if (threads < 1) threads = 1;
    if (threads > units) threads = units;
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; ++t)
        fn(static_cast<int>(static_cast<int64_t>(units) * t / threads),
           static_cast<int>(static_cast<int64_t>(units) * (t + 1) / threads));
}

}  // namespace
