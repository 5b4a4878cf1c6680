"""The kungfu library and the process-wide engine behind kungfu.init().

One shared library, python/kungfu/_kungfu.so (or the file named by KUNGFU_LIBRARY), holds both the
TensorFlow ops and the engine's C API. It is loaded on first use, never at import:
  1. tf.load_op_library(path) first. TF learns which ops a library defines by watching the op
     registry while *it* loads the library; had ctypes loaded it first, the ops would already be
     registered and TF's generated Python wrappers would come out empty.
  2. ctypes.CDLL(path): dlopen of a path already loaded returns the same handle, so the C API here
     and the kernels share one engine (kungfu::GlobalEngine()).

Threading: a lock guards loading, init and finalize; the engine itself is thread-safe.
"""

import atexit
import ctypes
import logging
import os
import re
import sys
import threading

from . import errors

LIBRARY_ENV = "KUNGFU_LIBRARY"
_STATS_FIELDS = ("started", "completed", "failed", "in_flight", "max_in_flight", "bytes_sent", "bytes_received",
                 "refused_handshakes")  # the order of kungfu_stats() in cc/c_api.h
_ERR_LEN = 4096

_lock = threading.RLock()
_library = None  # _Library, once loaded
_cluster = None  # kungfu._env.ClusterSpec of the running engine; None when not initialized
_atexit_registered = False
_uncaught = False  # an exception reached sys.excepthook: finalize() then skips its barrier
_left = None  # the ClusterSpec this process left with finalize(), when it had peers: no way back in
_forked_from = None  # in a child forked from a worker after init(): the worker's pid (see _after_fork_in_child)
_owner_pid = None  # the pid of the process that ran init()
_DTYPE_INT32, _OP_SUM = 2, 1  # cc/dtype.h wire values
# How the engine refuses a bad KUNGFU_* setting at start (ApplyEnvOverrides in cc/engine_api.cc, the
# config checks in cc/engine.cc), as against a peer's handshake (another build, another cluster version).
_BAD_SETTING = re.compile(r"KUNGFU_[A-Z_]+(=| must)|chunk_bytes |timeout must")


class _Library:
    def __init__(self, path, ops, cdll):
        self.path = path  # the file both loaders opened
        self.ops = ops  # the module of generated op wrappers (kf_all_reduce, ...)
        self.c = cdll  # the C API, argument types declared


def library_path():
    """The shared library kungfu loads: $KUNGFU_LIBRARY, else _kungfu.so next to this file."""
    path = os.environ.get(LIBRARY_ENV)
    if path:
        return os.path.abspath(path)
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kungfu.so")


def _declare(c):
    i64p = ctypes.POINTER(ctypes.c_int64)
    c.kungfu_init.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_double, ctypes.c_uint32,
                              ctypes.c_char_p, ctypes.c_int]
    c.kungfu_init.restype = ctypes.c_int
    for fn in (c.kungfu_initialized, c.kungfu_rank, c.kungfu_size, c.kungfu_finalize, c.kungfu_leave,
               c.kungfu_timed_out):
        fn.argtypes = []
        fn.restype = ctypes.c_int
    c.kungfu_stats.argtypes = [i64p, ctypes.c_int]
    c.kungfu_stats.restype = ctypes.c_int
    c.kungfu_reset_stats.argtypes = []
    c.kungfu_reset_stats.restype = None
    c.kungfu_finalizing.argtypes = []
    c.kungfu_finalizing.restype = None
    c.kungfu_collective_stats.argtypes = [ctypes.c_int]
    c.kungfu_collective_stats.restype = ctypes.c_void_p  # malloc'ed text: read, then kungfu_free
    c.kungfu_free.argtypes = [ctypes.c_void_p]
    c.kungfu_free.restype = None
    c.kungfu_all_reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    c.kungfu_all_reduce.restype = ctypes.c_int
    c.kungfu_all_reduce_dlpack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p,
                                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_int]
    c.kungfu_all_reduce_dlpack.restype = ctypes.c_int
    c.kungfu_broadcast_dlpack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p,
                                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_int]
    c.kungfu_broadcast_dlpack.restype = ctypes.c_int
    c.kungfu_all_gather_dlpack.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                           ctypes.c_char_p, ctypes.c_int]
    c.kungfu_all_gather_dlpack.restype = ctypes.c_int
    c.kungfu_consensus_dlpack.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int),
                                          ctypes.c_char_p, ctypes.c_int]
    c.kungfu_consensus_dlpack.restype = ctypes.c_int
    c.kungfu_dlpack_free.argtypes = [ctypes.c_void_p]
    c.kungfu_dlpack_free.restype = None
    c.kungfu_barrier.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    c.kungfu_barrier.restype = ctypes.c_int


def load():
    """Loads the library once (see the module doc) and returns it."""
    global _library
    with _lock:
        if _library is None:
            path = library_path()
            if not os.path.exists(path):
                hint = (f"{LIBRARY_ENV} names a missing file" if os.environ.get(LIBRARY_ENV) else
                        "build it with `pip install --no-build-isolation .` or point KUNGFU_LIBRARY at a built one")
                raise errors.EngineError(f"kungfu library not found at {path}: {hint}")
            import tensorflow as tf  # only here: `import kungfu` must stay cheap

            ops = tf.load_op_library(path)
            cdll = ctypes.CDLL(path)
            _declare(cdll)
            from .ops import _gradients

            _gradients.register()  # with the ops: a SavedModel's loaded functions need them too
            _library = _Library(path, ops, cdll)
        return _library


def op_module():
    """The generated op wrappers (kf_all_reduce, kf_broadcast, ...)."""
    library = _library  # every eager collective comes here: once loaded, skip load()'s lock
    return (library or load()).ops


def c_api():
    """The engine's C API (ctypes), its functions declared."""
    library = _library  # the eager all_reduce comes here on every call: once loaded, skip load()'s lock
    return (library or load()).c


def init():
    """Starts this process's engine and connects it to the other workers. A second call does nothing.

    The cluster comes from the launcher's environment (kungfu._env.resolve_cluster): kfrun, mpirun,
    or nothing, which gives a single-worker cluster of size 1. Raises ValueError for a bad
    environment and a KungFuError (e.g. CollectiveTimeout when peers do not come up) if the engine
    cannot start.
    """
    global _cluster, _atexit_registered, _owner_pid
    from . import _bind
    from . import _env

    if _forked_from is not None:  # before the lock, which a thread gone at the fork may have held
        raise errors.EngineError(_forked_message("kungfu.init()"))
    with _lock:
        if _cluster is not None:
            return
        if _left is not None:
            raise errors.EngineError(
                f"kungfu.init: this process was rank {_left.rank} of {_left.size} and left that cluster with "
                "kungfu.finalize(); it cannot join again (its peers have said goodbye, or will): call finalize() "
                "once, when the worker is done")
        bind_to = _bind.check_mode(os.environ.get(_bind.ENV, "none"))
        # Under mpirun, resolve_cluster reserves this worker's engine port for the rendezvous; it stays
        # held while the library (and TensorFlow: seconds) loads, and is released just before the engine
        # binds it, so that no outgoing connection can take it in between.
        with _env.engine_port_held():
            cluster = _resolve_cluster()
            _bind.bind(bind_to, cluster.local_rank, cluster.local_size)  # before the engine starts its threads
            lib = load()
        err = ctypes.create_string_buffer(_ERR_LEN)
        code = lib.c.kungfu_init(",".join(cluster.peers).encode(), cluster.rank, cluster.token.encode(),
                                 float(cluster.timeout), cluster.version, err, _ERR_LEN)
        if code != 0:
            message = _init_error_message(code, cluster, err.value.decode(errors="replace"))
            if code == errors._INVALID_ARGUMENT and _BAD_SETTING.match(err.value.decode(errors="replace")):
                raise ValueError(message)  # a bad engine setting (KUNGFU_CHUNK_BYTES=0, say), no mismatch
            raise errors.from_code(code, message)
        _cluster = cluster
        _owner_pid = os.getpid()
        if not _atexit_registered:
            atexit.register(finalize)
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _note_uncaught_exceptions()
            _atexit_registered = True


def _after_fork_in_child():
    """A child forked from this worker (os.fork, multiprocessing's "fork" start method) shares the worker's
    connections but has none of the engine's threads: it must never run a collective or finalize (its
    atexit would say goodbye to the peers for the parent). The engine stays the parent's (cc/c_api.cc sets
    it aside in the child); here the Python state forgets it. Runs in the child only, with one thread:
    no lock is taken (one held at the fork would never be released)."""
    global _cluster, _forked_from
    if _cluster is not None:
        _forked_from = _owner_pid  # not os.getppid(): 1 once the worker has died
        _cluster = None


def _forked_message(what):
    return (f"{what}: this process (pid {os.getpid()}) was forked from KungFu worker pid {_forked_from} after "
            "kungfu.init(); a forked child cannot use its parent's engine or join the cluster itself: run "
            "collectives in the worker process, and pass results to and from child processes yourself")


# The fix for a taken engine port that init's error names, by launcher (ClusterSpec.launcher; a lone worker
# gets kfrun's): under mpirun the kernel picked the port and the worker held it until the engine bound it
# (_env), so only a rerun picks another. (What sets KUNGFU_TIMEOUT: _env.timeout_knob.)
_PORT_TAKEN_HINT = {
    "kfrun": "another job or program holds that port (two jobs started at once may pick the same ports): give "
             "this job other ports with `kfrun --port-range A-B`; or two names in -H/--hostfile lead to this one "
             "host, which then got one port twice: name each host once",
    "mpirun": "another program took the port this worker had reserved for its engine; start the job again",
}


def _resolve_cluster():
    """_env.resolve_cluster(), with its rendezvous failures (only mpirun has a rendezvous) as KungFuErrors."""
    from . import _env

    try:
        return _env.resolve_cluster()
    except TimeoutError as e:  # on every rank once rank 0's deadline has passed (kungfu._rendezvous)
        knob = _env.timeout_knob()
        hint = "" if knob in str(e) else f" (KUNGFU_TIMEOUT, set by {knob})"
        raise errors.CollectiveTimeout(f"kungfu.init: rendezvous timed out: {e}{hint}") from e
    except ConnectionError as e:  # refused by rank 0 (another job, another token) or cut off
        raise errors.PeerError(f"kungfu.init: rendezvous failed: {e}") from e
    except OSError as e:  # e.g. rank 0 cannot bind the rendezvous port
        raise errors.EngineError(f"kungfu.init: rendezvous failed: {e}") from e


def _init_error_message(code, cluster, text):
    """The message of init's error, with a hint at what fixes the usual causes under the job's launcher
    (errors.from_code then names what sets KUNGFU_TIMEOUT where the engine's text has "(KUNGFU_TIMEOUT)")."""
    from . import _env

    message = f"kungfu.init (rank {cluster.rank} of {cluster.size}): {text}"
    if "Address already in use" in text:
        message += "; " + _PORT_TAKEN_HINT["mpirun" if cluster.launcher == "mpirun" else "kfrun"]
    elif code == errors._DEADLINE_EXCEEDED and "KUNGFU_TIMEOUT" not in text:
        message += f" (the deadline is KUNGFU_TIMEOUT, set by {_env.timeout_knob()})"
    return message


def _note_uncaught_exceptions():
    previous = sys.excepthook

    def hook(*exc_info):
        global _uncaught
        _uncaught = True
        previous(*exc_info)

    sys.excepthook = hook


def finalize():
    """Leaves the cluster: waits until every worker has called finalize() (like MPI_Finalize), then
    for in-flight collectives, then stops the engine. Safe to call twice; init() registers it with
    atexit.

    The wait keeps this worker's engine serving its peers until all are done: pair averaging
    fetches models from peers' stores, and a worker that finished its steps first must not vanish
    under the others. It is bounded by the timeout (KUNGFU_TIMEOUT), ends at once when a peer has
    died, and is skipped when the process is exiting on an uncaught exception or when this worker's
    last collective to time out did so after its last one to complete (a stalled peer would hold the
    wait for another whole timeout). After it, the
    engine says goodbye to its peers, so one still finishing the wait does not take this worker's
    exit for a failure; without it (a failed or skipped wait), peers see a closed connection.
    """
    global _cluster, _left
    with _lock:
        if _cluster is None:
            return
        clean = _cluster.size > 1 and not _uncaught and _finalize_barrier()
        if _cluster.size > 1:
            _left = _cluster
        _cluster = None
        (_library.c.kungfu_leave if clean else _library.c.kungfu_finalize)()


def _finalize_barrier():
    """True when every worker reached finalize; logs a warning otherwise. Peers still waiting in a
    collective that this worker never started (it left its loop early) fail at once (kungfu_finalizing).
    After a collective of this worker timed out, a peer has stalled: it would hold the barrier for another
    whole KUNGFU_TIMEOUT, so the barrier is skipped and the worker leaves at once."""
    _library.c.kungfu_finalizing()
    if _library.c.kungfu_timed_out():
        _warn("kungfu.finalize: a collective of this worker timed out, so a peer has stalled; leaving without "
              "waiting for the others")
        return False
    one, total = ctypes.c_int32(1), ctypes.c_int32(0)
    err = ctypes.create_string_buffer(_ERR_LEN)
    code = _library.c.kungfu_all_reduce(ctypes.byref(one), ctypes.byref(total), 1, _DTYPE_INT32, _OP_SUM,
                                        b"kungfu/finalize", err, _ERR_LEN)
    if code != 0:
        _warn("kungfu.finalize: not every worker reached finalize (%s); leaving anyway",
              errors.with_timeout_hint(code, err.value.decode(errors="replace")))
    return code == 0


def _warn(msg, *args):
    """A warning on the "kungfu" logger that reads the same on every rank.

    Where no handler is configured, logging's last resort prints the bare message; where the root logger
    has one, it prints in that handler's format, "WARNING:kungfu:..." for logging.basicConfig()'s. Which of
    the two a rank gets is not up to the user: absl.logging calls basicConfig() on its first message, and
    TF and Keras log through absl on some ranks only (rank 0). So when no handler is
    configured, the warning is printed as basicConfig() would print it, without configuring anything: every
    rank says "WARNING:kungfu:...", and a program that configures logging gets its own format everywhere."""
    log = logging.getLogger("kungfu")
    if log.hasHandlers() or not log.isEnabledFor(logging.WARNING):
        log.warning(msg, *args, stacklevel=2)
        return
    path, line, func, _ = log.findCaller(stacklevel=2)
    record = log.makeRecord(log.name, logging.WARNING, path, line, msg, args, None, func)
    if log.filter(record):
        handler = logging.StreamHandler()  # sys.stderr as it is now, as the last resort writes to
        handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
        handler.handle(record)


def initialized():
    """Whether init() has run (and finalize() has not since): kungfu.is_initialized(), as in Horovod."""
    return _cluster is not None


def require_init(what="this"):
    """Raises NotInitializedError naming `what` unless init() has run."""
    if _cluster is None:
        if _forked_from is not None:
            raise errors.EngineError(_forked_message(what))
        raise errors.NotInitializedError(f"{what} needs kungfu.init() to be called first")


def rank():
    """This worker's rank in [0, size())."""
    require_init("kungfu.rank()")
    return _cluster.rank


def size():
    """The number of workers."""
    require_init("kungfu.size()")
    return _cluster.size


def local_rank():
    """This worker's index among the workers on its machine."""
    require_init("kungfu.local_rank()")
    return _cluster.local_rank


def local_size():
    """The number of workers on this machine."""
    require_init("kungfu.local_size()")
    return _cluster.local_size


def engine_stats():
    """The engine's counters as a dict (see EngineStats in cc/engine.h); for tests and benchmarks."""
    require_init("kungfu._lib.engine_stats()")
    values = (ctypes.c_int64 * len(_STATS_FIELDS))()
    n = _library.c.kungfu_stats(values, len(_STATS_FIELDS))
    return dict(zip(_STATS_FIELDS[:n], values[:n]))


def reset_engine_stats():
    """Zeroes the resettable counters, max_in_flight included, and forgets the per-collective ones."""
    require_init("kungfu._lib.reset_engine_stats()")
    _library.c.kungfu_reset_stats()


def collective_stats(reset=False):
    """The engine's per-collective counters (cc/collective_stats.h), {name: {"calls", "failed",
    "bytes_sent", "bytes_received", "total_ms", "last_ms", "max_ms"}}; reset empties them in the same
    step. kungfu.monitor.collective_stats() is the public reading."""
    import json

    require_init("kungfu.monitor.collective_stats()")
    p = _library.c.kungfu_collective_stats(1 if reset else 0)
    if not p:
        raise MemoryError("kungfu.monitor.collective_stats(): the library could not allocate the result")
    try:
        text = ctypes.string_at(p)
    finally:
        _library.c.kungfu_free(p)
    return json.loads(text.decode("utf-8", errors="replace"))
