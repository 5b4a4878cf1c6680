"""Gradients of the collectives, as Horovod defines them, so that a tape differentiates through them.

Every worker runs the backward pass, each with the upstream gradient dy of its own loss; the gradient of
x on a worker is that of the sum of all workers' losses:
  - all_reduce (and group_all_reduce) with op sum or mean: all_reduce(dy) with the same op. min, max and
    prod have none (ValueError at tape.gradient);
  - broadcast: the sum of all workers' dy on the root, zeros elsewhere (every worker still takes part in
    that sum);
  - all_gather: this worker's rows of the sum of all workers' dy (the first dimensions are gathered too,
    to find them);
  - barrier and consensus have no gradient (their outputs are not differentiable).
A gradient's collectives are keyed by the forward collective's key with "/grad" (and "/grad/dims")
appended (and, for a further backward pass through it in one graph, "/2", "/3", ...), so they meet across
workers as the forward ones do: in order, per key.
"""

import numpy as np
import tensorflow as tf

from .. import _lib
from . import _naming

_GRAD_OPS = ("sum", "mean")


def _grad_key(op, suffix):
    """The key of a gradient's collective: the forward op's key (its second-to-last input) + suffix, a
    string where the key is known when the backward pass is built, else a string op. In a graph, a second
    backward pass through the same collective (two tape.gradient calls of a persistent tape in one
    tf.function) would run beside the first under the same key, so each further one in the function gets
    "/2", "/3", ... appended, counted in trace order, which every worker shares."""
    key = op.inputs[len(op.inputs) - 2]
    static = tf.get_static_value(key)
    eager = tf.executing_eagerly()
    if static is not None:
        if isinstance(static, np.ndarray):  # in a graph, a 0-d array of dtype object holding the bytes
            static = static.item()
        name = (static.decode() if isinstance(static, bytes) else str(static)) + suffix
        return name if eager else _naming.numbered(tf.compat.v1.get_default_graph(), name)
    if eager:
        return tf.strings.join([key, suffix])
    return tf.strings.join([key, suffix + "/" + tf.compat.v1.get_default_graph().unique_name("kungfu_grad")])


def _key_input(key, eager):
    return tf.constant(key) if eager and isinstance(key, str) else key


def _reduce(dys, op, key, group):
    eager = tf.executing_eagerly()
    token = _naming.token(eager)
    module = _lib.op_module()
    if group:
        return list(module.kf_group_all_reduce(dys, _key_input(key, eager), token, reduce_op=op, blocking=eager))
    return module.kf_all_reduce(dys, _key_input(key, eager), token, reduce_op=op, blocking=eager)


def _check_op(op, what):
    reduce_op = op.get_attr("reduce_op")
    reduce_op = reduce_op.decode() if isinstance(reduce_op, bytes) else reduce_op
    if reduce_op not in _GRAD_OPS:
        raise ValueError(f"{what} has a gradient for op sum and mean only, not {reduce_op!r} (wrap the call in "
                         "tf.stop_gradient, or write the gradient with tf.custom_gradient)")
    return reduce_op


def _all_reduce_grad(op, dy):
    reduce_op = _check_op(op, "kungfu.all_reduce")
    return [_reduce(dy, reduce_op, _grad_key(op, "/grad"), group=False), None, None]


def _group_all_reduce_grad(op, *dys):
    reduce_op = _check_op(op, "kungfu.group_all_reduce")
    dys = [tf.zeros_like(op.outputs[i]) if dy is None else dy for i, dy in enumerate(dys)]
    return _reduce(dys, reduce_op, _grad_key(op, "/grad"), group=True) + [None, None]  # key, token


def _broadcast_grad(op, dy):
    total = _reduce(dy, "sum", _grad_key(op, "/grad"), group=False)
    if _lib.rank() != op.get_attr("root"):
        total = tf.zeros_like(total)
    return [total, None, None]


def _all_gather_grad(op, dy):
    x = op.inputs[0]
    rows = tf.reshape(tf.shape(x, out_type=tf.int64)[:1], [1]) if x.shape.rank != 0 else tf.ones([1], tf.int64)
    eager = tf.executing_eagerly()
    module = _lib.op_module()
    everyone = module.kf_all_gather(rows, _key_input(_grad_key(op, "/grad/dims"), eager), _naming.token(eager),
                                    blocking=eager)
    total = _reduce(dy, "sum", _grad_key(op, "/grad"), group=False)
    start = tf.reduce_sum(everyone[:_lib.rank()])
    mine = total[start:start + rows[0]]
    return [tf.reshape(mine, tf.shape(x)), None, None]


_GRADIENTS = {
    "KfAllReduce": _all_reduce_grad,
    "KfGroupAllReduce": _group_all_reduce_grad,
    "KfBroadcast": _broadcast_grad,
    "KfAllGather": _all_gather_grad,
}


def register():
    """Registers the gradients with TensorFlow, once per process (a second call does nothing)."""
    for op_type, fn in _GRADIENTS.items():
        try:
            tf.RegisterGradient(op_type)(fn)
        except KeyError:  # registered already (the module was loaded again)
            pass
    for op_type in ("KfBarrier", "KfConsensus"):
        try:
            tf.no_gradient(op_type)
        except KeyError:
            pass
