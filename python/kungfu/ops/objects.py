"""Collectives of Python objects: broadcast_object and all_gather_object (eager only).

An object travels pickled, as a uint8 tensor, after its length: one broadcast (or all-gather) of the
lengths, then one of the bytes, keyed "<key>/len" and "<key>/bytes". A worker that cannot pickle its
object sends the length -1 instead, so every worker raises rather than waiting for bytes that never
come; the worker at fault raises its own pickling error.

Unpickling runs code chosen by the sender. The senders are the job's own workers, which proved the
job token when they connected, so this trusts them no more than the job already does.
"""

import pickle

import numpy as np
import tensorflow as tf

from .. import _lib
from .. import errors
from .._variables import DEFAULT_ROOT
from .._variables import root_alias
from . import _naming
from .collective import _no_autograph
from .collective import all_gather
from .collective import broadcast
from .collective import check_root

_FAILED = -1  # the length a worker sends when it could not pickle its object


def _eager_only(what):
    if not tf.executing_eagerly():
        raise RuntimeError(f"{what} works eagerly only (it pickles Python objects); call it outside "
                           "tf.function, or use broadcast/all_gather on tensors inside one")
    _lib.require_init(what)


def _pickle(obj):
    """(bytes, None) or (None, the exception pickling raised)."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as e:  # noqa: BLE001 (any pickling failure is reported to every worker)
        return None, e


@_no_autograph
def broadcast_object(obj, root=DEFAULT_ROOT, name=None, *, root_rank=None):
    """Every worker gets root's obj, any picklable Python object (the others' obj is ignored).
    root_rank= is Horovod's spelling of root= (hvd.broadcast_object(obj, root_rank=0)).

    Eager only. name is the collective's key, derived like the tensor collectives' when None.
    If root cannot pickle obj, root raises that error and every other worker raises KungFuError.
    """
    root = root_alias(root, root_rank, "kungfu.broadcast_object")
    _eager_only("kungfu.broadcast_object")
    root = check_root(root, "broadcast_object")
    key = _naming.collective_key("broadcast_object", name)
    is_root = _lib.rank() == root
    data, error = _pickle(obj) if is_root else (b"", None)
    length = _FAILED if error is not None else len(data)
    length = int(broadcast(tf.constant([length], tf.int64), root=root, name=key + "/len").numpy()[0])
    if error is not None:
        raise error
    if length == _FAILED:
        raise errors.KungFuError(f"broadcast_object '{key}': the root (rank {root}) could not pickle its "
                                 "object; its own error says why")
    buf = np.frombuffer(data, np.uint8) if is_root else np.zeros(length, np.uint8)
    out = broadcast(tf.constant(buf), root=root, name=key + "/bytes")
    return obj if is_root else pickle.loads(out.numpy().tobytes())


@_no_autograph
def all_gather_object(obj, name=None):
    """A list of every worker's obj (any picklable Python object), in rank order, on every worker.

    Eager only. name is the collective's key, derived like the tensor collectives' when None. If a
    worker cannot pickle its obj, it raises that error and every other worker raises KungFuError
    naming the ranks at fault.
    """
    _eager_only("kungfu.all_gather_object")
    key = _naming.collective_key("all_gather_object", name)
    data, error = _pickle(obj)
    length = _FAILED if error is not None else len(data)
    lengths = all_gather(tf.constant([length], tf.int64), name=key + "/len").numpy().tolist()
    if error is not None:
        raise error
    failed = [r for r, n in enumerate(lengths) if n == _FAILED]
    if failed:
        raise errors.KungFuError(f"all_gather_object '{key}': rank(s) {', '.join(map(str, failed))} could not "
                                 "pickle their object; their own errors say why")
    gathered = all_gather(tf.constant(np.frombuffer(data, np.uint8)), name=key + "/bytes").numpy().tobytes()
    out, start = [], 0
    for n in lengths:
        out.append(pickle.loads(gathered[start:start + n]))
        start += n
    return out
