// linear / linear_packed: y = x W^T (+ b) for a few rows of x, over a bf16 weight packed as
// [N/16][K/2][16][2]. Each 64-byte load holds two k-steps of sixteen output columns, so one
// dot product over bf16 pairs per (row, k-pair) consumes it (one instruction on AVX512-BF16,
// a widening and two FMAs per half on AVX2) and the weight streams from memory exactly once,
// with no horizontal sums. oneDNN's bf16 GEMV at batch 1 reads weights at a third of the memory
// bandwidth; small decode batches are all about bandwidth. More rows go to oneDNN's GEMM, on its
// own packed copy of the weight (onednn_pack).

#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace nanovllm_cpu {
namespace {

using simd::Vec;

// acc[m] += sum over k of x[m, k] * W[n, k] for one 16-column panel and M rows of x, given as
// pairs: pair k2 of row m at xp[k2 * x_step + m]. Each weight load feeds M dot products, and
// every row's pair sits at a fixed offset from one pointer, so the broadcasts need no address
// registers of their own.
template <int M>
void panel_dot(const simd::Pair* xp, int64_t x_step, const BFloat16* panel, int64_t K2, const BFloat16* prefetch,
               Vec* acc) {
  for (int m = 0; m < M; m++) acc[m] = simd::zero();
  for (int64_t k2 = 0; k2 < K2; k2++, xp += x_step) {
    if (prefetch != nullptr) simd::prefetch(prefetch + k2 * 32);
    const simd::Pairs w = simd::load_pairs(panel + k2 * 32);
#pragma GCC unroll 32
    for (int m = 0; m < M; m++) acc[m] = simd::dot(acc[m], w, simd::broadcast(xp[m]));
  }
}

// One 16-column panel times M rows, bias added, rounded to bf16 and stored.
template <int M>
void panel_rows(const simd::Pair* xp, int64_t x_step, const BFloat16* panel, int64_t K2, const BFloat16* prefetch,
                const BFloat16* bias, BFloat16* y, int64_t y_stride, int64_t cols) {
  Vec acc[M];
  panel_dot<M>(xp, x_step, panel, K2, prefetch, acc);
  const Vec b = bias != nullptr ? simd::load_bf16(bias, cols) : simd::zero();
  for (int m = 0; m < M; m++) simd::store_bf16(y + m * y_stride, simd::add(acc[m], b), cols);
}

using PanelRowsFn = void (*)(const simd::Pair*, int64_t, const BFloat16*, int64_t, const BFloat16*, const BFloat16*,
                             BFloat16*, int64_t, int64_t);
// Rows per panel pass: the accumulators, the weights and a broadcast must fit the registers
// (AVX-512: 24 of 32; AVX2, where each takes two of 16: 5 rows, 4 for the widened weights).
constexpr int kMaxRows = simd::kRegisters == 32 ? 24 : 5;
template <int... Ms>
constexpr auto make_panel_table(std::integer_sequence<int, Ms...>) {
  return std::array<PanelRowsFn, sizeof...(Ms)>{&panel_rows<Ms + 1>...};
}
constexpr auto kPanelRows = make_panel_table(std::make_integer_sequence<int, kMaxRows>{});

// Threads split the panels (output columns); each panel, once loaded, serves a block of rows in
// passes of at most kMaxRows (split evenly: 40 rows go 20 + 20, not 24 + 16) from L1, and a
// block of rows stays in L2 while every panel passes over it. Rows are first interleaved by
// pairs ([K/2][M] pairs; K odd is padded with a zero, as the packed weight is), except a single
// row where a pair is its two bf16s, which already is that layout.
void linear_packed_impl(const BFloat16* x, int64_t x_stride, const BFloat16* packed, const BFloat16* bias,
                        BFloat16* y, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kRowBlock = 256;
  const int64_t K2 = (K + 1) / 2, panels = (N + 15) / 16;
  // Reused from call to call (a step makes a hundred); every pair is written below.
  static thread_local std::vector<simd::Pair> interleaved;
  const simd::Pair* xp = reinterpret_cast<const simd::Pair*>(x);
  if (!simd::kPairIsTwoBf16 || M > 1 || K % 2) {
    interleaved.resize(K2 * M);
    for (int64_t m = 0; m < M; m++) {
      const BFloat16* row = x + m * x_stride;
      for (int64_t k2 = 0; k2 < K / 2; k2++) interleaved[k2 * M + m] = simd::make_pair(row + 2 * k2);
      if (K % 2) interleaved[(K2 - 1) * M + m] = simd::make_pair(row[K - 1], BFloat16(0.0f));
    }
    xp = interleaved.data();
  }
  parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
      const int64_t m_end = std::min(M, mb + kRowBlock), passes = (m_end - mb + kMaxRows - 1) / kMaxRows;
      for (int64_t p = begin; p < end; p++) {
        const int64_t cols = std::min<int64_t>(16, N - p * 16);
        const BFloat16* panel = packed + p * K2 * 32;
        for (int64_t i = 0, m0 = mb; i < passes; i++) {
          const int64_t rows = (m_end - m0) / (passes - i);
          // With rows enough to make a panel compute-bound, the first pass over it also fetches
          // the next panel, a line per line it reads, so memory keeps working meanwhile (15-20%
          // on a model's cold weights at 40-56 rows). With fewer rows the hardware prefetcher
          // streams the weights at full bandwidth alone, and extra requests only get in its way.
          const BFloat16* prefetch = i == 0 && p + 1 < end && M >= 16 ? panel + K2 * 32 : nullptr;
          kPanelRows[rows - 1](xp + m0, M, panel, K2, prefetch, bias ? bias + p * 16 : nullptr, y + m0 * N + p * 16,
                               N, cols);
          m0 += rows;
        }
      }
    }
  });
}

}  // namespace

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16 rows");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2,
              "packed weight must be [N/16, K/2, 16, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.size(0) == (N + 15) / 16 && packed.size(1) == (K + 1) / 2, "packed weight does not fit x");
  at::Tensor y = at::empty({M, N}, x.options());
  const BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16, "bad bias");
    b = bias->data_ptr<BFloat16>();
  }
  linear_packed_impl(x.data_ptr<BFloat16>(), x.stride(0), packed.data_ptr<BFloat16>(), b, y.data_ptr<BFloat16>(), M, N,
                     K);
  return y;
}

// ---- oneDNN's own packed weights ---------------------------------------------------------
// For many rows oneDNN's GEMM is the kernel to use, and it runs 10-25% faster (SmolLM2's shapes,
// 65-2048 rows, bit-identical results) on a copy of the weight it reordered once into its
// blocked layout than on the plain [N, K] weight. Where the CPU has no bf16 arithmetic (AVX2)
// the copy is fp32, which oneDNN multiplies several times faster than bf16 there: x is widened
// to it and the fp32 result rounded back, the same one rounding of an fp32 sum as a bf16 GEMM. That copy is an opaque mkldnn tensor, which
// torch.compile cannot take as a graph input, so it is held here, named by a handle that
// travels as a one-element int64 tensor. Handles are never reused: a released one fails loudly.

namespace {

std::mutex g_onednn_mutex;
std::vector<at::Tensor> g_onednn_weights;

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& handle, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(handle.numel() == 1 && handle.scalar_type() == at::kLong, "a oneDNN weight handle is one int64");
  const int64_t h = *handle.data_ptr<int64_t>();
  at::Tensor weight;
  {
    std::lock_guard<std::mutex> lock(g_onednn_mutex);
    TORCH_CHECK(h >= 0 && h < int64_t(g_onednn_weights.size()) && g_onednn_weights[h].defined(),
                "oneDNN weight ", h, " was released");
    weight = g_onednn_weights[h];
  }
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const auto dtype = weight.scalar_type();
  const bool widen = dtype != x.scalar_type();
  torch::jit::Stack stack{widen ? x.to(dtype) : x, weight,
                          bias.has_value() ? c10::IValue(widen ? bias->to(dtype) : *bias) : c10::IValue(),
                          c10::IValue("none"), c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
  op.callBoxed(&stack);
  const at::Tensor y = stack[0].toTensor();
  return widen ? y.to(x.scalar_type()) : y;
}

}  // namespace

at::Tensor onednn_pack(const at::Tensor& weight) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  torch::jit::Stack stack{simd::kBf16Arithmetic ? weight : weight.to(at::kFloat), c10::IValue()};
  op.callBoxed(&stack);
  std::lock_guard<std::mutex> lock(g_onednn_mutex);
  g_onednn_weights.push_back(stack[0].toTensor());
  return at::full({1}, int64_t(g_onednn_weights.size()) - 1, at::kLong);
}

void onednn_release(const at::Tensor& handle) {
  std::lock_guard<std::mutex> lock(g_onednn_mutex);
  g_onednn_weights.at(handle.item<int64_t>()) = at::Tensor();
}

// x W^T + b: the packed kernel for up to max_packed_rows rows, oneDNN's GEMM above (on its own
// packed copy when there is one); the caller picks the crossover for the CPU: see
// packed_max_rows() in cpu.py.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& packed,
                  const std::optional<at::Tensor>& bias, int64_t max_packed_rows,
                  const std::optional<at::Tensor>& onednn) {
  if (packed.has_value() && x.dim() == 2 && x.size(0) <= max_packed_rows && x.stride(1) == 1 &&
      x.scalar_type() == at::kBFloat16)
    return linear_packed(x, *packed, bias, weight.size(0));
  if (onednn.has_value()) return onednn_linear(x, *onednn, bias);
  return at::linear(x, weight, bias);
}

}  // namespace nanovllm_cpu
