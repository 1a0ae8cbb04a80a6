// gguf_linear: y = x W^T (+ b) over a weight kept in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), its rows [N, row bytes] repacked at load (gguf_repack)
// from the file's layout into the format's lanes layout, the only one the products read.
// gguf_linear_parts: the same over a packed layer whose projections differ in format, each part's
// rows in its own, in one call (x quantized once, one parallel region over every part's rows).
// gguf_dequantize: rows of either layout to fp32 (an embedding's looked-up rows; tests).
//
// Every step multiplies as llama.cpp does, in integers: each row of x is quantized once to blocks
// of 32 with an fp32 scale (and its sum, for the formats with an offset), and each 32 values of a
// weight row, widened to 16-bit integers, meet it in integer dot products scaled in fp32 by both
// blocks' scales. x takes the bits its caller asks for (activation_bits): 16, or 8 (the caller's
// choice by the layer's types and role, layers/quantization/cpu_gguf.py), on which both kernels
// multiply bytes where the format says its values fit one (kByteProducts: Q4_0, Q4_K, Q5_K, Q6_K).
// A few rows of x (decode) stream each weight row from its blocks once (streaming_linear): the
// weight leaves memory once at its own size (0.56-1.06 bytes a value), the point of a quantized
// file on a CPU. Many rows (prefill, a batch) decode blocks of weight rows into cache and tile
// them against x (tiled_linear), with the same arithmetic for each output element in the same
// order (RowSums), so that a row's result is the same bits whatever else shares its step: a
// weight pair or quad of bytes broadcast against 16 rows of x (vector_tile), or in the `amx`
// variant AMX-INT8 tiles (amx_tile), give the integer sums, the rest as RowSums has it.

#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace nanovllm_cpu {
namespace {

using simd::Bytes;
using simd::Words;
using simd::Vec8;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return simd::half_to_float(h);
}

// Each format as the kernels see it: a block of kValues values in kBytes bytes, visited as chunks
// of 32 values: visit(chunk, q, scale, offset) where value j of the chunk is q[j] * scale + offset,
// the scale one for the chunk or, where kScalePer16, one per 16 values (lanes 0-3 and 4-7 of the
// Vec8), and the offset 0 where not kOffset. kType is the GGML type id. The layouts are ggml's
// (gguf-py's quants.py reads them the same way).
// A block's fp16 scales are read four bytes at a time (two_halves_at: one load and one
// conversion, not one of each per value); where a block has one, the other half is its first
// quantized bytes, unused.

struct Q8_0 {
  static constexpr int kType = 8, kValues = 32, kBytes = 34;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = false;
  static constexpr bool kWholeRow = false;
  // For the Lanes layout: a chunk's scale bytes, and a group's quad j from its values.
  static constexpr int kScaleBytes = 2, kFifthBitBytes = 0;
  static constexpr float kZeroPoint = 0.0f;  // what a value less it is scaled by d, with no minimum
  static simd::Quad quad(const uint8_t* values, int j) { return simd::byte_quad(values + 64 * j); }
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    visit(c, simd::byte_words(b + 2), simd::set1_8(simd::two_halves_at(b).first), 0.0f);
  }
};

struct Q4_0 {
  static constexpr int kType = 2, kValues = 32, kBytes = 18;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = false;
  static constexpr int kScaleBytes = 2, kFifthBitBytes = 0;
  static constexpr float kZeroPoint = 8.0f;
  static constexpr int kByteMax = 15, kByteBias = 0;  // the byte tiles' weights (ByteProducts)
  static simd::Quad quad(const uint8_t* values, int j) { return simd::nibble_quad(values + 32 * j); }
  static simd::ByteQuad byte_quad(const uint8_t* values, int j) { return simd::nibble_byte_quad(values + 32 * j); }
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    const float d = simd::two_halves_at(b).first;
    visit(c, simd::nibble_words(b + 2), simd::set1_8(d), -kZeroPoint * d);
  }
};

struct Q4_1 {
  static constexpr int kType = 3, kValues = 32, kBytes = 20;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = false;
  static constexpr int kScaleBytes = 4, kFifthBitBytes = 0;  // the scale, then the minimum
  static constexpr float kZeroPoint = 0.0f;
  static simd::Quad quad(const uint8_t* values, int j) { return simd::nibble_quad(values + 32 * j); }
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    const auto [d, m] = simd::two_halves_at(b);
    visit(c, simd::nibble_words(b + 4), simd::set1_8(d), m);
  }
};

// Five-bit values: d (fp16; Q5_1's minimum after it), the values' fifth bits (32 bits, value j's in
// bit j), then 16 bytes of their low four bits as Q4_0's. In a lanes group the fifth bits follow the
// four nibble quads, 32 bytes whose words carry the sixteen vectors' bits (simd::five_bit_quad).
struct Q5_0 {
  static constexpr int kType = 6, kValues = 32, kBytes = 22;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = false;
  static constexpr int kScaleBytes = 2, kFifthBitBytes = 4;
  static constexpr float kZeroPoint = 16.0f;
  static simd::Quad quad(const uint8_t* values, int j) { return simd::five_bit_quad(values + 32 * j, values + 128, j); }
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    const float d = simd::two_halves_at(b).first;
    visit(c, simd::five_bit_words(b + 2, b + 6), simd::set1_8(d), -kZeroPoint * d);
  }
};

struct Q5_1 {
  static constexpr int kType = 7, kValues = 32, kBytes = 24;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = false;
  static constexpr int kScaleBytes = 4, kFifthBitBytes = 4;
  static constexpr float kZeroPoint = 0.0f;
  static simd::Quad quad(const uint8_t* values, int j) { return simd::five_bit_quad(values + 32 * j, values + 128, j); }
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    const auto [d, m] = simd::two_halves_at(b);
    visit(c, simd::five_bit_words(b + 4, b + 8), simd::set1_8(d), m);
  }
};

// 256 values: d, dmin (fp16), 8 six-bit scales and mins packed in 12 bytes, then 128 bytes whose
// low nibbles are chunk 2j and high nibbles chunk 2j+1 for each 32 bytes j.
struct Q4_K {
  static constexpr int kType = 12, kValues = 256, kBytes = 144;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = false;
  static std::pair<int, int> scale_min(const uint8_t* s, int j) {
    if (j < 4) return {s[j] & 63, s[j + 4] & 63};
    return {(s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)};
  }
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    const auto [d, dmin] = simd::two_halves_at(b);
    const uint8_t* scales = b + 4;
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 4; j++) {
      const auto [sc0, m0] = scale_min(scales, 2 * j);
      const auto [sc1, m1] = scale_min(scales, 2 * j + 1);
      visit(c + 2 * j, simd::low_nibble_words(qs + 32 * j), simd::set1_8(d * sc0), -dmin * m0);
      visit(c + 2 * j + 1, simd::high_nibble_words(qs + 32 * j), simd::set1_8(d * sc1), -dmin * m1);
    }
  }
};

// 256 values of 5 bits: d, dmin and the sub-blocks' scales and minimums as Q4_K's, then 32 bytes
// of fifth bits (value l of sub-block c in bit c of byte l), then 128 bytes of low four bits as Q4_K's.
struct Q5_K {
  static constexpr int kType = 13, kValues = 256, kBytes = 176;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = false;
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    const auto [d, dmin] = simd::two_halves_at(b);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    for (int j = 0; j < 4; j++) {
      const auto [sc0, m0] = Q4_K::scale_min(scales, 2 * j);
      const auto [sc1, m1] = Q4_K::scale_min(scales, 2 * j + 1);
      visit(c + 2 * j, simd::fifth_bits(simd::low_nibble_words(qs + 32 * j), qh, 2 * j), simd::set1_8(d * sc0), -dmin * m0);
      visit(c + 2 * j + 1, simd::fifth_bits(simd::high_nibble_words(qs + 32 * j), qh, 2 * j + 1), simd::set1_8(d * sc1),
            -dmin * m1);
    }
  }
};

// 256 values of 6 bits: low nibbles in ql[128], the top two bits in qh[64], 16 int8 scales (one
// per 16 values), then d (fp16). Each half of 128 values reads 64 bytes of ql and 32 of qh.
struct Q6_K {
  static constexpr int kType = 14, kValues = 256, kBytes = 210;
  static constexpr bool kScalePer16 = true;
  static constexpr bool kOffset = false;
  static constexpr bool kWholeRow = false;
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; h++) {
      const Bytes lo_a = simd::load_bytes(b + 64 * h), lo_b = simd::load_bytes(b + 64 * h + 32);
      const Bytes hi = simd::load_bytes(b + 128 + 32 * h);
      const int8_t* s = sc + 8 * h;
      const int64_t ch = c + 4 * h;
      visit(ch, simd::widen(simd::join_nibbles(simd::bits(lo_a, 0, 0x0f), simd::bits(hi, 0, 3), 32)),
            simd::halves(d * s[0], d * s[1]), 0.0f);
      visit(ch + 1, simd::widen(simd::join_nibbles(simd::bits(lo_b, 0, 0x0f), simd::bits(hi, 2, 3), 32)),
            simd::halves(d * s[2], d * s[3]), 0.0f);
      visit(ch + 2, simd::widen(simd::join_nibbles(simd::bits(lo_a, 4, 0x0f), simd::bits(hi, 4, 3), 32)),
            simd::halves(d * s[4], d * s[5]), 0.0f);
      visit(ch + 3, simd::widen(simd::join_nibbles(simd::bits(lo_b, 4, 0x0f), simd::bits(hi, 6, 3), 32)),
            simd::halves(d * s[6], d * s[7]), 0.0f);
    }
  }
};

// The non-linear 4-bit formats' sixteen values (ggml's kvalues_iq4nl, -127 to 113) plus 128: the
// kernels decode an index to this unsigned byte, and the -128 comes back as an offset of -128 d.
inline constexpr uint8_t kIq4Values[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// 32 non-linear 4-bit values: d (fp16), then 16 bytes of indices laid out as Q4_0's nibbles.
struct IQ4_NL {
  static constexpr int kType = 20, kValues = 32, kBytes = 18;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = false;
  static constexpr int kScaleBytes = 2, kFifthBitBytes = 0;
  static constexpr float kZeroPoint = 128.0f;
  static simd::Quad quad(const uint8_t* values, int j) { return simd::look_up(simd::nibble_quad(values + 32 * j), kIq4Values); }
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    const float d = simd::two_halves_at(b).first;
    visit(c, simd::look_up(simd::nibble_words(b + 2), kIq4Values), simd::set1_8(d), -kZeroPoint * d);
  }
};

// 256 non-linear 4-bit values: d (fp16), the eight sub-blocks' 6-bit scales (less 32) as their
// top two bits (16 bits) and low four (4 bytes), then each sub-block's indices as IQ4_NL's.
struct IQ4_XS {
  static constexpr int kType = 23, kValues = 256, kBytes = 136;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = false;
  static int scale(const uint8_t* b, int c) {
    const int high = (b[2] | b[3] << 8) >> (2 * c) & 3, low = b[4 + c / 2] >> (4 * (c % 2)) & 0x0f;
    return (low | high << 4) - 32;
  }
  template <class Visit>
  static void chunks(const uint8_t* b, int64_t c, Visit&& visit) {
    const float d = simd::two_halves_at(b).first;
    for (int j = 0; j < 8; j++) {
      const float dj = d * float(scale(b, j));
      visit(c + j, simd::look_up(simd::nibble_words(b + 8 + 16 * j), kIq4Values), simd::set1_8(dj), -128.0f * dj);
    }
  }
};

// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL repacked at load (repack_lanes) for the decode kernel, in the same
// bytes a chunk: each group of eight chunks (256 values) as its eight fp16 scales (Q4_1's and
// Q5_1's eight minimums after them), then its values as four quads (the Q5 formats' fifth bits after them) (simd.h: lane l of every vector is chunk l's), so
// that a group's integer sums come out as one vector of its chunks and meet their scales in one
// multiply-add; the row's last K % 256 values stay the base format's blocks. Not GGML types: the
// ids (kLanesTypeBase + the base's) are this project's, and layers/quantization/cpu_gguf.py names
// them too (LANES_TYPE_BASE).
constexpr int kLanesTypeBase = 1000;
// A lanes group's values as bytes, where its base format's values fit one unsigned (ByteProducts).
template <class B, class = void>
struct LanesBytes {};
template <class B>
struct LanesBytes<B, std::void_t<decltype(B::kByteMax)>> {
  static constexpr int kByteMax = B::kByteMax, kByteBias = B::kByteBias;
  static simd::ByteQuad byte_quad(const uint8_t* values, int j) { return B::byte_quad(values, j); }
};
template <class B>
struct Lanes : LanesBytes<B> {
  using Base = B;
  static constexpr int kType = kLanesTypeBase + Base::kType, kValues = 32, kBytes = Base::kBytes;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = Base::kOffset;
  static constexpr bool kWholeRow = true;
  static constexpr bool kMins = Base::kScaleBytes == 4;
  static constexpr bool kTail = true;  // a row's last K % 256 values stay Base's blocks
  static constexpr int kGroupBytes = 8 * kBytes, kHeaderBytes = 8 * Base::kScaleBytes;
  static Vec8 scales(const uint8_t* group) { return simd::halves_at(group); }
  // A group's eight offsets, given its scales d: the minimums (Q4_1, Q5_1), or -zero point x d
  // (Q4_0, Q5_0: their values are unsigned), none for Q8_0.
  static Vec8 offsets(const uint8_t* group, Vec8 d) {
    if constexpr (kMins) return simd::halves_at(group + 16);
    return kOffset ? simd::mul8(d, simd::set1_8(-Base::kZeroPoint)) : simd::zero8();
  }
  static simd::Quad quad(const uint8_t* values, int j) { return Base::quad(values, j); }
};

// Q4_K repacked at load (repack_k_lanes) for the decode kernel: each block of 256 values as
// d and dmin (fp16), its eight sub-blocks' 6-bit scales and then their minimums a byte each,
// then its values as four nibble quads (lane l = sub-block l), 148 bytes instead of 144. A
// block's scales d * sc and offsets -dmin * m (as the file's blocks give them) come out as one
// vector each. Type id 1012, this project's (layers/quantization/cpu_gguf.py names it too).
struct Q4_KLanes {
  static constexpr int kType = kLanesTypeBase + Q4_K::kType, kValues = 256, kBytes = 148;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = true;
  static constexpr bool kTail = false;
  static constexpr int kGroupBytes = kBytes, kHeaderBytes = 20;
  // The byte tiles' weights (ByteProducts): each value plus kByteBias, at most kByteMax.
  static constexpr int kByteMax = 15, kByteBias = 0;
  static Vec8 scales(const uint8_t* group) {
    return simd::mul8(simd::set1_8(simd::two_halves_at(group).first), simd::bytes_at(group + 4));
  }
  static Vec8 offsets(const uint8_t* group, Vec8) {
    return simd::mul8(simd::set1_8(-simd::two_halves_at(group).second), simd::bytes_at(group + 12));
  }
  static simd::Quad quad(const uint8_t* values, int j) { return simd::nibble_quad(values + 32 * j); }
  static simd::ByteQuad byte_quad(const uint8_t* values, int j) { return simd::nibble_byte_quad(values + 32 * j); }
};

// Q5_K repacked at load (repack_k_lanes) as Q4_KLanes, its fifth bits after the four nibble
// quads as the Q5 Lanes formats keep them (simd::five_bit_quad): 180 bytes a block instead of 176.
// Type id 1013, this project's.
struct Q5_KLanes : Q4_KLanes {
  static constexpr int kType = kLanesTypeBase + Q5_K::kType, kBytes = 180, kGroupBytes = kBytes;
  static constexpr int kByteMax = 31;
  static simd::Quad quad(const uint8_t* values, int j) { return simd::five_bit_quad(values + 32 * j, values + 128, j); }
  static simd::ByteQuad byte_quad(const uint8_t* values, int j) {
    return simd::five_bit_byte_quad(values + 32 * j, values + 128, j);
  }
};

// IQ4_XS repacked at load (repack_iq4_xs_lanes): each block of 256 values as d (fp16), its eight
// sub-blocks' scales a signed byte each, then its indices as four nibble quads, 138 bytes instead
// of 136. Type id 1023, this project's.
struct IQ4_XSLanes {
  static constexpr int kType = kLanesTypeBase + IQ4_XS::kType, kValues = 256, kBytes = 138;
  static constexpr bool kScalePer16 = false;
  static constexpr bool kOffset = true;
  static constexpr bool kWholeRow = true;
  static constexpr bool kTail = false;
  static constexpr int kGroupBytes = kBytes, kHeaderBytes = 10;
  static Vec8 scales(const uint8_t* group) { return simd::mul8(simd::set1_8(half_at(group)), simd::signed_bytes_at(group + 2)); }
  static Vec8 offsets(const uint8_t*, Vec8 d) { return simd::mul8(d, simd::set1_8(-128.0f)); }
  static simd::Quad quad(const uint8_t* values, int j) { return simd::look_up(simd::nibble_quad(values + 32 * j), kIq4Values); }
};

// Q6_K repacked at load (repack_q6_k_lanes): each block of 256 values as d (fp16), its sixteen
// int8 scales, those of the chunks' first halves (sub-blocks 0, 2, .., 14) and then of their
// second halves, then its values' low four bits as four nibble quads and their top two bits in
// 64 bytes (vectors 0-7, then 8-15; simd::six_bit_quad), 210 bytes as the file's. Vectors 0-7
// hold the chunks' first 16 values, 8-15 the rest: their sums, kept apart, meet one vector of
// scales each. Type id 1014, this project's.
struct Q6_KLanes {
  static constexpr int kType = kLanesTypeBase + Q6_K::kType, kValues = 256, kBytes = 210;
  static constexpr bool kScalePer16 = true;
  static constexpr bool kOffset = false;
  static constexpr bool kWholeRow = true;
  static constexpr bool kTail = false;
  static constexpr int kGroupBytes = kBytes, kHeaderBytes = 18;
  static constexpr int kByteMax = 63, kByteBias = 32;  // values -32 to 31, centred
  static Vec8 scales(const uint8_t* group) { return scaled(group, 2); }        // the chunks' first halves
  static Vec8 high_scales(const uint8_t* group) { return scaled(group, 10); }  // their second halves
  static Vec8 offsets(const uint8_t*, Vec8) { return simd::zero8(); }
  static simd::Quad quad(const uint8_t* values, int j) {
    return simd::six_bit_quad(values + 32 * j, values + 128 + 32 * (j / 2), 4 * (j % 2));
  }
  static simd::ByteQuad byte_quad(const uint8_t* values, int j) {
    return simd::six_bit_byte_quad(values + 32 * j, values + 128 + 32 * (j / 2), 4 * (j % 2));
  }

 private:
  static Vec8 scaled(const uint8_t* group, int at) {
    return simd::mul8(simd::set1_8(half_at(group)), simd::signed_bytes_at(group + at));
  }
};

// A row of a lanes format (Lanes<Base>, Q4_KLanes or Q6_KLanes) visited chunk by chunk, as for_each_chunk.
template <class F, class Visit>
void lanes_row_chunks(const uint8_t* row, int64_t K, Visit&& visit) {
  const int64_t groups = K / 256;
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* group = row + g * F::kGroupBytes;
    simd::Quad quads[4];
    for (int j = 0; j < 4; j++) quads[j] = F::quad(group + F::kHeaderBytes, j);
    Words chunks[8];
    simd::quads_to_chunks(quads, chunks);
    float d[8], d_high[8], offset[8];
    const Vec8 scales = F::scales(group);
    simd::store8(d, scales);
    simd::store8(offset, F::offsets(group, scales));
    if constexpr (F::kScalePer16) {
      simd::store8(d_high, F::high_scales(group));
      for (int c = 0; c < 8; c++) visit(8 * g + c, chunks[c], simd::halves(d[c], d_high[c]), offset[c]);
    } else {
      for (int c = 0; c < 8; c++) visit(8 * g + c, chunks[c], simd::set1_8(d[c]), offset[c]);
    }
  }
  if constexpr (F::kTail)
    for (int64_t c = 8 * groups; c < K / 32; c++) F::Base::chunks(row + c * F::kBytes, c, visit);
}

// Chunk c's 32 values (value(v), each 0-15) into a group's four nibble quads, as nibble_quad
// reads them: vector r holds values 2r and 2r + 1 of chunk c in words 2c and 2c + 1, vector k of
// a quad in bits 4k to 4k + 3 of each word, so byte 4c + 2p + b of quad j holds chunk c's values
// 8j + 4b + p (low nibble) and that + 2 (high).
template <class Value>
inline void pack_chunk_nibbles(int c, Value&& value, uint8_t* quads) {
  for (int j = 0; j < 4; j++)
    for (int p = 0; p < 2; p++)
      for (int b = 0; b < 2; b++) {
        const int v = 8 * j + 4 * b + p;
        quads[32 * j + 4 * c + 2 * p + b] = uint8_t(value(v) | value(v + 2) << 4);
      }
}

// A row of K values of the base format in its Lanes layout.
template <class Base>
void repack_lanes(const uint8_t* src, int64_t K, uint8_t* dst) {
  using F = Lanes<Base>;
  const int64_t groups = K / 256;
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* blocks = src + g * F::kGroupBytes;
    uint8_t* group = dst + g * F::kGroupBytes;
    uint8_t* values = group + F::kHeaderBytes;
    for (int c = 0; c < 8; c++) {
      std::memcpy(group + 2 * c, blocks + c * F::kBytes, 2);
      if constexpr (F::kMins) std::memcpy(group + 16 + 2 * c, blocks + c * F::kBytes + 2, 2);
      const uint8_t* block = blocks + c * F::kBytes + Base::kScaleBytes;
      if constexpr (std::is_same_v<Base, Q8_0>) {
        // vector r's words 2c, 2c + 1: chunk c's values 2r, 2r + 1
        for (int r = 0; r < 16; r++) std::memcpy(values + 16 * r + 2 * c, block + 2 * r, 2);
      } else {  // the nibbles' byte v holds values v (low nibble) and 16 + v (high)
        const uint8_t* nibbles = block + Base::kFifthBitBytes;
        pack_chunk_nibbles(c, [&](int v) { return (nibbles[v % 16] >> (4 * (v / 16))) & 0x0f; }, values);
      }
      if constexpr (Base::kFifthBitBytes > 0) {
        // value 2r + p's fifth bit in bit r of word 2c + p
        uint32_t fifth;
        std::memcpy(&fifth, block, 4);
        uint16_t* words = reinterpret_cast<uint16_t*>(values + 128);
        if (c == 0) std::memset(words, 0, 32);
        for (int r = 0; r < 16; r++)
          for (int p = 0; p < 2; p++) words[2 * c + p] |= uint16_t(((fifth >> (2 * r + p)) & 1) << r);
      }
    }
  }
  std::memcpy(dst + groups * F::kGroupBytes, src + groups * F::kGroupBytes, (K / 32 - 8 * groups) * F::kBytes);
}

// A row of K values of Q4_K or Q5_K (Source) in its lanes layout (Target: Q4_KLanes, Q5_KLanes).
template <class Source, class Target>
void repack_k_lanes(const uint8_t* src, int64_t K, uint8_t* dst) {
  constexpr bool kFifthBits = std::is_same_v<Source, Q5_K>;
  for (int64_t g = 0; g < K / 256; g++) {
    const uint8_t* block = src + g * Source::kBytes;
    uint8_t* group = dst + g * Target::kBytes;
    std::memcpy(group, block, 4);
    for (int c = 0; c < 8; c++) std::tie(group[4 + c], group[12 + c]) = Q4_K::scale_min(block + 4, c);
    // Sub-block c's value v: the low (c even) or high nibble of byte 32 (c / 2) + v of qs; with
    // Q5_K its fifth bit is bit c of byte v of qh.
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + (kFifthBits ? 48 : 16);
    uint8_t* values = group + Target::kHeaderBytes;
    for (int c = 0; c < 8; c++)
      pack_chunk_nibbles(c, [&](int v) { return (qs[32 * (c / 2) + v] >> (4 * (c % 2))) & 0x0f; }, values);
    if constexpr (kFifthBits) {
      // value 2r + p of sub-block c's fifth bit in bit r of word 2c + p, as repack_lanes lays them
      uint16_t* words = reinterpret_cast<uint16_t*>(values + 128);
      std::memset(words, 0, 32);
      for (int c = 0; c < 8; c++)
        for (int r = 0; r < 16; r++)
          for (int p = 0; p < 2; p++) words[2 * c + p] |= uint16_t(((qh[2 * r + p] >> c) & 1) << r);
    }
  }
}

// A row of K values of IQ4_XS in the IQ4_XSLanes layout.
void repack_iq4_xs_lanes(const uint8_t* src, int64_t K, uint8_t* dst) {
  for (int64_t g = 0; g < K / 256; g++) {
    const uint8_t* block = src + g * IQ4_XS::kBytes;
    uint8_t* group = dst + g * IQ4_XSLanes::kBytes;
    std::memcpy(group, block, 2);
    for (int c = 0; c < 8; c++) group[2 + c] = uint8_t(int8_t(IQ4_XS::scale(block, c)));
    // Sub-block c's index v: the low (v < 16) or high nibble of byte 16 c + v % 16.
    const uint8_t* qs = block + 8;
    for (int c = 0; c < 8; c++)
      pack_chunk_nibbles(c, [&](int v) { return (qs[16 * c + v % 16] >> (4 * (v / 16))) & 0x0f; },
                         group + IQ4_XSLanes::kHeaderBytes);
  }
}

// A row of K values of Q6_K in the Q6_KLanes layout.
void repack_q6_k_lanes(const uint8_t* src, int64_t K, uint8_t* dst) {
  for (int64_t g = 0; g < K / 256; g++) {
    const uint8_t* block = src + g * Q6_K::kBytes;
    uint8_t* group = dst + g * Q6_KLanes::kBytes;
    std::memcpy(group, block + 208, 2);
    for (int c = 0; c < 8; c++) {
      group[2 + c] = block[192 + 2 * c];
      group[10 + c] = block[192 + 2 * c + 1];
    }
    // Value v of the block (0-63), as ggml lays out a half of 128: ql's low nibbles hold values
    // 0-31 and (the next 32 bytes) 32-63, their high nibbles 64-127; qh's 32 bytes, two bits of
    // each in turn for the four runs of 32.
    uint8_t q[256];
    for (int h = 0; h < 2; h++) {
      const uint8_t* ql = block + 64 * h;
      const uint8_t* qh = block + 128 + 32 * h;
      for (int l = 0; l < 32; l++)
        for (int run = 0; run < 4; run++)
          q[128 * h + 32 * run + l] = uint8_t(((ql[l + 32 * (run % 2)] >> (4 * (run / 2))) & 0x0f) |
                                              (((qh[l] >> (2 * run)) & 3) << 4));
    }
    uint8_t* values = group + Q6_KLanes::kHeaderBytes;
    // The low four bits as nibble quads; the top two of vector r (values 2r + p of chunk c) in
    // bits 2 (r % 8) of word 2c + p of the run of 32 bytes r / 8.
    for (int c = 0; c < 8; c++) pack_chunk_nibbles(c, [&](int v) { return q[32 * c + v] & 0x0f; }, values);
    uint16_t* top = reinterpret_cast<uint16_t*>(values + 128);
    std::memset(top, 0, 64);
    for (int r = 0; r < 16; r++)
      for (int c = 0; c < 8; c++)
        for (int p = 0; p < 2; p++) top[16 * (r / 8) + 2 * c + p] |= uint16_t((q[32 * c + 2 * r + p] >> 4) << (2 * (r % 8)));
  }
}

template <class F, class Visit>
inline void for_each_chunk(const uint8_t* row, int64_t K, Visit&& visit) {
  if constexpr (F::kWholeRow)
    lanes_row_chunks<F>(row, K, visit);
  else
    for (int64_t b = 0; b < K / F::kValues; b++) F::chunks(row + b * F::kBytes, b * (F::kValues / 32), visit);
}

// Rows of x quantized to blocks of 32 values of `bits` bits (16: |q| <= 32767; 8: |q| <= 127, kept
// in 16-bit words all the same) with the block's fp32 scale and the sum of its quantized values
// (times a format's offset, the offset's share of the dot product), so the product is exactly that
// of x rounded to these blocks with the dequantized weight. Where the call multiplies bytes
// (`byte_products`: 8 bits, a part in a format with kByteProducts), the integer sums of each
// group's chunks' halves (what a weight's byte bias adds to byte products), and in the row
// kernel's steps (`streaming`) each group's values as bytes in simd::ByteQuad's layout, what its
// byte products read (byte_group_sums).
struct QuantizedRows {
  int64_t chunks, bits;
  bool byte_products;
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
  std::vector<int8_t> bytes;       // [row][K]: each group's four ByteQuads
  std::vector<int32_t> half_sums;  // [row][group][half][chunk of the group]

  // Each row's groups of eight chunks are laid out as the lanes formats' quads (value j of a
  // group's chunk l in vector j / 2, word 2l + j % 2); the last K % 256 values in order.
  template <typename T>
  QuantizedRows(const T* x, int64_t x_stride, int64_t M, int64_t K, int64_t bits, bool byte_products, bool streaming)
      : chunks(K / 32), bits(bits), byte_products(byte_products), q(M * K), scale(M * chunks), sum(M * chunks),
        bytes(byte_products && streaming ? M * K : 0), half_sums(byte_products ? M * K / 256 * 16 : 0) {
    TORCH_INTERNAL_ASSERT(!byte_products || bits == 8, "byte products need x in 8 bits");
    // A row's units: its groups, then its other chunks one by one.
    const int64_t groups = K / 256, units = groups + chunks - 8 * groups;
    parallel_for(0, M * units, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++) {
        const int64_t m = i / units, u = i % units;
        if (u < groups) {
          Words group[8];
          for (int l = 0; l < 8; l++) group[l] = quantize(x + m * x_stride, m, 8 * u + l);
          simd::Quad quads[4];
          simd::chunks_to_quads(group, quads);
          for (int j = 0; j < 4; j++) simd::store_quad(q.data() + m * K + 256 * u + 64 * j, quads[j]);
          if (!bytes.empty())
            for (int j = 0; j < 4; j++) simd::store_byte_quad(bytes.data() + m * K + 256 * u + 64 * j, quads[j]);
          if (!half_sums.empty())
            for (int l = 0; l < 8; l++) {
              int16_t values[32];
              simd::store_words(values, group[l]);
              int32_t* halves = &half_sums[(m * (K / 256) + u) * 16 + l];
              halves[0] = std::accumulate(values, values + 16, 0);
              halves[8] = std::accumulate(values + 16, values + 32, 0);
            }
        } else {
          const int64_t c = 8 * groups + u - groups;
          simd::store_words(q.data() + m * K + 32 * c, quantize(x + m * x_stride, m, c));
        }
      }
    });
  }
  // Chunk c of row m; c's group where c is in one.
  const int16_t* values(int64_t m, int64_t c) const { return q.data() + (m * chunks + c) * 32; }
  // Group g of row m as ByteQuads; its chunks' sums of values 16h to 16h + 15.
  const int8_t* group_bytes(int64_t m, int64_t g) const { return bytes.data() + (m * chunks + 8 * g) * 32; }
  const int32_t* group_half_sums(int64_t m, int64_t g, int h) const {
    return half_sums.data() + (m * (chunks / 8) + g) * 16 + 8 * h;
  }

 private:
  // Chunk c of a row of x (row m) to 16-bit integers, its scale and the values' sum recorded.
  template <typename T>
  Words quantize(const T* row, int64_t m, int64_t c) {
    const simd::Vec lo = load16(row + 32 * c), hi = load16(row + 32 * c + 16);
    const float amax = simd::reduce_max(simd::max(magnitude(lo), magnitude(hi)));
    const float d = amax / (bits == 8 ? 127.0f : 32767.0f);
    const simd::Vec inv = simd::set1(d > 0.0f ? 1.0f / d : 0.0f);
    const Words values = simd::round_words(simd::mul(lo, inv), simd::mul(hi, inv));
    scale[m * chunks + c] = d;
    sum[m * chunks + c] = d * float(simd::sum_words(values));
    return values;
  }
  static simd::Vec load16(const BFloat16* p) { return simd::load_bf16(p); }
  static simd::Vec load16(const float* p) { return simd::load(p); }
  static simd::Vec magnitude(simd::Vec v) { return simd::max(v, simd::sub(simd::zero(), v)); }
};

// One row of x's running sums against one weight row of a lanes format, in the order every kernel
// adds to them: group by group, the group's integer sums (a lane a chunk; two halves where a scale
// covers 16 values) times the weight's and x's chunk scales, the offsets' share apart; then the
// row's tail chunks one by one. The row kernel (lanes_dot_rows) adds through it and the tiled ones
// (vector_tile, amx_tile) repeat its steps vectorised over rows of x: integer sums are exact
// whatever their order, so an output element comes out the same bits whichever kernel, step size
// or batch computed it.
struct RowSums {
  Vec8 acc, offsets;
  float tail_offsets;

  RowSums() : acc(simd::zero8()), offsets(simd::zero8()), tail_offsets(0.0f) {}

  // sums[h] (h < kHalves) and d[h] its scales, `offset` the group's offsets; x's eight chunks'
  // scales and sums (times their offsets' share) at x_scales and x_sums.
  template <bool kOffset, int kHalves>
  void add_group(const simd::Sums* sums, const Vec8* d, Vec8 offset, const float* x_scales, const float* x_sums) {
    const Vec8 xs = simd::load8(x_scales);
    for (int h = 0; h < kHalves; h++) acc = simd::fmadd8(simd::to_float(sums[h]), simd::mul8(d[h], xs), acc);
    if constexpr (kOffset) offsets = simd::fmadd8(offset, simd::load8(x_sums), offsets);
  }
  // A row's tail chunks c0 to c0 + n - 1 (n < 8: a Lanes<Base> row's K % 256 values) against x
  // row m: sums[j] chunk c0 + j's integer dot product (zero past n), their scales in lanes (zero
  // past n) and offsets. Each chunk's integer sum meets its scales whole, in the lane of its
  // chunk modulo 8 (lane j: c0 is a multiple of 8), as a group's chunks do and as the AMX tiles
  // sum it; a lane without a chunk adds 0 x 0, which leaves it as it was (a sum that starts at
  // +0 is never -0).
  void add_tail_chunks(const simd::Sums* sums, Vec8 scales, const float* offsets, int64_t n, const QuantizedRows& x,
                       int64_t m, int64_t c0) {
    const int64_t xc = m * x.chunks + c0;
    for (int64_t j = 0; j < n; j++) tail_offsets = std::fma(offsets[j], x.sum[xc + j], tail_offsets);
    const Vec8 products = simd::mul8(scales, simd::load8_first(&x.scale[xc], n));
    acc = simd::fmadd8(simd::to_float(simd::totals(sums)), products, acc);
  }
  template <class F>
  void add_tail(const uint8_t* row, int64_t K, const QuantizedRows& x, int64_t m) {
    if constexpr (F::kTail) {
      const int64_t c0 = K / 256 * 8, n = K / 32 - c0;
      if (n == 0) return;
      simd::Sums sums[8];
      Vec8 scales = simd::zero8();
      float offsets[8];
      for (int j = 0; j < 8; j++) sums[j] = simd::zero_sums();
      for (int64_t j = 0; j < n; j++)
        F::Base::chunks(row + (c0 + j) * F::kBytes, c0 + j, [&](int64_t, Words q, Vec8 scale, float offset) {
          sums[j] = simd::dot(q, simd::load_words(x.values(m, c0 + j)));
          scales = simd::blend_lane(scales, scale, j);
          offsets[j] = offset;
        });
      add_tail_chunks(sums, scales, offsets, n, x, m, c0);
    }
  }
  float total() const { return simd::reduce_add8(simd::add8(acc, offsets)) + tail_offsets; }
};

// Bytes ahead of a group that lanes_dot_rows prefetches into L1, and further ahead into L2: the
// hardware prefetcher alone leaves one thread's stream from memory short of the bandwidth, and
// L1's few misses in flight cap what the near prefetch alone keeps coming; the far one, held in
// L2's deeper queue, turns the near one's misses into L2 hits (benchmarks/RESULTS.md).
constexpr int kPrefetchAhead = 2048, kPrefetchToL2Ahead = 8192;

// Whether format F's values plus F::kByteBias fit a byte unsigned (at most F::kByteMax), so that
// with x of 8 bits its groups' products can be taken a byte each (Q4_0, Q4_K, Q5_K, Q6_K; a
// Lanes<Base> row's tail chunks still take words).
template <class F, class = void>
struct HasByteProducts : std::false_type {};
template <class F>
struct HasByteProducts<F, std::void_t<decltype(F::kByteMax)>> : std::true_type {};
template <class F>
constexpr bool kByteProducts = HasByteProducts<F>::value;

// Whether the row kernel's sums for P rows of x take their products in more than one chain each:
// with VNNI's multiply-adds (simd::kProductsChain) a row's sums otherwise wait on each product's
// latency, which few rows of x leave idle. Integer sums: the totals are the same in any order.
template <int P>
constexpr bool kShortChains = simd::kProductsChain && P < 4;

// s[m][h] = the integer sums of group g of a weight row (its quads at `values`) with x row m0 + m's,
// from bytes: each of the weight's ByteQuads decoded once for the P rows, its products gathered
// in ByteSums widened as often as they must to stay exact, the byte bias taken off through x's
// half sums; the same sums as the quads of words give.
template <class F, int P, int kHalves>
__attribute__((always_inline)) inline void byte_group_sums(const uint8_t* values, const QuantizedRows& x, int64_t m0,
                                                           int64_t g, simd::Sums (&s)[P][kHalves]) {
  constexpr int kVectors = 8 / kHalves;  // a half's byte vectors, two a quad
  constexpr int kRun = std::min(kVectors, simd::byte_quads_per_widen(F::kByteMax));
  static_assert(kRun >= 1 && kVectors % kRun == 0);
  constexpr int kChains = kShortChains<P> ? 2 : 1;  // a row of x's sums taking products in turn
  simd::ByteQuad quads[4];
  for (int j = 0; j < 4; j++) quads[j] = F::byte_quad(values, j);
  for (int h = 0; h < kHalves; h++) {
    for (int m = 0; m < P; m++) s[m][h] = simd::zero_sums();
    for (int v0 = 0; v0 < kVectors; v0 += kRun) {
      simd::ByteSums p[P][kChains];
      for (auto& row : p)
        for (simd::ByteSums& sum : row) sum = simd::zero_byte_sums();
#pragma GCC unroll 8
      for (int v = v0; v < v0 + kRun; v++) {
        const int j = h * kVectors / 2 + v / 2;
        const simd::ByteVector wv = v % 2 ? quads[j].hi : quads[j].lo;
#pragma GCC unroll 8
        for (int m = 0; m < P; m++)
          p[m][v % kChains] = simd::dot_bytes(
              wv, simd::load_byte_vector(x.group_bytes(m0 + m, g) + 64 * j + 32 * (v % 2)), p[m][v % kChains]);
      }
      for (int m = 0; m < P; m++)
        for (int c = 0; c < kChains; c++) s[m][h] = simd::widen_byte_sums(p[m][c], s[m][h]);
    }
    if constexpr (F::kByteBias != 0)
      for (int m = 0; m < P; m++)
        s[m][h] = simd::sub_sums(s[m][h], simd::times(simd::load_sums(x.group_half_sums(m0 + m, g, h)), F::kByteBias));
  }
}

// out[r * P + m] = weight row r . x row m0 + m, for `rows` consecutive rows of a lanes format and
// P rows of x quantized in lanes: a group of eight chunks is four quads' multiply-adds into one
// Sums a row of x, whose lanes are the chunks (or, with kBytes, byte_group_sums' byte products),
// then RowSums::add_group. Rows are read one after another, straight from the blocks: one stream
// for the hardware prefetcher (a decode step).
template <class F, int P, bool kBytes>
void lanes_dot_rows(const uint8_t* w, int64_t w_stride, int64_t rows, int64_t K, const QuantizedRows& x,
                    int64_t m0, float* out) {
  // With a scale per 16 values, quads 2 and 3 (the chunks' values 16-31) sum apart: half 1.
  constexpr int kHalves = F::kScalePer16 ? 2 : 1;
  const int64_t groups = K / 256, C = K / 32;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t* row = w + r * w_stride;
    RowSums sums[P];
    for (int64_t g = 0; g < groups; g++) {
      const uint8_t* group = row + g * F::kGroupBytes;
      for (int line = 0; line < F::kGroupBytes; line += 64) {
        simd::prefetch(group + kPrefetchAhead + line);
        simd::prefetch_to_l2(group + kPrefetchToL2Ahead + line);
      }
      simd::Sums s[P][kHalves];
      if constexpr (kBytes) {
        byte_group_sums<F, P, kHalves>(group + F::kHeaderBytes, x, m0, g, s);
      } else {
        for (int m = 0; m < P; m++)
          for (int h = 0; h < kHalves; h++) s[m][h] = simd::zero_sums();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
          const simd::Quad quad = F::quad(group + F::kHeaderBytes, j);
          const int h = kHalves == 2 ? j / 2 : 0;
#pragma GCC unroll 8
          for (int m = 0; m < P; m++) {
            const int16_t* xq = x.values(m0 + m, 8 * g) + 64 * j;
            if constexpr (kShortChains<P>)  // each quad's products a chain of their own
              s[m][h] = simd::add_sums(s[m][h], simd::dot_quad(quad, xq, simd::zero_sums()));
            else
              s[m][h] = simd::dot_quad(quad, xq, s[m][h]);
          }
        }
      }
      Vec8 d[kHalves];
      d[0] = F::scales(group);
      if constexpr (F::kScalePer16) d[1] = F::high_scales(group);
      const Vec8 offset = F::offsets(group, d[0]);
#pragma GCC unroll 8
      for (int m = 0; m < P; m++) {
        const int64_t xc = (m0 + m) * C + 8 * g;
        sums[m].template add_group<F::kOffset, kHalves>(s[m], d, offset, &x.scale[xc], &x.sum[xc]);
      }
    }
    for (int m = 0; m < P; m++) {
      sums[m].template add_tail<F>(row, K, x, m0 + m);
      out[r * P + m] = sums[m].total();
    }
  }
}

// The lanes layouts alone: what the products multiply (a file's own layout is repacked first).
template <class Body>
void with_lanes_format(int64_t type, Body&& body) {
  switch (type) {
    case Lanes<Q8_0>::kType: return body(Lanes<Q8_0>{});
    case Lanes<Q4_0>::kType: return body(Lanes<Q4_0>{});
    case Lanes<Q4_1>::kType: return body(Lanes<Q4_1>{});
    case Lanes<Q5_0>::kType: return body(Lanes<Q5_0>{});
    case Lanes<Q5_1>::kType: return body(Lanes<Q5_1>{});
    case Lanes<IQ4_NL>::kType: return body(Lanes<IQ4_NL>{});
    case IQ4_XSLanes::kType: return body(IQ4_XSLanes{});
    case Q4_KLanes::kType: return body(Q4_KLanes{});
    case Q5_KLanes::kType: return body(Q5_KLanes{});
    case Q6_KLanes::kType: return body(Q6_KLanes{});
  }
  TORCH_CHECK(false, "GGUF type ", type, " is not a lanes layout: the kernels multiply rows that gguf_repack put in one "
              "(type 1000 + the file's: 1002 Q4_0, 1003 Q4_1, 1006 Q5_0, 1007 Q5_1, 1008 Q8_0, 1012 Q4_K, 1013 Q5_K, "
              "1014 Q6_K, 1020 IQ4_NL, 1023 IQ4_XS)");
}

// Every format: the files' own layouts and the lanes layouts.
template <class Body>
void with_format(int64_t type, Body&& body) {
  switch (type) {
    case Q8_0::kType: return body(Q8_0{});
    case Q4_0::kType: return body(Q4_0{});
    case Q4_1::kType: return body(Q4_1{});
    case Q4_K::kType: return body(Q4_K{});
    case Q5_K::kType: return body(Q5_K{});
    case Q6_K::kType: return body(Q6_K{});
    case Q5_0::kType: return body(Q5_0{});
    case Q5_1::kType: return body(Q5_1{});
    case IQ4_NL::kType: return body(IQ4_NL{});
    case IQ4_XS::kType: return body(IQ4_XS{});
  }
  TORCH_CHECK(type >= kLanesTypeBase, "GGUF type ", type, " has no kernel; the kernels read Q4_0 (2), Q4_1 (3), Q5_0 (6), "
              "Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14), IQ4_NL (20), IQ4_XS (23) and their lanes layouts "
              "(1000 + each)");
  with_lanes_format(type, std::forward<Body>(body));
}

// Rows of x per pass over a weight row: the accumulators with a weight chunk and its scale fit
// the sixteen ymm registers.
constexpr int kMaxPass = 8;
using LanesDotRowsFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const QuantizedRows&, int64_t, float*);
template <class F, bool kBytes, int... Ps>
constexpr auto make_lanes_table(std::integer_sequence<int, Ps...>) {
  return std::array<LanesDotRowsFn, sizeof...(Ps)>{&lanes_dot_rows<F, Ps + 1, kBytes>...};
}

// A weight's rows as one or more parts, each in one format, one after another in the output: a
// packed layer (q/k/v, gate/up) whose projections the file stores in different types keeps each
// projection's rows in its own type. Part p's row r is output column first + r.
struct Part {
  int64_t type;
  const uint8_t* w;
  int64_t w_stride, first, rows;
};

// Whether a part's format takes x of 8 bits as bytes (kByteProducts).
bool has_byte_products(const Part& part) {
  bool bytes = false;
  with_lanes_format(part.type, [&](auto format) { bytes = kByteProducts<decltype(format)>; });
  return bytes;
}

// Output columns [begin, end) of `part` (within it) for rows m_first to m_first + M - 1 of x in
// xq, into the same rows of y.
template <class F, typename T>
void streaming_rows(const QuantizedRows& xq, const Part& part, int64_t begin, int64_t end, const float* bias, T* y,
                    int64_t m_first, int64_t M, int64_t N, int64_t K) {
  const int64_t passes = (M + kMaxPass - 1) / kMaxPass;
  const auto store = [&](int64_t m, int64_t n, float value) {
    y[m * N + n] = T(value + (bias != nullptr ? bias[n] : 0.0f));
  };
  const auto row = [&](int64_t n) { return part.w + (n - part.first) * part.w_stride; };
  static constexpr auto words = make_lanes_table<F, false>(std::make_integer_sequence<int, kMaxPass>{});
  const LanesDotRowsFn* table = words.data();
  if constexpr (kByteProducts<F>) {
    static constexpr auto bytes = make_lanes_table<F, true>(std::make_integer_sequence<int, kMaxPass>{});
    if (xq.byte_products) table = bytes.data();
  }
  constexpr int64_t kRun = 32;  // weight rows a call
  float out[kRun * kMaxPass];
  for (int64_t n = begin; n < end; n += kRun) {
    const int64_t run = std::min(kRun, end - n);
    for (int64_t i = 0, m0 = m_first; i < passes; i++) {
      const int64_t rows = (m_first + M - m0) / (passes - i);
      table[rows - 1](row(n), part.w_stride, run, K, xq, m0, out);
      for (int64_t r = 0; r < run; r++)
        for (int64_t m = 0; m < rows; m++) store(m0 + m, n + r, out[r * rows + m]);
      m0 += rows;
    }
  }
}

// y = x W^T (+ bias) with each weight row streamed from its blocks once a call (a decode step's
// few rows of x): one parallel region over all the parts' rows.
template <typename T>
void streaming_linear(const QuantizedRows& xq, const std::vector<Part>& parts, const float* bias, T* y, int64_t M,
                      int64_t N, int64_t K) {
  int64_t widest = 1;  // row stride: a row's bytes, as the ops pass them
  for (const Part& part : parts) widest = std::max(widest, part.w_stride);
  // ~16 KB of weights a task at the least: a parallel region costs a few us.
  const int64_t grain = std::max<int64_t>(1, 16384 / widest);
  parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (const Part& part : parts) {
      const int64_t lo = std::max(begin, part.first), hi = std::min(end, part.first + part.rows);
      if (lo < hi)
        with_lanes_format(part.type, [&](auto format) {
          streaming_rows<decltype(format)>(xq, part, lo, hi, bias, y, 0, M, N, K);
        });
    }
  });
}

template <class F>
void dequantize_row(const uint8_t* row, int64_t K, float* out) {
  for_each_chunk<F>(row, K, [&](int64_t c, Words q, Vec8 scale, float offset) {
    Vec8 v[4];
    simd::widen_block(q, v);
    // Values 0-15 take the scale of the sums' lanes 0-3, values 16-31 that of lanes 4-7.
    const Vec8 lo = simd::low_half(scale), hi = simd::high_half(scale), add = simd::set1_8(offset);
    for (int g = 0; g < 4; g++) simd::store8(out + 32 * c + 8 * g, simd::fmadd8(v[g], g < 2 ? lo : hi, add));
  });
}

template <class F>
void dequantize_rows(const uint8_t* w, int64_t w_stride, int64_t rows, int64_t K, float* out) {
  parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++) dequantize_row<F>(w + n * w_stride, K, out + n * K);
  });
}

// ---- Many rows: the same sums, tiled -----------------------------------------------------
// A step of many rows of x (a prefill, a batch) computes every output element with exactly the
// row kernel's arithmetic (RowSums), in an order that reuses what it loads: each task decodes a
// block of weight rows once (DecodedRows), which stays in L2, and x's rows are laid out once a
// call in tiles of 16 rows (TiledX). A tile of kTileRows weight rows by 16 rows of x
// (vector_tile) then multiplies each weight's pair of values, or quad where it takes bytes,
// broadcast, with a vector of eight rows' pairs (quads) of x: a lane's sum is one output
// element's, so every chunk's integer sums come out in lanes of rows of x and meet their scales
// as the AMX tiles' do (a chunk's sum in the lane of its chunk modulo 8 of RowSums, vectorised
// over rows of x), the same operations in the same order as RowSums. Bytes where x has 8 bits
// and the weight's values fit a byte unsigned (kByteProducts; a Lanes<Base> row's tail chunks
// take pairs all the same), twice the products an instruction of 16-bit pairs; both sums are
// exact, so either gives the same bits.

// Weight rows a tile: their sums (two vectors a row), x's two vectors, a broadcast pair and a
// product fit AVX2's sixteen registers (4 x 2 + 4; with 5 rows GCC spills in the inner loop).
constexpr int kTileRows = simd::kRegisters == 32 ? 8 : 4;
// Whether a tile sums RowSums' lanes one after another: with 32 registers a lane's sums for the
// whole tile stay in registers while its chunks (l, l + 8, ..) pass; with 16 they would spill,
// so all eight lanes' sums live in memory while the chunks pass in order (benchmarks/RESULTS.md).
// Either way each lane adds its chunks in the same order: the same bits.
constexpr bool kLaneByLane = simd::kRegisters == 32;
// x tiles a weight tile meets in turn, from L2, while its rows stay in L1.
constexpr int64_t kXTilesPerPanel = 2;
// A block's decoded rows fill at most about a quarter of a core's L2 (the more rows a block, the
// fewer times a long step's x comes through L2), in at least eight blocks a thread: enough that a
// thread can take over the blocks of one another process holds up (benchmarks/RESULTS.md).
constexpr int64_t kBlockBytes = 256 * 1024;
constexpr int64_t kBlocksPerThread = 8;

// Rows a block, a multiple of the tile's rows (`tile_rows`).
int64_t block_rows(int64_t N, int64_t K, int64_t tile_rows) {
  const int64_t by_cache = kBlockBytes / (2 * K) / tile_rows * tile_rows;
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t by_balance = (N + kBlocksPerThread * threads - 1) / (kBlocksPerThread * threads);
  return std::max(tile_rows, std::min(by_cache, (by_balance + tile_rows - 1) / tile_rows * tile_rows));
}

// A block of a lanes format's rows decoded: the values of group g of row r as 256 words at
// values[(r * groups + g) * 256] (the lanes layout: chunk l's values 2v and 2v + 1 are words
// 16v + 2l and 16v + 2l + 1), or as bytes (plus F::kByteBias), chunk c of row r's 32 at
// bytes[(r * 8 groups + c) * 32] as eight quads in simd::ByteQuad's order (decoded straight from
// the lanes layout as the decode kernel reads them; the integer sums are exact, so x's quads in
// the same order give the same sums as any order); kHalves scale vectors then one of offsets at
// scales[(r * groups + g) * kStride]; the row's tail chunks (Lanes<Base>'s last K % 256 values)
// as Base's chunks give them. In a task's buffers (DecodeBuffers, sized for any format). Rows
// past the block's end keep what an earlier block left (or whatever the memory held): tiles
// compute them and store nothing.
template <class F>
struct DecodedRows {
  static constexpr int kHalves = F::kScalePer16 ? 2 : 1, kStride = 8 * (kHalves + 1);
  int64_t groups, tail;  // groups and tail chunks a row
  int16_t* values;
  uint8_t* bytes;
  float* scales;
  Words* tail_values;
  float* tail_scales;
  float* tail_offsets;

  // `rows` rows w_stride bytes apart, their values as bytes (kBytes) or words.
  template <bool kBytes>
  void decode(const uint8_t* w, int64_t w_stride, int64_t rows) {
    static_assert(!kBytes || kByteProducts<F>);
    for (int64_t r = 0; r < rows; r++) {
      const uint8_t* row = w + r * w_stride;
      for (int64_t g = 0; g < groups; g++) {
        const uint8_t* group = row + g * F::kGroupBytes;
        if constexpr (kBytes) {
          simd::ByteQuad quads[4];
          for (int j = 0; j < 4; j++) quads[j] = F::byte_quad(group + F::kHeaderBytes, j);
          simd::store_quads_by_chunk(quads, bytes + (r * groups + g) * 256);
        } else {
          for (int j = 0; j < 4; j++)
            simd::store_quad(values + (r * groups + g) * 256 + 64 * j, F::quad(group + F::kHeaderBytes, j));
        }
        float* s = scales + (r * groups + g) * kStride;
        const Vec8 d = F::scales(group);
        simd::store8(s, d);
        if constexpr (F::kScalePer16) simd::store8(s + 8, F::high_scales(group));
        simd::store8(s + 8 * kHalves, F::offsets(group, d));
      }
      if constexpr (F::kTail)
        for (int64_t t = 0; t < tail; t++)
          F::Base::chunks(row + (8 * groups + t) * F::kBytes, t, [&](int64_t, Words q, Vec8 scale, float offset) {
            tail_values[r * tail + t] = q;
            tail_scales[r * tail + t] = simd::first_lane(scale);
            tail_offsets[r * tail + t] = offset;
          });
    }
  }
  const int16_t* vectors(int64_t r, int64_t g) const { return values + (r * groups + g) * 256; }
  const uint8_t* chunk_bytes(int64_t r, int64_t c) const { return bytes + (r * groups * 8 + c) * 32; }
  const float* scales_of(int64_t r, int64_t g) const { return scales + (r * groups + g) * kStride; }
  // Tail chunk j of row r, its 32 values in order.
  const int16_t* tail_words(int64_t r, int64_t j) const {
    return reinterpret_cast<const int16_t*>(&tail_values[r * tail + j]);
  }
};

// Room for a block of any format's decoded rows of K values, left uninitialised: each task of a
// call takes one, and clearing it would write more bytes than decoding a block into it.
struct DecodeBuffers {
  int64_t groups, tail;
  std::unique_ptr<int16_t[]> values;
  std::unique_ptr<uint8_t[]> bytes;
  std::unique_ptr<float[]> scales, tail_offsets;
  std::unique_ptr<Words[]> tail_values;
  std::unique_ptr<float[]> tail_scales;

  DecodeBuffers(int64_t rows, int64_t K)
      : groups(K / 256), tail(K / 32 - K / 256 * 8), values(new int16_t[rows * groups * 256]),
        bytes(new uint8_t[rows * groups * 256]), scales(new float[rows * groups * 24]),
        tail_offsets(new float[rows * tail]), tail_values(new Words[rows * tail]), tail_scales(new float[rows * tail]) {}
  template <class F>
  DecodedRows<F> rows() {
    return {groups,           tail, values.get(), bytes.get(), scales.get(), tail_values.get(), tail_scales.get(),
            tail_offsets.get()};
  }
};

// x's rows as the tiles take them, in tiles of 16 rows (rows past M are zeros): for each tile and
// chunk, the chunk's scales and sums by row, and its values as the products read them: `pairs`,
// its 16 pairs of words in turn, each as the 16 rows' pairs (rows 0-7 a vector, 8-15 the next),
// for a group's chunks where a part multiplies words (`group_pairs`) and for the tail chunks;
// `quads` (where x meets bytes: x.byte_products), its 8 quads of bytes in the decoded weights'
// order (DecodedRows: simd::ByteQuad's), each as the 16 rows' quads, with the integer sum of each
// half of the chunk by row (what a weight's byte bias adds to the products).
struct TiledX {
  int64_t tiles, chunks;
  std::vector<int16_t> pairs;      // [tile][chunk][pair][row][2], where asked for
  std::vector<int8_t> quads;       // [tile][chunk][quad][row][4], where asked for
  std::vector<int32_t> half_sums;  // [tile][chunk][half][row], with the quads
  std::vector<float> scale, sum;   // [tile][chunk][row]

  TiledX(const QuantizedRows& x, int64_t M, bool group_pairs)
      : tiles((M + 15) / 16), chunks(x.chunks), pairs(group_pairs || chunks % 8 ? tiles * chunks * 512 : 0),
        quads(x.byte_products ? tiles * chunks * 512 : 0), half_sums(x.byte_products ? tiles * chunks * 32 : 0),
        scale(tiles * chunks * 16), sum(tiles * chunks * 16) {
    const bool with_quads = x.byte_products;
    const int64_t grouped = x.chunks / 8 * 8;
    parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; m++) {
        const int64_t i = m % 16;
        if (with_quads)  // a group's quads 2j and 2j + 1 of its eight chunks from its quad of vectors j at once
          for (int64_t g = 0; g < chunks / 8; g++) {
            const int64_t at = m / 16 * chunks + 8 * g;
            for (int j = 0; j < 4; j++) {
              int8_t lanes[64];  // ByteQuad's two vectors: the chunks' quads 2j and 2j + 1
              simd::store_byte_quad(lanes, simd::load_quad(x.values(m, 8 * g) + 64 * j));
              for (int q = 0; q < 2; q++)
                for (int l = 0; l < 8; l++)
                  std::memcpy(&quads[(at + l) * 512 + 64 * (2 * j + q) + 4 * i], lanes + 32 * q + 4 * l, 4);
            }
            for (int h = 0; h < 2; h++)
              for (int l = 0; l < 8; l++) half_sums[((at + l) * 2 + h) * 16 + i] = x.group_half_sums(m, g, h)[l];
          }
        for (int64_t c = 0; c < chunks; c++) {
          const int64_t at = m / 16 * chunks + c;
          // A group's chunk l has pair v at words 16v + 2l; a tail chunk's values are in order.
          const int16_t* from = c < grouped ? x.values(m, c / 8 * 8) + 2 * (c % 8) : x.values(m, c);
          const int64_t step = c < grouped ? 16 : 2;
          if (group_pairs || c >= grouped)
            for (int v = 0; v < 16; v++) std::memcpy(&pairs[at * 512 + 2 * i + 32 * v], from + step * v, 4);
          scale[at * 16 + i] = x.scale[m * chunks + c];
          sum[at * 16 + i] = x.sum[m * chunks + c];
        }
      }
    });
  }
  const int16_t* pairs_of(int64_t tile, int64_t c) const { return &pairs[(tile * chunks + c) * 512]; }
  const int8_t* quads_of(int64_t tile, int64_t c) const { return &quads[(tile * chunks + c) * 512]; }
  const int32_t* half_sums_of(int64_t tile, int64_t c, int h) const {
    return &half_sums[((tile * chunks + c) * 2 + h) * 16];
  }
  const float* scales(int64_t tile, int64_t c) const { return &scale[(tile * chunks + c) * 16]; }
  const float* sums(int64_t tile, int64_t c) const { return &sum[(tile * chunks + c) * 16]; }
};

// s[r][i] = half h of chunk c of decoded row t + r (bytes) . that of x's rows 16 xt + 8i to + 7
// (quads): each weight quad broadcast against eight rows' quads, the ByteSums widened as often as
// they must to stay exact, the weight's byte bias taken off through x's half sums.
template <class F, int kLive>
__attribute__((always_inline)) inline void byte_sums(const DecodedRows<F>& w, int64_t t, const TiledX& x, int64_t xt, int64_t c, int h,
               simd::Sums (&s)[kTileRows][kLive]) {
  constexpr int kQuads = 8 / DecodedRows<F>::kHalves;  // a half's
  constexpr int kRun = std::min(kQuads, simd::byte_quads_per_widen(F::kByteMax));
  static_assert(kRun >= 1 && kQuads % kRun == 0);
  const int8_t* xq = x.quads_of(xt, c) + 64 * kQuads * h;
  for (auto& row : s)
    for (simd::Sums& sum : row) sum = simd::zero_sums();
  for (int q0 = 0; q0 < kQuads; q0 += kRun) {
    simd::ByteSums p[kTileRows][kLive];
    for (auto& row : p)
      for (simd::ByteSums& sum : row) sum = simd::zero_byte_sums();
#pragma GCC unroll 4
    for (int q = q0; q < q0 + kRun; q++) {
      simd::ByteVector xv[kLive];
      for (int i = 0; i < kLive; i++) xv[i] = simd::load_byte_vector(xq + 64 * q + 32 * i);
#pragma GCC unroll 8
      for (int r = 0; r < kTileRows; r++) {
        const simd::ByteVector b = simd::broadcast_quad(w.chunk_bytes(t + r, c) + 4 * (kQuads * h + q));
        for (int i = 0; i < kLive; i++) p[r][i] = simd::dot_bytes(b, xv[i], p[r][i]);
      }
    }
    for (int r = 0; r < kTileRows; r++)
      for (int i = 0; i < kLive; i++) s[r][i] = simd::widen_byte_sums(p[r][i], s[r][i]);
  }
  if constexpr (F::kByteBias != 0)
    for (int i = 0; i < kLive; i++) {
      const simd::Sums bias = simd::times(simd::load_sums(x.half_sums_of(xt, c, h) + 8 * i), F::kByteBias);
      for (int r = 0; r < kTileRows; r++) s[r][i] = simd::sub_sums(s[r][i], bias);
    }
}

// out[r][m] = decoded row t + r . x row 16 xt + m, for r < kTileRows and m < 8 kLive (the rows of x
// whose vectors are computed: 1 where at most eight of the tile's rows are real), from bytes
// (kBytes) or pairs of words. RowSums' accumulators, lane by lane: lane l's acc takes chunks l,
// l + 8, .. (one lane after another where kLaneByLane, else all eight as the chunks pass) and its
// offsets their offsets' share, summed apart until the totals, whose tree is reduce_add8's.
template <class F, int kLive, bool kBytes>
void vector_tile(const DecodedRows<F>& w, int64_t t, const TiledX& x, int64_t xt, float (&out)[kTileRows][16]) {
  constexpr int kHalves = DecodedRows<F>::kHalves, kPairs = 16 / kHalves;
  using LaneSums = Vec8[kTileRows][kLive];  // one lane's acc over the tile
  const auto clear = [](LaneSums& sums) {
    for (auto& row : sums)
      for (Vec8& a : row) a = simd::zero8();
  };
  // Chunk c into its lane's acc (`into`): `pair(r, v)` weight row t + r's pair v of words, `scale(r, h)`
  // its scale for half h; from bytes where `bytes` says (a group's chunk under kBytes; a tail chunk
  // takes words).
  const auto chunk = [&](int64_t c, LaneSums& into, auto bytes, auto&& pair, auto&& scale) {
    Vec8 xs[kLive];
    for (int i = 0; i < kLive; i++) xs[i] = simd::load8(x.scales(xt, c) + 8 * i);
#pragma GCC unroll 2
    for (int h = 0; h < kHalves; h++) {
      simd::Sums s[kTileRows][kLive];
      if constexpr (decltype(bytes)::value) {
        byte_sums<F, kLive>(w, t, x, xt, c, h, s);
      } else {
        const int16_t* xp = x.pairs_of(xt, c);
        for (auto& row : s)
          for (simd::Sums& sum : row) sum = simd::zero_sums();
        // Four pairs an iteration (a Q6_K half's eight in two): with two, Q6_K's halves run as
        // short loops; with eight or sixteen, GCC spills the sums (benchmarks/RESULTS.md).
#pragma GCC unroll 4
        for (int v = h * kPairs; v < (h + 1) * kPairs; v++) {
          simd::Vector16 xv[kLive];
          for (int i = 0; i < kLive; i++) xv[i] = simd::load_vector(xp + 32 * v + 16 * i);
#pragma GCC unroll 8
          for (int r = 0; r < kTileRows; r++) {
            const simd::Vector16 b = simd::broadcast_pair(pair(r, v));
            for (int i = 0; i < kLive; i++) s[r][i] = simd::dot_vector(b, xv[i], s[r][i]);
          }
        }
      }
      for (int r = 0; r < kTileRows; r++) {
        const Vec8 d = simd::set1_8(scale(r, h));
        for (int i = 0; i < kLive; i++) into[r][i] = simd::fmadd8(simd::to_float(s[r][i]), simd::mul8(d, xs[i]), into[r][i]);
      }
    }
  };
  // Group g's chunk in lane l; the row's tail chunk l (lane l: the tail starts at a multiple of 8).
  const auto group_chunk = [&](int64_t g, int l, LaneSums& into) {
    chunk(8 * g + l, into, std::bool_constant<kBytes>{}, [&](int r, int v) { return w.vectors(t + r, g) + 16 * v + 2 * l; },
          [&](int r, int h) { return w.scales_of(t + r, g)[8 * h + l]; });
  };
  const auto tail_chunk = [&](int l, LaneSums& into) {
    chunk(8 * w.groups + l, into, std::false_type{}, [&](int r, int v) { return w.tail_words(t + r, l) + 2 * v; },
          [&](int r, int) { return w.tail_scales[(t + r) * w.tail + l]; });
  };
  // Lane l's offsets' share: its chains for the tile's rows side by side in registers (each an
  // FMA's latency a group), x's sums loaded once for all the weight rows, then into the lane's acc
  // as RowSums::total adds them (a tile without offsets adds +0, which leaves a sum that starts at
  // +0 as it is).
  const auto add_offsets = [&](int l, LaneSums& into) {
    if constexpr (F::kOffset) {
      LaneSums offsets;
      clear(offsets);
      for (int64_t g = 0; g < w.groups; g++) {
        Vec8 xsum[kLive];
        for (int i = 0; i < kLive; i++) xsum[i] = simd::load8(x.sums(xt, 8 * g + l) + 8 * i);
        for (int r = 0; r < kTileRows; r++) {
          const Vec8 d = simd::set1_8(w.scales_of(t + r, g)[8 * kHalves + l]);
          for (int i = 0; i < kLive; i++) offsets[r][i] = simd::fmadd8(d, xsum[i], offsets[r][i]);
        }
      }
      for (int r = 0; r < kTileRows; r++)
        for (int i = 0; i < kLive; i++) into[r][i] = simd::add8(into[r][i], offsets[r][i]);
    }
  };
  LaneSums lanes[8];  // each lane's acc + offsets, as RowSums::total meets them
  if constexpr (kLaneByLane) {
    for (int l = 0; l < 8; l++) {
      LaneSums acc;  // one lane's, a local: GCC keeps it in registers
      clear(acc);
      for (int64_t g = 0; g < w.groups; g++) group_chunk(g, l, acc);
      if (l < w.tail) tail_chunk(l, acc);
      add_offsets(l, acc);
      std::memcpy(lanes[l], acc, sizeof(LaneSums));
    }
  } else {
    for (LaneSums& lane : lanes) clear(lane);
    for (int64_t g = 0; g < w.groups; g++)
      for (int l = 0; l < 8; l++) group_chunk(g, l, lanes[l]);
    for (int l = 0; l < w.tail; l++) tail_chunk(l, lanes[l]);
    for (int l = 0; l < 8; l++) add_offsets(l, lanes[l]);
  }
  for (int r = 0; r < kTileRows; r++)
    for (int i = 0; i < kLive; i++) {
      Vec8 row_lanes[8];
      for (int l = 0; l < 8; l++) row_lanes[l] = lanes[l][r][i];
      Vec8 tail_offsets = simd::zero8();  // RowSums::tail_offsets: the tail chunks' in turn
      if constexpr (F::kOffset)
        for (int64_t j = 0; j < w.tail; j++)
          tail_offsets = simd::fmadd8(simd::set1_8(w.tail_offsets[(t + r) * w.tail + j]),
                                      simd::load8(x.sums(xt, 8 * w.groups + j) + 8 * i), tail_offsets);
      simd::store8(&out[r][8 * i], simd::add8(simd::add8_tree(row_lanes), tail_offsets));
    }
}

// 16 outputs converted to y's type (rounded as the scalar conversion rounds).
inline void convert16(simd::Vec x, float* out) { simd::store(out, x); }
inline void convert16(simd::Vec x, BFloat16* out) { simd::store_bf16(out, x); }

// A block of a part's rows (from r0, decoded) against every row of x, tile by tile.
template <class F, bool kBytes, typename T>
void vector_block(const DecodedRows<F>& w, const Part& part, int64_t r0, int64_t rows, const TiledX& x, int64_t M,
                  const float* bias, T* y, int64_t N) {
  for (int64_t p0 = 0; p0 < x.tiles; p0 += kXTilesPerPanel)
    for (int64_t t = 0; t < rows; t += kTileRows)
      for (int64_t xt = p0; xt < std::min(x.tiles, p0 + kXTilesPerPanel); xt++) {
        const int64_t live = std::min<int64_t>(16, M - 16 * xt);
        float out[kTileRows][16];
        if (live > 8)
          vector_tile<F, 2, kBytes>(w, t, x, xt, out);
        else
          vector_tile<F, 1, kBytes>(w, t, x, xt, out);
        // y's columns n0 .. over the tile's rows of x, converted a column at once and stored a row at once.
        const int64_t n0 = part.first + r0 + t, columns = std::min<int64_t>(kTileRows, rows - t);
        T converted[kTileRows][16];
        for (int64_t r = 0; r < columns; r++)
          convert16(simd::add(simd::load(out[r]), simd::set1(bias != nullptr ? bias[n0 + r] : 0.0f)), converted[r]);
        for (int64_t m = 0; m < live; m++)
          for (int64_t r = 0; r < columns; r++) y[(16 * xt + m) * N + n0 + r] = converted[r][m];
      }
}

#if defined(NANOVLLM_SIMD_AMX)
// ---- Many rows on AMX tiles (the `amx` variant) -------------------------------------------
// The same sums as RowSums, bit for bit, with the integer part on tiles (simd::tiles): a
// chunk's 32 values of 16 weight rows against the same chunk of 16 rows of x give 16 x 16 chunk
// sums, exact in int32 as the AVX sums are. Each then meets the weight's and x's chunk scales
// in the lane of its chunk modulo 8, as RowSums::add_group leaves it, and the totals go through
// reduce_add8's tree: the same operations in the same order on the same values, only
// vectorised over sixteen rows of x instead of eight chunks. A weight's decoded words fit a
// byte: signed where the format has no offset (Q8_0, Q6_K: their values are centred), unsigned
// where it has one (the offsets carry the zero points).

// x's rows as the B tiles take them (for each tile of 16 rows and each chunk, 512 bytes of its
// values' low bytes and, where x has 16 bits, 512 of their high bytes), and their chunks' scales
// and sums by row; rows past M are zeros.
struct AmxX {
  int64_t tiles, chunks;
  bool byte_values;                // x of 8 bits: the low bytes are the values, no high bytes
  std::vector<uint8_t> high, low;  // [tile][chunk][8 x 64]
  std::vector<float> scale, sum;   // [tile][chunk][16]

  AmxX(const QuantizedRows& x, int64_t M)
      : tiles((M + 15) / 16), chunks(x.chunks), byte_values(x.bits == 8), high(byte_values ? 0 : tiles * chunks * 512),
        low(tiles * chunks * 512), scale(tiles * chunks * 16), sum(tiles * chunks * 16) {
    parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; m++)
        for (int64_t c = 0; c < chunks; c++) {
          const int64_t at = m / 16 * chunks + c;
          uint8_t* high_bytes = byte_values ? nullptr : &high[at * 512];
          if (c < x.chunks / 8 * 8)
            simd::tiles::store_chunk_column(x.values(m, c / 8 * 8), int(c % 8), high_bytes, &low[at * 512],
                                            int(m % 16));
          else  // a tail chunk, its values in order
            simd::tiles::store_tail_column(x.values(m, c), high_bytes, &low[at * 512], int(m % 16));
          scale[at * 16 + m % 16] = x.scale[m * chunks + c];
          sum[at * 16 + m % 16] = x.sum[m * chunks + c];
        }
    });
  }
};

// A block of a lanes format's rows as the A tiles take them (for each tile of 16 rows and each
// chunk, its 16 rows of 32 bytes), and the chunks' scales (two halves, the second unused where a
// chunk has one scale) and offsets by row, each as lanes_row_chunks gives it; rows past the
// block's are zeros.
struct AmxRows {
  int64_t tiles, chunks;
  std::vector<int8_t> values;  // [tile][chunk][16][32]
  std::vector<float> scales;   // [tile][chunk][half][16]
  std::vector<float> offsets;  // [tile][chunk][16]

  AmxRows(int64_t rows, int64_t K)
      : tiles((rows + 15) / 16), chunks(K / 32), values(tiles * chunks * 512), scales(tiles * chunks * 32),
        offsets(tiles * chunks * 16) {}

  // `rows` rows of F, w_stride bytes apart.
  template <class F>
  void decode(const uint8_t* w, int64_t w_stride, int64_t rows) {
    for (int64_t r = rows; r < tiles * 16; r++)  // the last tile's rows past the block: zeros
      for (int64_t c = 0; c < chunks; c++) {
        std::fill_n(bytes_of(r, c), 32, int8_t(0));
        set_scales<true>(r, c, 0.0f, 0.0f, 0.0f);
      }
    for (int64_t r = 0; r < rows; r++) {
      const uint8_t* row = w + r * w_stride;
      // A chunk of words (the word formats, a row's tail). Its stores written out: through
      // bytes_of and set_scales this per-chunk path measured slower (benchmarks/RESULTS.md).
      const auto chunk = [&](int64_t c, Words q, Vec8 scale, float offset) {
        const int64_t a = at(r, c), i = r % 16;
        simd::tiles::store_bytes(q, &values[(a * 16 + i) * 32]);
        scales[a * 2 * 16 + i] = simd::first_lane(scale);
        if constexpr (F::kScalePer16) scales[(a * 2 + 1) * 16 + i] = simd::first_lane(simd::high_half(scale));
        offsets[a * 16 + i] = offset;
      };
      if constexpr (kByteProducts<F>) {
        // Straight to bytes, as the byte tiles decode, less the bias that made them unsigned
        // where the format's values are signed.
        for (int64_t g = 0; g < chunks / 8; g++) {
          const uint8_t* group = row + g * F::kGroupBytes;
          simd::ByteQuad quads[4];
          for (int j = 0; j < 4; j++) quads[j] = F::byte_quad(group + F::kHeaderBytes, j);
          // A group's chunks are consecutive chunks of the row's tile: 512 bytes apart.
          simd::tiles::store_quads_in_order(quads, F::kByteBias, reinterpret_cast<uint8_t*>(bytes_of(r, 8 * g)), 512);
          float d[8], d_high[8], offset[8];
          const Vec8 scale = F::scales(group);
          simd::store8(d, scale);
          simd::store8(offset, F::offsets(group, scale));
          if constexpr (F::kScalePer16) simd::store8(d_high, F::high_scales(group));
          for (int l = 0; l < 8; l++)
            set_scales<F::kScalePer16>(r, 8 * g + l, d[l], F::kScalePer16 ? d_high[l] : 0.0f, offset[l]);
        }
        if constexpr (F::kTail)
          for (int64_t c = chunks / 8 * 8; c < chunks; c++) F::Base::chunks(row + c * F::kBytes, c, chunk);
      } else {
        lanes_row_chunks<F>(row, 32 * chunks, chunk);
      }
    }
  }

 private:
  // Row r's chunk c: its tile's chunk (`at`), and the row's 32 bytes in it.
  __attribute__((always_inline)) int64_t at(int64_t r, int64_t c) const { return r / 16 * chunks + c; }
  __attribute__((always_inline)) int8_t* bytes_of(int64_t r, int64_t c) { return &values[(at(r, c) * 16 + r % 16) * 32]; }
  // Its scale, its second half's where kBothHalves (else left unused), and its offset.
  template <bool kBothHalves>
  __attribute__((always_inline)) void set_scales(int64_t r, int64_t c, float d, float d_high, float offset) {
    const int64_t a = at(r, c), i = r % 16;
    scales[a * 2 * 16 + i] = d;
    if constexpr (kBothHalves) scales[(a * 2 + 1) * 16 + i] = d_high;
    offsets[a * 16 + i] = offset;
  }
};

// out[r][m] = row 16 nt + r of w . x row 16 mt + m (x's values bytes where kByteX). Lane l of
// RowSums (chunks l, l + 8, ..) is summed apart from the other lanes, as they meet only in the
// totals: its sixteen rows' sums stay in registers through the row.
template <class F, bool kByteX>
void amx_tile(const AmxRows& w, int64_t nt, const AmxX& x, int64_t mt, float (&out)[16][16]) {
  constexpr int kHalves = F::kScalePer16 ? 2 : 1;
  const int64_t C = w.chunks;
  simd::tiles::Sums<kByteX> sums;
  simd::Vec lanes[8][16];  // RowSums' acc + offsets: [chunk % 8][weight row] over 16 rows of x
  for (int l = 0; l < 8; l++) {
    simd::Vec acc[16];
    for (int r = 0; r < 16; r++) acc[r] = simd::zero();
    for (int64_t c = l; c < C; c += 8) {
      const int64_t wc = nt * C + c, xc = mt * C + c;
      const simd::Vec xs = simd::load(&x.scale[xc * 16]);
#pragma GCC unroll 2
      for (int h = 0; h < kHalves; h++) {
        sums.template compute<!F::kOffset>(&w.values[wc * 512 + 16 * h], 32,
                                           kByteX ? nullptr : &x.high[xc * 512 + 256 * h], &x.low[xc * 512 + 256 * h]);
        const float* d = &w.scales[(wc * 2 + h) * 16];
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) acc[r] = simd::fmadd(sums.row(r), simd::mul(simd::set1(d[r]), xs), acc[r]);
      }
    }
    simd::Vec offsets[16];
    for (int r = 0; r < 16; r++) offsets[r] = simd::zero();
    if constexpr (F::kOffset)
      for (int64_t c = l; c < C / 8 * 8; c += 8) {
        const simd::Vec xsum = simd::load(&x.sum[(mt * C + c) * 16]);
        const float* o = &w.offsets[(nt * C + c) * 16];
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) offsets[r] = simd::fmadd(simd::set1(o[r]), xsum, offsets[r]);
      }
    for (int r = 0; r < 16; r++) lanes[l][r] = simd::add(acc[r], offsets[r]);
  }
  for (int r = 0; r < 16; r++) {
    simd::Vec tail_offsets = simd::zero();  // RowSums::tail_offsets: the tail chunks' in turn
    if constexpr (F::kOffset)
      for (int64_t c = C / 8 * 8; c < C; c++)
        tail_offsets = simd::fmadd(simd::set1(w.offsets[(nt * C + c) * 16 + r]), simd::load(&x.sum[(mt * C + c) * 16]),
                                   tail_offsets);
    const auto s = [&](int l) { return lanes[l][r]; };
    const simd::Vec total = simd::add(simd::add(simd::add(s(0), s(4)), simd::add(s(2), s(6))),
                                      simd::add(simd::add(s(1), s(5)), simd::add(s(3), s(7))));
    simd::store(out[r], simd::add(total, tail_offsets));
  }
}

// The first n of 16 outputs, as y's type.
inline void store_outputs(float* y, simd::Vec x, int64_t n) { simd::store_first(y, x, n); }
inline void store_outputs(BFloat16* y, simd::Vec x, int64_t n) { simd::store_bf16(y, x, n); }

// A block of a part's rows (from r0, decoded in tiles) against every row of x, on tiles.
template <class F, typename T>
void amx_block(const AmxRows& tiles, const Part& part, int64_t r0, int64_t rows, const AmxX& x, int64_t M,
               const float* bias, T* y, int64_t N) {
  simd::tiles::configure(F::kScalePer16 ? 16 : 32);
  constexpr int64_t kPanelTiles = 6;  // x tiles a weight tile meets in turn, in cache meanwhile
  for (int64_t p0 = 0; p0 < x.tiles; p0 += kPanelTiles)
    for (int64_t nt = 0; nt < tiles.tiles; nt++)
      for (int64_t mt = p0; mt < std::min(x.tiles, p0 + kPanelTiles); mt++) {
        float out[16][16];
        if (x.byte_values)
          amx_tile<F, true>(tiles, nt, x, mt, out);
        else
          amx_tile<F, false>(tiles, nt, x, mt, out);
        // Row m of x's 16 outputs, over 16 consecutive weight rows: a column of out.
        const int64_t n0 = part.first + r0 + 16 * nt, live = std::min<int64_t>(16, rows - 16 * nt);
        const simd::Vec b = bias != nullptr ? simd::load_first(bias + n0, live, 0.0f) : simd::zero();
        for (int64_t m = 0; m < std::min<int64_t>(16, M - 16 * mt); m++)
          store_outputs(y + (16 * mt + m) * N + n0, simd::add(simd::tiles::column(out, int(m)), b), live);
      }
  simd::tiles::release();
}
#endif  // NANOVLLM_SIMD_AMX

// y = x W^T (+ bias) over parts in lanes formats, tiled: one task a block of a part's rows.
template <typename T>
void tiled_linear(const QuantizedRows& xq, const std::vector<Part>& parts, const float* bias, T* y, int64_t M,
                  int64_t N, int64_t K) {
#if defined(NANOVLLM_SIMD_AMX)
  // In a process granted the tiles' state.
  std::optional<AmxX> amx_x;
  if (simd::tiles::permitted()) amx_x.emplace(xq, M);
  const int64_t per_block = block_rows(N, K, amx_x ? 16 : kTileRows);
#else
  const int64_t per_block = block_rows(N, K, kTileRows);
  constexpr bool amx_x = false;
#endif
  // Whether a part's tiles multiply bytes (else pairs of words).
  const auto takes_bytes = [&](const Part& part) { return xq.byte_products && has_byte_products(part); };
  std::optional<TiledX> tiled_x;  // the vector tiles' x (not made where AMX tiles multiply)
  if (!amx_x)
    tiled_x.emplace(xq, M, !std::all_of(parts.begin(), parts.end(), takes_bytes));
  std::vector<std::pair<const Part*, int64_t>> blocks;  // each part's blocks of rows: (part, first row)
  for (const Part& part : parts)
    for (int64_t r = 0; r < part.rows; r += per_block) blocks.emplace_back(&part, r);
  parallel_for(0, int64_t(blocks.size()), 1, [&](int64_t begin, int64_t end) {
#if defined(NANOVLLM_SIMD_AMX)
    std::optional<AmxRows> amx_rows;
    if (amx_x) amx_rows.emplace(per_block, K);
#endif
    std::optional<DecodeBuffers> buffers;  // the AVX tiles' (not made where AMX tiles multiply)
    for (int64_t b = begin; b < end; b++) {
      const auto [part, r0] = blocks[b];
      const int64_t rows = std::min<int64_t>(per_block, part->rows - r0);
      with_lanes_format(part->type, [&](auto format) {
        using F = decltype(format);
#if defined(NANOVLLM_SIMD_AMX)
        if (amx_x) {
          amx_rows->decode<F>(part->w + r0 * part->w_stride, part->w_stride, rows);
          return amx_block<F>(*amx_rows, *part, r0, rows, *amx_x, M, bias, y, N);
        }
#endif
        if (!buffers) buffers.emplace(per_block, K);
        DecodedRows<F> w = buffers->rows<F>();
        const uint8_t* first = part->w + r0 * part->w_stride;
        if constexpr (kByteProducts<F>)
          if (xq.byte_products) {
            w.template decode<true>(first, part->w_stride, rows);
            return vector_block<F, true>(w, *part, r0, rows, *tiled_x, M, bias, y, N);
          }
        w.template decode<false>(first, part->w_stride, rows);
        vector_block<F, false>(w, *part, r0, rows, *tiled_x, M, bias, y, N);
      });
    }
  });
}

template <class F>
void check_blocks(const at::Tensor& blocks, int64_t K) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.stride(1) == 1,
              "GGUF blocks must be uint8 [N, row bytes] with contiguous rows");
  TORCH_CHECK(K % F::kValues == 0, "K=", K, " is not a multiple of the format's block of ", F::kValues, " values");
  TORCH_CHECK(blocks.size(1) >= K / F::kValues * F::kBytes, "GGUF rows hold ", blocks.size(1), " bytes; K=", K,
              " needs ", K / F::kValues * F::kBytes);
}

// y = x W^T (+ bias) over a weight in `parts` (lanes layouts) covering N output columns.
at::Tensor linear_over_parts(const char* op, const at::Tensor& x, const std::vector<Part>& parts, int64_t N,
                             const std::optional<at::Tensor>& bias, int64_t max_streaming_rows,
                             int64_t activation_bits) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op, ": x must be bf16 or fp32");
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, op, ": activation_bits is ", activation_bits,
              "; x is quantized to 8 or 16 bits");
  const int64_t K = x.size(-1);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, op, ": bias has ", bias->numel(), " values, not ", N);
    b32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = b32.defined() ? b32.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());
  // Decided once a call: whether x meets any part's weights as bytes, which both kernels read.
  const bool byte_products = activation_bits == 8 && std::any_of(parts.begin(), parts.end(), has_byte_products);
  const auto run = [&](auto* x_rows, auto* y_rows) {
    const QuantizedRows xq(x_rows, K, M, K, activation_bits, byte_products, M <= max_streaming_rows);
    if (M > max_streaming_rows)
      tiled_linear(xq, parts, b, y_rows, M, N, K);
    else
      streaming_linear(xq, parts, b, y_rows, M, N, K);
  };
  if (x.scalar_type() == at::kFloat)
    run(rows.data_ptr<float>(), y.data_ptr<float>());
  else
    run(rows.data_ptr<BFloat16>(), y.data_ptr<BFloat16>());
  return y.view(shape);
}

}  // namespace

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                       const std::optional<at::Tensor>& bias, int64_t max_streaming_rows, int64_t activation_bits) {
  const int64_t N = blocks.size(0);
  with_lanes_format(type, [&](auto format) { check_blocks<decltype(format)>(blocks, x.size(-1)); });
  return linear_over_parts("gguf_linear", x, {Part{type, blocks.data_ptr<uint8_t>(), blocks.stride(0), 0, N}}, N, bias,
                           max_streaming_rows, activation_bits);
}

int64_t gguf_parts_rows(const at::Tensor& parts) {
  TORCH_CHECK(parts.dim() == 2 && parts.size(1) == 2 && parts.size(0) > 0 && parts.scalar_type() == at::kLong &&
                  parts.is_contiguous(), "gguf_linear_parts: parts must be int64 [parts, 2]: (rows, GGUF type)");
  const int64_t* table = parts.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t p = 0; p < parts.size(0); p++) {
    TORCH_CHECK(table[2 * p] > 0, "gguf_linear_parts: part ", p, " has ", table[2 * p], " rows");
    rows += table[2 * p];
  }
  return rows;
}

at::Tensor gguf_linear_parts(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts,
                             int64_t out_features, const std::optional<at::Tensor>& bias, int64_t max_streaming_rows,
                             int64_t activation_bits) {
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "gguf_linear_parts: the parts' rows as one contiguous uint8 tensor");
  const int64_t N = gguf_parts_rows(parts);
  TORCH_CHECK(N == out_features, "gguf_linear_parts: the parts hold ", N, " rows, not out_features=", out_features);
  const int64_t K = x.size(-1);
  const int64_t* table = parts.data_ptr<int64_t>();
  std::vector<Part> list;
  int64_t first = 0, offset = 0;
  for (int64_t p = 0; p < parts.size(0); p++) {
    const int64_t rows = table[2 * p], type = table[2 * p + 1];
    with_lanes_format(type, [&](auto format) {
      using F = decltype(format);
      TORCH_CHECK(K % F::kValues == 0, "K=", K, " is not a multiple of the format's block of ", F::kValues, " values");
      const int64_t row_bytes = K / F::kValues * F::kBytes;
      list.push_back(Part{type, blocks.data_ptr<uint8_t>() + offset, row_bytes, first, rows});
      offset += rows * row_bytes;
    });
    first += rows;
  }
  TORCH_CHECK(offset == blocks.numel(), "gguf_linear_parts: the parts' rows take ", offset, " bytes; blocks hold ",
              blocks.numel());
  return linear_over_parts("gguf_linear_parts", x, list, N, bias, max_streaming_rows, activation_bits);
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t in_features) {
  at::Tensor out;
  with_format(type, [&](auto format) {
    using F = decltype(format);
    check_blocks<F>(blocks, in_features);
    out = at::empty({blocks.size(0), in_features}, blocks.options().dtype(at::kFloat));
    dequantize_rows<F>(blocks.data_ptr<uint8_t>(), blocks.stride(0), blocks.size(0), in_features,
                       out.data_ptr<float>());
  });
  return out;
}

at::Tensor gguf_repack(const at::Tensor& blocks, int64_t type, int64_t in_features) {
  at::Tensor out;
  // Each row of `format` (the file's) into `lanes`'s layout by repack_row.
  const auto repack = [&](auto format, auto lanes, auto repack_row) {
    using Base = decltype(format);
    check_blocks<Base>(blocks, in_features);
    const int64_t row_bytes = in_features / decltype(lanes)::kValues * decltype(lanes)::kBytes;
    out = at::empty({blocks.size(0), row_bytes}, blocks.options());
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    parallel_for(0, blocks.size(0), 64, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; n++) repack_row(src + n * blocks.stride(0), in_features, dst + n * row_bytes);
    });
  };
  switch (type) {
    case Q8_0::kType: repack(Q8_0{}, Lanes<Q8_0>{}, repack_lanes<Q8_0>); break;
    case Q4_0::kType: repack(Q4_0{}, Lanes<Q4_0>{}, repack_lanes<Q4_0>); break;
    case Q4_1::kType: repack(Q4_1{}, Lanes<Q4_1>{}, repack_lanes<Q4_1>); break;
    case Q5_0::kType: repack(Q5_0{}, Lanes<Q5_0>{}, repack_lanes<Q5_0>); break;
    case Q5_1::kType: repack(Q5_1{}, Lanes<Q5_1>{}, repack_lanes<Q5_1>); break;
    case Q4_K::kType: repack(Q4_K{}, Q4_KLanes{}, repack_k_lanes<Q4_K, Q4_KLanes>); break;
    case Q5_K::kType: repack(Q5_K{}, Q5_KLanes{}, repack_k_lanes<Q5_K, Q5_KLanes>); break;
    case Q6_K::kType: repack(Q6_K{}, Q6_KLanes{}, repack_q6_k_lanes); break;
    case IQ4_NL::kType: repack(IQ4_NL{}, Lanes<IQ4_NL>{}, repack_lanes<IQ4_NL>); break;
    case IQ4_XS::kType: repack(IQ4_XS{}, IQ4_XSLanes{}, repack_iq4_xs_lanes); break;
    default:
      TORCH_CHECK(false, "gguf_repack: GGUF type ", type, " has no lanes layout; Q4_0 (2), Q4_1 (3), Q5_0 (6), "
                  "Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14), IQ4_NL (20) and IQ4_XS (23) have");
  }
  return out;
}

}  // namespace nanovllm_cpu
