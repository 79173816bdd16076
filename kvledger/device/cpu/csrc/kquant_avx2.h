// The products of kquant_scalar.h with AVX2: the weight codes are unsigned bytes, so
// vpmaddubsw takes them as they are against the signed activation codes (pair sums at most
// 2 * 63 * 127, no saturation), vpmaddwd multiplies the pair sums by the 16-bit sub-block
// scales (or by ones) into int32, and each super-block's int32 sum is scaled in fp32. Q8_0's
// signed codes go through vpsignb (|w| x sign(w) a). One weight row at a time, its unpacked
// codes reused for the R activation rows.
//
// Included by kquant_gemv.cpp only: everything is in an anonymous namespace.

#pragma once

#if defined(__AVX2__)

#include <immintrin.h>

#include <cstdint>

#include "gemv_tiles.h"
#include "kquant_scalar.h"

namespace {

// A row's super-blocks prefetch the bytes this far ahead of the one they compute: rows are
// contiguous, so this runs through the next rows of the thread's range.
constexpr int PREFETCH_BYTES = 2048;

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Every int16 of v (16-bit values, the same 8 in both lanes) replaced by value k.
inline __m256i broadcast16(__m256i v, int k) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<short>(((2 * k + 1) << 8) | (2 * k))));
}

// The 8 scales (as int16 in both lanes) and the 8 minima (int16) of a Q4_K / Q5_K super-block.
inline void scales_mins_avx2(const uint8_t* x, __m256i* scales, __m128i* mins) {
    uint32_t w[4];
    scales_mins(x + 4, w);
    const __m256i both = _mm256_cvtepu8_epi16(_mm_setr_epi32(w[0], w[1], w[2], w[3]));
    *scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(both));
    *mins = _mm256_extracti128_si256(both, 1);
}

// Codes of sub-block j of a Q4_K (or, with the fifth bits, Q5_K) super-block.
template <int TYPE>
inline __m256i q45k_codes(const uint8_t* x, int j) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i bits = load256(x + (TYPE == Q4_K ? 16 : 48) + 32 * (j / 2));
    __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(bits, 4) : bits, m4);
    if (TYPE == Q5_K) {
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(load256(x + 16), j),
                                              _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(high, 4));
    }
    return q;
}

template <int TYPE, int R>
void q45k_dot_avx2(const uint8_t* w, const Acts& a, int r0, float* out) {
    const int nb = a.in / QK;
    __m256 acc[R];
    __m128 accm[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), accm[r] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* x = w + static_cast<int64_t>(b) * block_bytes(TYPE);
        prefetch(x + PREFETCH_BYTES, 128);
        __m256i scales;
        __m128i mins;
        scales_mins_avx2(x, &scales, &mins);
        const float d = fp16_to_f32(x), dmin = fp16_to_f32(x + 2);
        __m256i sumi[R];
        for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            const __m256i q = q45k_codes<TYPE>(x, j);
            const __m256i sc = broadcast16(scales, j);
            for (int r = 0; r < R; ++r) {
                const __m256i av = load256(a.k->q.data() + (r0 + r) * int64_t(a.in) + b * QK + 32 * j);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(sc, _mm256_maddubs_epi16(q, av)));
            }
        }
        for (int r = 0; r < R; ++r) {
            const int64_t row = r0 + r;
            const float da = a.k->d[row * nb + b];
            const __m256i bs = load256(a.k->bsums.data() + row * (a.in / 16) + b * (QK / 16));
            const __m128i sums = _mm_hadd_epi16(_mm256_castsi256_si128(bs),
                                                _mm256_extracti128_si256(bs, 1));
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * da), _mm_cvtepi32_ps(_mm_madd_epi16(mins, sums)),
                                   accm[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * da), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        __m128 m = _mm_add_ps(accm[r], _mm_movehl_ps(accm[r], accm[r]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[r] = hsum(acc[r]) - _mm_cvtss_f32(m);
    }
}

template <int R>
void q6k_dot_avx2(const uint8_t* w, const Acts& a, int r0, float* out) {
    const int nb = a.in / QK;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* x = w + static_cast<int64_t>(b) * block_bytes(Q6_K);
        prefetch(x + PREFETCH_BYTES, 128);
        prefetch(x + PREFETCH_BYTES + 128, 128);
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        const float d = fp16_to_f32(x + 208);
        __m256i sumi[R];
        for (int r = 0; r < R; ++r) {
            const __m256i bs = load256(a.k->bsums.data() + (r0 + r) * int64_t(a.in / 16) + b * 16);
            sumi[r] = _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5);  // 32 sum_k sc_k bsum_k
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), sumi[r]);
        }
        for (int n = 0; n < 2; ++n) {
            const __m256i l0 = load256(x + 64 * n), l1 = load256(x + 64 * n + 32);
            const __m256i h = load256(x + 128 + 32 * n);
            for (int c = 0; c < 4; ++c) {
                const __m256i low = _mm256_and_si256(
                    c < 2 ? (c ? l1 : l0) : _mm256_srli_epi16(c == 2 ? l0 : l1, 4), m4);
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(h, 2 * c), m3);
                const __m256i q = _mm256_or_si256(low, _mm256_slli_epi16(top, 4));
                // sub-blocks 8n + 2c (first 16 codes) and 8n + 2c + 1 (last 16)
                const __m128i pick = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
                const __m128i k = _mm_add_epi8(pick, _mm_set1_epi8(static_cast<char>(8 * n + 2 * c)));
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, k));
                for (int r = 0; r < R; ++r) {
                    const __m256i av = load256(a.k->q.data() + (r0 + r) * int64_t(a.in) + b * QK +
                                               128 * n + 32 * c);
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(sc, _mm256_maddubs_epi16(q, av)));
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const float da = a.k->d[(r0 + r) * int64_t(nb) + b];
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * da), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// 32 codes of a block of a 32-weight type (signed for Q8_0, else unsigned), in weight order.
template <int TYPE>
inline __m256i block_codes_avx2(const uint8_t* x) {
    if (TYPE == Q8_0) return load256(x + 2);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + block_bytes(TYPE) - 16));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
    if (TYPE == Q5_0 || TYPE == Q5_1) {
        uint32_t qh;
        std::memcpy(&qh, x + (TYPE == Q5_0 ? 2 : 4), 4);
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(static_cast<int>(qh)),
            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return q;
}

template <int TYPE, int R>
void block_dot_avx2(const uint8_t* w, const Acts& a, int r0, float* out) {
    const int nb = a.in / QB;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    float low[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), low[r] = 0.f;
    for (int b = 0; b < nb; ++b) {
        const uint8_t* x = w + static_cast<int64_t>(b) * block_bytes(TYPE);
        prefetch(x + PREFETCH_BYTES, 64);
        const __m256i q = block_codes_avx2<TYPE>(x);
        float e, m;
        block_scale(TYPE, x, &e, &m);
        for (int r = 0; r < R; ++r) {
            const int64_t at = (r0 + r) * int64_t(a.in) + b * QB, bt = (r0 + r) * int64_t(nb) + b;
            const __m256i av = load256(a.b->q.data() + at);
            const __m256i p16 = TYPE == Q8_0  // |w| x sign(w) a: right for w = -128 too
                ? _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(av, q))
                : _mm256_maddubs_epi16(q, av);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)),
                                     _mm256_set1_ps(e * a.b->d[bt]), acc[r]);
            low[r] += m * a.b->sum[bt];
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + low[r];
}

template <int R>
void dot_avx2(int type, const uint8_t* w, const Acts& a, int r0, float* out) {
    switch (type) {
        case Q4_K: return q45k_dot_avx2<Q4_K, R>(w, a, r0, out);
        case Q5_K: return q45k_dot_avx2<Q5_K, R>(w, a, r0, out);
        case Q6_K: return q6k_dot_avx2<R>(w, a, r0, out);
        case Q8_0: return block_dot_avx2<Q8_0, R>(w, a, r0, out);
        case Q4_0: return block_dot_avx2<Q4_0, R>(w, a, r0, out);
        case Q4_1: return block_dot_avx2<Q4_1, R>(w, a, r0, out);
        case Q5_0: return block_dot_avx2<Q5_0, R>(w, a, r0, out);
        default: return block_dot_avx2<Q5_1, R>(w, a, r0, out);
    }
}

}  // namespace

#endif
