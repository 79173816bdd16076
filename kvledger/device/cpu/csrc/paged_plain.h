// Plain (fp32 / bf16) blocks of the paged-attention kernel (paged_attention.cpp) in *pair order*:
// the decode and prefill-after-prefix hot loop when head_dim is a multiple of 16.
//
// A row is read as pairs of fp32 vectors, 16 elements each: fp32 rows as their two halves, bf16
// rows as their even and odd elements (the low and high 16 bits of each 32-bit word: one shift
// and one mask widen 16 elements, where widening them in order takes two loads and two shifts).
// A dot product does not depend on the order of its terms, so the queries are loaded in the same
// order as the keys and the scores come out exact; the weighted sums of values accumulate in pair
// order too and are put back in element order once per item (natural_order).
//
// Scores are computed four keys at a time and summed across lanes together (three pairwise adds
// give the four sums, instead of one horizontal sum per key and query), the value rows are read
// once per two pairs of columns with the accumulators in registers, and the rows of the next
// block are prefetched while one block is folded in (block tables jump, the hardware prefetcher
// does not follow them).
//
// Included by paged_attention.cpp only: everything is in an anonymous namespace, as in one
// translation unit.

#pragma once

#include <cstdint>
#include <cstring>

#include "paged_softmax.h"
#include "paged_vec.h"

namespace {

constexpr int kPair = 2 * kLanes;  // elements of one pair of vectors

// 16 elements at p -> (a, b): fp32: elements [0, 8) and [8, 16); bf16: the even and odd ones.
inline void load_pair(const float* p, vec& a, vec& b) {
    a = load_vec(p);
    b = load_vec(p + kLanes);
}
inline void load_pair(const uint16_t* p, vec& a, vec& b) {
    vecu u;
    std::memcpy(&u, p, sizeof u);
    const vecu lo = u << 16, hi = u & 0xFFFF0000u;
    std::memcpy(&a, &lo, sizeof a);
    std::memcpy(&b, &hi, sizeof b);
}

// Lane-wise: [x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, x6+x7, y4+y5, y6+y7] (vhaddps).
inline vec hadd(vec x, vec y) {
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
}

// The lane sums of four vectors, as one vector of four.
inline vec4 sum4(vec a0, vec a1, vec a2, vec a3) {
    const vec h = hadd(hadd(a0, a1), hadd(a2, a3));
    return __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
}

// The G queries of an item, scaled, in pair order: qf[g][2p], qf[g][2p + 1] from pair p.
template <typename T, int NP>
inline void load_queries(State& st, const T* qrows, int D, int G, float scale) {
    for (int g = 0; g < G; ++g)
        for (int p = 0; p < NP; ++p) {
            load_pair(qrows + g * D + p * kPair, st.qf[g][2 * p], st.qf[g][2 * p + 1]);
            st.qf[g][2 * p] *= scale;
            st.qf[g][2 * p + 1] *= scale;
            st.acc[g][2 * p] = st.acc[g][2 * p + 1] = vec{};
        }
}

// st.acc back from pair order to element order (bf16: the even and odd lanes interleaved).
template <typename T, int NP>
inline void natural_order(State& st, int G) {
    if (sizeof(T) == 4) return;  // fp32 pairs are the elements in order
    for (int g = 0; g < G; ++g)
        for (int p = 0; p < NP; ++p) {
            const vec a = st.acc[g][2 * p], b = st.acc[g][2 * p + 1];
            st.acc[g][2 * p] = __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11);
            st.acc[g][2 * p + 1] = __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15);
        }
}

// Scores st.s[g0 + g][t0 .. t0 + 4) of the GC queries g0.. against rows r[0..4).
template <typename T, int NP, int GC>
inline __attribute__((always_inline)) void scores4(State& st, const T* const* r, int g0, int t0) {
    vec acc[GC][4] = {};
    for (int p = 0; p < NP; ++p)
        for (int i = 0; i < 4; ++i) {
            vec a, b;
            load_pair(r[i] + p * kPair, a, b);
            for (int g = 0; g < GC; ++g) {
                acc[g][i] += st.qf[g0 + g][2 * p] * a;
                acc[g][i] += st.qf[g0 + g][2 * p + 1] * b;
            }
        }
    for (int g = 0; g < GC; ++g) {
        const vec4 s = sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        std::memcpy(&st.s[g0 + g][t0], &s, sizeof s);
    }
}

// acc[g0 + g] += sum_t s[g0 + g][t] * row t, for the GC queries g0.., two pairs of columns per
// pass over the n rows (the GC x 4 accumulators stay in registers).
template <typename T, int NP, int GC>
inline __attribute__((always_inline)) void values_g(State& st, const T* vrows, int64_t stride,
                                                    int n, int g0) {
    static_assert(NP % 2 == 0, "two pairs per pass");
    for (int p = 0; p < NP; p += 2) {
        vec acc[GC][4];
        for (int g = 0; g < GC; ++g)
            for (int i = 0; i < 4; ++i) acc[g][i] = st.acc[g0 + g][2 * p + i];
        for (int t = 0; t < n; ++t) {
            vec x[4];
            load_pair(vrows + t * stride + p * kPair, x[0], x[1]);
            load_pair(vrows + t * stride + (p + 1) * kPair, x[2], x[3]);
            for (int g = 0; g < GC; ++g) {
                const float w = st.s[g0 + g][t];
                for (int i = 0; i < 4; ++i) acc[g][i] += w * x[i];
            }
        }
        for (int g = 0; g < GC; ++g)
            for (int i = 0; i < 4; ++i) st.acc[g0 + g][2 * p + i] = acc[g][i];
    }
}

// GC queries at a time, GC <= 3 (so 4 x GC score accumulators or 4 x GC value accumulators
// fit in the registers with the rows).
template <typename T, int NP, int GC>
inline __attribute__((always_inline)) void fold_g(State& st, const T* krows, const T* vrows,
                                                  int64_t stride, int n, int g0, bool scores) {
    if (scores) {
        for (int t0 = 0; t0 < n; t0 += 4) {
            const T* r[4];
            for (int i = 0; i < 4; ++i)  // past the end: the last row again (its score unused)
                r[i] = krows + (t0 + i < n ? t0 + i : n - 1) * stride;
            scores4<T, NP, GC>(st, r, g0, t0);
        }
    } else {
        values_g<T, NP, GC>(st, vrows, stride, n, g0);
    }
}

// Fold n <= kMaxBlock rows of K and V (`stride` elements apart) into the state.
template <typename T, int NP>
inline void attend_pairs(State& st, const T* krows, const T* vrows, int64_t stride, int n,
                         int G) {
    for (int pass = 0; pass < 2; ++pass) {  // scores of every query, then the weighted sums
        for (int g0 = 0; g0 < G; g0 += 3) {
            switch (G - g0 < 3 ? G - g0 : 3) {
                case 1: fold_g<T, NP, 1>(st, krows, vrows, stride, n, g0, pass == 0); break;
                case 2: fold_g<T, NP, 2>(st, krows, vrows, stride, n, g0, pass == 0); break;
                default: fold_g<T, NP, 3>(st, krows, vrows, stride, n, g0, pass == 0); break;
            }
        }
        if (pass == 0) softmax_block(st, n, G, 2 * NP);
    }
}

// Ask for the n rows (`bytes` each, `stride` elements apart) of K and V at krows, vrows, into
// L2 (measured on a Zen 4: into L1 the requests crowd out the block being read).
template <typename T>
inline void prefetch_rows(const T* krows, const T* vrows, int64_t stride, int n, int bytes) {
    for (int t = 0; t < n; ++t)
        for (int o = 0; o < bytes; o += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(krows + t * stride) + o, 0, 1);
            __builtin_prefetch(reinterpret_cast<const char*>(vrows + t * stride) + o, 0, 1);
        }
}

}  // namespace
