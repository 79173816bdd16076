// The w4a8 product of the int8 decode products (int8_gemv.cpp; the "w4a8" weight format,
// kvledger/engine/linear.py).
//
// w4a8: a GGUF Q4_0 / Q4_1 weight as the file stores it, per block b of 32 inputs 4-bit codes
// c[o, i] in [0, 15] (16 bytes: byte j holds code j in its low nibble and code j + 16 in its high
// one, ggml's block_q4_1 order) with a scale e[o, b] and a minimum m[o, b] (w = e * c + m; Q4_0
// is m = -8 e), times the same int8 activations:
//
//   y[r, o] = sum_b e[o, b] d[r, b] sum_{i in b} c[o, i] a[r, i]  +  sum_b m[o, b] d[r, b] A[r, b]
//
// with A[r, b] = sum_{i in b} a[r, i] (exact in int32), the scheme of llama.cpp's Q4_1 x Q8_1 dot
// product (no weight rounding beyond the file's). AVX2: the codes are unsigned, so vpmaddubsw
// takes them as they are (pair sums at most 2 * 15 * 127).
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

// Q4 blocks of a w4a8 weight (see the header): codes qs [out, in / 2], scales e and minima m
// [out, in / 32].
struct Q4Weight {
    const uint8_t* qs;
    const float* e;
    const float* m;
};

// The w4a8 products of weight rows [o0, o1) with every activation row, plain loops.
void q4_rows_scalar(const Q4Weight& w, int in, int o0, int o1, const Quantized& a, int rows,
                    uint16_t* y, int out) {
    const int nb = in / BLOCK;
    for (int o = o0; o < o1; ++o) {
        const uint8_t* qr = w.qs + static_cast<int64_t>(o) * in / 2;
        for (int r = 0; r < rows; ++r) {
            const int8_t* ar = a.q.data() + static_cast<int64_t>(r) * in;
            const float* dr = a.d.data() + static_cast<int64_t>(r) * nb;
            float acc = 0.f;
            for (int b = 0; b < nb; ++b) {
                int32_t dot = 0;
                for (int j = 0; j < BLOCK / 2; ++j) {
                    const uint8_t byte = qr[b * BLOCK / 2 + j];
                    dot += int32_t(byte & 0x0F) * ar[b * BLOCK + j];
                    dot += int32_t(byte >> 4) * ar[b * BLOCK + j + BLOCK / 2];
                }
                acc += w.e[int64_t(o) * nb + b] * dr[b] * static_cast<float>(dot);
            }
            float low = 0.f;
            for (int b = 0; b < nb; ++b)
                low += w.m[int64_t(o) * nb + b] * a.sum[int64_t(r) * nb + b];
            y[static_cast<int64_t>(r) * out + o] = f32_to_bf16(acc + low);
        }
    }
}

#if defined(__AVX2__)

// 16 bytes of a Q4 block -> its 32 codes in input order (low nibbles, then high nibbles).
inline __m256i unpack_q4(const uint8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// w4a8 for T weight rows by R activation rows (the arithmetic of q4_rows_scalar).
template <int T, int R>
void q4_tile_avx2(const Q4Weight& w, int in, int o, const Quantized& a, int r0, uint16_t* y,
                  int out) {
    const int nb = in / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[T][R];
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
    const int64_t ahead = static_cast<int64_t>(PREFETCH_TILES) * T;
    for (int b = 0; b < nb; ++b) {
        prefetch(w.qs + (o + ahead) * in / 2 + static_cast<int64_t>(b) * T * BLOCK / 2,
                 T * BLOCK / 2);
        prefetch(w.e + (o + ahead) * nb + b * T, T * 4);
        prefetch(w.m + (o + ahead) * nb + b * T, T * 4);
        __m256i wv[T];
        float e[T];
        for (int t = 0; t < T; ++t) {
            wv[t] = unpack_q4(w.qs + static_cast<int64_t>(o + t) * in / 2 + b * BLOCK / 2);
            e[t] = w.e[static_cast<int64_t>(o + t) * nb + b];
        }
        for (int r = 0; r < R; ++r) {
            const int64_t at = static_cast<int64_t>(r0 + r) * in + b * BLOCK;
            const __m256i q = load32(a.q.data() + at);
            const float d = a.d[static_cast<int64_t>(r0 + r) * nb + b];
            for (int t = 0; t < T; ++t) {
                const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[t], q), ones);
                acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(e[t] * d),
                                            acc[t][r]);
            }
        }
    }
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) {
            float low = 0.f;
            const float* m = w.m + static_cast<int64_t>(o + t) * nb;
            const float* sum = a.sum.data() + static_cast<int64_t>(r0 + r) * nb;
            for (int b = 0; b < nb; ++b) low += m[b] * sum[b];
            y[static_cast<int64_t>(r0 + r) * out + o + t] = f32_to_bf16(hsum(acc[t][r]) + low);
        }
}

#endif

}  // namespace
