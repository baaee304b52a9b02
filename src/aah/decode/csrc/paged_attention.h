#pragma once
// Per-head-window attention with sink tokens over a paged KV cache (CPU), for aah.vllm.
//
// Paper section 5.8 (windowed execution at inference) with the sink tokens of the pretrained
// bridge: query token t (request r, position p) of query head h reads, from the pages its
// request's row of the block table lists, the keys j <= p with p - j < W_h or j < S, that is
// the window [lo, p] (lo = max(0, p - W_h + 1)) and the sinks [0, min(S, lo)) that fell out
// of it. The G query heads of a KV head read its keys together (each key loaded once for all).
//
// Work is cut into items of one (token, KV head, span of the window keys); the first span of a
// token also reads its sinks. With many tokens (a prefill chunk) a token is one span and its
// rows are written directly; with few (decode steps) the windows are cut into spans of
// kPagedSpan keys spread over the threads, each keeping per row its maximum score, sum of
// exponentials and weighted sum of values, joined exactly by a second pass.
//
// Page layout (vLLM's CPU cache): key_cache and value_cache (blocks, KV heads, block_size, D)
// with any strides on the first two axes; a value page is (block_size, D) row-major; a key
// page is the same, or, with keys_transposed, K^T (D, block_size).

#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

namespace aah {

constexpr int64_t kPagedSpan = 512;  // window keys per item when the windows are split
constexpr int64_t kPagedChunk = 64;  // keys scored at once (one softmax rescale per chunk)

// Rows of a (tokens, heads, D) tensor whose last axis is contiguous (a view of a wider one, say).
template <typename T>
struct HeadRows {
  T* data;
  int64_t token_stride, head_stride;
  T* at(int64_t t, int64_t h) const { return data + t * token_stride + h * head_stride; }
};

struct PagedItem {
  int64_t token, kv_head;
  int64_t first, last;  // window keys [first, last) of this span (the union over the group's heads)
  bool sinks;           // this span also reads the sinks
};

// The running softmax of one row (query token x query head) over the keys seen so far.
template <typename acc_t>
struct RowState {
  acc_t top;
  acc_t total;
  bool started;
  acc_t* acc;  // D weighted values

  // Before folding in keys whose largest score is `chunk_top`: start the row there, or raise
  // its maximum to it, shrinking what is summed so far.
  void raise_to(acc_t chunk_top, int64_t dim) {
    if (!started) {
      started = true;
      top = chunk_top;
      total = 0;
      std::fill(acc, acc + dim, acc_t(0));
    } else if (chunk_top > top) {
      const acc_t shrink = std::exp(top - chunk_top);
      total *= shrink;
      for (int64_t d = 0; d < dim; ++d) acc[d] *= shrink;
      top = chunk_top;
    }
  }
};

template <typename scalar_t, int64_t kDim, bool kTransposed>
struct PagedReader {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* key_cache;
  const scalar_t* value_cache;
  int64_t key_block_stride, key_head_stride, value_block_stride, value_head_stride;
  int64_t block_size, dim;

  // Scores of the keys at slots [slot, slot + n) of one page (n <= kPagedChunk) for a scaled query.
  void scores(const acc_t* qs, const scalar_t* page, int64_t slot, int64_t n, acc_t* out) const {
    const int64_t d_end = kDim > 0 ? kDim : dim;
    if constexpr (kTransposed) {
      std::fill(out, out + n, acc_t(0));
      for (int64_t d = 0; d < d_end; ++d) {
        const acc_t qd = qs[d];
        const scalar_t* row = page + d * block_size + slot;
        for (int64_t k = 0; k < n; ++k) out[k] += qd * static_cast<acc_t>(row[k]);
      }
    } else {
      for (int64_t k = 0; k < n; ++k) {
        const scalar_t* kp = page + (slot + k) * d_end;
        acc_t dot = 0;
        for (int64_t d = 0; d < d_end; ++d) dot += qs[d] * static_cast<acc_t>(kp[d]);
        out[k] = dot;
      }
    }
  }

  // Folds n scores (overwritten by their weights) and the values at slots [slot, slot + n)
  // of a value page into a row's running softmax.
  void fold(acc_t* score, const scalar_t* values, int64_t slot, int64_t n, RowState<acc_t>& row) const {
    const int64_t d_end = kDim > 0 ? kDim : dim;
    acc_t top = score[0];
    for (int64_t k = 1; k < n; ++k) top = std::max(top, score[k]);
    row.raise_to(top, d_end);
    acc_t total = 0;
    for (int64_t k = 0; k < n; ++k) {
      score[k] = std::exp(score[k] - row.top);
      total += score[k];
    }
    row.total += total;
    auto weigh = [&](acc_t* sum) {
      for (int64_t k = 0; k < n; ++k) {
        const acc_t p = score[k];
        const scalar_t* vp = values + (slot + k) * d_end;
        for (int64_t d = 0; d < d_end; ++d) sum[d] += p * static_cast<acc_t>(vp[d]);
      }
    };
    if constexpr (kDim > 0) {  // a local array the compiler keeps in registers
      acc_t sum[kDim];
      std::copy(row.acc, row.acc + kDim, sum);
      weigh(sum);
      std::copy(sum, sum + kDim, row.acc);
    } else {
      weigh(row.acc);
    }
  }

  // Every row of a group over the keys [first, last) of request `pages` (its block table row),
  // row g reading only [max(first, lo[g]), min(last, hi[g])).
  void attend(const int32_t* pages, int64_t kv_head, int64_t first, int64_t last, const int64_t* lo,
              const int64_t* hi, int64_t rows, const acc_t* qs, RowState<acc_t>* state) const {
    acc_t score[kPagedChunk];
    const int64_t d_end = kDim > 0 ? kDim : dim;
    int64_t from = first;
    for (int64_t g = 0; g < rows; ++g) from = std::min(from, std::max(first, lo[g]));
    while (from < last) {
      const int64_t page = pages[from / block_size];
      const int64_t slot = from % block_size;
      const int64_t to = std::min({last, from + kPagedChunk, from - slot + block_size});
      const scalar_t* kp = key_cache + page * key_block_stride + kv_head * key_head_stride;
      const scalar_t* vp = value_cache + page * value_block_stride + kv_head * value_head_stride;
      for (int64_t g = 0; g < rows; ++g) {
        const int64_t a = std::max(from, lo[g]), b = std::min(to, hi[g]);
        if (a >= b) continue;
        scores(qs + g * d_end, kp, a % block_size, b - a, score);
        fold(score, vp, a % block_size, b - a, state[g]);
      }
      from = to;
    }
  }
};

// The fast path of a prefill chunk: float32, K^T pages, pages of a multiple of 32 slots, head
// size a multiple of 64. A tile is a few consecutive tokens of one request and one KV head;
// its rows (token x query head) go through the keys in aligned chunks of 32, six rows at a
// time: the scores of six rows by 32 keys and their weighted values are kept in vector
// registers (GCC vector types: AVX-512 where the CPU has it, else pairs of AVX2 registers).
typedef float Lanes __attribute__((vector_size(64), aligned(4)));  // 16 floats
constexpr int64_t kTileKeys = 32;
constexpr int64_t kTileRows = 6;
constexpr float kMasked = -1e30f;  // the score of a key a row does not see (finite: -ffast-math)

typedef int32_t IntLanes __attribute__((vector_size(64), aligned(4)));

inline Lanes load_lanes(const float* p) { Lanes v; __builtin_memcpy(&v, p, sizeof(v)); return v; }
inline void store_lanes(float* p, Lanes v) { __builtin_memcpy(p, &v, sizeof(v)); }

// exp(x) for x <= 0 (scores minus their row's maximum), 0 below -87: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its Taylor polynomial of degree 6 (relative error below 2e-7),
// times 2^n built in the exponent bits.
inline Lanes exp_lanes(Lanes x) {
  const Lanes zero = {};
  const IntLanes n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, IntLanes);  // round(x / ln2)
  const Lanes nf = __builtin_convertvector(n, Lanes);
  const Lanes r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187045e-06f;
  Lanes p = r * (1.0f / 720) + (1.0f / 120);
  p = p * r + (1.0f / 24);
  p = p * r + (1.0f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const IntLanes bits = (n + 127) << 23;
  Lanes two_n;
  __builtin_memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.0f ? zero : p * two_n;
}

template <int64_t kDim>
struct TileRows {
  // score[r][k] = qs[r] . key (c0 + k) for six rows and a chunk of 32 keys of a K^T page
  // (kt: the page's row d at kt + d * block_size, from the chunk's first slot).
  static void scores(const float* qs, const float* kt, int64_t block_size, float (*score)[kTileKeys]) {
    Lanes acc[kTileRows][2] = {};
    for (int64_t d = 0; d < kDim; ++d) {
      const Lanes k0 = load_lanes(kt + d * block_size), k1 = load_lanes(kt + d * block_size + 16);
#pragma GCC unroll 6
      for (int64_t r = 0; r < kTileRows; ++r) {
        const float q = qs[r * kDim + d];
        acc[r][0] += q * k0;
        acc[r][1] += q * k1;
      }
    }
    for (int64_t r = 0; r < kTileRows; ++r) {
      store_lanes(score[r], acc[r][0]);
      store_lanes(score[r] + 16, acc[r][1]);
    }
  }

  // acc[r] += sum_k weight[r][k] * value (c0 + k), keys k in [a, b) of the chunk
  // (vp: the value page from the chunk's first slot); 64 dims at a time.
  static void weigh(const float (*weight)[kTileKeys], const float* vp, int64_t a, int64_t b, float* acc) {
    for (int64_t d0 = 0; d0 < kDim; d0 += 64) {
      Lanes sum[kTileRows][4];
      for (int64_t r = 0; r < kTileRows; ++r)
        for (int64_t j = 0; j < 4; ++j) sum[r][j] = load_lanes(acc + r * kDim + d0 + 16 * j);
      for (int64_t k = a; k < b; ++k) {
        const float* v = vp + k * kDim + d0;
        const Lanes v0 = load_lanes(v), v1 = load_lanes(v + 16), v2 = load_lanes(v + 32), v3 = load_lanes(v + 48);
#pragma GCC unroll 6
        for (int64_t r = 0; r < kTileRows; ++r) {
          const float w = weight[r][k];
          sum[r][0] += w * v0;
          sum[r][1] += w * v1;
          sum[r][2] += w * v2;
          sum[r][3] += w * v3;
        }
      }
      for (int64_t r = 0; r < kTileRows; ++r)
        for (int64_t j = 0; j < 4; ++j) store_lanes(acc + r * kDim + d0 + 16 * j, sum[r][j]);
    }
  }
};

// The rows of one tile: scaled queries, visible intervals and running softmax, padded to a
// multiple of six rows (padding rows see nothing). One per thread, refilled for each tile.
struct TileState {
  std::vector<float> qs, acc;
  std::vector<RowState<float>> rows;
  std::vector<int64_t> lo, hi;  // row r sees [lo, hi) in the current pass
  std::vector<int64_t> window_lo, sink_end;  // row r's window starts at window_lo, its sinks end at sink_end

  void reset(int64_t rows_padded, int64_t dim) {
    qs.assign(rows_padded * dim, 0.0f);
    acc.assign(rows_padded * dim, 0.0f);
    rows.assign(rows_padded, RowState<float>{0.0f, 0.0f, false, nullptr});
    for (int64_t r = 0; r < rows_padded; ++r) rows[r].acc = acc.data() + r * dim;
    for (auto* v : {&lo, &hi, &window_lo, &sink_end}) v->assign(rows_padded, 0);
  }
};

template <int64_t kDim>
void tile_pass(const float* kt_head, const float* v_head, int64_t key_block_stride, int64_t value_block_stride,
               const int32_t* pages, int64_t block_size, int64_t first, int64_t last, int64_t rows, TileState& st) {
  float score[kTileRows][kTileKeys];
  for (int64_t c0 = first - first % kTileKeys; c0 < last; c0 += kTileKeys) {
    const int64_t page = pages[c0 / block_size], slot = c0 % block_size;
    const float* kt = kt_head + page * key_block_stride + slot;
    const float* vp = v_head + page * value_block_stride + slot * kDim;
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      int64_t a = kTileKeys, b = 0;  // the keys of the chunk some row of these six sees
      for (int64_t r = r0; r < r0 + kTileRows; ++r) {
        const int64_t ra = std::max(st.lo[r], c0) - c0, rb = std::min(st.hi[r], c0 + kTileKeys) - c0;
        if (ra < rb) { a = std::min(a, ra); b = std::max(b, rb); }
      }
      if (a >= b) continue;
      TileRows<kDim>::scores(st.qs.data() + r0 * kDim, kt, block_size, score);
      for (int64_t i = 0; i < kTileRows; ++i) {
        const int64_t r = r0 + i;
        const int64_t ra = std::max(st.lo[r], c0) - c0, rb = std::min(st.hi[r], c0 + kTileKeys) - c0;
        float* sc = score[i];
        if (ra >= rb) {
          std::fill(sc, sc + kTileKeys, 0.0f);
          continue;
        }
        if (ra > 0 || rb < kTileKeys) {
          for (int64_t k = 0; k < kTileKeys; ++k) sc[k] = (k >= ra && k < rb) ? sc[k] : kMasked;
        }
        float top = sc[ra];
        for (int64_t k = 0; k < kTileKeys; ++k) top = std::max(top, sc[k]);
        RowState<float>& row = st.rows[r];
        row.raise_to(top, kDim);
        Lanes total = {};
        for (int64_t k = 0; k < kTileKeys; k += 16) {
          const Lanes w = exp_lanes(load_lanes(sc + k) - row.top);
          store_lanes(sc + k, w);
          total += w;
        }
        float sum = 0;
        for (int64_t j = 0; j < 16; ++j) sum += total[j];
        row.total += sum;
      }
      TileRows<kDim>::weigh(score, vp, a, b, st.acc.data() + r0 * kDim);
    }
  }
}

// Tiles of up to `tile_tokens` consecutive tokens of one request (positions increasing by one).
template <int64_t kDim>
void paged_tiles(HeadRows<const float> q_rows, const float* key_cache, const float* value_cache, int64_t key_block_stride,
                 int64_t key_head_stride, int64_t value_block_stride, int64_t value_head_stride, int64_t block_size,
                 const int64_t* req, const int64_t* pos, int64_t tokens, int64_t heads, int64_t kv_heads,
                 const int32_t* table, int64_t table_width, const int64_t* win, int64_t sinks, float scale,
                 HeadRows<float> o_rows) {
  const int64_t group = heads / kv_heads;
  const int64_t tile_tokens = std::max<int64_t>(1, 24 / group);
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first token, last token) of each tile
  for (int64_t t = 0; t < tokens;) {
    int64_t u = t + 1;
    while (u < tokens && u - t < tile_tokens && req[u] == req[t] && pos[u] == pos[u - 1] + 1) ++u;
    runs.emplace_back(t, u);
    t = u;
  }
  const int64_t num_items = static_cast<int64_t>(runs.size()) * kv_heads;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    TileState st;
    for (int64_t i = begin; i < end; ++i) {
      const auto [t0, t1] = runs[i / kv_heads];
      const int64_t kv = i % kv_heads, n = (t1 - t0) * group;
      const int64_t rows = (n + kTileRows - 1) / kTileRows * kTileRows;
      st.reset(rows, kDim);
      std::vector<int64_t>& window_lo = st.window_lo;
      std::vector<int64_t>& sink_end = st.sink_end;
      int64_t first = pos[t1 - 1] + 1, last = 0, sinks_last = 0;
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = t0 + r / group, h = kv * group + r % group;
        const float* qp = q_rows.at(t, h);
        for (int64_t d = 0; d < kDim; ++d) st.qs[r * kDim + d] = qp[d] * scale;
        window_lo[r] = std::max<int64_t>(0, pos[t] - win[h] + 1);
        sink_end[r] = std::min(sinks, window_lo[r]);
        first = std::min(first, window_lo[r]);
        last = std::max(last, pos[t] + 1);
        sinks_last = std::max(sinks_last, sink_end[r]);
      }
      const int32_t* pages = table + req[t0] * table_width;
      const float* kt_head = key_cache + kv * key_head_stride;
      const float* v_head = value_cache + kv * value_head_stride;
      if (sinks_last > 0) {  // row r's sinks [0, sink_end[r]), disjoint from its window
        for (int64_t r = 0; r < n; ++r) st.hi[r] = sink_end[r];
        tile_pass<kDim>(kt_head, v_head, key_block_stride, value_block_stride, pages, block_size, 0, sinks_last,
                        rows, st);
      }
      for (int64_t r = 0; r < n; ++r) {
        st.lo[r] = window_lo[r];
        st.hi[r] = pos[t0 + r / group] + 1;
      }
      tile_pass<kDim>(kt_head, v_head, key_block_stride, value_block_stride, pages, block_size, first, last, rows, st);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = t0 + r / group, h = kv * group + r % group;
        float* op = o_rows.at(t, h);
        const float inv = 1.0f / st.rows[r].total;
        for (int64_t d = 0; d < kDim; ++d) op[d] = st.acc[r * kDim + d] * inv;
      }
    }
  });
}

// out (N, H, D) = attention of query (N, H, D); token_request, token_position (N,) int64;
// block_table (R, M) int32; windows (H,) int64.
template <typename scalar_t, int64_t kDim, bool kTransposed>
void paged_attention_impl(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const at::Tensor& token_request, const at::Tensor& token_position,
                          const at::Tensor& block_table, const at::Tensor& windows, int64_t sinks, double scale,
                          at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t tokens = query.size(0), heads = query.size(1);
  const int64_t dim = kDim > 0 ? kDim : query.size(2);
  const int64_t kv_heads = key_cache.size(1), group = heads / kv_heads;
  const PagedReader<scalar_t, kDim, kTransposed> reader{
      key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(), key_cache.stride(0), key_cache.stride(1),
      value_cache.stride(0), value_cache.stride(1), key_cache.size(2), dim};
  const int64_t* req = token_request.data_ptr<int64_t>();
  const int64_t* pos = token_position.data_ptr<int64_t>();
  const int64_t* win = windows.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_width = block_table.size(1);
  const HeadRows<const scalar_t> q_rows{query.data_ptr<scalar_t>(), query.stride(0), query.stride(1)};
  const HeadRows<scalar_t> o_rows{out.data_ptr<scalar_t>(), out.stride(0), out.stride(1)};

  // The window's first key of each row.
  auto window_start = [&](int64_t t, int64_t h) { return std::max<int64_t>(0, pos[t] - win[h] + 1); };
  // Split the windows only when there are too few (token, KV head) pairs to keep the threads busy.
  const bool split = tokens * kv_heads < 8 * at::get_num_threads();
  if constexpr (std::is_same_v<scalar_t, float> && kTransposed && kDim > 0 && kDim % 64 == 0) {
    if (!split && reader.block_size % kTileKeys == 0) {
      paged_tiles<kDim>(q_rows, reader.key_cache, reader.value_cache, reader.key_block_stride, reader.key_head_stride,
                        reader.value_block_stride, reader.value_head_stride, reader.block_size, req, pos, tokens,
                        heads, kv_heads, table, table_width, win, sinks, static_cast<float>(scale), o_rows);
      return;
    }
  }
  std::vector<PagedItem> items;
  std::vector<int64_t> first_item(tokens * kv_heads + 1);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      first_item[t * kv_heads + kv] = static_cast<int64_t>(items.size());
      int64_t lo = pos[t] + 1;
      for (int64_t g = 0; g < group; ++g) lo = std::min(lo, window_start(t, kv * group + g));
      const int64_t hi = pos[t] + 1, span = split ? kPagedSpan : hi - lo;
      for (int64_t a = lo; a < hi; a += span) items.push_back({t, kv, a, std::min(hi, a + span), a == lo});
    }
  }
  first_item[tokens * kv_heads] = static_cast<int64_t>(items.size());
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::vector<acc_t> part_top, part_total, part_acc;
  if (split) {
    part_top.resize(num_items * group);
    part_total.resize(num_items * group);
    part_acc.resize(num_items * group * dim);
  }
  const acc_t s = static_cast<acc_t>(scale);

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> qs(group * dim), acc(group * dim);
    std::vector<RowState<acc_t>> state(group);
    std::vector<int64_t> lo_v(group), hi_v(group), sink_end_v(group), none_v(group, 0);
    int64_t *lo = lo_v.data(), *hi = hi_v.data(), *sink_end = sink_end_v.data(), *none = none_v.data();
    for (int64_t i = begin; i < end; ++i) {
      const PagedItem& item = items[i];
      const int64_t t = item.token, h0 = item.kv_head * group;
      const int32_t* pages = table + req[t] * table_width;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qp = q_rows.at(t, h0 + g);
        for (int64_t d = 0; d < dim; ++d) qs[g * dim + d] = static_cast<acc_t>(qp[d]) * s;
        lo[g] = window_start(t, h0 + g);
        hi[g] = pos[t] + 1;
        sink_end[g] = std::min(sinks, lo[g]);
        state[g] = {acc_t(0), acc_t(0), false, acc.data() + g * dim};
      }
      if (item.sinks) {  // row g's sinks are [0, sink_end[g]), disjoint from its window
        const int64_t end_of_sinks = *std::max_element(sink_end, sink_end + group);
        reader.attend(pages, item.kv_head, 0, end_of_sinks, none, sink_end, group, qs.data(), state.data());
      }
      reader.attend(pages, item.kv_head, item.first, item.last, lo, hi, group, qs.data(), state.data());
      for (int64_t g = 0; g < group; ++g) {
        if (split) {
          acc_t* part = part_acc.data() + (i * group + g) * dim;
          part_top[i * group + g] = state[g].started ? state[g].top : acc_t(0);
          part_total[i * group + g] = state[g].started ? state[g].total : acc_t(0);  // 0: no key of this row
          if (state[g].started) std::copy(state[g].acc, state[g].acc + dim, part);
          else std::fill(part, part + dim, acc_t(0));
        } else {
          scalar_t* op = o_rows.at(t, h0 + g);
          for (int64_t d = 0; d < dim; ++d) op[d] = static_cast<scalar_t>(state[g].acc[d] / state[g].total);
        }
      }
    }
  });
  if (!split) return;
  at::parallel_for(0, tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> joined(dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t lo = first_item[pair], hi = first_item[pair + 1];
      const int64_t t = pair / kv_heads, h0 = (pair % kv_heads) * group;
      for (int64_t g = 0; g < group; ++g) {
        acc_t top = 0;
        bool any = false;
        for (int64_t i = lo; i < hi; ++i) {
          if (part_total[i * group + g] > 0) {
            top = any ? std::max(top, part_top[i * group + g]) : part_top[i * group + g];
            any = true;
          }
        }
        std::fill(joined.begin(), joined.end(), acc_t(0));
        acc_t total = 0;
        for (int64_t i = lo; i < hi; ++i) {
          if (part_total[i * group + g] <= 0) continue;
          const acc_t w = std::exp(part_top[i * group + g] - top);
          total += w * part_total[i * group + g];
          const acc_t* a = part_acc.data() + (i * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) joined[d] += w * a[d];
        }
        scalar_t* op = o_rows.at(t, h0 + g);
        for (int64_t d = 0; d < dim; ++d) op[d] = static_cast<scalar_t>(joined[d] / total);
      }
    }
  });
}

template <typename scalar_t>
void paged_attention_dispatch(bool transposed, const at::Tensor& query, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& token_request,
                              const at::Tensor& token_position, const at::Tensor& block_table,
                              const at::Tensor& windows, int64_t sinks, double scale, at::Tensor& out) {
#define AAH_PAGED(DIM, T)                                                                                     \
  paged_attention_impl<scalar_t, DIM, T>(query, key_cache, value_cache, token_request, token_position, \
                                          block_table, windows, sinks, scale, out)
  const int64_t dim = query.size(2);
  if (transposed) {
    if (dim == 64) AAH_PAGED(64, true); else if (dim == 128) AAH_PAGED(128, true); else AAH_PAGED(0, true);
  } else {
    if (dim == 64) AAH_PAGED(64, false); else if (dim == 128) AAH_PAGED(128, false); else AAH_PAGED(0, false);
  }
#undef AAH_PAGED
}

}  // namespace aah
