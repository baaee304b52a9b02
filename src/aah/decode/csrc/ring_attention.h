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

// kDim > 0: the head dim known at compile time (loops unrolled, the running sums kept in
// registers); kDim = 0: any head dim.
template <typename scalar_t, int64_t kDim>
void decode(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
            const at::Tensor& ring_start, const at::Tensor& capacity, const at::Tensor& windows,
            int64_t length, int64_t sinks, double scale, at::Tensor& out, float* lse) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = q.size(0), heads = q.size(1);
  const int64_t dim = kDim > 0 ? kDim : q.size(2);
  const int64_t slots = keys.size(1);
  const int64_t group = heads / ring_start.size(0);
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

  const int64_t num_spans = static_cast<int64_t>(spans.size());
  std::vector<acc_t> span_max(num_spans), span_sum(num_spans), span_acc(num_spans * dim);
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = keys.data_ptr<scalar_t>();
  const scalar_t* v_data = values.data_ptr<scalar_t>();
  const acc_t s = static_cast<acc_t>(scale);

  at::parallel_for(0, num_spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> score(kSpan), qf(dim);
    for (int64_t i = begin; i < end; ++i) {
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
      acc_t top = span_max[lo];  // every row has at least one span (length >= 1, windows >= 1)
      for (int64_t i = lo + 1; i < hi; ++i) top = std::max(top, span_max[i]);
      std::fill(joined.begin(), joined.end(), acc_t(0));
      acc_t total = 0;
      for (int64_t i = lo; i < hi; ++i) {
        const acc_t w = std::exp(span_max[i] - top);
        total += w * span_sum[i];
        const acc_t* acc = span_acc.data() + i * dim;
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

template <typename scalar_t>
void attend_rings(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& start, const at::Tensor& cap, const at::Tensor& win, int64_t length,
                  int64_t sinks, double scale, at::Tensor& out, float* lse = nullptr) {
  switch (q.size(2)) {
    case 32: decode<scalar_t, 32>(q, keys, values, start, cap, win, length, sinks, scale, out, lse); break;
    case 64: decode<scalar_t, 64>(q, keys, values, start, cap, win, length, sinks, scale, out, lse); break;
    case 128: decode<scalar_t, 128>(q, keys, values, start, cap, win, length, sinks, scale, out, lse); break;
    default: decode<scalar_t, 0>(q, keys, values, start, cap, win, length, sinks, scale, out, lse);
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
