#include "kf_ops/squares.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KF_SQUARES_AVX2 1
#endif

namespace kungfu_tf {
namespace {

using kungfu::DType;

constexpr int64_t kBlock = 4096;  // elements per partial sum in the element type
constexpr int kLanes = 8;         // independent accumulators: lets the compiler vectorise the loop

#ifdef KF_SQUARES_AVX2
__attribute__((target("avx2,fma"))) double SumSquaresAvx2(const float* p, int64_t n) {
  double total = 0;
  int64_t i = 0;
  while (i + 32 <= n) {
    const int64_t end = std::min(n, i + kBlock) & ~int64_t{31};
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i < end; i += 32) {
      const __m256 x0 = _mm256_loadu_ps(p + i), x1 = _mm256_loadu_ps(p + i + 8);
      const __m256 x2 = _mm256_loadu_ps(p + i + 16), x3 = _mm256_loadu_ps(p + i + 24);
      a0 = _mm256_fmadd_ps(x0, x0, a0);
      a1 = _mm256_fmadd_ps(x1, x1, a1);
      a2 = _mm256_fmadd_ps(x2, x2, a2);
      a3 = _mm256_fmadd_ps(x3, x3, a3);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (float v : lanes) total += v;
  }
  for (; i < n; ++i) total += static_cast<double>(p[i]) * p[i];
  return total;
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

// Sums x*x over n elements of T (each read through load), copying them to dst unless it is null.
template <typename T, typename A, typename Load>
double Blocks(T* dst, const T* src, int64_t n, Load load) {
  double total = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    A acc[kLanes] = {};
    int64_t i = start;
    for (; i + kLanes <= end; i += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const A x = load(src[i + k]);
        acc[k] += x * x;
      }
      if (dst != nullptr) std::memcpy(dst + i, src + i, kLanes * sizeof(T));
    }
    for (; i < end; ++i) {
      const A x = load(src[i]);
      acc[0] += x * x;
      if (dst != nullptr) dst[i] = src[i];
    }
    for (A a : acc) total += a;
  }
  return total;
}

double Squares(void* dst, const void* src, int64_t n, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: {
      const auto* p = static_cast<const float*>(src);
#ifdef KF_SQUARES_AVX2
      if (dst == nullptr && HasAvx2()) return SumSquaresAvx2(p, n);
#endif
      return Blocks<float, float>(static_cast<float*>(dst), p, n, [](float x) { return x; });
    }
    case DType::kFloat64:
      return Blocks<double, double>(static_cast<double*>(dst), static_cast<const double*>(src), n,
                                    [](double x) { return x; });
    case DType::kFloat16:
      return Blocks<uint16_t, float>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n,
                                     kungfu::HalfToFloat);
    case DType::kBFloat16:
      return Blocks<uint16_t, float>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n,
                                     kungfu::BFloat16ToFloat);
    default:
      if (dst != nullptr) std::memcpy(dst, src, static_cast<size_t>(n) * kungfu::DTypeSize(dtype));
      return 0;
  }
}

}  // namespace

bool HasSquares(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32 ||
         dtype == DType::kFloat64;
}

double SumSquares(const void* p, int64_t count, DType dtype) { return Squares(nullptr, p, count, dtype); }

double CopySumSquares(void* dst, const void* src, int64_t count, DType dtype) {
  return Squares(dst, src, count, dtype);
}

}  // namespace kungfu_tf
