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
// Quantized KV (kvledger.engine.kv.codecs, QuantizedKVStore): K and V are each described by a
// KVSide (codes, scales, zero points, fp16 outlier channels, the residual buffers) and attended
// without a dequantized copy: codes are widened to fp32 in registers inside the dot products,
// keys' per-channel (or e4m3's per-block) scales and zero points are folded into the query once
// per block, values' per-token scales are applied to the row in registers (attend_quantized).
// The arithmetic is the codecs' decode in fp32 (not rounded to a bf16 compute dtype first). A
// block whose residual_of entry is >= 0 is still partial and is read from its compute-dtype
// residual buffer instead.
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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

// K or V of one layer of a quantized store; block ids index every per-block tensor.
enum Kind { kInt8 = 8, kInt4 = 4, kFp8 = 3 };
struct KVSide {
    const uint8_t* codes;      // [blocks, bs, kv_heads, head_dim * bits / 8]
    const void* scale;         // int: fp16 bits, [blocks, kv_heads, head_dim] when group == 0
                               // (per channel), else [blocks, bs, kv_heads, head_dim / group];
                               // fp8: fp32 [blocks, kv_heads]
    const uint16_t* zero;      // int: fp16 bits, the shape of scale
    const uint16_t* outliers;  // fp16 bits [blocks, bs, kv_heads, num_outliers], or null
    const int64_t* outlier_channels;  // [kv_heads, num_outliers]
    const void* residual;      // compute dtype [slots, bs, kv_heads, head_dim]
    int32_t kind, group, num_outliers;
};

struct Args {
    const void* q; const void* k; const void* v; void* out;
    const int32_t* block_tables; const int32_t* seq_of_query; const int32_t* context_lens;
    int num_queries, heads, kv_heads, head_dim, block_size, max_blocks, parts;
    float scale;
    float* partial;  // [num_queries, kv_heads, parts, group, head_dim + 2] when parts > 1
    const KVSide* ks; const KVSide* vs;  // quantized K and V (null: k and v are plain blocks)
    const int64_t* residual_of;          // [blocks]: residual slot of a partial block, or -1
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

// fp16 bits -> fp32 (exact, subnormals included).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {
        const float f = static_cast<float>(m) * (1.f / 16777216.f);  // m x 2^-24
        return sign ? -f : f;
    }
    const uint32_t u = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}


// n fp16 values -> fp32: eight at a time with F16C where the CPU has it (exact either way).
inline void halves_to_floats(const uint16_t* h, float* f, int n) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < n; ++i) f[i] = _cvtsh_ss(h[i]);
#else
    for (; i < n; ++i) f[i] = half_to_float(h[i]);
#endif
}

inline void store_vec(float* p, vec x) { std::memcpy(p, &x, sizeof x); }

// Eight codes -> eight fp32: int8 (one byte each), int4 (four bytes, the low nibble is the
// even channel) and float8 e4m3fn. For e4m3 the 7 exponent and mantissa bits moved to fp32's
// bits 20..26 make 2^(e-127) x 1.m (a subnormal for e = 0), and x 2^120 rebiases to e4m3's 7;
// both steps are exact. (0x7F, e4m3's NaN, would read 480: the codec never writes it, values
// are clamped to +-448.) AVX2 widens the bytes in registers; other CPUs take a scalar loop.
#if defined(__AVX2__)
inline vec int8_codes(const uint8_t* c) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
    return reinterpret_cast<vec>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
}
inline vec int4_codes(const uint8_t* c) {
    int32_t four;
    std::memcpy(&four, c, 4);
    const __m128i pairs = _mm_shuffle_epi8(_mm_cvtsi32_si128(four),
                                           _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1,
                                                         -1, -1, -1, -1));
    const __m256i nibbles = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_cvtepu8_epi32(pairs), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
        _mm256_set1_epi32(15));
    return reinterpret_cast<vec>(_mm256_cvtepi32_ps(nibbles));
}
inline vec fp8_to_float(const uint8_t* c) {
    // sign-extended and moved up 20 bits: the sign lands in bit 31 (and 28..30, masked)
    const __m256i u = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
    const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(u, 20),
                                          _mm256_set1_epi32(static_cast<int>(0x87F00000u)));
    return reinterpret_cast<vec>(_mm256_castsi256_ps(bits)) * 0x1p120f;
}
#else
inline vec int8_codes(const uint8_t* c) {
    vec r;
    for (int i = 0; i < kLanes; ++i) r[i] = static_cast<float>(c[i]);
    return r;
}
inline vec int4_codes(const uint8_t* c) {
    vec r;
    for (int i = 0; i < kLanes; ++i) r[i] = static_cast<float>((c[i / 2] >> (4 * (i & 1))) & 15);
    return r;
}
inline vec fp8_to_float(const uint8_t* c) {
    vec r;
    for (int i = 0; i < kLanes; ++i) {
        const uint32_t bits = ((c[i] & 0x7Fu) << 20) | ((c[i] & 0x80u) << 24);
        std::memcpy(&r[i], &bits, 4);  // NOLINT: one lane's bytes
    }
    return r * 0x1p120f;
}
#endif

// Running state of one (query, kv head, part) item: the group's scaled queries (qm: the same
// with the outlier key channels zeroed; qk: folded with one block's key scales), weighted
// sums, running max m and normaliser l, and one block's scores.
struct State {
    vec qf[kMaxGroup][kMaxDim / kLanes], acc[kMaxGroup][kMaxDim / kLanes];
    vec qm[kMaxGroup][kMaxDim / kLanes], qk[kMaxGroup][kMaxDim / kLanes];
    alignas(64) float s[kMaxGroup][kMaxBlock + kLanes];
    alignas(64) float w[kMaxGroup][kMaxBlock + kLanes];  // probabilities x a value scale
    float m[kMaxGroup], l[kMaxGroup];
};

// q . row over nv vectors, in two chains of FMAs so their latencies overlap.
inline float dot(const vec* q, const vec* row, int nv) {
    vec even = q[0] * row[0], odd = vec{};
    for (int j = 1; j < nv; j += 2) {
        odd += q[j] * row[j];
        if (j + 1 < nv) even += q[j + 1] * row[j + 1];
    }
    return hsum(even + odd);
}

// Online-softmax step over the n scores st.s[g][0..n) of a block: new max, normaliser, the
// accumulators rescaled; the scores become exp(score - max).
inline void softmax_block(State& st, int n, int G, int nv) {
    const int nl = (n + kLanes - 1) / kLanes;  // score vectors; the tail lanes are -inf
    for (int g = 0; g < G; ++g) {
        for (int t = n; t < nl * kLanes; ++t) st.s[g][t] = -INFINITY;
        vec* sv = reinterpret_cast<vec*>(st.s[g]);
        vec vmax = vec{} + st.m[g];
        for (int j = 0; j < nl; ++j) vmax = vmax > sv[j] ? vmax : sv[j];
        float mx = vmax[0];
        for (int i = 1; i < kLanes; ++i) mx = vmax[i] > mx ? vmax[i] : mx;
        const float corr = exp_nonpos(st.m[g] - mx);
        vec sum = vec{};
        for (int j = 0; j < nl; ++j) {
            sv[j] = exp_nonpos(sv[j] - mx);
            sum += sv[j];
        }
        st.l[g] = st.l[g] * corr + hsum(sum);
        st.m[g] = mx;
        if (corr != 1.f)
            for (int j = 0; j < nv; ++j) st.acc[g][j] *= corr;
    }
}

// acc[g][j0..j1) += sum_t w[g][t] row(t, j) for the GC queries g0.. of the group, W vectors at
// a time: the accumulators stay in registers over the n rows (a row is read once per chunk).
template <int GC, int W, typename Row>
inline __attribute__((always_inline)) void weighted_rows_chunk(
        State& st, const float (*w)[kMaxBlock + kLanes], int g0, int n, int j, Row row) {
    vec acc[GC][W];
    for (int g = 0; g < GC; ++g)
        for (int i = 0; i < W; ++i) acc[g][i] = st.acc[g0 + g][j + i];
    for (int t = 0; t < n; ++t) {
        vec r[W];
        for (int i = 0; i < W; ++i) r[i] = row(t, j + i);
        for (int g = 0; g < GC; ++g) {
            const float p = w[g0 + g][t];
            for (int i = 0; i < W; ++i) acc[g][i] += p * r[i];
        }
    }
    for (int g = 0; g < GC; ++g)
        for (int i = 0; i < W; ++i) st.acc[g0 + g][j + i] = acc[g][i];
}

template <int GC, typename Row>
inline __attribute__((always_inline)) void weighted_rows_g(
        State& st, const float (*w)[kMaxBlock + kLanes], int g0, int n, int j0, int j1, Row row) {
    int j = j0;
    for (; j + 2 <= j1; j += 2) weighted_rows_chunk<GC, 2>(st, w, g0, n, j, row);
    if (j < j1) weighted_rows_chunk<GC, 1>(st, w, g0, n, j, row);
}

// acc[g][j0..j1) += sum_t w[g][t] row(t, j) for every query g < G of the group, in chunks of
// up to 4 queries (so the accumulators fit in registers).
template <typename Row>
inline __attribute__((always_inline)) void weighted_rows(
        State& st, const float (*w)[kMaxBlock + kLanes], int G, int n, int j0, int j1, Row row) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        switch (G - g0 < 4 ? G - g0 : 4) {
            case 1: weighted_rows_g<1>(st, w, g0, n, j0, j1, row); break;
            case 2: weighted_rows_g<2>(st, w, g0, n, j0, j1, row); break;
            case 3: weighted_rows_g<3>(st, w, g0, n, j0, j1, row); break;
            default: weighted_rows_g<4>(st, w, g0, n, j0, j1, row); break;
        }
    }
}

// Fold n rows of K and V (element type R, `stride` elements apart) into the state.
template <typename R, int DV>
inline __attribute__((always_inline)) void attend_block(State& st, const R* krows,
                                                        const R* vrows, int64_t stride, int n,
                                                        int G, int nv_dynamic) {
    const int nv = DV ? DV : nv_dynamic;
    for (int t = 0; t < n; ++t) {
        const R* krow = krows + t * stride;
        vec row[kMaxDim / kLanes];
        for (int j = 0; j < nv; ++j) row[j] = load_vec(krow + j * kLanes);
        for (int g = 0; g < G; ++g) st.s[g][t] = dot(st.qf[g], row, nv);
    }
    softmax_block(st, n, G, nv);
    weighted_rows(st, st.s, G, n, 0, nv,
                  [&](int t, int j) { return load_vec(vrows + t * stride + j * kLanes); });
}

// One quantized block of one KV head, as the attention reads it: the codes of token t at
// codes + t * stride, and what turns codes into values (x = zero + code x scale for int8/int4,
// x = value(code) x fp8_scale for e4m3).
struct QBlock {
    const uint8_t* codes;
    int64_t stride;
    const float *tscale, *tzero;  // per-token groups, fp32: token t's at + t * tstride (or null)
    float *scales, *zeros;        // where they are converted to (all KV heads of the block)
    int64_t tstride;
    int groups;
    bool aligned;                      // groups are whole vectors: vector j is in group_of[j]
    int16_t group_of[kMaxDim];         // group of vector j (aligned), else of lane j
    float fp8_scale;
    alignas(64) float cs[kMaxDim], cz[kMaxDim];  // per channel: scale and zero of each channel
};

// The block-independent part of a QBlock: which group each vector (or lane) belongs to, and
// room for a block's per-token scales and zero points in fp32 (all its KV heads, `tokens`).
void group_layout(const KVSide& s, int D, int64_t tokens, QBlock& b, std::vector<float>& room) {
    b.tscale = b.tzero = b.scales = b.zeros = nullptr;
    if (s.kind == kFp8 || s.group == 0) return;
    room.resize(2 * tokens * (D / s.group));
    b.tscale = b.scales = room.data();
    b.tzero = b.zeros = b.scales + tokens * (D / s.group);
    b.groups = D / s.group;
    b.aligned = s.group % kLanes == 0;
    for (int i = 0; i < (b.aligned ? D / kLanes : D); ++i)
        b.group_of[i] = static_cast<int16_t>(b.aligned ? i * kLanes / s.group : i / s.group);
}

// Point b at block `id`, KV head kh (per-channel scales converted to fp32 here).
template <int KIND>
void open_block(const KVSide& s, int64_t id, int kh, int kv_heads, int D, int bs, QBlock& b) {
    const int row_bytes = KIND == kInt4 ? D / 2 : D;
    const int64_t row0 = id * bs * kv_heads + kh;  // row of token t: row0 + t * kv_heads
    b.codes = s.codes + row0 * row_bytes;
    b.stride = static_cast<int64_t>(kv_heads) * row_bytes;
    if (KIND == kFp8) {
        b.fp8_scale = static_cast<const float*>(s.scale)[id * kv_heads + kh];
    } else if (s.group != 0) {
        const int n = bs * kv_heads * b.groups;
        halves_to_floats(static_cast<const uint16_t*>(s.scale) + id * n, b.scales, n);
        halves_to_floats(s.zero + id * n, b.zeros, n);
        b.tscale = b.scales + kh * b.groups;  // token t, KV head kh: + t * tstride
        b.tzero = b.zeros + kh * b.groups;
        b.tstride = static_cast<int64_t>(kv_heads) * b.groups;
    } else {
        halves_to_floats(static_cast<const uint16_t*>(s.scale) + (id * kv_heads + kh) * D, b.cs, D);
        halves_to_floats(s.zero + (id * kv_heads + kh) * D, b.cz, D);
    }
}

// Lanes j*8.. of a per-group array g as a vector.
inline vec group_vec(const QBlock& b, const float* g, int j) {
    if (b.aligned) return vec{} + g[b.group_of[j]];
    vec r;
    for (int i = 0; i < kLanes; ++i) r[i] = g[b.group_of[j * kLanes + i]];
    return r;
}

template <int KIND>
inline vec codes_vec(const uint8_t* c, int j) {
    if (KIND == kInt8) return int8_codes(c + j * kLanes);
    if (KIND == kInt4) return int4_codes(c + j * kLanes / 2);
    return fp8_to_float(c + j * kLanes);
}

// Token t's codes as nv vectors: the values themselves for int8/int4 (zero + code x scale,
// in registers), e4m3 values without their block scale (the caller folds it).
template <int KIND>
inline __attribute__((always_inline)) void dequantize_row(const QBlock& b, int t, int nv,
                                                          vec* row) {
    const uint8_t* c = b.codes + t * b.stride;
    for (int j = 0; j < nv; ++j) row[j] = codes_vec<KIND>(c, j);
    if (KIND == kFp8) return;
    if (b.tscale) {
        const float *sg = b.tscale + t * b.tstride, *zg = b.tzero + t * b.tstride;
        for (int j = 0; j < nv; ++j)
            row[j] = row[j] * group_vec(b, sg, j) + group_vec(b, zg, j);
    } else {
        for (int j = 0; j < nv; ++j)
            row[j] = row[j] * load_vec(b.cs + j * kLanes) + load_vec(b.cz + j * kLanes);
    }
}

// Fold one full quantized block (n rows) into the state without a dequantized copy. Keys with
// one scale per channel (and e4m3's one per block) are folded into the query once per block,
// q.k_t = sum_c (q_c s_c) code_tc + sum_c q_c z_c, so the loop over tokens is a dot of q' with
// the codes widened in registers (per-token key groups: each row dequantized in registers).
// Values: sum_t p_t v_t = sum_t (p_t s_t) code_t + sum_t p_t z_t, so the value scales go into
// the probabilities (w) and the loop over rows is weighted_rows over the widened codes, as
// for plain blocks; groups that split a vector take rows dequantized in registers. The fp16
// outlier key channels are zeroed in qm and their q_c x outlier_tc added per token.
template <int KIND, int DV>
inline __attribute__((always_inline)) void attend_quantized(
        State& st, const KVSide& ks, const QBlock& kb, const QBlock& vb, int64_t row0,
        int kh, int kv_heads, int n, int G, int nv_dynamic) {
    const int nv = DV ? DV : nv_dynamic;
    const bool fold = KIND == kFp8 || kb.tscale == nullptr;
    float kc[kMaxGroup] = {};
    if (fold) {
        for (int g = 0; g < G; ++g) {
            vec z = vec{};
            for (int j = 0; j < nv; ++j) {
                if (KIND == kFp8) {
                    st.qk[g][j] = st.qm[g][j] * kb.fp8_scale;
                } else {
                    st.qk[g][j] = st.qm[g][j] * load_vec(kb.cs + j * kLanes);
                    z += st.qm[g][j] * load_vec(kb.cz + j * kLanes);
                }
            }
            if (KIND != kFp8) kc[g] = hsum(z);
        }
    }
    const int no = ks.num_outliers;
    const int64_t* ch = ks.outlier_channels + static_cast<int64_t>(kh) * no;
    for (int t = 0; t < n; ++t) {
        vec row[kMaxDim / kLanes];
        if (fold) {
            for (int j = 0; j < nv; ++j) row[j] = codes_vec<KIND>(kb.codes + t * kb.stride, j);
        } else {
            dequantize_row<KIND>(kb, t, nv, row);
        }
        for (int g = 0; g < G; ++g) st.s[g][t] = dot(fold ? st.qk[g] : st.qm[g], row, nv) + kc[g];
        if (no) {
            float out[kMaxDim];
            halves_to_floats(ks.outliers + (row0 + static_cast<int64_t>(t) * kv_heads) * no,
                             out, no);
            for (int g = 0; g < G; ++g) {
                const float* q = reinterpret_cast<const float*>(st.qf[g]);
                float extra = 0.f;
                for (int j = 0; j < no; ++j) extra += q[ch[j]] * out[j];
                st.s[g][t] += extra;
            }
        }
    }
    softmax_block(st, n, G, nv);
    const auto codes = [&](int t, int j) { return codes_vec<KIND>(vb.codes + t * vb.stride, j); };
    const int nl = (n + kLanes - 1) / kLanes;
    if (KIND == kFp8) {  // one scale for the block: into the probabilities
        for (int g = 0; g < G; ++g) {
            vec* w = reinterpret_cast<vec*>(st.w[g]);
            for (int i = 0; i < nl; ++i) w[i] = reinterpret_cast<vec*>(st.s[g])[i] * vb.fp8_scale;
        }
        weighted_rows(st, st.w, G, n, 0, nv, codes);
        return;
    }
    if (vb.tscale && vb.aligned) {
        // per-token groups of whole vectors: for each group k, sum_t p_t v_t =
        // sum_t (p_t s_tk) code_t + sum_t p_t z_tk over the group's channels
        const int per = nv / vb.groups;  // vectors per group
        for (int k = 0; k < vb.groups; ++k) {
            alignas(64) float sk[kMaxBlock + kLanes], zk[kMaxBlock + kLanes];
            for (int t = 0; t < n; ++t) {
                sk[t] = vb.tscale[t * vb.tstride + k];
                zk[t] = vb.tzero[t * vb.tstride + k];
            }
            for (int t = n; t < nl * kLanes; ++t) sk[t] = zk[t] = 0.f;
            for (int g = 0; g < G; ++g) {
                vec z = vec{};
                for (int i = 0; i < nl; ++i) {
                    const vec p = reinterpret_cast<vec*>(st.s[g])[i];
                    reinterpret_cast<vec*>(st.w[g])[i] = p * load_vec(sk + i * kLanes);
                    z += p * load_vec(zk + i * kLanes);
                }
                const float zsum = hsum(z);
                for (int j = k * per; j < (k + 1) * per; ++j) st.acc[g][j] += zsum;
            }
            weighted_rows(st, st.w, G, n, k * per, (k + 1) * per, codes);
        }
        return;
    }
    for (int t = 0; t < n; ++t) {  // groups that split a vector: whole rows dequantized
        vec row[kMaxDim / kLanes];
        dequantize_row<KIND>(vb, t, nv, row);
        for (int g = 0; g < G; ++g)
            for (int j = 0; j < nv; ++j) st.acc[g][j] += st.s[g][t] * row[j];
    }
}

// One (query, kv head, part) item; DV = head_dim / kLanes when fixed at compile time, 0 when not.
// KIND: 0 for plain blocks a.k / a.v, else the codec kind of a.ks and a.vs.
template <typename T, int DV, int KIND>
void attend_part(const Args& a, int qi, int kh, int part) {
    const T* q = static_cast<const T*>(a.q);
    const int D = a.head_dim, G = a.heads / a.kv_heads, bs = a.block_size;
    const int nv = DV ? DV : D / kLanes;
    const int L = a.context_lens[qi];
    const int blocks = (L + bs - 1) / bs;
    const int b_begin = static_cast<int>(static_cast<int64_t>(blocks) * part / a.parts);
    const int b_end = static_cast<int>(static_cast<int64_t>(blocks) * (part + 1) / a.parts);
    const int32_t* table = a.block_tables + static_cast<int64_t>(a.seq_of_query[qi]) * a.max_blocks;
    State st;
    for (int g = 0; g < G; ++g) {
        const T* qrow = q + (static_cast<int64_t>(qi) * a.heads + kh * G + g) * D;
        for (int j = 0; j < nv; ++j) {
            st.qf[g][j] = load_vec(qrow + j * kLanes) * a.scale;
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
    const int64_t token_stride = static_cast<int64_t>(a.kv_heads) * D;
    QBlock kb, vb;
    std::vector<float> kroom, vroom;
    if (KIND) {
        group_layout(*a.ks, D, static_cast<int64_t>(bs) * a.kv_heads, kb, kroom);
        group_layout(*a.vs, D, static_cast<int64_t>(bs) * a.kv_heads, vb, vroom);
    }
    for (int b = b_begin; b < b_end; ++b) {
        const int start = b * bs;
        const int n = L - start < bs ? L - start : bs;
        const int64_t id = table[b];
        const int64_t slot = KIND ? a.residual_of[id] : id;
        if (!KIND || slot >= 0) {  // plain blocks, or a partial block's residual buffer
            const T* kc = static_cast<const T*>(KIND ? a.ks->residual : a.k);
            const T* vc = static_cast<const T*>(KIND ? a.vs->residual : a.v);
            const int64_t base = slot * bs * token_stride + kh * D;
            attend_block<T, DV>(st, kc + base, vc + base, token_stride, n, G, nv);
        } else {
            constexpr int K = KIND ? KIND : kInt8;  // (KIND 0 never gets here)
            open_block<K>(*a.ks, id, kh, a.kv_heads, D, bs, kb);
            open_block<K>(*a.vs, id, kh, a.kv_heads, D, bs, vb);
            attend_quantized<K, DV>(st, *a.ks, kb, vb, id * bs * a.kv_heads + kh, kh,
                                    a.kv_heads, n, G, nv);
        }
    }
    if (a.parts == 1) {
        T* out = static_cast<T*>(a.out);
        for (int g = 0; g < G; ++g) {
            const int64_t base = (static_cast<int64_t>(qi) * a.heads + kh * G + g) * D;
            const float inv = 1.f / st.l[g];
            for (int j = 0; j < nv; ++j)
                for (int i = 0; i < kLanes; ++i)
                    store(out, base + j * kLanes + i, st.acc[g][j][i] * inv);
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
    const int kind = a.ks ? a.ks->kind : 0;  // K and V share it (the caller checks)
    const int64_t pairs = static_cast<int64_t>(a.num_queries) * a.kv_heads;
    const int64_t items = pairs * a.parts;
    auto body = [&](int64_t begin, int64_t end) {
        for (int64_t w = begin; w < end; ++w) {
            const int64_t pair = w / a.parts;
            const int qi = static_cast<int>(pair / a.kv_heads);
            const int kh = static_cast<int>(pair % a.kv_heads), part = static_cast<int>(w % a.parts);
            if (kind == kInt8) attend_part<T, DV, kInt8>(a, qi, kh, part);
            else if (kind == kInt4) attend_part<T, DV, kInt4>(a, qi, kh, part);
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
// ks, vs, residual_of: a quantized store's K and V sides (k and v are then unused), or null.
void kvl_paged_attention(const void* q, const void* k, const void* v, void* out,
                         const int32_t* block_tables, const int32_t* seq_of_query,
                         const int32_t* context_lens, int num_queries, int heads, int kv_heads,
                         int head_dim, int block_size, int max_blocks, float scale, int is_bf16,
                         int num_threads, int parts, float* partial, const KVSide* ks,
                         const KVSide* vs, const int64_t* residual_of) {
    Args a{q, k, v, out, block_tables, seq_of_query, context_lens, num_queries, heads, kv_heads,
           head_dim, block_size, max_blocks, parts < 1 ? 1 : parts, scale, partial, ks, vs,
           residual_of};
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
