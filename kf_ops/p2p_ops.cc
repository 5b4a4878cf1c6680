// Op definitions of the peer-to-peer store (cc/p2p/): save a tensor in this worker's store, fetch
// another worker's latest saved copy. Kernels in p2p_kernels.cc.
//
// As for the collectives (collective_ops.cc): both ops are stateful, the name is a scalar string
// input (not an attr, which would cost a kernel per distinct name eagerly), and the last input is
// the ordering token, so independent calls in one tf.function are not serialized. The request is
// marked distributed communication so that TF keeps Unavailable (peer gone) as it is.
//
// Element types: those the engine carries as distinct types. int8 and bool would travel as uint8,
// and a request could then not tell a bool copy from a uint8 one.
#include <initializer_list>

#include "absl/status/status.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kungfu_tf {
namespace {

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

#define KF_P2P_TYPES "{half, bfloat16, float, double, int32, int64, uint8}"

// Every input listed must be a scalar.
absl::Status Scalars(InferenceContext* c, std::initializer_list<int> inputs) {
  ShapeHandle unused;
  for (int i : inputs) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  return absl::OkStatus();
}

REGISTER_OP("KfSaveVariable")
    .Input("key: string")
    .Input("tensor: T")
    .Input("token: resource")
    .Output("version: int64")
    .Attr("T: " KF_P2P_TYPES)
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(Scalars(c, {0, 2}));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(Copies tensor into this worker's peer-to-peer store under key, replacing the previous copy.
version: 0 for the first save of key in this process, then one more per save.)doc");

REGISTER_OP("KfRequestVariable")
    .Input("key: string")
    .Input("target: int32")
    .Input("default: T")
    .Input("token: resource")
    .Output("value: T")
    .Output("version: int64")
    .Attr("T: " KF_P2P_TYPES)
    .Attr("departed_ok: bool = false")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(Scalars(c, {0, 1, 3}));
      c->set_output(0, c->input(2));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(Fetches worker target's latest saved copy of key, without target's own ops taking part.
value: the copy (its dtype and shape must be default's), or default when target has saved nothing
under key. version: the copy's version, or -1 when there was none.
departed_ok: a target that has left the cluster (it finalized) answers as if it had saved nothing.)doc");

}  // namespace
}  // namespace kungfu_tf
