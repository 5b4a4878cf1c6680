"""Peer-to-peer: keep named tensors in this worker's store and fetch one peer's latest copy.

For pair averaging (AD-PSGD): each worker saves its model with save_variable after a step, and any
worker fetches one chosen peer's latest copy with request_variable. The peer's engine thread answers
from its store; the peer's own training step takes no part and is not slowed by a barrier.

- Names are the store's keys, the same on every worker; unlike collective names they are never
  derived, and one name may be saved and requested many times, even in one tf.function.
- A save copies the tensor: later changes to the variable do not reach the saved copy. Only the
  latest copy of each name is kept. Its version counts the saves of that name in this process from 0.
- A request gets one whole saved copy, never a mix of two saves. When the peer has saved nothing under
  the name it returns (default, -1). The copy must have default's dtype and shape, else
  tf.errors.InvalidArgumentError naming both sides; a peer that is gone gives tf.errors.UnavailableError
  at once, and no answer within KUNGFU_TIMEOUT gives tf.errors.DeadlineExceededError.
- Inside one tf.function, saves and requests are not ordered against each other (each takes a fresh
  ordering token, see _naming.py): to request what the same function just saved, add a control dependency.
"""

import numbers

import tensorflow as tf

from .. import _lib
from . import _naming

DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.uint8)
_MAX_NAME_BYTES = 4096  # cc/wire.h kMaxNameBytes
_MAX_EAGER_KEYS = 4096  # past this many distinct names the cache starts over

_no_autograph = _naming.no_autograph
_eager_keys = {}  # name -> its scalar string tensor, reused by eager calls (saves ~50 us per call)


def _key(name, what):
    if not isinstance(name, str) or not name or len(name.encode()) > _MAX_NAME_BYTES:
        raise ValueError(f"{what}: name must be a non-empty string of at most {_MAX_NAME_BYTES} bytes, got {name!r}")
    if not tf.executing_eagerly():
        _naming.refuse_xla(tf.compat.v1.get_default_graph(), what)
        return name
    t = _eager_keys.get(name)
    if t is None:
        if len(_eager_keys) >= _MAX_EAGER_KEYS:
            _eager_keys.clear()
        t = _eager_keys[name] = tf.constant(name)
    return t


def _tensor(x, what):
    x = tf.convert_to_tensor(x)
    if x.dtype not in DTYPES:
        raise TypeError(f"{what}: dtype {x.dtype.name} is not supported; use one of "
                        f"{', '.join(d.name for d in DTYPES)}")
    return x


def _target(target, what):
    """target as an int32 scalar: a Python int is checked against size() here, a tensor by the op."""
    if isinstance(target, bool):
        raise TypeError(f"{what}: target must be a rank (an int or an integer scalar tensor), got {target!r}")
    if isinstance(target, numbers.Integral):
        size = _lib.size()
        if not 0 <= target < size:
            raise ValueError(f"{what}: target must be a rank in [0, {size}), got {target!r}")
        return tf.constant(int(target), tf.int32)
    target = tf.convert_to_tensor(target)
    if not target.dtype.is_integer or target.shape.rank not in (None, 0):
        raise TypeError(f"{what}: target must be an integer scalar, got {target.dtype.name}{target.shape}")
    return tf.cast(target, tf.int32)


@_no_autograph
def save_variable(x, name):
    """Copies x into this worker's store under name; returns the copy's version, an int64 scalar tensor."""
    _lib.require_init("kungfu.ops.p2p.save_variable")
    key = _key(name, "save_variable")
    x = _tensor(x, "save_variable")
    return _lib.op_module().kf_save_variable(key, x, _naming.token())


@_no_autograph
def request_variable(target, default, name, departed_ok=False):
    """(value, version): worker target's latest saved copy of name and its version (int64 scalar).

    value has default's dtype and shape; it is default, and version -1, when target has saved nothing
    under name. target may be this worker's own rank (answered from its own store). departed_ok: a
    target that has left the cluster (it finalized) answers the same way instead of raising
    UnavailableError; a target that crashed still raises.
    """
    if not isinstance(departed_ok, bool):
        raise TypeError(f"request_variable: departed_ok must be True or False, got {departed_ok!r}")
    _lib.require_init("kungfu.ops.p2p.request_variable")
    key = _key(name, "request_variable")
    target = _target(target, "request_variable")
    default = _tensor(default, "request_variable")
    value, version = _lib.op_module().kf_request_variable(key, target, default, _naming.token(),
                                                          departed_ok=departed_ok)
    return value, version
