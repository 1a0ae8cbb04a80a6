// silu_and_mul, gelu_tanh_and_mul, rms_norm, add_rms_norm: the bf16 ops of a layer between its
// matmuls (the MLP's gated SiLU or tanh GELU, RMSNorm). Inductor fuses them too, but its kernels take about twice as long on
// their own and ~1.4x in a step (its exp and its bf16 conversions); these round where PyTorch's
// eager bf16 ops do, so they give the same values as those up to the last bit of exp and of a sum.

#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace nanovllm_cpu {
namespace {

using simd::Vec;

// Rows of x viewed as [rows, width], read in place where its rows lie in runs of back-to-back
// rows (a run: all of x's rows where it is contiguous; a token's heads where x is [T, H, D] sliced
// from a step's qkv rows), else from a contiguous copy. The copy is an ATen op on OpenMP's
// threads, which must first win a core from this pool's (benchmarks/RESULTS.md): a decode step's
// q/k norm pays that for a few kilobytes.
struct RowsView {
  at::Tensor x;
  int64_t rows, width, run = 1, run_stride = 0;
  explicit RowsView(const at::Tensor& t) : x(t), width(t.size(-1)) {
    const bool heads_in_runs = x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == width;
    const bool rows_apart = x.dim() == 2 && x.stride(1) == 1;
    if (!x.is_contiguous() && !heads_in_runs && !rows_apart) x = x.contiguous();
    rows = width == 0 ? 0 : x.numel() / width;
    if (x.is_contiguous()) {
      run = std::max<int64_t>(rows, 1);
    } else {
      run = heads_in_runs ? std::max<int64_t>(x.size(1), 1) : 1;
      run_stride = x.stride(0);
    }
  }
  const BFloat16* row(int64_t r) const {
    return x.data_ptr<BFloat16>() + (r / run) * run_stride + (r % run) * width;
  }
};

// At least ~8K elements per thread's share of the rows: a parallel region costs a few us.
inline int64_t rows_grain(int64_t width) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(width, 1)); }

}  // namespace

namespace {

// [..., 2I] = [gate | up] -> act(gate) * up, [..., I]; act(gate) rounded to bf16 before the
// product, as PyTorch's eager bf16 ops round it. `act` maps a vector of gates to fp32 values.
template <typename Act>
at::Tensor gated(const at::Tensor& x, const char* name, Act act) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) % 2 == 0, name, ": bf16 [..., 2I]");
  const RowsView in(x);
  const int64_t I = in.width / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  BFloat16* dst = out.data_ptr<BFloat16>();
  parallel_for(0, in.rows, rows_grain(in.width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; row++) {
      const BFloat16* gate = in.row(row);
      for (int64_t i = 0; i < I; i += 16) {
        const Vec activated = act(simd::load_bf16(gate + i, I - i));
        simd::store_bf16(dst + row * I + i, simd::mul(simd::round_bf16(activated), simd::load_bf16(gate + I + i, I - i)),
                         I - i);
      }
    }
  });
  return out;
}

}  // namespace

// silu(g) = g / (1 + exp(-g)).
at::Tensor silu_and_mul(const at::Tensor& x) {
  return gated(x, "silu_and_mul", [one = simd::set1(1.0f)](Vec g) {
    return simd::div(g, simd::add(one, simd::exp(simd::sub(simd::zero(), g))));
  });
}

// gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), computed as
// g / (1 + exp(-2u)) (1 + tanh(u) is 2 sigmoid(2u)): no cancellation where tanh(u) nears -1.
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return gated(x, "gelu_tanh_and_mul", [](Vec g) {
    const Vec cube = simd::mul(simd::mul(g, g), g);
    const Vec u = simd::mul(simd::set1(0.7978845608028654f), simd::add(g, simd::mul(simd::set1(0.044715f), cube)));
    const Vec minus_two_u = simd::mul(simd::set1(-2.0f), u);
    return simd::div(g, simd::add(simd::set1(1.0f), simd::exp(minus_two_u)));
  });
}

namespace {

// RMSNorm over the last dim, in fp32, as HF's: weight * bf16(x * rsqrt(mean(x^2) + eps)). With a
// residual, x + residual (rounded to bf16) is normed and also returned, as the next residual.
void rms_norm_rows(const RowsView& in, const BFloat16* residual, const at::Tensor& weight, double eps,
                   at::Tensor& out, BFloat16* summed) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == in.width,
              "rms_norm: a bf16 weight of the last dim's size");
  const int64_t H = in.width;
  const BFloat16* w = weight.data_ptr<BFloat16>();
  BFloat16* dst = out.data_ptr<BFloat16>();
  parallel_for(0, in.rows, rows_grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; row++) {
      const BFloat16* x = in.row(row);
      if (residual != nullptr) {  // the sum first, stored: the norm reads it back from L1
        for (int64_t i = 0; i < H; i += 16)
          simd::store_bf16(summed + row * H + i,
                           simd::add(simd::load_bf16(x + i, H - i), simd::load_bf16(residual + row * H + i, H - i)), H - i);
        x = summed + row * H;
      }
      Vec squares = simd::zero();
      for (int64_t i = 0; i < H; i += 16) {
        const Vec v = simd::load_bf16(x + i, H - i);
        squares = simd::fmadd(v, v, squares);
      }
      const Vec inv = simd::set1(1.0f / std::sqrt(simd::reduce_add(squares) / float(H) + float(eps)));
      for (int64_t i = 0; i < H; i += 16) {
        const Vec normed = simd::round_bf16(simd::mul(simd::load_bf16(x + i, H - i), inv));
        simd::store_bf16(dst + row * H + i, simd::mul(simd::load_bf16(w + i, H - i), normed), H - i);
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: bf16");
  const RowsView in(x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_rows(in, nullptr, weight, eps, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && residual.scalar_type() == at::kBFloat16 &&
                  residual.sizes() == x.sizes(), "add_rms_norm: bf16 x and residual of one shape");
  const RowsView in(x);
  const at::Tensor res = residual.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options()), summed = at::empty(x.sizes(), x.options());
  rms_norm_rows(in, res.data_ptr<BFloat16>(), weight, eps, out, summed.data_ptr<BFloat16>());
  return {out, summed};
}

}  // namespace nanovllm_cpu
