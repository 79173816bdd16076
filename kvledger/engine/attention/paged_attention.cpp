// Paged attention for CPU: each query attends over its sequence's K/V read in place from the
// block pool (no gather copy), with an online softmax over one block at a time (Milakov &
// Gimelshein, arXiv:1805.02867) and the K/V of a KV head shared by its group's query heads (GQA).
//
// Layout (kvledger.engine.kv): a layer's keys and values are [num_blocks, block_size, kv_heads,
// head_dim], contiguous. Queries q and the output are [num_queries, heads, head_dim], contiguous.
// Query i belongs to sequence seq_of_query[i] (a row of block_tables, [num_seqs, max_blocks]
// int32) and sees the first context_lens[i] positions of it. Element type: fp32 or bf16 (raw
// uint16 bits); arithmetic in fp32.
//
// Work is split into items (query, kv head, part of the context): with few queries (batch-1
// decode) a context is cut into parts so every thread has work, each part keeps its own running
// max, normaliser and weighted sum, and the parts are merged at the end (the split-context
// "flash decoding" scheme). Rows of K, V and q are handled as vectors of 8 fp32 lanes (GCC
// vector extensions: AVX where the CPU has it, SSE pairs otherwise) and the softmax's exp is a
// polynomial on the same vectors.
//
// Built by kvledger.engine.attention.native with g++ -O3 -march=native ; called
// through ctypes.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
    uint32_t u = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float* p, int64_t i, float f) { p[i] = f; }
inline void store(uint16_t* p, int64_t i, float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    p[i] = static_cast<uint16_t>(u >> 16);
}

struct Args {
    const void* q; const void* k; const void* v; void* out;
    const int32_t* block_tables; const int32_t* seq_of_query; const int32_t* context_lens;
    int num_queries, heads, kv_heads, head_dim, block_size, max_blocks, parts;
    float scale;
    float* partial;  // [num_queries, kv_heads, parts, group, head_dim + 2] when parts > 1
};

constexpr int kMaxGroup = 16, kMaxDim = 256, kMaxBlock = 256, kLanes = 8;

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
    vec16 h;
    std::memcpy(&h, p, sizeof h);
    const vecu u = __builtin_convertvector(h, vecu) << 16;
    vec r;
    std::memcpy(&r, &u, sizeof r);
    return r;
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

// One (query, kv head, part) item; DV = head_dim / kLanes when fixed at compile time, 0 when not.
template <typename T, int DV>
void attend_part(const Args& a, int qi, int kh, int part) {
    const T* q = static_cast<const T*>(a.q);
    const T* kc = static_cast<const T*>(a.k);
    const T* vc = static_cast<const T*>(a.v);
    const int D = a.head_dim, G = a.heads / a.kv_heads, bs = a.block_size;
    const int nv = DV ? DV : D / kLanes;
    const int L = a.context_lens[qi];
    const int blocks = (L + bs - 1) / bs;
    const int b_begin = static_cast<int>(static_cast<int64_t>(blocks) * part / a.parts);
    const int b_end = static_cast<int>(static_cast<int64_t>(blocks) * (part + 1) / a.parts);
    const int32_t* table = a.block_tables + static_cast<int64_t>(a.seq_of_query[qi]) * a.max_blocks;
    vec qf[kMaxGroup][kMaxDim / kLanes], acc[kMaxGroup][kMaxDim / kLanes];
    alignas(64) float s[kMaxGroup][kMaxBlock + kLanes];
    float m[kMaxGroup], l[kMaxGroup];
    for (int g = 0; g < G; ++g) {
        const T* qrow = q + (static_cast<int64_t>(qi) * a.heads + kh * G + g) * D;
        for (int j = 0; j < nv; ++j) {
            qf[g][j] = load_vec(qrow + j * kLanes) * a.scale;
            acc[g][j] = vec{};
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    const int64_t token_stride = static_cast<int64_t>(a.kv_heads) * D;
    for (int b = b_begin; b < b_end; ++b) {
        const int start = b * bs;
        const int n = L - start < bs ? L - start : bs;
        const int64_t block_base = static_cast<int64_t>(table[b]) * bs * token_stride + kh * D;
        for (int t = 0; t < n; ++t) {
            const T* krow = kc + block_base + t * token_stride;
            vec row[kMaxDim / kLanes];
            for (int j = 0; j < nv; ++j) row[j] = load_vec(krow + j * kLanes);
            for (int g = 0; g < G; ++g) {  // two chains of FMAs, so their latencies overlap
                vec even = qf[g][0] * row[0], odd = vec{};
                for (int j = 1; j < nv; j += 2) {
                    odd += qf[g][j] * row[j];
                    if (j + 1 < nv) even += qf[g][j + 1] * row[j + 1];
                }
                s[g][t] = hsum(even + odd);
            }
        }
        const int nl = (n + kLanes - 1) / kLanes;  // score vectors; the tail lanes are -inf
        for (int g = 0; g < G; ++g) {
            for (int t = n; t < nl * kLanes; ++t) s[g][t] = -INFINITY;
            vec* sv = reinterpret_cast<vec*>(s[g]);
            vec vmax = vec{} + m[g];
            for (int j = 0; j < nl; ++j) vmax = vmax > sv[j] ? vmax : sv[j];
            float mx = vmax[0];
            for (int i = 1; i < kLanes; ++i) mx = vmax[i] > mx ? vmax[i] : mx;
            const float corr = exp_nonpos(m[g] - mx);
            vec sum = vec{};
            for (int j = 0; j < nl; ++j) {
                sv[j] = exp_nonpos(sv[j] - mx);
                sum += sv[j];
            }
            l[g] = l[g] * corr + hsum(sum);
            m[g] = mx;
            if (corr != 1.f)
                for (int j = 0; j < nv; ++j) acc[g][j] *= corr;
        }
        for (int t = 0; t < n; ++t) {
            const T* vrow = vc + block_base + t * token_stride;
            vec row[kMaxDim / kLanes];
            for (int j = 0; j < nv; ++j) row[j] = load_vec(vrow + j * kLanes);
            for (int g = 0; g < G; ++g) {
                const float p = s[g][t];
                for (int j = 0; j < nv; ++j) acc[g][j] += p * row[j];
            }
        }
    }
    if (a.parts == 1) {
        T* out = static_cast<T*>(a.out);
        for (int g = 0; g < G; ++g) {
            const int64_t base = (static_cast<int64_t>(qi) * a.heads + kh * G + g) * D;
            const float inv = 1.f / l[g];
            for (int j = 0; j < nv; ++j)
                for (int i = 0; i < kLanes; ++i) store(out, base + j * kLanes + i, acc[g][j][i] * inv);
        }
        return;
    }
    float* dst = a.partial + ((static_cast<int64_t>(qi) * a.kv_heads + kh) * a.parts + part)
                                 * G * (D + 2);
    for (int g = 0; g < G; ++g, dst += D + 2) {
        dst[0] = m[g];
        dst[1] = l[g];
        std::memcpy(dst + 2, acc[g], sizeof(float) * D);
    }
}

// Combine the parts of (qi, kh): rescale each part's sums to the common maximum.
template <typename T>
void merge_parts(const Args& a, int qi, int kh) {
    const int D = a.head_dim, G = a.heads / a.kv_heads, P = a.parts;
    const float* src = a.partial + (static_cast<int64_t>(qi) * a.kv_heads + kh) * P * G * (D + 2);
    T* out = static_cast<T*>(a.out);
    for (int g = 0; g < G; ++g) {
        float mx = -INFINITY;
        for (int p = 0; p < P; ++p) {
            const float mp = src[(p * G + g) * (D + 2)];
            mx = mp > mx ? mp : mx;
        }
        alignas(64) float acc[kMaxDim] = {};
        float l = 0.f;
        for (int p = 0; p < P; ++p) {
            const float* part = src + (p * G + g) * (D + 2);
            if (part[0] == -INFINITY) continue;  // a part with no positions
            const float w = exp_nonpos(part[0] - mx);
            l += w * part[1];
#pragma omp simd
            for (int d = 0; d < D; ++d) acc[d] += w * part[2 + d];
        }
        const int64_t base = (static_cast<int64_t>(qi) * a.heads + kh * G + g) * D;
        const float inv = 1.f / l;
        for (int d = 0; d < D; ++d) store(out, base + d, acc[d] * inv);
    }
}

template <typename T, int DV>
void run(const Args& a, int num_threads) {
    const int64_t pairs = static_cast<int64_t>(a.num_queries) * a.kv_heads;
    const int64_t items = pairs * a.parts;
    auto body = [&](int64_t begin, int64_t end) {
        for (int64_t w = begin; w < end; ++w) {
            const int64_t pair = w / a.parts;
            attend_part<T, DV>(a, static_cast<int>(pair / a.kv_heads),
                           static_cast<int>(pair % a.kv_heads), static_cast<int>(w % a.parts));
        }
    };
    const int n = static_cast<int>(num_threads < items ? num_threads : items);
    if (n <= 1) {
        body(0, items);
    } else {
        std::vector<std::thread> pool;
        for (int i = 1; i < n; ++i) pool.emplace_back(body, items * i / n, items * (i + 1) / n);
        body(0, items / n);
        for (auto& t : pool) t.join();
    }
    if (a.parts > 1) {
        for (int64_t pair = 0; pair < pairs; ++pair)
            merge_parts<T>(a, static_cast<int>(pair / a.kv_heads),
                           static_cast<int>(pair % a.kv_heads));
    }
}

}  // namespace

extern "C" {

// Limits the caller must respect (checked in Python before the call).
int kvl_max_group() { return kMaxGroup; }
int kvl_max_head_dim() { return kMaxDim; }
int kvl_head_dim_multiple() { return kLanes; }
int kvl_max_block_size() { return kMaxBlock; }

// is_bf16: 0 = fp32, 1 = bf16. num_threads > 1 splits the items evenly over that many threads;
// parts > 1 cuts every context into that many runs of blocks (partial: scratch of
// num_queries * kv_heads * parts * (heads / kv_heads) * (head_dim + 2) floats).
void kvl_paged_attention(const void* q, const void* k, const void* v, void* out,
                         const int32_t* block_tables, const int32_t* seq_of_query,
                         const int32_t* context_lens, int num_queries, int heads, int kv_heads,
                         int head_dim, int block_size, int max_blocks, float scale, int is_bf16,
                         int num_threads, int parts, float* partial) {
    Args a{q, k, v, out, block_tables, seq_of_query, context_lens, num_queries, heads, kv_heads,
           head_dim, block_size, max_blocks, parts < 1 ? 1 : parts, scale, partial};
    const int dv = head_dim / kLanes;  // common head sizes get their own unrolled code
    if (is_bf16) {
        if (dv == 8) run<uint16_t, 8>(a, num_threads);
        else if (dv == 16) run<uint16_t, 16>(a, num_threads);
        else run<uint16_t, 0>(a, num_threads);
    } else {
        if (dv == 8) run<float, 8>(a, num_threads);
        else if (dv == 16) run<float, 16>(a, num_threads);
        else run<float, 0>(a, num_threads);
    }
}

}  // extern "C"
