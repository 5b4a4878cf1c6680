// Kernels of KfAllReduce, KfGroupAllReduce and KfGroupAllReduceNorms.
//
// Ownership: outputs are forwarded from inputs when TF allows it (the engine accepts in == out) and
// allocated otherwise. Whatever the engine reads or writes is held by the completion callback.
// A group completes when its last part does; the first error wins.
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/buffer.h"
#include "kf_ops/adapter.h"
#include "kf_ops/fusion.h"
#include "kf_ops/squares.h"
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

class AllReduceOp : public CollectiveKernel {
 public:
  explicit AllReduceOp(OpKernelConstruction* c) : CollectiveKernel(c) { OP_REQUIRES_OK(c, ReduceOpAttr(c, &op_)); }

  void Start(OpKernelContext* ctx, DoneCallback done) override {
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

// Counts the parts of one group down to zero, then finishes the kernel once. With norms, it also
// sums the squares of the reduced values as the parts finish and writes the total to its output.
// When a part fails, the others can no longer all succeed (workers whose lists differ even key their
// parts differently, so some would wait for the timeout): they are cancelled here and at the peers.
class GroupCompletion {
 public:
  GroupCompletion(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done, size_t parts, Tensor* reduced_sq,
                  const std::shared_ptr<kungfu::Engine>& engine, std::vector<std::string> names)
      : ctx_(ctx), done_(std::move(done)), remaining_(parts), reduced_sq_(reduced_sq), engine_(engine),
        names_(std::move(names)) {}

  // Once every part has been handed to the engine (a cancel reaches only those).
  void SubmittedAll() {
    std::lock_guard<std::mutex> lock(mu_);
    submitted_all_ = true;
    if (!status_.ok()) CancelOthers();
  }

  // Called on a worker thread once per part, with the sum of squares of its reduced values (0 without norms).
  void PartDone(const absl::Status& s, double squares = 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!s.ok() && status_.ok()) {
        status_ = s;
        if (submitted_all_) CancelOthers();
      }
      squares_ += squares;
      if (--remaining_ > 0) return;
    }
    if (!status_.ok()) {
      ctx_->SetStatus(status_);
    } else if (reduced_sq_ != nullptr) {
      reduced_sq_->scalar<float>()() = static_cast<float>(squares_);
    }
    done_();
  }

 private:
  OpKernelContext* ctx_;
  AsyncOpKernel::DoneCallback done_;
  std::mutex mu_;
  absl::Status status_;  // first error of any part
  size_t remaining_;     // parts not finished yet
  double squares_ = 0;   // of the reduced values so far
  Tensor* reduced_sq_;   // KfGroupAllReduceNorms' output, or null
  std::weak_ptr<kungfu::Engine> engine_;  // weak: the engine's callbacks hold this object
  std::vector<std::string> names_;  // every part's collective name
  bool submitted_all_ = false;

  void CancelOthers() {  // mu_ held; status_ is the first error
    if (names_.size() < 2) return;
    const kungfu::Status why(static_cast<kungfu::Code>(static_cast<int>(status_.code())),
                             "another part of this group failed: " + std::string(status_.message()));
    std::shared_ptr<kungfu::Engine> engine = engine_.lock();
    if (!engine) return;
    for (const std::string& name : names_) engine->Cancel(name, why);
  }
};

// KfGroupAllReduce, and with norms KfGroupAllReduceNorms: the same collectives, plus the squared norms
// of the inputs (their mean over the workers, carried as one more element of the last packed float32 or
// float64 bucket, else by an all-reduce of one double of its own) and of the outputs. A bucket's squares
// are summed while it is packed and unpacked, which reads the data anyway; a tensor reduced alone is
// read once more for them.
class GroupAllReduceOp : public CollectiveKernel {
 public:
  GroupAllReduceOp(OpKernelConstruction* c, bool norms) : CollectiveKernel(c), norms_(norms) {
    OP_REQUIRES_OK(c, ReduceOpAttr(c, &op_));
    OP_REQUIRES_OK(c, c->GetAttr("fusion_bytes", &fusion_bytes_));
    OP_REQUIRES_OK(c, c->GetAttr("layout", &layout_));
  }
  explicit GroupAllReduceOp(OpKernelConstruction* c) : GroupAllReduceOp(c, false) {}

  // Parts are keyed "<key>/<part>", part indexing the fusion plan (a bucket of packed tensors or one
  // tensor alone); the inputs' squared norm, when no bucket carries it, "<key>/sq".
  void Start(OpKernelContext* ctx, DoneCallback done) override {
    std::string key;
    OP_REQUIRES_OK_ASYNC(ctx, KeyOf(ctx, &key), done);
    const int n = ctx->num_inputs() - (norms_ ? 3 : 2);  // then the norms flag, the key and the token
    const bool squares = norms_ && ctx->input(n).scalar<bool>()();
    std::vector<BufferView> ins(n);
    std::vector<Tensor*> outs(n);
    std::vector<int64_t> bytes(n), counts(n);
    std::vector<kungfu::DType> dtypes(n);
    OP_REQUIRES_OK_ASYNC(ctx, ViewInputs(ctx, n, &ins, &outs, &bytes, &counts, &dtypes), done);
    Tensor* local_sq = nullptr;
    Tensor* reduced_sq = nullptr;
    if (norms_) {
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(n, tensorflow::TensorShape({}), &local_sq), done);
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(n + 1, tensorflow::TensorShape({}), &reduced_sq), done);
      local_sq->scalar<float>()() = 0;
      reduced_sq->scalar<float>()() = 0;
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
    // With norms, this worker's sum of squares travels in the last packed float bucket, one element
    // more at its end, started after every other part has been summed; without such a bucket (or for
    // min, max and prod) it is an all-reduce of its own.
    const int carrier = squares ? Carrier(plan) : -1;
    // Parts are named by their place in the plan, whatever they hold, and every part's signature covers
    // the whole group: workers whose lists differ (in length, a dtype, a shape, the layout) then meet at part 0 at
    // least and fail there with InvalidArgument, which cancels the rest, instead of waiting out the timeout.
    std::vector<std::string> names;  // each part's collective name, as started below
    for (size_t p = 0; p < plan.size(); ++p) names.push_back(key + "/" + std::to_string(p));
    if (squares && carrier < 0) names.push_back(key + "/sq");
    const uint32_t group_sig = GroupSignature(ctx, dtypes);
    auto group = std::make_shared<GroupCompletion>(ctx, std::move(done), names.size(), squares ? reduced_sq : nullptr,
                                                   engine, names);
    double local = 0;  // this worker's sum of squares of the inputs
    for (size_t p = 0; p < plan.size(); ++p) {
      const FusionPart& part = plan[p];
      if (static_cast<int>(p) == carrier) continue;
      if (!part.packed) {
        const int i = part.tensors[0];
        char* out = const_cast<char*>(outs[i]->tensor_data().data());
        if (squares) local += SumSquares(ins[i].data, part.count, part.dtype);
        std::function<double()> then;
        if (squares) then = [out, count = part.count, dtype = part.dtype] { return SumSquares(out, count, dtype); };
        engine->AllReduce(ins[i].data, out, part.count, part.dtype, op_, names[p],
                          PartCallback(ctx, group, inputs, std::move(then)), group_sig);
      } else {
        local += StartBucket(ctx, engine.get(), part, names[p], group_sig, ins, outs, bytes, group, inputs, squares);
      }
      // Blocking, nothing runs the loop until this returns: let this part go out while the next is packed.
      if (blocking()) engine->Progress();
    }
    if (carrier >= 0) {
      StartBucket(ctx, engine.get(), plan[carrier], names[carrier], group_sig, ins, outs, bytes, group, inputs, squares,
                  &local, local_sq, engine->size());
    } else if (squares) {
      StartSquares(ctx, engine.get(), names.back(), local, local_sq, group);
    }
    group->SubmittedAll();
  }

 private:
  // The n inputs' views, and outputs (an input's buffer where TF lets it be reused), sizes and dtypes.
  static absl::Status ViewInputs(OpKernelContext* ctx, int n, std::vector<BufferView>* ins,
                                 std::vector<Tensor*>* outs, std::vector<int64_t>* bytes,
                                 std::vector<int64_t>* counts, std::vector<kungfu::DType>* dtypes) {
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      TF_RETURN_IF_ERROR(ViewOf(in, &(*ins)[i]));
      TF_RETURN_IF_ERROR(ctx->forward_input_or_allocate_output({i}, i, in.shape(), &(*outs)[i]));
      (*bytes)[i] = static_cast<int64_t>(in.TotalBytes());
      (*counts)[i] = (*ins)[i].count;
      (*dtypes)[i] = (*ins)[i].dtype;
    }
    return absl::OkStatus();
  }

  // The part whose buffer carries the inputs' squared norm: the last packed float32 or float64 bucket,
  // for sum and mean only; -1 when there is none (the norm is then an all-reduce of its own).
  int Carrier(const std::vector<FusionPart>& plan) const {
    if (op_ != kungfu::ReduceOp::kSum && op_ != kungfu::ReduceOp::kMean) return -1;
    for (int p = static_cast<int>(plan.size()) - 1; p >= 0; --p) {
      const kungfu::DType d = plan[p].dtype;
      if (plan[p].packed && (d == kungfu::DType::kFloat32 || d == kungfu::DType::kFloat64)) return p;
    }
    return -1;
  }

  // The signature every part carries: the whole group's length, fusion bytes, layout, dtypes and shapes.
  uint32_t GroupSignature(OpKernelContext* ctx, const std::vector<kungfu::DType>& dtypes) const {
    const int n = static_cast<int>(dtypes.size());
    uint32_t sig = CombineSignatures(static_cast<uint32_t>(n), static_cast<uint32_t>(fusion_bytes_));
    sig = CombineSignatures(sig, static_cast<uint32_t>(layout_));
    sig = CombineSignatures(sig, static_cast<uint32_t>(static_cast<uint64_t>(layout_) >> 32));
    for (int i = 0; i < n; ++i) {
      sig = CombineSignatures(sig, static_cast<uint32_t>(dtypes[i]));
      sig = CombineSignatures(sig, ShapeSignature(ctx->input(i).shape()));
    }
    return sig;
  }

  // Packs the bucket's inputs, reduces in place, and unpacks into the outputs on completion; with
  // squares, sums them in both copies and returns the inputs' sum. With carry (a float bucket, sum or
  // mean), *carry plus that sum rides as one more element at the end of the buffer, and its mean over
  // the workers (the sum divided by size for sum) lands in local_sq.
  double StartBucket(OpKernelContext* ctx, kungfu::Engine* engine, const FusionPart& part, const std::string& name,
                     uint32_t group_sig, const std::vector<BufferView>& ins, const std::vector<Tensor*>& outs,
                     const std::vector<int64_t>& bytes, const std::shared_ptr<GroupCompletion>& group,
                     const std::shared_ptr<std::vector<Tensor>>& inputs, bool squares, const double* carry = nullptr,
                     Tensor* local_sq = nullptr, int size = 1) {
    const size_t elem = kungfu::DTypeSize(part.dtype);
    int64_t total = carry != nullptr ? static_cast<int64_t>(elem) : 0;
    for (int i : part.tensors) total += bytes[i];
    // Cache-line aligned like TF's own buffers, so the kernel copies to and from sockets line up (cc/buffer.h).
    auto buffer = std::make_shared<kungfu::Buffer>(kungfu::NewBuffer(static_cast<size_t>(total)));
    std::vector<std::pair<char*, int64_t>> pieces;  // output and element count, in bucket order
    int64_t offset = 0;
    const uint32_t sig = group_sig;  // covers the members' shapes, and every other part's
    double local = 0;
    for (int i : part.tensors) {
      if (squares) {
        local += CopySumSquares(buffer->get() + offset, ins[i].data, ins[i].count, part.dtype);
      } else if (bytes[i] > 0) {
        std::memcpy(buffer->get() + offset, ins[i].data, bytes[i]);
      }
      pieces.emplace_back(const_cast<char*>(outs[i]->tensor_data().data()), ins[i].count);
      offset += bytes[i];
    }
    if (carry != nullptr) PutScalar(buffer->get() + offset, part.dtype, *carry + local);
    const bool mean = op_ == kungfu::ReduceOp::kMean;
    auto unpack = [buffer, pieces, elem, squares, dtype = part.dtype, carried = carry != nullptr, local_sq,
                   divisor = mean ? 1 : size] {
      double sum = 0;
      int64_t at = 0;
      for (const auto& [dst, count] : pieces) {
        if (squares) {
          sum += CopySumSquares(dst, buffer->get() + at, count, dtype);
        } else if (count > 0) {
          std::memcpy(dst, buffer->get() + at, count * elem);
        }
        at += count * elem;
      }
      if (carried) local_sq->scalar<float>()() = static_cast<float>(GetScalar(buffer->get() + at, dtype) / divisor);
      return sum;
    };
    engine->AllReduce(buffer->get(), buffer->get(), part.count + (carry != nullptr ? 1 : 0), part.dtype, op_, name,
                      PartCallback(ctx, group, inputs, unpack), sig);
    return local;
  }

  static void PutScalar(char* at, kungfu::DType dtype, double value) {
    if (dtype == kungfu::DType::kFloat64) {
      std::memcpy(at, &value, sizeof(value));
    } else {
      const float f = static_cast<float>(value);
      std::memcpy(at, &f, sizeof(f));
    }
  }

  static double GetScalar(const char* at, kungfu::DType dtype) {
    if (dtype == kungfu::DType::kFloat64) {
      double d;
      std::memcpy(&d, at, sizeof(d));
      return d;
    }
    float f;
    std::memcpy(&f, at, sizeof(f));
    return f;
  }

  // The mean over the workers of their inputs' sums of squares, into local_sq; counts as one part. (Its
  // signature is 1: every worker sends one double, and a group that differs fails at its part 0.)
  static void StartSquares(OpKernelContext* ctx, kungfu::Engine* engine, const std::string& name, double local,
                           Tensor* local_sq, const std::shared_ptr<GroupCompletion>& group) {
    auto value = std::make_shared<double>(local);
    engine->AllReduce(value.get(), value.get(), 1, kungfu::DType::kFloat64, kungfu::ReduceOp::kMean, name,
                      [ctx, group, value, local_sq](const kungfu::Status& s) {
                        RunOnWorkerPool(ctx, [group, s, value, local_sq] {
                          if (s.ok()) local_sq->scalar<float>()() = static_cast<float>(*value);
                          group->PartDone(ToTfStatus(s));
                        });
                      },
                      1);
  }

  // then() (optional) runs on success before the part counts as done; it returns the sum of squares
  // of the part's reduced values (0 when not asked for).
  static kungfu::DoneCallback PartCallback(OpKernelContext* ctx, std::shared_ptr<GroupCompletion> group,
                                           std::shared_ptr<std::vector<Tensor>> inputs,
                                           std::function<double()> then) {
    return [ctx, group, inputs, then](const kungfu::Status& s) {
      RunOnWorkerPool(ctx, [group, s, then] {
        const double squares = s.ok() && then ? then() : 0;
        group->PartDone(ToTfStatus(s), squares);
      });
    };
  }

  const bool norms_;           // KfGroupAllReduceNorms: the norms flag input and the two norm outputs
  kungfu::ReduceOp op_{};      // from the reduce_op attr
  int64_t fusion_bytes_ = 0;   // bucket capacity; tensors this large or larger go alone
  int64_t layout_ = 0;         // the caller's, checked like the shapes (the op's doc)
};

class GroupAllReduceNormsOp : public GroupAllReduceOp {
 public:
  explicit GroupAllReduceNormsOp(OpKernelConstruction* c) : GroupAllReduceOp(c, true) {}
};

REGISTER_KERNEL_BUILDER(Name("KfAllReduce").Device(tensorflow::DEVICE_CPU), AllReduceOp);
REGISTER_KERNEL_BUILDER(Name("KfGroupAllReduce").Device(tensorflow::DEVICE_CPU), GroupAllReduceOp);
REGISTER_KERNEL_BUILDER(Name("KfGroupAllReduceNorms").Device(tensorflow::DEVICE_CPU), GroupAllReduceNormsOp);

}  // namespace
}  // namespace kungfu_tf
