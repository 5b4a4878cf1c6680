// Kernels of KfBarrier and KfConsensus.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cc/tensor_meta.h"
#include "kf_ops/adapter.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace kungfu_tf {
namespace {

using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;

class BarrierOp : public CollectiveKernel {
 public:
  explicit BarrierOp(OpKernelConstruction* c) : CollectiveKernel(c) {}

  void Start(OpKernelContext* ctx, DoneCallback done) override {
    std::string key;
    OP_REQUIRES_OK_ASYNC(ctx, KeyOf(ctx, &key), done);
    std::shared_ptr<kungfu::Engine> engine = EngineOrFail(ctx, done);
    if (!engine) return;
    engine->Barrier(key, FinishKernel(ctx, std::move(done)));
  }
};

class ConsensusOp : public CollectiveKernel {
 public:
  explicit ConsensusOp(OpKernelConstruction* c) : CollectiveKernel(c) {}

  void Start(OpKernelContext* ctx, DoneCallback done) override {
    std::string key;
    OP_REQUIRES_OK_ASYNC(ctx, KeyOf(ctx, &key), done);
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, TensorShape({}), &out), done);
    std::shared_ptr<kungfu::Engine> engine = EngineOrFail(ctx, done);
    if (!engine) return;
    const Tensor& in = ctx->input(0);
    const auto dims = in.shape().dim_sizes();
    auto bytes = std::make_shared<std::vector<char>>(
        kungfu::ConsensusBytes(in.dtype(), dims.data(), in.dims(), in.tensor_data().data(), in.TotalBytes()));
    bool* same = &out->scalar<bool>()();  // written by the engine before the callback
    *same = false;
    engine->Consensus(bytes->data(), static_cast<int64_t>(bytes->size()), same, key,
                      FinishKernel(ctx, std::move(done), nullptr, bytes));
  }
};

REGISTER_KERNEL_BUILDER(Name("KfBarrier").Device(tensorflow::DEVICE_CPU), BarrierOp);
REGISTER_KERNEL_BUILDER(Name("KfConsensus").Device(tensorflow::DEVICE_CPU), ConsensusOp);

}  // namespace
}  // namespace kungfu_tf
