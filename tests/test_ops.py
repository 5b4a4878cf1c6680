"""The collective ops on one process (a cluster of size 1): values, shapes, dtypes and errors.

At size 1 every collective completes at once with this worker's own data, so these tests check the
op layer (registration, shape functions, kernels, wrappers, naming) rather than the network; the
multi-process behaviour is in test_collectives_mp.py, and the eager calls' way around TF's dispatch
(kungfu/ops/_direct.py) in test_ops_eager.py.
"""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

import kungfu
from kungfu import _lib
from kungfu import errors
from kungfu.ops import _direct
from ops_util import COPY_ONLY_DTYPES, REDUCE_DTYPES, REDUCE_OPS, sample

pytestmark = pytest.mark.usefixtures("kungfu_library")  # fails, naming the fix, when it is not built


class SizeOneTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        kungfu.init()

    def test_cluster(self):
        self.assertEqual((kungfu.rank(), kungfu.size(), kungfu.local_rank(), kungfu.local_size()), (0, 1, 0, 1))

    def test_eager_calls_block_and_graph_calls_do_not(self):
        """Eagerly the kernels wait on the calling thread, driving the engine there (the ops' `blocking`
        attr); in a graph they must not, or an executor thread would wait on the other workers."""
        module = _lib.op_module()
        ops = ["kf_all_reduce", "kf_group_all_reduce", "kf_group_all_reduce_norms", "kf_broadcast",
               "kf_all_gather", "kf_barrier", "kf_consensus"]
        seen = []
        originals = {name: getattr(module, name) for name in ops}

        def spy(name):
            def call(*args, **kwargs):
                seen.append((name, kwargs.get("blocking")))
                return originals[name](*args, **kwargs)
            return call

        def every_collective():
            x = tf.ones([3])
            kungfu.all_reduce(x)
            kungfu.group_all_reduce([x])
            kungfu.ops.group_all_reduce_with_norms([x])
            kungfu.broadcast(x)
            kungfu.all_gather(x)
            kungfu.barrier()
            return kungfu.consensus(x)

        try:
            for name in ops:
                setattr(module, name, spy(name))
            _direct.ENABLED = False  # eager collectives run the ops (else most go around them)
            try:
                every_collective()
            finally:
                _direct.ENABLED = True
            self.assertEqual(seen, [(name, True) for name in ops])
            seen.clear()
            every_collective()  # the same, but only the group ops go through TF's dispatch
            self.assertEqual(seen, [("kf_group_all_reduce", True), ("kf_group_all_reduce_norms", True)])
            seen.clear()
            graph = tf.function(every_collective).get_concrete_function().graph
            self.assertEqual(seen, [(name, False) for name in ops])
        finally:
            for name, fn in originals.items():
                setattr(module, name, fn)
        kinds = {"KfAllReduce", "KfGroupAllReduce", "KfGroupAllReduceNorms", "KfBroadcast", "KfAllGather",
                 "KfBarrier", "KfConsensus"}
        traced = [op for op in graph.get_operations() if op.type in kinds]
        self.assertEqual({op.type for op in traced}, kinds)
        self.assertTrue(all(op.get_attr("blocking") is False for op in traced))

    def test_all_reduce_every_dtype_op_and_size(self):
        for dtype in REDUCE_DTYPES:
            for op in REDUCE_OPS:
                for shape in [[0], [1], [7], [3, 5], [2, 0, 4]]:
                    x = sample(shape, dtype)
                    y = kungfu.all_reduce(x, op=op)
                    self.assertEqual(y.dtype, dtype)
                    self.assertAllEqual(y, x, msg=f"{dtype.name} {op} {shape}")

    def test_all_reduce_in_function_keeps_static_shape(self):
        @tf.function
        def f(x):
            y = kungfu.all_reduce(x, op="max")
            self.assertEqual(y.shape.as_list(), [None, 4])
            return y

        x = sample([3, 4], tf.float32)
        self.assertAllEqual(f.get_concrete_function(tf.TensorSpec([None, 4], tf.float32))(x), x)
        self.assertAllEqual(kungfu.all_reduce(tf.constant(2.5)), 2.5)  # scalar

    def test_group_all_reduce(self):
        xs = [sample([5], tf.float32), sample([3, 2], tf.int32), sample([0], tf.float16), sample([1000], tf.float32),
              sample([], tf.float64), sample([4], tf.bfloat16)]
        for fusion_bytes in [None, 0, 16, 1 << 30]:
            ys = kungfu.group_all_reduce(xs, op="sum", fusion_bytes=fusion_bytes)
            self.assertLen(ys, len(xs))
            for x, y in zip(xs, ys):
                self.assertEqual(y.dtype, x.dtype)
                self.assertAllEqual(y, x)
        self.assertEqual(kungfu.group_all_reduce([]), [])

        @tf.function
        def f(a, b):
            ys = kungfu.group_all_reduce([a, b], op="mean")
            self.assertEqual([y.shape.as_list() for y in ys], [[None], [2, 2]])
            return ys

        a, b = sample([6], tf.float32), sample([2, 2], tf.int64)
        ya, yb = f.get_concrete_function(tf.TensorSpec([None], tf.float32), tf.TensorSpec([2, 2], tf.int64))(a, b)
        self.assertAllEqual(ya, a)
        self.assertAllEqual(yb, b)

    def test_broadcast(self):
        for dtype in REDUCE_DTYPES + COPY_ONLY_DTYPES:
            for shape in [[0], [1], [7], [2, 3]]:
                x = sample(shape, dtype)
                self.assertAllEqual(kungfu.broadcast(x, root=0), x)

    def test_all_gather(self):
        for dtype in REDUCE_DTYPES + COPY_ONLY_DTYPES:
            for shape in [[0], [1], [7], [2, 3], [0, 3]]:
                x = sample(shape, dtype)
                y = kungfu.all_gather(x)
                self.assertEqual(y.dtype, dtype)
                self.assertAllEqual(y, x)
        self.assertAllEqual(kungfu.all_gather(tf.constant(4)), [4])  # a scalar gathers as one element

        @tf.function
        def f(x, s):
            y, z = kungfu.all_gather(x), kungfu.all_gather(s)
            self.assertEqual(y.shape.as_list(), [None, 3])
            self.assertEqual(z.shape.as_list(), [None])
            return y, z

        y, z = f(sample([2, 3], tf.float32), tf.constant(1.5))
        self.assertAllEqual(y, sample([2, 3], tf.float32))
        self.assertAllEqual(z, [1.5])

    def test_barrier_and_consensus(self):
        self.assertIsNone(kungfu.barrier())
        for dtype in REDUCE_DTYPES + COPY_ONLY_DTYPES:
            same = kungfu.consensus(sample([3], dtype))
            self.assertEqual(same.dtype, tf.bool)
            self.assertEqual(same.shape, [])
            self.assertTrue(bool(same))

        @tf.function
        def f(x):
            kungfu.barrier()
            return kungfu.consensus(x)

        self.assertTrue(bool(f(tf.constant([1, 2]))))

    def test_unused_collective_still_runs(self):
        @tf.function
        def f(x):
            kungfu.all_reduce(x)  # output unused
            kungfu.barrier()
            return tf.constant(0)

        _lib.reset_engine_stats()
        before = _lib.engine_stats()["started"]
        f(tf.ones([3]))
        self.assertEqual(_lib.engine_stats()["started"] - before, 2)

    def test_identical_calls_both_run(self):
        @tf.function
        def f(x):
            return kungfu.all_reduce(x) + kungfu.all_reduce(x)

        before = _lib.engine_stats()["started"]
        self.assertAllEqual(f(tf.ones([2])), [2.0, 2.0])
        self.assertEqual(_lib.engine_stats()["started"] - before, 2)

    def test_eager_calls_do_not_grow_memory(self):
        # Each eager call has a new key. Were the key an attr, TF would instantiate and cache one kernel per
        # call (measured: ~80 KB and ~1 ms each); as an input it costs nothing per key.
        def rss_mb():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        x = tf.ones([4])
        for _ in range(200):
            kungfu.all_reduce(x)
        before = rss_mb()
        for _ in range(2000):
            kungfu.all_reduce(x)
        self.assertLess(rss_mb() - before, 50, "2000 eager all_reduce calls grew the process by over 50 MB")

    def test_argument_errors(self):
        x = tf.ones([2])
        with self.assertRaisesRegex(ValueError, "op must be one of sum, mean, min, max, prod; got 'avg' "
                                                "\\(Horovod's Average is op=\"mean\" here"):
            kungfu.all_reduce(x, op="avg")
        with self.assertRaisesRegex(ValueError, "op must be one of"):
            kungfu.group_all_reduce([x], op=None)
        with self.assertRaisesRegex(TypeError, "dtype string is not supported"):
            kungfu.all_reduce(tf.constant(["a"]))
        with self.assertRaisesRegex(TypeError, "dtype bool is not supported"):
            kungfu.all_reduce(tf.constant([True]))
        with self.assertRaisesRegex(TypeError, "dtype complex64 is not supported"):
            kungfu.broadcast(tf.constant([1j], tf.complex64))
        with self.assertRaisesRegex(ValueError, r"root must be a rank in \[0, 1\), got 1"):
            kungfu.broadcast(x, root=1)
        with self.assertRaisesRegex(ValueError, r"root must be a Python int, a rank in \[0, 1\), got a tensor"):
            kungfu.broadcast(x, root=tf.constant(0))  # the message said "a rank in [0, 1)" of a 0
        with self.assertRaisesRegex(ValueError, "name must be a non-empty string"):
            kungfu.all_reduce(x, name="")
        with self.assertRaisesRegex(TypeError, "xs must be a list or tuple"):
            kungfu.group_all_reduce(x)

        @tf.function
        def twice(x):
            return kungfu.all_reduce(x, name="dup") + kungfu.all_reduce(x, name="dup")

        with self.assertRaisesRegex(ValueError, "name 'dup' is already used by another collective"):
            twice(x)

    def test_bad_reduce_op_fails_before_init_check(self):
        kungfu.finalize()
        try:
            with self.assertRaises(ValueError):
                kungfu.all_reduce([1.0], op="median")
        finally:
            kungfu.init()

    def test_not_initialized(self):
        @tf.function
        def f(x):
            return kungfu.all_reduce(x)

        x = tf.ones([2])
        f(x)  # traced while initialized
        self.assertTrue(kungfu.is_initialized())
        kungfu.finalize()
        kungfu.finalize()  # a second call is harmless
        self.assertFalse(kungfu.is_initialized())
        try:
            for call in [lambda: kungfu.all_reduce(x), lambda: kungfu.group_all_reduce([x]),
                         lambda: kungfu.broadcast(x), lambda: kungfu.all_gather(x), kungfu.barrier,
                         lambda: kungfu.consensus(x), kungfu.rank, kungfu.size, kungfu.local_rank,
                         kungfu.local_size, _lib.engine_stats]:
                with self.assertRaisesRegex(errors.NotInitializedError, r"needs kungfu.init\(\) to be called first"):
                    call()
            # A graph traced before finalize reaches the kernel, which fails cleanly.
            with self.assertRaisesRegex(tf.errors.FailedPreconditionError, r"call kungfu.init\(\) first"):
                f(x)

            @tf.function
            def traced_now(x):
                return kungfu.all_reduce(x)

            # Tracing one now raises the error of an eager call, not autograph's StagingError.
            with self.assertRaisesRegex(errors.NotInitializedError, r"needs kungfu.init\(\) to be called first"):
                traced_now(x)
        finally:
            kungfu.init()
        self.assertAllEqual(f(x), x)  # works again after a new init()
        kungfu.init()  # a second init is a no-op


def test_import_is_lazy():
    code = ("import sys, threading, kungfu, kungfu.errors\n"
            "assert 'tensorflow' not in sys.modules, 'import kungfu imported tensorflow'\n"
            "assert kungfu._lib._library is None, 'import kungfu loaded the library'\n"
            "assert threading.active_count() == 1, threading.enumerate()\n"
            "assert not kungfu.is_initialized()\n"
            "names = dir(kungfu)  # tab completion: the lazy API is listed, nothing is imported for it\n"
            "assert {'all_reduce', 'DistributedGradientTape', 'keras', 'init'} <= set(names), names\n"
            "assert not {'os', 'importlib'} & set(names), names\n"
            "assert 'tensorflow' not in sys.modules, 'dir(kungfu) imported tensorflow'\n"
            "print('lazy')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lazy"


def test_first_collective_in_a_later_trace():
    # In a fresh process, so that no earlier collective has run: a function traced first without a
    # collective (a Python branch) and then with one. A token variable created at the first collective's
    # trace was refused there ("Creating variables on a non-first call to a function").
    code = ("import tensorflow as tf, kungfu\n"
            "kungfu.init()\n"
            "@tf.function\n"
            "def f(x, sync):\n"
            "    return kungfu.all_reduce(x) if sync else x\n"
            "print(f(tf.ones(2), False).numpy().tolist(), f(tf.ones(2), True).numpy().tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[1.0, 1.0] [1.0, 1.0]"


def test_a_bad_engine_setting_is_a_value_error_naming_it():
    # The engine refuses it as InvalidArgument, which for collectives means the workers disagree
    # (MismatchError): at init() it is a bad setting in the environment, a plain ValueError.
    code = ("import kungfu, kungfu.errors\n"
            "try:\n"
            "    kungfu.init()\n"
            "except ValueError as e:\n"
            "    print(type(e).__name__, isinstance(e, kungfu.errors.MismatchError), 'KUNGFU_CHUNK_BYTES' in str(e))\n")
    env = dict(os.environ, KUNGFU_CHUNK_BYTES="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ValueError False True", out.stdout


def test_library_path_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KUNGFU_LIBRARY", str(tmp_path / "lib.so"))
    assert _lib.library_path() == str(tmp_path / "lib.so")
    monkeypatch.delenv("KUNGFU_LIBRARY")
    assert _lib.library_path().endswith("kungfu/_kungfu.so")


def test_missing_library_is_a_clear_error(tmp_path):
    code = ("import kungfu\n"
            "try:\n"
            "    kungfu.init()\n"
            "except kungfu.errors.EngineError as e:\n"
            "    print('ERR', e)\n")
    env = dict(os.environ, KUNGFU_LIBRARY=str(tmp_path / "missing.so"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert "ERR kungfu library not found at" in out.stdout, out.stdout + out.stderr
    assert "KUNGFU_LIBRARY names a missing file" in out.stdout


if __name__ == "__main__":
    tf.test.main()
