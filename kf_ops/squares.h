// Sums of squares over raw buffers of the engine's float dtypes: for the squared-norm monitor op, and for
// the group all-reduce, which can sum the squares of what it copies while it copies (its bucket's pack
// and unpack), so that a monitored step's two gradient norms cost no pass over memory of their own.
//
// float32 and float64 are summed in their own type in blocks whose sums are added in double; float16
// and bfloat16 are widened to float. float32 uses AVX2/FMA when the CPU has them (checked at run time).
#pragma once

#include <cstdint>

#include "cc/dtype.h"

namespace kungfu_tf {

// The sum of squares of count elements at p; 0 for a dtype that is not a float.
double SumSquares(const void* p, int64_t count, kungfu::DType dtype);

// memcpy(dst, src, count elements), returning the sum of squares of the elements copied: block by block,
// each block's squares read back from L1 right after its copy (about 1.3x memcpy's time in all).
double CopySumSquares(void* dst, const void* src, int64_t count, kungfu::DType dtype);

}  // namespace kungfu_tf
