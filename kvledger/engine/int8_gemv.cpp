// Products of int8 activations with int8 or 4-bit weights for the few rows of a decode step
// (the "w8a8" and "w4a8" weight formats, kvledger/engine/linear.py). w8a8:
//
//   y[r, o] = sum_b s[o, b] * d[r, b] * sum_{i in block b} a[r, i] * w[o, i]
//
// with w [out, in] the symmetric int8 codes of the weight per block of 32 inputs and s
// [out, in / 32] their fp32 scales (w ~ codes * s: GGML's Q8_0 layout), and the activations x [rows, in] (bf16) quantized here, per row in
// blocks of 32, to a[r, i] = round(x[r, i] / d[r, b]) with d[r, b] = max_{i in b} |x[r, i]| / 127
// (the Q8_0 activation scheme of GGML/llama.cpp, described in its docs; not its code). Each block's
// integer dot product is exact in int32 (at most 32 * 127 * 127), scaled by s * d in fp32 and
// summed in fp32, and y is rounded to bf16.
//
// AVX2: the dot of a block is vpmaddubsw on (|a|, w * sign(a)) -- the unsigned x signed byte
// product, whose int16 pair sums (at most 2 * 127 * 127) cannot saturate -- then vpmaddwd with
// ones to int32, converted to fp32 and fused-multiply-added with s * d. Other CPUs (and the
// kvl_w8a8_mm `scalar` switch, so tests can compare both here) run the same arithmetic in plain
// loops; both paths quantize to identical codes and differ only in fp32 summation order.
//
// w4a8: a GGUF Q4_0 / Q4_1 weight as the file stores it, per block b of 32 inputs 4-bit codes
// c[o, i] in [0, 15] (16 bytes: byte j holds code j in its low nibble and code j + 16 in its high
// one, ggml's block_q4_1 order) with a scale e[o, b] and a minimum m[o, b] (w = e * c + m; Q4_0
// is m = -8 e), times the same int8 activations:
//
//   y[r, o] = sum_b e[o, b] d[r, b] sum_{i in b} c[o, i] a[r, i]  +  sum_b m[o, b] d[r, b] A[r, b]
//
// with A[r, b] = sum_{i in b} a[r, i] (exact in int32), the scheme of llama.cpp's Q4_1 x Q8_1 dot
// product (no weight rounding beyond the file's). AVX2: the codes are unsigned, so vpmaddubsw
// takes them as they are (pair sums at most 2 * 15 * 127).
//
// Threads: output rows are split into `threads` contiguous ranges with an OpenMP parallel loop.
// Built with -fopenmp, the library needs libgomp.so.1, the soname of the OpenMP runtime that
// PyTorch loads first, so these loops run on the same thread pool as torch's own intra-op loops
// (no second pool competing for the cores).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int BLOCK = 32;
constexpr int TILE = 4;  // weight rows per tile: each activation block is loaded once per tile
// A tile prefetches the weight rows (and scales) of the tile this many tiles ahead, a slice per
// block, so the bytes a decode step streams from memory arrive while earlier rows are computed
// (one row of a GEMV is too short for the hardware prefetcher to run ahead of it).
constexpr int PREFETCH_TILES = 2;

inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// Activations of one call, quantized: codes q, their magnitudes |q| (the unsigned operand of
// vpmaddubsw) and the block scales d.
struct Quantized {
    std::vector<int8_t> q;
    std::vector<uint8_t> mag;
    std::vector<float> d;
    std::vector<float> sum;  // d[r, b] * A[r, b] (w4a8's minimum term)
};

// One row of n (a multiple of BLOCK) bf16 values. inv = 127 / amax is computed the same way on
// both paths and rounding is to nearest even on both, so the codes are identical.
void quantize_row_scalar(const uint16_t* x, int n, int8_t* q, uint8_t* mag, float* d,
                         float* sum) {
    for (int b = 0; b < n / BLOCK; ++b) {
        int32_t total = 0;
        float amax = 0.f;
        for (int i = 0; i < BLOCK; ++i)
            amax = std::fmax(amax, std::fabs(bf16_to_f32(x[b * BLOCK + i])));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = amax / 127.f;
        for (int i = 0; i < BLOCK; ++i) {
            const float v = std::nearbyint(bf16_to_f32(x[b * BLOCK + i]) * inv);
            const int c = static_cast<int>(std::fmax(-127.f, std::fmin(127.f, v)));
            q[b * BLOCK + i] = static_cast<int8_t>(c);
            mag[b * BLOCK + i] = static_cast<uint8_t>(c < 0 ? -c : c);
            total += c;
        }
        sum[b] = d[b] * static_cast<float>(total);
    }
}

// Dot products of weight rows [o0, o1) with every activation row, plain loops.
void rows_scalar(const int8_t* w, const float* s, int in, int o0, int o1, const Quantized& a,
                 int rows, uint16_t* y, int out) {
    const int nb = in / BLOCK;
    for (int o = o0; o < o1; ++o) {
        const int8_t* wr = w + static_cast<int64_t>(o) * in;
        for (int r = 0; r < rows; ++r) {
            const int8_t* ar = a.q.data() + static_cast<int64_t>(r) * in;
            float acc = 0.f;
            for (int b = 0; b < nb; ++b) {
                int32_t dot = 0;
                for (int i = b * BLOCK; i < (b + 1) * BLOCK; ++i) dot += int32_t(ar[i]) * wr[i];
                acc += s[int64_t(o) * nb + b] * a.d[static_cast<int64_t>(r) * nb + b] *
                       static_cast<float>(dot);
            }
            y[static_cast<int64_t>(r) * out + o] = f32_to_bf16(acc);
        }
    }
}

// Q4 blocks of a w4a8 weight (see the header): codes qs [out, in / 2], scales e and minima m
// [out, in / 32].
struct Q4Weight {
    const uint8_t* qs;
    const float* e;
    const float* m;
};

// The w4a8 products of weight rows [o0, o1) with every activation row, plain loops.
void q4_rows_scalar(const Q4Weight& w, int in, int o0, int o1, const Quantized& a, int rows,
                    uint16_t* y, int out) {
    const int nb = in / BLOCK;
    for (int o = o0; o < o1; ++o) {
        const uint8_t* qr = w.qs + static_cast<int64_t>(o) * in / 2;
        for (int r = 0; r < rows; ++r) {
            const int8_t* ar = a.q.data() + static_cast<int64_t>(r) * in;
            const float* dr = a.d.data() + static_cast<int64_t>(r) * nb;
            float acc = 0.f;
            for (int b = 0; b < nb; ++b) {
                int32_t dot = 0;
                for (int j = 0; j < BLOCK / 2; ++j) {
                    const uint8_t byte = qr[b * BLOCK / 2 + j];
                    dot += int32_t(byte & 0x0F) * ar[b * BLOCK + j];
                    dot += int32_t(byte >> 4) * ar[b * BLOCK + j + BLOCK / 2];
                }
                acc += w.e[int64_t(o) * nb + b] * dr[b] * static_cast<float>(dot);
            }
            float low = 0.f;
            for (int b = 0; b < nb; ++b)
                low += w.m[int64_t(o) * nb + b] * a.sum[int64_t(r) * nb + b];
            y[static_cast<int64_t>(r) * out + o] = f32_to_bf16(acc + low);
        }
    }
}

#if defined(__AVX2__)

inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

inline __m256i load32(const void* p) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// 32 bf16 -> 4 x 8 fp32 (in order).
inline void load_bf16x32(const uint16_t* x, __m256 v[4]) {
    for (int k = 0; k < 4; ++k) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * k));
        v[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
}

inline int32_t hsum_i32(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
    return _mm_cvtsi128_si32(x);
}

void quantize_row_avx2(const uint16_t* x, int n, int8_t* q, uint8_t* mag, float* d,
                       float* sum) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < n / BLOCK; ++b) {
        __m256 v[4];
        load_bf16x32(x + b * BLOCK, v);
        for (int k = 0; k < 4; ++k) v[k] = _mm256_and_ps(v[k], abs_mask);  // |x| for the max
        const __m256 m = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = amax / 127.f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i c[4];
        load_bf16x32(x + b * BLOCK, v);  // again, signed
        for (int k = 0; k < 4; ++k) c[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vinv));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]),
                                               _mm256_add_epi32(c[2], c[3]));
        sum[b] = d[b] * static_cast<float>(hsum_i32(total));
        // pack 32 int32 -> 32 int8 (saturating; |c| <= 127 anyway), then undo the lane interleave
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                             _mm256_packs_epi32(c[2], c[3]));
        const __m256i codes = _mm256_permutevar8x32_epi32(p, order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * BLOCK), codes);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(mag + b * BLOCK), _mm256_abs_epi8(codes));
    }
}

// Hint that the n bytes at p (n <= 128) will be read soon; a prefetch past an array's end is
// ignored by the CPU, never a fault.
inline void prefetch(const void* p, int n) {
    const char* c = static_cast<const char*>(p);
    _mm_prefetch(c, _MM_HINT_T0);
    if (n > 64) _mm_prefetch(c + 64, _MM_HINT_T0);
}

// acc[t][r] += s[o + t, b] d[r, b] (block b of weight row t) . (block b of activation row r),
// T weight rows by R activation rows at a time.
template <int T, int R>
void tile_avx2(const int8_t* w, const float* s, int in, int o, const Quantized& a, int r0,
               uint16_t* y, int out) {
    const int nb = in / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[T][R];
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
    const int8_t* wr = w + static_cast<int64_t>(o) * in;
    const int64_t ahead = static_cast<int64_t>(PREFETCH_TILES) * T;
    for (int b = 0; b < nb; ++b) {
        prefetch(wr + ahead * in + static_cast<int64_t>(b) * T * BLOCK, T * BLOCK);
        prefetch(s + (o + ahead) * nb + b * T, T * 4);
        __m256i wv[T];
        float e[T];
        for (int t = 0; t < T; ++t) {
            wv[t] = load32(wr + static_cast<int64_t>(t) * in + b * BLOCK);
            e[t] = s[static_cast<int64_t>(o + t) * nb + b];
        }
        for (int r = 0; r < R; ++r) {
            const int64_t at = static_cast<int64_t>(r0 + r) * in + b * BLOCK;
            const __m256i q = load32(a.q.data() + at);
            const __m256i mag = load32(a.mag.data() + at);
            const float d = a.d[static_cast<int64_t>(r0 + r) * nb + b];
            for (int t = 0; t < T; ++t) {
                const __m256i p16 = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(wv[t], q));
                const __m256i p32 = _mm256_madd_epi16(p16, ones);
                acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(e[t] * d),
                                            acc[t][r]);
            }
        }
    }
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r)
            y[static_cast<int64_t>(r0 + r) * out + o + t] = f32_to_bf16(hsum(acc[t][r]));
}

// 16 bytes of a Q4 block -> its 32 codes in input order (low nibbles, then high nibbles).
inline __m256i unpack_q4(const uint8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// w4a8 for T weight rows by R activation rows (the arithmetic of q4_rows_scalar).
template <int T, int R>
void q4_tile_avx2(const Q4Weight& w, int in, int o, const Quantized& a, int r0, uint16_t* y,
                  int out) {
    const int nb = in / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[T][R];
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
    const int64_t ahead = static_cast<int64_t>(PREFETCH_TILES) * T;
    for (int b = 0; b < nb; ++b) {
        prefetch(w.qs + (o + ahead) * in / 2 + static_cast<int64_t>(b) * T * BLOCK / 2,
                 T * BLOCK / 2);
        prefetch(w.e + (o + ahead) * nb + b * T, T * 4);
        prefetch(w.m + (o + ahead) * nb + b * T, T * 4);
        __m256i wv[T];
        float e[T];
        for (int t = 0; t < T; ++t) {
            wv[t] = unpack_q4(w.qs + static_cast<int64_t>(o + t) * in / 2 + b * BLOCK / 2);
            e[t] = w.e[static_cast<int64_t>(o + t) * nb + b];
        }
        for (int r = 0; r < R; ++r) {
            const int64_t at = static_cast<int64_t>(r0 + r) * in + b * BLOCK;
            const __m256i q = load32(a.q.data() + at);
            const float d = a.d[static_cast<int64_t>(r0 + r) * nb + b];
            for (int t = 0; t < T; ++t) {
                const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[t], q), ones);
                acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(e[t] * d),
                                            acc[t][r]);
            }
        }
    }
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) {
            float low = 0.f;
            const float* m = w.m + static_cast<int64_t>(o + t) * nb;
            const float* sum = a.sum.data() + static_cast<int64_t>(r0 + r) * nb;
            for (int b = 0; b < nb; ++b) low += m[b] * sum[b];
            y[static_cast<int64_t>(r0 + r) * out + o + t] = f32_to_bf16(hsum(acc[t][r]) + low);
        }
}

template <int N>
using Int = std::integral_constant<int, N>;

// tile(Int<T>, Int<R>, o, r) over weight rows [o0, o1) x activation rows [0, rows): tiles of
// TILE x 2 weight x activation rows (or, with `wide` and from 4 activation rows on, 2 x 4: a
// weight block then serves 4 rows, in 8 accumulators), then the remainders. A row's arithmetic
// does not depend on its tile.
template <class Tile>
void tiles(int o0, int o1, int rows, bool wide, Tile tile) {
    int o = o0;
    if (wide && rows >= 4)
        for (; o + 2 <= o1; o += 2) {
            int r = 0;
            for (; r + 4 <= rows; r += 4) tile(Int<2>{}, Int<4>{}, o, r);
            for (; r + 2 <= rows; r += 2) tile(Int<2>{}, Int<2>{}, o, r);
            if (r < rows) tile(Int<2>{}, Int<1>{}, o, r);
        }
    auto all_rows = [&](auto t, int at) {
        int r = 0;
        for (; r + 2 <= rows; r += 2) tile(t, Int<2>{}, at, r);
        if (r < rows) tile(t, Int<1>{}, at, r);
    };
    for (; o + TILE <= o1; o += TILE) all_rows(Int<TILE>{}, o);
    for (; o < o1; ++o) all_rows(Int<1>{}, o);
}

#endif

bool use_vector(int scalar) {
#if defined(__AVX2__)
    return scalar == 0;
#else
    (void)scalar;
    return false;
#endif
}

// The activations x [rows, in] quantized into this thread's buffers.
const Quantized& quantize(const uint16_t* x, int rows, int in, bool vector) {
    thread_local Quantized a;
    const int nb = in / BLOCK;
    a.q.resize(static_cast<size_t>(rows) * in);
    a.mag.resize(static_cast<size_t>(rows) * in);
    a.d.resize(static_cast<size_t>(rows) * nb);
    a.sum.resize(static_cast<size_t>(rows) * nb);
    for (int r = 0; r < rows; ++r) {
        const int64_t at = static_cast<int64_t>(r) * in, bt = static_cast<int64_t>(r) * nb;
#if defined(__AVX2__)
        if (vector) {
            quantize_row_avx2(x + at, in, a.q.data() + at, a.mag.data() + at, a.d.data() + bt,
                              a.sum.data() + bt);
            continue;
        }
#endif
        quantize_row_scalar(x + at, in, a.q.data() + at, a.mag.data() + at, a.d.data() + bt,
                            a.sum.data() + bt);
    }
    return a;
}

// rows_fn(o0, o1) over contiguous ranges of whole tiles of the out rows, one range per thread.
template <class Fn>
void split_rows(int out, int threads, Fn rows_fn) {
    const int tiles = (out + TILE - 1) / TILE;
    if (threads < 1) threads = 1;
    if (threads > tiles) threads = tiles;
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; ++t) {
        const int o0 = static_cast<int>(static_cast<int64_t>(tiles) * t / threads) * TILE;
        int o1 = static_cast<int>(static_cast<int64_t>(tiles) * (t + 1) / threads) * TILE;
        if (o1 > out) o1 = out;
        rows_fn(o0, o1);
    }
}

}  // namespace

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

// Whether kvl_w8a8_mm and kvl_w4a8_mm were built with their AVX2 path (1) or only the plain
// loops (0).
int kvl_w8a8_vector() { return use_vector(0) ? 1 : 0; }

}  // extern "C"
