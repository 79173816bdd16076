// The int8 activations of the decode products with int8 or 4-bit weights (int8_gemv.cpp; the
// scheme is in interleaved_gemv.h): bf16 <-> fp32, and the activations x [rows, in] quantized
// per row in blocks of 32 into this thread's buffers, by plain loops or AVX2 (identical codes).
//
// Included by int8_gemv.cpp only: everything is in an anonymous namespace, as in one
// translation unit.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int BLOCK = 32;

inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// Activations of one call, quantized: codes q, their magnitudes |q| (the unsigned operand of
// vpmaddubsw) and the block scales d.
struct Quantized {
    std::vector<int8_t> q;
    std::vector<uint8_t> mag;
    std::vector<float> d;
    std::vector<float> sum;  // d[r, b] * A[r, b] (w4a8's minimum term)
};

// One row of n (a multiple of BLOCK) bf16 values. inv = 127 / amax is computed the same way on
// both paths and rounding is to nearest even on both, so the codes are identical.
void quantize_row_scalar(const uint16_t* x, int n, int8_t* q, uint8_t* mag, float* d,
                         float* sum) {
    for (int b = 0; b < n / BLOCK; ++b) {
        int32_t total = 0;
        float amax = 0.f;
        for (int i = 0; i < BLOCK; ++i)
            amax = std::fmax(amax, std::fabs(bf16_to_f32(x[b * BLOCK + i])));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = amax / 127.f;
        for (int i = 0; i < BLOCK; ++i) {
            const float v = std::nearbyint(bf16_to_f32(x[b * BLOCK + i]) * inv);
            const int c = static_cast<int>(std::fmax(-127.f, std::fmin(127.f, v)));
            q[b * BLOCK + i] = static_cast<int8_t>(c);
            mag[b * BLOCK + i] = static_cast<uint8_t>(c < 0 ? -c : c);
            total += c;
        }
        sum[b] = d[b] * static_cast<float>(total);
    }
}

#if defined(__AVX2__)

// 32 bf16 -> 4 x 8 fp32 (in order).
inline void load_bf16x32(const uint16_t* x, __m256 v[4]) {
    for (int k = 0; k < 4; ++k) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * k));
        v[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
}

inline int32_t hsum_i32(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
    return _mm_cvtsi128_si32(x);
}

void quantize_row_avx2(const uint16_t* x, int n, int8_t* q, uint8_t* mag, float* d,
                       float* sum) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < n / BLOCK; ++b) {
        __m256 v[4];
        load_bf16x32(x + b * BLOCK, v);
        for (int k = 0; k < 4; ++k) v[k] = _mm256_and_ps(v[k], abs_mask);  // |x| for the max
        const __m256 m = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = amax / 127.f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i c[4];
        load_bf16x32(x + b * BLOCK, v);  // again, signed
        for (int k = 0; k < 4; ++k) c[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vinv));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]),
                                               _mm256_add_epi32(c[2], c[3]));
        sum[b] = d[b] * static_cast<float>(hsum_i32(total));
        // pack 32 int32 -> 32 int8 (saturating; |c| <= 127 anyway), then undo the lane interleave
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                             _mm256_packs_epi32(c[2], c[3]));
        const __m256i codes = _mm256_permutevar8x32_epi32(p, order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * BLOCK), codes);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(mag + b * BLOCK), _mm256_abs_epi8(codes));
    }
}

#endif

bool use_vector(int scalar) {
#if defined(__AVX2__)
    return scalar == 0;
#else
    (void)scalar;
    return false;
#endif
}

// The activations x [rows, in] quantized into this thread's buffers.
const Quantized& quantize(const uint16_t* x, int rows, int in, bool vector) {
    thread_local Quantized a;
    const int nb = in / BLOCK;
    a.q.resize(static_cast<size_t>(rows) * in);
    a.mag.resize(static_cast<size_t>(rows) * in);
    a.d.resize(static_cast<size_t>(rows) * nb);
    a.sum.resize(static_cast<size_t>(rows) * nb);
    for (int r = 0; r < rows; ++r) {
        const int64_t at = static_cast<int64_t>(r) * in, bt = static_cast<int64_t>(r) * nb;
#if defined(__AVX2__)
        if (vector) {
            quantize_row_avx2(x + at, in, a.q.data() + at, a.mag.data() + at, a.d.data() + bt,
                              a.sum.data() + bt);
            continue;
        }
#endif
        quantize_row_scalar(x + at, in, a.q.data() + at, a.mag.data() + at, a.d.data() + bt,
                            a.sum.data() + bt);
    }
    return a;
}

}  // namespace
