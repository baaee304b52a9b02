#pragma once
// One decode step of per-head-window attention over ring buffers, in one call (CPU).
//
// Paper section 5.8 (windowed execution) at inference: query head h reads the
// last n_h = min(W_h, length, C) entries of the ring of its KV head, a ring of
// capacity C in which absolute position p sits in slot p % C. Softmax does not
// care about key order, so the readable entries are visited in slot order.
//
// The work is cut into spans of at most kSpan entries of one (batch row, head),
// spread over the threads; each span keeps its maximum score, the sum of its
// exponentials and its weighted sum of values, and a second pass joins the spans
// of a head by those sums (split-key attention, exact). With ``lse`` given, the step also
// writes each (batch row, head)'s log-sum-exp of scaled scores there, so that a caller can
// join more keys to the same softmax.
//
// Sink tokens (the first S positions, which pretrained models keep attending): the S slots
// just before a KV head's ring hold positions 0..S-1; a query head reads those of them that
// lie before its window (j < length - n_h) as one more span.
//
// Kept keys (far keys a prefill chose to keep, aah.hf.bridge.kept_keys): beside the rings, KV
// head g may hold entries in slots [kept_start[g], kept_start[g] + kept_count[g]) of a second
// pair of buffers, each flagged valid or not per batch row. Every query head reading g reads
// its valid entries in the same softmax; the invalid ones weigh nothing. They are cut into spans
// of at most kSpan entries of one (batch row, KV head), each span scored for all the query
// heads of its KV head at once (a key and a value loaded once for all of them), and joined
// with the ring spans of each head. Kept keys never overlap a window or the sinks, so no key
// is counted twice.

#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace aah {


constexpr int64_t kSpan = 256;

struct Span {
  int64_t row;    // b * H + h
  int64_t first;  // first age of the span (age 0 is the newest entry); -1: the sink slots
  int64_t count;  // entries in the span
};

// A span of kept keys: entries first .. first + count - 1 of KV head kv's kept slots in batch
// row b, read by every query head of that KV head at once (each key and value is loaded once
// for all of them).
struct KeptSpan {
  int64_t b;
  int64_t kv;
  int64_t first;
  int64_t count;
};

// The kept keys of every KV head, as decode reads them (keys == nullptr: none). keys, values
// (B, slots, D); valid (B, slots) one byte each (0: empty); KV head g's entries in slots
// [start[g], start[g] + count[g]).
struct KeptView {
  const void* keys = nullptr;
  const void* values = nullptr;
  const uint8_t* valid = nullptr;
  const int64_t* start = nullptr;
  const int64_t* count = nullptr;
  int64_t slots = 0;
};

// Scores of the valid kept entries of one KeptSpan for the `group` query heads of its KV head
// (their scaled queries qf, group x dim), kept per head r as the ring spans keep theirs: the
// maximum top[r], the sum of exp(score - top[r]) in total[r], the weighted sum of the values
// in acc[r * dim ..]. No valid entry: total 0 (a span the join skips), top 0, acc 0.
template <typename scalar_t, typename acc_t, int64_t kDim>
void attend_kept(const KeptView& kept, const KeptSpan& sp, const acc_t* qf, int64_t group, int64_t dim,
                 int64_t* taken, acc_t* score, acc_t* top, acc_t* total, acc_t* acc) {
  const int64_t width = kDim > 0 ? kDim : dim;  // a constant where the head dim is known
  const int64_t first = sp.b * kept.slots + kept.start[sp.kv] + sp.first;
  const uint8_t* ok = kept.valid + first;
  int64_t count = 0;
  for (int64_t j = 0; j < sp.count; ++j) {
    if (ok[j] != 0) taken[count++] = first + j;
  }
  std::fill(acc, acc + group * width, acc_t(0));
  if (count == 0) {
    std::fill(top, top + group, acc_t(0));
    std::fill(total, total + group, acc_t(0));
    return;
  }
  const scalar_t* k_data = static_cast<const scalar_t*>(kept.keys);
  const scalar_t* v_data = static_cast<const scalar_t*>(kept.values);
  for (int64_t j = 0; j < count; ++j) {
    const scalar_t* kp = k_data + taken[j] * width;
    for (int64_t r = 0; r < group; ++r) {
      const acc_t* qr = qf + r * width;
      acc_t dot = 0;
      for (int64_t d = 0; d < width; ++d) dot += qr[d] * static_cast<acc_t>(kp[d]);
      score[r * kSpan + j] = dot;
    }
  }
  // No infinities: each maximum starts at a real score (the ring spans' rule).
  for (int64_t r = 0; r < group; ++r) {
    acc_t* sr = score + r * kSpan;
    acc_t m = sr[0];
    for (int64_t j = 1; j < count; ++j) m = std::max(m, sr[j]);
    acc_t sum = 0;
    for (int64_t j = 0; j < count; ++j) {
      sr[j] = std::exp(sr[j] - m);
      sum += sr[j];
    }
    top[r] = m;
    total[r] = sum;
  }
  for (int64_t j = 0; j < count; ++j) {
    const scalar_t* vp = v_data + taken[j] * width;
    for (int64_t r = 0; r < group; ++r) {
      const acc_t p = score[r * kSpan + j];
      acc_t* ar = acc + r * width;
      for (int64_t d = 0; d < width; ++d) ar[d] += p * static_cast<acc_t>(vp[d]);
    }
  }
}

// kDim > 0: the head dim known at compile time (loops unrolled, the running sums kept in
// registers); kDim = 0: any head dim. kept: the kept keys (KeptView::keys == nullptr: none).
template <typename scalar_t, int64_t kDim>
void decode(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
            const at::Tensor& ring_start, const at::Tensor& capacity, const at::Tensor& windows,
            int64_t length, int64_t sinks, double scale, at::Tensor& out, float* lse, const KeptView& kept) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = q.size(0), heads = q.size(1);
  const int64_t dim = kDim > 0 ? kDim : q.size(2);
  const int64_t slots = keys.size(1);
  const int64_t kv_heads = ring_start.size(0);
  const int64_t group = heads / kv_heads;
  const int64_t* start = ring_start.data_ptr<int64_t>();
  const int64_t* cap = capacity.data_ptr<int64_t>();
  const int64_t* win = windows.data_ptr<int64_t>();

  std::vector<Span> spans;
  std::vector<int64_t> first_span(batch * heads + 1);
  for (int64_t row = 0; row < batch * heads; ++row) {
    first_span[row] = static_cast<int64_t>(spans.size());
    const int64_t h = row % heads;
    const int64_t n = std::min({win[h], length, cap[h / group]});
    for (int64_t a = 0; a < n; a += kSpan) {
      spans.push_back({row, a, std::min(kSpan, n - a)});
    }
    const int64_t outside = std::min(sinks, length - n);  // sinks before the window
    if (outside > 0) spans.push_back({row, -1, outside});
  }
  first_span[batch * heads] = static_cast<int64_t>(spans.size());
  // The kept spans of (b, kv) are kept_spans[first_kept[b * H_kv + kv] .. first_kept[.. + 1]).
  std::vector<KeptSpan> kept_spans;
  std::vector<int64_t> first_kept;
  if (kept.keys != nullptr) {
    first_kept.resize(batch * kv_heads + 1);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        first_kept[b * kv_heads + kv] = static_cast<int64_t>(kept_spans.size());
        for (int64_t a = 0; a < kept.count[kv]; a += kSpan) {
          kept_spans.push_back({b, kv, a, std::min(kSpan, kept.count[kv] - a)});
        }
      }
    }
    first_kept[batch * kv_heads] = static_cast<int64_t>(kept_spans.size());
  }

  const int64_t num_spans = static_cast<int64_t>(spans.size());
  const int64_t num_kept = static_cast<int64_t>(kept_spans.size());
  std::vector<acc_t> span_max(num_spans), span_sum(num_spans), span_acc(num_spans * dim);
  // Per kept span and query head r of its KV head: entry (span * group + r).
  std::vector<acc_t> kept_max(num_kept * group), kept_sum(num_kept * group), kept_acc(num_kept * group * dim);
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = keys.data_ptr<scalar_t>();
  const scalar_t* v_data = values.data_ptr<scalar_t>();
  const acc_t s = static_cast<acc_t>(scale);

  at::parallel_for(0, num_spans + num_kept, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> score(kSpan), qf(dim);
    std::vector<acc_t> kept_score(num_kept > 0 ? group * kSpan : 0), kept_q(num_kept > 0 ? group * dim : 0);
    std::vector<int64_t> taken(num_kept > 0 ? kSpan : 0);
    for (int64_t i = begin; i < end; ++i) {
      if (i >= num_spans) {
        const int64_t k = i - num_spans;
        const KeptSpan& sp = kept_spans[k];
        const scalar_t* qp = q_data + (sp.b * heads + sp.kv * group) * dim;  // the KV head's query heads
        for (int64_t d = 0; d < group * dim; ++d) kept_q[d] = static_cast<acc_t>(qp[d]) * s;
        attend_kept<scalar_t, acc_t, kDim>(kept, sp, kept_q.data(), group, dim, taken.data(), kept_score.data(),
                                           kept_max.data() + k * group, kept_sum.data() + k * group,
                                           kept_acc.data() + k * group * dim);
        continue;
      }
      const Span& sp = spans[i];
      const int64_t b = sp.row / heads, h = sp.row % heads, kv = h / group;
      // A sink span walks the sink slots from the first (a "ring" that never wraps).
      const bool sink_span = sp.first < 0;
      const int64_t c = sink_span ? sp.count : cap[kv];
      const int64_t base = start[kv] - (sink_span ? sinks : 0);
      const int64_t first_slot = sink_span ? 0 : (length - sp.first - sp.count) % c;
      const scalar_t* qp = q_data + sp.row * dim;
      for (int64_t d = 0; d < dim; ++d) qf[d] = static_cast<acc_t>(qp[d]) * s;
      // Ages first .. first + count - 1 hold positions length - 1 - age; walk them oldest
      // first, so that the slots increase (wrapping once at most).
      int64_t slot = first_slot;
      const scalar_t* k_ring = k_data + (b * slots + base) * dim;
      const scalar_t* v_ring = v_data + (b * slots + base) * dim;
      for (int64_t j = 0; j < sp.count; ++j) {
        const scalar_t* kp = k_ring + slot * dim;
        acc_t dot = 0;
        for (int64_t d = 0; d < dim; ++d) dot += qf[d] * static_cast<acc_t>(kp[d]);
        score[j] = dot;
        if (++slot == c) slot = 0;
      }
      // No infinities anywhere (the maximum starts at a real score), so the step stays exact
      // under the vectorising flags it is built with.
      acc_t top = score[0];
      for (int64_t j = 1; j < sp.count; ++j) top = std::max(top, score[j]);
      acc_t total = 0;
      for (int64_t j = 0; j < sp.count; ++j) {
        score[j] = std::exp(score[j] - top);
        total += score[j];
      }
      // Weighted sum of the values, in the same slot order as the scores.
      auto weighted_sum = [&](acc_t* sum) {
        int64_t at_slot = first_slot;
        for (int64_t j = 0; j < sp.count; ++j) {
          const acc_t p = score[j];
          const scalar_t* vp = v_ring + at_slot * dim;
          for (int64_t d = 0; d < dim; ++d) sum[d] += p * static_cast<acc_t>(vp[d]);
          if (++at_slot == c) at_slot = 0;
        }
      };
      acc_t* acc = span_acc.data() + i * dim;
      if constexpr (kDim > 0) {  // a local array the compiler keeps in registers
        acc_t sum[kDim] = {};
        weighted_sum(sum);
        std::copy(sum, sum + kDim, acc);
      } else {
        std::fill(acc, acc + dim, acc_t(0));
        weighted_sum(acc);
      }
      span_max[i] = top;
      span_sum[i] = total;
    }
  });

  scalar_t* o_data = out.data_ptr<scalar_t>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> joined(dim);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t lo = first_span[row], hi = first_span[row + 1];
      // The row's kept spans: entries r of the kept spans of its batch row and KV head; one
      // with no valid entry (sum 0) has no maximum and is skipped.
      const int64_t h = row % heads, r = h % group;
      const int64_t kept_row = (row / heads) * kv_heads + h / group;
      const int64_t kept_lo = num_kept > 0 ? first_kept[kept_row] : 0;
      const int64_t kept_hi = num_kept > 0 ? first_kept[kept_row + 1] : 0;
      acc_t top = span_max[lo];  // every row has at least one span (length >= 1, windows >= 1)
      for (int64_t i = lo + 1; i < hi; ++i) top = std::max(top, span_max[i]);
      for (int64_t k = kept_lo; k < kept_hi; ++k) {
        if (kept_sum[k * group + r] > 0) top = std::max(top, kept_max[k * group + r]);
      }
      std::fill(joined.begin(), joined.end(), acc_t(0));
      acc_t total = 0;
      for (int64_t i = lo; i < hi; ++i) {
        const acc_t w = std::exp(span_max[i] - top);
        total += w * span_sum[i];
        const acc_t* acc = span_acc.data() + i * dim;
        for (int64_t d = 0; d < dim; ++d) joined[d] += w * acc[d];
      }
      for (int64_t k = kept_lo; k < kept_hi; ++k) {
        const int64_t e = k * group + r;
        if (kept_sum[e] == 0) continue;
        const acc_t w = std::exp(kept_max[e] - top);
        total += w * kept_sum[e];
        const acc_t* acc = kept_acc.data() + e * dim;
        for (int64_t d = 0; d < dim; ++d) joined[d] += w * acc[d];
      }
      scalar_t* op = o_data + row * dim;
      for (int64_t d = 0; d < dim; ++d) op[d] = static_cast<scalar_t>(joined[d] / total);
      if (lse != nullptr) lse[row] = static_cast<float>(top + std::log(total));
    }
  });
}


inline void check_rings(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& ring_start,
                 const at::Tensor& capacity, const at::Tensor& windows, int64_t length, int64_t sinks = 0) {
  TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu(), "ring_decode runs on CPU tensors");
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3, "keys, values must be 3-d");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "keys, values must be contiguous");
  TORCH_CHECK(keys.sizes() == values.sizes() && values.scalar_type() == keys.scalar_type(),
              "keys and values must be (B, S, D) of one dtype");
  TORCH_CHECK(ring_start.scalar_type() == at::kLong && capacity.scalar_type() == at::kLong &&
                  windows.scalar_type() == at::kLong,
              "ring_start, capacity, windows must be int64");
  TORCH_CHECK(ring_start.numel() == capacity.numel() && ring_start.numel() >= 1 &&
                  windows.numel() % ring_start.numel() == 0,
              "one window per query head, one start and capacity per KV head");
  TORCH_CHECK(length >= 1, "length must be at least 1");
  TORCH_CHECK(sinks >= 0, "sinks must be >= 0");
  TORCH_CHECK(ring_start.device().is_cpu() && capacity.device().is_cpu() && windows.device().is_cpu(),
              "ring_start, capacity, windows must be CPU tensors");
  const at::Tensor start = ring_start.contiguous(), cap = capacity.contiguous(), win = windows.contiguous();
  for (int64_t g = 0; g < start.numel(); ++g) {
    const int64_t first = start.data_ptr<int64_t>()[g], size = cap.data_ptr<int64_t>()[g];
    TORCH_CHECK(size >= 1 && first >= sinks && first + size <= keys.size(1),
                "every ring, and the sink slots before it, must lie within the slots of keys and values "
                "(capacity >= 1)");
  }
  for (int64_t h = 0; h < win.numel(); ++h) {
    TORCH_CHECK(win.data_ptr<int64_t>()[h] >= 1, "every window must be >= 1");
  }
}

// The kept keys of ring_decode, ring_decode_packed and decode_block, checked against the rings'
// keys (B, S, D) and their kv_heads KV heads: all five tensors or none. kept_keys, kept_values
// (B, K, D) contiguous, of the rings' dtype; kept_valid (B, K) contiguous bool or uint8 (which
// entries hold a key); kept_start, kept_count (H_kv,) contiguous int64: KV head g's entries in
// slots [kept_start[g], kept_start[g] + kept_count[g]). Returns their view (none: keys ==
// nullptr); the tensors must outlive it.
inline KeptView check_kept(const c10::optional<at::Tensor>& kept_keys, const c10::optional<at::Tensor>& kept_values,
                           const c10::optional<at::Tensor>& kept_valid, const c10::optional<at::Tensor>& kept_start,
                           const c10::optional<at::Tensor>& kept_count, const at::Tensor& keys, int64_t kv_heads) {
  auto given = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  const int present = given(kept_keys) + given(kept_values) + given(kept_valid) + given(kept_start) + given(kept_count);
  KeptView view;
  if (present == 0) return view;
  TORCH_CHECK(present == 5, "kept_keys, kept_values, kept_valid, kept_start and kept_count come together");
  const at::Tensor &k = *kept_keys, &v = *kept_values, &ok = *kept_valid, &first = *kept_start, &count = *kept_count;
  for (const at::Tensor* t : {&k, &v, &ok, &first, &count}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "the kept-key tensors must be contiguous CPU tensors");
  }
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == keys.size(0) && k.size(2) == keys.size(2),
              "kept_keys and kept_values must be (B, K, D) with the rings' B and D");
  TORCH_CHECK(k.scalar_type() == keys.scalar_type() && v.scalar_type() == keys.scalar_type(),
              "kept_keys and kept_values must have the rings' dtype");
  TORCH_CHECK(ok.dim() == 2 && ok.size(0) == k.size(0) && ok.size(1) == k.size(1) &&
                  (ok.scalar_type() == at::kBool || ok.scalar_type() == at::kByte),
              "kept_valid must be a bool or uint8 (B, K) tensor with kept_keys' B and K");
  TORCH_CHECK(first.scalar_type() == at::kLong && count.scalar_type() == at::kLong && first.numel() == kv_heads &&
                  count.numel() == kv_heads,
              "kept_start and kept_count must be int64, one per KV head");
  const int64_t* f = first.data_ptr<int64_t>();
  const int64_t* n = count.data_ptr<int64_t>();
  for (int64_t g = 0; g < kv_heads; ++g) {
    TORCH_CHECK(f[g] >= 0 && n[g] >= 0 && f[g] + n[g] <= k.size(1),
                "every KV head's kept slots [kept_start, kept_start + kept_count) must lie within kept_keys' K slots");
  }
  view.keys = k.data_ptr();
  view.values = v.data_ptr();
  view.valid = static_cast<const uint8_t*>(ok.data_ptr());
  view.start = f;
  view.count = n;
  view.slots = k.size(1);
  return view;
}

template <typename scalar_t>
void attend_rings(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& start, const at::Tensor& cap, const at::Tensor& win, int64_t length,
                  int64_t sinks, double scale, at::Tensor& out, float* lse = nullptr,
                  const KeptView& kept = KeptView()) {
  switch (q.size(2)) {
    case 32: decode<scalar_t, 32>(q, keys, values, start, cap, win, length, sinks, scale, out, lse, kept); break;
    case 64: decode<scalar_t, 64>(q, keys, values, start, cap, win, length, sinks, scale, out, lse, kept); break;
    case 128: decode<scalar_t, 128>(q, keys, values, start, cap, win, length, sinks, scale, out, lse, kept); break;
    default: decode<scalar_t, 0>(q, keys, values, start, cap, win, length, sinks, scale, out, lse, kept);
  }
}

// Rotate-half rotary embedding of one head vector, as aah.attention.RotaryEmbedding:
// x * cos + cat(-x[half:], x[:half]) * sin. cos == nullptr: no rotary embedding (a copy).
template <typename scalar_t>
void rotate(const scalar_t* x, const float* cos, const float* sin, int64_t dim, scalar_t* y) {
  if (cos == nullptr) {
    std::copy(x, x + dim, y);
    return;
  }
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    const float other = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
    y[d] = static_cast<scalar_t>(static_cast<float>(x[d]) * cos[d] + other * sin[d]);
  }
}

}  // namespace aah
