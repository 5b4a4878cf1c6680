"""KungFu, started by its launcher: times kungfu.all_reduce as an eager TF op (the headline: what a user's
code pays) and, in the same processes, the engine's blocking C call through ctypes (no TF in the path), so
the gap between the two series is the TF op overhead."""
import ctypes
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402

import harness  # noqa: E402

OP_SERIES = 'kungfu (tf eager op)'
ENGINE_SERIES = 'kungfu (engine)'
FLOAT32, SUM = 6, 1  # wire values from cc/dtype.h (DType::kFloat32, ReduceOp::kSum)


class OpCollective:
    """kungfu.all_reduce on a tf.constant, eagerly; the op returns once the reduced tensor is ready.
    Each size has a fixed collective name, as a training step's gradient would."""

    def __init__(self):
        self.rank, self.size = kungfu.rank(), kungfu.size()

    def barrier(self):
        kungfu.barrier(name='bench/barrier')

    def sum_over_ranks(self, value):
        x = tf.constant([float(value)], tf.float32)
        return int(round(float(kungfu.all_reduce(x, op='sum', name='bench/agree')[0])))

    def prepare(self, nbytes):
        x = tf.ones([nbytes // 4], tf.float32)
        name = 'bench/op/%d' % nbytes
        last = [None]

        def run():
            last[0] = kungfu.all_reduce(x, op='sum', name=name)

        return run, (lambda: float(last[0][0]))


class EngineCollective:
    """The engine's blocking kungfu_all_reduce through ctypes, on numpy buffers (ctypes drops the GIL)."""

    def __init__(self, lib):
        self.rank, self.size = kungfu.rank(), kungfu.size()
        self._fn = lib.kungfu_all_reduce
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                             ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
        self._err = ctypes.create_string_buffer(1024)
        self._scalar_in = np.ones(1, np.float32)
        self._scalar_out = np.empty(1, np.float32)

    def _call(self, x, y, name):
        if self._fn(x.ctypes.data, y.ctypes.data, x.size, FLOAT32, SUM, name, self._err, len(self._err)):
            raise RuntimeError('kungfu_all_reduce %s: %s' % (name.decode(), self._err.value.decode()))

    def barrier(self):
        self._call(self._scalar_in, self._scalar_out, b'bench/engine-barrier')

    def sum_over_ranks(self, value):
        x = np.array([float(value)], np.float32)
        self._call(x, self._scalar_out, b'bench/engine-agree')
        return int(round(float(self._scalar_out[0])))

    def prepare(self, nbytes):
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        name = b'bench/engine/%d' % nbytes
        return (lambda: self._call(x, y, name)), (lambda: float(y[0]))


def _engine_library():
    """The engine's C API (the library kungfu.init() loaded), or None if it lacks the blocking call."""
    from kungfu import _lib
    c = _lib.load().c
    return c if hasattr(c, 'kungfu_all_reduce') else None


def main():
    plan = harness.load_plan()
    kungfu.init()
    colls = {OP_SERIES: OpCollective()}
    lib = _engine_library()
    if lib is not None:
        colls[ENGINE_SERIES] = EngineCollective(lib)
    elif kungfu.rank() == 0:
        print('kungfu._lib exposes no kungfu_all_reduce: engine series skipped', flush=True)
    # Size by size, op then engine: their ratio is the TF op's overhead, so both see the same moment's load.
    results = harness.measure_interleaved(colls, plan)
    harness.write_results(plan, kungfu.rank(), results)


if __name__ == '__main__':
    main()
