// The C API's DLPack calls (cc/c_api.h): the eager collectives' way from a framework's tensor to the engine
// and back, with no copy on the way in and a result block the caller's framework takes over.
#include "cc/c_api.h"

#include <pthread.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cc/dlpack.h"
#include "cc/engine.h"
#include "cc/tensor_meta.h"

using kungfu::Status;

namespace {
using kungfu::dlpack::DLManagedTensor;

constexpr size_t kDataAlign = 64;  // TF's EIGEN_MAX_ALIGN_BYTES: its kernels may assume it of any tensor

// Result blocks of kungfu_all_reduce_dlpack, kept once their tensor is freed for the next call of the same
// size: a fresh block of 64 MiB is a fresh mapping from malloc, and faulting its pages in on every call
// doubled an eager 64 MiB all-reduce's time on the 2-core VM (TF's own allocator keeps its memory too).
// Blocks under kMinBytes come from malloc's bins anyway. At most kPerSize blocks of one size and kMaxBytes
// in all are kept; the rest are freed. The pool is never destroyed, so a tensor freed during exit still
// finds it. In a child forked meanwhile (its lock may have been held by a thread that is gone) blocks
// bypass it: malloc and free.
class BlockPool {
 public:
  static constexpr size_t kMinBytes = size_t{64} << 10;
  static constexpr size_t kMaxBytes = size_t{256} << 20;
  static constexpr size_t kPerSize = 4;

  static BlockPool& Get() {
    static BlockPool* pool = [] {
      pthread_atfork(nullptr, nullptr, [] { forked_.store(true); });
      return new BlockPool;
    }();
    return *pool;
  }

  // A block of bytes (a multiple of kDataAlign) aligned to kDataAlign, or null when out of memory.
  void* Take(size_t bytes) {
    if (bytes >= kMinBytes && !forked_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        void* block = it->second.back();
        it->second.pop_back();
        cached_ -= bytes;
        return block;
      }
    }
    void* block = nullptr;
    return posix_memalign(&block, kDataAlign, bytes) == 0 ? block : nullptr;
  }

  void Give(void* block, size_t bytes) {
    if (bytes >= kMinBytes && !forked_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<void*>& same = free_[bytes];
      if (same.size() < kPerSize && cached_ + bytes <= kMaxBytes) {
        same.push_back(block);
        cached_ += bytes;
        return;
      }
    }
    std::free(block);
  }

 private:
  static inline std::atomic<bool> forked_{false};
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // block size -> blocks
  size_t cached_ = 0;                                     // bytes in free_
};

// Whether t's strides (null: compact) describe compact row-major data; dimensions of size 1 may carry any.
bool Compact(const kungfu::dlpack::DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expected = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expected) return false;
    expected *= t.shape[d];
  }
  return true;
}

// One block: the data (first, aligned), the DLManagedTensor, its shape, then the block's size.
size_t* BlockSize(DLManagedTensor* t) {
  return reinterpret_cast<size_t*>(reinterpret_cast<char*>(t) + sizeof(DLManagedTensor) +
                                   sizeof(int64_t) * static_cast<size_t>(t->dl_tensor.ndim));
}

void FreeDLManaged(DLManagedTensor* self) { BlockPool::Get().Give(self->manager_ctx, *BlockSize(self)); }

// A compact tensor of like's dtype and device and the given shape over a new block; null if out of memory.
DLManagedTensor* NewDLManaged(const kungfu::dlpack::DLTensor& like, const int64_t* dims, int ndim, int64_t nbytes) {
  const size_t data_bytes = (static_cast<size_t>(nbytes) + kDataAlign - 1) / kDataAlign * kDataAlign;
  const size_t head = sizeof(DLManagedTensor) + sizeof(int64_t) * static_cast<size_t>(ndim) + sizeof(size_t);
  const size_t total = data_bytes + (head + kDataAlign - 1) / kDataAlign * kDataAlign;
  void* block = BlockPool::Get().Take(total);
  if (block == nullptr) return nullptr;
  char* base = static_cast<char*>(block);
  auto* t = reinterpret_cast<DLManagedTensor*>(base + data_bytes);
  auto* shape = reinterpret_cast<int64_t*>(base + data_bytes + sizeof(DLManagedTensor));
  for (int d = 0; d < ndim; ++d) shape[d] = dims[d];
  t->dl_tensor = like;
  t->dl_tensor.data = base;
  t->dl_tensor.ndim = ndim;
  t->dl_tensor.shape = shape;
  t->dl_tensor.strides = nullptr;
  t->dl_tensor.byte_offset = 0;
  t->manager_ctx = block;
  t->deleter = &FreeDLManaged;
  *BlockSize(t) = total;
  return t;
}

// An input tensor of the DLPack calls, once taken.
struct Input {
  const kungfu::dlpack::DLTensor* t = nullptr;
  kungfu::DType dtype = kungfu::DType::kFloat32;
  int tf_dtype = 0;      // TF's DataType number (cc/tensor_meta.h); copying collectives only
  int64_t count = 0;     // elements
  const char* data = nullptr;
  int64_t bytes() const { return count * static_cast<int64_t>(kungfu::DTypeSize(dtype)); }
};

// Whether the C API takes in (a DLManagedTensor): a compact CPU tensor of a dtype the engine reduces or, when
// copying, also one of those that travel as bytes. Its shape is bounded first (the product of its nonzero
// dimensions below 2^60), so that its bytes, Compact()'s products and RowElements cannot overflow.
bool Take(const void* in, bool copying, Input* out) {
  const auto* managed = static_cast<const DLManagedTensor*>(in);
  if (managed == nullptr) return false;
  const kungfu::dlpack::DLTensor& t = managed->dl_tensor;
  if (t.device.device_type != kungfu::dlpack::kDLCPU || t.ndim < 0 || (t.ndim > 0 && t.shape == nullptr)) return false;
  if (copying ? !kungfu::dlpack::ToCopyDType(t.dtype, &out->dtype, &out->tf_dtype)
              : !kungfu::dlpack::ToEngineDType(t.dtype, &out->dtype)) {
    return false;
  }
  int64_t product = 1;  // of the nonzero dimensions: below 2^60, so no product of some of them overflows
  bool empty = false;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) return false;
    if (t.shape[d] == 0) {
      empty = true;
      continue;
    }
    if (product > ((int64_t{1} << 60) - 1) / t.shape[d]) return false;
    product *= t.shape[d];
  }
  if (!Compact(t)) return false;
  out->t = &t;
  out->count = empty ? 0 : product;
  out->data = static_cast<const char*>(t.data) + t.byte_offset;
  return true;
}

int OutOfMemory(const char* what, char* err, int err_len) {
  return kungfu::Report(kungfu::ResourceExhausted(std::string("out of memory for the ") + what + "'s result"), err,
                        err_len);
}

// Hands result to *out when s is OK; frees it otherwise.
int Finish(const Status& s, DLManagedTensor* result, void** out, char* err, int err_len) {
  if (!s.ok()) {
    result->deleter(result);
    *out = nullptr;
    return kungfu::Report(s, err, err_len);
  }
  *out = result;
  return 0;
}
}  // namespace

extern "C" {

int kungfu_all_reduce_dlpack(const void* in, int op, const char* name, void** out, char* err, int err_len) {
  Input x;
  if (out == nullptr || !kungfu::IsValidReduceOp(static_cast<uint8_t>(op)) || !Take(in, false, &x)) return -1;
  auto e = kungfu::GlobalEngine();
  if (!e) return kungfu::Report(kungfu::FailedPrecondition(kungfu::NoEngineReason()), err, err_len);
  DLManagedTensor* result = NewDLManaged(*x.t, x.t->shape, x.t->ndim, x.bytes());
  if (result == nullptr) return OutOfMemory("all-reduce", err, err_len);
  return Finish(e->AllReduceSync(x.data, result->dl_tensor.data, x.count, x.dtype, static_cast<kungfu::ReduceOp>(op),
                                 name ? name : "c_api", kungfu::ShapeSignature(x.t->shape, x.t->ndim)),
                result, out, err, err_len);
}

int kungfu_broadcast_dlpack(const void* in, int root, const char* name, void** out, char* err, int err_len) {
  Input x;
  if (out == nullptr || !Take(in, true, &x)) return -1;
  auto e = kungfu::GlobalEngine();
  if (!e) return kungfu::Report(kungfu::FailedPrecondition(kungfu::NoEngineReason()), err, err_len);
  const std::string key = name ? name : "c_api";
  if (root < 0 || root >= e->size()) {
    return kungfu::Report(kungfu::InvalidArgument("broadcast '" + key + "': root " + std::to_string(root) +
                                                  " is not a rank of this cluster of size " +
                                                  std::to_string(e->size())),
                          err, err_len);
  }
  DLManagedTensor* result = NewDLManaged(*x.t, x.t->shape, x.t->ndim, x.bytes());
  if (result == nullptr) return OutOfMemory("broadcast", err, err_len);
  if (e->rank() == root && x.bytes() > 0) std::memcpy(result->dl_tensor.data, x.data, static_cast<size_t>(x.bytes()));
  return Finish(e->BroadcastSync(result->dl_tensor.data, x.count, x.dtype, root, key,
                                 kungfu::BroadcastSignature(x.t->shape, x.t->ndim, x.tf_dtype)),
                result, out, err, err_len);
}

int kungfu_all_gather_dlpack(const void* in, const char* name, void** out, char* err, int err_len) {
  Input x;
  if (out == nullptr || !Take(in, true, &x)) return -1;
  auto e = kungfu::GlobalEngine();
  if (!e) return kungfu::Report(kungfu::FailedPrecondition(kungfu::NoEngineReason()), err, err_len);
  const std::string key = name ? name : "c_api";
  const kungfu::dlpack::DLTensor& t = *x.t;
  // Step one: every worker's shape record, under the key itself (cc/tensor_meta.h).
  const std::vector<int64_t> mine = kungfu::GatherRecord(x.tf_dtype, t.shape, t.ndim);
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(e->size()));
  Status s = e->AllGatherSync(mine.data(), all.data(), std::vector<int64_t>(e->size(), kungfu::kGatherRecordSize),
                              kungfu::DType::kInt64, key);
  if (!s.ok()) return kungfu::Report(s, err, err_len);
  const int64_t row = kungfu::RowElements(t.shape, t.ndim);
  int64_t rows = 0;
  std::vector<int64_t> counts;
  s = kungfu::CheckGatherRecords(all, row, key, &counts, &rows);
  if (!s.ok()) return kungfu::Report(s, err, err_len);
  const int64_t esize = static_cast<int64_t>(kungfu::DTypeSize(x.dtype));
  // Step two: the data, into a tensor of the concatenated shape (a scalar counts as a one-element vector).
  std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
  if (shape.empty()) shape.push_back(rows);
  else shape[0] = rows;
  DLManagedTensor* result = NewDLManaged(t, shape.data(), static_cast<int>(shape.size()), rows * row * esize);
  if (result == nullptr) return OutOfMemory("all-gather", err, err_len);
  return Finish(e->AllGatherSync(x.data, result->dl_tensor.data, counts, x.dtype, key + "/data"), result, out, err,
                err_len);
}

int kungfu_consensus_dlpack(const void* in, const char* name, int* same, char* err, int err_len) {
  Input x;
  if (same == nullptr || !Take(in, true, &x)) return -1;
  auto e = kungfu::GlobalEngine();
  if (!e) return kungfu::Report(kungfu::FailedPrecondition(kungfu::NoEngineReason()), err, err_len);
  const std::vector<char> bytes =
      kungfu::ConsensusBytes(x.tf_dtype, x.t->shape, x.t->ndim, x.data, static_cast<size_t>(x.bytes()));
  bool agreed = false;
  const Status s = e->ConsensusSync(bytes.data(), static_cast<int64_t>(bytes.size()), &agreed, name ? name : "c_api");
  *same = agreed ? 1 : 0;
  return kungfu::Report(s, err, err_len);
}

void kungfu_dlpack_free(void* tensor) {
  auto* t = static_cast<DLManagedTensor*>(tensor);
  if (t != nullptr && t->deleter != nullptr) t->deleter(t);
}

}  // extern "C"
