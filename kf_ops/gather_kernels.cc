// Kernels of KfBroadcast and KfAllGather.
//
// The all-gather's two steps (shape records under "<name>", then the data under "<name>/data") and
// the records are cc/tensor_meta.h's, shared with the C API's eager path.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cc/tensor_meta.h"
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
    const auto dims = in.shape().dim_sizes();
    engine->Broadcast(buf, view.count, view.dtype, root_, key, FinishKernel(ctx, std::move(done), nullptr, keep),
                      kungfu::BroadcastSignature(dims.data(), in.dims(), in.dtype()));
  }

 private:
  int root_ = 0;      // the rank whose input every worker receives
};

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
    const auto dims = in.shape().dim_sizes();
    auto mine = std::make_shared<std::vector<int64_t>>(kungfu::GatherRecord(in.dtype(), dims.data(), in.dims()));
    auto all = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(kungfu::kGatherRecordSize) * size);
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
    engine->AllGather(mine->data(), all->data(), std::vector<int64_t>(size, kungfu::kGatherRecordSize),
                      kungfu::DType::kInt64, key, std::move(on_shapes));
  }

 private:
  // Second step, on a worker thread: validate the gathered records, allocate, gather the data.
  static void GatherData(OpKernelContext* ctx, const std::string& key, const DoneCallback& done,
                         const std::vector<int64_t>& all, const std::shared_ptr<Tensor>& input) {
    int64_t rows = 0;
    std::vector<int64_t> counts;
    const auto dims = input->shape().dim_sizes();
    const int64_t row = kungfu::RowElements(dims.data(), input->dims());
    OP_REQUIRES_OK_ASYNC(ctx, ToTfStatus(kungfu::CheckGatherRecords(all, row, key, &counts, &rows)), done);
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
};

REGISTER_KERNEL_BUILDER(Name("KfBroadcast").Device(tensorflow::DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("KfAllGather").Device(tensorflow::DEVICE_CPU), AllGatherOp);

}  // namespace
}  // namespace kungfu_tf
