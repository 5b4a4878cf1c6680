"""How collectives meet across workers: mismatched shapes, dtypes and kinds fail on every worker, a
rank-dependent order in one tf.function completes, independent collectives are in flight together, unused
and identical ones run, and threads take turns. Run by tests/collectives_worker.py with its own checks.
"""

import atexit
import ctypes
import os
import tempfile
import threading
import time

import numpy as np
import tensorflow as tf

import kungfu
from kungfu import _lib
from kungfu.ops import _direct

import mp
from collective_values import assert_equal, data, expected_reduce

CHECKS, check = mp.check_list()


def invalid_argument_problem(fn, *words):
    """None when fn raises InvalidArgumentError whose message has every word; else what went wrong."""
    try:
        fn()
    except tf.errors.InvalidArgumentError as e:
        missing = [w for w in words if w not in e.message]
        return f"message lacks {missing}: {e.message}" if missing else None
    except tf.errors.OpError as e:
        return f"{type(e).__name__} instead of InvalidArgumentError: {e.message}"
    return "no error"


def through_the_op_on(this_worker, fn):
    """fn(), with eager collectives running the TF ops on this worker (if true) instead of going around TF's
    dispatch (kungfu/ops/_direct.py)."""
    enabled = _direct.ENABLED
    _direct.ENABLED = enabled and not this_worker
    try:
        return fn()
    finally:
        _direct.ENABLED = enabled


@check
def mismatches_fail_on_every_worker():
    rank, size = kungfu.rank(), kungfu.size()
    if size == 1:
        return
    odd = rank == 1  # rank 1 disagrees with the others

    @tf.function
    def group(x):
        return kungfu.group_all_reduce([x, x], name="mm/group")

    cases = {  # every rank runs every case, whatever happened in the previous ones
        "all_reduce count": (lambda: kungfu.all_reduce(np.zeros([5 if odd else 4], np.float32), name="mm/count"),
                             ["mm/count"]),
        "all_reduce dtype": (lambda: kungfu.all_reduce(np.zeros([4], np.float64 if odd else np.float32),
                                                       name="mm/dtype"), ["mm/dtype"]),
        "all_reduce op": (lambda: kungfu.all_reduce(np.zeros([4], np.float32), op="max" if odd else "sum",
                                                    name="mm/rop"), ["mm/rop", "reduce op", "max", "sum"]),
        "all_gather dims": (lambda: kungfu.all_gather(np.zeros([2, 4 if odd else 3], np.float32), name="mm/ag"),
                            ["mm/ag", "rank 1 has float[2,4]"]),
        # Shapes that differ beyond the dimensions a message lists (eight after the first) say so.
        "all_gather deep dims": (lambda: kungfu.all_gather(np.zeros([1] * 10 + [3 if odd else 2], np.float32),
                                                           name="mm/agdeep"), ["after the first 9"]),
        "all_gather dtype": (lambda: kungfu.all_gather(np.zeros([2], np.int64 if odd else np.int32),
                                                       name="mm/agtype"), ["int64"]),
        "group in function": (lambda: group(tf.zeros([3 if odd else 2])), ["mm/group"]),
        # Lists that the fusion plan cuts into other parts (a dtype, a length): the parts meet by their
        # place in the plan and every part's signature covers the whole group, so this fails at once too.
        "group dtype": (lambda: kungfu.group_all_reduce([tf.zeros([2], tf.float64 if odd else tf.float32),
                                                         tf.zeros([3])], name="mm/gdtype"), ["mm/gdtype"]),
        "group length": (lambda: kungfu.group_all_reduce([tf.zeros([2])] * (3 if odd else 2), fusion_bytes=0,
                                                         name="mm/glen"), ["mm/glen"]),
        # An empty list meets the others too (it used to return at once, pairing its next group with theirs).
        "group empty": (lambda: kungfu.group_all_reduce([] if odd else [tf.zeros([2])], name="mm/gempty"),
                        ["mm/gempty"]),
        "broadcast count": (lambda: kungfu.broadcast(np.zeros([3 if odd else 2], np.int32), name="mm/bcast"),
                            ["mm/bcast"]),
        # Same number of elements, another shape: caught by the shape signature in every frame.
        "all_reduce shape": (lambda: kungfu.all_reduce(np.zeros([3, 2] if odd else [2, 3], np.float32),
                                                       name="mm/shape"), ["mm/shape", "another shape"]),
        "broadcast shape": (lambda: kungfu.broadcast(np.zeros([6] if odd else [2, 3], np.int32), name="mm/bshape"),
                            ["mm/bshape", "another shape"]),
        # One-byte dtypes travel as the same bytes: the signature carries the TF dtype too (a bool tensor
        # must never receive a uint8's 255).
        "broadcast byte dtype": (lambda: kungfu.broadcast(np.zeros([3], np.bool_ if odd else np.uint8),
                                                          name="mm/bbytes"), ["mm/bbytes", "dtype"]),
        # An eager all_reduce around TF's dispatch (kungfu/ops/_direct.py) against the op on rank 1: the same
        # shape check.
        "all_reduce shape, direct against the op": (lambda: through_the_op_on(
            odd, lambda: kungfu.all_reduce(np.zeros([3, 2] if odd else [2, 3], np.float32), name="mm/dshape")),
            ["mm/dshape", "another shape"]),
        # The direct paths of all_gather and broadcast describe dtypes and shapes as the kernels do
        # (cc/tensor_meta.h): rank 1's op meets the others' C calls.
        "all_gather dims, direct against the op": (lambda: through_the_op_on(
            odd, lambda: kungfu.all_gather(np.zeros([2, 4 if odd else 3], np.float16), name="mm/dag")),
            ["mm/dag", "rank 0 has half[2,3], rank 1 has half[2,4]"]),
        "broadcast byte dtype, direct against the op": (lambda: through_the_op_on(
            odd, lambda: kungfu.broadcast(np.zeros([3], np.int8 if odd else np.bool_), name="mm/dbbytes")),
            ["mm/dbbytes", "dtype"]),
        # One name for two collectives: all_gather's first step (the shapes) runs under the name itself.
        "all_gather against all_reduce": (lambda: (kungfu.all_gather if odd else kungfu.all_reduce)(
            np.zeros([2], np.float32), name="mm/kind"), ["mm/kind", "two different collectives"]),
    }
    problems = []
    for what, (fn, words) in cases.items():
        problem = invalid_argument_problem(fn, *words)
        if problem:
            problems.append(f"{what} on rank {rank}: {problem}")
        kungfu.barrier(name=f"mm/after/{what}")
    assert_equal(kungfu.all_reduce(np.ones([3], np.float32), name="mm/after"), np.full([3], size, np.float32),
                 "a collective after the mismatches")
    if problems:
        raise AssertionError("; ".join(problems))


@check
def rank_dependent_order_in_one_function():
    rank, size = kungfu.rank(), kungfu.size()
    order = np.random.RandomState(rank + 1).permutation(20)
    xs = [tf.constant(data(rank, [k + 1], tf.float32, salt=k)) for k in range(20)]

    @tf.function
    def f(xs):
        out = [None] * 20
        for k in order:  # traced in a different order on every rank
            kind = k % 4
            if kind == 0:
                out[k] = kungfu.all_reduce(xs[k], name=f"perm/{k}")
            elif kind == 1:
                out[k] = kungfu.broadcast(xs[k], root=k % size, name=f"perm/{k}")
            elif kind == 2:
                out[k] = kungfu.all_gather(xs[k], name=f"perm/{k}")
            else:
                out[k] = tf.cast(kungfu.consensus(xs[k], name=f"perm/{k}"), tf.float32)
        return out

    for _ in range(2):
        for k, y in enumerate(f(xs)):
            kind, shape = k % 4, [k + 1]
            if kind == 0:
                want = expected_reduce(shape, tf.float32, "sum", size, salt=k)
            elif kind == 1:
                want = data(k % size, shape, tf.float32, salt=k)
            elif kind == 2:
                want = np.concatenate([data(r, shape, tf.float32, salt=k) for r in range(size)])
            else:
                want = np.float32(size == 1)
            assert_equal(y, want, f"perm/{k}")


def late_start(fn, *args):
    """Runs fn with the last rank 0.5 s late, so the others' collectives wait in flight meanwhile."""
    kungfu.barrier()
    _lib.reset_engine_stats()
    if kungfu.rank() == kungfu.size() - 1:
        time.sleep(0.5)
    result = fn(*args)
    return result, _lib.engine_stats()


@check
def independent_collectives_run_together():
    rank, size = kungfu.rank(), kungfu.size()
    if size == 1:
        return  # at size 1 a collective completes at once: nothing to overlap

    @tf.function
    def eight(x):
        return [kungfu.all_reduce(x * i) for i in range(8)]

    @tf.function
    def mixed(x):
        kungfu.barrier()
        # Every collective waits for the late rank (the broadcast has it as root).
        return (kungfu.all_reduce(x), kungfu.broadcast(x, root=kungfu.size() - 1), kungfu.consensus(x),
                kungfu.group_all_reduce([x, x]))

    x = tf.ones([1000])
    ys, stats = late_start(eight, x)
    for i, y in enumerate(ys):
        assert_equal(y, np.full([1000], i * size, np.float32), f"eight #{i}")
    if rank != size - 1 and stats["max_in_flight"] < 8:
        raise AssertionError(f"8 independent all-reduces: max_in_flight {stats['max_in_flight']} < 8; they ran "
                             f"one after another ({stats})")
    _, stats = late_start(mixed, x)
    if rank != size - 1 and stats["max_in_flight"] < 5:
        raise AssertionError(f"5 independent collectives of 4 kinds: max_in_flight {stats['max_in_flight']} < 5")


@check
def unused_and_identical_collectives_run():
    size = kungfu.size()

    @tf.function
    def unused(x):
        kungfu.all_reduce(x)  # the result is dropped
        return tf.constant(0)

    @tf.function
    def identical(x):
        return kungfu.all_reduce(x) + kungfu.all_reduce(x)

    before = _lib.engine_stats()
    unused(tf.ones([4]))
    after = _lib.engine_stats()
    assert after["started"] - before["started"] == 1, f"unused: started {before} -> {after}"
    assert after["completed"] - before["completed"] == 1, f"unused: completed {before} -> {after}"
    assert_equal(identical(tf.ones([4])), np.full([4], 2 * size, np.float32), "identical")
    assert _lib.engine_stats()["started"] - after["started"] == 2, "identical: both calls started"


@check
def later_trace_and_saved_model():
    """A function whose first collective comes in its second trace (a Python branch), and a tf.Module saved
    with tf.saved_model.save and loaded again. The ordering token is each graph's own op, so neither is
    refused (a captured token variable was: "Creating variables on a non-first call", "untracked resource")."""
    rank, size = kungfu.rank(), kungfu.size()
    total = np.full([3], size * (size + 1) / 2, np.float32)

    @tf.function
    def maybe(x, sync):
        return kungfu.all_reduce(x, name="later_trace") if sync else x

    x = tf.fill([3], float(rank + 1))
    assert_equal(maybe(x, False), x.numpy(), "first trace, no collective")
    assert_equal(maybe(x, True), total, "second trace, a collective")

    class Summer(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
        def __call__(self, v):
            return kungfu.all_reduce(v, name="saved_model")

    with tempfile.TemporaryDirectory() as d:
        tf.saved_model.save(Summer(), d)
        loaded = tf.saved_model.load(d)
    assert_equal(loaded(x), total, "a loaded SavedModel's collective")
    assert_equal(loaded(x), total, "a loaded SavedModel's collective, again")


@check
def nested_calls_meet_in_order():
    """Two calls of one tf.function holding a collective (one key), from another tf.function, whose inputs
    are ready in a rank-dependent order: the calls must run in program order on every worker. The inner
    function reads a captured variable, so its call takes a resource input and TF would not order it by
    itself (kungfu/ops/_naming.py, "Calls of functions that hold collectives")."""
    rank, size = kungfu.rank(), kungfu.size()
    w = tf.Variable(1.0)

    @tf.function
    def inner(x):
        return kungfu.all_reduce(x * w, name="nested/k")

    def slow(x):  # some work that the other input does not wait for
        m = tf.fill([200, 200], x[0] * 1e-9)
        for _ in range(20):
            m = tf.matmul(m, m) * 0.0 + m
        return x + tf.reduce_sum(m) * 0.0

    @tf.function
    def outer(a, b):
        if rank % 2 == 0:
            a = slow(a)
        else:
            b = slow(b)
        return inner(a), inner(b)

    a, b = tf.constant([1.0]), tf.constant([100.0])
    for _ in range(5):
        x, y = outer(a, b)
        assert_equal(x, np.full([1], size, np.float32), "the first call")
        assert_equal(y, np.full([1], 100 * size, np.float32), "the second call")


def _in_forked_child():
    """What a child forked from this worker checks (no TensorFlow: TF's thread pools are not forked); returns
    what went wrong, or None."""
    try:
        kungfu.all_reduce(np.ones(2, np.float32))
        return "kungfu.all_reduce in the child raised nothing"
    except kungfu.errors.EngineError as e:
        if "forked" not in str(e):
            return f"kungfu.all_reduce: {e}"
    one, out = ctypes.c_int32(1), ctypes.c_int32(0)
    err = ctypes.create_string_buffer(512)
    code = _lib._library.c.kungfu_all_reduce(ctypes.byref(one), ctypes.byref(out), 1, 2, 1, b"child", err, 512)
    if code != 9 or b"forked" not in err.value:  # FAILED_PRECONDITION, naming the fork
        return f"the engine's C API in the child: code {code}, {err.value!r}"
    atexit._run_exitfuncs()  # as at the child's exit: kungfu.finalize must leave the parent's engine alone
    return None


@check
def forked_child_keeps_off_the_engine():
    """A child forked after init() (os.fork, multiprocessing's default) shares the worker's connections but
    none of the engine's threads: its collectives fail at once naming the fork, and its exit does not
    finalize for the parent (whose peers were told it was leaving, and whose own collectives then failed)."""
    pid = os.fork()
    if pid == 0:
        problem = "?"
        try:
            problem = _in_forked_child()
        except BaseException as e:  # noqa: BLE001 - reported through the exit code and stderr
            problem = f"{type(e).__name__}: {e}"
        finally:
            if problem:
                os.write(2, f"forked child: {problem}\n".encode())
            os._exit(1 if problem else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's checks failed (its stderr says why)"
    size = kungfu.size()
    assert_equal(kungfu.all_reduce(tf.ones([2]), name="after_fork"), np.full([2], size, np.float32),
                 "the parent's collective after its child exited")


@check
def eager_collectives_from_several_threads():
    """Eager collectives wait on their own thread, driving the engine there; several Python threads doing
    so at once (started in a rank-dependent order) take turns, while a tf.function's collectives, which
    never block, run beside them."""
    rank, size = kungfu.rank(), kungfu.size()
    threads, iters = 3, 20
    errors = []

    def eager(t):
        try:
            for i in range(iters):
                x = tf.fill([1 + 50 * t], float((rank + 1) * (t + 1)))
                got = kungfu.all_reduce(x, name=f"threads/{t}")
                assert_equal(got, np.full([1 + 50 * t], (t + 1) * size * (size + 1) / 2, np.float32),
                             f"thread {t} call {i}")
                if i % 5 == 0:
                    kungfu.barrier(name=f"threads/{t}/barrier")
        except Exception as e:  # noqa: BLE001 (reported below, with the thread)
            errors.append(f"thread {t}: {e!r}")

    @tf.function
    def graph_step(x):
        return kungfu.group_all_reduce([x, 2 * x], name="threads/graph")

    def graphs():
        try:
            for i in range(iters):
                a, b = graph_step(tf.ones([7]))
                assert_equal(b, np.full([7], 2 * size, np.float32), f"graph call {i}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"graph thread: {e!r}")

    order = [(t + rank) % threads for t in range(threads)]
    ts = [threading.Thread(target=eager, args=(t,)) for t in order] + [threading.Thread(target=graphs)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(timeout=120)
    if any(th.is_alive() for th in ts):
        raise AssertionError("a thread did not finish within 120 s")
    if errors:
        raise AssertionError("; ".join(errors))
