// The one place where TensorFlow meets the engine: dtype, status and buffer conversions, and the
// completion path every collective kernel uses.
//
// Threading: engine callbacks run on the thread driving the engine's event loop (its own, or an eager
// kernel's caller: CollectiveKernel below) and must be quick (cc/engine.h, design note 5). done() is
// quick when the executor hands ready successors to its runner (the normal case) or notifies an eager
// caller, so kernels finish right there. When the executor runs every kernel inline
// (ctx->run_all_kernels_inline(), e.g. some tf.data functions), done() could run a successor on the
// loop thread, possibly one that waits on the engine: then the callback hops to the device's worker
// pool first. KUNGFU_KERNEL_HOP=1 forces the hop always. Either way the status is set and done()
// called exactly once.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "cc/dtype.h"
#include "cc/engine.h"
#include "cc/status.h"
#include "cc/tensor_meta.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"

namespace kungfu_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

// The engine dtype carrying a TF dtype. bool and int8 travel as uint8: only byte-moving collectives
// (broadcast, all-gather, consensus) accept them, which the op registrations enforce.
absl::Status ToEngineDType(tensorflow::DataType dtype, kungfu::DType* out);

// Codes are numerically identical (cc/status.h), so this keeps the code and the message.
absl::Status ToTfStatus(const kungfu::Status& s);

// A tensor seen as the engine sees it.
struct BufferView {
  void* data = nullptr;   // the tensor's first byte (null for an empty tensor is fine)
  int64_t count = 0;      // elements
  kungfu::DType dtype{};  // engine dtype
};
absl::Status ViewOf(const Tensor& t, BufferView* out);

// A nonzero hash of a shape (kungfu::ShapeSignature), carried in every frame so workers whose tensors have
// equal element counts but different shapes ([2,3] against [6]) fail with InvalidArgument.
uint32_t ShapeSignature(const tensorflow::TensorShape& shape);
// Combines signatures in order (a fused bucket's members).
using kungfu::CombineSignatures;

// The collective's key: the scalar string input before the token (the last input of every op).
absl::Status KeyOf(OpKernelContext* ctx, std::string* key);

// The process-wide engine, or null after failing the kernel with FailedPrecondition (done() called).
std::shared_ptr<kungfu::Engine> EngineOrFail(OpKernelContext* ctx, const AsyncOpKernel::DoneCallback& done);

// Runs fn where finishing the kernel is safe: here, or on the device's worker pool (see above).
void RunOnWorkerPool(OpKernelContext* ctx, std::function<void()> fn);

// An engine callback that finishes the kernel: on a worker thread, runs then() if the engine
// succeeded (it may copy results into outputs and return its own error), sets the kernel status
// and calls done().
// `keep` holds whatever the engine reads or writes until the callback runs (e.g. input tensors).
kungfu::DoneCallback FinishKernel(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done,
                                  std::function<absl::Status()> then = nullptr, std::shared_ptr<void> keep = nullptr);

// The base of the collective kernels. Start() hands the work to the engine and arranges for done() to
// be called once. With the op's `blocking` attr (the Python wrappers set it when they run eagerly, where
// the caller waits for the kernel anyway), ComputeAsync waits for that done() on the calling thread and
// drives the engine there meanwhile (Engine::RunAndWait), so neither the start nor the result needs a
// thread wake-up. Without it (in a graph, where an executor thread must never block) it returns at once.
class CollectiveKernel : public AsyncOpKernel {
 public:
  explicit CollectiveKernel(tensorflow::OpKernelConstruction* c);
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) final;

 protected:
  virtual void Start(OpKernelContext* ctx, DoneCallback done) = 0;
  // Start runs inside Engine::RunAndWait, whose caller drives the engine only once Start returns.
  bool blocking() const { return blocking_; }

 private:
  bool blocking_ = false;
};

// "allreduce 'grad/w'", the prefix of messages the kernels raise themselves.
std::string Describe(const char* what, const std::string& name);

}  // namespace kungfu_tf
