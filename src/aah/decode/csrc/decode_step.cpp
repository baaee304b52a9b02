// The entry points of the compiled decode step (aah.ring_decode), CPU.
//
// ring_decode: attention of one query per head over per-head-window ring buffers;
// ring_decode_packed: rotary embedding, ring write and that attention, from a layer's
// packed QKV projection; linear_rows: the linear layers of a decode step (a few rows);
// decode_block: one whole pre-norm transformer block of a decode step, in one call;
// paged_attention: per-head windows and sink tokens over a paged KV cache (aah.vllm).

#include "linear_rows.h"
#include "paged_attention.h"
#include "ring_attention.h"

using namespace aah;

// x (N, I), weight (O, I), bias (O,) or None, one dtype: returns activation(x @ weight.T + bias),
// (N, O); activation "none", "gelu" or "relu".
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       const std::string& activation) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_rows runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x must be (N, I) and weight (O, I)");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be a contiguous (O,) tensor of x's dtype");
  }
  TORCH_CHECK(activation == "none" || activation == "gelu" || activation == "relu",
              "activation must be none, gelu or relu, got ", activation);
  const Activation act = activation_named(activation);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_rows", [&] {
    linear<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), weight.data_ptr<scalar_t>(), weight.size(0),
                     has_bias ? bias->data_ptr<scalar_t>() : nullptr, act, out.data_ptr<scalar_t>());
  });
  return out;
}


// q (B, H, D); keys, values (B, S, D): the rings of every KV head, KV head g in slots
// [ring_start[g], ring_start[g] + capacity[g]), its sink tokens (positions 0..sinks-1) in the
// sinks slots before; windows (H,) per query head; length: positions written so far (the new
// one included); lse: None, or a contiguous float32 (B, H) tensor that receives each row's
// log-sum-exp of scaled scores; kept_keys .. kept_count: None, or the kept keys every query head
// of a KV head also reads (check_kept). Returns (B, H, D) in q's dtype.
at::Tensor ring_decode(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                       const at::Tensor& ring_start, const at::Tensor& capacity,
                       const at::Tensor& windows, int64_t length, int64_t sinks, double scale,
                       const c10::optional<at::Tensor>& lse, const c10::optional<at::Tensor>& kept_keys,
                       const c10::optional<at::Tensor>& kept_values, const c10::optional<at::Tensor>& kept_valid,
                       const c10::optional<at::Tensor>& kept_start, const c10::optional<at::Tensor>& kept_count) {
  check_rings(keys, values, ring_start, capacity, windows, length, sinks);
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.is_contiguous(), "q must be a contiguous 3-d CPU tensor");
  TORCH_CHECK(keys.scalar_type() == q.scalar_type(), "q, keys, values must share a dtype");
  TORCH_CHECK(keys.size(0) == q.size(0) && keys.size(2) == q.size(2),
              "keys and values must be (B, S, D) with q's B and D");
  TORCH_CHECK(windows.numel() == q.size(1), "one window per query head, one start and capacity per KV head");
  const bool with_lse = lse.has_value() && lse->defined();
  if (with_lse) {
    TORCH_CHECK(lse->device().is_cpu() && lse->scalar_type() == at::kFloat && lse->is_contiguous() &&
                    lse->numel() == q.size(0) * q.size(1),
                "lse must be a contiguous float32 (B, H) CPU tensor");
  }
  const KeptView kept =
      check_kept(kept_keys, kept_values, kept_valid, kept_start, kept_count, keys, ring_start.numel());
  at::Tensor out = at::empty_like(q);
  const at::Tensor start = ring_start.contiguous(), cap = capacity.contiguous(), win = windows.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "ring_decode", [&] {
    attend_rings<scalar_t>(q, keys, values, start, cap, win, length, sinks, scale, out,
                           with_lse ? lse->data_ptr<float>() : nullptr, kept);
  });
  return out;
}

// One whole decode step of a layer from its packed projection. qkv (B, (H + 2 H_kv) D): the
// query heads, the key heads and the value heads of the new position length - 1, as the
// layer's QKV projection gives them; cos, sin: the rotary tables (positions, D) of
// aah.attention.RotaryEmbedding, of which row length - 1 is used (a one-row table: that row),
// or empty tensors (no rotary embedding); sinks: as ring_decode (the new position is written to
// its ring only); unread (1, S): a float32 scratch row whose entry for the written slot is set
// to 0 (the caches keep their own record of the positions held). Rotates the query and the key, writes the key and
// the value into slot (length - 1) % C of their KV head's ring (marking it written), then
// attends as ring_decode (with the kept keys, where given). Returns (B, H * D), the heads side by side.
at::Tensor ring_decode_packed(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                              at::Tensor& keys, at::Tensor& values, at::Tensor& unread,
                              const at::Tensor& ring_start, const at::Tensor& capacity,
                              const at::Tensor& windows, int64_t length, int64_t sinks, double scale,
                              const c10::optional<at::Tensor>& kept_keys, const c10::optional<at::Tensor>& kept_values,
                              const c10::optional<at::Tensor>& kept_valid, const c10::optional<at::Tensor>& kept_start,
                              const c10::optional<at::Tensor>& kept_count) {
  check_rings(keys, values, ring_start, capacity, windows, length, sinks);
  const KeptView kept =
      check_kept(kept_keys, kept_values, kept_valid, kept_start, kept_count, keys, ring_start.numel());
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16,
              "the packed step runs float32 or bfloat16 rings");
  const int64_t batch = keys.size(0), slots = keys.size(1), dim = keys.size(2);
  const int64_t heads = windows.numel(), kv_heads = ring_start.numel();
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(qkv.scalar_type() == keys.scalar_type(), "qkv, keys, values must share a dtype");
  TORCH_CHECK(qkv.size(0) == batch && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv must be (B, (H + 2 H_kv) D) with the rings' B and D");
  const bool rotary = cos.numel() > 0;
  TORCH_CHECK(!rotary || (cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) == dim &&
                          (cos.size(0) >= length || cos.size(0) == 1) && dim % 2 == 0 &&
                          cos.is_floating_point() && sin.is_floating_point()),
              "cos and sin must be rotary tables (positions, D) holding position length - 1, or that "
              "position's row alone (1, D) (or both empty)");
  // The row of the new position, in float32 (a no-op for float32 tables).
  const int64_t row_index = rotary && cos.size(0) == 1 ? 0 : length - 1;
  const at::Tensor cos_row = rotary ? cos.select(0, row_index).to(at::kFloat).contiguous() : cos;
  const at::Tensor sin_row = rotary ? sin.select(0, row_index).to(at::kFloat).contiguous() : sin;
  TORCH_CHECK(unread.scalar_type() == at::kFloat && unread.numel() == slots && unread.is_contiguous(),
              "unread must be a contiguous float32 (1, S) mask");
  const at::Tensor start = ring_start.contiguous(), cap = capacity.contiguous(), win = windows.contiguous();
  const int64_t* st = start.data_ptr<int64_t>();
  const int64_t* cp = cap.data_ptr<int64_t>();
  at::Tensor q = at::empty({batch, heads, dim}, qkv.options());
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "ring_decode_packed", [&] {
    const float* c = rotary ? cos_row.data_ptr<float>() : nullptr;
    const float* s = rotary ? sin_row.data_ptr<float>() : nullptr;
    const scalar_t* x = qkv.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = keys.data_ptr<scalar_t>();
    scalar_t* vp = values.data_ptr<scalar_t>();
    float* mask = unread.data_ptr<float>();
    for (int64_t b = 0; b < batch; ++b) {
      const scalar_t* row = x + b * qkv.size(1);
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, c, s, dim, qp + (b * heads + h) * dim);
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t slot = st[g] + (length - 1) % cp[g];
        rotate(row + (heads + g) * dim, c, s, dim, kp + (b * slots + slot) * dim);
        const scalar_t* v_new = row + (heads + kv_heads + g) * dim;
        std::copy(v_new, v_new + dim, vp + (b * slots + slot) * dim);
        mask[slot] = 0.0f;
      }
    }
    attend_rings<scalar_t>(q, keys, values, start, cap, win, length, sinks, scale, out, nullptr, kept);
  });
  return out.view({batch, heads * dim});
}

namespace {

// LayerNorm (rms false: weight, bias optional) or RMSNorm (rms true: weight optional) of each
// row, computed in float32 as torch.nn.LayerNorm and torch.nn.RMSNorm do.
template <typename scalar_t>
void norm_rows(const scalar_t* x, int64_t rows, int64_t dim, const scalar_t* weight, const scalar_t* bias,
               bool rms, double eps, scalar_t* y) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* xr = x + r * dim;
    acc_t mean = 0;
    if (!rms) {
      for (int64_t d = 0; d < dim; ++d) mean += static_cast<acc_t>(xr[d]);
      mean /= dim;
    }
    acc_t var = 0;
    for (int64_t d = 0; d < dim; ++d) {
      const acc_t c = static_cast<acc_t>(xr[d]) - mean;
      var += c * c;
    }
    const acc_t inv = acc_t(1) / std::sqrt(var / dim + static_cast<acc_t>(eps));
    for (int64_t d = 0; d < dim; ++d) {
      acc_t v = (static_cast<acc_t>(xr[d]) - mean) * inv;
      if (weight != nullptr) v *= static_cast<acc_t>(weight[d]);
      if (bias != nullptr) v += static_cast<acc_t>(bias[d]);
      y[r * dim + d] = static_cast<scalar_t>(v);
    }
  }
}

// a += b, elementwise, rounded to scalar_t as a PyTorch addition is.
template <typename scalar_t>
void add_into(scalar_t* a, const scalar_t* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = static_cast<scalar_t>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

const at::Tensor* present(const std::vector<c10::optional<at::Tensor>>& weights, size_t i) {
  return weights[i].has_value() && weights[i]->defined() ? &*weights[i] : nullptr;
}

enum Weight {
  kNorm1W, kNorm1B, kQkvW, kQkvB, kKeyW, kKeyB, kValueW, kValueB, kOutW, kOutB,
  kNorm2W, kNorm2B, kGateW, kGateB, kUpW, kUpB, kDownW, kDownB, kWeights
};

}  // namespace

// One decode step of a pre-norm transformer block in one call (aah.model.Block, or a
// Llama-style decoder layer of a transformers model):
//   x = x + out(attention(qkv(norm1(x))));  x = x + down(act(up(norm2(x))))
// with the attention of ring_decode_packed. x (B, d_model); weights: the 18 tensors
// [norm1 weight, norm1 bias, qkv weight, qkv bias, key weight, key bias, value weight, value
// bias, out weight, out bias, norm2 weight, norm2 bias, gate weight, gate bias, up weight, up
// bias, down weight, down bias], None where the layer has none. With a key and a value weight
// the qkv weight is the query projection alone (three projections side by side); without, it
// is the packed projection. Activation "gelu", "relu" or "swiglu" (silu(gate) * value: with a
// gate weight the up weight gives the value; without, up gives the gate, then the value).
// norm "layernorm" or "rmsnorm" (eps1, eps2 the norms' epsilons). The rest (the kept keys
// included) as ring_decode_packed. Returns the block's output (B, d_model).
at::Tensor decode_block(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& weights,
                        const std::string& norm, double eps1, double eps2, const std::string& activation,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys, at::Tensor& values,
                        at::Tensor& unread, const at::Tensor& ring_start, const at::Tensor& capacity,
                        const at::Tensor& windows, int64_t length, int64_t sinks, double scale,
                        const c10::optional<at::Tensor>& kept_keys, const c10::optional<at::Tensor>& kept_values,
                        const c10::optional<at::Tensor>& kept_valid, const c10::optional<at::Tensor>& kept_start,
                        const c10::optional<at::Tensor>& kept_count) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "the block step runs float32 or bfloat16");
  TORCH_CHECK(weights.size() == kWeights, "weights must hold the block's 18 tensors (None where absent)");
  TORCH_CHECK(norm == "layernorm" || norm == "rmsnorm", "norm must be layernorm or rmsnorm, got ", norm);
  TORCH_CHECK(activation == "gelu" || activation == "relu" || activation == "swiglu",
              "activation must be gelu, relu or swiglu, got ", activation);
  for (size_t i = 0; i < kWeights; ++i) {
    const at::Tensor* w = present(weights, i);
    TORCH_CHECK(w != nullptr || (i != kQkvW && i != kOutW && i != kUpW && i != kDownW),
                "the qkv, out, up and down weights are required");
    TORCH_CHECK(w == nullptr || (w->device().is_cpu() && w->is_contiguous() && w->scalar_type() == x.scalar_type()),
                "every weight must be a contiguous CPU tensor of x's dtype");
  }
  const bool split_qkv = present(weights, kKeyW) != nullptr;
  const bool split_up = present(weights, kGateW) != nullptr;
  TORCH_CHECK(split_qkv == (present(weights, kValueW) != nullptr), "the key and value weights come together");
  TORCH_CHECK(!split_up || activation == "swiglu", "a gate weight needs the swiglu activation");
  const int64_t batch = x.size(0), model = x.size(1);
  // The projections that fill qkv (B, (H + 2 H_kv) D) and up side by side.
  std::vector<int> qkv_parts = split_qkv ? std::vector<int>{kQkvW, kKeyW, kValueW} : std::vector<int>{kQkvW};
  std::vector<int> up_parts = split_up ? std::vector<int>{kGateW, kUpW} : std::vector<int>{kUpW};
  auto features = [&](const std::vector<int>& parts) {
    int64_t total = 0;
    for (int i : parts) {
      const at::Tensor& w = *present(weights, i);
      TORCH_CHECK(w.dim() == 2 && w.size(1) == model, "the projections of x must be (features, d_model)");
      const at::Tensor* b = present(weights, i + 1);
      TORCH_CHECK(b == nullptr || b->numel() == w.size(0), "a projection's bias must have one entry per output feature");
      total += w.size(0);
    }
    return total;
  };
  const int64_t qkv_features = features(qkv_parts), up_features = features(up_parts);
  const at::Tensor& out_w = *present(weights, kOutW);
  const at::Tensor& down_w = *present(weights, kDownW);
  const int64_t hidden = down_w.size(1);
  TORCH_CHECK(out_w.dim() == 2 && out_w.size(0) == model && down_w.dim() == 2 && down_w.size(0) == model &&
                  up_features == (activation == "swiglu" ? 2 * hidden : hidden) &&
                  (!split_up || present(weights, kGateW)->size(0) == hidden),
              "the weights do not fit x's width and each other");
  for (int i : {kNorm1W, kNorm1B, kNorm2W, kNorm2B, kOutB, kDownB}) {
    TORCH_CHECK(present(weights, i) == nullptr || present(weights, i)->numel() == model,
                "the norm weights and the out and down biases must have d_model entries");
  }
  TORCH_CHECK(out_w.size(1) == windows.numel() * keys.size(2),
              "the out weight must take the H * D attention outputs");  // before anything is written
  check_kept(kept_keys, kept_values, kept_valid, kept_start, kept_count, keys, ring_start.numel());
  const bool rms = norm == "rmsnorm";
  at::Tensor y = x.clone();
  at::Tensor normed = at::empty_like(x);
  at::Tensor qkv = at::empty({batch, qkv_features}, x.options());
  at::Tensor projected = at::empty_like(x);
  at::Tensor up = at::empty({batch, up_features}, x.options());
  at::Tensor gated = activation == "swiglu" ? at::empty({batch, hidden}, x.options()) : up;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "decode_block", [&] {
    auto data = [&](int i) -> const scalar_t* {
      const at::Tensor* w = present(weights, i);
      return w == nullptr ? nullptr : w->data_ptr<scalar_t>();
    };
    // Each part's outputs at its columns of a (B, total) buffer.
    auto project = [&](const scalar_t* in, const std::vector<int>& parts, Activation act, scalar_t* buffer,
                       int64_t total) {
      int64_t column = 0;
      for (int i : parts) {
        const int64_t rows = present(weights, i)->size(0);
        linear(in, batch, model, data(i), rows, data(i + 1), act, buffer + column, total);
        column += rows;
      }
    };
    scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* np = normed.data_ptr<scalar_t>();
    scalar_t* pp = projected.data_ptr<scalar_t>();
    norm_rows(yp, batch, model, data(kNorm1W), data(kNorm1B), rms, eps1, np);
    project(np, qkv_parts, Activation::kNone, qkv.data_ptr<scalar_t>(), qkv_features);
    at::Tensor heads = ring_decode_packed(qkv, cos, sin, keys, values, unread, ring_start, capacity, windows,
                                          length, sinks, scale, kept_keys, kept_values, kept_valid, kept_start,
                                          kept_count);
    linear(heads.data_ptr<scalar_t>(), batch, out_w.size(1), data(kOutW), model, data(kOutB), Activation::kNone, pp);
    add_into(yp, pp, batch * model);
    norm_rows(yp, batch, model, data(kNorm2W), data(kNorm2B), rms, eps2, np);
    const Activation act = activation_named(activation);  // none for swiglu: gated below
    scalar_t* upp = up.data_ptr<scalar_t>();
    project(np, up_parts, act, upp, up_features);
    if (activation == "swiglu") {
      scalar_t* gp = gated.data_ptr<scalar_t>();
      for (int64_t r = 0; r < batch; ++r) {
        for (int64_t i = 0; i < hidden; ++i) {
          const float gate = static_cast<float>(upp[r * up_features + i]);
          const float value = static_cast<float>(upp[r * up_features + hidden + i]);
          gp[r * hidden + i] = static_cast<scalar_t>(gate / (1.0f + std::exp(-gate)) * value);
        }
      }
    }
    linear(gated.data_ptr<scalar_t>(), batch, hidden, data(kDownW), model, data(kDownB), Activation::kNone, pp);
    add_into(yp, pp, batch * model);
  });
  return y;
}

// query (N, H, D): the tokens of a step, token t of request token_request[t] at position
// token_position[t] (N, int64); key_cache, value_cache (blocks, KV heads, block_size, D), the
// last two axes contiguous (keys_transposed: a key page holds K^T); block_table (R, M) int32;
// windows (H,) int64 >= 1; sinks >= 0. Writes (N, H, D) into out when given (query and out may
// be views whose last axis alone is contiguous), else into a new tensor; returns it.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           bool keys_transposed, const at::Tensor& token_request, const at::Tensor& token_position,
                           const at::Tensor& block_table, const at::Tensor& windows, int64_t sinks, double scale,
                           const c10::optional<at::Tensor>& out_given) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.stride(2) == 1,
              "query must be an (N, H, D) CPU tensor with its last axis contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must be (blocks, KV heads, block_size, D)");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(),
              "query and the caches must share a dtype");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "the caches' head size must be the query's");
  for (const at::Tensor* cache : {&key_cache, &value_cache}) {
    TORCH_CHECK(cache->stride(3) == 1 && cache->stride(2) == cache->size(3),
                "a page of a KV head must be contiguous");
  }
  const int64_t kv_heads = key_cache.size(1);
  TORCH_CHECK(query.size(1) % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(windows.scalar_type() == at::kLong && windows.numel() == query.size(1) && windows.is_contiguous(),
              "windows must be a contiguous int64 tensor, one per query head");
  TORCH_CHECK(token_request.scalar_type() == at::kLong && token_position.scalar_type() == at::kLong &&
                  token_request.numel() == query.size(0) && token_position.numel() == query.size(0) &&
                  token_request.is_contiguous() && token_position.is_contiguous(),
              "token_request and token_position must be contiguous int64, one per query token");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.is_contiguous(),
              "block_table must be a contiguous (requests, blocks) int32 tensor");
  TORCH_CHECK(sinks >= 0, "sinks must be >= 0");
  const int64_t* win = windows.data_ptr<int64_t>();
  for (int64_t h = 0; h < windows.numel(); ++h) TORCH_CHECK(win[h] >= 1, "every window must be >= 1");
  const int64_t* req = token_request.data_ptr<int64_t>();
  const int64_t* pos = token_position.data_ptr<int64_t>();
  for (int64_t t = 0; t < query.size(0); ++t) {
    TORCH_CHECK(req[t] >= 0 && req[t] < block_table.size(0), "token_request out of the block table's rows");
    TORCH_CHECK(pos[t] >= 0 && pos[t] < block_table.size(1) * key_cache.size(2),
                "token_position beyond the pages of the block table");
  }
  at::Tensor out = out_given.has_value() && out_given->defined() ? *out_given : at::empty(query.sizes(), query.options());
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.stride(2) == 1 &&
                  out.device().is_cpu(),
              "out must be a CPU tensor of query's shape and dtype with its last axis contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    paged_attention_dispatch<scalar_t>(keys_transposed, query, key_cache, value_cache, token_request,
                                       token_position, block_table, windows, sinks, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ring_decode", &ring_decode, "one decode step over per-head-window ring buffers (and kept_keys beside them)");
  m.def("ring_decode_packed", &ring_decode_packed,
        "rotary, ring write and attention of one decode step, from the packed QKV projection");
  m.def("linear_rows", &linear_rows, "activation(x @ weight.T + bias) for a few rows, reading the weight once");
  m.def("decode_block", &decode_block, "one decode step of a pre-norm transformer block, in one call");
  m.def("paged_attention", &paged_attention, "per-head windows and sink tokens over a paged KV cache");
}
