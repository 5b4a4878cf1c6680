// The few DLPack definitions the C API's eager path needs (kungfu_all_reduce_dlpack): the unversioned
// DLManagedTensor that a "dltensor" PyCapsule carries, the exchange format of TensorFlow's
// tf.experimental.dlpack (and of numpy, PyTorch, JAX). Written from the DLPack specification
// (dmlc/dlpack, include/dlpack/dlpack.h, whose ABI has been stable since v0.2); only what is used here.
// No TensorFlow here: the engine stays framework-free, and the Python side does the capsule work.
#ifndef KUNGFU_CC_DLPACK_H_
#define KUNGFU_CC_DLPACK_H_

#include <cstdint>

#include "cc/dtype.h"
#include "cc/tensor_meta.h"

namespace kungfu {
namespace dlpack {

constexpr int32_t kDLCPU = 1;

// DLDataTypeCode
constexpr uint8_t kDLInt = 0;
constexpr uint8_t kDLUInt = 1;
constexpr uint8_t kDLFloat = 2;
constexpr uint8_t kDLBfloat = 4;
constexpr uint8_t kDLBool = 6;

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// The engine's dtype of a DLPack dtype the engine reduces (one lane; float16, bfloat16, float32,
// float64, int32, int64), or false.
inline bool ToEngineDType(const DLDataType& t, DType* out) {
  if (t.lanes != 1) return false;
  if (t.code == kDLFloat && t.bits == 16) *out = DType::kFloat16;
  else if (t.code == kDLBfloat && t.bits == 16) *out = DType::kBFloat16;
  else if (t.code == kDLFloat && t.bits == 32) *out = DType::kFloat32;
  else if (t.code == kDLFloat && t.bits == 64) *out = DType::kFloat64;
  else if (t.code == kDLInt && t.bits == 32) *out = DType::kInt32;
  else if (t.code == kDLInt && t.bits == 64) *out = DType::kInt64;
  else return false;
  return true;
}

// For the collectives that copy (broadcast, all-gather, consensus): the engine's dtype and TF's DataType
// number (cc/tensor_meta.h) of a DLPack dtype they take: those the engine reduces, and uint8, int8 and bool,
// which travel as bytes. False for any other.
inline bool ToCopyDType(const DLDataType& t, DType* out, int* tf) {
  if (t.lanes == 1 && t.bits == 8 && (t.code == kDLUInt || t.code == kDLInt || t.code == kDLBool)) {
    *out = DType::kUInt8;
    *tf = t.code == kDLUInt ? tf_dtype::kUInt8 : t.code == kDLInt ? tf_dtype::kInt8 : tf_dtype::kBool;
    return true;
  }
  if (!ToEngineDType(t, out)) return false;
  switch (*out) {
    case DType::kFloat16: *tf = tf_dtype::kHalf; return true;
    case DType::kBFloat16: *tf = tf_dtype::kBFloat16; return true;
    case DType::kFloat32: *tf = tf_dtype::kFloat; return true;
    case DType::kFloat64: *tf = tf_dtype::kDouble; return true;
    case DType::kInt32: *tf = tf_dtype::kInt32; return true;
    case DType::kInt64: *tf = tf_dtype::kInt64; return true;
    default: return false;
  }
}

}  // namespace dlpack
}  // namespace kungfu

#endif  // KUNGFU_CC_DLPACK_H_
