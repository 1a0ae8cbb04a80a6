// The paged KV cache's two ops:
//  * store_kv: scatters a step's new keys/values into the paged cache by slot (-1 = skip).
//  * paged_attention: causal attention of every query row of a step (decodes and prefill
//    chunks alike) over the paged cache, read in place through the block tables; with a
//    sliding window a row sees only its last `window` positions, and with a softcap its scores
//    become softcap * tanh(score / softcap) (Gemma 2).
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
// Both feed dot products over bf16 pairs (simd.h) with no shuffles and no horizontal sums.
//
// Only slots below a sequence's context length are ever read, and those were written by this
// or an earlier step, so the cache never needs zeroing; lanes past the end are masked before
// any arithmetic touches them (0 * NaN garbage would be NaN).

#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace nanovllm_cpu {
namespace {

// Offsets of (token in block, dim) inside one block of one KV head, in the layouts above.
inline int64_t key_offset(int64_t t, int64_t d, int64_t bs) { return ((d / 2) * bs + t) * 2 + (d & 1); }
inline int64_t value_offset(int64_t t, int64_t d, int64_t D) { return ((t / 2) * D + d) * 2 + (t & 1); }

}  // namespace

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
    parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
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

namespace {

// One unit of work: query rows [row_begin, row_end) of one sequence, one KV head.
struct Item {
  int64_t seq, head, row_begin, row_end;
  double cost;
};

// A (query row, query head) pair; it sees key positions first..last.
template <typename T>
struct Row {
  const T* q;
  T* out;
  int64_t first, last;
};

// How a score is finished before the softmax: scaled, then capped when softcap > 0.
struct Scoring {
  float scale, softcap;
  float cap(float scaled) const { return softcap > 0 ? softcap * std::tanh(scaled / softcap) : scaled; }
  float operator()(float dot) const { return cap(dot * scale); }
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
                         Scoring scoring, std::vector<float>& scratch) {
  const int64_t D = pg.D, bs = pg.bs;
  for (int r = 0; r < n; r++) {
    const int64_t first = rows[r].first, len = rows[r].last + 1 - first;
    scratch.resize(len + D);
    float* s = scratch.data();
    float* acc = s + len;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < len; i++) {
      const T* kb = pg.block(k_cache, first + i);
      float dot = 0;
      for (int64_t d = 0; d < D; d++) dot += float(rows[r].q[d]) * float(kb[key_offset((first + i) % bs, d, bs)]);
      s[i] = scoring(dot);
      max_score = std::max(max_score, s[i]);
    }
    float sum = 0;
    for (int64_t i = 0; i < len; i++) sum += (s[i] = std::exp(s[i] - max_score));
    std::fill(acc, acc + D, 0.0f);
    for (int64_t i = 0; i < len; i++) {
      const T* vb = pg.block(v_cache, first + i);
      for (int64_t d = 0; d < D; d++) acc[d] += s[i] * float(vb[value_offset((first + i) % bs, d, D)]);
    }
    for (int64_t d = 0; d < D; d++) rows[r].out[d] = T(acc[d] / sum);
  }
}

using simd::Vec;

// Rows per call, so that each key and value tile loaded (and on AVX2 widened) serves several;
// a decode's GQA group (its query heads share every key and value) fits in one call. Past the
// registers (NR * (chunks + 1) accumulators; on AVX2 already at one row of head_dim 64) the
// accumulators spill, and the reuse still wins (benchmarks/RESULTS.md).
template <int chunks>
constexpr int kRowsAtOnce = chunks <= 4 ? 4 : 2;

// bf16, D = 16 * chunks, block size a multiple of 16: NR rows at once over 16-key tiles with an
// online softmax, so every key and value load feeds NR dot products. Scores accumulate in fp32;
// probabilities are rounded to bf16 for the value sum, as flash attention does.
template <int chunks, int NR>
void attend_rows_bf16(const Row<BFloat16>* rows, const BFloat16* k_cache, const BFloat16* v_cache, const Paged& pg,
                      Scoring scoring) {
  constexpr int D = 16 * chunks;
  // P partial sums per row where the registers allow (P divides D / 2 = 8 * chunks), as many for
  // every NR: a row's scores then sum in one order whichever rows share its call (batch invariance).
  constexpr int P = kRowsAtOnce<chunks> * (chunks + 4) * simd::kRegistersPerVec <= simd::kRegisters - 4 ? 4 : 2;
  const int64_t bs = pg.bs;
  Vec acc[NR][chunks];
  float running_max[NR], running_sum[NR];
  // The query's pairs made once, not at every tile (on AVX2 each is two widenings).
  simd::Pair query[NR][D / 2];
  int64_t first = rows[0].first, last = 0;
  for (int r = 0; r < NR; r++) {
    for (int dp = 0; dp < D / 2; dp++) query[r][dp] = simd::make_pair(rows[r].q + 2 * dp);
    for (int c = 0; c < chunks; c++) acc[r][c] = simd::zero();
    running_max[r] = -std::numeric_limits<float>::infinity();
    running_sum[r] = 0;
    first = std::min(first, rows[r].first);
    last = std::max(last, rows[r].last);
  }
  const Vec minus_inf = simd::set1(-std::numeric_limits<float>::infinity());
  // From the tile of the first key any row sees. A row's arithmetic starts at its own first tile
  // (the tiles before it are skipped below), so it is the same whichever rows share the call.
  for (int64_t t0 = first / 16 * 16; t0 <= last; t0 += 16) {
    const BFloat16* keys = pg.block(k_cache, t0) + (t0 % bs) * 2;
    const BFloat16* values = pg.block(v_cache, t0) + (t0 % bs) * D;
    // Blocks sit anywhere in memory: fetch the next tile into L2 while on this one, a key line
    // and a value line per key line read (a burst of requests at once would be mostly dropped;
    // into L1, a tile's 2 x D / 2 lines outran its misses in flight: benchmarks/RESULTS.md).
    const int64_t next = std::min(t0 + 16, last);
    const char* next_keys = (const char*)(pg.block(k_cache, next) + (next % bs) * 2);
    const char* next_values = (const char*)(pg.block(v_cache, next) + (next % bs) * D);
    // P partial sums per row: a dot product's latency is several cycles, and one chain per row
    // over D / 2 steps would leave the multiply units idle.
    Vec part[NR][P], s[NR];
    for (int r = 0; r < NR; r++)
      for (int p = 0; p < P; p++) part[r][p] = simd::zero();
    for (int dp0 = 0; dp0 < D / 2; dp0 += P) {
      for (int p = 0; p < P; p++) {
        const int dp = dp0 + p;
        simd::prefetch_to_l2(next_keys + dp * bs * 4);
        simd::prefetch_to_l2(next_values + dp * 64);
        const simd::Pairs k = simd::load_pairs(keys + dp * bs * 2);
        for (int r = 0; r < NR; r++) part[r][p] = simd::dot(part[r][p], k, simd::broadcast(query[r][dp]));
      }
    }
    for (int r = 0; r < NR; r++) {
      s[r] = part[r][0];
      for (int p = 1; p < P; p++) s[r] = simd::add(s[r], part[r][p]);
    }
    alignas(64) BFloat16 probs[NR][16];
    for (int r = 0; r < NR; r++) {
      // Lanes from..visible-1 of the tile are this row's keys.
      const int64_t visible = std::clamp<int64_t>(rows[r].last - t0 + 1, 0, 16);
      const int64_t from = std::clamp<int64_t>(rows[r].first - t0, 0, 16);
      if (from >= visible) {  // this row's keys lie in other tiles
        std::memset(probs[r], 0, sizeof(probs[r]));
        continue;
      }
      Vec scores = simd::mul(s[r], simd::set1(scoring.scale));
      if (scoring.softcap > 0 || from > 0) {  // per lane: the cap, and the keys before the window
        alignas(64) float lanes[16];
        simd::store(lanes, scores);
        for (int64_t j = 0; j < 16; j++)
          lanes[j] = j < from ? -std::numeric_limits<float>::infinity() : scoring.cap(lanes[j]);
        scores = simd::load(lanes);
      }
      scores = simd::keep_first(scores, visible, minus_inf);
      const float tile_max = simd::reduce_max(scores);
      if (tile_max > running_max[r]) {  // rescale what came before; past the first tiles, rarely
        const float correction = std::exp(running_max[r] - tile_max);
        running_sum[r] *= correction;
        for (int c = 0; c < chunks; c++) acc[r][c] = simd::mul(acc[r][c], simd::set1(correction));
        running_max[r] = tile_max;
      }
      const Vec p = simd::keep_first(simd::exp(simd::sub(scores, simd::set1(running_max[r]))), visible, simd::zero());
      running_sum[r] += simd::reduce_add(p);
      simd::store_bf16(probs[r], p);
    }
    // Token pairs up to the last visible key of any row; a pair whose second token lies past
    // it has that token's values zeroed, since the slot may never have been written.
    const int64_t visible = std::min<int64_t>(last - t0 + 1, 16);
    for (int64_t tp = 0; 2 * tp < visible; tp++) {
      const bool half = 2 * tp + 1 >= visible;
      simd::Broadcast prob_pairs[NR];
      for (int r = 0; r < NR; r++) prob_pairs[r] = simd::broadcast(simd::make_pair(probs[r] + 2 * tp));
      for (int c = 0; c < chunks; c++) {
        const BFloat16* v = values + tp * D * 2 + c * 32;
        const simd::Pairs pairs = half ? simd::load_pairs_first_only(v) : simd::load_pairs(v);
        for (int r = 0; r < NR; r++) acc[r][c] = simd::dot(acc[r][c], pairs, prob_pairs[r]);
      }
    }
  }
  for (int r = 0; r < NR; r++) {
    const Vec inv = simd::set1(1.0f / running_sum[r]);
    for (int c = 0; c < chunks; c++) simd::store_bf16(rows[r].out + 16 * c, simd::mul(acc[r][c], inv));
  }
}

template <int chunks, int... NRs>
void attend_rows_bf16_groups(const Row<BFloat16>* rows, int n, const BFloat16* k_cache, const BFloat16* v_cache,
                             const Paged& pg, Scoring scoring, std::integer_sequence<int, NRs...>) {
  using Fn = void (*)(const Row<BFloat16>*, const BFloat16*, const BFloat16*, const Paged&, Scoring);
  constexpr Fn by_count[] = {&attend_rows_bf16<chunks, NRs + 1>...};
  constexpr int R = sizeof...(NRs);
  for (int i = 0; i < n; i += R) by_count[std::min(R, n - i) - 1](rows + i, k_cache, v_cache, pg, scoring);
}

template <int chunks>
void attend_rows_bf16_any(const Row<BFloat16>* rows, int n, const BFloat16* k_cache, const BFloat16* v_cache,
                          const Paged& pg, Scoring scoring) {
  attend_rows_bf16_groups<chunks>(rows, n, k_cache, v_cache, pg, scoring,
                                  std::make_integer_sequence<int, kRowsAtOnce<chunks>>{});
}

using AttendRowsFn = void (*)(const Row<BFloat16>*, int, const BFloat16*, const BFloat16*, const Paged&, Scoring);
// head_dim 16, 32, ..., 256 (index head_dim / 16 - 1; Gemma's heads are 256 wide); other sizes
// go the portable way.
constexpr int kMaxChunks = 16;
constexpr AttendRowsFn kAttendRows[kMaxChunks] = {
    &attend_rows_bf16_any<1>, &attend_rows_bf16_any<2>, &attend_rows_bf16_any<3>, &attend_rows_bf16_any<4>,
    &attend_rows_bf16_any<5>, &attend_rows_bf16_any<6>, &attend_rows_bf16_any<7>, &attend_rows_bf16_any<8>,
    &attend_rows_bf16_any<9>, &attend_rows_bf16_any<10>, &attend_rows_bf16_any<11>, &attend_rows_bf16_any<12>,
    &attend_rows_bf16_any<13>, &attend_rows_bf16_any<14>, &attend_rows_bf16_any<15>, &attend_rows_bf16_any<16>};

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, const at::Tensor& block_tables,
                     double scale, int64_t window, double softcap) {
  // q, out: [T, H, D] (each head's D contiguous); caches [KVH, blocks, bs * D]; sequence i owns
  // query rows cu_seqlens_q[i]:cu_seqlens_q[i+1], the last of which sits at position
  // context_lens[i] - 1; block_tables [B, max_blocks] int32. window > 0: a row at position p sees
  // keys p - window + 1 .. p; softcap > 0: capped scores.
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
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

  // Work items of up to 16 query rows, heaviest first (causal rows late in a long prompt cost far
  // more than early ones or than a short decode), shared out by the pool (thread_pool.h): a thread
  // that another process holds up leaves its untaken items to the others.
  constexpr int64_t kRowsPerItem = 16;
  std::vector<Item> items;
  for (int64_t b = 0; b < B; b++) {
    const int64_t q_len = cu[b + 1] - cu[b], ctx = lens[b];
    TORCH_CHECK(q_len >= 0 && ctx >= q_len && ctx <= max_blocks * bs, "sequence ", b, ": bad lengths");
    for (int64_t r0 = 0; r0 < q_len; r0 += kRowsPerItem) {
      const int64_t r1 = std::min(q_len, r0 + kRowsPerItem);
      const int64_t span = ctx - q_len + (r0 + r1) / 2;  // keys a middle row sees without a window
      const double cost = double(r1 - r0) * double((window > 0 ? std::min(span, window) : span) + 16);
      for (int64_t h = 0; h < KVH; h++) items.push_back({b, h, cu[b] + r0, cu[b] + r1, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const Scoring scoring{float(scale), float(softcap)};
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* kc = k_cache.data_ptr<T>();
    const T* vc = v_cache.data_ptr<T>();
    parallel_for(0, int64_t(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<Row<T>> rows;
      std::vector<float> scratch;
      for (int64_t i = begin; i < end; i++) {
        const Item& it = items[i];
        const int64_t first_pos = lens[it.seq] - (cu[it.seq + 1] - cu[it.seq]);
        rows.clear();
        for (int64_t row = it.row_begin; row < it.row_end; row++)
          for (int64_t g = 0; g < G; g++) {
            const int64_t head = it.head * G + g, pos = first_pos + row - cu[it.seq];
            rows.push_back({q.data_ptr<T>() + row * q.stride(0) + head * q.stride(1),
                            out.data_ptr<T>() + row * out.stride(0) + head * out.stride(1),
                            window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0, pos});
          }
        const Paged pg{tables + it.seq * max_blocks, bs, D, num_blocks, it.head};
        if constexpr (std::is_same_v<T, BFloat16>) {
          if (D % 16 == 0 && D <= 16 * kMaxChunks && bs % 16 == 0) {
            kAttendRows[D / 16 - 1](rows.data(), int(rows.size()), kc, vc, pg, scoring);
            continue;
          }
        }
        attend_rows_generic<T>(rows.data(), int(rows.size()), kc, vc, pg, scoring, scratch);
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

}  // namespace nanovllm_cpu
