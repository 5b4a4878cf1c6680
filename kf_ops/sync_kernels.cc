// Kernels of KfBarrier and KfConsensus.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

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

// The bytes compared across workers: dtype, rank and dimensions, then the tensor's data, so that
// equal bytes under different shapes or dtypes do not count as the same.
std::vector<char> ConsensusBytes(const Tensor& t) {
  std::vector<int64_t> header = {static_cast<int64_t>(t.dtype()), t.dims()};
  for (int d = 0; d < t.dims(); ++d) header.push_back(t.dim_size(d));
  const size_t head = header.size() * sizeof(int64_t);
  std::vector<char> bytes(head + t.TotalBytes());
  std::memcpy(bytes.data(), header.data(), head);
  if (t.TotalBytes() > 0) std::memcpy(bytes.data() + head, t.tensor_data().data(), t.TotalBytes());
  return bytes;
}

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
    auto bytes = std::make_shared<std::vector<char>>(ConsensusBytes(ctx->input(0)));
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
