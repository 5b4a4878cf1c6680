"""What kungfu.rewrite assumes about the graphs TensorFlow and Keras trace (measured on TF 2.21, Keras 3.15).

Every assumption the rewrite makes about TensorFlow's or Keras's graphs, or about TensorFlow internals,
lives here, so that a TensorFlow or Keras upgrade that breaks one shows up in one place:
tests/test_rewrite.py::test_tf_conventions_hold traces a small Keras step and checks those an upgrade
could change (1, 2, 4, 5, 6, 7, 8, 9), naming the one that did.

  1. tf.GradientTape.gradient builds the backward pass under a name scope "gradient_tape" (a second tape
     in one graph gets "gradient_tape_1", a user's name scope may prefix it).
  2. Keras 3 optimizers update variables with AssignSubVariableOp / AssignAddVariableOp / AssignVariableOp
     and, for tf.IndexedSlices gradients, ResourceScatter*; TF 1-style optimizers use ResourceApply* and
     ResourceSparseApply*. The first input of each of these is the variable's resource handle.
  3. Keras passes dense gradients through an IdentityN (the replica context's "all_reduce" marker, a
     tf.custom_gradient identity), whose output k is its input k: walking back through it must follow
     output k to input k only, or every update would seem to depend on every gradient. (TF op semantics;
     the marker being there or not makes no difference to the rewrite.)
  4. An IndexedSlices gradient (e.g. of tf.gather on an embedding) leaves the tape as loose tensors:
     float values, integer indices and a dense shape that is a Const or a Shape op.
  5. In a ConcreteFunction, cf.inputs are the argument placeholders followed by one placeholder per
     captured tensor, in the order of cf.captured_inputs. (TF internal; public attributes, unpublished order.)
  6. Inside the body of a tf.function being traced, the default graph's `inputs` are, before anything is
     captured, the argument placeholders, in the order a function of the same signature uses. (TF internal.)
  7. When a variable is used more than once (a layer called twice), the tape sums its partial gradients
     with an AddN made outside the "gradient_tape" name scope, whose inputs all come from the backward pass;
     an IndexedSlices part among dense ones (an embedding also used as a tied output layer) is made dense
     first, by ops under the AddN's own name scope ("AddN/..."). IndexedSlices parts alone (one embedding
     looked up twice) are joined by two ConcatV2 ops outside the scope, of the values and of the indices.
  8. A tf.function keeps its reduce_retracing= in the attribute _reduce_retracing. (TF internal.)
  9. The backward pass of a nested tf.function (a forward pass, or part of it, in a tf.function of its
     own) is a call (PartitionedCall) of a function whose name holds "__backward_", made outside the
     "gradient_tape" name scope; its outputs are the gradients of the nested function's inputs and
     captured variables. (TF internal: concrete_function.py's _BACKWARD_PREFIX.)
"""

import re

import tensorflow as tf

GRADIENT_SCOPE = re.compile(r"(^|/)gradient_tape(_\d+)?/")

# Ops that write a variable through the resource handle that is their first input.
_WRITE_TYPES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
_WRITE_PREFIXES = ("ResourceScatter", "ResourceApply", "ResourceSparseApply")

# Ops whose output k is their input k (everything else: each output depends on every input).
PER_OUTPUT_OPS = frozenset({"IdentityN"})

# Ops through which the tensor of a resource handle passes unchanged.
HANDLE_PASSTHROUGH_OPS = frozenset({"Identity", "IdentityN"})

# Producers of integer tensors that describe shapes, not data: the dense shape of an IndexedSlices.
SHAPE_OPS = frozenset({"Const", "Shape", "ShapeN", "VariableShape", "Size"})

# Reductions: an update that depends on a gradient only through one of these (a global norm, a clip
# factor, a trust ratio) uses a statistic of that gradient, not the gradient itself.
REDUCTION_OPS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "L2Loss", "EuclideanNorm",
                           "ArgMax", "ArgMin"})

# KungFu's collectives that average or gather tensors: an update that takes its gradient through one of
# them belongs to a step that is distributed already (kf_ops/, the Kf<Verb><Noun> ops).
KUNGFU_COLLECTIVE_OPS = frozenset({"KfAllReduce", "KfGroupAllReduce", "KfGroupAllReduceNorms", "KfAllGather"})

# KungFu's collectives whose result is the same on every worker: a value that comes through one of them
# is no longer this worker's own (KfGroupAllReduceNorms is left out: its norms are each worker's own).
KUNGFU_SHARED_RESULT_OPS = frozenset({"KfAllReduce", "KfGroupAllReduce", "KfAllGather", "KfBroadcast",
                                      "KfConsensus"})

# Ops that run a graph of the function library: gradients or updates inside them are out of reach.
CALL_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
                      "PartitionedCall", "StatefulPartitionedCall"})


def in_gradient_scope(op_name):
    """Whether an op belongs to the backward pass a tf.GradientTape built."""
    return GRADIENT_SCOPE.search(op_name) is not None


def gradient_sum_ops(op, backward):
    """The ops by which the tape sums one variable's partial gradients (convention 7) ending at op: op
    itself, and for an AddN the ops under its name scope that made an IndexedSlices part dense; empty if
    op is no such sum. backward holds the names of the backward-pass ops seen so far. (A sum and a
    concatenation are linear, so averaging after them is averaging before them.)"""
    if op.type == "ConcatV2" and len(op.inputs) > 2:
        parts, axis = op.inputs[:-1], op.inputs[-1]
        joined = axis.op.type == "Const" and all(t.op.name in backward for t in parts)
        return [op] if joined else []
    if op.type != "AddN" or not op.inputs:
        return []
    prefix, helpers = op.name + "/", {}

    def from_backward(t):
        if t.op.name in backward:
            return True
        if not t.op.name.startswith(prefix):
            return False
        helpers[t.op.name] = t.op
        return all(from_backward(i) for i in t.op.inputs)

    return [op, *helpers.values()] if all(from_backward(t) for t in op.inputs) else []


_BACKWARD_FUNCTION = "__backward_"


def is_backward_call(op):
    """Whether op runs the backward pass TF made for a nested tf.function (convention 9)."""
    if op.type not in ("PartitionedCall", "StatefulPartitionedCall"):
        return False
    try:
        return _BACKWARD_FUNCTION in op.get_attr("f").name
    except ValueError:
        return False


def can_have_gradient(dtype):
    """Whether a tf.GradientTape can give a gradient for a variable of this dtype (float or complex)."""
    return dtype.is_floating or dtype.is_complex


def is_variable_write(op_type):
    """Whether an op of this type writes the variable whose handle is its first input."""
    return op_type in _WRITE_TYPES or op_type.startswith(_WRITE_PREFIXES)


def split_inputs(cf):
    """(argument placeholders, capture placeholders) of a ConcreteFunction: convention 5."""
    captured = list(cf.captured_inputs)
    inputs = list(cf.inputs)
    n_args = len(inputs) - len(captured)
    if n_args < 0 or any(i.dtype != c.dtype for i, c in zip(inputs[n_args:], captured)):
        raise RuntimeError("kungfu.rewrite: this TensorFlow orders a ConcreteFunction's inputs differently "
                           "(arguments, then captures); kungfu/_rewrite/_conventions.py needs updating")
    return inputs[:n_args], inputs[n_args:]


def traced_arguments():
    """The argument placeholders of the tf.function being traced now: convention 6. Call first thing."""
    return list(tf.compat.v1.get_default_graph().inputs)


def reduce_retracing(fn):
    """The reduce_retracing a tf.function was made with (convention 8; TF internal: no public accessor)."""
    return bool(getattr(fn, "_reduce_retracing", False))


def variable_name(variable):
    """A variable's name without the ':0' TF appends."""
    name = getattr(variable, "path", None) or variable.name
    return name[:-2] if name.endswith(":0") else name
