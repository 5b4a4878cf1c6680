#include "cc/tensor_meta.h"

#include <algorithm>
#include <cstring>

#include "cc/engine.h"

namespace kungfu {

std::string TfDTypeName(int tf_dtype) {
  switch (tf_dtype) {
    case tf_dtype::kFloat: return "float";
    case tf_dtype::kDouble: return "double";
    case tf_dtype::kInt32: return "int32";
    case tf_dtype::kUInt8: return "uint8";
    case tf_dtype::kInt8: return "int8";
    case tf_dtype::kInt64: return "int64";
    case tf_dtype::kBool: return "bool";
    case tf_dtype::kBFloat16: return "bfloat16";
    case tf_dtype::kHalf: return "half";
    default: return "dtype " + std::to_string(tf_dtype);
  }
}

uint32_t BroadcastSignature(const int64_t* dims, int ndims, int tf_dtype) {
  return CombineSignatures(ShapeSignature(dims, ndims), static_cast<uint32_t>(tf_dtype));
}

namespace {
enum RecordField { kRank = 0, kDType = 1, kDim0 = 2, kRestHash = 3, kListed = 4 };

// "float[3,4]"; "[3,4,...]" when the record lists only some dimensions.
std::string RecordString(const int64_t* r) {
  std::string s = TfDTypeName(static_cast<int>(r[kDType]));
  if (r[kRank] == 0) return s + "[] (scalar)";
  s += "[" + std::to_string(r[kDim0]);
  for (int64_t d = 1; d < r[kRank]; ++d) {
    if (d - 1 >= kGatherListedDims) return s + ",...]";
    s += "," + std::to_string(r[kListed + d - 1]);
  }
  return s + "]";
}

// When all that two records list agrees (dim 0 aside), what differs lies in the dimensions they do not
// list: say so, or the message would show two shapes that look alike.
std::string UnlistedHint(const int64_t* a, const int64_t* b) {
  if (a[kRank] != b[kRank] || a[kDType] != b[kDType] ||
      !std::equal(a + kListed, a + kGatherRecordSize, b + kListed)) {
    return "";
  }
  return " (they differ in a dimension after the first " + std::to_string(kGatherListedDims + 1) + ")";
}

bool SameExceptDim0(const int64_t* a, const int64_t* b) {
  return a[kRank] == b[kRank] && a[kDType] == b[kDType] && a[kRestHash] == b[kRestHash] &&
         std::equal(a + kListed, a + kGatherRecordSize, b + kListed);
}
}  // namespace

int64_t RowElements(const int64_t* dims, int ndims) {
  int64_t row = 1;
  for (int d = 1; d < ndims; ++d) {
    if (dims[d] < 0 || (dims[d] > 0 && row > ((int64_t{1} << 60) - 1) / dims[d])) return -1;
    row *= dims[d];
  }
  return row;
}

std::vector<int64_t> GatherRecord(int tf_dtype, const int64_t* dims, int ndims) {
  std::vector<int64_t> r(kGatherRecordSize, -1);
  r[kRank] = ndims;
  r[kDType] = tf_dtype;
  r[kDim0] = ndims == 0 ? 1 : dims[0];
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the dimensions after the first
  for (int d = 1; d < ndims; ++d) {
    hash = (hash ^ static_cast<uint64_t>(dims[d])) * 1099511628211ull;
    if (d - 1 < kGatherListedDims) r[kListed + d - 1] = dims[d];
  }
  r[kRestHash] = static_cast<int64_t>(hash);
  return r;
}

Status CheckGatherRecords(const std::vector<int64_t>& all, int64_t row_elements, const std::string& key,
                          std::vector<int64_t>* counts, int64_t* rows) {
  const int size = static_cast<int>(all.size() / kGatherRecordSize);
  const int64_t* first = all.data();
  for (int r = 1; r < size; ++r) {
    const int64_t* rec = all.data() + static_cast<size_t>(r) * kGatherRecordSize;
    if (!SameExceptDim0(first, rec)) {
      return InvalidArgument("allgather '" + key + "': workers disagree on dtype or dimensions after the first: " +
                             "rank 0 has " + RecordString(first) + ", rank " + std::to_string(r) + " has " +
                             RecordString(rec) + UnlistedHint(first, rec));
    }
  }
  if (row_elements < 0) {  // the same on every worker now: they all fail alike
    return InvalidArgument("allgather '" + key + "': a slice along the first dimension has 2^60 elements or more");
  }
  counts->assign(static_cast<size_t>(size), 0);
  *rows = 0;
  // The result's elements stay below 2^60, so that its bytes (8 at most each) and rows cannot overflow.
  constexpr int64_t kMaxElements = int64_t{1} << 60;
  int64_t elements = 0;
  for (int r = 0; r < size; ++r) {
    const int64_t dim0 = all[static_cast<size_t>(r) * kGatherRecordSize + kDim0];
    if (dim0 < 0 || dim0 > kMaxElements - *rows ||
        (row_elements > 0 && dim0 > (kMaxElements - elements) / row_elements)) {
      return InvalidArgument("allgather '" + key + "': rank " + std::to_string(r) + "'s first dimension " +
                             std::to_string(dim0) + " is negative or makes the result too large");
    }
    *rows += dim0;
    (*counts)[static_cast<size_t>(r)] = dim0 * row_elements;
    elements += dim0 * row_elements;
  }
  return Status::OK();
}

std::vector<char> ConsensusBytes(int tf_dtype, const int64_t* dims, int ndims, const void* data, size_t nbytes) {
  std::vector<int64_t> header = {tf_dtype, ndims};
  header.insert(header.end(), dims, dims + ndims);
  const size_t head = header.size() * sizeof(int64_t);
  std::vector<char> bytes(head + nbytes);
  std::memcpy(bytes.data(), header.data(), head);
  if (nbytes > 0) std::memcpy(bytes.data() + head, data, nbytes);
  return bytes;
}

}  // namespace kungfu
