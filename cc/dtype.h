// Element types and reductions the engine understands, independent of any framework.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/status.h"

namespace kungfu {

// Wire values: never renumber, they travel in frame headers.
enum class DType : uint8_t {
  kUInt8 = 1,
  kInt32 = 2,
  kInt64 = 3,
  kFloat16 = 4,
  kBFloat16 = 5,
  kFloat32 = 6,
  kFloat64 = 7,
};

enum class ReduceOp : uint8_t { kSum = 1, kMin = 2, kMax = 3, kProd = 4, kMean = 5 };

// 0 for an unknown value (which callers must reject).
size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);
const char* ReduceOpName(ReduceOp op);
bool IsValidDType(uint8_t v);
bool IsValidReduceOp(uint8_t v);
// Parses "sum", "mean", "min", "max", "prod".
StatusOr<ReduceOp> ParseReduceOp(const std::string& name);

// dst[i] = dst[i] (op) src[i] for i < count. kMean reduces as kSum; callers divide with Scale().
// Half types (float16, bfloat16) are widened to float32 for the arithmetic and rounded once.
void ReduceInto(void* dst, const void* src, int64_t count, DType dtype, ReduceOp op);

// Three-way, for a star root that wants to avoid an extra copy: dst[i] = a[i] (op) b[i].
void Reduce3(void* dst, const void* a, const void* b, int64_t count, DType dtype, ReduceOp op);

// buf[i] /= divisor, for kMean. Integers use truncating division.
void DivideBy(void* buf, int64_t count, DType dtype, int64_t divisor);

// Half conversions, exposed for tests.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace kungfu
