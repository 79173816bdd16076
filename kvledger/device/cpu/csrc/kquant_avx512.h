// The K-quant products of kquant_scalar.h with AVX-512 (BW) and VNNI: 64 codes per register
// (two sub-blocks of Q4_K / Q5_K, four of Q6_K, in input order, so the activations load as
// they are stored), vpmaddubsw for the unsigned code x signed activation pair sums, and
// vpdpwssd to multiply them by the 16-bit sub-block scales and add them into the super-block's
// int32 sum in one instruction. The 32-weight types take the AVX2 path (kquant_avx2.h).
//
// Included by kquant_gemv.cpp only: everything is in an anonymous namespace.

#pragma once

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)

#include <immintrin.h>

#include <cstdint>

#include "kquant_avx2.h"

namespace {

// Indices for vpermw: int16 k of lane i is scale (i / per) + first, for `per` lanes a scale.
inline __m512i scale_index(int first, int per) {
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = static_cast<int16_t>(first + i / per);
    return _mm512_load_si512(idx);
}

// Two 32-byte halves into one register.
inline __m512i join(__m256i low, __m256i high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

template <int TYPE, int R>
void q45k_dot_avx512(const uint8_t* w, const Acts& a, int r0, float* out) {
    const int nb = a.in / QK;
    const __m512i m4 = _mm512_set1_epi8(0x0F), five = _mm512_set1_epi8(0x10);
    __m512i index[4];
    for (int p = 0; p < 4; ++p) index[p] = scale_index(2 * p, 16);
    __m512 acc[R];
    __m128 accm[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), accm[r] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* x = w + static_cast<int64_t>(b) * block_bytes(TYPE);
        prefetch(x + PREFETCH_BYTES, 128);
        if (TYPE == Q5_K) prefetch(x + PREFETCH_BYTES + 128, 64);
        uint32_t words[4];
        scales_mins(x + 4, words);
        const __m256i both = _mm256_cvtepu8_epi16(
            _mm_setr_epi32(words[0], words[1], words[2], words[3]));
        const __m512i scales = _mm512_castsi256_si512(both);
        const __m128i mins = _mm256_extracti128_si256(both, 1);
        const float d = fp16_to_f32(x), dmin = fp16_to_f32(x + 2);
        __m512i sumi[R];
        for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
        const uint8_t* qs = x + (TYPE == Q4_K ? 16 : 48);
        for (int p = 0; p < 4; ++p) {  // sub-blocks 2p, 2p + 1: the low, then high nibbles
            const __m256i bits = load256(qs + 32 * p);
            __m512i q = _mm512_and_si512(join(bits, _mm256_srli_epi16(bits, 4)), m4);
            if (TYPE == Q5_K) {
                const __m256i qh = load256(x + 16);
                const __m512i h = join(_mm256_srli_epi16(qh, 2 * p), _mm256_srli_epi16(qh, 2 * p + 1));
                q = _mm512_or_si512(q, _mm512_and_si512(_mm512_slli_epi16(h, 4), five));
            }
            const __m512i sc = _mm512_permutexvar_epi16(index[p], scales);
            for (int r = 0; r < R; ++r) {
                const __m512i av = _mm512_loadu_si512(a.k->q.data() + (r0 + r) * int64_t(a.in) +
                                                      b * QK + 64 * p);
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], _mm512_maddubs_epi16(q, av), sc);
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
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * da), _mm512_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        __m128 m = _mm_add_ps(accm[r], _mm_movehl_ps(accm[r], accm[r]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[r] = _mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(m);
    }
}

template <int R>
void q6k_dot_avx512(const uint8_t* w, const Acts& a, int r0, float* out) {
    const int nb = a.in / QK;
    const __m512i m4 = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    __m512i index[4];
    for (int p = 0; p < 4; ++p) index[p] = scale_index(4 * p, 8);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* x = w + static_cast<int64_t>(b) * block_bytes(Q6_K);
        prefetch(x + PREFETCH_BYTES, 128);
        prefetch(x + PREFETCH_BYTES + 128, 128);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 192)));
        const __m512i scales = _mm512_castsi256_si512(sc16);
        const float d = fp16_to_f32(x + 208);
        __m512i sumi[R];
        for (int r = 0; r < R; ++r) {  // -32 sum_k sc_k bsum_k
            const __m256i bs = load256(a.k->bsums.data() + (r0 + r) * int64_t(a.in / 16) + b * 16);
            const __m256i bias = _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5);
            sumi[r] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), bias));
        }
        for (int n = 0; n < 2; ++n) {  // weights 128 n + [0, 64) and + [64, 128)
            const __m512i ql = _mm512_loadu_si512(x + 64 * n);
            const __m256i qh = load256(x + 128 + 32 * n);
            const __m512i h_low = join(qh, _mm256_srli_epi16(qh, 2));
            const __m512i h_high = join(_mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6));
            const __m512i q[2] = {
                _mm512_or_si512(_mm512_and_si512(ql, m4),
                                _mm512_and_si512(_mm512_slli_epi16(h_low, 4), top)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                _mm512_and_si512(_mm512_slli_epi16(h_high, 4), top))};
            for (int half = 0; half < 2; ++half) {
                const __m512i sc = _mm512_permutexvar_epi16(index[2 * n + half], scales);
                for (int r = 0; r < R; ++r) {
                    const __m512i av = _mm512_loadu_si512(a.k->q.data() + (r0 + r) * int64_t(a.in) +
                                                          b * QK + 128 * n + 64 * half);
                    sumi[r] = _mm512_dpwssd_epi32(sumi[r], _mm512_maddubs_epi16(q[half], av), sc);
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const float da = a.k->d[(r0 + r) * int64_t(nb) + b];
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * da), _mm512_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

template <int R>
void dot_avx512(int type, const uint8_t* w, const Acts& a, int r0, float* out) {
    switch (type) {
        case Q4_K: return q45k_dot_avx512<Q4_K, R>(w, a, r0, out);
        case Q5_K: return q45k_dot_avx512<Q5_K, R>(w, a, r0, out);
        case Q6_K: return q6k_dot_avx512<R>(w, a, r0, out);
        default: return dot_avx2<R>(type, w, a, r0, out);
    }
}

}  // namespace

#endif
