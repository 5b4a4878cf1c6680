// Op definitions of the training monitors. Kernels in monitor_kernels.cc; formulas and the handling of
// non-finite and negative estimates in docs/monitoring.md ("Operators").
//
// These ops talk to no other worker: the caller feeds them norms it has already reduced. The GNS op
// keeps state (an EMA per monitor name, in a process-wide registry), so it is stateful: TF must neither
// fold, dedupe nor prune it, and the state survives retracing because it lives outside the kernel.
// The squared-norm ops are pure functions of their inputs: one kernel sums the squares of a whole
// list of tensors in one pass each, with no temporary tensor, which is what makes a monitored step
// cheap (the same sum as tf.square + tf.reduce_sum per tensor would cost a temporary the size of the
// model and a dozen ops).
// The monitor name of KfGradientNoiseScale is an attr: a monitor has one fixed name, so the eager
// kernel cache holds one kernel per monitor, not one per call.
#include "absl/status/status.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kungfu_tf {
namespace {

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

// Every input must be a scalar; every output is one.
absl::Status AllScalars(InferenceContext* c) {
  ShapeHandle unused;
  for (int i = 0; i < c->num_inputs(); ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->Scalar());
  return absl::OkStatus();
}

REGISTER_OP("KfGradientNoiseScale")
    .Input("g_small_sq: float")
    .Input("g_big_sq: float")
    .Input("b_small: float")
    .Input("b_big: float")
    .Output("gns: float")
    .Output("g_sq: float")
    .Output("trace: float")
    .Attr("key: string")
    .Attr("alpha: float = 0.1")
    .SetIsStateful()
    .SetShapeFn(AllScalars)
    .Doc(R"doc(Gradient noise scale B_simple = EMA(tr Sigma) / EMA(|G|^2) (McCandlish et al.) from the
squared gradient norm g_small_sq at batch b_small (one worker's gradient) and g_big_sq at b_big (the
all-reduced one):
  |G|^2    = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
  tr Sigma = (g_small_sq - g_big_sq) / (1/b_small - 1/b_big)
ema = (1 - alpha) * ema + alpha * x; the first finite estimate initialises it. The EMAs live in a
process-wide registry under `key`. Non-finite inputs or estimates leave the EMAs unchanged; negative
estimates are averaged in. gns is 0 ("no estimate yet") unless both EMAs are positive and the ratio is
finite. g_sq and trace are the EMAs (0 before the first estimate). Needs b_big > b_small > 0.)doc");

REGISTER_OP("KfMonitorRecord")
    .Input("small_sq: float")
    .Input("big_sq: float")
    .Input("spread_sq: float")
    .Input("b_small: float")
    .Input("b_big: float")
    .Input("snr_batch: float")
    .Input("valid: bool")
    .Output("values: float")
    .Attr("key: string")
    .Attr("alpha: float = 0.1")
    .Attr("gns: bool = true")
    .Attr("variance: bool = true")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      for (int i = 0; i < c->num_inputs(); ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      c->set_output(0, c->Vector(5));
      return absl::OkStatus();
    })
    .Doc(R"doc(A monitored step's bookkeeping in one op: [gns, g_sq, trace, snr, grad_variance].
With gns: KfGradientNoiseScale's EMAs under `key` from small_sq at b_small and big_sq at b_big, and
snr = g_sq * snr_batch / trace (0 unless both are positive). With variance: max(spread_sq - big_sq, 0),
spread_sq being the mean over workers of their squared norms. valid false leaves the EMAs and the
variance as they were. What the attrs leave out is 0. Needs b_big > b_small > 0 when gns is set.)doc");

REGISTER_OP("KfStepClock")
    .Input("samples: float")
    .Output("values: float")
    .Attr("key: string")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
      c->set_output(0, c->Vector(2));
      return absl::OkStatus();
    })
    .Doc(R"doc([step_time, samples_per_sec]: the seconds (steady clock) since the previous call with the
same key, and samples over them (0 when samples is 0). Both are 0 until a second call. The previous
call's time lives in the registry under `key`; KfResetMonitor forgets it.)doc");

REGISTER_OP("KfSquaredNorm")
    .Input("tensors: T")
    .Output("sq_norm: float")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(The sum of squares of every element of every input, as one float scalar. Each tensor is
summed in its own precision (float for half and bfloat16), the tensors' sums in double.)doc");

REGISTER_OP("KfConsecutiveSquaredNorms")
    .Input("grads: T")
    .Input("prev_grads: T")
    .Output("grad_sq: float")
    .Output("mean_sq: float")
    .Output("prev_sq: float")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() / 2;
      for (int i = 0; i < n; ++i) {
        ShapeHandle unused;
        TF_RETURN_IF_ERROR(c->Merge(c->input(i), c->input(n + i), &unused));
      }
      for (int i = 0; i < 3; ++i) c->set_output(i, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(For one worker's gradient noise scale from consecutive steps: |g|^2, |(g + p)/2|^2 and |p|^2
over the lists grads (g) and prev_grads (p), pairwise, which must have equal shapes.)doc");

REGISTER_OP("KfResetMonitor")
    .Input("key: string")
    .SetIsStateful()
    .SetShapeFn(AllScalars)
    .Doc("Forgets the state of the monitor named `key` (a no-op when it has none).");

}  // namespace
}  // namespace kungfu_tf
