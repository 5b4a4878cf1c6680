// Kernels of KfBroadcast and KfAllGather.
//
// The all-gather runs in two steps. First every worker's shape record (a fixed-size int64 vector:
// rank, dtype, first dimension, a hash of the other dimensions, and the first few of them for
// messages) is all-gathered under "<name>". Every worker then sees the same records, so a mismatch
// fails every worker alike with InvalidArgument, and otherwise each allocates the output and
// all-gathers the data under "<name>/data" with per-worker counts. The first step has the name itself,
// so that another collective given the same name on some worker meets it and fails at once.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kf_ops/adapter.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace kungfu_tf {
namespace {

using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;

class BroadcastOp : public CollectiveKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : CollectiveKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("root", &root_)); }

  void Start(OpKernelContext* ctx, DoneCallback done) override {
    std::string key;
    OP_REQUIRES_OK_ASYNC(ctx, KeyOf(ctx, &key), done);
    const Tensor& in = ctx->input(0);
    BufferView view;
    OP_REQUIRES_OK_ASYNC(ctx, ViewOf(in, &view), done);
    std::shared_ptr<kungfu::Engine> engine = EngineOrFail(ctx, done);
    if (!engine) return;
    OP_REQUIRES_ASYNC(ctx, root_ >= 0 && root_ < engine->size(),
                      absl::InvalidArgumentError(Describe("broadcast", key) + ": root " + std::to_string(root_) +
                                                 " is not a rank of this cluster of size " +
                                                 std::to_string(engine->size())),
                      done);
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({0}, 0, in.shape(), &out), done);
    char* buf = const_cast<char*>(out->tensor_data().data());
    if (engine->rank() == root_ && buf != view.data && in.TotalBytes() > 0) {
      std::memcpy(buf, view.data, in.TotalBytes());
    }
    auto keep = std::make_shared<Tensor>(in);
    // uint8, int8 and bool all travel as bytes (kUInt8): the signature tells them apart.
    engine->Broadcast(buf, view.count, view.dtype, root_, key, FinishKernel(ctx, std::move(done), nullptr, keep),
                      CombineSignatures(ShapeSignature(in.shape()), static_cast<uint32_t>(in.dtype())));
  }

 private:
  int root_ = 0;      // the rank whose input every worker receives
};

// One worker's shape record, as all-gathered before the data.
constexpr int kListedDims = 8;                    // dimensions after the first kept for messages
constexpr int kRecordSize = 4 + kListedDims;      // rank, dtype, dim 0, hash of dims 1.., listed dims
enum RecordField { kRank = 0, kDType = 1, kDim0 = 2, kRestHash = 3, kListed = 4 };

std::vector<int64_t> ShapeRecord(const Tensor& t) {
  std::vector<int64_t> r(kRecordSize, -1);
  const int dims = t.dims();
  r[kRank] = dims;
  r[kDType] = t.dtype();
  r[kDim0] = dims == 0 ? 1 : t.dim_size(0);  // a scalar is gathered as one element
  uint64_t hash = 1469598103934665603ull;     // FNV-1a over the dimensions after the first
  for (int d = 1; d < dims; ++d) {
    hash = (hash ^ static_cast<uint64_t>(t.dim_size(d))) * 1099511628211ull;
    if (d - 1 < kListedDims) r[kListed + d - 1] = t.dim_size(d);
  }
  r[kRestHash] = static_cast<int64_t>(hash);
  return r;
}

// "float32[3,4]"; "[3,4,...]" when the record lists only some dimensions.
std::string RecordString(const int64_t* r) {
  std::string s = tensorflow::DataTypeString(static_cast<tensorflow::DataType>(r[kDType]));
  if (r[kRank] == 0) return s + "[] (scalar)";
  s += "[" + std::to_string(r[kDim0]);
  for (int d = 1; d < r[kRank]; ++d) {
    if (d - 1 >= kListedDims) return s + ",...]";
    s += "," + std::to_string(r[kListed + d - 1]);
  }
  return s + "]";
}

// When all that two records list agrees (dim 0 aside), what differs lies in the dimensions they do not
// list: say so, or the message would show two shapes that look alike.
std::string UnlistedHint(const int64_t* a, const int64_t* b) {
  if (a[kRank] != b[kRank] || a[kDType] != b[kDType] || !std::equal(a + kListed, a + kRecordSize, b + kListed)) {
    return "";
  }
  return " (they differ in a dimension after the first " + std::to_string(kListedDims + 1) + ")";
}

bool SameExceptDim0(const int64_t* a, const int64_t* b) {
  return a[kRank] == b[kRank] && a[kDType] == b[kDType] && a[kRestHash] == b[kRestHash] &&
         std::equal(a + kListed, a + kRecordSize, b + kListed);
}

class AllGatherOp : public CollectiveKernel {
 public:
  explicit AllGatherOp(OpKernelConstruction* c) : CollectiveKernel(c) {}

  // The shape step is keyed "<key>", the data step "<key>/data".
  void Start(OpKernelContext* ctx, DoneCallback done) override {
    std::string key;
    OP_REQUIRES_OK_ASYNC(ctx, KeyOf(ctx, &key), done);
    const Tensor& in = ctx->input(0);
    BufferView view;
    OP_REQUIRES_OK_ASYNC(ctx, ViewOf(in, &view), done);
    std::shared_ptr<kungfu::Engine> engine = EngineOrFail(ctx, done);
    if (!engine) return;
    const int size = engine->size();
    auto mine = std::make_shared<std::vector<int64_t>>(ShapeRecord(in));
    auto all = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(kRecordSize) * size);
    auto input = std::make_shared<Tensor>(in);
    auto on_shapes = [ctx, key, done = std::move(done), mine, all, input](const kungfu::Status& s) {
      RunOnWorkerPool(ctx, [ctx, key, done, all, input, s] {
        if (!s.ok()) {
          ctx->SetStatus(ToTfStatus(s));
          done();
          return;
        }
        GatherData(ctx, key, done, *all, input);
      });
    };
    engine->AllGather(mine->data(), all->data(), std::vector<int64_t>(size, kRecordSize), kungfu::DType::kInt64,
                      key, std::move(on_shapes));
  }

 private:
  // Second step, on a worker thread: validate the gathered records, allocate, gather the data.
  static void GatherData(OpKernelContext* ctx, const std::string& key, const DoneCallback& done,
                         const std::vector<int64_t>& all, const std::shared_ptr<Tensor>& input) {
    const int size = static_cast<int>(all.size() / kRecordSize);
    const int64_t* first = all.data();
    for (int r = 1; r < size; ++r) {
      const int64_t* rec = all.data() + r * kRecordSize;
      OP_REQUIRES_ASYNC(ctx, SameExceptDim0(first, rec),
                        absl::InvalidArgumentError(Describe("allgather", key) +
                                                   ": workers disagree on dtype or dimensions after the first: rank 0 "
                                                   "has " + RecordString(first) + ", rank " + std::to_string(r) +
                                                   " has " + RecordString(rec) + UnlistedHint(first, rec)),
                        done);
    }
    const int64_t row = RowElements(*input);
    int64_t rows = 0;
    std::vector<int64_t> counts(size);
    for (int r = 0; r < size; ++r) {
      rows += all[r * kRecordSize + kDim0];
      counts[r] = all[r * kRecordSize + kDim0] * row;
    }
    TensorShape shape = input->shape();
    if (shape.dims() == 0) {
      shape.AddDim(rows);
    } else {
      shape.set_dim(0, rows);
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, shape, &out), done);
    std::shared_ptr<kungfu::Engine> engine = EngineOrFail(ctx, done);
    if (!engine) return;
    BufferView view;
    OP_REQUIRES_OK_ASYNC(ctx, ViewOf(*input, &view), done);
    engine->AllGather(view.data, const_cast<char*>(out->tensor_data().data()), counts, view.dtype, key + "/data",
                      FinishKernel(ctx, done, nullptr, input));
  }

  // Elements per slice along the first dimension, also when this worker has no rows.
  static int64_t RowElements(const Tensor& t) {
    int64_t n = 1;
    for (int d = 1; d < t.dims(); ++d) n *= t.dim_size(d);
    return n;
  }
};

REGISTER_KERNEL_BUILDER(Name("KfBroadcast").Device(tensorflow::DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("KfAllGather").Device(tensorflow::DEVICE_CPU), AllGatherOp);

}  // namespace
}  // namespace kungfu_tf
