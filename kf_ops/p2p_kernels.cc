// Kernels of KfSaveVariable and KfRequestVariable.
//
// Save is synchronous: the engine copies the tensor into its store before Compute returns. Request
// forwards `default` to `value` when TF allows it (and departed_ok is off), so that the engine writes the
// fetched copy straight into the output and a "not found" leaves default's bytes there without a copy;
// otherwise the output is allocated and default is copied into it whenever nothing was found.
#include <cstring>
#include <memory>
#include <string>

#include "cc/c_api.h"
#include "kf_ops/adapter.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace kungfu_tf {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;

// The variable's name: input 0 of both ops (the collectives' KeyOf reads the input before the token).
absl::Status NameOf(OpKernelContext* ctx, const char* what, std::string* name) {
  const Tensor& t = ctx->input(0);
  if (t.dtype() != tensorflow::DT_STRING || t.dims() != 0) {
    return absl::InvalidArgumentError(std::string(what) + ": the key must be a scalar string, got " + t.DebugString());
  }
  *name = std::string(t.scalar<tensorflow::tstring>()());
  if (name->empty()) return absl::InvalidArgumentError(std::string(what) + ": the key must not be empty");
  return absl::OkStatus();
}

class SaveVariableOp : public OpKernel {
 public:
  explicit SaveVariableOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    std::string name;
    OP_REQUIRES_OK(ctx, NameOf(ctx, "save_variable", &name));
    const Tensor& t = ctx->input(1);
    BufferView view;
    OP_REQUIRES_OK(ctx, ViewOf(t, &view));
    std::shared_ptr<kungfu::Engine> engine = kungfu::GlobalEngine();
    OP_REQUIRES(ctx, engine != nullptr,
                absl::FailedPreconditionError(kungfu::NoEngineReason()));
    int64_t version = -1;
    kungfu::Status s = engine->Save(name, view.data, view.count, view.dtype, ShapeSignature(t.shape()), &version);
    OP_REQUIRES_OK(ctx, ToTfStatus(s));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = version;
  }
};

class RequestVariableOp : public AsyncOpKernel {
 public:
  explicit RequestVariableOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("departed_ok", &departed_ok_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::string name;
    OP_REQUIRES_OK_ASYNC(ctx, NameOf(ctx, "request_variable", &name), done);
    const Tensor& target_t = ctx->input(1);
    OP_REQUIRES_ASYNC(ctx, target_t.dims() == 0,
                      absl::InvalidArgumentError(Describe("request_variable", name) + ": target must be a scalar"),
                      done);
    const int target = target_t.scalar<int32_t>()();
    const Tensor& def = ctx->input(2);
    BufferView view;
    OP_REQUIRES_OK_ASYNC(ctx, ViewOf(def, &view), done);
    std::shared_ptr<kungfu::Engine> engine = EngineOrFail(ctx, done);
    if (!engine) return;
    OP_REQUIRES_ASYNC(ctx, target >= 0 && target < engine->size(),
                      absl::InvalidArgumentError(Describe("request_variable", name) + ": target " +
                                                 std::to_string(target) + " is not a rank of this cluster of size " +
                                                 std::to_string(engine->size())),
                      done);
    Tensor* value = nullptr;
    // With departed_ok a "none" may follow part of a copy (Engine::Request): the output then must not be
    // default's own buffer, so that default can be copied back whole.
    if (departed_ok_) {
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, def.shape(), &value), done);
    } else {
      OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({2}, 0, def.shape(), &value), done);
    }
    Tensor* version = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(1, TensorShape({}), &version), done);
    char* buf = const_cast<char*>(value->tensor_data().data());
    const bool forwarded = buf == view.data;
    engine->Request(target, name, buf, view.count, view.dtype, ShapeSignature(def.shape()),
                    Finish(ctx, std::move(done), value, version, forwarded), departed_ok_);
  }

 private:
  bool departed_ok_ = false;  // a target that has left answers "none" (Engine::Request)

  // Writes the version, fills value with default when nothing was found (unless it already is
  // default's buffer), names this worker's shape in a mismatch, and finishes the kernel.
  static kungfu::RequestCallback Finish(OpKernelContext* ctx, DoneCallback done, Tensor* value, Tensor* version,
                                        bool forwarded) {
    return [=](const kungfu::Status& s, int64_t v) {
      RunOnWorkerPool(ctx, [=] {
        absl::Status status = ToTfStatus(s);
        const Tensor& def = ctx->input(2);
        if (status.ok()) {
          version->scalar<int64_t>()() = v;
          if (v < 0 && !forwarded && def.TotalBytes() > 0) {
            std::memcpy(const_cast<char*>(value->tensor_data().data()), def.tensor_data().data(), def.TotalBytes());
          }
        } else if (s.code() == kungfu::Code::kInvalidArgument) {
          const std::string mine = tensorflow::DataTypeString(def.dtype()) + def.shape().DebugString();
          status = absl::InvalidArgumentError(s.message() + " (this worker's default: " + mine + ")");
        }
        if (!status.ok()) ctx->SetStatus(status);
        done();
      });
    };
  }
};

REGISTER_KERNEL_BUILDER(Name("KfSaveVariable").Device(tensorflow::DEVICE_CPU), SaveVariableOp);
REGISTER_KERNEL_BUILDER(Name("KfRequestVariable").Device(tensorflow::DEVICE_CPU), RequestVariableOp);

}  // namespace
}  // namespace kungfu_tf
