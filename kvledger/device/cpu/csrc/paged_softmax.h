// The online softmax of the paged-attention kernel (paged_attention.cpp; Milakov & Gimelshein,
// arXiv:1805.02867): the running state of one (query, kv head, part) item, the scores' softmax
// step per block, the probability-weighted sums of value rows, and one block of plain
// (fp32 / bf16) K and V folded into the state.
//
// Included by paged_attention.cpp only: everything is in an anonymous namespace, as in one
// translation unit.

#pragma once

#include <cmath>
#include <cstdint>

#include "paged_vec.h"

namespace {

// Running state of one (query, kv head, part) item: the group's scaled queries (qm: the same
// with the outlier key channels zeroed; qk: folded with one block's key scales), weighted
// sums, running max m and normaliser l, one block's scores, and the layer's logit soft-cap
// (cap > 0: every score s becomes cap tanh(s / cap) before the softmax; 0: none).
struct State {
    vec qf[kMaxGroup][kMaxDim / kLanes], acc[kMaxGroup][kMaxDim / kLanes];
    vec qm[kMaxGroup][kMaxDim / kLanes], qk[kMaxGroup][kMaxDim / kLanes];
    alignas(64) float s[kMaxGroup][kMaxBlock + kLanes];
    alignas(64) float w[kMaxGroup][kMaxBlock + kLanes];  // probabilities x a value scale
    float m[kMaxGroup], l[kMaxGroup];
    float cap;
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

// tanh, lane-wise, for |x| = a: (1 - e) / (1 + e) with e = exp(-2a) from a = 0.35 on (e <= 0.5,
// so the relative error stays that of exp_nonpos, < 2e-7), below it the Taylor series to a^13
// (the next term is under 3e-10).
inline vec tanh_vec(vec x) {
    const vec a = x < 0.f ? -x : x, a2 = a * a;
    const vec e = exp_nonpos(-2.f * a);
    const vec far = (1.f - e) / (1.f + e);
    vec p = vec{} + 21844.f / 6081075.f;
    p = p * a2 - 1382.f / 155925.f;
    p = p * a2 + 62.f / 2835.f;
    p = p * a2 - 17.f / 315.f;
    p = p * a2 + 2.f / 15.f;
    p = p * a2 - 1.f / 3.f;
    const vec near = a + a * a2 * p;
    const vec t = a < 0.35f ? near : far;
    return x < 0.f ? -t : t;
}

// Scores s[0..n) soft-capped (Gemma 2's attn_logit_softcapping): s -> cap tanh(s / cap), -inf
// kept (a row before a sliding window stays hidden). s has room for whole vectors past n.
inline void soft_cap(float* s, int n, float cap) {
    const float inv = 1.f / cap;
    vec* sv = reinterpret_cast<vec*>(s);
    for (int j = 0; j < (n + kLanes - 1) / kLanes; ++j) {
        const vec capped = cap * tanh_vec(sv[j] * inv);
        sv[j] = sv[j] == -INFINITY ? sv[j] : capped;
    }
}

// Online-softmax step over the n scores st.s[g][0..n) of a block (soft-capped first when
// st.cap > 0): new max, normaliser, the accumulators rescaled; the scores become
// exp(score - max).
inline void softmax_block(State& st, int n, int G, int nv) {
    const int nl = (n + kLanes - 1) / kLanes;  // score vectors; the tail lanes are -inf
    for (int g = 0; g < G; ++g) {
        if (st.cap > 0.f) soft_cap(st.s[g], n, st.cap);
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

}  // namespace
