// Quantized K/V for the paged-attention kernel (paged_attention.cpp; the codecs of
// kvledger.engine.kv.codecs, QuantizedKVStore): a KVSide as the caller passes it, fp16 scales
// and int8 / int4 / e4m3 codes widened to fp32 vectors, one block of one KV head opened for
// reading (QBlock), and a full block folded into the online-softmax state without a dequantized
// copy (attend_quantized).
//
// Included by paged_attention.cpp only: everything is in an anonymous namespace, as in one
// translation unit.

#pragma once

#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "paged_softmax.h"
#include "paged_vec.h"

namespace {

// K or V of one layer of a quantized store; block ids index every per-block tensor.
// (int3 is 7: 3 is e4m3's, and KVSide.kind is set by kvledger.device.cpu.native.kv_side)
enum Kind { kInt8 = 8, kInt4 = 4, kInt2 = 2, kInt3 = 7, kFp8 = 3 };

// Bytes of one row of D codes (kvledger.engine.kv.codecs.pack).
template <int KIND>
constexpr int row_bytes_of(int D) {
    return KIND == kInt4 ? D / 2 : KIND == kInt2 ? D / 4 : KIND == kInt3 ? 3 * D / 8 : D;
}
struct KVSide {
    const uint8_t* codes;      // [blocks, bs, kv_heads, head_dim * bits / 8]
    const void* scale;         // int: fp16 bits, [blocks, kv_heads, head_dim / group_blocks]
                               // when group == 0 (per channel: a key group's block j holds
                               // channels [j D / k, (j + 1) D / k) of the group's scales),
                               // else [blocks, bs, kv_heads, head_dim / group];
                               // fp8: fp32 [blocks, kv_heads]
    const uint16_t* zero;      // int: fp16 bits, the shape of scale
    const uint16_t* outliers;  // fp16 bits [blocks, bs, kv_heads, num_outliers], or null
    const int64_t* outlier_channels;  // [kv_heads, num_outliers]
    const void* residual;      // compute dtype [slots, bs, kv_heads, head_dim]
    const float* rotation;     // [head_dim, head_dim] R the rows are stored rotated by (x R),
                               // or null (kvledger.engine.kv.rotation)
    int32_t kind, group, num_outliers;
    const int64_t* group_members;  // [blocks, group_blocks]: the blocks of a block's key group
    int32_t group_blocks;          // k: blocks per key group (1: each block has its own)
};

// x[0..D) <- x R (transpose: x R^T), R [D, D] row-major, in fp32: a query into the basis of
// rotated keys, or an output of rotated values back (R orthogonal).
inline void rotate_row(float* x, const float* R, int D, bool transpose) {
    alignas(64) float y[kMaxDim] = {};
    if (transpose) {
        for (int d = 0; d < D; ++d) {
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < D; ++i) sum += x[i] * R[static_cast<int64_t>(d) * D + i];
            y[d] = sum;
        }
    } else {
        for (int i = 0; i < D; ++i) {
            const float xi = x[i];
            const float* r = R + static_cast<int64_t>(i) * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) y[d] += xi * r[d];
        }
    }
    std::memcpy(x, y, sizeof(float) * D);
}

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

// Eight codes -> eight fp32: int8 (one byte each), int4 (four bytes, the low nibble is the
// even channel), int2 (two bytes, channel j at bits 2j), int3 (three bytes, one little-endian
// word, channel j at bits 3j) and float8 e4m3fn. For e4m3 the 7 exponent and mantissa bits moved to fp32's
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
// The eight fields of `bits` bits of word w (field j at bits j x bits) as fp32.
inline vec fields_of(uint32_t w, int bits) {
    const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                              _mm256_set1_epi32(bits));
    const __m256i f = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts),
                                       _mm256_set1_epi32((1 << bits) - 1));
    return reinterpret_cast<vec>(_mm256_cvtepi32_ps(f));
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
inline vec fields_of(uint32_t w, int bits) {
    vec r;
    for (int i = 0; i < kLanes; ++i) r[i] = static_cast<float>((w >> (bits * i)) & ((1u << bits) - 1));
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
    const int row_bytes = row_bytes_of<KIND>(D);
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
    } else {  // per channel: slice j of the key group's scales sits in its block j
        const int k = s.group_blocks, w = D / k;
        for (int j = 0; j < k; ++j) {
            const int64_t m = k == 1 ? id : s.group_members[id * k + j];
            halves_to_floats(static_cast<const uint16_t*>(s.scale) + (m * kv_heads + kh) * w,
                             b.cs + j * w, w);
            halves_to_floats(s.zero + (m * kv_heads + kh) * w, b.cz + j * w, w);
        }
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
    if (KIND == kInt2) return fields_of(static_cast<uint32_t>(c[2 * j]) | (c[2 * j + 1] << 8), 2);
    if (KIND == kInt3) {
        const uint8_t* w = c + 3 * j;
        return fields_of(static_cast<uint32_t>(w[0]) | (w[1] << 8) | (w[2] << 16), 3);
    }
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
        int kh, int kv_heads, int n, int G, int nv_dynamic, int skip) {
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
    for (int g = 0; g < G; ++g)  // rows before a sliding window: no weight (skip < n)
        for (int t = 0; t < skip; ++t) st.s[g][t] = -INFINITY;
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

}  // namespace
