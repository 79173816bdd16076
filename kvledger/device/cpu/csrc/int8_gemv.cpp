// Products of int8 activations with int8 or 4-bit weights for the few rows of a decode step
// (the "w8a8" and "w4a8" weight formats, kvledger/model/linear.py): their C entry points.
//
// The pieces: int8_activations.h (the activations quantized per block of 32), gemv_tiles.h
// (threads and prefetch), interleaved_gemv.h (both products on their repacked weights, with
// their arithmetic and the AVX2 and AVX-512 VNNI paths).

#include <cstdint>

#include "gemv_tiles.h"
#include "int8_activations.h"
#include "interleaved_gemv.h"

namespace {

// y = x W^T for a weight of format F repacked (interleaved_gemv.h); see kvl_w8a8_mm.
template <class F>
int product(const uint16_t* x, int rows, int in, const uint8_t* packed, int out, uint16_t* y,
            int threads, int path) {
    if (!path_built(path)) return -1;
    path = best_path(path);
    const Quantized& a = quantize(x, rows, in, path != SCALAR && use_vector(0));
    split_units((out + ROWS - 1) / ROWS, threads, [&](int g0, int g1) {
        groups<F>(path, packed, in, g0, g1, a, 0, rows, y, out);
    });
    return 0;
}

}  // namespace

extern "C" {

// x: [rows, in] bf16 (raw bits); packed: the weight [out, in] repacked (interleaved_gemv.h;
// [ceil(out / 8), in / 32, 288] bytes: int8 codes, fp32 scales); y: [rows, out] bf16. in must be
// a multiple of 32. threads: how many threads share the output rows (1: the caller only;
// ignored without OpenMP). path: 0 the best built, 1 plain loops, 2 AVX2, 3 AVX-512 VNNI
// (kvl_int8_paths). Returns -1 (computing nothing) for a path not built here, else 0.
int kvl_w8a8_mm(const uint16_t* x, int rows, int in, const uint8_t* packed, int out, uint16_t* y,
                int threads, int path) {
    return product<Int8Codes>(x, rows, in, packed, out, y, threads, path);
}

// As kvl_w8a8_mm with a Q4 weight repacked: [ceil(out / 8), in / 32, 192] bytes (codes, fp32
// scales and minima).
int kvl_w4a8_mm(const uint16_t* x, int rows, int in, const uint8_t* packed, int out, uint16_t* y,
                int threads, int path) {
    return product<Nibble4Codes>(x, rows, in, packed, out, y, threads, path);
}

// Bit i set: path i of kvl_w8a8_mm and kvl_w4a8_mm is built here.
int kvl_int8_paths() {
    int mask = 0;
    for (int p = SCALAR; p <= VNNI; ++p)
        if (path_built(p)) mask |= 1 << p;
    return mask;
}

// Grouped w8a8 products (the routed experts of a mixture-of-experts layer, kvledger/model/
// experts.py): activation rows [starts[g], starts[g + 1]) times the weight of expert
// experts[g], repacked as kvl_w8a8_mm's and starting at table[e] (an address), for g in
// [0, groups); y [rows, out] as kvl_w8a8_mm. One call quantizes every row once and one thread
// team shares all groups' 8-row groups, so k small products cost one parallel region, not k.
// Returns -1 (computing nothing) when an expert is outside [0, n_experts), starts do not rise
// from 0 to rows or the path is not built, else 0.
int kvl_w8a8_mm_grouped(const uint16_t* x, int rows, int in, const int64_t* table,
                        int n_experts, const int64_t* experts, const int64_t* starts, int groups_,
                        int out, uint16_t* y, int threads, int path) {
    if (groups_ < 1 || starts[0] != 0 || starts[groups_] != rows || !path_built(path)) return -1;
    for (int g = 0; g < groups_; ++g)
        if (experts[g] < 0 || experts[g] >= n_experts || starts[g + 1] < starts[g]) return -1;
    path = best_path(path);
    const Quantized& a = quantize(x, rows, in, path != SCALAR && use_vector(0));
    const int span = (out + ROWS - 1) / ROWS;  // one expert's 8-row groups
    split_units(groups_ * span, threads, [&](int lo, int hi) {
        for (int g = lo / span; g < groups_ && g * span < hi; ++g) {
            const int g0 = lo > g * span ? lo - g * span : 0;
            const int g1 = hi - g * span < span ? hi - g * span : span;
            const int r0 = static_cast<int>(starts[g]), r1 = static_cast<int>(starts[g + 1]);
            if (g0 >= g1 || r0 >= r1) continue;
            const auto* packed = reinterpret_cast<const uint8_t*>(table[experts[g]]);
            groups<Int8Codes>(path, packed, in, g0, g1, a, r0, r1, y, out);
        }
    });
    return 0;
}

}  // extern "C"
