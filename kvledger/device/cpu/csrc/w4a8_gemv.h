// The w4a8 product of the int8 decode products (int8_gemv.cpp; the "w4a8" weight format,
// kvledger/model/linear.py), on the weight repacked at load for streaming.
//
// w4a8: a GGUF Q4_0 / Q4_1 weight, per block b of 32 inputs 4-bit codes c[o, i] in [0, 15] with
// a scale e[o, b] and a minimum m[o, b] (w = e * c + m; Q4_0 is m = -8 e), times the int8
// activations a (scale d[r, b] per block, int8_activations.h):
//
//   y[r, o] = sum_b ( e[o, b] d[r, b] sum_{i in b} c[o, i] a[r, i]  +  m[o, b] d[r, b] A[r, b] )
//
// with A[r, b] = sum_{i in b} a[r, i] (exact in int32), the scheme of llama.cpp's Q4_1 x Q8_1 dot
// product (no weight rounding beyond the file's).
//
// The repacked layout (kvledger/device/cpu/q4_repack.py writes it): the output rows in groups of
// Q4_ROWS = 8 (the last group padded with zero rows), each group one run of `in / 32` records of
// Q4_RECORD = 192 bytes, one per block b:
//   bytes [32 k + 4 t, 32 k + 4 t + 4)  row t's bytes 4k..4k+3 of the file's 16 (k = 0..3):
//                                        low nibbles codes 4k..4k+3, high nibbles 16+4k..16+4k+3
//   bytes [128, 160)                     e of the 8 rows, fp32
//   bytes [160, 192)                     m of the 8 rows, fp32
// So a decode step reads each weight as one sequential stream (codes and scales together, no
// strided side arrays), and one 32-byte load holds 4 codes of each of 8 rows: with the 4
// matching activations broadcast to every lane, one dot-product instruction (VNNI vpdpbusd, or
// vpmaddubsw + vpmaddwd on AVX2) adds into 8 lanes that are the 8 rows: no horizontal sums.
//
// Every path computes a row the same way: the block's integer dot exactly, then per block
// acc = fma(float(dot), e * d, acc) and acc = fma(m, d * A, acc), in that order, in fp32; so the
// plain loops, AVX2 and VNNI give the same bits (the tests check it).
//
// Included by int8_gemv.cpp only: everything is in an anonymous namespace, as in one
// translation unit.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gemv_tiles.h"
#include "int8_activations.h"

namespace {

constexpr int Q4_ROWS = 8;
constexpr int Q4_CODES = Q4_ROWS * BLOCK / 2;              // 128 code bytes per record
constexpr int Q4_RECORD = Q4_CODES + 2 * Q4_ROWS * 4;      // + e[8], m[8] fp32
// Records prefetched ahead of the one computed (the stream is sequential, but one group's run
// is short enough that the hardware prefetcher starts late on each).
constexpr int Q4_AHEAD = 4;

// The paths, as kvl_w4a8_mm's `path` argument names them (0: the best built).
enum Q4Path { Q4_BEST = 0, Q4_SCALAR = 1, Q4_AVX2 = 2, Q4_VNNI = 3 };

constexpr bool q4_vnni_built() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return true;
#else
    return false;
#endif
}

// Group g's products with activation rows [r0, r1), plain loops.
void q4_group_scalar(const uint8_t* packed, int in, int g, const Quantized& a, int r0, int r1,
                     uint16_t* y, int out) {
    const int nb = in / BLOCK;
    for (int r = r0; r < r1; ++r) {
        float acc[Q4_ROWS] = {};
        const uint8_t* rec = packed + static_cast<int64_t>(g) * nb * Q4_RECORD;
        for (int b = 0; b < nb; ++b, rec += Q4_RECORD) {
            float e[Q4_ROWS], m[Q4_ROWS];
            std::memcpy(e, rec + Q4_CODES, sizeof e);
            std::memcpy(m, rec + Q4_CODES + sizeof e, sizeof m);
            const int8_t* q = a.q.data() + static_cast<int64_t>(r) * in + b * BLOCK;
            const float d = a.d[static_cast<int64_t>(r) * nb + b];
            const float sum = a.sum[static_cast<int64_t>(r) * nb + b];
            for (int t = 0; t < Q4_ROWS; ++t) {
                int32_t dot = 0;
                for (int k = 0; k < 4; ++k)
                    for (int j = 0; j < 4; ++j) {
                        const uint8_t byte = rec[32 * k + 4 * t + j];
                        dot += int32_t(byte & 0x0F) * q[4 * k + j];
                        dot += int32_t(byte >> 4) * q[BLOCK / 2 + 4 * k + j];
                    }
                acc[t] = std::fma(static_cast<float>(dot), e[t] * d, acc[t]);
                acc[t] = std::fma(m[t], sum, acc[t]);
            }
        }
        for (int t = 0; t < Q4_ROWS && g * Q4_ROWS + t < out; ++t)
            y[static_cast<int64_t>(r) * out + g * Q4_ROWS + t] = f32_to_bf16(acc[t]);
    }
}

#if defined(__AVX2__)

inline __m256i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// The 8 rows' integer dots of one record with one activation block q: lo[k] / hi[k] the low /
// high nibbles of the record's 32-byte load k.
template <bool Vnni>
inline __m256i q4_dots(const __m256i lo[4], const __m256i hi[4], const int8_t* q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if constexpr (Vnni) {
        __m256i dot = _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k) {
            dot = _mm256_dpbusd_epi32(dot, lo[k], broadcast4(q + 4 * k));
            dot = _mm256_dpbusd_epi32(dot, hi[k], broadcast4(q + BLOCK / 2 + 4 * k));
        }
        return dot;
    }
#endif
    // pair sums |c a + c' a'| <= 2 * 15 * 127, eight of them <= 30480: exact in int16
    __m256i s = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[k], broadcast4(q + 4 * k)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[k], broadcast4(q + BLOCK / 2 + 4 * k)));
    }
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

// Group g's products with activation rows [r0, r0 + R) (the arithmetic of q4_group_scalar).
template <int R, bool Vnni>
void q4_group_avx2(const uint8_t* packed, int in, int g, const Quantized& a, int r0, uint16_t* y,
                   int out) {
    const int nb = in / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* rec = packed + static_cast<int64_t>(g) * nb * Q4_RECORD;
    for (int b = 0; b < nb; ++b, rec += Q4_RECORD) {
        prefetch(rec + Q4_AHEAD * Q4_RECORD, 128);
        prefetch(rec + Q4_AHEAD * Q4_RECORD + 128, 64);
        __m256i lo[4], hi[4];
        for (int k = 0; k < 4; ++k) {
            const __m256i w = load32(rec + 32 * k);
            lo[k] = _mm256_and_si256(w, nibble);
            hi[k] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        }
        const __m256 e = _mm256_loadu_ps(reinterpret_cast<const float*>(rec + Q4_CODES));
        const __m256 m = _mm256_loadu_ps(reinterpret_cast<const float*>(rec + Q4_CODES + 32));
        for (int r = 0; r < R; ++r) {
            const int64_t row = r0 + r;
            const __m256i dot = q4_dots<Vnni>(lo, hi, a.q.data() + row * in + b * BLOCK);
            const __m256 ed = _mm256_mul_ps(e, _mm256_set1_ps(a.d[row * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ed, acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sum[row * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float v[Q4_ROWS];
        _mm256_storeu_ps(v, acc[r]);
        for (int t = 0; t < Q4_ROWS && g * Q4_ROWS + t < out; ++t)
            y[static_cast<int64_t>(r0 + r) * out + g * Q4_ROWS + t] = f32_to_bf16(v[t]);
    }
}

// Group g with every activation row, 4 at a time (a record is read from memory once and from
// cache for the other rows).
template <bool Vnni>
void q4_group_rows(const uint8_t* packed, int in, int g, const Quantized& a, int rows,
                   uint16_t* y, int out) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) q4_group_avx2<4, Vnni>(packed, in, g, a, r, y, out);
    for (; r + 2 <= rows; r += 2) q4_group_avx2<2, Vnni>(packed, in, g, a, r, y, out);
    if (r < rows) q4_group_avx2<1, Vnni>(packed, in, g, a, r, y, out);
}

#endif

// Whether `path` (Q4Path) is built here; Q4_BEST always is.
bool q4_path_built(int path) {
    switch (path) {
        case Q4_BEST:
        case Q4_SCALAR:
            return true;
        case Q4_AVX2:
#if defined(__AVX2__)
            return true;
#else
            return false;
#endif
        case Q4_VNNI:
            return q4_vnni_built();
        default:
            return false;
    }
}

// Groups [g0, g1) with every activation row on `path` (built: q4_path_built).
void q4_groups(int path, const uint8_t* packed, int in, int g0, int g1, const Quantized& a,
               int rows, uint16_t* y, int out) {
    if (path == Q4_BEST) path = q4_vnni_built() ? Q4_VNNI : q4_path_built(Q4_AVX2) ? Q4_AVX2
                                                                                : Q4_SCALAR;
    for (int g = g0; g < g1; ++g) {
#if defined(__AVX2__)
        if (path == Q4_VNNI) {
            q4_group_rows<true>(packed, in, g, a, rows, y, out);
            continue;
        }
        if (path == Q4_AVX2) {
            q4_group_rows<false>(packed, in, g, a, rows, y, out);
            continue;
        }
#endif
        q4_group_scalar(packed, in, g, a, 0, rows, y, out);
    }
}

}  // namespace
