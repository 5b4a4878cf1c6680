"""The engine's C API (cc/c_api.h) through ctypes, for the workers that time the bare engine: worker_kungfu.py
(the library kungfu loaded, beside the TF op) and worker_engine.py (the library build_engine.sh compiled, with
neither TensorFlow nor kungfu). Both time the same EngineCollective, so their engine series differ only in
which build of the engine they load and in what else shares the process.

Imports numpy and nothing else beyond the standard library: worker_engine.py must run without TensorFlow.
"""
import ctypes

import numpy as np

INT32, FLOAT32, SUM = 2, 6, 1  # wire values from cc/dtype.h (DType::kInt32, DType::kFloat32, ReduceOp::kSum)
ERR_LEN = 1024
FINALIZE_NAME = b'kungfu/finalize'  # the barrier kungfu._lib.finalize runs: the same name in both


def declare(lib):
    """Sets the argument and result types of the C API functions the benchmark calls (as kungfu._lib does)."""
    lib.kungfu_init.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_double, ctypes.c_uint32,
                                ctypes.c_char_p, ctypes.c_int]
    lib.kungfu_init.restype = ctypes.c_int
    for fn in (lib.kungfu_rank, lib.kungfu_size, lib.kungfu_timed_out, lib.kungfu_finalize, lib.kungfu_leave):
        fn.argtypes = []
        fn.restype = ctypes.c_int
    lib.kungfu_finalizing.argtypes = []
    lib.kungfu_finalizing.restype = None
    lib.kungfu_all_reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    lib.kungfu_all_reduce.restype = ctypes.c_int
    return lib


def load(path):
    """The engine library at path, its functions declared."""
    return declare(ctypes.CDLL(path))


def init(lib, peers, rank, token):
    """Starts the engine and joins the cluster (peers "h:p,h:p,..." in rank order). The timeout is the engine's
    default unless KUNGFU_TIMEOUT is set, which the engine reads itself. Raises RuntimeError on failure."""
    err = ctypes.create_string_buffer(ERR_LEN)
    code = lib.kungfu_init(peers.encode(), rank, token.encode(), 0.0, 0, err, ERR_LEN)
    if code != 0:
        raise RuntimeError('kungfu_init (rank %d of %s): status %d: %s'
                           % (rank, peers, code, err.value.decode(errors='replace')))


def finalize(lib, clean):
    """Leaves the cluster as kungfu._lib.finalize does, so that no peer sees this exit as a failure: tell the
    peers that no other collective is coming (kungfu_finalizing), wait at the "kungfu/finalize" barrier until
    every worker is there, then say goodbye (kungfu_leave). Without a clean run, after a timed-out collective
    (a stalled peer would hold the barrier for a whole timeout) or when the barrier fails, it only stops the
    engine (kungfu_finalize). Returns '' or why the exit was not clean."""
    why = 'the benchmark failed' if not clean else ''
    if clean:
        lib.kungfu_finalizing()
        if lib.kungfu_timed_out():
            why = 'a collective of this worker timed out, so a peer has stalled'
        else:
            one, total = ctypes.c_int32(1), ctypes.c_int32(0)
            err = ctypes.create_string_buffer(ERR_LEN)
            if lib.kungfu_all_reduce(ctypes.byref(one), ctypes.byref(total), 1, INT32, SUM, FINALIZE_NAME, err,
                                     ERR_LEN):
                why = 'not every worker reached finalize: ' + err.value.decode(errors='replace')
    (lib.kungfu_finalize if why else lib.kungfu_leave)()
    return why


class EngineCollective:
    """The engine's blocking kungfu_all_reduce on numpy buffers (ctypes drops the GIL), as harness.measure_series
    wants it. The barrier and the agreement sum are tiny all-reduces; every collective has a fixed name, as a
    training step's gradient would."""

    def __init__(self, lib, rank, size):
        self.rank, self.size = rank, size
        self._fn = declare(lib).kungfu_all_reduce
        self._err = ctypes.create_string_buffer(ERR_LEN)
        self._scalar_in = np.ones(1, np.float32)
        self._scalar_out = np.empty(1, np.float32)
        self._barrier = self._caller(self._scalar_in, self._scalar_out, b'bench/engine-barrier')

    def _caller(self, x, y, name):
        """A call of the all-reduce x -> y under name, its arguments made once: numpy's x.ctypes costs about
        1.4 us a time and makes garbage for the collector, overhead that is the harness's, not the engine's.
        call.buffers keeps x and y alive."""
        fn, err, args = self._fn, self._err, (x.ctypes.data, y.ctypes.data, x.size, FLOAT32, SUM, name)

        def call():
            if fn(*args, err, ERR_LEN):
                raise RuntimeError('kungfu_all_reduce %s: %s' % (name.decode(), err.value.decode(errors='replace')))
        call.buffers = (x, y)
        return call

    def barrier(self):
        self._barrier()

    def sum_over_ranks(self, value):
        x = np.array([float(value)], np.float32)
        self._caller(x, self._scalar_out, b'bench/engine-agree')()
        return int(round(float(self._scalar_out[0])))

    def prepare(self, nbytes):
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        return self._caller(x, y, b'bench/engine/%d' % nbytes), (lambda: float(y[0]))
