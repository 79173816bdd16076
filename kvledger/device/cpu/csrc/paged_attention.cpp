// Paged attention for CPU: each query attends over its sequence's K/V read in place from the
// block pool (no gather copy), with an online softmax over one block at a time (Milakov &
// Gimelshein, arXiv:1805.02867) and the K/V of a KV head shared by its group's query heads (GQA).
//
// Layout (kvledger.engine.kv): a layer's keys and values are [num_blocks, block_size, kv_heads,
// head_dim], contiguous. Queries q and the output are [num_queries, heads, head_dim], contiguous.
// Query i belongs to sequence seq_of_query[i] (a row of block_tables, [num_seqs, max_blocks]
// int32) and sees the first context_lens[i] positions of it; with a sliding window W > 0 only
// the last W of them (the query is at position context_lens[i] - 1 and sees key j when
// i - j < W): its blocks before the window are not read, the window's first block from the
// window's first row on. With sink logits (gpt-oss, one per query head) each softmax's
// normaliser gets one more term e^(sink), applied when an item (or its merged parts) finishes.
// With a logit soft-cap c (Gemma 2) every scaled score s is c tanh(s / c) before the softmax.
// Element type: fp32 or bf16 (raw uint16 bits); arithmetic in fp32.
//
// Quantized KV (kvledger.engine.kv.codecs, QuantizedKVStore): K and V are each described by a
// KVSide (codes, scales, zero points, fp16 outlier channels, the residual buffers) and attended
// without a dequantized copy: codes are widened to fp32 in registers inside the dot products,
// keys' per-channel (or e4m3's per-block) scales and zero points are folded into the query once
// per block, values' per-token scales are applied to the row in registers (attend_quantized).
// The arithmetic is the codecs' decode in fp32 (not rounded to a bf16 compute dtype first). A
// block whose residual_of entry is >= 0 is still partial and is read from its compute-dtype
// residual buffer instead, and one whose entry is r <= -2 from row -2 - r of k and v (then the
// blocks a prefill step wrote, staged in the compute dtype: the step's own tokens as computed). Rotated K/V (KVSide.rotation R: rows stored as k R, v R) are read
// with the query rotated once per item, q R, and the output rotated back, o R^T.
//
// Work is split into items (query, kv head, part of the context): with few queries (batch-1
// decode) a context is cut into parts so every thread has work, each part keeps its own running
// max, normaliser and weighted sum, and the parts are merged at the end (the split-context
// "flash decoding" scheme). The items are cut into contiguous ranges, one per thread of an
// OpenMP parallel region: the library needs libgomp.so.1, the soname of the runtime PyTorch
// loads first, so the region runs on torch's own intra-op threads. (Threads of our own would
// compete for the cores with torch's workers, which spin for a while after each parallel op:
// measured 2.4x the time per call in a decode step of 8 x 1K.) Rows of K, V and q are
// handled as vectors of 8 fp32 lanes (GCC vector extensions: AVX where the CPU has it, SSE
// pairs otherwise) and the softmax's exp is a polynomial on the same vectors.
//
// Built by kvledger.engine.attention.native with g++ -O3 -march=native ; called
// through ctypes.
//
// Plain blocks with head_dim a multiple of 16 (the common sizes 64 and 128) take the pair-order
// loop of paged_plain.h; when a context is cut into parts, each such item takes every KV head
// of its part, so a block's K and V rows are read whole and in one run.
//
// The pieces: paged_vec.h (fp32 vectors, the size limits), paged_softmax.h (the online softmax
// and plain blocks of other head sizes), paged_plain.h (plain blocks in pair order),
// paged_quantized.h (quantized blocks); this file splits the work and holds the C entry points.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

#include "paged_plain.h"
#include "paged_quantized.h"
#include "paged_softmax.h"
#include "paged_vec.h"

namespace {

struct Args {
    const void* q; const void* k; const void* v; void* out;
    const int32_t* block_tables; const int32_t* seq_of_query; const int32_t* context_lens;
    int num_queries, heads, kv_heads, head_dim, block_size, max_blocks, parts;
    float scale;
    int window;  // > 0: each query sees its context's last `window` positions only
    float* partial;  // [num_queries, kv_heads, parts, group, head_dim + 2] when parts > 1
    const KVSide* ks; const KVSide* vs;  // quantized K and V (null: k and v are plain blocks)
    const int64_t* residual_of;          // [blocks]: residual slot of a partial block, or -1
    const float* sinks;  // [heads]: a sink logit per query head in each denominator, or null
    float softcap;       // > 0: scores soft-capped, cap tanh(s / cap) (Gemma 2); 0: none
};

// 1 / the normaliser of query head h whose running max is m and normaliser l, and the factor
// exp(m - m*) on its sums: with a sink logit s (gpt-oss) the normaliser is l e^(m - m*) +
// e^(s - m*), m* = max(m, s); the output is acc x the factor / the normaliser.
inline float finish_scale(const Args& a, int h, float m, float l) {
    if (!a.sinks) return 1.f / l;
    const float s = a.sinks[h], top = s > m ? s : m, c = std::exp(m - top);
    return c / (l * c + std::exp(s - top));
}

// The item's result: the output rows when the context is one part, else its part's running
// max, normaliser and weighted sums (merged by merge_parts).
template <typename T>
void finish_item(const Args& a, const State& st, int qi, int kh, int part, int nv) {
    const int D = a.head_dim, G = a.heads / a.kv_heads;
    if (a.parts == 1) {
        T* out = static_cast<T*>(a.out);
        for (int g = 0; g < G; ++g) {
            const int64_t base = (static_cast<int64_t>(qi) * a.heads + kh * G + g) * D;
            const float inv = finish_scale(a, kh * G + g, st.m[g], st.l[g]);
            alignas(64) float row[kMaxDim];
            for (int j = 0; j < nv; ++j)
                for (int i = 0; i < kLanes; ++i) row[j * kLanes + i] = st.acc[g][j][i];
            if (a.vs && a.vs->rotation) rotate_row(row, a.vs->rotation, D, true);
            for (int d = 0; d < D; ++d) store(out, base + d, row[d] * inv);
        }
        return;
    }
    float* dst = a.partial + ((static_cast<int64_t>(qi) * a.kv_heads + kh) * a.parts + part)
                                 * G * (D + 2);
    for (int g = 0; g < G; ++g, dst += D + 2) {
        dst[0] = st.m[g];
        dst[1] = st.l[g];
        std::memcpy(dst + 2, st.acc[g], sizeof(float) * D);
    }
}

// The blocks [begin, end) of query qi's visible context that part `part` of a.parts covers,
// its context length, its first visible position and its block table row.
struct PartSpan { int L, first, begin, end; const int32_t* table; };

inline PartSpan part_span(const Args& a, int qi, int part) {
    const int L = a.context_lens[qi], blocks = (L + a.block_size - 1) / a.block_size;
    const int first = a.window > 0 && L > a.window ? L - a.window : 0;
    const int b0 = first / a.block_size;
    const int64_t span = blocks - b0;
    return {L, first, b0 + static_cast<int>(span * part / a.parts),
            b0 + static_cast<int>(span * (part + 1) / a.parts),
            a.block_tables + static_cast<int64_t>(a.seq_of_query[qi]) * a.max_blocks};
}

// Rows of the block starting at position `start` that lie before the window.
inline int rows_before(const PartSpan& span, int start) {
    return span.first > start ? span.first - start : 0;
}

// Pairs per row of the pair-order loop (paged_plain.h) for plain blocks of DV vectors per
// row, 0 where it does not apply (quantized blocks, a head size not a multiple of 16).
constexpr int pairs_of(int kind, int dv) { return kind == 0 && dv % 2 == 0 ? dv / 2 : 0; }

// Items (query qi, KV heads kh0 .. kh0 + nh, part) over plain blocks in pair order: every block
// of the part is read for all nh heads before the next (with nh = kv_heads its K and V rows are
// read whole, one contiguous run per block), the block after it prefetched into L2.
template <typename T, int NP>
void attend_plain(const Args& a, int qi, int kh0, int nh, int part) {
    thread_local std::vector<State> states;  // one per head; kept, it is ~100 KB each
    if (static_cast<int>(states.size()) < nh) states.resize(nh);
    const int D = a.head_dim, G = a.heads / a.kv_heads, bs = a.block_size;
    const PartSpan span = part_span(a, qi, part);
    const int L = span.L, b_begin = span.begin, b_end = span.end;
    const int32_t* table = span.table;
    const int64_t token_stride = static_cast<int64_t>(a.kv_heads) * D;
    const T* k = static_cast<const T*>(a.k) + kh0 * D;
    const T* v = static_cast<const T*>(a.v) + kh0 * D;
    for (int h = 0; h < nh; ++h) {
        const T* qrows = static_cast<const T*>(a.q) + (static_cast<int64_t>(qi) * a.heads + (kh0 + h) * G) * D;
        load_queries<T, NP>(states[h], qrows, D, G, a.scale);
        states[h].cap = a.softcap;
        for (int g = 0; g < G; ++g) {
            states[h].m[g] = -INFINITY;
            states[h].l[g] = 0.f;
        }
    }
    const int row_bytes = nh * D * static_cast<int>(sizeof(T));
    for (int b = b_begin; b < b_end; ++b) {
        const int start = b * bs;
        const int n = L - start < bs ? L - start : bs;
        if (b + 1 < b_end) {
            const int64_t next = static_cast<int64_t>(table[b + 1]) * bs * token_stride;
            prefetch_rows(k + next, v + next, token_stride, bs, row_bytes);
        }
        const int skip = rows_before(span, start);
        const int64_t base = (static_cast<int64_t>(table[b]) * bs + skip) * token_stride;
        for (int h = 0; h < nh; ++h)
            attend_pairs<T, NP>(states[h], k + base + h * D, v + base + h * D, token_stride,
                                n - skip, G);
    }
    for (int h = 0; h < nh; ++h) {
        natural_order<T, NP>(states[h], G);
        finish_item<T>(a, states[h], qi, kh0 + h, part, 2 * NP);
    }
}

// One (query, kv head, part) item; DV = head_dim / kLanes when fixed at compile time, 0 when not.
// KIND: 0 for plain blocks a.k / a.v, else the codec kind of a.ks and a.vs.
template <typename T, int DV, int KIND>
void attend_part(const Args& a, int qi, int kh, int part) {
    if constexpr (pairs_of(KIND, DV) > 0) {
        attend_plain<T, pairs_of(KIND, DV)>(a, qi, kh, 1, part);
        return;
    }
    const T* q = static_cast<const T*>(a.q);
    const int D = a.head_dim, G = a.heads / a.kv_heads, bs = a.block_size;
    const int nv = DV ? DV : D / kLanes;
    const PartSpan span = part_span(a, qi, part);
    const int L = span.L, b_begin = span.begin, b_end = span.end;
    const int32_t* table = span.table;
    const int64_t token_stride = static_cast<int64_t>(a.kv_heads) * D;
    State st;
    st.cap = a.softcap;
    for (int g = 0; g < G; ++g) {
        const T* qrow = q + (static_cast<int64_t>(qi) * a.heads + kh * G + g) * D;
        for (int j = 0; j < nv; ++j) st.qf[g][j] = load_vec(qrow + j * kLanes) * a.scale;
        if (KIND != 0 && a.ks->rotation)
            rotate_row(reinterpret_cast<float*>(st.qf[g]), a.ks->rotation, D, false);
        for (int j = 0; j < nv; ++j) {
            st.qm[g][j] = st.qf[g][j];
            st.acc[g][j] = vec{};
        }
        if (KIND != 0) {
            float* qm = reinterpret_cast<float*>(st.qm[g]);
            for (int j = 0; j < a.ks->num_outliers; ++j)
                qm[a.ks->outlier_channels[static_cast<int64_t>(kh) * a.ks->num_outliers + j]] = 0.f;
        }
        st.m[g] = -INFINITY;
        st.l[g] = 0.f;
    }
    QBlock kb, vb;
    std::vector<float> kroom, vroom;
    if (KIND) {
        group_layout(*a.ks, D, static_cast<int64_t>(bs) * a.kv_heads, kb, kroom);
        group_layout(*a.vs, D, static_cast<int64_t>(bs) * a.kv_heads, vb, vroom);
    }
    for (int b = b_begin; b < b_end; ++b) {
        const int start = b * bs;
        const int n = L - start < bs ? L - start : bs;
        const int skip = rows_before(span, start);
        const int64_t id = table[b];
        const int64_t slot = KIND ? a.residual_of[id] : id;
        const bool staged = KIND && slot <= -2;  // a block the step wrote: row -2 - slot of k, v
        if (!KIND || slot >= 0 || staged) {  // plain or staged blocks, or a residual buffer
            const T* kc = static_cast<const T*>(KIND && !staged ? a.ks->residual : a.k);
            const T* vc = static_cast<const T*>(KIND && !staged ? a.vs->residual : a.v);
            const int64_t row = staged ? -2 - slot : slot;
            const int64_t base = (row * bs + skip) * token_stride + kh * D;
            attend_block<T, DV>(st, kc + base, vc + base, token_stride, n - skip, G, nv);
        } else {
            constexpr int K = KIND ? KIND : kInt8;  // (KIND 0 never gets here)
            open_block<K>(*a.ks, id, kh, a.kv_heads, D, bs, kb);
            open_block<K>(*a.vs, id, kh, a.kv_heads, D, bs, vb);
            attend_quantized<K, DV>(st, *a.ks, kb, vb, id * bs * a.kv_heads + kh, kh,
                                    a.kv_heads, n, G, nv, skip);
        }
    }
    finish_item<T>(a, st, qi, kh, part, nv);
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
        const float inv = finish_scale(a, kh * G + g, mx, l);
        if (a.vs && a.vs->rotation) rotate_row(acc, a.vs->rotation, D, true);
        for (int d = 0; d < D; ++d) store(out, base + d, acc[d] * inv);
    }
}

template <typename T, int DV>
void run(const Args& a, int num_threads) {
    const int kind = a.ks ? a.ks->kind : 0;  // K and V share it (the caller checks)
    const int64_t pairs = static_cast<int64_t>(a.num_queries) * a.kv_heads;
    // a context cut into parts (few queries): each plain item takes every KV head of its part
    constexpr int NP = pairs_of(0, DV);
    const bool whole_rows = NP > 0 && kind == 0 && a.parts > 1;
    const int64_t items = (whole_rows ? a.num_queries : pairs) * a.parts;
    auto body = [&](int64_t begin, int64_t end) {
        for (int64_t w = begin; w < end; ++w) {
            const int64_t pair = w / a.parts;
            const int part = static_cast<int>(w % a.parts);
            if (whole_rows) {
                attend_plain<T, NP>(a, static_cast<int>(pair), 0, a.kv_heads, part);
                continue;
            }
            const int qi = static_cast<int>(pair / a.kv_heads);
            const int kh = static_cast<int>(pair % a.kv_heads);
            if (kind == kInt8) attend_part<T, DV, kInt8>(a, qi, kh, part);
            else if (kind == kInt4) attend_part<T, DV, kInt4>(a, qi, kh, part);
            else if (kind == kInt3) attend_part<T, DV, kInt3>(a, qi, kh, part);
            else if (kind == kInt2) attend_part<T, DV, kInt2>(a, qi, kh, part);
            else if (kind == kFp8) attend_part<T, DV, kFp8>(a, qi, kh, part);
            else attend_part<T, DV, 0>(a, qi, kh, part);
        }
    };
    const int n = static_cast<int>(num_threads < items ? num_threads : items);
    if (n <= 1) {
        body(0, items);
    } else {
#pragma omp parallel num_threads(n)
        {
            const int64_t i = omp_get_thread_num(), t = omp_get_num_threads();
            body(items * i / t, items * (i + 1) / t);
        }
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
// ks, vs, residual_of: a quantized store's K and V sides (k and v then hold the staged blocks
// that residual_of entries <= -2 name, [n, block_size, kv_heads, head_dim], or are unused), or
// null.
// window > 0: a sliding layer's window W (each query sees the last W positions of its context).
// sinks: [heads] fp32 sink logits (one more term per query head in each softmax denominator,
// holding no value: gpt-oss), or null.
// softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax
// (Gemma 2's attn_logit_softcapping); 0: none.
void kvl_paged_attention(const void* q, const void* k, const void* v, void* out,
                         const int32_t* block_tables, const int32_t* seq_of_query,
                         const int32_t* context_lens, int num_queries, int heads, int kv_heads,
                         int head_dim, int block_size, int max_blocks, float scale, int window,
                         int is_bf16, int num_threads, int parts, float* partial,
                         const KVSide* ks, const KVSide* vs, const int64_t* residual_of,
                         const float* sinks, float softcap) {
    Args a{q, k, v, out, block_tables, seq_of_query, context_lens, num_queries, heads, kv_heads,
           head_dim, block_size, max_blocks, parts < 1 ? 1 : parts, scale, window, partial, ks,
           vs, residual_of, sinks, softcap > 0.f ? softcap : 0.f};
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
