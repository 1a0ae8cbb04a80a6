// gguf_moe: a mixture-of-experts layer's experts over weights kept in GGUF blocks (each expert's
// rows in a lanes layout, as gguf_repack makes them), one call a layer: for each token t,
//   y[t] = sum over its slots j of weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
// where the router (a plain linear, softmax and top-k) chose ids and weights before the call.
//
// The step's (token, slot) pairs are grouped by expert, so each selected expert's weights are
// read once a step for all the tokens that chose it. An expert with few rows (a decode step)
// streams its weight rows as gguf_linear's row kernel does, and all such experts share one
// parallel region a projection (the threads split their rows, not the experts: a decode step
// selects about as many experts as there are threads, of equal size); an expert with many rows
// (a prefill chunk) runs the tiled kernel on its rows as one GEMM. Each output element of each
// projection is computed with gguf_linear's arithmetic (RowSums), and each token's slots are
// summed in slot order, so a token's result is the same bits whatever else shares its step.
//
// packed_moe: the same over dense bf16 experts, each expert's weights packed for the packed linear
// kernel (linear.cpp), which runs each selected expert's rows; a token's slots summed alike.
//
// Included by the quantized translation unit after quantized.cpp, whose kernels it calls.

#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <limits>

namespace nanovllm_cpu {
namespace {

// The step's (token, slot) pairs grouped by expert: the experts that stream first, then the
// tiled ones, each in ascending id; within an expert, its pairs in order. Row r of the grouped
// activations is pair pairs[r]; expert i of `experts` owns rows first[i] to first[i] + rows[i] - 1.
struct ExpertGroups {
  std::vector<int64_t> pairs, experts, first, rows, row_of_pair;
  int64_t streamed_experts = 0, streamed_rows = 0;

  ExpertGroups(const int64_t* ids, int64_t pair_count, int64_t num_experts, int64_t max_streaming_rows)
      : pairs(pair_count), row_of_pair(pair_count) {
    std::vector<int64_t> count(num_experts, 0);
    for (int64_t p = 0; p < pair_count; p++) {
      TORCH_CHECK(ids[p] >= 0 && ids[p] < num_experts, "gguf_moe: expert id ", ids[p], " is outside 0..",
                  num_experts - 1);
      count[ids[p]]++;
    }
    for (const bool streamed : {true, false})
      for (int64_t e = 0; e < num_experts; e++)
        if (count[e] > 0 && (count[e] <= max_streaming_rows) == streamed) {
          first.push_back(experts.empty() ? 0 : first.back() + rows.back());
          experts.push_back(e);
          rows.push_back(count[e]);
          if (streamed) streamed_experts++, streamed_rows += count[e];
        }
    std::vector<int64_t> next(num_experts, 0);
    for (size_t i = 0; i < experts.size(); i++) next[experts[i]] = first[i];
    for (int64_t p = 0; p < pair_count; p++) {
      row_of_pair[p] = next[ids[p]]++;
      pairs[row_of_pair[p]] = p;
    }
  }
};

// One projection of every grouped expert: y[r] = a[r] W_e^T for each expert e's rows r, W_e the
// N rows of `w` from row e * N (each `row_bytes` bytes, in lanes layout `type`), a's rows K wide.
template <typename X, typename Y>
void experts_linear(const X* a, int64_t K, const ExpertGroups& groups, const uint8_t* w, int64_t type, int64_t N,
                    int64_t activation_bits, Y* y) {
  int64_t row_bytes = 0;
  bool byte_format = false;
  with_lanes_format(type, [&](auto format) {
    using F = decltype(format);
    TORCH_CHECK(K % F::kValues == 0, "gguf_moe: K=", K, " is not a multiple of the format's block of ", F::kValues,
                " values");
    row_bytes = K / F::kValues * F::kBytes;
    byte_format = kByteProducts<F>;
  });
  const bool byte_products = activation_bits == 8 && byte_format;
  const auto part = [&](size_t i) {
    return Part{type, w + groups.experts[i] * N * row_bytes, row_bytes, 0, N};
  };
  if (groups.streamed_rows > 0) {
    // The streamed experts' rows lead the grouping: one quantized x for them all, and one
    // parallel region over all their weight rows, expert after expert.
    const QuantizedRows xq(a, K, groups.streamed_rows, K, activation_bits, byte_products, true);
    const int64_t grain = std::max<int64_t>(1, 16384 / row_bytes);
    parallel_for(0, groups.streamed_experts * N, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end;) {
        const int64_t expert = i / N, lo = i % N, hi = std::min(N, lo + end - i);
        with_lanes_format(type, [&](auto format) {
          streaming_rows<decltype(format)>(xq, part(expert), lo, hi, nullptr, y, groups.first[expert],
                                           groups.rows[expert], N, K);
        });
        i += hi - lo;
      }
    });
  }
  for (size_t i = groups.streamed_experts; i < groups.experts.size(); i++) {
    const QuantizedRows xq(a + groups.first[i] * K, K, groups.rows[i], K, activation_bits, byte_products, false);
    tiled_linear(xq, {part(i)}, nullptr, y + groups.first[i] * N, groups.rows[i], N, K);
  }
}

// A step's routing as both ops take it: the checked ids and weights, the pairs grouped by expert
// (groups), x's rows in that order (grouped), and each token's slots summed in slot order (sum).
struct RoutedStep {
  int64_t T, H, k;
  at::Tensor ids, weights, grouped;
  ExpertGroups groups;

  RoutedStep(const char* op, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
             int64_t num_experts, int64_t max_streaming_rows)
      : T(x.size(0)), H(x.size(1)), k(topk_ids.size(-1)), ids(checked_ids(op, x, topk_ids)),
        weights(topk_weights.contiguous()),
        groups(ids.data_ptr<int64_t>(), T * k, num_experts, max_streaming_rows) {
    TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat, op,
                ": topk_weights must be fp32, shaped as topk_ids");
    at::Tensor index = at::empty({T * k}, ids.options());
    int64_t* token = index.data_ptr<int64_t>();
    for (int64_t r = 0; r < T * k; r++) token[r] = groups.pairs[r] / k;
    grouped = x.contiguous().index_select(0, index);
  }

  static at::Tensor checked_ids(const char* op, const at::Tensor& x, const at::Tensor& topk_ids) {
    TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat), op,
                ": x must be bf16 or fp32 [tokens, hidden]");
    TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.scalar_type() == at::kLong, op,
                ": topk_ids must be int64 [tokens, k]");
    return topk_ids.contiguous();
  }

  // down: [pairs, H] fp32 in grouped order -> [T, H] in `like`'s dtype, each token's slots summed
  // in slot order.
  at::Tensor sum(const at::Tensor& down, const at::Tensor& like) const {
    at::Tensor out = at::empty({T, H}, like.options());
    const float* d = down.data_ptr<float>();
    const float* wt = weights.data_ptr<float>();
    const int64_t* row_of_pair = groups.row_of_pair.data();
    const auto run = [&](auto* y) {
      using Y = std::remove_pointer_t<decltype(y)>;
      parallel_for(0, T, std::max<int64_t>(1, 8192 / H), [&](int64_t begin, int64_t end) {
        std::vector<float> acc(H);
        for (int64_t t = begin; t < end; t++) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t j = 0; j < k; j++) {
            const float weight = wt[t * k + j];
            const float* row = d + row_of_pair[t * k + j] * H;
            for (int64_t h = 0; h < H; h++) acc[h] += weight * row[h];
          }
          for (int64_t h = 0; h < H; h++) y[t * H + h] = Y(acc[h]);
        }
      });
    };
    if (like.scalar_type() == at::kFloat)
      run(out.data_ptr<float>());
    else
      run(out.data_ptr<BFloat16>());
    return out;
  }
};

// [rows, 2I] gate | up -> act(gate) * up, with the dense MLP's kernels and roundings.
at::Tensor gated_rows(const at::Tensor& gate_up, int64_t activation, int64_t I) {
  TORCH_CHECK(activation == 0 || activation == 1, "moe: activation ", activation, " is not 0 (silu) or 1 (gelu_tanh)");
  if (gate_up.scalar_type() == at::kBFloat16) return activation == 0 ? silu_and_mul(gate_up) : gelu_tanh_and_mul(gate_up);
  const at::Tensor gate = gate_up.narrow(1, 0, I);
  return at::mul(activation == 0 ? at::silu(gate) : at::gelu(gate, "tanh"), gate_up.narrow(1, I, I));
}

}  // namespace

at::Tensor gguf_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                    const at::Tensor& w13, int64_t w13_type, const at::Tensor& w2, int64_t w2_type,
                    int64_t intermediate, int64_t activation, int64_t max_streaming_rows, int64_t w13_bits,
                    int64_t w2_bits) {
  const int64_t I = intermediate;
  TORCH_CHECK(w13.dim() == 2 && w2.dim() == 2 && w13.scalar_type() == at::kByte && w2.scalar_type() == at::kByte &&
                  w13.is_contiguous() && w2.is_contiguous(),
              "gguf_moe: the experts' weights must be contiguous uint8 rows of blocks");
  const int64_t E = w13.size(0) / (2 * I);
  const RoutedStep step("gguf_moe", x, topk_ids, topk_weights, E, max_streaming_rows);
  const int64_t H = step.H, P = step.T * step.k;
  TORCH_CHECK(w13.size(0) == E * 2 * I && w2.size(0) == E * H, "gguf_moe: w13 holds ", w13.size(0), " rows and w2 ",
              w2.size(0), "; expected 2 x ", I, " and ", H, " an expert");
  // The gate/up projection's output and the activation in x's dtype (the dense MLP's roundings);
  // the down projection's output in fp32, unrounded until the sum.
  at::Tensor gate_up = at::empty({P, 2 * I}, x.options());
  at::Tensor down = at::empty({P, H}, x.options().dtype(at::kFloat));
  const auto run = [&](auto* xs) {
    using X = std::remove_pointer_t<decltype(xs)>;
    experts_linear(step.grouped.data_ptr<X>(), H, step.groups, w13.data_ptr<uint8_t>(), w13_type, 2 * I, w13_bits,
                   gate_up.data_ptr<X>());
    const at::Tensor activated = gated_rows(gate_up, activation, I);
    experts_linear(activated.data_ptr<X>(), I, step.groups, w2.data_ptr<uint8_t>(), w2_type, H, w2_bits,
                   down.data_ptr<float>());
  };
  if (x.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<BFloat16*>(nullptr));
  return step.sum(down, x);
}

at::Tensor packed_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                      const at::Tensor& w13, const at::Tensor& w2, int64_t intermediate, int64_t activation) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_moe: x must be bf16");
  TORCH_CHECK(w13.dim() == 5 && w2.dim() == 5 && w13.size(0) == w2.size(0) && w13.is_contiguous() &&
                  w2.is_contiguous() && w13.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16,
              "packed_moe: the experts' weights must be bf16 [experts, N/16, K/2, 16, 2], packed");
  const int64_t I = intermediate, E = w13.size(0);
  // Every expert's rows through the packed kernel, one expert after another.
  const RoutedStep step("packed_moe", x, topk_ids, topk_weights, E, std::numeric_limits<int64_t>::max());
  const int64_t H = step.H;
  const ExpertGroups& groups = step.groups;
  at::Tensor down = at::empty({step.T * step.k, H}, x.options().dtype(at::kFloat));
  for (size_t i = 0; i < groups.experts.size(); i++) {
    const int64_t e = groups.experts[i], first = groups.first[i], rows = groups.rows[i];
    const at::Tensor gate_up = linear_packed(step.grouped.narrow(0, first, rows), w13[e], std::nullopt, 2 * I);
    down.narrow(0, first, rows).copy_(linear_packed(gated_rows(gate_up, activation, I), w2[e], std::nullopt, H));
  }
  return step.sum(down, x);
}

}  // namespace nanovllm_cpu
