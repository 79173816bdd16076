// Products of int8 activations with int8 or 4-bit weights for the few rows of a decode step
// (the "w8a8" and "w4a8" weight formats, kvledger/engine/linear.py): their C entry points.
//
// The pieces: int8_activations.h (the activations quantized per block of 32), gemv_tiles.h
// (threads, tiles and prefetch), w8a8_gemv.h and w4a8_gemv.h (each product, with its
// arithmetic and the AVX2 path).

#include <cstdint>

#include "gemv_tiles.h"
#include "int8_activations.h"
#include "w4a8_gemv.h"
#include "w8a8_gemv.h"

extern "C" {

// x: [rows, in] bf16 (raw bits); w: [out, in] int8 row-major; s: [out, in / 32] fp32; y: [rows,
// out] bf16.
// in must be a multiple of 32. threads: how many threads share the output rows (1: the caller
// only; ignored without OpenMP). scalar != 0 forces the plain loops even where AVX2 is built.
void kvl_w8a8_mm(const uint16_t* x, int rows, int in, const int8_t* w, const float* s, int out,
                 uint16_t* y, int threads, int scalar) {
    const bool vector = use_vector(scalar);
    const Quantized& a = quantize(x, rows, in, vector);
    split_rows(out, threads, [&](int o0, int o1) {
#if defined(__AVX2__)
        if (vector)
            return tiles(o0, o1, rows, false, [&](auto t, auto r, int o, int r0) {
                tile_avx2<decltype(t)::value, decltype(r)::value>(w, s, in, o, a, r0, y, out);
            });
#endif
        rows_scalar(w, s, in, o0, o1, a, 0, rows, y, out);
    });
}

// Grouped products (the routed experts of a mixture-of-experts layer, kvledger/model/
// experts.py): activation rows [starts[g], starts[g + 1]) times the weight of expert
// experts[g], whose codes [out, in] and scales [out, in / 32] start at table_w[e] and
// table_s[e] (addresses), for g in [0, groups); y [rows, out] as kvl_w8a8_mm. One call quantizes
// every row once and one thread team shares all groups' tiles of output rows, so k small
// products cost one parallel region, not k. Returns -1 (computing nothing) when an expert is
// outside [0, n_experts) or starts do not rise from 0 to rows, else 0.
int kvl_w8a8_mm_grouped(const uint16_t* x, int rows, int in, const int64_t* table_w,
                        const int64_t* table_s, int n_experts, const int64_t* experts,
                        const int64_t* starts, int groups, int out, uint16_t* y, int threads,
                        int scalar) {
    if (groups < 1 || starts[0] != 0 || starts[groups] != rows) return -1;
    for (int g = 0; g < groups; ++g)
        if (experts[g] < 0 || experts[g] >= n_experts || starts[g + 1] < starts[g]) return -1;
    const bool vector = use_vector(scalar);
    const Quantized& a = quantize(x, rows, in, vector);
    const int span = (out + TILE - 1) / TILE * TILE;  // one group's rows, in whole tiles
    split_rows(groups * span, threads, [&](int lo, int hi) {
        for (int g = lo / span; g < groups && g * span < hi; ++g) {
            const int o0 = lo > g * span ? lo - g * span : 0;
            const int o1 = hi - g * span < out ? hi - g * span : out;
            const int r0 = static_cast<int>(starts[g]), r1 = static_cast<int>(starts[g + 1]);
            const auto* w = reinterpret_cast<const int8_t*>(table_w[experts[g]]);
            const auto* s = reinterpret_cast<const float*>(table_s[experts[g]]);
            if (o0 >= o1 || r0 >= r1) continue;
#if defined(__AVX2__)
            if (vector) {
                tiles(o0, o1, r1 - r0, false, [&](auto t, auto r, int o, int rt) {
                    tile_avx2<decltype(t)::value, decltype(r)::value>(w, s, in, o, a, r0 + rt,
                                                                       y, out);
                });
                continue;
            }
#endif
            rows_scalar(w, s, in, o0, o1, a, r0, r1, y, out);
        }
    });
    return 0;
}

// As kvl_w8a8_mm with a Q4 weight repacked (w4a8_gemv.h): packed [ceil(out / 8), in / 32, 192]
// bytes. path: 0 the best built, 1 plain loops, 2 AVX2, 3 AVX-512 VNNI (kvl_w4a8_paths).
// Returns -1 (computing nothing) for a path not built here, else 0.
int kvl_w4a8_mm(const uint16_t* x, int rows, int in, const uint8_t* packed, int out,
                uint16_t* y, int threads, int path) {
    if (!q4_path_built(path)) return -1;
    const Quantized& a = quantize(x, rows, in, path != Q4_SCALAR && use_vector(0));
    split_units((out + Q4_ROWS - 1) / Q4_ROWS, threads, [&](int g0, int g1) {
        q4_groups(path, packed, in, g0, g1, a, rows, y, out);
    });
    return 0;
}

// Bit i set: path i of kvl_w4a8_mm is built here.
int kvl_w4a8_paths() {
    int mask = 0;
    for (int p = Q4_SCALAR; p <= Q4_VNNI; ++p)
        if (q4_path_built(p)) mask |= 1 << p;
    return mask;
}

}  // extern "C"
