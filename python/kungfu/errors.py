"""The exceptions kungfu raises, under one base class.

    KungFuError
    ├── NotInitializedError    kungfu.init() was not called (or finalize() was)       usage error
    ├── MismatchError          workers disagree on a collective (dtype, shape, count)   fatal: a program bug
    ├── PeerError              a peer failed, closed its connection or is unreachable   recoverable
    │   └── CollectiveTimeout  a collective or the start-up missed its deadline        recoverable
    ├── ClusterChangedError    peers under different cluster versions (see below)      recoverable
    ├── EngineError            anything else the engine reports                        fatal
    └── PolicyError            an adaptation policy raised, or asked for what it cannot  fatal

Recoverable errors mean "the cluster is not what it was": a caller that can rebuild it (today: restart
the job from a checkpoint) may carry on; `is_recoverable(exc)` tells which is which. Membership is fixed
for the life of a job in this version: nothing resizes a cluster, so ClusterChangedError only reports
workers started with different KUNGFU_CLUSTER_VERSION values (a misconfigured launch: init() raises it
when a peer refuses this worker's version at the handshake). It is reserved for resizing, which a later
version adds.

Where these are raised: kungfu raises them itself from Python (init(), rank() and the collective
wrappers' own checks). A collective that fails while it runs inside TensorFlow surfaces as the
matching `tf.errors.OpError` instead: InvalidArgumentError (mismatch), UnavailableError (peer gone),
DeadlineExceededError (timeout), AbortedError (cluster changed), FailedPreconditionError (not
initialized). TF owns that exception path; `from_tf_error(e)` converts one into the error above,
keeping its message, which names the collective and the peer.
"""

# Status codes as in cc/status.h (identical to TF's and absl's canonical codes).
_INVALID_ARGUMENT = 3
_DEADLINE_EXCEEDED = 4
_FAILED_PRECONDITION = 9
_ABORTED = 10
_UNAVAILABLE = 14


class KungFuError(Exception):
    """Base of every kungfu error. `code` is the engine status code when one is known (else None).

    The constructor is Exception's own, taking the message, in every subclass too (the ones that also
    derive from RuntimeError or ValueError included): TF's autograph rebuilds an error raised while a
    tf.function is traced only when its type's __init__ is Exception.__init__, and otherwise puts its
    StagingError in its place, so `except kungfu.errors.NotInitializedError` would miss it."""

    __init__ = Exception.__init__
    recoverable = False
    code = None


class NotInitializedError(KungFuError, RuntimeError):
    """kungfu.init() has not been called in this process, or kungfu.finalize() has."""


class MismatchError(KungFuError, ValueError):
    """Workers called the same collective with different dtypes, shapes or element counts."""


class PeerError(KungFuError):
    """A peer failed, closed its connection or could not be reached. The message names it."""

    recoverable = True


class CollectiveTimeout(PeerError):
    """A collective (or init's connection to the peers) did not finish within KUNGFU_TIMEOUT."""


class ClusterChangedError(KungFuError):
    """Work started under one cluster version met a message of another. Reserved for resizing, which a
    later version adds; membership is fixed for the life of a job now, so today it only means workers
    were started with different KUNGFU_CLUSTER_VERSION values (init() raises it at the handshake)."""

    recoverable = True


class EngineError(KungFuError):
    """An engine failure with no more specific class (bad configuration, internal error)."""


class PolicyError(KungFuError):
    """An adaptation policy raised in one of its hooks (on any worker: every worker raises it), or a
    decision cannot be applied (e.g. set_batch_size with no adaptive dataset). The message names the
    policy, the hook, the step and the rank; on the worker where the policy raised, __cause__ and
    .original are the original exception (None elsewhere). Keras's traceback filtering drops __cause__
    of an error raised through model.fit; .original stays."""

    original = None


_BY_CODE = {
    _INVALID_ARGUMENT: MismatchError,
    _DEADLINE_EXCEEDED: CollectiveTimeout,
    _FAILED_PRECONDITION: NotInitializedError,
    _ABORTED: ClusterChangedError,
    _UNAVAILABLE: PeerError,
}


def with_timeout_hint(code, message):
    """message, with the engine's "(KUNGFU_TIMEOUT)" in a timeout naming what sets it under this worker's
    launcher too (kfrun's flag, or mpirun's -x)."""
    from ._env import timeout_knob

    if code == _DEADLINE_EXCEEDED and "(KUNGFU_TIMEOUT)" in message:
        return message.replace("(KUNGFU_TIMEOUT)", f"(KUNGFU_TIMEOUT, set by {timeout_knob()})", 1)
    return message


def from_code(code, message):
    """The KungFuError for an engine status code (nonzero) and its message."""
    error = _BY_CODE.get(code, EngineError)(with_timeout_hint(code, message))
    error.code = code
    return error


def from_tf_error(error):
    """Converts a tf.errors.OpError raised by a kungfu collective into a KungFuError.

    Use it as `raise kungfu.errors.from_tf_error(e) from e`. Needs no TensorFlow import: it reads the
    error's `error_code` and `message`.
    """
    message = getattr(error, "message", None) or str(error)
    return from_code(getattr(error, "error_code", 2), message)


def is_recoverable(error):
    """Whether error (a KungFuError or a tf.errors.OpError from a collective) is a recoverable one."""
    if isinstance(error, KungFuError):
        return error.recoverable
    if hasattr(error, "error_code"):
        return from_tf_error(error).recoverable
    return False
