// What a broadcast, all-gather or consensus knows of its tensor beyond the bytes, in one place for both
// callers: the TF kernels (kf_ops/) and the C API's DLPack path (cc/c_api_dlpack.cc, eager Python calls). Both
// describe a tensor the same way, so an eager call on one worker meets a graph call of the same collective
// on another, and a mismatch reads alike wherever it is found. No TensorFlow here: dtypes are TF's
// DataType numbers, which are part of TF's protobuf format (tensorflow/core/framework/types.proto) and
// never change.
#ifndef KUNGFU_CC_TENSOR_META_H_
#define KUNGFU_CC_TENSOR_META_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cc/status.h"

namespace kungfu {

// TF's DataType numbers of the dtypes the copying collectives take.
namespace tf_dtype {
constexpr int kFloat = 1;
constexpr int kDouble = 2;
constexpr int kInt32 = 3;
constexpr int kUInt8 = 4;
constexpr int kInt8 = 6;
constexpr int kInt64 = 9;
constexpr int kBool = 10;
constexpr int kBFloat16 = 14;
constexpr int kHalf = 19;
}  // namespace tf_dtype

// TF's name of a DataType number (tensorflow::DataTypeString: "float", "half", ...) for the dtypes above;
// "dtype <n>" for others.
std::string TfDTypeName(int tf_dtype);

// Combines shape signatures (ShapeSignature, engine.h), or a signature and a dtype, in order.
inline uint32_t CombineSignatures(uint32_t a, uint32_t b) { return ((a * 16777619u) ^ b) | 1u; }

// The broadcast's shape_sig: the shape's signature combined with the TF dtype, since uint8, int8 and bool
// all travel as bytes.
uint32_t BroadcastSignature(const int64_t* dims, int ndims, int tf_dtype);

// ---- all-gather ----
// The all-gather runs in two steps. First every worker's shape record (kGatherRecordSize int64s: rank,
// dtype, first dimension, a hash of the other dimensions, and the first few of them for messages) is
// all-gathered under "<name>". Every worker then sees the same records, so a mismatch fails every worker
// alike with InvalidArgument; otherwise each allocates the output and all-gathers the data under
// "<name>/data" with per-worker counts. The first step has the name itself, so that another collective
// given the same name on some worker meets it and fails at once.
constexpr int kGatherListedDims = 8;  // dimensions after the first kept for messages
constexpr int kGatherRecordSize = 4 + kGatherListedDims;

// The elements of one slice along the first dimension (the product of the dimensions after it), or -1 when
// that is 2^60 or more (possible only when the first dimension is 0).
int64_t RowElements(const int64_t* dims, int ndims);

// This worker's record. A scalar is gathered as one element.
std::vector<int64_t> GatherRecord(int tf_dtype, const int64_t* dims, int ndims);

// Checks the gathered records (one per worker, in rank order) against rank 0's: InvalidArgument naming the
// collective `key` and both sides when a dtype or a dimension after the first differs, or when the result
// would have 2^60 elements or more (row_elements: RowElements of this worker's shape). Otherwise fills
// *counts (each worker's elements, its first dimension times row_elements) and *rows (their first
// dimensions' sum). row_elements: the product of this worker's dimensions after the first.
Status CheckGatherRecords(const std::vector<int64_t>& all, int64_t row_elements, const std::string& key,
                          std::vector<int64_t>* counts, int64_t* rows);

// ---- consensus ----
// The bytes compared across workers: dtype, rank and dimensions (int64 each), then the tensor's data, so
// that equal bytes under different shapes or dtypes do not count as the same.
std::vector<char> ConsensusBytes(int tf_dtype, const int64_t* dims, int ndims, const void* data, size_t nbytes);

}  // namespace kungfu

#endif  // KUNGFU_CC_TENSOR_META_H_
