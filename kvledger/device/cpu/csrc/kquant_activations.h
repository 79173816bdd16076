// The activations of the K-quant products (kquant_gemv.cpp) in llama.cpp's Q8_K scheme: per
// row, per super-block of 256 inputs, int8 codes a = round(x / d) with d = max |x| / 127, and
// the sums of the codes per 16 inputs (bsums), which the minima of Q4_K / Q5_K and the offset
// of Q6_K multiply. The plain loops and AVX2 round the same products to nearest even, so the
// codes are identical.
//
// Included by kquant_gemv.cpp only: everything is in an anonymous namespace.

#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "int8_activations.h"
#include "kquant_blocks.h"

namespace {

struct Q8K {
    std::vector<int8_t> q;       // [rows, in]
    std::vector<float> d;        // [rows, in / 256]
    std::vector<int16_t> bsums;  // [rows, in / 16]
};

void q8k_row_scalar(const uint16_t* x, int n, int8_t* q, float* d, int16_t* bsums) {
    for (int b = 0; b < n / QK; ++b) {
        float amax = 0.f;
        for (int i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(bf16_to_f32(x[b * QK + i])));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = amax / 127.f;
        for (int k = 0; k < QK / 16; ++k) {
            int sum = 0;
            for (int i = 16 * k; i < 16 * (k + 1); ++i) {
                const float v = std::nearbyint(bf16_to_f32(x[b * QK + i]) * inv);
                const int c = static_cast<int>(std::fmax(-127.f, std::fmin(127.f, v)));
                q[b * QK + i] = static_cast<int8_t>(c);
                sum += c;
            }
            bsums[b * QK / 16 + k] = static_cast<int16_t>(sum);
        }
    }
}

#if defined(__AVX2__)

void q8k_row_avx2(const uint16_t* x, int n, int8_t* q, float* d, int16_t* bsums) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < n / QK; ++b) {
        const uint16_t* xb = x + b * QK;
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < QK / BLOCK; ++k) {
            __m256 v[4];
            load_bf16x32(xb + k * BLOCK, v);
            for (int j = 0; j < 4; ++j) m = _mm256_max_ps(m, _mm256_and_ps(v[j], abs_mask));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        d[b] = amax / 127.f;
        for (int k = 0; k < QK / BLOCK; ++k) {
            __m256 v[4];
            load_bf16x32(xb + k * BLOCK, v);
            __m256i c[4];
            for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
            bsums[b * QK / 16 + 2 * k] =
                static_cast<int16_t>(hsum_i32(_mm256_add_epi32(c[0], c[1])));
            bsums[b * QK / 16 + 2 * k + 1] =
                static_cast<int16_t>(hsum_i32(_mm256_add_epi32(c[2], c[3])));
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                                 _mm256_packs_epi32(c[2], c[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK + k * BLOCK),
                                _mm256_permutevar8x32_epi32(p, order));
        }
    }
}

#endif

// The activations x [rows, in] (in a multiple of 256) in this thread's Q8_K buffers.
const Q8K& quantize_q8k(const uint16_t* x, int rows, int in, bool vector) {
    thread_local Q8K a;
    a.q.resize(static_cast<size_t>(rows) * in);
    a.d.resize(static_cast<size_t>(rows) * (in / QK));
    a.bsums.resize(static_cast<size_t>(rows) * (in / 16));
    for (int r = 0; r < rows; ++r) {
        const int64_t at = static_cast<int64_t>(r) * in;
        int8_t* q = a.q.data() + at;
        float* d = a.d.data() + static_cast<int64_t>(r) * (in / QK);
        int16_t* bs = a.bsums.data() + static_cast<int64_t>(r) * (in / 16);
#if defined(__AVX2__)
        if (vector) {
            q8k_row_avx2(x + at, in, q, d, bs);
            continue;
        }
#endif
        (void)vector;
        q8k_row_scalar(x + at, in, q, d, bs);
    }
    return a;
}

}  // namespace
