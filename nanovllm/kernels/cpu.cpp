// CPU kernels for the decode-heavy parts of a step, registered as torch ops (namespace
// nanovllm_cpu) and built on first use by nanovllm/kernels/cpu.py.
//
//  * linear / linear_packed: y = x W^T (+ b) for a few rows of x, over a bf16 weight packed as
//    [N/16][K/2][16][2]. Each 64-byte load holds two k-steps of sixteen output columns, so one
//    AVX512-BF16 dot-product instruction per (row, k-pair) consumes it and the weight streams
//    from memory exactly once, with no horizontal sums. oneDNN's bf16 GEMV at batch 1 reads
//    weights at a third of the memory bandwidth; small decode batches are all about bandwidth.
//  * store_kv: scatters a step's new keys/values into the paged cache by slot (-1 = skip).
//  * paged_attention: causal attention of every query row of a step (decodes and prefill
//    chunks alike) over the paged cache, read in place through the block tables.
//
// Cache layout, per layer: [KVH][blocks][bs * D], head-major, so that one KV head's blocks lie
// back to back and a sequence's run of consecutive block ids reads as one stream (the
// hardware prefetchers follow it; block-major, a head's 2 KB of a block sat between the other
// heads' and every block was a new stream). Inside one block of one head (bs = block size,
// D = head_dim):
//    keys   [D/2][bs][2]: for each pair of dims, the 16 tokens of a tile side by side, so one
//           64-byte load times a broadcast query pair yields 16 partial scores at once;
//    values [bs/2][D][2]: for each pair of tokens, their values interleaved dim by dim, so one
//           load times a broadcast pair of probabilities adds two tokens into 16 outputs.
// Both feed AVX512-BF16 dot products with no shuffles and no horizontal sums.
//
// Only slots below a sequence's context length are ever read, and those were written by this
// or an earlier step, so the cache never needs zeroing; lanes past the end are masked before
// any arithmetic touches them (0 * NaN garbage would be NaN).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using at::BFloat16;

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kHasBf16Kernels = true;

// acc += w . (the bf16 pair at p, broadcast to all 16 lanes).
inline __m512 dot_broadcast(__m512 acc, __m512bh w, const void* p) {
  uint32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm512_dpbf16_ps(acc, w, (__m512bh)_mm512_set1_epi32(pair));
}

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

// acc[m] += sum over k of x[m, k] * W[n, k] for one 16-column panel and M rows of x, given as
// bf16 pairs: pair k2 of row m at xp[k2 * x_step + m]. Each weight load feeds M dot products,
// and every row's pair sits at a fixed offset from one pointer, so the broadcasts need no
// address registers of their own.
template <int M>
void panel_dot(const uint32_t* xp, int64_t x_step, const BFloat16* panel, int64_t K2, const BFloat16* prefetch,
               __m512* acc) {
  for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; k2++, xp += x_step) {
    if (prefetch != nullptr) _mm_prefetch((const char*)(prefetch + k2 * 32), _MM_HINT_T0);
    const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + k2 * 32);
#pragma GCC unroll 32
    for (int m = 0; m < M; m++) acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(int(xp[m])));
  }
}

// One 16-column panel times M rows, bias added, rounded to bf16 and stored.
template <int M>
void panel_rows(const uint32_t* xp, int64_t x_step, const BFloat16* panel, int64_t K2, const BFloat16* prefetch,
                const BFloat16* bias, BFloat16* y, int64_t y_stride, int64_t cols) {
  __m512 acc[M];
  panel_dot<M>(xp, x_step, panel, K2, prefetch, acc);
  const __mmask16 mask = tail_mask(cols);
  const __m512 b = bias != nullptr ? load_bf16(bias, mask) : _mm512_setzero_ps();
  for (int m = 0; m < M; m++) store_bf16(y + m * y_stride, _mm512_add_ps(acc[m], b), mask);
}

using PanelRowsFn = void (*)(const uint32_t*, int64_t, const BFloat16*, int64_t, const BFloat16*, const BFloat16*,
                             BFloat16*, int64_t, int64_t);
// Rows per panel pass: 24 accumulators, the weight and a broadcast fit AVX-512's 32 registers.
constexpr int kMaxRows = 24;
template <int... Ms>
constexpr auto make_panel_table(std::integer_sequence<int, Ms...>) {
  return std::array<PanelRowsFn, sizeof...(Ms)>{&panel_rows<Ms + 1>...};
}
constexpr auto kPanelRows = make_panel_table(std::make_integer_sequence<int, kMaxRows>{});

// Threads split the panels (output columns); each panel, once loaded, serves a block of rows in
// passes of at most kMaxRows (split evenly: 40 rows go 20 + 20, not 24 + 16) from L1, and a
// block of rows stays in L2 while every panel passes over it. Rows are first interleaved by
// pairs ([K/2][M] pairs; K odd is padded with a zero, as the packed weight is), except a single
// row, which already is that layout.
void linear_packed_impl(const BFloat16* x, int64_t x_stride, const BFloat16* packed, const BFloat16* bias,
                        BFloat16* y, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kRowBlock = 256;
  const int64_t K2 = (K + 1) / 2, panels = (N + 15) / 16;
  std::vector<uint32_t> interleaved;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  if (M > 1 || K % 2) {
    interleaved.assign(K2 * M, 0);
    for (int64_t m = 0; m < M; m++) {
      const BFloat16* row = x + m * x_stride;
      for (int64_t k2 = 0; k2 < K / 2; k2++) std::memcpy(&interleaved[k2 * M + m], row + 2 * k2, 4);
      if (K % 2) std::memcpy(&interleaved[(K2 - 1) * M + m], row + K - 1, 2);
    }
    xp = interleaved.data();
  }
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
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
#else
constexpr bool kHasBf16Kernels = false;
#endif

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(kHasBf16Kernels, "linear_packed needs a build with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16 rows");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2,
              "packed weight must be [N/16, K/2, 16, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.size(0) == (N + 15) / 16 && packed.size(1) == (K + 1) / 2, "packed weight does not fit x");
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  const BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16, "bad bias");
    b = bias->data_ptr<BFloat16>();
  }
  linear_packed_impl(x.data_ptr<BFloat16>(), x.stride(0), packed.data_ptr<BFloat16>(), b, y.data_ptr<BFloat16>(), M, N,
                     K);
#endif
  return y;
}

// ---- oneDNN's own packed weights ---------------------------------------------------------
// For many rows oneDNN's GEMM is the kernel to use, and it runs 10-25% faster (SmolLM2's shapes,
// 65-2048 rows, bit-identical results) on a copy of the weight it reordered once into its
// blocked layout than on the plain [N, K] weight. That copy is an opaque mkldnn tensor, which
// torch.compile cannot take as a graph input, so it is held here, named by a handle that
// travels as a one-element int64 tensor. Handles are never reused: a released one fails loudly.

std::mutex g_onednn_mutex;
std::vector<at::Tensor> g_onednn_weights;

at::Tensor onednn_pack(const at::Tensor& weight) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  torch::jit::Stack stack{weight, c10::IValue()};
  op.callBoxed(&stack);
  std::lock_guard<std::mutex> lock(g_onednn_mutex);
  g_onednn_weights.push_back(stack[0].toTensor());
  return at::full({1}, int64_t(g_onednn_weights.size()) - 1, at::kLong);
}

void onednn_release(const at::Tensor& handle) {
  std::lock_guard<std::mutex> lock(g_onednn_mutex);
  g_onednn_weights.at(handle.item<int64_t>()) = at::Tensor();
}

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
  torch::jit::Stack stack{x, weight, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x W^T + b: the packed kernel for up to max_packed_rows rows, oneDNN's GEMM above (on its own
// packed copy when there is one); the caller picks the crossover for the CPU: see
// PACKED_MAX_ROWS in cpu.py.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& packed,
                  const std::optional<at::Tensor>& bias, int64_t max_packed_rows,
                  const std::optional<at::Tensor>& onednn) {
  if (kHasBf16Kernels && packed.has_value() && x.dim() == 2 && x.size(0) <= max_packed_rows && x.stride(1) == 1 &&
      x.scalar_type() == at::kBFloat16)
    return linear_packed(x, *packed, bias, weight.size(0));
  if (onednn.has_value()) return onednn_linear(x, *onednn, bias);
  return at::linear(x, weight, bias);
}

// Offsets of (token in block, dim) inside one block of one KV head, in the layouts above.
inline int64_t key_offset(int64_t t, int64_t d, int64_t bs) { return ((d / 2) * bs + t) * 2 + (d & 1); }
inline int64_t value_offset(int64_t t, int64_t d, int64_t D) { return ((t / 2) * D + d) * 2 + (t & 1); }

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  // k, v: [T, KVH, D], each head's D contiguous; caches: [KVH, blocks, bs * D].
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3, "caches: [KVH, blocks, bs*D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "dtypes");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v heads must be contiguous");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), bs = k_cache.size(2) / D;
  TORCH_CHECK(k_cache.size(0) == KVH && bs * D == k_cache.size(2), "cache shape does not fit k");
  const int64_t num_blocks = k_cache.size(1), num_slots = num_blocks * bs;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto run = [&](auto* type_tag) {
    using T_ = std::remove_pointer_t<decltype(type_tag)>;
    T_* kc = k_cache.data_ptr<T_>();
    T_* vc = v_cache.data_ptr<T_>();
    const T_* ks = k.data_ptr<T_>();
    const T_* vs = v.data_ptr<T_>();
    // Split even a decode step's few tokens between threads: each token writes a cache line per
    // pair of key dims, ~100 lines per token of the default model, all cold, so the time is
    // misses in flight, and two threads keep twice as many (56 tokens: 43 us -> 30 us a layer).
    at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;  // a padding row
        TORCH_CHECK(slot < num_slots, "slot ", slot, " is outside the cache");
        const int64_t block = slot / bs, pos = slot % bs;
        for (int64_t h = 0; h < KVH; h++) {
          T_* kb = kc + (h * num_blocks + block) * bs * D;
          T_* vb = vc + (h * num_blocks + block) * bs * D;
          const T_* kr = ks + t * k.stride(0) + h * k.stride(1);
          const T_* vr = vs + t * v.stride(0) + h * v.stride(1);
          for (int64_t d = 0; d < D; d++) {
            kb[key_offset(pos, d, bs)] = kr[d];
            vb[value_offset(pos, d, D)] = vr[d];
          }
        }
      }
    });
  };
  if (k.scalar_type() == at::kBFloat16) {
    run(static_cast<BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(k.scalar_type() == at::kFloat, "store_kv supports float32 and bfloat16");
    run(static_cast<float*>(nullptr));
  }
}

// ---- attention ---------------------------------------------------------------------------

// One unit of work: query rows [row_begin, row_end) of one sequence, one KV head.
struct Item {
  int64_t seq, head, row_begin, row_end;
  double cost;
};

// A (query row, query head) pair; `last` is the last key position it may see.
template <typename T>
struct Row {
  const T* q;
  T* out;
  int64_t last;
};

struct Paged {
  const int32_t* table;  // the sequence's block table
  int64_t bs, D, num_blocks, head;
  // Start of the data of the block holding token t, for this KV head.
  template <typename T>
  const T* block(const T* cache, int64_t t) const {
    return cache + (head * num_blocks + table[t / bs]) * bs * D;
  }
};

// Portable path (fp32, or shapes the vectorised path does not take): one row at a time.
template <typename T>
void attend_rows_generic(const Row<T>* rows, int n, const T* k_cache, const T* v_cache, const Paged& pg,
                         float scale, std::vector<float>& scratch) {
  const int64_t D = pg.D, bs = pg.bs;
  for (int r = 0; r < n; r++) {
    const int64_t len = rows[r].last + 1;
    scratch.resize(len + D);
    float* s = scratch.data();
    float* acc = s + len;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; t++) {
      const T* kb = pg.block(k_cache, t);
      float dot = 0;
      for (int64_t d = 0; d < D; d++) dot += float(rows[r].q[d]) * float(kb[key_offset(t % bs, d, bs)]);
      s[t] = dot * scale;
      max_score = std::max(max_score, s[t]);
    }
    float sum = 0;
    for (int64_t t = 0; t < len; t++) sum += (s[t] = std::exp(s[t] - max_score));
    std::fill(acc, acc + D, 0.0f);
    for (int64_t t = 0; t < len; t++) {
      const T* vb = pg.block(v_cache, t);
      for (int64_t d = 0; d < D; d++) acc[d] += s[t] * float(vb[value_offset(t % bs, d, D)]);
    }
    for (int64_t d = 0; d < D; d++) rows[r].out[d] = T(acc[d] / sum);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
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

// bf16, D = 16 * chunks, block size a multiple of 16: NR rows at once over 16-key tiles with an
// online softmax, so every key and value load feeds NR dot products. Scores accumulate in fp32;
// probabilities are rounded to bf16 for the value sum, as flash attention does.
template <int chunks, int NR>
void attend_rows_bf16(const Row<BFloat16>* rows, const BFloat16* k_cache, const BFloat16* v_cache, const Paged& pg,
                      float scale) {
  constexpr int D = 16 * chunks;
  constexpr int P = NR * (chunks + 4) <= 28 ? 4 : 2;  // divides D / 2 = 8 * chunks
  const int64_t bs = pg.bs;
  __m512 acc[NR][chunks];
  float running_max[NR], running_sum[NR];
  int64_t last = 0;
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < chunks; c++) acc[r][c] = _mm512_setzero_ps();
    running_max[r] = -std::numeric_limits<float>::infinity();
    running_sum[r] = 0;
    last = std::max(last, rows[r].last);
  }
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = 0; t0 <= last; t0 += 16) {
    const BFloat16* keys = pg.block(k_cache, t0) + (t0 % bs) * 2;
    const BFloat16* values = pg.block(v_cache, t0) + (t0 % bs) * D;
    // Blocks sit anywhere in memory: fetch the next tile while on this one, a key line and a
    // value line per key line read (a burst of requests at once would be mostly dropped).
    const int64_t next = std::min(t0 + 16, last);
    const char* next_keys = (const char*)(pg.block(k_cache, next) + (next % bs) * 2);
    const char* next_values = (const char*)(pg.block(v_cache, next) + (next % bs) * D);
    // P partial sums per row: a dot product's latency is several cycles, and one chain per row
    // over D / 2 steps would leave the multiply units idle.
    __m512 part[NR][P], s[NR];
    for (int r = 0; r < NR; r++)
      for (int p = 0; p < P; p++) part[r][p] = _mm512_setzero_ps();
    for (int dp0 = 0; dp0 < D / 2; dp0 += P) {
      for (int p = 0; p < P; p++) {
        const int dp = dp0 + p;
        _mm_prefetch(next_keys + dp * bs * 4, _MM_HINT_T0);
        _mm_prefetch(next_values + dp * 64, _MM_HINT_T0);
        const __m512bh k = (__m512bh)_mm512_loadu_si512(keys + dp * bs * 2);
        for (int r = 0; r < NR; r++) part[r][p] = dot_broadcast(part[r][p], k, rows[r].q + 2 * dp);
      }
    }
    for (int r = 0; r < NR; r++) {
      s[r] = part[r][0];
      for (int p = 1; p < P; p++) s[r] = _mm512_add_ps(s[r], part[r][p]);
    }
    alignas(64) uint16_t probs[NR][16];
    for (int r = 0; r < NR; r++) {
      const int64_t visible = std::clamp<int64_t>(rows[r].last - t0 + 1, 0, 16);
      if (visible == 0) {  // this row's keys ended in an earlier tile
        std::memset(probs[r], 0, sizeof(probs[r]));
        continue;
      }
      const __mmask16 mask = tail_mask(visible);
      const __m512 scores = _mm512_mask_blend_ps(mask, minus_inf, _mm512_mul_ps(s[r], _mm512_set1_ps(scale)));
      const float tile_max = _mm512_reduce_max_ps(scores);
      if (tile_max > running_max[r]) {  // rescale what came before; past the first tiles, rarely
        const float correction = std::exp(running_max[r] - tile_max);
        running_sum[r] *= correction;
        for (int c = 0; c < chunks; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(correction));
        running_max[r] = tile_max;
      }
      const __m512 p = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(running_max[r]))));
      running_sum[r] += _mm512_reduce_add_ps(p);
      _mm256_store_si256((__m256i*)probs[r], (__m256i)_mm512_cvtneps_pbh(p));
    }
    // Token pairs up to the last visible key of any row; a pair whose second token lies past
    // it has that token's values zeroed, since the slot may never have been written.
    const int64_t visible = std::min<int64_t>(last - t0 + 1, 16);
    for (int64_t tp = 0; 2 * tp < visible; tp++) {
      const bool half = 2 * tp + 1 >= visible;
      for (int c = 0; c < chunks; c++) {
        __m512i v = _mm512_loadu_si512(values + tp * D * 2 + c * 32);
        if (half) v = _mm512_maskz_mov_epi16(0x55555555u, v);
        for (int r = 0; r < NR; r++)
          acc[r][c] = dot_broadcast(acc[r][c], (__m512bh)v, probs[r] + 2 * tp);
      }
    }
  }
  for (int r = 0; r < NR; r++) {
    const __m512 inv = _mm512_set1_ps(1.0f / running_sum[r]);
    for (int c = 0; c < chunks; c++)
      _mm256_storeu_si256((__m256i*)(rows[r].out + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));
  }
}

// Rows per call: as many as registers allow (NR * (chunks + 1) accumulators); a decode's GQA
// group (its query heads share every key and value) fits in one call.
template <int chunks>
constexpr int kRowsAtOnce = chunks <= 4 ? 4 : 2;

template <int chunks, int... NRs>
void attend_rows_bf16_groups(const Row<BFloat16>* rows, int n, const BFloat16* k_cache, const BFloat16* v_cache,
                             const Paged& pg, float scale, std::integer_sequence<int, NRs...>) {
  using Fn = void (*)(const Row<BFloat16>*, const BFloat16*, const BFloat16*, const Paged&, float);
  constexpr Fn by_count[] = {&attend_rows_bf16<chunks, NRs + 1>...};
  constexpr int R = sizeof...(NRs);
  for (int i = 0; i < n; i += R) by_count[std::min(R, n - i) - 1](rows + i, k_cache, v_cache, pg, scale);
}

template <int chunks>
void attend_rows_bf16_any(const Row<BFloat16>* rows, int n, const BFloat16* k_cache, const BFloat16* v_cache,
                          const Paged& pg, float scale) {
  attend_rows_bf16_groups<chunks>(rows, n, k_cache, v_cache, pg, scale,
                                  std::make_integer_sequence<int, kRowsAtOnce<chunks>>{});
}

using AttendRowsFn = void (*)(const Row<BFloat16>*, int, const BFloat16*, const BFloat16*, const Paged&, float);
// head_dim 16, 32, ..., 128 (index head_dim / 16 - 1); other sizes go the portable way.
constexpr AttendRowsFn kAttendRows[8] = {
    &attend_rows_bf16_any<1>, &attend_rows_bf16_any<2>, &attend_rows_bf16_any<3>, &attend_rows_bf16_any<4>,
    &attend_rows_bf16_any<5>, &attend_rows_bf16_any<6>, &attend_rows_bf16_any<7>, &attend_rows_bf16_any<8>};
#endif

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, const at::Tensor& block_tables,
                     double scale) {
  // q, out: [T, H, D] (each head's D contiguous); caches [KVH, blocks, bs * D]; sequence i owns
  // query rows cu_seqlens_q[i]:cu_seqlens_q[i+1], the last of which sits at position
  // context_lens[i] - 1; block_tables [B, max_blocks] int32.
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(), "dtypes differ");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt, "cu_seqlens_q/context_lens/block_tables: int32");
  TORCH_CHECK(block_tables.is_contiguous() && cu_seqlens_q.is_contiguous() && context_lens.is_contiguous(),
              "metadata must be contiguous");
  const int64_t B = context_lens.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2) / D, G = H / KVH;
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  // Work items of up to 16 query rows, heaviest first, dealt out to threads in turn: causal
  // rows late in a long prompt cost far more than early ones or than a short decode.
  constexpr int64_t kRowsPerItem = 16;
  std::vector<Item> items;
  for (int64_t b = 0; b < B; b++) {
    const int64_t q_len = cu[b + 1] - cu[b], ctx = lens[b];
    TORCH_CHECK(q_len >= 0 && ctx >= q_len && ctx <= max_blocks * bs, "sequence ", b, ": bad lengths");
    for (int64_t r0 = 0; r0 < q_len; r0 += kRowsPerItem) {
      const int64_t r1 = std::min(q_len, r0 + kRowsPerItem);
      const double cost = double(r1 - r0) * double(ctx - q_len + (r0 + r1) / 2 + 16);
      for (int64_t h = 0; h < KVH; h++) items.push_back({b, h, cu[b] + r0, cu[b] + r1, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n_items = int64_t(items.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n_items, 1));

  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* kc = k_cache.data_ptr<T>();
    const T* vc = v_cache.data_ptr<T>();
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      std::vector<Row<T>> rows;
      std::vector<float> scratch;
      for (int64_t worker = begin; worker < end; worker++) {
        for (int64_t i = worker; i < n_items; i += threads) {
          const Item& it = items[i];
          const int64_t first_pos = lens[it.seq] - (cu[it.seq + 1] - cu[it.seq]);
          rows.clear();
          for (int64_t row = it.row_begin; row < it.row_end; row++)
            for (int64_t g = 0; g < G; g++) {
              const int64_t head = it.head * G + g;
              rows.push_back({q.data_ptr<T>() + row * q.stride(0) + head * q.stride(1),
                              out.data_ptr<T>() + row * out.stride(0) + head * out.stride(1),
                              first_pos + row - cu[it.seq]});
            }
          const Paged pg{tables + it.seq * max_blocks, bs, D, num_blocks, it.head};
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
          if constexpr (std::is_same_v<T, BFloat16>) {
            if (D % 16 == 0 && D <= 128 && bs % 16 == 0) {
              kAttendRows[D / 16 - 1](rows.data(), int(rows.size()), kc, vc, pg, float(scale));
              continue;
            }
          }
#endif
          attend_rows_generic<T>(rows.data(), int(rows.size()), kc, vc, pg, float(scale), scratch);
        }
      }
    });
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(static_cast<BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention supports float32 and bfloat16");
    run(static_cast<float*>(nullptr));
  }
}

// ---- sampling ----------------------------------------------------------------------------

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
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  const float* temps = temperatures.data_ptr<float>();
  const float* us = uniforms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t row = begin; row < end; row++) {
      const float* l = logits.data_ptr<float>() + row * logits.stride(0);
      auto load16 = [&](int64_t v) {  // the 16 logits at v; -inf past the end
        return _mm512_mask_loadu_ps(minus_inf, tail_mask(V - v), l + v);
      };
      __m512 max16 = minus_inf;
      for (int64_t v = 0; v < V; v += 16) max16 = _mm512_max_ps(max16, load16(v));
      const __m512 offset = _mm512_set1_ps(_mm512_reduce_max_ps(max16)), inv_t = _mm512_set1_ps(1.0f / temps[row]);
      // exp((l - max) / T) for the 16 logits at v, 0 where l is -inf.
      auto probs16 = [&](int64_t v) {
        const __m512 x = load16(v);
        const __mmask16 live = _mm512_cmp_ps_mask(x, minus_inf, _CMP_NEQ_OQ);
        return _mm512_maskz_mov_ps(live, exp16(_mm512_mul_ps(_mm512_sub_ps(x, offset), inv_t)));
      };
      float total = 0;
      for (int64_t v = 0; v < V; v += 16) total += _mm512_reduce_add_ps(probs16(v));
      const float target = us[row] * total;
      // Whole chunks are skipped by the same sums as the total's, then one is scanned. Should
      // rounding leave the target unreached, the last token with any probability is drawn.
      int64_t token = -1, last_live = -1;
      float running = 0;
      for (int64_t v = 0; v < V && token < 0; v += 16) {
        const __m512 p = probs16(v);
        const float chunk = _mm512_reduce_add_ps(p);
        if (running + chunk > target) {
          alignas(64) float ps[16];
          _mm512_store_ps(ps, p);
          float partial = running;
          for (int j = 0; j < 16 && token < 0; j++) {
            partial += ps[j];
            if (ps[j] > 0 && partial > target) token = v + j;
          }
        }
        const unsigned live = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_GT_OQ);
        if (live != 0) last_live = v + 31 - __builtin_clz(live);
        running += chunk;
      }
      out[row] = token >= 0 ? token : last_live;
    }
  });
#else
  TORCH_CHECK(false, "sample_rows needs a build with AVX512-BF16");
#endif
  return tokens;
}

// ---- elementwise: the MLP's gated SiLU, RMSNorm -------------------------------------------

// The bf16 ops of a layer between its matmuls. Inductor fuses them too, but its kernels take
// about twice as long on their own and ~1.4x in a step (its exp and its bf16 conversions);
// these round where PyTorch's eager bf16 ops do, so they give the same values as those up to
// the last bit of exp and of a sum.

// Rows of x viewed as [rows, width]; x made contiguous first if it is not.
struct RowsView {
  at::Tensor x;
  int64_t rows, width;
  explicit RowsView(const at::Tensor& t) : x(t.contiguous()), width(t.size(-1)) {
    rows = width == 0 ? 0 : x.numel() / width;
  }
};

// At least ~8K elements per thread's share of the rows: a parallel region costs a few us.
inline int64_t rows_grain(int64_t width) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(width, 1)); }

// [..., 2I] = [gate | up] -> silu(gate) * up, [..., I]; silu rounded to bf16 before the product.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "silu_and_mul: bf16 [..., 2I]");
  const RowsView in(x);
  const int64_t I = in.width / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  const BFloat16* src = in.x.data_ptr<BFloat16>();
  BFloat16* dst = out.data_ptr<BFloat16>();
  at::parallel_for(0, in.rows, rows_grain(in.width), [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t row = begin; row < end; row++) {
      const BFloat16* gate = src + row * 2 * I;
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = tail_mask(I - i);
        const __m512 g = load_bf16(gate + i, m);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store_bf16(dst + row * I + i, _mm512_mul_ps(round_bf16(silu), load_bf16(gate + I + i, m)), m);
      }
    }
  });
#else
  TORCH_CHECK(false, "silu_and_mul needs a build with AVX512-BF16");
#endif
  return out;
}

// RMSNorm over the last dim, in fp32, as HF's: weight * bf16(x * rsqrt(mean(x^2) + eps)). With a
// residual, x + residual (rounded to bf16) is normed and also returned, as the next residual.
void rms_norm_rows(const RowsView& in, const BFloat16* residual, const at::Tensor& weight, double eps,
                   at::Tensor& out, BFloat16* summed) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == in.width,
              "rms_norm: a bf16 weight of the last dim's size");
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  const int64_t H = in.width;
  const BFloat16* src = in.x.data_ptr<BFloat16>();
  const BFloat16* w = weight.data_ptr<BFloat16>();
  BFloat16* dst = out.data_ptr<BFloat16>();
  at::parallel_for(0, in.rows, rows_grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; row++) {
      const BFloat16* x = src + row * H;
      if (residual != nullptr) {  // the sum first, stored: the norm reads it back from L1
        for (int64_t i = 0; i < H; i += 16) {
          const __mmask16 m = tail_mask(H - i);
          store_bf16(summed + row * H + i, _mm512_add_ps(load_bf16(x + i, m), load_bf16(residual + row * H + i, m)), m);
        }
        x = summed + row * H;
      }
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < H; i += 16) {
        const __m512 v = load_bf16(x + i, tail_mask(H - i));
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / float(H) + float(eps)));
      for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 m = tail_mask(H - i);
        const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(x + i, m), inv));
        store_bf16(dst + row * H + i, _mm512_mul_ps(load_bf16(w + i, m), normed), m);
      }
    }
  });
#else
  TORCH_CHECK(false, "rms_norm needs a build with AVX512-BF16");
#endif
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: bf16");
  const RowsView in(x);
  at::Tensor out = at::empty_like(in.x);
  rms_norm_rows(in, nullptr, weight, eps, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && residual.scalar_type() == at::kBFloat16 &&
                  residual.sizes() == x.sizes(), "add_rms_norm: bf16 x and residual of one shape");
  const RowsView in(x);
  const at::Tensor res = residual.contiguous();
  at::Tensor out = at::empty_like(in.x), summed = at::empty_like(in.x);
  rms_norm_rows(in, res.data_ptr<BFloat16>(), weight, eps, out, summed.data_ptr<BFloat16>());
  return {out, summed};
}

}  // namespace

TORCH_LIBRARY(nanovllm_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? packed, Tensor? bias, int max_packed_rows, Tensor? onednn) -> Tensor");
  m.def("onednn_pack(Tensor weight) -> Tensor");
  m.def("onednn_release(Tensor handle) -> ()");
  m.def("linear_packed(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
        "Tensor context_lens, Tensor block_tables, float scale) -> ()");
  m.def("sample_rows(Tensor logits, Tensor temperatures, Tensor uniforms) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("has_bf16_kernels() -> bool", [] { return kHasBf16Kernels; });
}

TORCH_LIBRARY_IMPL(nanovllm_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("onednn_pack", &onednn_pack);
  m.impl("onednn_release", &onednn_release);
  m.impl("linear_packed", &linear_packed);
  m.impl("store_kv", &store_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("sample_rows", &sample_rows);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
