// The w8a8 product of the int8 decode products (int8_gemv.cpp; the "w8a8" weight format,
// kvledger/engine/linear.py). w8a8:
//
//   y[r, o] = sum_b s[o, b] * d[r, b] * sum_{i in block b} a[r, i] * w[o, i]
//
// with w [out, in] the symmetric int8 codes of the weight per block of 32 inputs and s
// [out, in / 32] their fp32 scales (w ~ codes * s: GGML's Q8_0 layout), and the activations
// x [rows, in] (bf16) quantized (int8_activations.h), per row in blocks of 32, to
// a[r, i] = round(x[r, i] / d[r, b]) with d[r, b] = max_{i in b} |x[r, i]| / 127 (the Q8_0
// activation scheme of GGML/llama.cpp, described in its docs; not its code). Each block's
// integer dot product is exact in int32 (at most 32 * 127 * 127), scaled by s * d in fp32 and
// summed in fp32, and y is rounded to bf16.
//
// AVX2: the dot of a block is vpmaddubsw on (|a|, w * sign(a)) -- the unsigned x signed byte
// product, whose int16 pair sums (at most 2 * 127 * 127) cannot saturate -- then vpmaddwd with
// ones to int32, converted to fp32 and fused-multiply-added with s * d. Other CPUs (and the
// kvl_w8a8_mm `scalar` switch, so tests can compare both here) run the same arithmetic in plain
// loops; both paths quantize to identical codes and differ only in fp32 summation order.
//
// Included by int8_gemv.cpp only: everything is in an anonymous namespace, as in one
// translation unit.

#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gemv_tiles.h"
#include "int8_activations.h"

namespace {

// Dot products of weight rows [o0, o1) with activation rows [r0, r1), plain loops.
void rows_scalar(const int8_t* w, const float* s, int in, int o0, int o1, const Quantized& a,
                 int r0, int r1, uint16_t* y, int out) {
    const int nb = in / BLOCK;
    for (int o = o0; o < o1; ++o) {
        const int8_t* wr = w + static_cast<int64_t>(o) * in;
        for (int r = r0; r < r1; ++r) {
            const int8_t* ar = a.q.data() + static_cast<int64_t>(r) * in;
            float acc = 0.f;
            for (int b = 0; b < nb; ++b) {
                int32_t dot = 0;
                for (int i = b * BLOCK; i < (b + 1) * BLOCK; ++i) dot += int32_t(ar[i]) * wr[i];
                acc += s[int64_t(o) * nb + b] * a.d[static_cast<int64_t>(r) * nb + b] *
                       static_cast<float>(dot);
            }
            y[static_cast<int64_t>(r) * out + o] = f32_to_bf16(acc);
        }
    }
}

#if defined(__AVX2__)

// acc[t][r] += s[o + t, b] d[r, b] (block b of weight row t) . (block b of activation row r),
// T weight rows by R activation rows at a time.
template <int T, int R>
void tile_avx2(const int8_t* w, const float* s, int in, int o, const Quantized& a, int r0,
               uint16_t* y, int out) {
    const int nb = in / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[T][R];
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
    const int8_t* wr = w + static_cast<int64_t>(o) * in;
    const int64_t ahead = static_cast<int64_t>(PREFETCH_TILES) * T;
    for (int b = 0; b < nb; ++b) {
        prefetch(wr + ahead * in + static_cast<int64_t>(b) * T * BLOCK, T * BLOCK);
        prefetch(s + (o + ahead) * nb + b * T, T * 4);
        __m256i wv[T];
        float e[T];
        for (int t = 0; t < T; ++t) {
            wv[t] = load32(wr + static_cast<int64_t>(t) * in + b * BLOCK);
            e[t] = s[static_cast<int64_t>(o + t) * nb + b];
        }
        for (int r = 0; r < R; ++r) {
            const int64_t at = static_cast<int64_t>(r0 + r) * in + b * BLOCK;
            const __m256i q = load32(a.q.data() + at);
            const __m256i mag = load32(a.mag.data() + at);
            const float d = a.d[static_cast<int64_t>(r0 + r) * nb + b];
            for (int t = 0; t < T; ++t) {
                const __m256i p16 = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(wv[t], q));
                const __m256i p32 = _mm256_madd_epi16(p16, ones);
                acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(e[t] * d),
                                            acc[t][r]);
            }
        }
    }
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r)
            y[static_cast<int64_t>(r0 + r) * out + o + t] = f32_to_bf16(hsum(acc[t][r]));
}

#endif

}  // namespace
