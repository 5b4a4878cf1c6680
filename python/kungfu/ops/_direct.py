"""The eager collectives that go around TensorFlow's op dispatch.

Eagerly, a collective's kernel only hands its input to the engine and waits, yet dispatching it costs
most of an eager all_reduce's CPU time on few cores: on the 2-core VM a 4 KiB call took 35-55 us on one
worker, the engine's C call 3-7 us, and with more workers than cores every microsecond of it counts about
twice (README, Allreduce). So, when nothing watches eager ops (_naming.unobserved(): no GradientTape, no
op callback), kungfu.all_reduce, broadcast, all_gather and consensus hand the tensor to the engine
themselves, as DLPack:
  - tf.experimental.dlpack.to_dlpack lends the input's buffer (no copy; the capsule holds a reference);
  - a C call (kungfu_all_reduce_dlpack, kungfu_broadcast_dlpack, kungfu_all_gather_dlpack; cc/c_api.h) runs
    the collective, blocking, into a new 64-byte-aligned buffer, under the same key, dtype and shape checks
    as the kernel's (cc/tensor_meta.h), so eager calls on one worker meet graph or op calls of the same
    collective on another;
  - tf.experimental.dlpack.from_dlpack makes that buffer the result tensor (no copy; TF frees it).
The result is what the op returns: all_reduce and broadcast a new tensor of the input's dtype and shape,
all_gather the workers' tensors concatenated along the first dimension. consensus (kungfu_consensus_dlpack)
returns a scalar bool tensor, and kungfu.barrier, which has no tensor, calls kungfu_barrier. A failure
raises the tf.errors.OpError of the engine's status code with the engine's message, as the op does
(without the op's " [Op:KfAllReduce]" suffix). An input the C API does not take (not in host memory) runs
the op. Eager calls no longer show up as ops in TF's profiler. KUNGFU_EAGER_DIRECT=0 runs the ops always.
group_all_reduce keeps the op: its fusion into buckets lives in the kernel (kf_ops/fusion.cc).

The capsule calls go through ctypes.pythonapi with function types of this module's own (PYFUNCTYPE: they
hold the GIL), so other users of ctypes.pythonapi keep their declarations.
"""

import ctypes
import os
import threading

import tensorflow as tf

from .. import _lib

ENABLED = os.environ.get("KUNGFU_EAGER_DIRECT", "1").strip() != "0"
_REDUCE_CODES = {"sum": 1, "min": 2, "max": 3, "prod": 4, "mean": 5}  # cc/dtype.h ReduceOp wire values
_NOT_TAKEN = -1  # kungfu_all_reduce_dlpack: nothing started, run the op
_ERR_LEN = 4096
_CAPSULE = b"dltensor"  # the DLPack capsule's name, before a consumer renames it "used_dltensor"

_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_to_dlpack = tf.experimental.dlpack.to_dlpack
_from_dlpack = tf.experimental.dlpack.from_dlpack

# The tf.errors.OpError class of each status code, as TF raises it for a failed op.
_ERRORS = {
    tf.errors.CANCELLED: tf.errors.CancelledError,
    tf.errors.UNKNOWN: tf.errors.UnknownError,
    tf.errors.INVALID_ARGUMENT: tf.errors.InvalidArgumentError,
    tf.errors.DEADLINE_EXCEEDED: tf.errors.DeadlineExceededError,
    tf.errors.NOT_FOUND: tf.errors.NotFoundError,
    tf.errors.ALREADY_EXISTS: tf.errors.AlreadyExistsError,
    tf.errors.PERMISSION_DENIED: tf.errors.PermissionDeniedError,
    tf.errors.RESOURCE_EXHAUSTED: tf.errors.ResourceExhaustedError,
    tf.errors.FAILED_PRECONDITION: tf.errors.FailedPreconditionError,
    tf.errors.ABORTED: tf.errors.AbortedError,
    tf.errors.OUT_OF_RANGE: tf.errors.OutOfRangeError,
    tf.errors.UNIMPLEMENTED: tf.errors.UnimplementedError,
    tf.errors.INTERNAL: tf.errors.InternalError,
    tf.errors.UNAVAILABLE: tf.errors.UnavailableError,
    tf.errors.DATA_LOSS: tf.errors.DataLossError,
    tf.errors.UNAUTHENTICATED: tf.errors.UnauthenticatedError,
}

_local = threading.local()  # this thread's .buffers (error text, result pointer) and .same for the C calls


def _buffers():
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = (ctypes.create_string_buffer(_ERR_LEN), ctypes.c_void_p())
    return buffers


def _same():
    same = getattr(_local, "same", None)
    if same is None:
        same = _local.same = ctypes.c_int()
    return same


def _error(code, err):
    """The tf.errors.OpError a failed op with this status code (nonzero) and message would raise."""
    return _ERRORS.get(code, tf.errors.UnknownError)(None, None, err.value.decode(errors="replace"))


def _lend(x):
    """The DLManagedTensor pointer of a capsule lending x, and the capsule (keep it until the call is done),
    or (None, None) when DLPack cannot describe x: the op decides then."""
    try:
        capsule = _to_dlpack(x)
    except (tf.errors.OpError, TypeError, ValueError):
        return None, None
    return _capsule_pointer(capsule, _CAPSULE), capsule


def _result(code, out, err):
    """The tensor a DLPack call made (code 0), None when it took nothing (code -1), or raise its error."""
    if code == _NOT_TAKEN:
        return None
    if code != 0:
        raise _error(code, err)
    result = out.value
    try:
        return _from_dlpack(_new_capsule(result, _CAPSULE, None))
    except BaseException:  # TF did not take it: the capsule has no destructor, so free it here
        _lib.c_api().kungfu_dlpack_free(result)
        raise


def all_reduce(x, op, key):
    """kungfu.all_reduce of the eager tensor x (op: a checked reduce op name; key: the collective's key),
    or None, with nothing started, when the C API does not take x: the caller runs the op then."""
    pointer, capsule = _lend(x)
    if capsule is None:
        return None
    err, out = _buffers()
    return _result(_lib.c_api().kungfu_all_reduce_dlpack(pointer, _REDUCE_CODES[op], key.encode(), out, err,
                                                         _ERR_LEN), out, err)


def broadcast(x, root, key):
    """kungfu.broadcast of the eager tensor x from root (a checked rank), or None as all_reduce's."""
    pointer, capsule = _lend(x)
    if capsule is None:
        return None
    err, out = _buffers()
    return _result(_lib.c_api().kungfu_broadcast_dlpack(pointer, root, key.encode(), out, err, _ERR_LEN), out, err)


def all_gather(x, key):
    """kungfu.all_gather of the eager tensor x, or None as all_reduce's."""
    pointer, capsule = _lend(x)
    if capsule is None:
        return None
    err, out = _buffers()
    return _result(_lib.c_api().kungfu_all_gather_dlpack(pointer, key.encode(), out, err, _ERR_LEN), out, err)


_agreed = {}  # 0 and 1: consensus's results, made on first use (not at import: that would start TF's runtime)


def consensus(x, key):
    """kungfu.consensus of the eager tensor x (a scalar bool tensor), or None as all_reduce's."""
    pointer, capsule = _lend(x)
    if capsule is None:
        return None
    err, _ = _buffers()
    same = _same()
    code = _lib.c_api().kungfu_consensus_dlpack(pointer, key.encode(), same, err, _ERR_LEN)
    if code == _NOT_TAKEN:
        return None
    if code != 0:
        raise _error(code, err)
    result = _agreed.get(same.value)
    if result is None:  # eager tensors are immutable: every call may return the same one
        result = _agreed[same.value] = tf.constant(bool(same.value))
    return result


def barrier(key):
    """kungfu.barrier under key, eagerly: waits until every worker is there."""
    err, _ = _buffers()
    code = _lib.c_api().kungfu_barrier(key.encode(), err, _ERR_LEN)
    if code != 0:
        raise _error(code, err)
