// Products of bf16 activations with GGUF-quantized weights held as the file stores them (the
// "kquant" weight formats, kvledger/model/kquant.py), for the few rows of a decode step, and
// the weights dequantized to fp32 or bf16 for a prefill's GEMM: their C entry points.
//
// A weight is one or more row segments (the fused Q/K/V or gate/up of a layer may hold
// tensors of different types), each a row-major matrix of blocks of one GGML type: Q4_K, Q5_K,
// Q6_K (activations quantized to Q8_K, kquant_activations.h) or Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
// (activations quantized per 32 inputs, int8_activations.h). The arithmetic is in
// kquant_scalar.h; kquant_avx2.h and kquant_avx512.h (AVX-512 BW + VNNI) compute it with
// vectors. `isa` picks the path at run time (0 plain loops, 1 AVX2, 2 AVX-512), so the kernel
// probe can time each one the build has.
//
// Threads: every segment's rows are split into `threads` contiguous ranges, thread t taking
// range t of each segment, in one OpenMP parallel region (libgomp, torch's own pool; see
// gemv_tiles.h).

#include <cstdint>
#include <cstring>

#include "int8_activations.h"
#include "kquant_activations.h"
#include "kquant_avx2.h"
#include "kquant_avx512.h"
#include "kquant_blocks.h"
#include "kquant_scalar.h"

namespace {

constexpr int ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2;

int isa_mask() {
    int mask = 1 << ISA_SCALAR;
#if defined(__AVX2__)
    mask |= 1 << ISA_AVX2;
#endif
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    mask |= 1 << ISA_AVX512;
#endif
    return mask;
}

template <int R>
void dot(int isa, int type, const uint8_t* w, const Acts& a, int r0, float* out) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (isa == ISA_AVX512) return dot_avx512<R>(type, w, a, r0, out);
#endif
#if defined(__AVX2__)
    if (isa >= ISA_AVX2) return dot_avx2<R>(type, w, a, r0, out);
#endif
    (void)isa;
    dot_scalar<R>(type, w, a, r0, out);
}

inline int64_t row_bytes(int type, int in) {
    return static_cast<int64_t>(in / block_weights(type)) * block_bytes(type);
}

// Weight rows [o0, o1) of one segment with every activation row, into columns col + o of y.
void segment_rows(int isa, int type, const uint8_t* data, int o0, int o1, const Acts& a,
                  int rows, uint16_t* y, int out, int col) {
    for (int o = o0; o < o1; ++o) {
        const uint8_t* w = data + o * row_bytes(type, a.in);
        float v[4];
        int r = 0;
        auto put = [&](int n) {
            for (int i = 0; i < n; ++i)
                y[static_cast<int64_t>(r + i) * out + col + o] = f32_to_bf16(v[i]);
            r += n;
        };
        for (; r + 4 <= rows;) dot<4>(isa, type, w, a, r, v), put(4);
        for (; r + 2 <= rows;) dot<2>(isa, type, w, a, r, v), put(2);
        if (r < rows) dot<1>(isa, type, w, a, r, v), put(1);
    }
}

}  // namespace

extern "C" {

// Bitmask of the paths built (bit i: isa i), each one this CPU runs (-march=native).
int kvl_kquant_isas() { return isa_mask(); }

// Bytes of one block of a GGML type, 0 for a type these kernels do not take.
int kvl_kquant_block_bytes(int type) { return block_bytes(type); }

// x: [rows, in] bf16 (raw bits); segment s: types[s] (a GGML type id), data[s] its blocks
// [seg_rows[s], in / block weights] as the file stores them; y: [rows, out] bf16 with out the
// sum of seg_rows, segment s in the columns after the segments before it. in must be a whole
// number of blocks of every type (256 for a K-quant). isa: 0, 1, 2 (a path kvl_kquant_isas
// reports; another falls back to the best built below it).
void kvl_kquant_mm(const uint16_t* x, int rows, int in, int nseg, const int* types,
                   const uint8_t* const* data, const int* seg_rows, uint16_t* y, int threads,
                   int isa) {
    bool need_k = false, need_b = false;
    int out = 0;
    for (int s = 0; s < nseg; ++s) {
        (is_kquant(types[s]) ? need_k : need_b) = true;
        out += seg_rows[s];
    }
    const bool vector = isa >= ISA_AVX2;
    const Acts a{need_k ? &quantize_q8k(x, rows, in, vector) : nullptr,
                 need_b ? &quantize(x, rows, in, vector) : nullptr, in};
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; ++t) {
        int col = 0;
        for (int s = 0; s < nseg; ++s) {
            const int64_t n = seg_rows[s];
            segment_rows(isa, types[s], data[s], static_cast<int>(n * t / threads),
                         static_cast<int>(n * (t + 1) / threads), a, rows, y, out, col);
            col += seg_rows[s];
        }
    }
}

// w: [rows, in] fp32 (dtype 0) or bf16 (dtype 1, each weight rounded once to nearest even) of
// the blocks `data` [rows, in / block weights] of GGML type `type`, on `threads` threads.
void kvl_kquant_dequant(int type, const uint8_t* data, int rows, int in, void* w, int dtype,
                        int threads) {
    const int per = block_weights(type), nb = in / per;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int o = 0; o < rows; ++o) {
        float block[QK];
        for (int b = 0; b < nb; ++b) {
            dequantize_block(type, data + o * row_bytes(type, in) + b * block_bytes(type), block);
            const int64_t at = static_cast<int64_t>(o) * in + static_cast<int64_t>(b) * per;
            if (dtype == 0) {
                std::memcpy(static_cast<float*>(w) + at, block, sizeof(float) * per);
            } else {
                uint16_t* dst = static_cast<uint16_t*>(w) + at;
#pragma omp simd
                for (int i = 0; i < per; ++i) dst[i] = f32_to_bf16(block[i]);
            }
        }
    }
}

}  // extern "C"
