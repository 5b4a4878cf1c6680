// Op definitions of the collectives. Kernels live in *_kernels.cc.
//
// Every op:
//  - is stateful: it talks to other workers, so TF must neither fold, dedupe nor prune it;
//  - is marked distributed communication: otherwise TF's executor rewrites an Unavailable or
//    Aborted status (peer gone, cluster changed) into Internal, hiding the recoverable cause;
//  - takes `key`, a scalar string: the name that matches this call with the same call on the other
//    workers. It is an input, not an attr: TF's eager runtime instantiates and caches one kernel per
//    distinct attr value, so a per-call attr cost ~1 ms and ~80 KB per eager call (measured);
//  - takes `token`, a resource input that only orders calls. TF's automatic control dependencies
//    chain stateful ops that take no resource in program order (so independent collectives in one
//    tf.function would run one after another) but order ops taking a resource only against other
//    users of the same resource tensor. The Python wrappers feed a fresh token per call, so
//    independent collectives are in flight together; a shared token orders the calls that use it;
//  - has `blocking`, which the Python wrappers set when they run eagerly: the caller waits for the
//    result anyway, so the kernel waits on its thread, driving the engine there (Engine::RunAndWait):
//    no thread wake-up on either side. In a graph it stays false: an executor thread must not block.
#include "absl/status/status.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kungfu_tf {

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

// The key is the second-to-last input, the token the last; both are scalars.
absl::Status CheckKeyAndToken(InferenceContext* c) {
  ShapeHandle unused;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - 2), 0, &unused));
  return c->WithRank(c->input(c->num_inputs() - 1), 0, &unused);
}

// Wraps a shape function with the key and token checks.
template <typename F>
auto WithKey(F f) {
  return [f](InferenceContext* c) -> absl::Status {
    TF_RETURN_IF_ERROR(CheckKeyAndToken(c));
    return f(c);
  };
}

// Element types a reduction is defined for.
#define KF_REDUCE_TYPES "{half, bfloat16, float, double, int32, int64}"
// Byte-moving collectives also carry these.
#define KF_COPY_TYPES "{half, bfloat16, float, double, int32, int64, uint8, int8, bool}"

REGISTER_OP("KfAllReduce")
    .Input("input: T")
    .Input("key: string")
    .Input("token: resource")
    .Output("output: T")
    .Attr("T: " KF_REDUCE_TYPES)
    .Attr("reduce_op: {'sum', 'mean', 'min', 'max', 'prod'}")
    .Attr("blocking: bool = false")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(WithKey(tensorflow::shape_inference::UnchangedShape))
    .Doc("output = reduce_op over workers of input, element-wise. 'mean' divides the sum by the cluster size.");

REGISTER_OP("KfGroupAllReduce")
    .Input("inputs: T")
    .Input("key: string")
    .Input("token: resource")
    .Output("outputs: T")
    .Attr("T: list(" KF_REDUCE_TYPES ")")
    .Attr("reduce_op: {'sum', 'mean', 'min', 'max', 'prod'}")
    .Attr("fusion_bytes: int = 4194304")
    .Attr("layout: int = 0")
    .Attr("blocking: bool = false")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(WithKey([](InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    }))
    .Doc(R"doc(All-reduces every tensor of the list. Tensors smaller than fusion_bytes are packed, per
dtype and in order, into buckets of at most fusion_bytes; each bucket and each larger tensor is one
engine all-reduce, all in flight together. layout, which every worker must pass alike, is checked with
the shapes and dtypes (InvalidArgument on every worker when it differs): the optimizers pass which of the
variables have gradients, so workers whose gradients of the same shapes belong to different variables fail
instead of averaging one variable's gradient with another's.)doc");

REGISTER_OP("KfGroupAllReduceNorms")
    .Input("inputs: T")
    .Input("norms: bool")
    .Input("key: string")
    .Input("token: resource")
    .Output("outputs: T")
    .Output("local_sq: float")
    .Output("reduced_sq: float")
    .Attr("T: list({half, bfloat16, float, double})")
    .Attr("reduce_op: {'sum', 'mean', 'min', 'max', 'prod'}")
    .Attr("fusion_bytes: int = 4194304")
    .Attr("layout: int = 0")
    .Attr("blocking: bool = false")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(WithKey([](InferenceContext* c) {
      const int n = c->num_inputs() - 3;
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(n), 0, &unused));
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(i));
      c->set_output(n, c->Scalar());
      c->set_output(n + 1, c->Scalar());
      return absl::OkStatus();
    }))
    .Doc(R"doc(KfGroupAllReduce of float tensors that also gives the squared norms a training monitor needs,
without passes over the data of their own: when norms is true, local_sq is the mean over the workers of
each worker's sum of squares of its inputs, and reduced_sq the sum of squares of the outputs; when it is
false both are 0 and no more is sent. The squares are summed in the copies into and out of the buckets; the
local sums ride as one more element of the last float32 or float64 bucket (sum and mean), else in an
all-reduce of one double of their own. norms must be the same on every worker; layout as KfGroupAllReduce's.)doc");

REGISTER_OP("KfBroadcast")
    .Input("input: T")
    .Input("key: string")
    .Input("token: resource")
    .Output("output: T")
    .Attr("T: " KF_COPY_TYPES)
    .Attr("root: int = 0")
    .Attr("blocking: bool = false")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(WithKey(tensorflow::shape_inference::UnchangedShape))
    .Doc("output = input of worker `root` on every worker.");

REGISTER_OP("KfAllGather")
    .Input("input: T")
    .Input("key: string")
    .Input("token: resource")
    .Output("output: T")
    .Attr("T: " KF_COPY_TYPES)
    .Attr("blocking: bool = false")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(WithKey([](InferenceContext* c) {
      ShapeHandle in = c->input(0);
      if (!c->RankKnown(in)) {
        c->set_output(0, c->UnknownShape());
        return absl::OkStatus();
      }
      if (c->Rank(in) == 0) {  // scalars are gathered as one-element vectors
        c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
        return absl::OkStatus();
      }
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    }))
    .Doc(R"doc(Concatenates every worker's input along the first dimension, in rank order. The first
dimension may differ between workers; the other dimensions and the dtype must agree.)doc");

REGISTER_OP("KfBarrier")
    .Input("key: string")
    .Input("token: resource")
    .Attr("blocking: bool = false")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(WithKey(tensorflow::shape_inference::NoOutputs))
    .Doc("Completes once every worker has reached the barrier of the same name.");

REGISTER_OP("KfConsensus")
    .Input("input: T")
    .Input("key: string")
    .Input("token: resource")
    .Output("same: bool")
    .Attr("T: " KF_COPY_TYPES)
    .Attr("blocking: bool = false")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(WithKey(tensorflow::shape_inference::ScalarShape))
    .Doc("same = whether every worker holds an input of the same dtype, shape and bytes.");

}  // namespace kungfu_tf
