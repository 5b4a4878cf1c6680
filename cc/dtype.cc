#include "cc/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace kungfu {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kUInt8: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kUInt8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
  }
  return "unknown";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMean: return "mean";
  }
  return "unknown";
}

bool IsValidDType(uint8_t v) { return v >= 1 && v <= 7; }
bool IsValidReduceOp(uint8_t v) { return v >= 1 && v <= 5; }

StatusOr<ReduceOp> ParseReduceOp(const std::string& name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "mean") return ReduceOp::kMean;
  if (name == "min") return ReduceOp::kMin;
  if (name == "max") return ReduceOp::kMax;
  if (name == "prod") return ReduceOp::kProd;
  return InvalidArgument("unknown reduce op '" + name + "'; expected one of sum, mean, min, max, prod");
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0);
  }
  if (absx >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: overflow to inf
  if (absx < 0x38800000u) {                       // below the smallest normal half: subnormal or zero
    if (absx < 0x33000000u) return sign;          // < 2^-25 rounds to zero
    const uint32_t e = absx >> 23;
    const uint32_t m = (absx & 0x7fffff) | 0x800000;
    const int shift = 126 - static_cast<int>(e);  // 14 + (113 - e) - 1 ... see derivation: value = m * 2^(e-150)
    // half subnormal unit is 2^-24, so result = m * 2^(e-150+24) = m >> (126 - e)
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  // normal: rebias exponent, round mantissa to nearest even
  uint32_t r = ((absx >> 13) - ((127 - 15) << 10));
  const uint32_t rem = absx & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
  return sign | static_cast<uint16_t>(r);
}

float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet nan
  const uint32_t lsb = (x >> 16) & 1;
  x += 0x7fff + lsb;  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}

namespace {

// min and max that give the same bits whichever operand comes first, as recursive doubling needs (each
// partner reduces with the operands swapped): std::min/max return their first argument for a NaN
// and for -0 against +0. Here a NaN wins (one quiet NaN, whatever the inputs' payloads), as in
// np.maximum, so a NaN on any worker shows in the result; and -0 < +0.
template <typename T>
T Max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
    if (a == b) return std::signbit(a) ? b : a;
  }
  return a < b ? b : a;
}

template <typename T>
T Min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
    if (a == b) return std::signbit(a) ? a : b;
  }
  return a < b ? a : b;
}

template <typename T>
struct Ops {
  static T Apply(ReduceOp op, T a, T b) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMean: return a + b;
      case ReduceOp::kMin: return Min(a, b);
      case ReduceOp::kMax: return Max(a, b);
      case ReduceOp::kProd: return a * b;
    }
    return a;
  }
};

// Separate loops per op so the compiler vectorises each one.
template <typename T>
void ReduceTyped(T* dst, const T* a, const T* b, int64_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      for (int64_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
      break;
    case ReduceOp::kMin:
      for (int64_t i = 0; i < n; ++i) dst[i] = Min(a[i], b[i]);
      break;
    case ReduceOp::kMax:
      for (int64_t i = 0; i < n; ++i) dst[i] = Max(a[i], b[i]);
      break;
    case ReduceOp::kProd:
      for (int64_t i = 0; i < n; ++i) dst[i] = a[i] * b[i];
      break;
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void ReduceHalf(uint16_t* dst, const uint16_t* a, const uint16_t* b, int64_t n, ReduceOp op) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FromF(Ops<float>::Apply(op, ToF(a[i]), ToF(b[i])));
}

}  // namespace

void Reduce3(void* dst, const void* a, const void* b, int64_t n, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kUInt8:
      ReduceTyped(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), n, op);
      break;
    case DType::kInt32:
      ReduceTyped(static_cast<int32_t*>(dst), static_cast<const int32_t*>(a), static_cast<const int32_t*>(b), n, op);
      break;
    case DType::kInt64:
      ReduceTyped(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a), static_cast<const int64_t*>(b), n, op);
      break;
    case DType::kFloat32:
      ReduceTyped(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b), n, op);
      break;
    case DType::kFloat64:
      ReduceTyped(static_cast<double*>(dst), static_cast<const double*>(a), static_cast<const double*>(b), n, op);
      break;
    case DType::kFloat16:
      ReduceHalf<HalfToFloat, FloatToHalf>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                                           static_cast<const uint16_t*>(b), n, op);
      break;
    case DType::kBFloat16:
      ReduceHalf<BFloat16ToFloat, FloatToBFloat16>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                                                   static_cast<const uint16_t*>(b), n, op);
      break;
  }
}

void ReduceInto(void* dst, const void* src, int64_t count, DType dtype, ReduceOp op) {
  Reduce3(dst, dst, src, count, dtype, op);
}

namespace {
template <typename T>
void DivTyped(T* p, int64_t n, int64_t d) {
  const T dv = static_cast<T>(d);
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] / dv;
}
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void DivHalf(uint16_t* p, int64_t n, int64_t d) {
  const float dv = static_cast<float>(d);
  for (int64_t i = 0; i < n; ++i) p[i] = FromF(ToF(p[i]) / dv);
}
}  // namespace

void DivideBy(void* buf, int64_t count, DType dtype, int64_t divisor) {
  if (divisor == 1) return;
  switch (dtype) {
    case DType::kUInt8: DivTyped(static_cast<uint8_t*>(buf), count, divisor); break;
    case DType::kInt32: DivTyped(static_cast<int32_t*>(buf), count, divisor); break;
    case DType::kInt64: DivTyped(static_cast<int64_t*>(buf), count, divisor); break;
    case DType::kFloat32: DivTyped(static_cast<float*>(buf), count, divisor); break;
    case DType::kFloat64: DivTyped(static_cast<double*>(buf), count, divisor); break;
    case DType::kFloat16: DivHalf<HalfToFloat, FloatToHalf>(static_cast<uint16_t*>(buf), count, divisor); break;
    case DType::kBFloat16:
      DivHalf<BFloat16ToFloat, FloatToBFloat16>(static_cast<uint16_t*>(buf), count, divisor);
      break;
  }
}

}  // namespace kungfu
