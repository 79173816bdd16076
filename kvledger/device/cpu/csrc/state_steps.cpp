// Decode steps of the state mixers for CPU, one token per sequence (kvledger.model.layers
// .gated_deltanet and .mamba2 hold the formulas; kvledger/device/cpu/state_steps.py wraps them):
//
//  - kvl_conv_step: the causal depthwise conv of one new input per channel after the window of
//    the last K - 1 inputs, then SiLU; the window shifts by one (in place);
//  - kvl_delta_step: the gated delta rule (Yang, Kautz & Hatamizadeh, arXiv:2412.06464) on the
//    conv's q, k, v: L2 norm of q and k, q / sqrt(dk), g = -exp(A_log) softplus(a + dt_bias),
//    beta = sigmoid(b); S <- e^g S; S <- S + k (beta (v - S^T k))^T; o = S^T q (in place on S),
//    then, when given the gate z, the output RMSNorm(o) w silu(z) of each head;
//  - kvl_ssd_step: the Mamba-2 recurrence (Dao & Gu, arXiv:2405.21060) on the conv's x, B, C:
//    dt = clamp(softplus(dt + dt_bias)); S <- e^(dt A) S + dt x B^T; y = S C + D x.
//
// States and the conv window are fp32 or bf16 (the engine keeps them in its compute dtype; bf16
// is widened on load and rounded to nearest even on store, the arithmetic is fp32); the
// projection's columns (the new conv input, a, b, dt, z) are fp32 or bf16 rows of a strided
// matrix. A state's rows are picked by an index, so the step writes straight into the gathered
// batch of the engine.
//
// The state loops run along the state's last dimension (dv, d_state) in GCC vectors of kLanes
// fp32: 16 (one zmm) where the compiler targets AVX-512, 8 (one ymm) with AVX2, else 4 (SSE or
// plain scalar code); that dimension must be a multiple of kLanes (kvl_state_lanes; the
// caller checks and otherwise takes PyTorch). The (sequence, head) pairs are split over
// torch's OpenMP threads from PARALLEL_MIN state elements on.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vec __attribute__((vector_size(4 * kLanes)));
constexpr int kTile = 4;  // vectors of a column tile held in registers
constexpr int64_t PARALLEL_MIN = 1 << 16;

typedef uint16_t vec16 __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vecu __attribute__((vector_size(4 * kLanes)));

inline vec load(const float* p) {
    vec r;
    std::memcpy(&r, p, sizeof r);
    return r;
}
inline vec load(const uint16_t* p) {  // bf16 -> fp32: the 16 bits become the high half
    vec16 h;
    std::memcpy(&h, p, sizeof h);
    const vecu u = __builtin_convertvector(h, vecu) << 16;
    vec r;
    std::memcpy(&r, &u, sizeof r);
    return r;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
inline void store(uint16_t* p, vec v) {  // round to nearest even
    vecu u;
    std::memcpy(&u, &v, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    const vec16 h = __builtin_convertvector(u >> 16, vec16);
    std::memcpy(p, &h, sizeof h);
}
inline vec splat(float f) { return vec{} + f; }
inline float hsum(vec v) {
    float s = 0.f;
    for (int i = 0; i < kLanes; ++i) s += v[i];
    return s;
}

inline float to_f32(const float* p, int64_t i) { return p[i]; }
inline float to_f32(const uint16_t* p, int64_t i) {
    const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void put(float* p, int64_t i, float f) { p[i] = f; }
inline void put(uint16_t* p, int64_t i, float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    p[i] = static_cast<uint16_t>(u >> 16);
}
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
inline float silu(float x) { return x / (1.f + std::exp(-x)); }

template <typename T, typename TS>
void conv_step(const T* x, int64_t x_stride, TS* window, const int64_t* rows, int n, int C,
               int K, const float* w, const float* bias, float* out) {
    const int W = K - 1;
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(n) * C * K >= PARALLEL_MIN)
    for (int i = 0; i < n; ++i) {
        TS* win = window + rows[i] * C * W;
        for (int c = 0; c < C; ++c) {
            TS* h = win + static_cast<int64_t>(c) * W;
            const float* wc = w + static_cast<int64_t>(c) * K;
            const float now = to_f32(x, i * x_stride + c);
            float acc = (bias ? bias[c] : 0.f) + wc[W] * now;
            for (int j = 0; j < W; ++j) acc += wc[j] * to_f32(h, j);
            for (int j = 0; j + 1 < W; ++j) h[j] = h[j + 1];
            if (W > 0) put(h, W - 1, now);
            out[static_cast<int64_t>(i) * C + c] = silu(acc);
        }
    }
}

// One value head of one sequence: S [dk, dv] in place, o [dv].
template <typename TS>
void delta_head(TS* S, const float* qn, const float* kn, const float* v, float decay,
                float beta, int dk, int dv, float* o) {
    for (int j0 = 0; j0 < dv; j0 += kTile * kLanes) {
        const int nv = (dv - j0) / kLanes < kTile ? (dv - j0) / kLanes : kTile;
        vec kv[kTile] = {}, acc[kTile] = {}, delta[kTile];
        for (int i = 0; i < dk; ++i) {
            const vec ki = splat(kn[i]);
            for (int t = 0; t < nv; ++t) kv[t] += ki * load(S + i * dv + j0 + t * kLanes);
        }
        for (int t = 0; t < nv; ++t)
            delta[t] = (load(v + j0 + t * kLanes) - kv[t] * decay) * beta;
        for (int i = 0; i < dk; ++i) {
            const vec ki = splat(kn[i]), qi = splat(qn[i]);
            for (int t = 0; t < nv; ++t) {
                TS* p = S + i * dv + j0 + t * kLanes;
                const vec s = load(p) * decay + ki * delta[t];
                store(p, s);
                acc[t] += qi * s;
            }
        }
        for (int t = 0; t < nv; ++t) store(o + j0 + t * kLanes, acc[t]);
    }
}

// q or k of one key head, L2-normed (x / sqrt(sum x^2 + 1e-6)) and scaled, into out [d].
void l2_normed(const float* x, int d, float scale, float* out) {
    float sq = 0.f;
    for (int i = 0; i < d; ++i) sq += x[i] * x[i];
    const float inv = scale / std::sqrt(sq + 1e-6f);
    for (int i = 0; i < d; ++i) out[i] = x[i] * inv;
}

// out[j] = o[j] / rms(o) * w[j] * silu(z[j]) over one head's dv values; o rounded to T first,
// as the PyTorch norm rounds it to the compute dtype before the weight.
template <typename T>
void gated_norm(const float* o, const T* z, const float* w, float eps, int dv, T* out) {
    float sq = 0.f;
    for (int j = 0; j < dv; ++j) sq += o[j] * o[j];
    const float inv = 1.f / std::sqrt(sq / dv + eps);
    for (int j = 0; j < dv; ++j) {
        T normed[1];
        put(normed, 0, o[j] * inv);
        put(normed, 0, to_f32(normed, 0) * w[j]);
        put(out, j, to_f32(normed, 0) * silu(to_f32(z, j)));
    }
}

template <typename T, typename TS>
void delta_step(const float* mixed, const T* a, const T* b, int64_t ab_stride, TS* S,
                const int64_t* rows, int n, int hk, int hv, int dk, int dv,
                const float* neg_A, const float* dt_bias, float* out, const T* z,
                int64_t z_stride, const float* norm_w, float eps, T* gated) {
    const int64_t key_dim = static_cast<int64_t>(hk) * dk, width = 2 * key_dim + hv * dv;
    const int rep = hv / hk;
    const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
#pragma omp parallel for schedule(static) \
    if (static_cast<int64_t>(n) * hv * dk * dv >= PARALLEL_MIN)
    for (int p = 0; p < n * hv; ++p) {
        const int i = p / hv, h = p % hv, kh = h / rep;
        const float* row = mixed + i * width;
        float qn[512], kn[512];
        l2_normed(row + kh * dk, dk, q_scale, qn);
        l2_normed(row + key_dim + kh * dk, dk, 1.f, kn);
        const float g = neg_A[h] * softplus(to_f32(a, i * ab_stride + h) + dt_bias[h]);
        const float beta = 1.f / (1.f + std::exp(-to_f32(b, i * ab_stride + h)));
        float* o = out + static_cast<int64_t>(p) * dv;
        delta_head(S + (rows[i] * hv + h) * static_cast<int64_t>(dk) * dv, qn, kn,
                   row + 2 * key_dim + static_cast<int64_t>(h) * dv, std::exp(g), beta, dk, dv,
                   o);
        if (z)
            gated_norm(o, z + i * z_stride + static_cast<int64_t>(h) * dv, norm_w, eps, dv,
                       gated + static_cast<int64_t>(p) * dv);
    }
}

template <typename T, typename TS>
void ssd_step(const float* mixed, const T* dt, int64_t dt_stride, TS* S, const int64_t* rows,
              int n, int heads, int hd, int ds, int groups, const float* A, const float* D,
              const float* dt_bias, float dt_min, float dt_max, float* out) {
    const int64_t inner = static_cast<int64_t>(heads) * hd, width = inner + 2 * groups * ds;
    const int rep = heads / groups;
#pragma omp parallel for schedule(static) \
    if (static_cast<int64_t>(n) * heads * hd * ds >= PARALLEL_MIN)
    for (int p = 0; p < n * heads; ++p) {
        const int i = p / heads, h = p % heads, g = h / rep;
        const float* row = mixed + i * width;
        const float* x = row + h * hd;
        const float* B = row + inner + g * ds;
        const float* C = row + inner + static_cast<int64_t>(groups) * ds + g * ds;
        float step = softplus(to_f32(dt, i * dt_stride + h) + dt_bias[h]);
        step = step < dt_min ? dt_min : (step > dt_max ? dt_max : step);
        const vec decay = splat(std::exp(step * A[h]));
        TS* s = S + (rows[i] * heads + h) * static_cast<int64_t>(hd) * ds;
        for (int r = 0; r < hd; ++r) {
            const vec u = splat(step * x[r]);
            vec acc = {};
            for (int j = 0; j < ds; j += kLanes) {
                TS* q = s + static_cast<int64_t>(r) * ds + j;
                const vec v = load(q) * decay + u * load(B + j);
                store(q, v);
                acc += v * load(C + j);
            }
            out[static_cast<int64_t>(p) * hd + r] = hsum(acc) + D[h] * x[r];
        }
    }
}

// Calls fn with (T*) columns and (TS*) states: each fp32 (0) or bf16 (1) by its code.
template <typename Fn>
void with_types(int columns_bf16, int state_bf16, Fn fn) {
    if (columns_bf16 && state_bf16)
        fn(static_cast<uint16_t*>(nullptr), static_cast<uint16_t*>(nullptr));
    else if (columns_bf16)
        fn(static_cast<uint16_t*>(nullptr), static_cast<float*>(nullptr));
    else if (state_bf16)
        fn(static_cast<float*>(nullptr), static_cast<uint16_t*>(nullptr));
    else
        fn(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
}

}  // namespace

extern "C" {

int kvl_state_lanes() { return kLanes; }
int kvl_state_max_key_dim() { return 512; }

// x: [n] rows of x_stride elements, C channels each; window: [*, C, K - 1], row rows[i] for
// sequence i; w: fp32 [C, K]; bias: fp32 [C] or null; out: fp32 [n, C]. x_bf16 / state_bf16:
// the element types of x and of the window (0: fp32, 1: bf16).
void kvl_conv_step(const void* x, int64_t x_stride, int x_bf16, void* window, int state_bf16,
                   const int64_t* rows, int n, int C, int K, const float* w, const float* bias,
                   float* out) {
    with_types(x_bf16, state_bf16, [&](auto* t, auto* ts) {
        using T = std::remove_pointer_t<decltype(t)>;
        using TS = std::remove_pointer_t<decltype(ts)>;
        conv_step(static_cast<const T*>(x), x_stride, static_cast<TS*>(window), rows, n, C, K, w,
                  bias, out);
    });
}

// mixed: fp32 [n, 2 hk dk + hv dv] (q, k, v after the conv); a, b: [n] rows of ab_stride
// elements, hv each (fp32 or bf16: bf16, as z and gated); S: [*, hv, dk, dv] (state_bf16), row
// rows[i]; out: fp32 [n, hv, dv]; z: null, or [n] rows of z_stride elements, hv dv each, and
// then gated [n, hv, dv] gets RMSNorm(o) norm_w silu(z) per head (norm_w: fp32 [dv]).
void kvl_delta_step(const float* mixed, const void* a, const void* b, int64_t ab_stride,
                    int bf16, void* S, int state_bf16, const int64_t* rows, int n, int hk,
                    int hv, int dk, int dv, const float* neg_A, const float* dt_bias,
                    float* out, const void* z, int64_t z_stride, const float* norm_w, float eps,
                    void* gated) {
    with_types(bf16, state_bf16, [&](auto* t, auto* ts) {
        using T = std::remove_pointer_t<decltype(t)>;
        using TS = std::remove_pointer_t<decltype(ts)>;
        delta_step(mixed, static_cast<const T*>(a), static_cast<const T*>(b), ab_stride,
                   static_cast<TS*>(S), rows, n, hk, hv, dk, dv, neg_A, dt_bias, out,
                   static_cast<const T*>(z), z_stride, norm_w, eps, static_cast<T*>(gated));
    });
}

// mixed: fp32 [n, heads hd + 2 groups ds] (x, B, C after the conv); dt: [n] rows of dt_stride
// elements, heads each (fp32 or bf16); S: [*, heads, hd, ds] (state_bf16), row rows[i]; A
// (= -exp A_log), D, dt_bias: fp32 [heads]; out: fp32 [n, heads, hd].
void kvl_ssd_step(const float* mixed, const void* dt, int64_t dt_stride, int dt_bf16, void* S,
                  int state_bf16, const int64_t* rows, int n, int heads, int hd, int ds,
                  int groups, const float* A, const float* D, const float* dt_bias, float dt_min,
                  float dt_max, float* out) {
    with_types(dt_bf16, state_bf16, [&](auto* t, auto* ts) {
        using T = std::remove_pointer_t<decltype(t)>;
        using TS = std::remove_pointer_t<decltype(ts)>;
        ssd_step(mixed, static_cast<const T*>(dt), dt_stride, static_cast<TS*>(S), rows, n,
                 heads, hd, ds, groups, A, D, dt_bias, dt_min, dt_max, out);
    });
}

}  // extern "C"
