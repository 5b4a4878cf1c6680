"""KungFu, started by its launcher: times kungfu.all_reduce called eagerly (the headline: what a user's code
pays; since 2026-11-28 it hands the tensor to the engine as DLPack instead of dispatching the TF op,
kungfu/ops/_direct.py) and, in the same processes, the engine's blocking C call through ctypes on numpy
buffers, so the gap between the two series is what TensorFlow and the Python wrapper add."""
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402

import harness  # noqa: E402
from engine_capi import EngineCollective  # noqa: E402

OP_SERIES = 'kungfu (eager all_reduce)'
ENGINE_SERIES = 'kungfu (engine)'


class OpCollective:
    """kungfu.all_reduce on a tf.constant, eagerly; it returns once the reduced tensor is ready.
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
        colls[ENGINE_SERIES] = EngineCollective(lib, kungfu.rank(), kungfu.size())
    elif kungfu.rank() == 0:
        print('kungfu._lib exposes no kungfu_all_reduce: engine series skipped', flush=True)
    # Size by size, op then engine: their ratio is the TF op's overhead, so both see the same moment's load.
    results = harness.measure_interleaved(colls, plan)
    harness.write_results(plan, kungfu.rank(), results)


if __name__ == '__main__':
    main()
