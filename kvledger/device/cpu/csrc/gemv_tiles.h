// What the int8 decode products (int8_gemv.cpp) share beyond the activations: how the output
// rows are split over threads and cut into tiles of weight x activation rows, the prefetch of
// the weights a few tiles ahead, and the AVX2 loads and sums of a tile.
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
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int TILE = 4;  // weight rows per tile: each activation block is loaded once per tile
// A tile prefetches the weight rows (and scales) of the tile this many tiles ahead, a slice per
// block, so the bytes a decode step streams from memory arrive while earlier rows are computed
// (one row of a GEMV is too short for the hardware prefetcher to run ahead of it).
constexpr int PREFETCH_TILES = 2;

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

template <int N>
using Int = std::integral_constant<int, N>;

// tile(Int<T>, Int<R>, o, r) over weight rows [o0, o1) x activation rows [0, rows): tiles of
// TILE x 2 weight x activation rows (or, with `wide` and from 4 activation rows on, 2 x 4: a
// weight block then serves 4 rows, in 8 accumulators), then the remainders. A row's arithmetic
// does not depend on its tile.
template <class Tile>
void tiles(int o0, int o1, int rows, bool wide, Tile tile) {
    int o = o0;
    if (wide && rows >= 4)
        for (; o + 2 <= o1; o += 2) {
            int r = 0;
            for (; r + 4 <= rows; r += 4) tile(Int<2>{}, Int<4>{}, o, r);
            for (; r + 2 <= rows; r += 2) tile(Int<2>{}, Int<2>{}, o, r);
            if (r < rows) tile(Int<2>{}, Int<1>{}, o, r);
        }
    auto all_rows = [&](auto t, int at) {
        int r = 0;
        for (; r + 2 <= rows; r += 2) tile(t, Int<2>{}, at, r);
        if (r < rows) tile(t, Int<1>{}, at, r);
    };
    for (; o + TILE <= o1; o += TILE) all_rows(Int<TILE>{}, o);
    for (; o < o1; ++o) all_rows(Int<1>{}, o);
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

// rows_fn(o0, o1) over contiguous ranges of whole tiles of the out rows, one range per thread.
template <class Fn>
void split_rows(int out, int threads, Fn rows_fn) {
    split_units((out + TILE - 1) / TILE, threads, [&](int t0, int t1) {
        if (t0 < t1) rows_fn(t0 * TILE, t1 * TILE < out ? t1 * TILE : out);
    });
}

}  // namespace
