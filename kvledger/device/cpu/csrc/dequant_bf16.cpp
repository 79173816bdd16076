// A weight of the "w4a8" or "w8a8" format (kvledger/model/linear.py), repacked
// (interleaved_gemv.h), written out as a dense
// bf16 matrix, for the bf16 GEMM that a prefill chunk's many rows take (oneDNN through
// F.linear): the int8 kernels of int8_gemv.cpp are made for the few rows of a decode step.
//
// Each weight is computed in fp32 exactly as the fp32 path does (w4a8: e * code + m; w8a8:
// code * s) and rounded once to bf16, to nearest even (the rounding of torch's
// Tensor.to(torch.bfloat16); the weights are finite, so NaN needs no case). Output rows are
// split over `threads` threads with an OpenMP loop (libgomp, torch's own pool: see
// gemv_tiles.h).

#include <cstdint>
#include <cstring>

namespace {

constexpr int BLOCK = 32;  // weights per scale (GGML's Q4_0 / Q4_1 / Q8_0 blocks)

inline uint16_t bf16_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <class Row>
void each_row(int out, int threads, Row row) {
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int o = 0; o < out; ++o) row(o);
}

}  // namespace

extern "C" {

// packed: a Q4 weight repacked for the w4a8 product (interleaved_gemv.h: groups of 8 rows, a
// 192-byte record per group and block: 8 x 16 code bytes interleaved 4 bytes at a time, then
// e[8] and m[8] fp32); w: [out, in] bf16 (raw bits), w = e * code + m. in must be a multiple of
// 32.
void kvl_q4_dequant_bf16(const uint8_t* packed, int out, int in, uint16_t* w, int threads) {
    constexpr int ROWS = 8, CODES = ROWS * BLOCK / 2, RECORD = CODES + 2 * ROWS * 4;
    const int blocks = in / BLOCK;
    each_row(out, threads, [&](int o) {
        const int g = o / ROWS, t = o % ROWS;
        for (int b = 0; b < blocks; ++b) {
            const uint8_t* rec = packed + (static_cast<int64_t>(g) * blocks + b) * RECORD;
            float scale, low;
            std::memcpy(&scale, rec + CODES + 4 * t, 4);
            std::memcpy(&low, rec + CODES + 4 * ROWS + 4 * t, 4);
            uint16_t* dst = w + static_cast<int64_t>(o) * in + b * BLOCK;
            for (int i = 0; i < BLOCK / 2; ++i) {
                const uint8_t byte = rec[32 * (i / 4) + 4 * t + i % 4];
                dst[i] = bf16_bits(scale * static_cast<float>(byte & 0x0F) + low);
                dst[i + BLOCK / 2] = bf16_bits(scale * static_cast<float>(byte >> 4) + low);
            }
        }
    });
}

// packed: an int8 weight repacked for the w8a8 product (interleaved_gemv.h: groups of 8 rows, a
// 288-byte record per group and block: 8 x 32 codes interleaved 4 at a time, then s[8] fp32);
// w: [out, in] bf16 (raw bits), w = code * s. in must be a multiple of 32.
void kvl_q8_dequant_bf16(const uint8_t* packed, int out, int in, uint16_t* w, int threads) {
    constexpr int ROWS = 8, CODES = ROWS * BLOCK, RECORD = CODES + ROWS * 4;
    const int blocks = in / BLOCK;
    each_row(out, threads, [&](int o) {
        const int g = o / ROWS, t = o % ROWS;
        for (int b = 0; b < blocks; ++b) {
            const uint8_t* rec = packed + (static_cast<int64_t>(g) * blocks + b) * RECORD;
            float scale;
            std::memcpy(&scale, rec + CODES + 4 * t, 4);
            uint16_t* dst = w + static_cast<int64_t>(o) * in + b * BLOCK;
            for (int i = 0; i < BLOCK; ++i) {
                const auto code = static_cast<int8_t>(rec[32 * (i / 4) + 4 * t + i % 4]);
                dst[i] = bf16_bits(static_cast<float>(code) * scale);
            }
        }
    });
}

}  // extern "C"
