// GGML's quantized blocks as a GGUF file stores them, and their arithmetic in plain loops: the
// reference the vector paths (kquant_avx2.h, kquant_avx512.h) compute the same way, and the
// dequantization of kquant_gemv.cpp.
//
// Layouts (ggml-common.h; fp16 as IEEE half, little-endian):
//   Q4_K (144 B per 256 weights): d, dmin fp16; scales[12] (8 pairs of 6-bit sub-block scale sc
//        and minimum m, packed as ggml's get_scale_min_k4 reads them); qs[128]: sub-block j of
//        32 weights in byte 32 (j / 2) + l, low nibble for even j, high for odd;
//        w = d sc_j q - dmin m_j.
//   Q5_K (176 B): d, dmin, scales[12] as Q4_K, qh[32], qs[128] as Q4_K; bit j of qh[l] is the
//        fifth bit of weight l of sub-block j; w = d sc_j q - dmin m_j, q in [0, 31].
//   Q6_K (210 B): ql[128], qh[64], scales[16] int8, d fp16; weight 128 n + 32 c + l (c < 4,
//        l < 32) has the low 4 bits in ql[64 n + 32 (c & 1) + l] (low nibble for c < 2, high
//        otherwise) and the top 2 in bits 2c, 2c + 1 of qh[32 n + l]; w = d sc_{w / 16} (q - 32).
//   Q8_0 (34 B per 32): d, qs[32] int8; w = d q.
//   Q4_0 (18 B): d, qs[16] (code j low nibble of byte j, j + 16 high); w = d (q - 8).
//   Q4_1 (20 B): d, m, qs[16] as Q4_0; w = d q + m.
//   Q5_0 (22 B): d, qh (32 bits: fifth bit of code j), qs[16] as Q4_0; w = d (q - 16).
//   Q5_1 (24 B): d, m, qh, qs as Q5_0; w = d q + m.
// The 32-weight types are all w = e q + m with unsigned codes (e = d and m = -8 d or -16 d for
// Q4_0 / Q5_0) except Q8_0 (signed codes).
//
// Included by kquant_gemv.cpp only: everything is in an anonymous namespace.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

enum GgmlType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
                      Q6_K = 14 };
constexpr int QK = 256;   // weights per K-quant super-block
constexpr int QB = 32;    // weights per block of the 32-weight types

inline bool is_kquant(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

// Weights per block and bytes per block of a type (0: not a type these kernels take).
inline int block_weights(int type) { return is_kquant(type) ? QK : QB; }
inline int block_bytes(int type) {
    switch (type) {
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        case Q8_0: return 34;
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        default: return 0;
    }
}

inline float fp16_to_f32(const uint8_t* p) {  // IEEE half at p (any alignment)
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; --exp; }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

// The 8 scales (bytes 0..7) and 8 minima (bytes 8..15) of a Q4_K / Q5_K super-block from its
// 12 packed bytes, as four words: sub-block j < 4 keeps its 6 bits in byte j (scale) / j + 4
// (minimum); j >= 4 has its low 4 bits in byte j + 4 (scale: low nibble, minimum: high) and its
// top 2 in the top bits of byte j - 4 (scale) / j (minimum).
inline void scales_mins(const uint8_t* packed, uint32_t out[4]) {
    constexpr uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, low2 = 0x03030303;
    uint32_t p[3];
    std::memcpy(p, packed, 12);
    out[0] = p[0] & low6;
    out[1] = (p[2] & low4) | (((p[0] >> 6) & low2) << 4);
    out[2] = p[1] & low6;
    out[3] = ((p[2] >> 4) & low4) | (((p[1] >> 6) & low2) << 4);
}

// The codes of a Q4_K, Q5_K or Q6_K super-block in weight order: [0, 15], [0, 31], [0, 63].
inline void kquant_codes(int type, const uint8_t* x, uint8_t* q) {
    if (type == Q6_K) {
        for (int n = 0; n < 2; ++n)
            for (int c = 0; c < 4; ++c) {
                const uint8_t* ql = x + 64 * n + 32 * (c & 1);
                const uint8_t* qh = x + 128 + 32 * n;
                for (int l = 0; l < 32; ++l)
                    q[128 * n + 32 * c + l] = static_cast<uint8_t>(
                        ((ql[l] >> (4 * (c >> 1))) & 0xF) | (((qh[l] >> (2 * c)) & 3) << 4));
            }
        return;
    }
    const uint8_t* qs = x + (type == Q4_K ? 16 : 48);
    for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; ++l) {
            const int low = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF;
            q[32 * j + l] = static_cast<uint8_t>(
                type == Q4_K ? low : low | (((x[16 + l] >> j) & 1) << 4));
        }
}

// The codes of a block of a 32-weight type in weight order: [0, 31], or signed for Q8_0.
inline void block_codes(int type, const uint8_t* x, int8_t* q) {
    if (type == Q8_0) {
        std::memcpy(q, x + 2, QB);
        return;
    }
    const uint8_t* qs = x + block_bytes(type) - 16;
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) std::memcpy(&qh, x + (type == Q5_0 ? 2 : 4), 4);
    for (int i = 0; i < QB; ++i)
        q[i] = static_cast<int8_t>(((qs[i % 16] >> (4 * (i / 16))) & 0xF) |
                                   (((qh >> i) & 1) << 4));
}

// (e, m) of a block of a 32-weight type: w = e * code + m.
inline void block_scale(int type, const uint8_t* x, float* e, float* m) {
    *e = fp16_to_f32(x);
    switch (type) {
        case Q4_0: *m = -8.f * *e; break;
        case Q5_0: *m = -16.f * *e; break;
        case Q4_1: case Q5_1: *m = fp16_to_f32(x + 2); break;
        default: *m = 0.f;
    }
}

// The weights of one block (block_weights(type) of them) in fp32, with ggml's own operations
// (Q4_0 / Q5_0 as d (q - 8) / d (q - 16), Q4_K / Q5_K as (d sc) q - (dmin m), Q6_K as
// (d sc) (q - 32)), so they equal ggml's dequantization bit for bit.
inline void dequantize_block(int type, const uint8_t* x, float* w) {
    if (!is_kquant(type)) {
        int8_t q[QB];
        block_codes(type, x, q);
        float e, m;
        block_scale(type, x, &e, &m);
        const int offset = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
        const bool with_min = type == Q4_1 || type == Q5_1;
        for (int i = 0; i < QB; ++i)
            w[i] = with_min ? e * static_cast<float>(q[i]) + m
                            : e * static_cast<float>(q[i] - offset);
        return;
    }
    uint8_t q[QK];
    kquant_codes(type, x, q);
    if (type == Q6_K) {
        const float d = fp16_to_f32(x + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
        for (int k = 0; k < 16; ++k) {
            const float dk = d * static_cast<float>(sc[k]);
            for (int l = 0; l < 16; ++l)
                w[16 * k + l] = dk * static_cast<float>(static_cast<int>(q[16 * k + l]) - 32);
        }
        return;
    }
    const float d = fp16_to_f32(x), dmin = fp16_to_f32(x + 2);
    uint32_t words[4];
    scales_mins(x + 4, words);
    uint8_t sm[16];
    std::memcpy(sm, words, 16);
    for (int j = 0; j < 8; ++j) {
        const float dj = d * static_cast<float>(sm[j]), mj = dmin * static_cast<float>(sm[8 + j]);
        for (int l = 0; l < 32; ++l) w[32 * j + l] = dj * static_cast<float>(q[32 * j + l]) - mj;
    }
}

}  // namespace
