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
        rows_scalar(w, s, in, o0, o1, a, rows, y, out);
    });
}

// As kvl_w8a8_mm with a Q4 weight: qs [out, in / 2] uint8 (ggml block order), e and m
// [out, in / 32] fp32 (w = e * code + m).
void kvl_w4a8_mm(const uint16_t* x, int rows, int in, const uint8_t* qs, const float* e,
                 const float* m, int out, uint16_t* y, int threads, int scalar) {
    const bool vector = use_vector(scalar);
    const Quantized& a = quantize(x, rows, in, vector);
    const Q4Weight w{qs, e, m};
    split_rows(out, threads, [&](int o0, int o1) {
#if defined(__AVX2__)
        if (vector)
            return tiles(o0, o1, rows, true, [&](auto t, auto r, int o, int r0) {
                q4_tile_avx2<decltype(t)::value, decltype(r)::value>(w, in, o, a, r0, y, out);
            });
#endif
        q4_rows_scalar(w, in, o0, o1, a, rows, y, out);
    });
}

}  // extern "C"
