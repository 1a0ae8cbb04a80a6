// The small SIMD layer every CPU kernel file includes: the build's ISA switch and the bf16
// helpers its AVX512-BF16 paths share.
//
// NANOVLLM_BF16_KERNELS is defined when the build targets AVX512-BF16 (with AVX512F and BW);
// the vectorised paths are compiled only then, and kHasBf16Kernels tells callers at run time.
// Elsewhere every op keeps its schema and either takes its portable path or fails, saying so.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define NANOVLLM_BF16_KERNELS 1
#endif

namespace nanovllm_cpu {

using at::BFloat16;

#ifdef NANOVLLM_BF16_KERNELS
inline constexpr bool kHasBf16Kernels = true;

// The first min(n, 16) lanes.
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }
// 16 bf16 values widened to fp32 (exactly: a bf16 is the top half of an fp32).
inline __m512 widen_bf16(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }
inline __m512 load_bf16(const BFloat16* p, __mmask16 m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
inline void store_bf16(BFloat16* p, __m512 x, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}
// x rounded to bf16 (nearest even) and widened back, as a bf16 intermediate in eager PyTorch.
inline __m512 round_bf16(__m512 x) { return widen_bf16((__m256i)_mm512_cvtneps_pbh(x)); }

// exp, relative error ~2e-7: 2^n * p(r), r in [-ln2/2, ln2/2]. Arguments are clamped to
// [-87, 89]: below, a tiny normal float instead of one smaller still; from 89 (past ~88.72)
// up, +inf, as exp's own overflow.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180560f), x);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#else
inline constexpr bool kHasBf16Kernels = false;
#endif

}  // namespace nanovllm_cpu
