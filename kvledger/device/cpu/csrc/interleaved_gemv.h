// The w8a8 and w4a8 products of the int8 decode products (int8_gemv.cpp; the "w8a8" and "w4a8"
// weight formats, kvledger/model/linear.py), on weights repacked at load for streaming.
//
// The activations x [rows, in] (bf16) are quantized (int8_activations.h) per row in blocks of 32
// to a[r, i] = round(x[r, i] / d[r, b]), d[r, b] = max_{i in b} |x[r, i]| / 127 (the Q8_0
// activation scheme of GGML/llama.cpp, from its docs; not its code). Per block b of 32 inputs:
//
//   w8a8: y[r, o] = sum_b s[o, b] d[r, b] sum_{i in b} w[o, i] a[r, i]
//         (w the symmetric int8 codes of the weight, s their fp32 scales: GGML's Q8_0 layout)
//   w4a8: y[r, o] = sum_b d[r, b] ( e[o, b] sum_{i in b} c[o, i] a[r, i] + m[o, b] A[r, b] )
//         (a GGUF Q4_0 / Q4_1 weight: 4-bit codes c in [0, 15], scale e and minimum m, w = e c + m;
//         A[r, b] = sum_{i in b} a[r, i]: llama.cpp's Q4_1 x Q8_1 scheme)
//
// The repacked layout (kvledger/device/cpu/repack.py writes it): the output rows in groups of
// ROWS = 8 (the last group padded with zero rows), each group one run of `in / 32` records, one
// per block b: the 8 rows' code bytes interleaved 4 bytes at a time (bytes [32 k + 4 t, +4) are
// row t's bytes 4k..4k+3 of the block: w8a8 k = 0..7, the codes themselves; w4a8 k = 0..3, the
// file's bytes, low nibbles codes 4k..4k+3 and high nibbles 16+4k..16+4k+3), then the 8 rows'
// scales (fp32) and, for w4a8, their minima (fp32). So a decode step reads each weight as one
// sequential stream (codes and scales together), and one 32-byte load holds 4 codes of each of
// 8 rows: with the 4 matching activations broadcast to every lane, one dot-product instruction
// (VNNI vpdpbusd, or vpmaddubsw + vpmaddwd on AVX2) adds into 8 lanes that are the 8 rows, with
// no horizontal sums (the idea of ik_llama.cpp's run-time repacked rows).
//
// Every path computes a row the same way: the block's integer dot exactly, then per block
// acc = fma(float(dot), scale * d, acc) (and for w4a8 acc = fma(m, d * A, acc)), in that order,
// in fp32; so the plain loops, AVX2 and AVX-512 VNNI give the same bits (the tests check it).
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

constexpr int ROWS = 8;
// Records prefetched ahead of the one computed (one group's run is short enough that the
// hardware prefetcher starts late on each).
constexpr int AHEAD = 4;

// The paths, as the entry points' `path` argument names them (0: the best built).
enum Path { BEST = 0, SCALAR = 1, AVX2 = 2, VNNI = 3 };

constexpr bool vnni_built() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return true;
#else
    return false;
#endif
}

// Whether `path` is built here; BEST always is.
bool path_built(int path) {
    switch (path) {
        case BEST:
        case SCALAR:
            return true;
        case AVX2:
#if defined(__AVX2__)
            return true;
#else
            return false;
#endif
        case VNNI:
            return vnni_built();
        default:
            return false;
    }
}

int best_path(int path) {
    if (path != BEST) return path;
    return vnni_built() ? VNNI : path_built(AVX2) ? AVX2 : SCALAR;
}

#if defined(__AVX2__)
inline __m256i broadcast4(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#endif

// The int8 weight of w8a8: 8 loads of 4 codes per row and block.
struct Int8Codes {
    static constexpr int CODES = ROWS * BLOCK;
    static constexpr bool MINIMA = false;

    static int32_t dot(const uint8_t* rec, int t, const int8_t* q) {
        int32_t dot = 0;
        for (int k = 0; k < 8; ++k)
            for (int j = 0; j < 4; ++j)
                dot += int32_t(static_cast<int8_t>(rec[32 * k + 4 * t + j])) * q[4 * k + j];
        return dot;
    }

#if defined(__AVX2__)
    // (|a|, w * sign(a)): the unsigned x signed byte product, pair sums at most 2 * 127 * 127.
    template <bool Vnni>
    static __m256i dots(const uint8_t* rec, const int8_t* q, const uint8_t* mag) {
        __m256i dot = _mm256_setzero_si256();
        for (int k = 0; k < 8; ++k) {
            const __m256i w = _mm256_sign_epi8(load32(rec + 32 * k), broadcast4(q + 4 * k));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            if constexpr (Vnni) {
                dot = _mm256_dpbusd_epi32(dot, broadcast4(mag + 4 * k), w);
                continue;
            }
#endif
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(
                _mm256_maddubs_epi16(broadcast4(mag + 4 * k), w), _mm256_set1_epi16(1)));
        }
        return dot;
    }
#endif
};

// The 4-bit weight of w4a8: 4 loads of 4 bytes (8 codes) per row and block.
struct Nibble4Codes {
    static constexpr int CODES = ROWS * BLOCK / 2;
    static constexpr bool MINIMA = true;

    static int32_t dot(const uint8_t* rec, int t, const int8_t* q) {
        int32_t dot = 0;
        for (int k = 0; k < 4; ++k)
            for (int j = 0; j < 4; ++j) {
                const uint8_t byte = rec[32 * k + 4 * t + j];
                dot += int32_t(byte & 0x0F) * q[4 * k + j];
                dot += int32_t(byte >> 4) * q[BLOCK / 2 + 4 * k + j];
            }
        return dot;
    }

#if defined(__AVX2__)
    template <bool Vnni>
    static __m256i dots(const uint8_t* rec, const int8_t* q, const uint8_t*) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        if constexpr (Vnni) {
            __m256i dot = _mm256_setzero_si256();
            for (int k = 0; k < 4; ++k) {
                const __m256i w = load32(rec + 32 * k);
                dot = _mm256_dpbusd_epi32(dot, _mm256_and_si256(w, nibble), broadcast4(q + 4 * k));
                dot = _mm256_dpbusd_epi32(dot, _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble),
                                          broadcast4(q + BLOCK / 2 + 4 * k));
            }
            return dot;
        }
#endif
        // pair sums |c a + c' a'| <= 2 * 15 * 127, eight of them <= 30480: exact in int16
        __m256i s = _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k) {
            const __m256i w = load32(rec + 32 * k);
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(w, nibble),
                                                         broadcast4(q + 4 * k)));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(
                _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble),
                broadcast4(q + BLOCK / 2 + 4 * k)));
        }
        return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
    }
#endif
};

template <class F>
constexpr int record_bytes() {
    return F::CODES + (F::MINIMA ? 2 : 1) * ROWS * 4;
}

// Group g's products with activation rows [r0, r1), plain loops.
template <class F>
void group_scalar(const uint8_t* packed, int in, int g, const Quantized& a, int r0, int r1,
                  uint16_t* y, int out) {
    const int nb = in / BLOCK;
    for (int r = r0; r < r1; ++r) {
        float acc[ROWS] = {};
        const uint8_t* rec = packed + static_cast<int64_t>(g) * nb * record_bytes<F>();
        for (int b = 0; b < nb; ++b, rec += record_bytes<F>()) {
            float e[ROWS], m[ROWS];
            std::memcpy(e, rec + F::CODES, sizeof e);
            if (F::MINIMA) std::memcpy(m, rec + F::CODES + sizeof e, sizeof m);
            const int8_t* q = a.q.data() + static_cast<int64_t>(r) * in + b * BLOCK;
            const float d = a.d[static_cast<int64_t>(r) * nb + b];
            const float sum = a.sum[static_cast<int64_t>(r) * nb + b];
            for (int t = 0; t < ROWS; ++t) {
                acc[t] = std::fma(static_cast<float>(F::dot(rec, t, q)), e[t] * d, acc[t]);
                if (F::MINIMA) acc[t] = std::fma(m[t], sum, acc[t]);
            }
        }
        for (int t = 0; t < ROWS && g * ROWS + t < out; ++t)
            y[static_cast<int64_t>(r) * out + g * ROWS + t] = f32_to_bf16(acc[t]);
    }
}

#if defined(__AVX2__)

// Group g's products with activation rows [r0, r0 + R) (the arithmetic of group_scalar).
template <class F, int R, bool Vnni>
void group_avx2(const uint8_t* packed, int in, int g, const Quantized& a, int r0, uint16_t* y,
                int out) {
    constexpr int RECORD = record_bytes<F>();
    const int nb = in / BLOCK;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* rec = packed + static_cast<int64_t>(g) * nb * RECORD;
    for (int b = 0; b < nb; ++b, rec += RECORD) {
        for (int at = 0; at < RECORD; at += 128) prefetch(rec + AHEAD * RECORD + at, 128);
        const __m256 e = _mm256_loadu_ps(reinterpret_cast<const float*>(rec + F::CODES));
        for (int r = 0; r < R; ++r) {
            const int64_t row = r0 + r, at = row * in + b * BLOCK;
            const __m256i dot = F::template dots<Vnni>(rec, a.q.data() + at, a.mag.data() + at);
            const __m256 ed = _mm256_mul_ps(e, _mm256_set1_ps(a.d[row * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ed, acc[r]);
            if constexpr (F::MINIMA) {
                const __m256 m =
                    _mm256_loadu_ps(reinterpret_cast<const float*>(rec + F::CODES + 32));
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sum[row * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float v[ROWS];
        _mm256_storeu_ps(v, acc[r]);
        for (int t = 0; t < ROWS && g * ROWS + t < out; ++t)
            y[static_cast<int64_t>(r0 + r) * out + g * ROWS + t] = f32_to_bf16(v[t]);
    }
}

// Group g with activation rows [r0, r1), 4 at a time (a record is read from memory once and
// from cache for the other rows).
template <class F, bool Vnni>
void group_rows(const uint8_t* packed, int in, int g, const Quantized& a, int r0, int r1,
                uint16_t* y, int out) {
    int r = r0;
    for (; r + 4 <= r1; r += 4) group_avx2<F, 4, Vnni>(packed, in, g, a, r, y, out);
    for (; r + 2 <= r1; r += 2) group_avx2<F, 2, Vnni>(packed, in, g, a, r, y, out);
    if (r < r1) group_avx2<F, 1, Vnni>(packed, in, g, a, r, y, out);
}

#endif

// Groups [g0, g1) with activation rows [r0, r1) on `path` (built: path_built; not BEST).
template <class F>
void groups(int path, const uint8_t* packed, int in, int g0, int g1, const Quantized& a, int r0,
            int r1, uint16_t* y, int out) {
    for (int g = g0; g < g1; ++g) {
#if defined(__AVX2__)
        if (path == VNNI) {
            group_rows<F, true>(packed, in, g, a, r0, r1, y, out);
            continue;
        }
        if (path == AVX2) {
            group_rows<F, false>(packed, in, g, a, r0, r1, y, out);
            continue;
        }
#endif
        group_scalar<F>(packed, in, g, a, r0, r1, y, out);
    }
}

}  // namespace
