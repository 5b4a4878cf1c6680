// Kernels of KfAllReduce and KfGroupAllReduce.
//
// Ownership: outputs are forwarded from inputs when TF allows it (the engine accepts in == out) and
// allocated otherwise. Whatever the engine reads or writes is held by the completion callback.
// A group completes when its last part does; the first error wins.
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "kf_ops/adapter.h"
#include "kf_ops/fusion.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace kungfu_tf {
namespace {

using tensorflow::OpKernelConstruction;

absl::Status ReduceOpAttr(OpKernelConstruction* c, kungfu::ReduceOp* op) {
  std::string s;
  TF_RETURN_IF_ERROR(c->GetAttr("reduce_op", &s));
  kungfu::StatusOr<kungfu::ReduceOp> parsed = kungfu::ParseReduceOp(s);
  if (!parsed.ok()) return ToTfStatus(parsed.status());
  *op = *parsed;
  return absl::OkStatus();
}

class AllReduceOp : public AsyncOpKernel {
 public:
  explicit AllReduceOp(OpKernelConstruction* c) : AsyncOpKernel(c) { OP_REQUIRES_OK(c, ReduceOpAttr(c, &op_)); }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::string key;
    OP_REQUIRES_OK_ASYNC(ctx, KeyOf(ctx, &key), done);
    const Tensor& in = ctx->input(0);
    BufferView view;
    OP_REQUIRES_OK_ASYNC(ctx, ViewOf(in, &view), done);
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({0}, 0, in.shape(), &out), done);
    std::shared_ptr<kungfu::Engine> engine = EngineOrFail(ctx, done);
    if (!engine) return;
    auto keep = std::make_shared<Tensor>(in);
    engine->AllReduce(view.data, const_cast<char*>(out->tensor_data().data()), view.count, view.dtype, op_, key,
                      FinishKernel(ctx, std::move(done), nullptr, keep), ShapeSignature(in.shape()));
  }

 private:
  kungfu::ReduceOp op_{};  // from the reduce_op attr
};

// Counts the parts of one group down to zero, then finishes the kernel once.
class GroupCompletion {
 public:
  GroupCompletion(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done, size_t parts)
      : ctx_(ctx), done_(std::move(done)), remaining_(parts) {}

  // Called on a worker thread once per part.
  void PartDone(const absl::Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!s.ok() && status_.ok()) status_ = s;
      if (--remaining_ > 0) return;
    }
    if (!status_.ok()) ctx_->SetStatus(status_);
    done_();
  }

 private:
  OpKernelContext* ctx_;
  AsyncOpKernel::DoneCallback done_;
  std::mutex mu_;
  absl::Status status_;  // first error of any part
  size_t remaining_;     // parts not finished yet
};

class GroupAllReduceOp : public AsyncOpKernel {
 public:
  explicit GroupAllReduceOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, ReduceOpAttr(c, &op_));
    OP_REQUIRES_OK(c, c->GetAttr("fusion_bytes", &fusion_bytes_));
  }

  // Parts are keyed "<key>/<index>" (a tensor alone) and "<key>/bucket<part>".
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::string key;
    OP_REQUIRES_OK_ASYNC(ctx, KeyOf(ctx, &key), done);
    const int n = ctx->num_inputs() - 2;  // the last two inputs are the key and the token
    std::vector<BufferView> ins(n);
    std::vector<Tensor*> outs(n);
    std::vector<int64_t> bytes(n), counts(n);
    std::vector<kungfu::DType> dtypes(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      OP_REQUIRES_OK_ASYNC(ctx, ViewOf(in, &ins[i]), done);
      OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({i}, i, in.shape(), &outs[i]), done);
      bytes[i] = static_cast<int64_t>(in.TotalBytes());
      counts[i] = ins[i].count;
      dtypes[i] = ins[i].dtype;
    }
    std::shared_ptr<kungfu::Engine> engine = EngineOrFail(ctx, done);
    if (!engine) return;
    if (n == 0) {
      done();
      return;
    }
    std::vector<FusionPart> plan = PlanFusion(bytes, counts, dtypes, fusion_bytes_);
    auto inputs = std::make_shared<std::vector<Tensor>>();
    for (int i = 0; i < n; ++i) inputs->push_back(ctx->input(i));
    auto group = std::make_shared<GroupCompletion>(ctx, std::move(done), plan.size());
    for (size_t p = 0; p < plan.size(); ++p) {
      const FusionPart& part = plan[p];
      if (!part.packed) {
        const int i = part.tensors[0];
        engine->AllReduce(ins[i].data, const_cast<char*>(outs[i]->tensor_data().data()), part.count, part.dtype, op_,
                          key + "/" + std::to_string(i), PartCallback(ctx, group, inputs, nullptr),
                          ShapeSignature(ctx->input(i).shape()));
      } else {
        StartBucket(ctx, engine.get(), part, key + "/bucket" + std::to_string(p), ins, outs, bytes, group, inputs);
      }
    }
  }

 private:
  // Packs the bucket's inputs, reduces in place, and unpacks into the outputs on completion.
  void StartBucket(OpKernelContext* ctx, kungfu::Engine* engine, const FusionPart& part, const std::string& name,
                   const std::vector<BufferView>& ins, const std::vector<Tensor*>& outs,
                   const std::vector<int64_t>& bytes, const std::shared_ptr<GroupCompletion>& group,
                   const std::shared_ptr<std::vector<Tensor>>& inputs) {
    int64_t total = 0;
    for (int i : part.tensors) total += bytes[i];
    auto buffer = std::make_shared<std::vector<char>>(static_cast<size_t>(total));
    std::vector<std::pair<char*, int64_t>> pieces;  // output and byte length, in bucket order
    int64_t offset = 0;
    uint32_t sig = 1;  // over the members' shapes, in order
    for (int i : part.tensors) {
      sig = CombineSignatures(sig, ShapeSignature(ctx->input(i).shape()));
      if (bytes[i] > 0) std::memcpy(buffer->data() + offset, ins[i].data, bytes[i]);
      pieces.emplace_back(const_cast<char*>(outs[i]->tensor_data().data()), bytes[i]);
      offset += bytes[i];
    }
    auto unpack = [buffer, pieces] {
      int64_t at = 0;
      for (const auto& [dst, len] : pieces) {
        if (len > 0) std::memcpy(dst, buffer->data() + at, len);
        at += len;
      }
    };
    engine->AllReduce(buffer->data(), buffer->data(), part.count, part.dtype, op_, name,
                      PartCallback(ctx, group, inputs, unpack), sig);
  }

  static kungfu::DoneCallback PartCallback(OpKernelContext* ctx, std::shared_ptr<GroupCompletion> group,
                                           std::shared_ptr<std::vector<Tensor>> inputs, std::function<void()> then) {
    return [ctx, group, inputs, then](const kungfu::Status& s) {
      RunOnWorkerPool(ctx, [group, s, then] {
        if (s.ok() && then) then();
        group->PartDone(ToTfStatus(s));
      });
    };
  }

  kungfu::ReduceOp op_{};    // from the reduce_op attr
  int64_t fusion_bytes_ = 0; // bucket capacity; tensors this large or larger go alone
};

REGISTER_KERNEL_BUILDER(Name("KfAllReduce").Device(tensorflow::DEVICE_CPU), AllReduceOp);
REGISTER_KERNEL_BUILDER(Name("KfGroupAllReduce").Device(tensorflow::DEVICE_CPU), GroupAllReduceOp);

}  // namespace
}  // namespace kungfu_tf
