// kvl_encode_int: quantize full KV blocks to int8 / int4 / int3 / int2 codes with fp16 scale and zero point
// and store them straight into the pool at their physical block ids, in one call instead of
// the ~20 PyTorch ops of IntCodec.encode + OutlierKeys.encode + the index_copy_ per field.
//
// The arithmetic is IntCodec.encode's, step for step, so the bytes are equal (tested):
//   lo, hi = min, max of a group (fp32); scale = fp16(max((hi - lo) / qmax, min_scale));
//   zero = fp16(lo); code = clamp(round_half_even((x - zero) / scale), 0, qmax)
// or, `centred` (levels at the centres of 2^bits equal bins): scale = fp16(max((hi - lo) /
//   (qmax + 1), min_scale)), zero = fp16(lo + scale / 2), the code as above
// with the divisions done as IEEE fp32 divisions and every fp32 -> fp16 conversion rounded to
// nearest even (the compiler's _Float16). A group is one channel over the block's tokens
// (per-channel keys, KIVI arXiv:2402.02750) or `group` consecutive channels of one token
// (per-token values). Packing as kvledger.engine.kv.codecs.pack: int4 channel 2i in the low
// nibble, 2i + 1 in the high one; int2 channel 4i + j at bits 2j of byte i; int3 channels
// 8i .. 8i + 7 in the 24-bit little-endian word of bytes 3i .. 3i + 2, channel 8i + j at 3j.
// Outlier channels (keys only): their values go to `outliers` as fp16 and they are quantized
// as zeros, as OutlierKeys.encode does.
//
// Layout (C order): x [n, bs, H, D] fp32 or bf16 bits (dtype 0 / 1); codes [blocks, bs, H,
// D * bits / 8]; scale, zero [blocks, H, D] (per-channel) or [blocks, bs, H, D / group];
// outlier_channels [H, num_outliers] int64; outliers [blocks, bs, H, num_outliers] fp16.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float load(const void* x, int dtype, int64_t i) {
    if (dtype == 0) return static_cast<const float*>(x)[i];
    uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t half_bits(float f, float* back) {
    const _Float16 h = static_cast<_Float16>(f);
    *back = static_cast<float>(h);
    uint16_t u;
    std::memcpy(&u, &h, 2);
    return u;
}

constexpr int kMaxBlock = 256, kMaxDim = 512;

}  // namespace

extern "C" int kvl_encode_int(const void* x, int dtype, int n, int bs, int H, int D, int bits,
                              int group, int centred, float min_scale,
                              const int64_t* block_ids,
                              uint8_t* codes, uint16_t* scale, uint16_t* zero,
                              const int64_t* outlier_channels, int num_outliers,
                              uint16_t* outliers) {
    if (bs > kMaxBlock || D > kMaxDim || (bits != 8 && bits != 4 && bits != 3 && bits != 2))
        return 1;
    const int qmax = (1 << bits) - 1;
    const int row_bytes = D * bits / 8;
    for (int b = 0; b < n; ++b) {
        const int64_t id = block_ids[b];
        uint8_t* cb = codes + id * bs * H * row_bytes;
        for (int h = 0; h < H; ++h) {
            // the block's values for this KV head, outlier channels zeroed (v), and codes (q)
            static thread_local float v[kMaxBlock][kMaxDim];
            static thread_local uint8_t q[kMaxBlock][kMaxDim];
            for (int t = 0; t < bs; ++t)
                for (int d = 0; d < D; ++d)
                    v[t][d] = load(x, dtype, ((static_cast<int64_t>(b) * bs + t) * H + h) * D + d);
            for (int j = 0; j < num_outliers; ++j) {
                const int64_t c = outlier_channels[h * num_outliers + j];
                for (int t = 0; t < bs; ++t) {
                    float unused;
                    outliers[((id * bs + t) * H + h) * num_outliers + j] = half_bits(v[t][c], &unused);
                    v[t][c] = 0.f;
                }
            }
            // one group: values v[t0 + i * ts][d0 + i * ds] for i < len
            auto quantize = [&](int t0, int d0, int ts, int ds, int len, int64_t meta) {
                float lo = v[t0][d0], hi = lo;
                for (int i = 1; i < len; ++i) {
                    const float e = v[t0 + i * ts][d0 + i * ds];
                    lo = e < lo ? e : lo;
                    hi = e > hi ? e : hi;
                }
                float s = (hi - lo) / static_cast<float>(qmax + (centred ? 1 : 0)), sf, zf;
                s = s < min_scale ? min_scale : s;
                scale[meta] = half_bits(s, &sf);
                zero[meta] = half_bits(centred ? lo + sf / 2.f : lo, &zf);
                for (int i = 0; i < len; ++i) {
                    float c = std::nearbyint((v[t0 + i * ts][d0 + i * ds] - zf) / sf);
                    c = c < 0.f ? 0.f : (c > qmax ? static_cast<float>(qmax) : c);
                    q[t0 + i * ts][d0 + i * ds] = static_cast<uint8_t>(c);
                }
            };
            if (group == 0) {
                for (int d = 0; d < D; ++d) quantize(0, d, 1, 0, bs, (id * H + h) * D + d);
            } else {
                const int groups = D / group;
                for (int t = 0; t < bs; ++t)
                    for (int k = 0; k < groups; ++k)
                        quantize(t, k * group, 0, 1, group, ((id * bs + t) * H + h) * groups + k);
            }
            for (int t = 0; t < bs; ++t) {
                uint8_t* row = cb + (static_cast<int64_t>(t) * H + h) * row_bytes;
                const uint8_t* c = q[t];
                if (bits == 8) {
                    std::memcpy(row, c, D);
                } else if (bits == 4) {
                    for (int i = 0; i < D / 2; ++i)
                        row[i] = static_cast<uint8_t>(c[2 * i] | (c[2 * i + 1] << 4));
                } else if (bits == 2) {
                    for (int i = 0; i < D / 4; ++i)
                        row[i] = static_cast<uint8_t>(c[4 * i] | (c[4 * i + 1] << 2) |
                                                      (c[4 * i + 2] << 4) | (c[4 * i + 3] << 6));
                } else {
                    for (int i = 0; i < D / 8; ++i) {
                        uint32_t w = 0;
                        for (int j = 0; j < 8; ++j) w |= static_cast<uint32_t>(c[8 * i + j]) << (3 * j);
                        row[3 * i] = static_cast<uint8_t>(w);
                        row[3 * i + 1] = static_cast<uint8_t>(w >> 8);
                        row[3 * i + 2] = static_cast<uint8_t>(w >> 16);
                    }
                }
            }
        }
    }
    return 0;
}
