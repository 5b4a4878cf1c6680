"""Eager collectives around TF's dispatch, on one process (a cluster of size 1): a plain eager call hands
its tensor to the engine itself (kungfu/ops/_direct.py), by the C way (kungfu/ops/_eager.cc) or, where
that cannot run, the DLPack way, and gives what the op gives; a watched call (a tape, an op callback)
runs the op. The ops themselves are tested in test_ops.py.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import kungfu
from kungfu import _lib
from kungfu.ops import _direct, _naming
from ops_util import COPY_ONLY_DTYPES, REDUCE_DTYPES, sample

pytestmark = pytest.mark.usefixtures("kungfu_library")  # fails, naming the fix, when it is not built


def both_ways(test):
    """Runs test(self) twice: eager calls by the C way (kungfu.ops._eager), then by the DLPack way (_direct.py)."""
    def run(self):
        for use_extension in (True, False):
            _direct.USE_EXTENSION = use_extension
            try:
                with self.subTest(way="C" if use_extension else "DLPack"):
                    test(self)
            finally:
                _direct.USE_EXTENSION = True
    run.__name__, run.__doc__ = test.__name__, test.__doc__
    return run


class EagerAroundTFTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        kungfu.init()

    def test_the_private_tf_api_of_the_eager_path_is_there(self):
        """The C way of eager collectives (python/kungfu/ops/_eager.cc) reaches EagerTensors through three
        private functions of TF's Python bindings. When a TF upgrade removes or renames them, eager calls
        fall back to the DLPack way (slower, still right) and this test says what changed."""
        problem = _direct._eager_problem()
        self.assertIsNone(problem, f"the eager collectives' C way cannot run with TF {tf.__version__}: {problem}")
        self.assertIs(_direct._fast(), _direct._extension)
        x = tf.constant([[1.5, -2.0], [3.0, 4.0]])
        refs = sys.getrefcount(x)
        y = _direct._extension.all_reduce(x, 1, b"private/api")  # the round trip through those functions
        self.assertIsInstance(y, type(x))
        self.assertAllEqual(y, x)
        self.assertEqual(sys.getrefcount(y), 2)  # a new reference, held by y alone (and the call's argument)
        for _ in range(100):
            _direct._extension.broadcast(x, 0, b"private/api")
        self.assertEqual(sys.getrefcount(x), refs)  # the input is borrowed, not kept
        self.assertIsNone(_direct._extension.all_reduce(np.ones(2), 1, b"private/api/numpy"))  # not an EagerTensor
        with self.assertRaisesRegex(TypeError, "the key must be bytes"):
            _direct._extension.all_reduce(x, 1, "private/api")
        with self.assertRaisesRegex(TypeError, r"all_reduce\(\) takes 3 arguments \(2 given\)"):
            _direct._extension.all_reduce(x, 1)

    @both_ways
    def test_eager_all_reduce_around_tf_gives_what_the_op_gives(self):
        """Eagerly, with nothing watching, all_reduce hands the tensor to the engine itself (_direct.py): the
        result is a new tensor of the same dtype and shape, aligned as TF's own, equal to the op's."""
        for dtype in REDUCE_DTYPES:
            for shape in [[], [0], [1], [7], [3, 5], [2, 0, 4], [1000]]:
                x = sample(shape, dtype)
                direct = _direct.all_reduce(x, "sum", "direct/values")
                self.assertIsNotNone(direct)
                _direct.ENABLED = False
                try:
                    by_op = kungfu.all_reduce(x, name="direct/values")
                finally:
                    _direct.ENABLED = True
                self.assertEqual((direct.dtype, direct.shape), (dtype, x.shape))
                self.assertAllEqual(direct, by_op, msg=f"{dtype.name} {shape}")
                if shape and int(np.prod(shape)):
                    self.assertEqual(direct._numpy().ctypes.data % 64, 0)  # TF's kernels may assume it
                    self.assertNotEqual(direct._numpy().ctypes.data, x._numpy().ctypes.data)  # not the input
                self.assertAllEqual(direct * 2, x * 2)  # an ordinary TF tensor from here on

    @both_ways
    def test_eager_copies_around_tf_give_what_the_ops_give(self):
        """broadcast, all_gather and consensus go around TF's dispatch as all_reduce does (_direct.py), for every
        dtype they take: the same results as the ops, new aligned tensors."""
        for dtype in REDUCE_DTYPES + COPY_ONLY_DTYPES:
            for shape in [[], [0], [1], [7], [3, 5], [2, 0, 4], [1000]]:
                x = sample(shape, dtype)
                direct = [_direct.broadcast(x, 0, "direct/bcast"), _direct.all_gather(x, "direct/gather"),
                          _direct.consensus(x, "direct/consensus")]
                _direct.ENABLED = False
                try:
                    by_op = [kungfu.broadcast(x, name="direct/bcast"), kungfu.all_gather(x, name="direct/gather"),
                             kungfu.consensus(x, name="direct/consensus")]
                finally:
                    _direct.ENABLED = True
                for what, got, want in zip(["broadcast", "all_gather", "consensus"], direct, by_op):
                    msg = f"{what} {dtype.name} {shape}"
                    self.assertIsNotNone(got, msg)
                    self.assertEqual((got.dtype, got.shape), (want.dtype, want.shape), msg)
                    self.assertAllEqual(got, want, msg=msg)
                for got in direct[:2]:
                    if shape and int(np.prod(shape)):
                        self.assertEqual(got._numpy().ctypes.data % 64, 0)
                        self.assertNotEqual(got._numpy().ctypes.data, x._numpy().ctypes.data)
                self.assertTrue(bool(direct[2]))
        with self.assertRaisesRegex(ValueError, r"root must be a rank in \[0, 1\), got 1"):
            kungfu.broadcast(tf.ones([2]), root=1)  # checked before the C call, as before the op
        # An empty tensor whose other dimensions multiply past 2^60: the C call leaves it to the op, whose
        # kernel refuses it (on every worker alike) rather than overflow.
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"2\^60 elements or more"):
            kungfu.all_gather(tf.zeros([0, 2**40, 2**40]))
        self.assertEqual(kungfu.all_gather(tf.zeros([0, 2**20, 2**20])).shape, [0, 2**20, 2**20])

    def test_the_short_way_takes_plain_eager_calls_and_leaves_the_rest(self):
        """all_reduce, broadcast and all_gather hand a plain eager call (an EagerTensor, a lower-case op, a
        str name or none, an int root) to the C way before any check of their own (_direct.short()); every
        other call, and every call the C API does not take, goes the long way, with its checks and errors."""
        self.assertIsNotNone(_direct._fast())
        real, calls = _direct._extension, []

        class Recorder:
            def __getattr__(self, what):
                def call(*args):
                    calls.append(what)
                    return getattr(real, what)(*args)
                return call

        x = tf.constant([1.0, 2.0])
        _direct._extension = Recorder()
        try:
            self.assertIs(_direct.short(), _direct._extension)
            self.assertAllEqual(kungfu.all_reduce(x, name="short/a"), x)
            self.assertAllEqual(kungfu.all_reduce(x, op="max"), x)
            self.assertAllEqual(kungfu.broadcast(x, 0, name="short/b"), x)
            self.assertAllEqual(kungfu.all_gather(x), x)
            self.assertEqual(calls, ["all_reduce", "all_reduce", "broadcast", "all_gather"])
            calls.clear()
            # Not in the short way's form: the long way converts, checks and calls the C way itself.
            self.assertAllEqual(kungfu.all_reduce([1.0, 2.0], op="SUM"), x)
            self.assertAllEqual(kungfu.broadcast(x, root=np.int64(0)), x)
            self.assertEqual(calls, ["all_reduce", "broadcast"])
            calls.clear()
            for call, error, message in [
                    (lambda: kungfu.all_reduce(x, op="avg"), ValueError, "op must be one of"),
                    (lambda: kungfu.all_reduce(x, op=["sum"]), ValueError, "op must be one of"),  # unhashable
                    (lambda: kungfu.all_reduce(x, name=""), ValueError, "name must be a non-empty string"),
                    (lambda: kungfu.all_gather(x, name=5), ValueError, "name must be a non-empty string"),
                    (lambda: kungfu.broadcast(x, root=1), ValueError, r"root must be a rank in \[0, 1\)"),
                    (lambda: kungfu.broadcast(x, root=True), ValueError, "root must be a Python int")]:
                with self.assertRaisesRegex(error, message):
                    call()
            self.assertEqual(calls, [])
            # Taken by neither way's C call: a dtype the C API refuses gets the long way's TypeError.
            with self.assertRaisesRegex(TypeError, "dtype bool is not supported"):
                kungfu.all_reduce(tf.constant([True]))
            self.assertEqual(calls, ["all_reduce"])
            calls.clear()
            with tf.GradientTape():
                self.assertIsNone(_direct.short())
                kungfu.all_reduce(x)
            tf.function(lambda: kungfu.all_reduce(x))()
            self.assertEqual(calls, [])  # a tape records the op; a traced call is an op in the graph
            _direct.USE_EXTENSION = False
            try:
                self.assertAllEqual(kungfu.all_reduce(x), x)  # the DLPack way
            finally:
                _direct.USE_EXTENSION = True
            self.assertEqual(calls, [])
        finally:
            _direct._extension = real

    def test_watched_eager_all_reduce_runs_the_op(self):
        """A tape must record the op for the gradient, an op callback must see it: then the op runs."""
        module = _lib.op_module()
        original, calls = module.kf_all_reduce, []

        def spy(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        x = tf.constant([1.0, 2.0])
        self.assertTrue(_naming.eager_unobserved())
        module.kf_all_reduce = spy
        try:
            kungfu.all_reduce(x)
            self.assertEqual(calls, [])
            with tf.GradientTape() as tape:
                tape.watch(x)
                self.assertFalse(_naming.eager_unobserved())
                y = kungfu.all_reduce(x * x)
            self.assertEqual(len(calls), 1)
            self.assertAllEqual(tape.gradient(y, x), [2.0, 4.0])  # its all_reduce runs the op too
            self.assertEqual(len(calls), 2)
            with tf.autodiff.ForwardAccumulator(x, tf.ones([2])):
                self.assertFalse(_naming.eager_unobserved())
            tf.debugging.enable_check_numerics()  # an op callback
            try:
                self.assertFalse(_naming.eager_unobserved())
                kungfu.all_reduce(x)
            finally:
                tf.debugging.disable_check_numerics()
            self.assertEqual(len(calls), 3)
            self.assertTrue(_naming.eager_unobserved())
        finally:
            module.kf_all_reduce = original

    @both_ways
    def test_eager_all_reduce_around_tf_does_not_leak(self):
        """Each result's buffer comes from the engine and is freed when TF frees the tensor."""
        def rss_mb():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        x = tf.ones([1 << 18])  # 1 MiB
        for _ in range(20):
            kungfu.all_reduce(x, name="direct/leak")
        before = rss_mb()
        for _ in range(500):  # 500 MiB of results, were they kept
            kungfu.all_reduce(x, name="direct/leak")
        self.assertLess(rss_mb() - before, 100)


def test_eager_collectives_fall_back_to_dlpack_with_one_warning():
    # Where the C way cannot run (here: TF's library of private functions is not where it is looked for, as
    # after a TF upgrade that moves it), eager collectives still work, the DLPack way, and say so once.
    code = ("import kungfu, tensorflow as tf\n"
            "from kungfu.ops import _direct\n"
            "_direct._PYWRAP_LIBRARY = 'lib_moved_away.so'\n"
            "kungfu.init()\n"
            "print(kungfu.all_reduce(tf.ones(2)).numpy().tolist(), kungfu.broadcast(tf.ones(2)).numpy().tolist())\n"
            "print(_direct._fast() is None, _direct._eager_problem())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "[1.0, 1.0] [1.0, 1.0]", out.stdout
    assert lines[-1].startswith("True RuntimeError: TensorFlow's ") and "lib_moved_away.so is not loaded" in lines[-1]
    assert out.stderr.count("eager collectives take the slower DLPack way") == 1, out.stderr[-3000:]


def test_a_bad_eager_direct_setting_is_a_value_error():
    code = "import kungfu\nkungfu.init()\n"  # init() imports the ops, which read the setting
    env = dict(os.environ, KUNGFU_EAGER_DIRECT="yes")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "ValueError: KUNGFU_EAGER_DIRECT must be 1 (the default), dlpack or 0; got 'yes'" in out.stderr


if __name__ == "__main__":
    tf.test.main()
