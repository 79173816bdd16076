// Fused element-wise ops of a decoder layer for CPU, one call each instead of 3-10 PyTorch ops:
//
//  - kvl_add_rms_norm: h += delta (the residual add, in place), then out = h / rms(h) * weight
//    with rms(h) = sqrt(mean(h^2) + eps) (Zhang & Sennrich, "Root Mean Square Layer
//    Normalization", arXiv:1910.07467);
//  - kvl_rope: rotate the first `heads` heads of every row in place by the angles of its position,
//    the "rotate half" layout (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) (Su et al.,
//    RoFormer, arXiv:2104.09864), cos/sin from fp32 tables [max_positions, head_dim / 2];
//  - kvl_silu_mul: out = silu(gate) * up for rows [gate | up] (SwiGLU, Shazeer arXiv:2002.05202).
//
// Elements are fp32 or bf16 (raw uint16 bits, rounded to nearest even once per result); the
// arithmetic is fp32. Built into the same library as paged_attention.cpp.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float to_f32(const float* p, int64_t i) { return p[i]; }
inline float to_f32(const uint16_t* p, int64_t i) {
    uint32_t u = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void put(float* p, int64_t i, float f) { p[i] = f; }
inline void put(uint16_t* p, int64_t i, float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    p[i] = static_cast<uint16_t>(u >> 16);
}

template <typename T>
void add_rms_norm(T* h, const T* delta, const T* w, T* out, int rows, int dim, float eps) {
    for (int r = 0; r < rows; ++r) {
        T* x = h + static_cast<int64_t>(r) * dim;
        float sq = 0.f;
        for (int i = 0; i < dim; ++i) {
            float v = to_f32(x, i);
            if (delta) {
                put(x, i, v + to_f32(delta + static_cast<int64_t>(r) * dim, i));
                v = to_f32(x, i);  // the residual stream keeps the stored (rounded) value
            }
            sq += v * v;
        }
        const float inv = 1.f / std::sqrt(sq / dim + eps);
        T* y = out + static_cast<int64_t>(r) * dim;
        for (int i = 0; i < dim; ++i) put(y, i, to_f32(x, i) * inv * to_f32(w, i));
    }
}

template <typename T>
void rope(T* x, int64_t row_stride, int tokens, int heads, int dim, const float* cos,
          const float* sin, const int64_t* positions) {
    const int half = dim / 2;
    for (int t = 0; t < tokens; ++t) {
        const float* c = cos + positions[t] * half;
        const float* s = sin + positions[t] * half;
        for (int hd = 0; hd < heads; ++hd) {
            T* v = x + t * row_stride + static_cast<int64_t>(hd) * dim;
            for (int i = 0; i < half; ++i) {
                const float a = to_f32(v, i), b = to_f32(v, i + half);
                put(v, i, a * c[i] - b * s[i]);
                put(v, i + half, b * c[i] + a * s[i]);
            }
        }
    }
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int rows, int f) {
    for (int r = 0; r < rows; ++r) {
        const T* g = gate_up + static_cast<int64_t>(r) * 2 * f;
        T* y = out + static_cast<int64_t>(r) * f;
        for (int i = 0; i < f; ++i) {
            const float a = to_f32(g, i);
            put(y, i, a / (1.f + std::exp(-a)) * to_f32(g, f + i));
        }
    }
}

}  // namespace

extern "C" {

// delta may be null (no residual add). is_bf16: 0 = fp32, 1 = bf16, for every tensor argument.
void kvl_add_rms_norm(void* h, const void* delta, const void* weight, void* out, int rows,
                      int dim, float eps, int is_bf16) {
    if (is_bf16)
        add_rms_norm(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(delta),
                     static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows,
                     dim, eps);
    else
        add_rms_norm(static_cast<float*>(h), static_cast<const float*>(delta),
                     static_cast<const float*>(weight), static_cast<float*>(out), rows, dim, eps);
}

// x: rows of row_stride elements, the first heads * dim of each rotated; positions: [tokens].
void kvl_rope(void* x, int64_t row_stride, int tokens, int heads, int dim, const float* cos,
              const float* sin, const int64_t* positions, int is_bf16) {
    if (is_bf16)
        rope(static_cast<uint16_t*>(x), row_stride, tokens, heads, dim, cos, sin, positions);
    else
        rope(static_cast<float*>(x), row_stride, tokens, heads, dim, cos, sin, positions);
}

// gate_up: [rows, 2 * f] (gate then up); out: [rows, f].
void kvl_silu_mul(const void* gate_up, void* out, int rows, int f, int is_bf16) {
    if (is_bf16)
        silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, f);
    else
        silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, f);
}

}  // extern "C"
