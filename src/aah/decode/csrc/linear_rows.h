#pragma once
// activation(x @ weight.T + bias) for a few rows (CPU): the linear layers of one decode step.
//
// A decode step multiplies one row per sequence by every weight matrix of the model,
// so it is bound by reading the weights. The general matrix product takes a path
// built for many rows; here each thread takes a range of output features and reads
// each weight row once, computing its dot product with every input row while the
// weight row is in the first-level cache. An activation (GELU, ReLU) can be applied on the way
// out, which saves the activation's own call. Accumulates in float32 (double for double), with
// AVX2 vectors for float32 and bfloat16 where the CPU has them.

#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace aah {


template <typename scalar_t>
at::opmath_type<scalar_t> dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<acc_t>(a[i]) * static_cast<acc_t>(b[i]);
  return sum;
}

#ifdef __AVX2__
// Eight bfloat16 values widened to float32 (a bfloat16 is the upper half of a float32).
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline float horizontal_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Four independent 8-wide partial sums, so that the fused multiply-adds do not wait on each other.
template <typename scalar_t>
float dot_avx2(const scalar_t* a, const scalar_t* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), s0);
    s1 = _mm256_fmadd_ps(load8(a + i + 8), load8(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(load8(a + i + 16), load8(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(load8(a + i + 24), load8(b + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), s0);
  float sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  for (; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

template <>
inline float dot<float>(const float* a, const float* b, int64_t n) { return dot_avx2(a, b, n); }
template <>
inline float dot<c10::BFloat16>(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n) { return dot_avx2(a, b, n); }
#endif

enum class Activation { kNone, kGelu, kRelu };

// The activation named "gelu" or "relu"; any other name is none.
inline Activation activation_named(const std::string& name) {
  return name == "gelu" ? Activation::kGelu : name == "relu" ? Activation::kRelu : Activation::kNone;
}

// The activation applied to each output: exact GELU (erf form, as torch.nn.functional.gelu) or ReLU.
template <typename acc_t>
acc_t activate(acc_t y, Activation activation) {
  switch (activation) {
    case Activation::kGelu: return acc_t(0.5) * y * (acc_t(1) + std::erf(y * acc_t(M_SQRT1_2)));
    case Activation::kRelu: return y > acc_t(0) ? y : acc_t(0);
    default: return y;
  }
}

// out (rows, O) = activation(x (rows, I) @ weight (O, I).T + bias (O,) or nullptr); row r of the
// output starts at op + r * out_stride (out_stride < 0: O, the rows packed).
template <typename scalar_t>
void linear(const scalar_t* xp, int64_t rows, int64_t in_features, const scalar_t* wp, int64_t out_features,
            const scalar_t* bias, Activation activation, scalar_t* op, int64_t out_stride = -1) {
  if (out_stride < 0) out_stride = out_features;
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const scalar_t* w_row = wp + o * in_features;
      const auto b = bias == nullptr ? 0 : static_cast<at::opmath_type<scalar_t>>(bias[o]);
      for (int64_t r = 0; r < rows; ++r) {
        const auto y = dot(w_row, xp + r * in_features, in_features) + b;
        op[r * out_stride + o] = static_cast<scalar_t>(activate(y, activation));
      }
    }
  });
}

}  // namespace aah
