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
// Built by kvledger.engine.attention.native with g++ -O3 -march=native; called through ctypes.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

inline float load(const float* p, int i) { return p[i]; }
inline float load(const uint16_t* p, int i) {
    uint32_t u = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float* p, int i, float f) { p[i] = f; }
inline void store(uint16_t* p, int i, float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    p[i] = static_cast<uint16_t>(u >> 16);
}

struct Args {
    const void* q; const void* k; const void* v; void* out;
    const int32_t* block_tables; const int32_t* seq_of_query; const int32_t* context_lens;
    int num_queries, heads, kv_heads, head_dim, block_size, max_blocks;
    float scale;
};

constexpr int kMaxGroup = 16, kMaxDim = 256, kMaxBlock = 256;

template <typename T>
void attend_one(const Args& a, int qi, int kh) {
    const T* q = static_cast<const T*>(a.q);
    const T* kc = static_cast<const T*>(a.k);
    const T* vc = static_cast<const T*>(a.v);
    T* out = static_cast<T*>(a.out);
    const int D = a.head_dim, G = a.heads / a.kv_heads, bs = a.block_size;
    const int L = a.context_lens[qi];
    const int32_t* table = a.block_tables + static_cast<int64_t>(a.seq_of_query[qi]) * a.max_blocks;
    float qf[kMaxGroup][kMaxDim], acc[kMaxGroup][kMaxDim], m[kMaxGroup], l[kMaxGroup];
    float s[kMaxGroup][kMaxBlock];
    for (int g = 0; g < G; ++g) {
        const int64_t base = (static_cast<int64_t>(qi) * a.heads + kh * G + g) * D;
        for (int d = 0; d < D; ++d) { qf[g][d] = load(q, base + d) * a.scale; acc[g][d] = 0.f; }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    const int64_t token_stride = static_cast<int64_t>(a.kv_heads) * D;
    for (int b = 0, start = 0; start < L; ++b, start += bs) {
        const int n = L - start < bs ? L - start : bs;
        const int64_t block_base = static_cast<int64_t>(table[b]) * bs * token_stride + kh * D;
        for (int t = 0; t < n; ++t) {
            const int64_t kb = block_base + t * token_stride;
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
                for (int d = 0; d < D; ++d) dot += qf[g][d] * load(kc, kb + d);
                s[g][t] = dot;
            }
        }
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
            for (int t = 0; t < n; ++t) mx = s[g][t] > mx ? s[g][t] : mx;
            const float corr = std::exp(m[g] - mx);
            l[g] *= corr;
            for (int d = 0; d < D; ++d) acc[g][d] *= corr;
            for (int t = 0; t < n; ++t) {
                const float p = std::exp(s[g][t] - mx);
                l[g] += p;
                const int64_t vb = block_base + t * token_stride;
                for (int d = 0; d < D; ++d) acc[g][d] += p * load(vc, vb + d);
            }
            m[g] = mx;
        }
    }
    for (int g = 0; g < G; ++g) {
        const int64_t base = (static_cast<int64_t>(qi) * a.heads + kh * G + g) * D;
        const float inv = 1.f / l[g];
        for (int d = 0; d < D; ++d) store(out, base + d, acc[g][d] * inv);
    }
}

template <typename T>
void run_range(const Args& a, int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) attend_one<T>(a, w / a.kv_heads, w % a.kv_heads);
}

}  // namespace

extern "C" {

// Limits the caller must respect (checked in Python before the call).
int kvl_max_group() { return kMaxGroup; }
int kvl_max_head_dim() { return kMaxDim; }
int kvl_max_block_size() { return kMaxBlock; }

// is_bf16: 0 = fp32, 1 = bf16. num_threads > 1 splits the (query, kv head) pairs evenly.
void kvl_paged_attention(const void* q, const void* k, const void* v, void* out,
                         const int32_t* block_tables, const int32_t* seq_of_query,
                         const int32_t* context_lens, int num_queries, int heads, int kv_heads,
                         int head_dim, int block_size, int max_blocks, float scale, int is_bf16,
                         int num_threads) {
    Args a{q, k, v, out, block_tables, seq_of_query, context_lens, num_queries, heads, kv_heads,
           head_dim, block_size, max_blocks, scale};
    const int64_t work = static_cast<int64_t>(num_queries) * kv_heads;
    auto body = [&](int64_t b, int64_t e) {
        if (is_bf16) run_range<uint16_t>(a, b, e); else run_range<float>(a, b, e);
    };
    if (num_threads <= 1 || work < 2) { body(0, work); return; }
    const int n = static_cast<int>(num_threads < work ? num_threads : work);
    std::vector<std::thread> pool;
    for (int i = 1; i < n; ++i) pool.emplace_back(body, work * i / n, work * (i + 1) / n);
    body(0, work / n);
    for (auto& t : pool) t.join();
}

}  // extern "C"
