"""The eager collectives that go around TensorFlow's op dispatch.

Eagerly, a collective's kernel only hands its input to the engine and waits, yet dispatching it costs most of
an eager all_reduce's CPU time on few cores: on the 2-core VM a 4 KiB call took 35-55 us on one worker, the
engine's C call 3-7 us, and with more workers than cores every microsecond of it counts about twice
(benchmarks/results/allreduce_history.md). So, when nothing watches eager ops (_naming.eager_unobserved(): no
GradientTape, no op callback), kungfu.all_reduce, broadcast, all_gather and consensus hand the tensor to the
engine themselves, one of two ways:
  - the C way (kungfu.ops._eager, python/kungfu/ops/_eager.cc), the default: one call of that extension
    lends the EagerTensor's buffer to the C API (no copy), runs the collective with the GIL released and
    makes the engine's buffer the result tensor (no copy). It reaches the EagerTensor's handle through
    three private C++ functions of TF's Python bindings (see that file; _naming.py lists every TF
    internal the project relies on);
  - the DLPack way, where the extension cannot run (_eager_problem() says why; kungfu warns once, and
    tests/test_ops_eager.py fails), or with KUNGFU_EAGER_DIRECT=dlpack: tf.experimental.dlpack.to_dlpack lends
    the input's buffer (the capsule holds a reference), a ctypes call runs the collective, and
    tf.experimental.dlpack.from_dlpack makes the engine's buffer the result. On the 2-core VM, a 4 KiB
    all_reduce took 12-16 us this way against 6-8 the C way on one worker, and 219-271 against 190-225 us
    on 4 workers (each after a barrier, the slowest worker's median;
    benchmarks/results/allreduce_history.md).
Both call the C API's kungfu_all_reduce_dlpack, kungfu_broadcast_dlpack, kungfu_all_gather_dlpack and
kungfu_consensus_dlpack (cc/c_api.h), which run the collective, blocking, into a new 64-byte-aligned buffer,
under the same key, dtype and shape checks as the kernel's (cc/tensor_meta.h), so eager calls on one worker
meet graph or op calls of the same collective on another.
The result is what the op returns: all_reduce and broadcast a new tensor of the input's dtype and shape,
all_gather the workers' tensors concatenated along the first dimension. consensus returns a scalar bool
tensor, and kungfu.barrier, which has no tensor, calls kungfu_barrier. A failure raises the tf.errors.OpError
of the engine's status code with the engine's message, as the op does (without the op's " [Op:KfAllReduce]"
suffix). An input the C API does not take (not in host memory) runs the op. Eager calls no longer show up
as ops in TF's profiler. KUNGFU_EAGER_DIRECT=0 runs the ops always. group_all_reduce keeps the op: its fusion
into buckets lives in the kernel (kf_ops/fusion.cc).

The short way (short(), 2026-11-29): all_reduce, broadcast and all_gather first offer a call in its plain form
(an EagerTensor, a lower-case reduce op, a str name or none, an int root) to the C way, before the wrapper's
own checks, which then run only for what it does not take. On 4 workers sharing the 2-core VM every
microsecond of Python before the engine's call costs about ten of wall time (3.5 us of pure Python there
took a 4 KiB call from about 125 to 130-210 us); the short way skips about 2 of the wrapper's 3.5: blocks of
calls in turn in the same processes, the long way against the short one, 4 KiB, slowest worker's median,
the median block 169-171 against 156-159 us on 4 workers (the short way faster in 65 of 80 blocks), 30
against 26 us on 2 (29 of 30).

The DLPack way's capsule calls go through ctypes.pythonapi with function types of this module's own
(PYFUNCTYPE: they hold the GIL), so other users of ctypes.pythonapi keep their declarations.
"""

import ctypes
import os
import threading

import tensorflow as tf

from .. import _lib
from . import _naming

_MODE = os.environ.get("KUNGFU_EAGER_DIRECT", "1").strip().lower()
if _MODE not in ("0", "1", "dlpack"):
    raise ValueError(f"KUNGFU_EAGER_DIRECT must be 1 (the default), dlpack or 0; got {_MODE!r}")
ENABLED = _MODE != "0"
# Whether the C way is wanted (tests switch it to compare the two ways); the extension decides whether it runs.
USE_EXTENSION = _MODE == "1"
_PYWRAP_LIBRARY = "lib_pywrap_tensorflow_common.so"  # under TF's python/: where the C way's private functions live
REDUCE_CODES = {"sum": 1, "min": 2, "max": 3, "prod": 4, "mean": 5}  # cc/dtype.h ReduceOp wire values
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


def _error(code, message):
    """The tf.errors.OpError a failed op with this status code (nonzero) and message (bytes) would raise."""
    return _ERRORS.get(code, tf.errors.UnknownError)(None, None, message.decode(errors="replace"))


_extension = None  # kungfu.ops._eager once set up; None before the first call or where it cannot run
_extension_problem = None  # why the C way cannot run (a str), once looked at


def _eager_problem():
    """None when the C way (kungfu.ops._eager) runs here, else why not; looks once, on first use (it loads
    the library)."""
    global _extension, _extension_problem
    if _extension is None and _extension_problem is None:
        try:
            from . import _eager

            c = _lib.c_api()
            addresses = [ctypes.cast(fn, ctypes.c_void_p).value for fn in (
                c.kungfu_all_reduce_dlpack, c.kungfu_broadcast_dlpack, c.kungfu_all_gather_dlpack,
                c.kungfu_consensus_dlpack)]
            _eager.setup(*addresses, os.path.join(tf.sysconfig.get_lib(), "python", _PYWRAP_LIBRARY))
            _extension = _eager
        except (ImportError, RuntimeError, OSError) as e:
            _extension_problem = f"{type(e).__name__}: {e}"
            _lib._warn("kungfu: eager collectives take the slower DLPack way (kungfu/ops/_direct.py): %s",
                       _extension_problem)
    return _extension_problem


def _fast():
    """kungfu.ops._eager, set up, when eager calls take the C way; else None (the DLPack way)."""
    if _extension is not None:
        return _extension if USE_EXTENSION else None
    if not USE_EXTENSION or _eager_problem() is not None:
        return None
    return _extension


def short():
    """The C way's extension when an eager collective may take the short way now, else None: the C way is
    on and set up, kungfu.init() has run, and the call is eager with nothing watching. The wrappers in
    collective.py then hand their arguments to it before any check of their own, and go the long way
    (which checks, converts and names) when it takes nothing (None: not an EagerTensor in host memory, or a
    dtype the C API does not take) or when an argument is not in the form the short way takes. A 4 KiB
    all_reduce on one worker: 4.5-5 us against 6-7 the long way (the extension's call alone: 2.5-3). Each
    wrapper spells its few lines of the short way out: a shared helper (its call, getattr, *args) cost
    another 0.5 us, which on 4 workers sharing 2 cores is worth about 5 of wall time."""
    if not (ENABLED and USE_EXTENSION) or _extension is None or not _lib.initialized():
        return None
    return _extension if _naming.eager_unobserved() else None


def outcome(result):
    """What a call of kungfu.ops._eager returned, as the collective's result: a tensor (or bool), None (not
    taken: the caller runs the op), or the op's error raised for (code, message)."""
    if type(result) is tuple:
        raise _error(*result)
    return result


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
        raise _error(code, err.value)
    result = out.value
    try:
        return _from_dlpack(_new_capsule(result, _CAPSULE, None))
    except BaseException:  # TF did not take it: the capsule has no destructor, so free it here
        _lib.c_api().kungfu_dlpack_free(result)
        raise


def all_reduce(x, op, key):
    """kungfu.all_reduce of the eager tensor x (op: a checked reduce op name; key: the collective's key),
    or None, with nothing started, when the C API does not take x: the caller runs the op then."""
    fast = _fast()
    if fast is not None:
        return outcome(fast.all_reduce(x, REDUCE_CODES[op], key.encode()))
    pointer, capsule = _lend(x)
    if capsule is None:
        return None
    err, out = _buffers()
    return _result(_lib.c_api().kungfu_all_reduce_dlpack(pointer, REDUCE_CODES[op], key.encode(), out, err,
                                                         _ERR_LEN), out, err)


def broadcast(x, root, key):
    """kungfu.broadcast of the eager tensor x from root (a checked rank), or None as all_reduce's."""
    fast = _fast()
    if fast is not None:
        return outcome(fast.broadcast(x, root, key.encode()))
    pointer, capsule = _lend(x)
    if capsule is None:
        return None
    err, out = _buffers()
    return _result(_lib.c_api().kungfu_broadcast_dlpack(pointer, root, key.encode(), out, err, _ERR_LEN), out, err)


def all_gather(x, key):
    """kungfu.all_gather of the eager tensor x, or None as all_reduce's."""
    fast = _fast()
    if fast is not None:
        return outcome(fast.all_gather(x, key.encode()))
    pointer, capsule = _lend(x)
    if capsule is None:
        return None
    err, out = _buffers()
    return _result(_lib.c_api().kungfu_all_gather_dlpack(pointer, key.encode(), out, err, _ERR_LEN), out, err)


_agreed = {}  # False, True: consensus's results, made on first use (at import it would start TF's runtime)


def consensus(x, key):
    """kungfu.consensus of the eager tensor x (a scalar bool tensor), or None as all_reduce's."""
    fast = _fast()
    if fast is not None:
        same = outcome(fast.consensus(x, key.encode()))
        if same is None:
            return None
    else:
        pointer, capsule = _lend(x)
        if capsule is None:
            return None
        err, _ = _buffers()
        agreed = _same()
        code = _lib.c_api().kungfu_consensus_dlpack(pointer, key.encode(), agreed, err, _ERR_LEN)
        if code == _NOT_TAKEN:
            return None
        if code != 0:
            raise _error(code, err.value)
        same = bool(agreed.value)
    result = _agreed.get(same)
    if result is None:  # eager tensors are immutable: every call may return the same one
        result = _agreed[same] = tf.constant(same)
    return result


def barrier(key):
    """kungfu.barrier under key, eagerly: waits until every worker is there."""
    err, _ = _buffers()
    code = _lib.c_api().kungfu_barrier(key.encode(), err, _ERR_LEN)
    if code != 0:
        raise _error(code, err.value)
