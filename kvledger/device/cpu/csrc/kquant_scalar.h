// The products of kquant_gemv.cpp in plain loops: one weight row (its blocks as the file
// stores them, kquant_blocks.h) with R activation rows. The arithmetic every path follows:
//
//   Q4_K / Q5_K: per super-block, a.d (d sum_j sc_j dot_j - dmin sum_j m_j (bsum_2j + bsum_2j+1))
//   Q6_K:        per super-block, a.d d sum_k sc_k (dot_k - 32 bsum_k)
//   32-weight types: per block, e a.d dot + m a.d sum(a)
//
// with dot the exact int32 dot product of the codes with the activations' int8 codes (Q8_K for
// the K-quants, kquant_activations.h; per 32 inputs for the others, int8_activations.h), the
// scheme of llama.cpp's vec_dot kernels. The vector paths differ only in fp32 summation order.
//
// Included by kquant_gemv.cpp only: everything is in an anonymous namespace.

#pragma once

#include <cstdint>
#include <cstring>

#include "int8_activations.h"
#include "kquant_activations.h"
#include "kquant_blocks.h"

namespace {

// The activations of one call: Q8_K (for the K-quant segments) and per-32 blocks (for the
// others); either is null when no segment needs it.
struct Acts {
    const Q8K* k;
    const Quantized* b;
    int in;
};

template <int R>
void kquant_dot_scalar(int type, const uint8_t* w, const Acts& a, int r0, float* out) {
    const int nb = a.in / QK;
    for (int r = 0; r < R; ++r) out[r] = 0.f;
    for (int b = 0; b < nb; ++b) {
        const uint8_t* x = w + static_cast<int64_t>(b) * block_bytes(type);
        uint8_t q[QK];
        kquant_codes(type, x, q);
        uint32_t words[4];
        if (type != Q6_K) scales_mins(x + 4, words);
        uint8_t sm[16];
        std::memcpy(sm, words, 16);
        for (int r = 0; r < R; ++r) {
            const int64_t row = r0 + r;
            const int8_t* aq = a.k->q.data() + row * a.in + b * QK;
            const int16_t* bs = a.k->bsums.data() + row * (a.in / 16) + b * (QK / 16);
            const float da = a.k->d[row * nb + b];
            if (type == Q6_K) {
                const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
                int sumi = 0;
                for (int k = 0; k < 16; ++k) {
                    int dot = 0;
                    for (int l = 16 * k; l < 16 * (k + 1); ++l) dot += q[l] * aq[l];
                    sumi += sc[k] * (dot - 32 * bs[k]);
                }
                out[r] += da * fp16_to_f32(x + 208) * static_cast<float>(sumi);
                continue;
            }
            int sumi = 0, summ = 0;
            for (int j = 0; j < 8; ++j) {
                int dot = 0;
                for (int l = 32 * j; l < 32 * (j + 1); ++l) dot += q[l] * aq[l];
                sumi += sm[j] * dot;
                summ += sm[8 + j] * (bs[2 * j] + bs[2 * j + 1]);
            }
            out[r] += da * (fp16_to_f32(x) * static_cast<float>(sumi) -
                            fp16_to_f32(x + 2) * static_cast<float>(summ));
        }
    }
}

template <int R>
void block_dot_scalar(int type, const uint8_t* w, const Acts& a, int r0, float* out) {
    const int nb = a.in / QB;
    for (int r = 0; r < R; ++r) out[r] = 0.f;
    for (int b = 0; b < nb; ++b) {
        const uint8_t* x = w + static_cast<int64_t>(b) * block_bytes(type);
        int8_t q[QB];
        block_codes(type, x, q);
        float e, m;
        block_scale(type, x, &e, &m);
        for (int r = 0; r < R; ++r) {
            const int64_t row = r0 + r;
            const int8_t* aq = a.b->q.data() + row * a.in + b * QB;
            int dot = 0;
            for (int l = 0; l < QB; ++l) dot += q[l] * aq[l];
            out[r] += e * a.b->d[row * nb + b] * static_cast<float>(dot) + m * a.b->sum[row * nb + b];
        }
    }
}

template <int R>
void dot_scalar(int type, const uint8_t* w, const Acts& a, int r0, float* out) {
    if (is_kquant(type))
        kquant_dot_scalar<R>(type, w, a, r0, out);
    else
        block_dot_scalar<R>(type, w, a, r0, out);
}

}  // namespace
