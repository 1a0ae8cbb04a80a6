// The sampler's per-row work (nanovllm/engine/sampler.py): sample_rows, the random draw of one
// token per row; mask_disallowed, a grammar's bitmask of allowed tokens applied to the logits.

#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace nanovllm_cpu {

// One token per row drawn from softmax(logits / temperature) by inverse transform: the first
// token at which the running sum of exp((l - max) / T) exceeds u times their total. Three
// passes over the row (max, total, scan) and no temporaries, where the same in torch is a
// division, a softmax and a cumulative sum over [rows, vocab] fp32 tensors. -inf logits
// (banned tokens) have probability exactly 0 and are never drawn.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits: [rows, vocab] fp32 with contiguous rows");
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && uniforms.scalar_type() == at::kFloat &&
                  temperatures.is_contiguous() && uniforms.is_contiguous() && temperatures.numel() == logits.size(0) &&
                  uniforms.numel() == logits.size(0),
              "temperatures and uniforms: one fp32 per row");
  const int64_t n = logits.size(0), V = logits.size(1);
  at::Tensor tokens = at::empty({n}, at::kLong);
  const float* temps = temperatures.data_ptr<float>();
  const float* us = uniforms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const simd::Vec minus_inf = simd::set1(kMinusInf);
    for (int64_t row = begin; row < end; row++) {
      const float* l = logits.data_ptr<float>() + row * logits.stride(0);
      auto load16 = [&](int64_t v) { return simd::load_first(l + v, V - v, kMinusInf); };  // -inf past the end
      simd::Vec max16 = minus_inf;
      for (int64_t v = 0; v < V; v += 16) max16 = simd::max(max16, load16(v));
      const simd::Vec offset = simd::set1(simd::reduce_max(max16)), inv_t = simd::set1(1.0f / temps[row]);
      // exp((l - max) / T) for the 16 logits at v, 0 where l is -inf.
      auto probs16 = [&](int64_t v) {
        const simd::Vec x = load16(v);
        return simd::where_greater(x, minus_inf, simd::exp(simd::mul(simd::sub(x, offset), inv_t)));
      };
      float total = 0;
      for (int64_t v = 0; v < V; v += 16) total += simd::reduce_add(probs16(v));
      const float target = us[row] * total;
      // Whole chunks are skipped by the same sums as the total's, then one is scanned. Should
      // rounding leave the target unreached, the last token with any probability is drawn.
      int64_t token = -1, last_live = -1;
      float running = 0;
      for (int64_t v = 0; v < V && token < 0; v += 16) {
        const simd::Vec p = probs16(v);
        const float chunk = simd::reduce_add(p);
        if (running + chunk > target) {
          float ps[16];
          std::memcpy(ps, &p, sizeof(ps));
          float partial = running;
          for (int j = 0; j < 16 && token < 0; j++) {
            partial += ps[j];
            if (ps[j] > 0 && partial > target) token = v + j;
          }
        }
        const uint32_t live = simd::positive_lanes(p);
        if (live != 0) last_live = v + 31 - __builtin_clz(live);
        running += chunk;
      }
      out[row] = token >= 0 ? token : last_live;
    }
  });
  return tokens;
}

// Sets to -inf every logit whose bit in the row's bitmask is clear (bit j of word w: token
// 32 * w + j, llguidance's layout). Most words of a constrained row are 0 (a grammar allows
// few tokens at a time), and those are a plain fill; all-ones words (unconstrained rows, or
// free text inside a string) are skipped.
void mask_disallowed(at::Tensor& logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits: [rows, vocab] fp32 with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "bitmask: [rows, ceil(vocab / 32)] int32");
  const int64_t n = logits.size(0), V = logits.size(1), words = bitmask.size(1);
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; row++) {
      float* l = logits.data_ptr<float>() + row * logits.stride(0);
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + row * words;
      for (int64_t w = 0; w * 32 < V; w++) {
        const uint32_t word = bits[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t count = std::min<int64_t>(32, V - w * 32);
        for (int64_t j = 0; j < count; j++)
          if (!((word >> j) & 1u)) l[w * 32 + j] = kMinusInf;
      }
    }
  });
}

}  // namespace nanovllm_cpu
