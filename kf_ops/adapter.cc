#include "kf_ops/adapter.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "cc/c_api.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/platform/threadpool.h"

namespace kungfu_tf {

// cc/tensor_meta.h names TF's DataType numbers without TF; they are protobuf enum values, fixed for good.
namespace tfd = kungfu::tf_dtype;
static_assert(tfd::kFloat == tensorflow::DT_FLOAT && tfd::kDouble == tensorflow::DT_DOUBLE &&
                  tfd::kInt32 == tensorflow::DT_INT32 && tfd::kUInt8 == tensorflow::DT_UINT8 &&
                  tfd::kInt8 == tensorflow::DT_INT8 && tfd::kInt64 == tensorflow::DT_INT64 &&
                  tfd::kBool == tensorflow::DT_BOOL && tfd::kBFloat16 == tensorflow::DT_BFLOAT16 &&
                  tfd::kHalf == tensorflow::DT_HALF,
              "cc/tensor_meta.h's tf_dtype numbers must be TensorFlow's DataType values");

absl::Status ToEngineDType(tensorflow::DataType dtype, kungfu::DType* out) {
  using kungfu::DType;
  switch (dtype) {
    case tensorflow::DT_HALF: *out = DType::kFloat16; return absl::OkStatus();
    case tensorflow::DT_BFLOAT16: *out = DType::kBFloat16; return absl::OkStatus();
    case tensorflow::DT_FLOAT: *out = DType::kFloat32; return absl::OkStatus();
    case tensorflow::DT_DOUBLE: *out = DType::kFloat64; return absl::OkStatus();
    case tensorflow::DT_INT32: *out = DType::kInt32; return absl::OkStatus();
    case tensorflow::DT_INT64: *out = DType::kInt64; return absl::OkStatus();
    case tensorflow::DT_UINT8:
    case tensorflow::DT_INT8:
    case tensorflow::DT_BOOL: *out = DType::kUInt8; return absl::OkStatus();
    default:
      return absl::InvalidArgumentError("kungfu does not support dtype " + tensorflow::DataTypeString(dtype));
  }
}

absl::Status ToTfStatus(const kungfu::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.code())), s.message());
}

absl::Status ViewOf(const Tensor& t, BufferView* out) {
  absl::Status s = ToEngineDType(t.dtype(), &out->dtype);
  if (!s.ok()) return s;
  out->data = const_cast<char*>(t.tensor_data().data());
  out->count = t.NumElements();
  return absl::OkStatus();
}

absl::Status KeyOf(OpKernelContext* ctx, std::string* key) {
  const Tensor& t = ctx->input(ctx->num_inputs() - 2);
  if (t.dtype() != tensorflow::DT_STRING || t.dims() != 0) {
    return absl::InvalidArgumentError("the collective key must be a scalar string, got " + t.DebugString());
  }
  *key = std::string(t.scalar<tensorflow::tstring>()());
  if (key->empty()) return absl::InvalidArgumentError("the collective key must not be empty");
  return absl::OkStatus();
}

std::shared_ptr<kungfu::Engine> EngineOrFail(OpKernelContext* ctx, const AsyncOpKernel::DoneCallback& done) {
  std::shared_ptr<kungfu::Engine> engine = kungfu::GlobalEngine();
  if (!engine) {
    ctx->SetStatus(absl::FailedPreconditionError(kungfu::NoEngineReason()));
    done();
  }
  return engine;
}

namespace {
// KUNGFU_KERNEL_HOP=1 always finishes kernels on TF's worker pool (the cautious, slower path).
bool AlwaysHop() {
  static const bool hop = [] {
    const char* v = std::getenv("KUNGFU_KERNEL_HOP");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return hop;
}
}  // namespace

void RunOnWorkerPool(OpKernelContext* ctx, std::function<void()> fn) {
  // Unless the executor runs every kernel inline, done() only hands the ready successors to TF's
  // runner (executor.cc, ScheduleReady with no inline queue) or notifies an eager caller, so it is
  // quick and safe on the engine's loop thread, and skipping the hop saves a thread wake-up per
  // collective (4 KiB chained in a tf.function, 2 workers: about 260 -> 100 us).
  if (!ctx->run_all_kernels_inline() && !AlwaysHop()) {
    fn();
    return;
  }
  const tensorflow::DeviceBase::CpuWorkerThreads* threads = ctx->device()->tensorflow_cpu_worker_threads();
  if (threads != nullptr && threads->workers != nullptr) {
    threads->workers->Schedule(std::move(fn));
  } else {
    fn();
  }
}

kungfu::DoneCallback FinishKernel(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done,
                                  std::function<absl::Status()> then, std::shared_ptr<void> keep) {
  return [ctx, done = std::move(done), then = std::move(then), keep = std::move(keep)](const kungfu::Status& s) {
    RunOnWorkerPool(ctx, [ctx, done, then, keep, s] {
      absl::Status status = ToTfStatus(s);
      if (status.ok() && then) status = then();
      if (!status.ok()) ctx->SetStatus(status);
      done();
    });
  };
}

CollectiveKernel::CollectiveKernel(tensorflow::OpKernelConstruction* c) : AsyncOpKernel(c) {
  OP_REQUIRES_OK(c, c->GetAttr("blocking", &blocking_));
}

void CollectiveKernel::ComputeAsync(OpKernelContext* ctx, DoneCallback done) {
  std::shared_ptr<kungfu::Engine> engine = blocking_ ? kungfu::GlobalEngine() : nullptr;
  if (!engine) return Start(ctx, std::move(done));  // without an engine, Start fails the kernel itself
  // 1: done() has run (what the wait is for); 2: the callback has let go of the engine too. done() may
  // run on TF's worker pool (RunOnWorkerPool), so this frame keeps engine alive until stage 2: a
  // concurrent kungfu.finalize() must not free it under the callback's WakeWaiters().
  auto stage = std::make_shared<std::atomic<int>>(0);
  kungfu::Engine* e = engine.get();
  DoneCallback wrapped = [done = std::move(done), stage, e] {
    done();
    stage->store(1);
    e->WakeWaiters();
    stage->store(2);
  };
  engine->RunAndWait([&] { Start(ctx, std::move(wrapped)); }, [stage] { return stage->load() >= 1; });
  while (stage->load() < 2) std::this_thread::yield();  // at most the few instructions above
}

std::string Describe(const char* what, const std::string& name) { return std::string(what) + " '" + name + "'"; }

uint32_t ShapeSignature(const tensorflow::TensorShape& shape) {
  const auto dims = shape.dim_sizes();  // int64_t each
  return kungfu::ShapeSignature(dims.data(), shape.dims());
}

}  // namespace kungfu_tf
