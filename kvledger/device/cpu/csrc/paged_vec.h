// Vectors of fp32 lanes for the paged-attention kernel (paged_attention.cpp): the element
// types' loads and stores (fp32, bf16 as raw uint16 bits), the kernel's size limits, and the
// lane-wise sum and exp of the online softmax.
//
// Included by paged_attention.cpp only: everything is in an anonymous namespace, as in one
// translation unit.

#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline void store(float* p, int64_t i, float f) { p[i] = f; }
inline void store(uint16_t* p, int64_t i, float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    p[i] = static_cast<uint16_t>(u >> 16);
}

// kMaxDim 576: an MLA latent entry (DeepSeek-V2: kv_lora_rank 512 + qk_rope_head_dim 64), read in
// place as one KV head (model/mla.py)
constexpr int kMaxGroup = 16, kMaxDim = 576, kMaxBlock = 256, kLanes = 8;

// Eight fp32 lanes as a GCC vector type: one AVX register where the CPU has AVX, two SSE ones
// otherwise; head_dim must be a multiple of kLanes (the caller checks).
typedef float vec __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vec16 __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vecu __attribute__((vector_size(4 * kLanes)));

inline vec load_vec(const float* p) {
    vec r;
    std::memcpy(&r, p, sizeof r);
    return r;
}
inline vec load_vec(const uint16_t* p) {  // bf16 -> fp32: the 16 bits become the high half
#if defined(__AVX2__)  // one widening load and one shift (GCC splits the generic form in halves)
    return reinterpret_cast<vec>(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
    vec16 h;
    std::memcpy(&h, p, sizeof h);
    const vecu u = __builtin_convertvector(h, vecu) << 16;
    vec r;
    std::memcpy(&r, &u, sizeof r);
    return r;
#endif
}
typedef float vec4 __attribute__((vector_size(16)));
typedef int32_t veci __attribute__((vector_size(4 * kLanes)));

inline float hsum(vec x) {  // a tree, so the adds of different rows overlap
    vec4 h = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
    h += __builtin_shufflevector(h, h, 2, 3, 0, 1);
    return h[0] + h[1];
}

// exp(x) for x <= 0 (scores minus their running max), lane-wise: 2^k * e^r with k = round(x /
// ln 2) (the 1.5 * 2^23 rounding trick), |r| <= ln2/2, and a degree-6 Taylor polynomial for e^r
// (relative error < 2e-7); x <= -87 (including -inf) gives 0.
inline vec exp_nonpos(vec x) {
    const vec lo = vec{} - 87.f, magic = vec{} + 12582912.f;
    const veci dead = x <= lo;
    x = dead ? lo : x;
    const vec k = (x * 1.44269504f + magic) - magic;
    const vec r = x - k * 0.693145751953125f - k * 1.428606765330187e-06f;
    vec p = vec{} + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const veci bits = (__builtin_convertvector(k, veci) + 127) << 23;
    vec scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return dead ? vec{} : p * scale;
}
inline float exp_nonpos(float x) { return exp_nonpos(vec{} + x)[0]; }

}  // namespace
