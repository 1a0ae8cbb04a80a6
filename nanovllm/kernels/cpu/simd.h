// The small SIMD layer every CPU kernel file includes: sixteen fp32 lanes (`Vec`) and bf16 pairs
// ready for dot products (`Pairs`), over whichever instruction set the build targets. The kernels
// are written once against it; only this file knows the ISA.
//
//   avx512: AVX512F + BW + VL + BF16 + VNNI (Zen 4, Sapphire Rapids and later): a Vec is one zmm
//           register, a dot product over bf16 pairs is one vdpbf16ps, over 16-bit integer pairs
//           one vpdpwssd.
//   amx:    avx512 with AMX-TILE and AMX-INT8 (Sapphire Rapids and later): the same layer and
//           tiles:: (NANOVLLM_SIMD_AMX says so), on which the quantized kernels' many-row path
//           multiplies (quantized.cpp).
//   avx2:   AVX2 + FMA + F16C (Haswell, Zen 1-3, Alder Lake): a Vec is two ymm registers; bf16
//           widens to fp32 exactly (a shift or a mask: a bf16 is the top half of an fp32) and the
//           pairs' products are two FMAs.
//   none:   plain C++ loops over 16 floats, for any other CPU: correct, the compiler's to
//           vectorise; the engine does not switch onto the kernels there (kernels/cpu.py).
//
// The build picks the ISA by its -m flags (kernels/cpu.py passes one set per variant), so one
// machine can build and test every variant it can execute.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#define NANOVLLM_SIMD_AVX512 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NANOVLLM_SIMD_AVX2 1
#include <immintrin.h>
#endif

namespace nanovllm_cpu::simd {

using at::BFloat16;

// exp's polynomial: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], relative error ~2e-7.
// Arguments are clamped to [-87, 89]: below, a tiny normal float instead of one smaller still;
// from 89 (past ~88.72) up, 2^128 = +inf, as exp's own overflow.
inline constexpr float kExpLow = -87.0f, kExpHigh = 89.0f, kLog2e = 1.44269504089f, kLn2 = 0.693147180560f;
inline constexpr float kExpPoly[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

// Whether dot_quad and dot_bytes add into their sums in the multiply itself (VNNI: the avx512
// variant), so that sums taking products one after another wait on its latency each time.
#if defined(NANOVLLM_SIMD_AVX512)
inline constexpr bool kProductsChain = true;
#else
inline constexpr bool kProductsChain = false;
#endif

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
// Into L2 only (prefetcht1): for streams whose lines in flight outnumber L1's misses, which L2's
// deeper queue keeps going (paged attention's blocks, the row kernel's far prefetch:
// benchmarks/RESULTS.md).
inline void prefetch_to_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#if defined(NANOVLLM_SIMD_AVX512)

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define NANOVLLM_SIMD_AMX 1
inline constexpr const char* kIsa = "amx";
#else
inline constexpr const char* kIsa = "avx512";
#endif
inline constexpr int kRegisters = 32;  // vector registers
inline constexpr int kRegistersPerVec = 1;
inline constexpr bool kBf16Arithmetic = true;  // the CPU multiplies bf16 (oneDNN's GEMM too)

struct Vec {
  __m512 v;
};
// The first min(n, 16) lanes.
inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1); }
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec set1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// x as computed, opaque to the compiler: a product passed through it is not contracted with
// the add that follows into one FMA (GCC contracts intrinsics too), so it rounds as eager's ops.
inline Vec rounded(Vec x) {
  asm("" : "+v"(x.v));
  return x;
}
inline float reduce_add(Vec x) { return _mm512_reduce_add_ps(x.v); }
inline float reduce_max(Vec x) { return _mm512_reduce_max_ps(x.v); }
// Lanes from n on take `fill`.
inline Vec keep_first(Vec x, int64_t n, Vec fill) { return {_mm512_mask_blend_ps(first(n), fill.v, x.v)}; }
// x where a > b (ordered), else 0.
inline Vec where_greater(Vec a, Vec b, Vec x) { return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), x.v)}; }
// Bit j set where lane j is > 0.
inline uint32_t positive_lanes(Vec x) { return _mm512_cmp_ps_mask(x.v, _mm512_setzero_ps(), _CMP_GT_OQ); }

// Up to 16 floats from p (min(n, 16) of them); the rest take `fill`.
inline Vec load_first(const float* p, int64_t n, float fill) {
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), p)};
}
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x.v); }
inline void store_first(float* p, Vec x, int64_t n) { _mm512_mask_storeu_ps(p, first(n), x.v); }
inline Vec widen_bf16(__m256i x) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16))}; }
// min(n, 16) bf16 values from p widened to fp32; the rest are 0.
inline Vec load_bf16(const BFloat16* p, int64_t n = 16) { return widen_bf16(_mm256_maskz_loadu_epi16(first(n), p)); }
// The first min(n, 16) lanes rounded to bf16 (nearest even) and stored at p.
inline void store_bf16(BFloat16* p, Vec x, int64_t n = 16) {
  _mm256_mask_storeu_epi16(p, first(n), (__m256i)_mm512_cvtneps_pbh(x.v));
}
// x rounded to bf16 and widened back, as a bf16 intermediate in eager PyTorch.
inline Vec round_bf16(Vec x) { return widen_bf16((__m256i)_mm512_cvtneps_pbh(x.v)); }

inline Vec exp(Vec x) {
  const __m512 c = _mm512_min_ps(_mm512_max_ps(x.v, _mm512_set1_ps(kExpLow)), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2), c);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return {_mm512_scalef_ps(p, n)};
}

// Sixteen bf16 pairs (64 bytes, pair j = lanes 2j, 2j+1) ready for dot products, and one pair
// of bf16 scalars broadcast to all lanes: dot(acc, w, x)[j] = acc[j] + w.a[j] * x.a + w.b[j] * x.b.
struct Pairs {
  __m512bh v;
};
inline Pairs load_pairs(const BFloat16* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
// As load_pairs, with the second value of every pair taken as 0.
inline Pairs load_pairs_first_only(const BFloat16* p) { return {(__m512bh)_mm512_maskz_loadu_epi16(0x55555555u, p)}; }
// A pair of scalars as the kernels keep them between uses: here its two bf16s' bits.
struct Pair {
  uint32_t bits;
};
inline constexpr bool kPairIsTwoBf16 = true;  // a Pair's memory is the two bf16s themselves
inline Pair make_pair(const BFloat16* p) {
  Pair pair;
  std::memcpy(&pair.bits, p, 4);
  return pair;
}
inline Pair make_pair(BFloat16 a, BFloat16 b) {
  const BFloat16 both[2] = {a, b};
  return make_pair(both);
}
struct Broadcast {
  __m512bh v;
};
inline Broadcast broadcast(Pair x) { return {(__m512bh)_mm512_set1_epi32(int(x.bits))}; }
inline Vec dot(Vec acc, Pairs w, Broadcast x) { return {_mm512_dpbf16_ps(acc.v, w.v, x.v)}; }

#if defined(NANOVLLM_SIMD_AMX)
// AMX-INT8 tiles, for the quantized kernels' many-row path (quantized.cpp): the integer sums of
// 32-value chunks of 16 weight rows against 16 rows of x, whose 16-bit values go in as two byte
// tiles, their high bytes (signed) and low bytes (unsigned), the sum being 256 high + low.
namespace tiles {

// Linux grants a process the tile registers' state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction faults.
inline bool permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Chunk l (of 8) of a group of 256 words in the lanes layout (value j of chunk l in vector
// j / 2, word 2l + j % 2), its 32 values in order: dword v of it is the group's dword 8v + l.
inline __m512i chunk_words(const int16_t* group, int l) {
  const __m512i index = _mm512_add_epi32(
      _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120), _mm512_set1_epi32(l));
  return _mm512_i32gather_epi32(index, group, 4);
}

// 32 words as column `column` of B tiles (TDPB*D's layout: eight rows of 64 bytes, values 4k to
// 4k + 3 of each of 16 columns in row k): their low bytes, and where `high` is given their high
// bytes. Words of 8-bit x (|q| <= 127) need no high bytes: the low byte, signed, is the value.
inline void store_column(__m512i words, uint8_t* high, uint8_t* low, int column) {
  const __m256i rows = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  if (high != nullptr) _mm256_i32scatter_epi32(high + 4 * column, rows, _mm512_cvtepi16_epi8(_mm512_srai_epi16(words, 8)), 4);
  _mm256_i32scatter_epi32(low + 4 * column, rows, _mm512_cvtepi16_epi8(words), 4);
}
// Chunk l of a group in the lanes layout as column `column` of x's B tiles.
inline void store_chunk_column(const int16_t* group, int l, uint8_t* high, uint8_t* low, int column) {
  store_column(chunk_words(group, l), high, low, column);
}
// A row's tail chunk (32 words in order) as column `column` of x's B tiles.
inline void store_tail_column(const int16_t* chunk, uint8_t* high, uint8_t* low, int column) {
  store_column(_mm512_loadu_si512(chunk), high, low, column);
}

// Column m of a 16 x 16 block of fp32: its rows' element m.
inline Vec column(const float (&block)[16][16], int m) {
  const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  return {_mm512_i32gather_ps(rows, &block[0][m], 4)};
}

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tiles for dot products of k values (32, a chunk; 16, half a chunk): 0 and 1 the
// high and low sums (16 x 16 int32), 2 the weights (16 rows of k bytes), 3 and 4 x's high and
// low bytes (k / 4 rows of 64). Released by release().
inline void configure(int k) {
  Config config;
  config.rows[0] = config.rows[1] = config.rows[2] = 16;
  config.colsb[0] = config.colsb[1] = config.colsb[3] = config.colsb[4] = 64;
  config.colsb[2] = uint16_t(k);
  config.rows[3] = config.rows[4] = uint8_t(k / 4);
  _tile_loadconfig(&config);
}
inline void release() { _tile_release(); }

// sums[r][m] = row r of w (16 rows of k bytes, w_stride apart; signed or not) . column m of x,
// exact. x of 16 bits comes as B tiles of its high and low bytes, the sum left as its two halves
// (256 (w . high) + w . low); x of 8 bits (kByteX) as one B tile of its values, signed: one
// product where words take two.
template <bool kByteX>
struct Sums {
  alignas(64) int32_t high[kByteX ? 1 : 16][16], low[16][16];

  template <bool kSignedWeights>
  void compute(const int8_t* w, int64_t w_stride, const uint8_t* x_high, const uint8_t* x_low) {
    _tile_loadd(2, w, w_stride);
    _tile_loadd(4, x_low, 64);
    _tile_zero(1);
    if constexpr (kByteX) {
      if constexpr (kSignedWeights)
        _tile_dpbssd(1, 2, 4);
      else
        _tile_dpbusd(1, 2, 4);
    } else {
      _tile_loadd(3, x_high, 64);
      _tile_zero(0);
      if constexpr (kSignedWeights) {
        _tile_dpbssd(0, 2, 3);
        _tile_dpbsud(1, 2, 4);
      } else {
        _tile_dpbusd(0, 2, 3);
        _tile_dpbuud(1, 2, 4);
      }
      _tile_stored(0, high, 64);
    }
    _tile_stored(1, low, 64);
  }
  // Row r's sixteen sums, converted to fp32 (as to_float converts the AVX sums).
  Vec row(int r) const {
    __m512i sums = _mm512_load_si512(low[r]);
    if constexpr (!kByteX) sums = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high[r]), 8), sums);
    return {_mm512_cvtepi32_ps(sums)};
  }
};

}  // namespace tiles
#endif  // NANOVLLM_SIMD_AMX

#elif defined(NANOVLLM_SIMD_AVX2)

inline constexpr const char* kIsa = "avx2";
inline constexpr int kRegisters = 16;
inline constexpr int kRegistersPerVec = 2;
inline constexpr bool kBf16Arithmetic = false;

struct Vec {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
// All-ones in the 32-bit lanes below n (for lanes base..base+7).
inline __m256i first8(int64_t n, int base) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::clamp<int64_t>(n, 0, 16))),
                            _mm256_add_epi32(_mm256_set1_epi32(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec rounded(Vec x) {
  asm("" : "+x"(x.lo), "+x"(x.hi));
  return x;
}
inline float reduce8(__m256 x, __m128 (*op)(__m128, __m128)) {
  __m128 r = op(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  r = op(r, _mm_movehl_ps(r, r));
  r = op(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
inline float reduce_add(Vec x) { return reduce8(_mm256_add_ps(x.lo, x.hi), [](__m128 a, __m128 b) { return _mm_add_ps(a, b); }); }
inline float reduce_max(Vec x) { return reduce8(_mm256_max_ps(x.lo, x.hi), [](__m128 a, __m128 b) { return _mm_max_ps(a, b); }); }
inline Vec keep_first(Vec x, int64_t n, Vec fill) {
  return {_mm256_blendv_ps(fill.lo, x.lo, _mm256_castsi256_ps(first8(n, 0))),
          _mm256_blendv_ps(fill.hi, x.hi, _mm256_castsi256_ps(first8(n, 8)))};
}
inline Vec where_greater(Vec a, Vec b, Vec x) {
  return {_mm256_and_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), x.lo), _mm256_and_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ), x.hi)};
}
inline uint32_t positive_lanes(Vec x) {
  const __m256 z = _mm256_setzero_ps();
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.lo, z, _CMP_GT_OQ))) |
         uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.hi, z, _CMP_GT_OQ))) << 8;
}

inline Vec load_first(const float* p, int64_t n, float fill) {
  if (n >= 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  const __m256i mlo = first8(n, 0), mhi = first8(n, 8);
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, _mm256_maskload_ps(p, mlo), _mm256_castsi256_ps(mlo)),
          _mm256_blendv_ps(f, _mm256_maskload_ps(p + 8, mhi), _mm256_castsi256_ps(mhi))};
}
inline Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, Vec x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline __m256 widen8(__m128i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)); }
inline Vec widen_bf16(__m256i x) { return {widen8(_mm256_castsi256_si128(x)), widen8(_mm256_extracti128_si256(x, 1))}; }
inline Vec load_bf16(const BFloat16* p, int64_t n = 16) {
  if (n >= 16) return widen_bf16(_mm256_loadu_si256((const __m256i*)p));
  alignas(32) uint16_t tail[16] = {};
  std::memcpy(tail, p, std::max<int64_t>(n, 0) * 2);
  return widen_bf16(_mm256_load_si256((const __m256i*)tail));
}
// Eight fp32 lanes to bf16 bits in their 32-bit lanes, rounded to nearest even as c10::BFloat16
// rounds (NaN to the quiet NaN 0x7fc0).
inline __m256i narrow8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
inline __m256i narrow_bf16(Vec x) {
  // packus interleaves the 128-bit halves: lo0-3 hi0-3 lo4-7 hi4-7 -> reorder the quarters.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(narrow8(x.lo), narrow8(x.hi)), 0xd8);
}
inline void store_bf16(BFloat16* p, Vec x, int64_t n = 16) {
  const __m256i bits = narrow_bf16(x);
  if (n >= 16) {
    _mm256_storeu_si256((__m256i*)p, bits);
    return;
  }
  alignas(32) uint16_t tail[16];
  _mm256_store_si256((__m256i*)tail, bits);
  std::memcpy(p, tail, std::max<int64_t>(n, 0) * 2);
}
inline Vec round_bf16(Vec x) { return widen_bf16(narrow_bf16(x)); }

inline __m256 exp8(__m256 x) {
  const __m256 c = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2), c);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  // 2^n from its exponent bits, n in [-126, 128]: 2^128 is not a float, so n = 128 builds
  // 2^127 and doubles the product (finite below exp's overflow at ~88.72, +inf above it).
  const __m256 n127 = _mm256_min_ps(n, _mm256_set1_ps(127.0f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n127), _mm256_set1_epi32(127)), 23);
  const __m256 twice = _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(2.0f), _mm256_cmp_ps(n, n127, _CMP_GT_OQ));
  return _mm256_mul_ps(_mm256_mul_ps(p, twice), _mm256_castsi256_ps(pow2n));
}
inline Vec exp(Vec x) { return {exp8(x.lo), exp8(x.hi)}; }

// Pairs widened: a holds each pair's first value, b its second, as fp32 (a shift and a mask).
struct Pairs {
  Vec a, b;
};
inline void widen_pairs(__m256i x, __m256& a, __m256& b) {
  a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u))));
}
inline Pairs load_pairs(const BFloat16* p) {
  Pairs w;
  widen_pairs(_mm256_loadu_si256((const __m256i*)p), w.a.lo, w.b.lo);
  widen_pairs(_mm256_loadu_si256((const __m256i*)(p + 16)), w.a.hi, w.b.hi);
  return w;
}
inline Pairs load_pairs_first_only(const BFloat16* p) {
  Pairs w = load_pairs(p);
  w.b = zero();
  return w;
}
// Scalars widened once, where they are made, rather than at every broadcast.
struct Pair {
  float a, b;
};
inline constexpr bool kPairIsTwoBf16 = false;
inline Pair make_pair(BFloat16 a, BFloat16 b) { return {float(a), float(b)}; }
inline Pair make_pair(const BFloat16* p) { return make_pair(p[0], p[1]); }
struct Broadcast {
  __m256 a, b;
};
inline Broadcast broadcast(Pair x) { return {_mm256_set1_ps(x.a), _mm256_set1_ps(x.b)}; }
inline Vec dot(Vec acc, const Pairs& w, Broadcast x) {
  return {_mm256_fmadd_ps(w.b.lo, x.b, _mm256_fmadd_ps(w.a.lo, x.a, acc.lo)),
          _mm256_fmadd_ps(w.b.hi, x.b, _mm256_fmadd_ps(w.a.hi, x.a, acc.hi))};
}

#else  // none: plain loops

inline constexpr const char* kIsa = "none";
inline constexpr int kRegisters = 16;
inline constexpr int kRegistersPerVec = 2;
inline constexpr bool kBf16Arithmetic = false;

struct Vec {
  float v[16];
};
template <typename F>
inline Vec map(F f) {
  Vec r;
  for (int j = 0; j < 16; j++) r.v[j] = f(j);
  return r;
}
inline Vec zero() { return map([](int) { return 0.0f; }); }
inline Vec set1(float x) { return map([x](int) { return x; }); }
inline Vec add(Vec a, Vec b) { return map([&](int j) { return a.v[j] + b.v[j]; }); }
inline Vec sub(Vec a, Vec b) { return map([&](int j) { return a.v[j] - b.v[j]; }); }
inline Vec mul(Vec a, Vec b) { return map([&](int j) { return a.v[j] * b.v[j]; }); }
inline Vec div(Vec a, Vec b) { return map([&](int j) { return a.v[j] / b.v[j]; }); }
inline Vec max(Vec a, Vec b) { return map([&](int j) { return a.v[j] > b.v[j] ? a.v[j] : b.v[j]; }); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return map([&](int j) { return std::fma(a.v[j], b.v[j], c.v[j]); }); }
inline Vec rounded(Vec x) {
  asm("" : "+m"(x));
  return x;
}
inline float reduce_add(Vec x) {
  float s = 0;
  for (float v : x.v) s += v;
  return s;
}
inline float reduce_max(Vec x) {
  float m = x.v[0];
  for (float v : x.v) m = v > m ? v : m;
  return m;
}
inline Vec keep_first(Vec x, int64_t n, Vec fill) { return map([&](int j) { return j < n ? x.v[j] : fill.v[j]; }); }
inline Vec where_greater(Vec a, Vec b, Vec x) { return map([&](int j) { return a.v[j] > b.v[j] ? x.v[j] : 0.0f; }); }
inline uint32_t positive_lanes(Vec x) {
  uint32_t bits = 0;
  for (int j = 0; j < 16; j++) bits |= uint32_t(x.v[j] > 0) << j;
  return bits;
}
inline Vec load_first(const float* p, int64_t n, float fill) { return map([&](int j) { return j < n ? p[j] : fill; }); }
inline Vec load(const float* p) { return map([&](int j) { return p[j]; }); }
inline void store(float* p, Vec x) { std::memcpy(p, x.v, sizeof(x.v)); }
inline Vec load_bf16(const BFloat16* p, int64_t n = 16) { return map([&](int j) { return j < n ? float(p[j]) : 0.0f; }); }
inline void store_bf16(BFloat16* p, Vec x, int64_t n = 16) {
  for (int j = 0; j < 16 && j < n; j++) p[j] = BFloat16(x.v[j]);
}
inline Vec round_bf16(Vec x) { return map([&](int j) { return float(BFloat16(x.v[j])); }); }
inline Vec exp(Vec x) {
  return map([&](int j) {
    const float c = std::min(std::max(x.v[j], kExpLow), kExpHigh), n = std::nearbyint(c * kLog2e);
    const float r = std::fma(-n, kLn2, c);
    float p = kExpPoly[0];
    for (int i = 1; i < 7; i++) p = std::fma(p, r, kExpPoly[i]);
    return std::ldexp(p, int(n));
  });
}

struct Pairs {
  Vec a, b;
};
inline Pairs load_pairs(const BFloat16* p) {
  return {map([&](int j) { return float(p[2 * j]); }), map([&](int j) { return float(p[2 * j + 1]); })};
}
inline Pairs load_pairs_first_only(const BFloat16* p) { return {load_pairs(p).a, zero()}; }
struct Pair {
  float a, b;
};
inline constexpr bool kPairIsTwoBf16 = false;
inline Pair make_pair(BFloat16 a, BFloat16 b) { return {float(a), float(b)}; }
inline Pair make_pair(const BFloat16* p) { return make_pair(p[0], p[1]); }
using Broadcast = Pair;
inline Broadcast broadcast(Pair x) { return x; }
inline Vec dot(Vec acc, const Pairs& w, Broadcast x) {
  return map([&](int j) { return std::fma(w.b.v[j], x.b, std::fma(w.a.v[j], x.a, acc.v[j])); });
}

#endif

// ---- Quantized blocks: the GGUF kernels' integer dot products -------------------------------
// A chunk of 32 weights is decoded to 16-bit integers (`Words`: lo holds values 0-15, hi 16-31),
// from 4, 6 or 8 bits (through `Bytes`, 32 8-bit values, where the bits need assembling), and meets
// 32 16-bit integers of x in a dot product of eight int32 partial sums (`Sums`), turned into eight
// fp32 lanes (`Vec8`) and scaled. `dot` leaves the lanes in any order (a row's tail chunk, summed
// whole). The 256-bit AVX2 code serves AVX-512 too, whose VNNI multiplies and accumulates 16-bit
// pairs in one instruction (vpdpwssd) instead of two.

#if defined(NANOVLLM_SIMD_AVX512) || defined(NANOVLLM_SIMD_AVX2)

struct Bytes {
  __m256i v;
};
struct Words {
  __m256i lo, hi;
};
struct Sums {
  __m256i v;
};
struct Vec8 {
  __m256 v;
};
inline Bytes load_bytes(const void* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }
// (x >> shift) & mask in every byte; mask must fit in 8 - shift bits.
inline Bytes bits(Bytes x, int shift, uint8_t mask) {
  return {_mm256_and_si256(_mm256_srli_epi16(x.v, shift), _mm256_set1_epi8(char(mask)))};
}
// lo | hi << 4 - bias, for hi < 16 and lo < 16.
inline Bytes join_nibbles(Bytes lo, Bytes hi, uint8_t bias) {
  return {_mm256_sub_epi8(_mm256_or_si256(lo.v, _mm256_slli_epi16(hi.v, 4)), _mm256_set1_epi8(char(bias)))};
}
// Signed bytes widened.
inline Words widen(Bytes x) {
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(x.v)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x.v, 1))};
}
inline Words byte_words(const void* p) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)),
          _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p + 1))};
}
// 16 bytes of nibbles: the low nibbles are values 0-15, the high ones 16-31.
inline Words nibble_words(const uint8_t* p) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  return {_mm256_and_si256(x, _mm256_set1_epi16(0x0f)), _mm256_srli_epi16(x, 4)};
}
// 32 bytes of nibbles: the 32 low nibbles, or the 32 high ones, in order.
inline Words low_nibble_words(const uint8_t* p) {
  const __m256i mask = _mm256_set1_epi16(0x0f);
  return {_mm256_and_si256(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), mask),
          _mm256_and_si256(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p + 1)), mask)};
}
inline Words high_nibble_words(const uint8_t* p) {
  return {_mm256_srli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 4),
          _mm256_srli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p + 1)), 4)};
}
// Five-bit values: nibble_words(qs), each value j's fifth bit bit j of the 32 bits at qh.
inline Words five_bit_words(const uint8_t* qh, const uint8_t* qs) {
  uint32_t high;
  std::memcpy(&high, qh, 4);
  const __m256i select = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                           int16_t(0x8000));
  const auto fifth = [&](uint32_t half) {  // 16 for the words whose bit is set
    const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(int16_t(half)), select), select);
    return _mm256_and_si256(set, _mm256_set1_epi16(16));
  };
  const Words low = nibble_words(qs);
  return {_mm256_or_si256(low.lo, fifth(high & 0xffff)), _mm256_or_si256(low.hi, fifth(high >> 16))};
}
// low's values plus 16 where bit `bit` (0-7) of byte j of the 32 bytes at p is set (value j's fifth bit).
inline Words fifth_bits(Words low, const uint8_t* p, int bit) {
  const auto sixteens = [&](const uint8_t* half) {  // the bit moved to bit 4 of each word
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)half));
    const __m256i at4 = bit <= 4 ? _mm256_sll_epi16(w, _mm_cvtsi32_si128(4 - bit)) : _mm256_srl_epi16(w, _mm_cvtsi32_si128(bit - 4));
    return _mm256_and_si256(at4, _mm256_set1_epi16(16));
  };
  return {_mm256_or_si256(low.lo, sixteens(p)), _mm256_or_si256(low.hi, sixteens(p + 16))};
}
inline Words load_words(const int16_t* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1)};
}
// No sum of two products overflows: |w| <= 128 and |x| <= 32767.
#if defined(NANOVLLM_SIMD_AVX512)
// The VNNI multiply-adds s + (a . b) written out: GCC 12 gives the intrinsics' 256-bit forms only
// registers 0-15, so a tile's sums, kept in 16-31, were copied in and out around every product
// (two moves an instruction). As EVEX instructions they take any of the 32.
inline __m256i dpwssd(__m256i s, __m256i a, __m256i b) {
  __asm__("vpdpwssd %2, %1, %0" : "+v"(s) : "v"(a), "v"(b));
  return s;
}
inline __m256i dpbusd(__m256i s, __m256i unsigned_bytes, __m256i signed_bytes) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(s) : "v"(unsigned_bytes), "v"(signed_bytes));
  return s;
}
inline Sums dot(Words w, Words x) { return {dpwssd(_mm256_madd_epi16(w.lo, x.lo), w.hi, x.hi)}; }
#else
inline Sums dot(Words w, Words x) { return {_mm256_add_epi32(_mm256_madd_epi16(w.lo, x.lo), _mm256_madd_epi16(w.hi, x.hi))}; }
#endif
// A group of eight chunks in lanes (the Lanes formats' values): sixteen vectors of 16 words, vector
// r holding values 2r and 2r + 1 of chunk l in words 2l and 2l + 1, so that a madd's lane l sums
// chunk l's products only and a group's eight sums stay in the lanes of one Sums. A Quad is
// four consecutive vectors, decoded from one load.
struct Quad {
  __m256i v[4];
};
// 32 bytes whose 16-bit words carry the quad's four vectors in their four nibbles (vector k in
// bits 4k to 4k + 3).
inline Quad nibble_quad(const uint8_t* p) {
  const __m256i a = _mm256_loadu_si256((const __m256i*)p), low = _mm256_set1_epi16(0x0f);
  return {{_mm256_and_si256(a, low), _mm256_and_si256(_mm256_srli_epi16(a, 4), low),
           _mm256_and_si256(_mm256_srli_epi16(a, 8), low), _mm256_srli_epi16(a, 12)}};
}
// 64 signed bytes, the quad's vectors one after another.
inline Quad byte_quad(const uint8_t* p) {
  Quad q;
  for (int k = 0; k < 4; k++) q.v[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p + k));
  return q;
}
// Six-bit values less 32: a nibble quad's low four bits, and the top two from 32 bytes whose
// words carry eight vectors' two bits each (vector k in bits 2k, 2k + 1), of which this quad's
// four start at vector `first` (0 or 4).
inline Quad six_bit_quad(const uint8_t* nibbles, const uint8_t* crumbs, int first) {
  Quad q = nibble_quad(nibbles);
  const __m256i top = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)crumbs), _mm_cvtsi32_si128(2 * first));
  const __m256i mask = _mm256_set1_epi16(0x30), bias = _mm256_set1_epi16(32);
  // vector first + k's two bits moved to bits 4 and 5
  q.v[0] = _mm256_sub_epi16(_mm256_or_si256(q.v[0], _mm256_and_si256(_mm256_slli_epi16(top, 4), mask)), bias);
  q.v[1] = _mm256_sub_epi16(_mm256_or_si256(q.v[1], _mm256_and_si256(_mm256_slli_epi16(top, 2), mask)), bias);
  q.v[2] = _mm256_sub_epi16(_mm256_or_si256(q.v[2], _mm256_and_si256(top, mask)), bias);
  q.v[3] = _mm256_sub_epi16(_mm256_or_si256(q.v[3], _mm256_and_si256(_mm256_srli_epi16(top, 2), mask)), bias);
  return q;
}
// Five-bit values: a nibble quad's low four bits, and the fifth from 32 bytes whose words carry
// sixteen vectors' bits (vector r in bit r), of which this quad's four start at vector 4 j.
inline Quad five_bit_quad(const uint8_t* nibbles, const uint8_t* fifth_bits, int j) {
  Quad q = nibble_quad(nibbles);
  const __m256i top = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)fifth_bits), _mm_cvtsi32_si128(4 * j));
  const __m256i mask = _mm256_set1_epi16(0x10);
  q.v[0] = _mm256_or_si256(q.v[0], _mm256_and_si256(_mm256_slli_epi16(top, 4), mask));
  q.v[1] = _mm256_or_si256(q.v[1], _mm256_and_si256(_mm256_slli_epi16(top, 3), mask));
  q.v[2] = _mm256_or_si256(q.v[2], _mm256_and_si256(_mm256_slli_epi16(top, 2), mask));
  q.v[3] = _mm256_or_si256(q.v[3], _mm256_and_si256(_mm256_slli_epi16(top, 1), mask));
  return q;
}
// Each word, an index 0-15, replaced by table[index] (16 unsigned bytes; the non-linear formats).
inline __m256i look_up(__m256i indices, const uint8_t* table) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)table));
  // a word's high byte, 0x80, selects zero
  return _mm256_shuffle_epi8(both, _mm256_or_si256(indices, _mm256_set1_epi16(int16_t(0x8000))));
}
inline Quad look_up(Quad q, const uint8_t* table) {
  for (int k = 0; k < 4; k++) q.v[k] = look_up(q.v[k], table);
  return q;
}
inline Words look_up(Words w, const uint8_t* table) { return {look_up(w.lo, table), look_up(w.hi, table)}; }
// s plus the quad's products with its 64 words of x (laid out as the quad is).
#if defined(NANOVLLM_SIMD_AVX512)
inline Sums dot_quad(Quad q, const int16_t* x, Sums s) {
  for (int k = 0; k < 4; k++) s.v = dpwssd(s.v, q.v[k], _mm256_loadu_si256((const __m256i*)x + k));
  return s;
}
#else
inline Sums dot_quad(Quad q, const int16_t* x, Sums s) {
  const __m256i* xv = (const __m256i*)x;
  const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(q.v[0], _mm256_loadu_si256(xv)),
                                     _mm256_madd_epi16(q.v[1], _mm256_loadu_si256(xv + 1)));
  const __m256i b = _mm256_add_epi32(_mm256_madd_epi16(q.v[2], _mm256_loadu_si256(xv + 2)),
                                     _mm256_madd_epi16(q.v[3], _mm256_loadu_si256(xv + 3)));
  return {_mm256_add_epi32(s.v, _mm256_add_epi32(a, b))};
}
#endif
// One of a lanes group's sixteen vectors (16 words), as the tiled kernel holds a weight's decoded rows.
struct Vector16 {
  __m256i v;
};
inline Vector16 load_vector(const int16_t* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }
// The pair of words at p in every lane: one operand of eight rows' dot products (dot_vector) with
// a vector that holds each row's pair of the same two values.
inline Vector16 broadcast_pair(const int16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, 4);
  return {_mm256_set1_epi32(pair)};
}
inline void store_quad(int16_t* p, Quad q) {
  for (int k = 0; k < 4; k++) _mm256_storeu_si256((__m256i*)p + k, q.v[k]);
}
inline Quad load_quad(const int16_t* p) {
  Quad q;
  for (int k = 0; k < 4; k++) q.v[k] = _mm256_loadu_si256((const __m256i*)p + k);
  return q;
}
// s plus w's products with x's vector (lane l: the pair of words 2l, 2l + 1).
#if defined(NANOVLLM_SIMD_AVX512)
inline Sums dot_vector(Vector16 w, Vector16 x, Sums s) { return {dpwssd(s.v, w.v, x.v)}; }
#else
inline Sums dot_vector(Vector16 w, Vector16 x, Sums s) { return {_mm256_add_epi32(s.v, _mm256_madd_epi16(w.v, x.v))}; }
#endif
// The 8-bit tiles' operands (ByteVector): eight rows' quads of x (four signed bytes a lane), or
// one weight quad (four unsigned bytes) in every lane. A lane of ByteSums gathers one row's
// products: AVX2 in its two 16-bit halves (vpmaddubsw, two products a half, then vpaddw), widened
// to the lane's int32 by widen_byte_sums; AVX-512 VNNI in the 32-bit lane itself (vpdpbusd).
struct ByteVector {
  __m256i v;
};
struct ByteSums {
  __m256i v;
};
inline ByteVector load_byte_vector(const int8_t* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }
inline ByteVector broadcast_quad(const uint8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, 4);
  return {_mm256_set1_epi32(quad)};
}
inline ByteSums zero_byte_sums() { return {_mm256_setzero_si256()}; }
#if defined(NANOVLLM_SIMD_AVX512)
inline ByteSums dot_bytes(ByteVector w, ByteVector x, ByteSums s) { return {dpbusd(s.v, w.v, x.v)}; }
inline Sums widen_byte_sums(ByteSums p, Sums s) { return {_mm256_add_epi32(s.v, p.v)}; }
// Quads of weights up to max_weight (with |x| <= 127) a ByteSums takes before it must be widened.
inline constexpr int byte_quads_per_widen(int) { return 1 << 16; }
#else
inline ByteSums dot_bytes(ByteVector w, ByteVector x, ByteSums s) {
  return {_mm256_add_epi16(s.v, _mm256_maddubs_epi16(w.v, x.v))};
}
inline Sums widen_byte_sums(ByteSums p, Sums s) {
  return {_mm256_add_epi32(s.v, _mm256_madd_epi16(p.v, _mm256_set1_epi16(1)))};
}
// A 16-bit half takes two products a quad, each at most max_weight x 127 in magnitude: exact (no
// saturation, no wrap) while the quads' sum stays within 32767.
inline constexpr int byte_quads_per_widen(int max_weight) { return 32767 / (2 * 127 * max_weight); }
#endif
// A lanes group's quad as bytes (the row kernel's 8-bit path): `lo` holds the quad's vectors 0
// and 2, `hi` vectors 1 and 3, word i of each as bytes 2i and 2i + 1, so that lane l still holds
// chunk l's values only (of quad j: 8j + 0, 4, 1, 5 in lo; 8j + 2, 6, 3, 7 in hi) and a lane's
// byte products sum chunk l's. The weights' as unsigned bytes (plus a format's byte bias),
// decoded from their quads straight to bytes; x's (|x| <= 127) from its words (store_byte_quad).
struct ByteQuad {
  ByteVector lo, hi;
};
inline ByteQuad nibble_byte_quad(const uint8_t* p) {
  const __m256i a = _mm256_loadu_si256((const __m256i*)p), low = _mm256_set1_epi8(0x0f);
  return {{_mm256_and_si256(a, low)}, {_mm256_and_si256(_mm256_srli_epi16(a, 4), low)}};
}
// A nibble quad's values with their fifth bits (five_bit_quad's): vector k's bit moves from bit k
// of `top`'s word to bit 4 of its byte (bit 4 or 12 of the word).
inline ByteQuad five_bit_byte_quad(const uint8_t* nibbles, const uint8_t* fifth_bits, int j) {
  ByteQuad q = nibble_byte_quad(nibbles);
  const __m256i top = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)fifth_bits), _mm_cvtsi32_si128(4 * j));
  const __m256i even = _mm256_set1_epi16(0x0010), odd = _mm256_set1_epi16(0x1000);
  const auto bits = [&](int to_even, int to_odd) {  // each shifted bit masked alone: the rest of top is other vectors'
    return _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(top, to_even), even),
                           _mm256_and_si256(_mm256_slli_epi16(top, to_odd), odd));
  };
  q.lo.v = _mm256_or_si256(q.lo.v, bits(4, 10));
  q.hi.v = _mm256_or_si256(q.hi.v, bits(3, 9));
  return q;
}
// Six-bit values plus 32 (six_bit_quad's, not centred): vector k's two bits move from bits 2k,
// 2k + 1 of `top`'s word to bits 4 and 5 of its byte.
inline ByteQuad six_bit_byte_quad(const uint8_t* nibbles, const uint8_t* crumbs, int first) {
  ByteQuad q = nibble_byte_quad(nibbles);
  const __m256i top = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)crumbs), _mm_cvtsi32_si128(2 * first));
  const __m256i even = _mm256_set1_epi16(0x0030), odd = _mm256_set1_epi16(0x3000);
  const auto bits = [&](int to_even, int to_odd) {
    return _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(top, to_even), even),
                           _mm256_and_si256(_mm256_slli_epi16(top, to_odd), odd));
  };
  q.lo.v = _mm256_or_si256(q.lo.v, bits(4, 8));
  q.hi.v = _mm256_or_si256(q.hi.v, bits(2, 6));
  return q;
}
// x's quad (words of at most 127 in magnitude) as ByteQuad's 64 bytes, lo then hi.
inline void store_byte_quad(int8_t* p, Quad q) {
  const __m256i low = _mm256_set1_epi16(0x00ff);
  const auto bytes = [&](__m256i even, __m256i odd) {
    return _mm256_or_si256(_mm256_and_si256(even, low), _mm256_slli_epi16(odd, 8));
  };
  _mm256_storeu_si256((__m256i*)p, bytes(q.v[0], q.v[2]));
  _mm256_storeu_si256((__m256i*)p + 1, bytes(q.v[1], q.v[3]));
}
inline Sums load_sums(const int32_t* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }
inline Sums times(Sums x, int32_t k) { return {_mm256_mullo_epi32(x.v, _mm256_set1_epi32(k))}; }
inline Sums sub_sums(Sums a, Sums b) { return {_mm256_sub_epi32(a.v, b.v)}; }
inline Sums add_sums(Sums a, Sums b) { return {_mm256_add_epi32(a.v, b.v)}; }
// Eight rows of eight 32-bit lanes transposed.
inline void transpose8(const __m256i* in, __m256i* out) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    const __m256 a = _mm256_castsi256_ps(in[2 * i]), b = _mm256_castsi256_ps(in[2 * i + 1]);
    t[2 * i] = _mm256_unpacklo_ps(a, b);
    t[2 * i + 1] = _mm256_unpackhi_ps(a, b);
  }
  for (int h = 0; h < 2; h++) {  // rows 4h to 4h + 3: lane pairs of columns c and c + 4
    const __m256 *lo = t + 4 * h, *hi = t + 4 * h + 2;
    u[4 * h] = _mm256_shuffle_ps(lo[0], hi[0], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(lo[0], hi[0], 0xee);
    u[4 * h + 2] = _mm256_shuffle_ps(lo[1], hi[1], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(lo[1], hi[1], 0xee);
  }
  for (int c = 0; c < 4; c++) {
    out[c] = _mm256_castps_si256(_mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
    out[c + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
  }
}
// A group's four ByteQuads stored chunk by chunk: lane l of each of their eight vectors (lo, hi,
// lo, ..) is a quad of chunk l's values, which go to out + 32 l in the vectors' order.
inline void store_quads_by_chunk(const ByteQuad q[4], uint8_t* out) {
  __m256i in[8], chunks[8];
  for (int j = 0; j < 4; j++) in[2 * j] = q[j].lo.v, in[2 * j + 1] = q[j].hi.v;
  transpose8(in, chunks);
  for (int l = 0; l < 8; l++) _mm256_storeu_si256((__m256i*)(out + 32 * l), chunks[l]);
}
// A group's four quads back in chunk order: chunk c's 32 values as Words (vector r's lane c is
// its values 2r and 2r + 1, so the chunks are the columns of the vectors' 32-bit lanes).
inline void quads_to_chunks(const Quad q[4], Words out[8]) {
  __m256i lo[8], hi[8];
  transpose8(q[0].v, lo);  // vectors 0-7 (quads 0 and 1): values 0-15
  transpose8(q[2].v, hi);  // vectors 8-15: values 16-31
  for (int c = 0; c < 8; c++) out[c] = {lo[c], hi[c]};
}
// quads_to_chunks reversed: eight chunks (x's, quantized) as a group's four quads.
inline void chunks_to_quads(const Words in[8], Quad q[4]) {
  __m256i lo[8], hi[8];
  for (int c = 0; c < 8; c++) lo[c] = in[c].lo, hi[c] = in[c].hi;
  transpose8(lo, q[0].v);  // vectors 0-7 (quads 0 and 1)
  transpose8(hi, q[2].v);
}
// 32 fp32 values (lo: 0-15, hi: 16-31), each within int16's range, rounded to the nearest
// integer (ties to even: the default rounding, std::nearbyint's).
#if defined(NANOVLLM_SIMD_AVX512)
inline Words round_words(Vec lo, Vec hi) {
  return {_mm512_cvtepi32_epi16(_mm512_cvtps_epi32(lo.v)), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(hi.v))};
}
#else
inline __m256i round_halves(Vec x) {  // packs interleaves 128-bit halves; the permute restores the order
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(x.lo), _mm256_cvtps_epi32(x.hi)), 0xd8);
}
inline Words round_words(Vec lo, Vec hi) { return {round_halves(lo), round_halves(hi)}; }
#endif
// The 32 values' sum, exact.
inline int32_t sum_words(Words w) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w.lo, ones), _mm256_madd_epi16(w.hi, ones));
  __m128i r = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(r, _mm_shuffle_epi32(r, 0xb1)));
}
inline void store_words(int16_t* p, Words w) {
  _mm256_storeu_si256((__m256i*)p, w.lo);
  _mm256_storeu_si256((__m256i*)p + 1, w.hi);
}
#if defined(NANOVLLM_SIMD_AMX)
namespace tiles {
// The 32 values as bytes, in order (each must fit one byte, signed or unsigned: the caller knows
// its format's range): a row of an A tile.
inline void store_bytes(Words w, int8_t* out) {
  const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(w.lo), w.hi, 1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi16_epi8(words));
}
// A group's four ByteQuads as its eight chunks' values in order, less `bias` (a format's byte
// bias: back to its own values, signed), chunk l at out + stride l: rows of A tiles.
// store_quads_by_chunk's chunk holds value 8j + 2h + 4 (i % 2) + i / 2 at byte 4 (2j + h) + i,
// values 0-15 in its first 16 bytes, so one byte shuffle within each half puts them in order.
inline void store_quads_in_order(const ByteQuad q[4], int bias, uint8_t* out, int64_t stride) {
  __m256i in[8], chunks[8];
  const __m256i b = _mm256_set1_epi8(int8_t(bias));
  for (int j = 0; j < 4; j++) in[2 * j] = _mm256_sub_epi8(q[j].lo.v, b), in[2 * j + 1] = _mm256_sub_epi8(q[j].hi.v, b);
  transpose8(in, chunks);
  const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,  //
                                         0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int l = 0; l < 8; l++) _mm256_storeu_si256((__m256i*)(out + stride * l), _mm256_shuffle_epi8(chunks[l], order));
}
}  // namespace tiles
#endif
// Eight fp16 values converted.
inline Vec8 halves_at(const uint8_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))}; }
inline Vec8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// The first n values at p, zeros after (nothing past them is read).
inline Vec8 load8_first(const float* p, int64_t n) { return {_mm256_maskload_ps(p, lanes_below(n))}; }
// a with lane `lane` taken from b.
inline Vec8 blend_lane(Vec8 a, Vec8 b, int64_t lane) {
  const __m256i mask = _mm256_cmpeq_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int(lane)));
  return {_mm256_blendv_ps(a.v, b.v, _mm256_castsi256_ps(mask))};
}
// Eight unsigned (or signed) bytes converted.
inline Vec8 bytes_at(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)))};
}
inline Vec8 signed_bytes_at(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)))};
}
inline Sums zero_sums() { return {_mm256_setzero_si256()}; }
// The 32 values as four groups of eight fp32 lanes.
inline void widen_block(Words q, Vec8 out[4]) {
  out[0] = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q.lo)))};
  out[1] = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q.lo, 1)))};
  out[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q.hi)))};
  out[3] = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q.hi, 1)))};
}
inline void store8(float* p, Vec8 x) { _mm256_storeu_ps(p, x.v); }
inline float first_lane(Vec8 x) { return _mm256_cvtss_f32(x.v); }
inline Vec8 to_float(Sums x) { return {_mm256_cvtepi32_ps(x.v)}; }
// Lane j: the sum of x[j]'s lanes, exact.
inline Sums totals(const Sums x[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(x[0].v, x[1].v), _mm256_hadd_epi32(x[2].v, x[3].v));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(x[4].v, x[5].v), _mm256_hadd_epi32(x[6].v, x[7].v));
  return {_mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31))};
}
inline Vec8 set1_8(float x) { return {_mm256_set1_ps(x)}; }
// Lanes 0-3 take lo, 4-7 hi.
inline Vec8 halves(float lo, float hi) { return {_mm256_setr_m128(_mm_set1_ps(lo), _mm_set1_ps(hi))}; }
// Every lane takes lane 0's value (low_half) or lane 4's (high_half).
inline Vec8 low_half(Vec8 x) { return {_mm256_permutevar8x32_ps(x.v, _mm256_setzero_si256())}; }
inline Vec8 high_half(Vec8 x) { return {_mm256_permutevar8x32_ps(x.v, _mm256_set1_epi32(4))}; }
inline Vec8 zero8() { return {_mm256_setzero_ps()}; }
inline Vec8 add8(Vec8 a, Vec8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec8 mul8(Vec8 a, Vec8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec8 fmadd8(Vec8 a, Vec8 b, Vec8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline float reduce_add8(Vec8 x) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(x.v), _mm256_extractf128_ps(x.v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
// The fp16 values at p and p + 2, converted from one 4-byte load.
inline std::pair<float, float> two_halves_at(const uint8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  return {_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v))};
}

#else

struct Bytes {
  int8_t v[32];
};
struct Words {
  int16_t v[32];
};
struct Sums {
  int32_t v[8];
};
struct Vec8 {
  float v[8];
};
inline Bytes load_bytes(const void* p) {
  Bytes b;
  std::memcpy(b.v, p, 32);
  return b;
}
inline Bytes bits(Bytes x, int shift, uint8_t mask) {
  for (int8_t& v : x.v) v = int8_t((uint8_t(v) >> shift) & mask);
  return x;
}
inline Bytes join_nibbles(Bytes lo, Bytes hi, uint8_t bias) {
  for (int j = 0; j < 32; j++) lo.v[j] = int8_t(uint8_t(lo.v[j] | (hi.v[j] << 4)) - bias);
  return lo;
}
inline Words widen(Bytes x) {
  Words w;
  for (int j = 0; j < 32; j++) w.v[j] = x.v[j];
  return w;
}
inline Words byte_words(const void* p) { return widen(load_bytes(p)); }
inline Words nibble_words(const uint8_t* p) {
  Words w;
  for (int j = 0; j < 16; j++) w.v[j] = int16_t(p[j] & 0x0f), w.v[j + 16] = int16_t(p[j] >> 4);
  return w;
}
inline Words low_nibble_words(const uint8_t* p) {
  Words w;
  for (int j = 0; j < 32; j++) w.v[j] = int16_t(p[j] & 0x0f);
  return w;
}
inline Words high_nibble_words(const uint8_t* p) {
  Words w;
  for (int j = 0; j < 32; j++) w.v[j] = int16_t(p[j] >> 4);
  return w;
}
inline Words five_bit_words(const uint8_t* qh, const uint8_t* qs) {
  uint32_t high;
  std::memcpy(&high, qh, 4);
  Words w = nibble_words(qs);
  for (int j = 0; j < 32; j++) w.v[j] = int16_t(w.v[j] | ((high >> j) & 1) << 4);
  return w;
}
inline Words fifth_bits(Words low, const uint8_t* p, int bit) {
  for (int j = 0; j < 32; j++) low.v[j] = int16_t(low.v[j] | ((p[j] >> bit) & 1) << 4);
  return low;
}
inline Words load_words(const int16_t* p) {
  Words w;
  std::memcpy(w.v, p, 64);
  return w;
}
inline Sums dot(Words w, Words x) {
  Sums r{};
  for (int j = 0; j < 32; j++) r.v[j / 4] += int32_t(w.v[j]) * x.v[j];
  return r;
}
template <typename F>
inline Vec8 map8(F f) {
  Vec8 r;
  for (int j = 0; j < 8; j++) r.v[j] = f(j);
  return r;
}
struct Quad {
  int16_t v[4][16];
};
inline Quad nibble_quad(const uint8_t* p) {
  Quad q;
  for (int i = 0; i < 16; i++) {
    const int word = p[2 * i] | p[2 * i + 1] << 8;
    for (int k = 0; k < 4; k++) q.v[k][i] = int16_t((word >> (4 * k)) & 0x0f);
  }
  return q;
}
inline Quad byte_quad(const uint8_t* p) {
  Quad q;
  for (int k = 0; k < 4; k++)
    for (int i = 0; i < 16; i++) q.v[k][i] = int8_t(p[16 * k + i]);
  return q;
}
inline Quad six_bit_quad(const uint8_t* nibbles, const uint8_t* crumbs, int first) {
  Quad q = nibble_quad(nibbles);
  for (int i = 0; i < 16; i++) {
    const int word = crumbs[2 * i] | crumbs[2 * i + 1] << 8;
    for (int k = 0; k < 4; k++) q.v[k][i] = int16_t((q.v[k][i] | ((word >> (2 * (first + k))) & 3) << 4) - 32);
  }
  return q;
}
inline Quad five_bit_quad(const uint8_t* nibbles, const uint8_t* fifth_bits, int j) {
  Quad q = nibble_quad(nibbles);
  for (int i = 0; i < 16; i++) {
    const int word = fifth_bits[2 * i] | fifth_bits[2 * i + 1] << 8;
    for (int k = 0; k < 4; k++) q.v[k][i] = int16_t(q.v[k][i] | ((word >> (4 * j + k)) & 1) << 4);
  }
  return q;
}
inline Quad look_up(Quad q, const uint8_t* table) {
  for (auto& vector : q.v)
    for (int16_t& v : vector) v = table[v];
  return q;
}
inline Words look_up(Words w, const uint8_t* table) {
  for (int16_t& v : w.v) v = table[v];
  return w;
}
inline Sums dot_quad(Quad q, const int16_t* x, Sums s) {
  for (int k = 0; k < 4; k++)
    for (int i = 0; i < 16; i++) s.v[i / 2] += int32_t(q.v[k][i]) * x[16 * k + i];
  return s;
}
struct Vector16 {
  int16_t v[16];
};
inline Vector16 load_vector(const int16_t* p) {
  Vector16 w;
  std::memcpy(w.v, p, 32);
  return w;
}
inline Vector16 broadcast_pair(const int16_t* p) {
  Vector16 w;
  for (int i = 0; i < 16; i++) w.v[i] = p[i % 2];
  return w;
}
inline void store_quad(int16_t* p, Quad q) { std::memcpy(p, q.v, 128); }
inline Quad load_quad(const int16_t* p) {
  Quad q;
  std::memcpy(q.v, p, 128);
  return q;
}
inline Sums dot_vector(Vector16 w, Vector16 x, Sums s) {
  for (int i = 0; i < 16; i++) s.v[i / 2] += int32_t(w.v[i]) * x.v[i];
  return s;
}
struct ByteVector {
  int8_t v[32];
};
using ByteSums = Sums;  // each lane's products summed in 32 bits at once
inline ByteVector load_byte_vector(const int8_t* p) {
  ByteVector b;
  std::memcpy(b.v, p, 32);
  return b;
}
inline ByteVector broadcast_quad(const uint8_t* p) {
  ByteVector b;
  for (int i = 0; i < 32; i++) b.v[i] = int8_t(p[i % 4]);
  return b;
}
inline ByteSums zero_byte_sums() { return {}; }
inline ByteSums dot_bytes(ByteVector w, ByteVector x, ByteSums s) {
  for (int i = 0; i < 32; i++) s.v[i / 4] += int32_t(uint8_t(w.v[i])) * x.v[i];
  return s;
}
inline Sums widen_byte_sums(ByteSums p, Sums s) {
  for (int i = 0; i < 8; i++) s.v[i] += p.v[i];
  return s;
}
inline constexpr int byte_quads_per_widen(int) { return 1 << 16; }
struct ByteQuad {
  ByteVector lo, hi;
};
// Quad's vectors 0 and 2 (lo), 1 and 3 (hi), word i as bytes 2i and 2i + 1; `bias` added.
inline ByteQuad quad_bytes(Quad q, int bias) {
  ByteQuad b;
  for (int i = 0; i < 16; i++) {
    b.lo.v[2 * i] = int8_t(q.v[0][i] + bias), b.lo.v[2 * i + 1] = int8_t(q.v[2][i] + bias);
    b.hi.v[2 * i] = int8_t(q.v[1][i] + bias), b.hi.v[2 * i + 1] = int8_t(q.v[3][i] + bias);
  }
  return b;
}
inline ByteQuad nibble_byte_quad(const uint8_t* p) { return quad_bytes(nibble_quad(p), 0); }
inline ByteQuad five_bit_byte_quad(const uint8_t* nibbles, const uint8_t* fifth_bits, int j) {
  return quad_bytes(five_bit_quad(nibbles, fifth_bits, j), 0);
}
inline ByteQuad six_bit_byte_quad(const uint8_t* nibbles, const uint8_t* crumbs, int first) {
  return quad_bytes(six_bit_quad(nibbles, crumbs, first), 32);
}
inline void store_byte_quad(int8_t* p, Quad q) {
  const ByteQuad b = quad_bytes(q, 0);
  std::memcpy(p, b.lo.v, 32);
  std::memcpy(p + 32, b.hi.v, 32);
}
inline Sums load_sums(const int32_t* p) {
  Sums s;
  std::memcpy(s.v, p, 32);
  return s;
}
inline Sums times(Sums x, int32_t k) {
  for (int32_t& v : x.v) v *= k;
  return x;
}
inline Sums sub_sums(Sums a, Sums b) {
  for (int i = 0; i < 8; i++) a.v[i] -= b.v[i];
  return a;
}
inline Sums add_sums(Sums a, Sums b) {
  for (int i = 0; i < 8; i++) a.v[i] += b.v[i];
  return a;
}
inline void store_quads_by_chunk(const ByteQuad q[4], uint8_t* out) {
  for (int j = 0; j < 4; j++)
    for (int l = 0; l < 8; l++) {
      std::memcpy(out + 32 * l + 8 * j, q[j].lo.v + 4 * l, 4);
      std::memcpy(out + 32 * l + 8 * j + 4, q[j].hi.v + 4 * l, 4);
    }
}
inline void quads_to_chunks(const Quad q[4], Words out[8]) {
  for (int c = 0; c < 8; c++)
    for (int j = 0; j < 32; j++) out[c].v[j] = q[j / 8].v[(j / 2) % 4][2 * c + j % 2];
}
inline void chunks_to_quads(const Words in[8], Quad q[4]) {
  for (int c = 0; c < 8; c++)
    for (int j = 0; j < 32; j++) q[j / 8].v[(j / 2) % 4][2 * c + j % 2] = in[c].v[j];
}
inline Words round_words(Vec lo, Vec hi) {
  Words w;
  for (int j = 0; j < 16; j++) w.v[j] = int16_t(std::nearbyint(lo.v[j])), w.v[j + 16] = int16_t(std::nearbyint(hi.v[j]));
  return w;
}
inline int32_t sum_words(Words w) {
  int32_t s = 0;
  for (int16_t v : w.v) s += v;
  return s;
}
inline void store_words(int16_t* p, Words w) { std::memcpy(p, w.v, 64); }
inline Sums zero_sums() { return Sums{}; }
inline void widen_block(Words q, Vec8 out[4]) {
  for (int g = 0; g < 4; g++) out[g] = map8([&](int j) { return float(q.v[8 * g + j]); });
}
inline void store8(float* p, Vec8 x) { std::memcpy(p, x.v, 32); }
inline float first_lane(Vec8 x) { return x.v[0]; }
inline Vec8 to_float(Sums x) { return map8([&](int j) { return float(x.v[j]); }); }
inline Sums totals(const Sums x[8]) {
  Sums t{};
  for (int j = 0; j < 8; j++)
    for (int32_t v : x[j].v) t.v[j] += v;
  return t;
}
inline Vec8 set1_8(float x) { return map8([x](int) { return x; }); }
inline Vec8 halves(float lo, float hi) { return map8([=](int j) { return j < 4 ? lo : hi; }); }
inline Vec8 low_half(Vec8 x) { return set1_8(x.v[0]); }
inline Vec8 high_half(Vec8 x) { return set1_8(x.v[4]); }
inline Vec8 zero8() { return set1_8(0.0f); }
inline Vec8 add8(Vec8 a, Vec8 b) { return map8([&](int j) { return a.v[j] + b.v[j]; }); }
inline Vec8 mul8(Vec8 a, Vec8 b) { return map8([&](int j) { return a.v[j] * b.v[j]; }); }
inline Vec8 fmadd8(Vec8 a, Vec8 b, Vec8 c) { return map8([&](int j) { return std::fma(a.v[j], b.v[j], c.v[j]); }); }
inline float reduce_add8(Vec8 x) {  // the AVX reduction's tree
  const float* v = x.v;
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}
inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
inline Vec8 halves_at(const uint8_t* p) {
  uint16_t h[8];
  std::memcpy(h, p, 16);
  return map8([&](int j) { return half_to_float(h[j]); });
}
inline Vec8 load8(const float* p) { return map8([&](int j) { return p[j]; }); }
inline Vec8 load8_first(const float* p, int64_t n) { return map8([&](int j) { return j < n ? p[j] : 0.0f; }); }
inline Vec8 blend_lane(Vec8 a, Vec8 b, int64_t lane) {
  a.v[lane] = b.v[lane];
  return a;
}
inline Vec8 bytes_at(const uint8_t* p) { return map8([&](int j) { return float(p[j]); }); }
inline Vec8 signed_bytes_at(const uint8_t* p) { return map8([&](int j) { return float(int8_t(p[j])); }); }
inline std::pair<float, float> two_halves_at(const uint8_t* p) {
  uint16_t h[2];
  std::memcpy(h, p, 4);
  return {half_to_float(h[0]), half_to_float(h[1])};
}

#endif

// Eight vectors summed lane by lane, each lane in reduce_add8's order: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
inline Vec8 add8_tree(const Vec8 v[8]) {
  return add8(add8(add8(v[0], v[4]), add8(v[2], v[6])), add8(add8(v[1], v[5]), add8(v[3], v[7])));
}

}  // namespace nanovllm_cpu::simd

namespace nanovllm_cpu {
using at::BFloat16;
}  // namespace nanovllm_cpu
