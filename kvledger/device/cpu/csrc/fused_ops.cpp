// Fused element-wise ops of a decoder layer for CPU, one call each instead of 3-10 PyTorch ops:
//
//  - kvl_add_rms_norm: h += delta (the residual add, in place), then out = h / rms(h) * weight
//    with rms(h) = sqrt(mean(h^2) + eps) (Zhang & Sennrich, "Root Mean Square Layer
//    Normalization", arXiv:1910.07467);
//  - kvl_rope: rotate the first `heads` heads of every row in place by the angles of its position,
//    the "rotate half" layout (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) (Su et al.,
//    RoFormer, arXiv:2104.09864), cos/sin from fp32 tables [max_positions, head_dim / 2];
//  - kvl_silu_mul: out = silu(gate) * up for rows [gate | up] (SwiGLU, Shazeer arXiv:2002.05202);
//  - kvl_gelu_tanh_mul: out = gelu_tanh(gate) * up (GeGLU, ibid.), with the tanh approximation
//    0.5 a (1 + tanh(z)), z = sqrt(2 / pi) (a + 0.044715 a^3) (Hendrycks & Gimpel,
//    arXiv:1606.08415), computed as a / (1 + e^(-2z)), the same value.
//
// Elements are fp32 or bf16 (raw uint16 bits, rounded to nearest even once per result); the
// arithmetic is fp32. Built into the same library as paged_attention.cpp.
//
// The norm and GLU loops are written to vectorise (`omp simd`; exp by exp_f32 below, since the
// C library's expf has no vector form without -ffast-math), and rows are split over torch's
// OpenMP threads once a call holds PARALLEL_MIN elements (libgomp, the pool torch itself uses:
// see gemv_tiles.h), so the many rows of a prefill chunk run at the machine's speed while a
// decode step's few rows stay on the calling thread.

#include <algorithm>
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

constexpr int64_t PARALLEL_MIN = 1 << 15;  // elements of a call from which rows are threaded

// e^x in fp32 to ~2 ulp, in branch-free arithmetic that vectorises: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by Cephes' expf polynomial (S. L. Moshier, Cephes Math Library, expf.c),
// times 2^n built in the exponent bits; x clamped to [-87.3, 88.7] (results stay normal
// floats: silu needs only their size there).
inline float exp_f32(float x) {
    x = std::max(-87.3f, std::min(x, 88.7f));
    // n = round(x log2 e): adding and subtracting 1.5 * 2^23 rounds to an integer (|x log2 e|
    // < 2^22), and unlike floor() it vectorises without -fno-trapping-math
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

template <typename T, typename W>
void add_rms_norm(T* h, const T* delta, const W* w, T* out, int rows, int dim, float eps) {
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(rows) * dim >= PARALLEL_MIN)
    for (int r = 0; r < rows; ++r) {
        T* x = h + static_cast<int64_t>(r) * dim;
        const T* d = delta ? delta + static_cast<int64_t>(r) * dim : nullptr;
        float sq = 0.f;
        if (d) {
#pragma omp simd reduction(+ : sq)
            for (int i = 0; i < dim; ++i) {
                put(x, i, to_f32(x, i) + to_f32(d, i));
                const float v = to_f32(x, i);  // the residual stream keeps the stored value
                sq += v * v;
            }
        } else {
#pragma omp simd reduction(+ : sq)
            for (int i = 0; i < dim; ++i) sq += to_f32(x, i) * to_f32(x, i);
        }
        const float inv = 1.f / std::sqrt(sq / dim + eps);
        T* y = out + static_cast<int64_t>(r) * dim;
#pragma omp simd
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

// The gate's scale inside the logistic: silu(a) = a / (1 + e^-a); gelu_tanh(a) = a / (1 + e^-2z).
struct Silu {
    static float arg(float a) { return a; }
};
struct GeluTanh {
    static float arg(float a) { return 1.5957691216057308f * (a + 0.044715f * a * a * a); }
};

template <typename Act, typename T>
void glu_mul(const T* gate_up, T* out, int rows, int f) {
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(rows) * f >= PARALLEL_MIN)
    for (int r = 0; r < rows; ++r) {
        const T* g = gate_up + static_cast<int64_t>(r) * 2 * f;
        T* y = out + static_cast<int64_t>(r) * f;
#pragma omp simd
        for (int i = 0; i < f; ++i) {
            const float a = to_f32(g, i);
            put(y, i, a / (1.f + exp_f32(-Act::arg(a))) * to_f32(g, f + i));
        }
    }
}

template <typename Act>
void glu_mul_any(const void* gate_up, void* out, int rows, int f, int is_bf16) {
    if (is_bf16)
        glu_mul<Act>(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, f);
    else
        glu_mul<Act>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, f);
}

}  // namespace

extern "C" {

// delta may be null (no residual add). is_bf16: 0 = fp32, 1 = bf16, for every tensor argument
// but the weight, which is bf16 when weight_bf16, else fp32 (a GGUF's F32 norm beside bf16 rows).
void kvl_add_rms_norm(void* h, const void* delta, const void* weight, void* out, int rows,
                      int dim, float eps, int is_bf16, int weight_bf16) {
    if (is_bf16 && weight_bf16)
        add_rms_norm(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(delta),
                     static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows,
                     dim, eps);
    else if (is_bf16)
        add_rms_norm(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(delta),
                     static_cast<const float*>(weight), static_cast<uint16_t*>(out), rows, dim,
                     eps);
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
    glu_mul_any<Silu>(gate_up, out, rows, f, is_bf16);
}

void kvl_gelu_tanh_mul(const void* gate_up, void* out, int rows, int f, int is_bf16) {
    glu_mul_any<GeluTanh>(gate_up, out, rows, f, is_bf16);
}

}  // extern "C"
