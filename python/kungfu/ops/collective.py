"""Collective operations: thin wrappers that validate, name and call the kf_ops.

All work eagerly and inside tf.function. `name` is the collective's key across workers; without one a
key is derived (see kungfu/ops/_naming.py and docs/api.md). Argument errors (a bad reduce op, dtype or
root) raise ValueError or TypeError here, before any op runs, and calling before kungfu.init() raises
kungfu.errors.NotInitializedError. A collective that fails while it runs raises the matching
tf.errors.OpError (InvalidArgumentError when workers disagree, UnavailableError when a peer is gone,
DeadlineExceededError on timeout); kungfu.errors.from_tf_error converts one.
"""

import numbers

import tensorflow as tf

from .. import _lib
from .._variables import DEFAULT_ROOT
from .._variables import root_alias
from . import _direct, _naming


class _DTypes(tuple):
    """The dtypes an op takes, in the order error messages list them. `in` looks a dtype up by identity
    first: TF interns its DType objects, and hashing one (a call into its C++ class) costs an eager
    collective several microseconds on a loaded core; by hash, not by one DType.__eq__ per entry, if
    that misses."""

    def __new__(cls, dtypes):
        self = super().__new__(cls, dtypes)
        self._set = frozenset(dtypes)
        self._ids = frozenset(map(id, dtypes))
        return self

    def __contains__(self, dtype):
        return id(dtype) in self._ids or dtype in self._set


REDUCE_OPS = ("sum", "mean", "min", "max", "prod")
REDUCE_DTYPES = _DTypes((tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64))
COPY_DTYPES = _DTypes(REDUCE_DTYPES + (tf.uint8, tf.int8, tf.bool))  # broadcast, all_gather, consensus

_no_autograph = _naming.no_autograph


def _direct_call():
    """Whether this call may go around TensorFlow's op dispatch (_direct.py): eager, with nothing watching."""
    return _direct.ENABLED and _naming.eager_unobserved()


def _reduce_op(op, what):
    if not isinstance(op, str) or op.lower() not in REDUCE_OPS:
        hint = ""
        if isinstance(op, str) and op.lower() in ("average", "avg"):
            hint = " (Horovod's Average is op=\"mean\" here; the default op is \"sum\")"
        raise ValueError(f"{what}: op must be one of {', '.join(REDUCE_OPS)}; got {op!r}{hint}")
    return op.lower()


def _tensor(x, dtypes, what):
    if not isinstance(x, tf.Tensor):
        x = tf.convert_to_tensor(x)
    if x.dtype not in dtypes:
        raise TypeError(f"{what}: dtype {x.dtype.name} is not supported; use one of "
                        f"{', '.join(d.name for d in dtypes)}")
    return x


@_no_autograph
def all_reduce(x, op="sum", name=None):
    """Reduces x element-wise over all workers; every worker gets the result.

    op: "sum", "mean" (sum / size(); integer dtypes truncate), "min", "max" or "prod".
    Every worker must pass the same dtype and number of elements.
    """
    fast = _direct.short()
    if fast is not None and type(op) is str:  # the short way (_direct.short)
        code = _direct.REDUCE_CODES.get(op)
        key = _naming.eager_key_bytes("all_reduce", name)
        if code is not None and key is not None:
            y = fast.all_reduce(x, code, key)
            if y is not None:
                return _direct.outcome(y)
    op = _reduce_op(op, "all_reduce")
    _lib.require_init("kungfu.all_reduce")
    x = _tensor(x, REDUCE_DTYPES, "all_reduce")
    if _direct_call():
        y = _direct.all_reduce(x, op, _naming.collective_key("all_reduce", name, True))
        if y is not None:
            return y
    key, token, eager = _naming.call_inputs("all_reduce", name)
    return _naming.ops(eager).kf_all_reduce(x, key, token, reduce_op=op, blocking=eager)


@_no_autograph
def group_all_reduce(xs, op="sum", name=None, fusion_bytes=None, _layout=0):
    """all_reduce of every tensor in the list xs, as one op; returns a list in the same order.

    Tensors smaller than fusion_bytes (default 4 MiB) are packed per dtype into buckets of at most
    that size, one network collective per bucket; larger tensors are reduced alone, in place. The
    buckets and the large tensors are all in flight together. Dtypes may differ within the list.

    _layout (internal): an int every worker passes alike, checked with the shapes (see _layout_extra).
    """
    op = _reduce_op(op, "group_all_reduce")
    _lib.require_init("kungfu.group_all_reduce")
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"group_all_reduce: xs must be a list or tuple of tensors, got {type(xs).__name__}")
    if fusion_bytes is not None and (not isinstance(fusion_bytes, int) or fusion_bytes < 0):
        raise ValueError(f"group_all_reduce: fusion_bytes must be an int >= 0, got {fusion_bytes!r}")
    xs = [_tensor(x, REDUCE_DTYPES, "group_all_reduce") for x in xs]
    key, token, eager = _naming.call_inputs("group_all_reduce", name)
    extra = _layout_extra(fusion_bytes, _layout)
    # An empty list still meets the other workers (as one empty tensor), so that a worker whose list is
    # empty while another's is not fails with the others instead of returning at once, which would pair
    # its next group with their current one.
    outs = _naming.ops(eager).kf_group_all_reduce(xs or [tf.zeros([0], tf.float32)], key, token, reduce_op=op,
                                                  blocking=eager, **extra)
    return list(outs) if xs else []


def _layout_extra(fusion_bytes, layout):
    """The group ops' optional attrs. layout: an int (any size; folded to 63 bits) that every worker must pass
    alike; the op checks it with the shapes and dtypes and fails with InvalidArgument on every worker when it
    differs. The optimizers pass which of their variables have gradients (_reduce.present_layout)."""
    extra = {} if fusion_bytes is None else {"fusion_bytes": fusion_bytes}
    if layout:
        extra["layout"] = int(layout) & ((1 << 63) - 1)
    return extra


NORM_DTYPES = _DTypes((tf.float16, tf.bfloat16, tf.float32, tf.float64))  # group_all_reduce_with_norms's


@_no_autograph
def group_all_reduce_with_norms(xs, norms=True, op="sum", name=None, fusion_bytes=None, _layout=0):
    """group_all_reduce of float tensors, plus the two squared norms a gradient monitor needs:
    (outputs, local_sq, reduced_sq).

    When norms (a bool or a bool scalar tensor, the same on every worker) is true, local_sq is the mean
    over the workers of each worker's sum of squares of its xs, and reduced_sq the sum of squares of the
    outputs, both float32 scalars; when it is false both are 0 and nothing more is sent. The squares
    are summed while the op packs and unpacks its buckets, which read the data anyway (tensors reduced
    alone are read once more). The workers' local sums travel as one more element of the last packed
    float32 or float64 bucket (with op sum or mean; otherwise as an all-reduce of one double of their own).
    _layout (internal): as group_all_reduce's.
    """
    op = _reduce_op(op, "group_all_reduce_with_norms")
    _lib.require_init("kungfu.group_all_reduce_with_norms")
    if not isinstance(xs, (list, tuple)) or not xs:
        raise TypeError(f"group_all_reduce_with_norms: xs must be a non-empty list or tuple of tensors, got {xs!r}")
    if fusion_bytes is not None and (not isinstance(fusion_bytes, int) or fusion_bytes < 0):
        raise ValueError(f"group_all_reduce_with_norms: fusion_bytes must be an int >= 0, got {fusion_bytes!r}")
    xs = [_tensor(x, NORM_DTYPES, "group_all_reduce_with_norms") for x in xs]
    norms = tf.convert_to_tensor(norms, tf.bool)
    key, token, eager = _naming.call_inputs("group_all_reduce", name)
    extra = _layout_extra(fusion_bytes, _layout)
    outs, local_sq, reduced_sq = _naming.ops(eager).kf_group_all_reduce_norms(xs, norms, key, token,
                                                                              reduce_op=op, blocking=eager,
                                                                              **extra)
    return list(outs), local_sq, reduced_sq


def check_root(root, what):
    """root as an int, a rank of this cluster; ValueError otherwise (a tensor too: the root is an attr of the
    op, fixed when it is built, as Horovod's root_rank is a Python int)."""
    size = _lib.size()
    if isinstance(root, bool) or not isinstance(root, numbers.Integral):
        kind = "a tensor" if tf.is_tensor(root) else type(root).__name__
        raise ValueError(f"{what}: root must be a Python int, a rank in [0, {size}), got {kind}: {root!r}")
    if not 0 <= root < size:
        raise ValueError(f"{what}: root must be a rank in [0, {size}), got {root!r}")
    return int(root)


@_no_autograph
def broadcast(x, root=DEFAULT_ROOT, name=None, *, root_rank=None):
    """Every worker gets root's x. Every worker must pass the same dtype and number of elements.

    root_rank= is Horovod's spelling of root= (hvd.broadcast(x, root_rank=0)).
    """
    fast = _direct.short()
    if fast is not None and root_rank is None and (type(root) is int or root is DEFAULT_ROOT) and \
            0 <= root < _lib.size():  # the short way (_direct.short)
        key = _naming.eager_key_bytes("broadcast", name)
        if key is not None:
            y = fast.broadcast(x, root, key)
            if y is not None:
                return _direct.outcome(y)
    _lib.require_init("kungfu.broadcast")
    root = check_root(root_alias(root, root_rank, "kungfu.broadcast"), "broadcast")
    x = _tensor(x, COPY_DTYPES, "broadcast")
    if _direct_call():
        y = _direct.broadcast(x, root, _naming.collective_key("broadcast", name, True))
        if y is not None:
            return y
    key, token, eager = _naming.call_inputs("broadcast", name)
    return _naming.ops(eager).kf_broadcast(x, key, token, root=root, blocking=eager)


@_no_autograph
def all_gather(x, name=None):
    """Concatenates every worker's x along the first dimension, in rank order.

    The first dimension may differ between workers; the other dimensions and the dtype must agree
    (otherwise every worker raises InvalidArgumentError). A scalar counts as a one-element vector,
    so gathering scalars gives a vector of size() elements.
    """
    fast = _direct.short()
    if fast is not None:  # the short way (_direct.short)
        key = _naming.eager_key_bytes("all_gather", name)
        if key is not None:
            y = fast.all_gather(x, key)
            if y is not None:
                return _direct.outcome(y)
    _lib.require_init("kungfu.all_gather")
    x = _tensor(x, COPY_DTYPES, "all_gather")
    if _direct_call():
        y = _direct.all_gather(x, _naming.collective_key("all_gather", name, True))
        if y is not None:
            return y
    key, token, eager = _naming.call_inputs("all_gather", name)
    return _naming.ops(eager).kf_all_gather(x, key, token, blocking=eager)


@_no_autograph
def barrier(name=None):
    """Waits until every worker has reached this barrier. Returns None eagerly, the op in a graph."""
    _lib.require_init("kungfu.barrier")
    if _direct_call():
        return _direct.barrier(_naming.collective_key("barrier", name, True))
    key, token, eager = _naming.call_inputs("barrier", name)
    return _naming.ops(eager).kf_barrier(key, token, blocking=eager)


@_no_autograph
def consensus(x, name=None):
    """A scalar bool tensor: whether every worker passed an x of the same dtype, shape and bytes."""
    _lib.require_init("kungfu.consensus")
    x = _tensor(x, COPY_DTYPES, "consensus")
    if _direct_call():
        y = _direct.consensus(x, _naming.collective_key("consensus", name, True))
        if y is not None:
            return y
    key, token, eager = _naming.call_inputs("consensus", name)
    return _naming.ops(eager).kf_consensus(x, key, token, blocking=eager)
