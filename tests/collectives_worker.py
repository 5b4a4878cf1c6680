"""The worker of test_collectives_mp.py, started once per np by kfrun. Not a test module itself.

    python -m kungfu.launcher -np N -- python tests/collectives_worker.py

It runs every multi-worker check in one process (TF costs seconds and 600 MB per process, so one
launch per np, not per case): the value checks here and how collectives meet across workers
(tests/collectives_meeting_checks.py). It prints one line per check: "KFCHECK <name> OK <seconds>" or
"KFCHECK <name> FAIL <reason>", then "KFDONE". Every worker can compute every rank's input
(tests/collective_values.py), so each checks exact values on its own. How workers fail when a peer
dies, leaves or stalls is in tests/failures_worker.py.
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import os  # noqa: E402 (after the pid file on purpose)
import sys  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
from kungfu.ops import _direct  # noqa: E402

import collectives_meeting_checks  # noqa: E402
from collectives_meeting_checks import through_the_op_on  # noqa: E402
from collective_values import (BIG, COPY_DTYPES, REDUCE_DTYPES, REDUCE_OPS, assert_equal, data,  # noqa: E402
                               expected_reduce)

CHECKS, check = mp.check_list()


ROWS = [2, 0, 3, 1]  # all_gather: rows of rank r, ROWS[r % 4], so some worker has none from np 2 on


def matrix():
    """(dtype, op, shape) of the all-reduce value checks."""
    for dtype in REDUCE_DTYPES:
        for op in REDUCE_OPS:
            for shape in [[0], [1], [7], [3, 5], [BIG]]:
                yield dtype, op, shape


@check
def all_reduce_values_eager():
    rank, size = kungfu.rank(), kungfu.size()
    for dtype, op, shape in matrix():
        y = kungfu.all_reduce(data(rank, shape, dtype, op), op=op)
        assert_equal(y, expected_reduce(shape, dtype, op, size), f"{dtype.name} {op} {shape}")


@check
def eager_collectives_around_tf_meet_the_op():
    """Eagerly, all_reduce, broadcast, all_gather, barrier and consensus go around TF's op dispatch
    (kungfu/ops/_direct.py) unless a tape or an op callback watches; here odd ranks run the TF ops instead, so
    each path meets the other, values exact."""
    rank, size = kungfu.rank(), kungfu.size()
    odd = rank % 2 == 1
    for dtype, op, shape in matrix():
        if shape == [BIG] and dtype != tf.float32:  # the large values once: all_reduce_values_eager has the rest
            continue
        y = through_the_op_on(odd, lambda: kungfu.all_reduce(data(rank, shape, dtype, op), op=op,
                                                             name="direct/meets/op"))
        assert_equal(y, expected_reduce(shape, dtype, op, size), f"{dtype.name} {op} {shape}")
        through_the_op_on(not odd, lambda: kungfu.barrier(name="direct/meets/op/barrier"))
    for root in range(size):
        for dtype in COPY_DTYPES:
            for shape in [[], [0], [7], [2, 3]]:
                y = through_the_op_on(odd, lambda: kungfu.broadcast(data(rank, shape, dtype), root=root,
                                                                    name="direct/meets/op/broadcast"))
                assert_equal(y, data(root, shape, dtype), f"broadcast from {root} {dtype.name} {shape}")
    for dtype in COPY_DTYPES:
        y = through_the_op_on(not odd, lambda: kungfu.all_gather(data(rank, [ROWS[rank % 4], 3], dtype),
                                                                 name="direct/meets/op/all_gather"))
        want = np.concatenate([data(r, [ROWS[r % 4], 3], dtype) for r in range(size)])
        assert_equal(y, want, f"all_gather {dtype.name} rows {ROWS[:size]}")
    y = through_the_op_on(odd, lambda: kungfu.all_gather(np.int64(rank), name="direct/meets/op/scalars"))
    assert_equal(y, np.arange(size, dtype=np.int64), "all_gather of scalars")
    for same in (True, False):
        x = data(0 if same else min(rank, 1), [2, 3], tf.bfloat16)
        agreed = through_the_op_on(odd, lambda: kungfu.consensus(x, name="direct/meets/op/consensus"))
        assert bool(agreed) == (same or size == 1), f"consensus, inputs {'alike' if same else 'differing'}"


@check
def eager_c_way_meets_the_dlpack_way():
    """The two ways eager collectives go around TF's dispatch (kungfu/ops/_direct.py): the C extension on even
    ranks, the DLPack calls on odd ones, for each collective; values exact, and a mismatch fails on both."""
    rank, size = kungfu.rank(), kungfu.size()
    _direct.USE_EXTENSION = rank % 2 == 0
    try:
        for dtype in COPY_DTYPES:
            for shape in [[], [0], [7], [2, 3]]:
                if dtype in REDUCE_DTYPES:
                    y = kungfu.all_reduce(data(rank, shape, dtype, "sum"), name="ways/all_reduce")
                    assert_equal(y, expected_reduce(shape, dtype, "sum", size), f"all_reduce {dtype.name} {shape}")
                y = kungfu.broadcast(data(rank, shape, dtype), root=size - 1, name="ways/broadcast")
                assert_equal(y, data(size - 1, shape, dtype), f"broadcast {dtype.name} {shape}")
            y = kungfu.all_gather(data(rank, [ROWS[rank % 4], 3], dtype), name="ways/all_gather")
            want = np.concatenate([data(r, [ROWS[r % 4], 3], dtype) for r in range(size)])
            assert_equal(y, want, f"all_gather {dtype.name}")
        assert bool(kungfu.consensus(tf.constant([rank, 1]), name="ways/consensus")) == (size == 1)
        if size > 1:
            problem = collectives_meeting_checks.invalid_argument_problem(
                lambda: kungfu.all_reduce(tf.ones([2 + rank % 2]), name="ways/mismatch"), "ways/mismatch")
            assert problem is None, problem
    finally:
        _direct.USE_EXTENSION = True


@check
def all_reduce_values_in_one_function():
    rank, size = kungfu.rank(), kungfu.size()
    cases = [c for c in matrix() if c[2] != [BIG] or c[0] == tf.float32]
    inputs = [tf.constant(data(rank, shape, dtype, op)) for dtype, op, shape in cases]

    @tf.function
    def f(xs):  # every all-reduce of the matrix in flight at once
        return [kungfu.all_reduce(x, op=op) for x, (_, op, _) in zip(xs, cases)]

    for _ in range(2):  # the second call reuses the graph: the keys' second generation
        for y, (dtype, op, shape) in zip(f(inputs), cases):
            assert_equal(y, expected_reduce(shape, dtype, op, size), f"{dtype.name} {op} {shape}")


@check
def group_all_reduce_values():
    rank, size = kungfu.rank(), kungfu.size()
    specs = [([5], tf.float32), ([3, 2], tf.int32), ([0], tf.float16), ([BIG], tf.float32), ([], tf.float64),
             ([40], tf.bfloat16), ([7], tf.int64), ([300000], tf.float16), ([9], tf.float32)]
    for op in ["sum", "mean", "max"]:
        xs = [data(rank, s, d, op, salt=k) for k, (s, d) in enumerate(specs)]
        for fusion_bytes in [None, 64, 0]:
            ys = kungfu.group_all_reduce(xs, op=op, fusion_bytes=fusion_bytes)
            for k, ((s, d), y) in enumerate(zip(specs, ys)):
                assert_equal(y, expected_reduce(s, d, op, size, salt=k), f"{op} fusion={fusion_bytes} #{k}")
    assert kungfu.group_all_reduce([]) == [], "an empty group"


def _squares(x):
    return float(np.sum(np.square(np.asarray(x, np.float64))))


@check
def group_all_reduce_with_norms_values():
    """The outputs equal group_all_reduce's; local_sq is the workers' mean sum of squares of their inputs,
    reduced_sq that of the outputs; norms false gives 0s. Every float dtype; packed buckets (the local sum
    rides in the last float32/float64 one), tensors alone and half types only (it gets its own all-reduce)."""
    rank, size = kungfu.rank(), kungfu.size()
    mixed = [([5], tf.float32), ([0], tf.float16), ([BIG], tf.float32), ([], tf.float64), ([40], tf.bfloat16),
             ([300000], tf.float16), ([9, 3], tf.float32), ([6], tf.float64)]
    halves = [([7], tf.float16), ([3, 3], tf.bfloat16)]
    fn = tf.function(lambda xs, norms, op, fb: kungfu.ops.group_all_reduce_with_norms(xs, norms, op=op,
                                                                                      fusion_bytes=fb))
    for specs in (mixed, halves):
        for op in ["mean", "sum"]:
            xs = [data(rank, s, d, op, salt=k) for k, (s, d) in enumerate(specs)]
            local_want = np.mean([sum(_squares(data(r, s, d, op, salt=k)) for k, (s, d) in enumerate(specs))
                                  for r in range(size)])
            for fusion_bytes in [None, 64, 0]:
                for norms in [True, False]:
                    for how, call in (("eager", kungfu.ops.group_all_reduce_with_norms),
                                      ("function", lambda xs, n, op, fusion_bytes: fn(xs, tf.constant(n), op,
                                                                                      fusion_bytes))):
                        ys, local_sq, reduced_sq = call(xs, norms, op=op, fusion_bytes=fusion_bytes)
                        what = f"{how} {op} {len(specs)} tensors fusion={fusion_bytes} norms={norms}"
                        for k, ((s, d), y) in enumerate(zip(specs, ys)):
                            assert_equal(y, expected_reduce(s, d, op, size, salt=k), f"{what} #{k}")
                        if not norms:
                            assert float(local_sq) == 0 and float(reduced_sq) == 0, (what, local_sq, reduced_sq)
                            continue
                        np.testing.assert_allclose(float(local_sq), local_want, rtol=1e-5, err_msg=what)
                        np.testing.assert_allclose(float(reduced_sq), sum(_squares(y) for y in ys), rtol=1e-5,
                                                   err_msg=what)
    try:
        kungfu.ops.group_all_reduce_with_norms([tf.constant([1, 2])])
        raise AssertionError("an int tensor must be refused")
    except TypeError as e:
        assert "dtype int32 is not supported" in str(e), e


@check
def broadcast_from_every_root():
    rank, size = kungfu.rank(), kungfu.size()
    for root in range(size):
        for dtype in COPY_DTYPES:
            for shape in [[0], [7], [2, 3]] + ([[BIG]] if dtype == tf.float32 else []):
                y = kungfu.broadcast(data(rank, shape, dtype), root=root)
                assert_equal(y, data(root, shape, dtype), f"root {root} {dtype.name} {shape}")

    @tf.function
    def f(x):
        return [kungfu.broadcast(x, root=r) for r in range(size)]

    for root, y in enumerate(f(data(rank, [4], tf.int64))):
        assert_equal(y, data(root, [4], tf.int64), f"in function, root {root}")


@check
def all_gather_differing_first_dims():
    rank, size = kungfu.rank(), kungfu.size()
    for dtype in COPY_DTYPES:
        y = kungfu.all_gather(data(rank, [ROWS[rank % 4], 3], dtype))
        want = np.concatenate([data(r, [ROWS[r % 4], 3], dtype) for r in range(size)])
        assert_equal(y, want, f"{dtype.name} rows {ROWS[:size]}")
    big = [BIG // 3 + r for r in range(size)]
    y = kungfu.all_gather(data(rank, [big[rank]], tf.float32))
    assert_equal(y, np.concatenate([data(r, [big[r]], tf.float32) for r in range(size)]), "big")
    assert_equal(kungfu.all_gather(np.int32(rank * 10)), np.arange(size, dtype=np.int32) * 10, "scalars")

    @tf.function
    def f(x):
        return kungfu.all_gather(x)

    y = f(tf.constant(data(rank, [ROWS[rank % 4], 2, 2], tf.float64)))
    assert_equal(y, np.concatenate([data(r, [ROWS[r % 4], 2, 2], tf.float64) for r in range(size)]), "in function")


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


@check
def python_objects():
    rank, size = kungfu.rank(), kungfu.size()
    for root in range(size):
        mine = {"root": rank, "config": [1.5, None, "x" * rank], "big": bytes(range(256)) * 4000 * (rank + 1)}
        got = kungfu.broadcast_object(mine, root=root)
        assert got == {"root": root, "config": [1.5, None, "x" * root], "big": bytes(range(256)) * 4000 * (root + 1)}, \
            f"broadcast_object from {root}: {str(got)[:80]}"
    gathered = kungfu.all_gather_object(("rank", rank, list(range(rank))))
    assert gathered == [("rank", r, list(range(r))) for r in range(size)], gathered
    assert kungfu.all_gather_object(None, name="nones") == [None] * size

    # A worker that cannot pickle its object raises its own error; the others raise KungFuError naming it,
    # and none waits for bytes that never come.
    bad = size - 1
    try:
        kungfu.broadcast_object(_Unpicklable() if rank == bad else 0, root=bad)
        raise AssertionError("broadcast_object of an unpicklable object returned")
    except TypeError as e:
        assert rank == bad and "refuses" in str(e), (rank, e)
    except kungfu.errors.KungFuError as e:
        assert rank != bad and f"rank {bad}" in str(e), (rank, e)
    try:
        kungfu.all_gather_object(_Unpicklable() if rank == bad else rank)
        raise AssertionError("all_gather_object with an unpicklable object returned")
    except TypeError as e:
        assert rank == bad and "refuses" in str(e), (rank, e)
    except kungfu.errors.KungFuError as e:
        assert rank != bad and f"rank(s) {bad} " in str(e), (rank, e)
    assert kungfu.broadcast_object("still in step", root=0) == "still in step"  # the workers still agree

    @tf.function
    def in_function():
        return kungfu.broadcast_object(1)

    try:
        in_function()
        raise AssertionError("broadcast_object inside tf.function did not raise")
    except RuntimeError as e:
        assert "eagerly only" in str(e), e


@check
def barrier_and_consensus():
    rank, size = kungfu.rank(), kungfu.size()
    kungfu.barrier()
    same = data(0, [6], tf.float32)
    assert bool(kungfu.consensus(same)), "identical inputs"
    assert bool(kungfu.consensus(tf.zeros([0], tf.int8))), "empty inputs"
    differs = data(min(rank, 1), [6], tf.float32)
    assert bool(kungfu.consensus(differs)) == (size == 1), "rank 1's input differs"
    shaped = np.zeros([2, 3] if rank == 0 else [3, 2], np.int32)
    assert bool(kungfu.consensus(shaped)) == (size == 1), "same bytes, other shape"
    typed = np.zeros([4], np.int32 if rank == 0 else np.float32)
    assert bool(kungfu.consensus(typed)) == (size == 1), "same bytes, other dtype"

    @tf.function
    def f(x):
        kungfu.barrier()
        return kungfu.consensus(x), kungfu.consensus(x + tf.cast(kungfu.rank(), tf.float32))

    a, b = f(tf.constant(same))
    assert bool(a) and bool(b) == (size == 1), "in function"


@check
def gradients_through_collectives():
    """tape.gradient through each collective, eagerly and in a tf.function: the gradient of the sum of all
    workers' losses, where worker k's loss weighs the collective's output by k + 1 (Horovod's definitions,
    kungfu/ops/_gradients.py). Worker k's w is k + 1, and d(w*w)/dw = 2w."""
    rank, size = kungfu.rank(), kungfu.size()
    w = tf.Variable(tf.fill([3], float(rank + 1)))
    c = float(rank + 1)
    total_c = size * (size + 1) / 2  # the sum of the workers' weights
    # all_gather's output weighs row j by j + 1; this worker's rows are 3 * rank + 1 ... 3 * rank + 3.
    gathered_rows = np.arange(1.0, 4.0) + 3 * rank
    cases = {
        "all_reduce sum": (lambda: c * kungfu.all_reduce(w * w), total_c),
        "all_reduce mean": (lambda: c * kungfu.all_reduce(w * w, op="mean"), total_c / size),
        "group_all_reduce": (lambda: c * kungfu.group_all_reduce([w * w, 2 * w])[0], total_c),
        "broadcast": (lambda: c * kungfu.broadcast(w * w, root=size - 1), total_c if rank == size - 1 else 0.0),
        "all_gather": (lambda: c * tf.range(1.0, 1.0 + 3 * size) * kungfu.all_gather(w * w),
                       total_c * gathered_rows),
    }
    for what, (fn, weight) in cases.items():
        def grad(fn=fn):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(fn())
            return tape.gradient(loss, w)

        want = (np.ones(3) * weight * 2 * (rank + 1)).astype(np.float32)
        assert_equal(grad(), want, f"{what}, eagerly")
        assert_equal(tf.function(grad)(), want, f"{what}, in a tf.function")

    def gather_grad():  # rank 0 takes it eagerly, the others in a tf.function: their gradient keys meet
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.range(1.0, 1.0 + 3 * size) * kungfu.all_gather(w * w, name="grad/mixed"))
        return tape.gradient(loss, w)

    assert_equal(gather_grad() if rank == 0 else tf.function(gather_grad)(),
                 (size * gathered_rows * 2 * (rank + 1)).astype(np.float32), "all_gather, eager on rank 0 only")

    @tf.function
    def two_passes():  # one persistent tape, two backward passes through one collective, in one graph
        with tf.GradientTape(persistent=True) as tape:
            y = kungfu.all_reduce(w * w, name="grad/two_passes")
            first, second = tf.reduce_sum(c * y), tf.reduce_sum(100 * c * y)
        return tape.gradient(first, w), tape.gradient(second, w)

    for _ in range(3):
        g1, g2 = two_passes()
        want = (np.ones(3) * total_c * 2 * (rank + 1)).astype(np.float32)
        assert_equal(g1, want, "the first of two backward passes in one function")
        assert_equal(g2, 100 * want, "the second of two backward passes in one function")
    try:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(kungfu.all_reduce(w * w, op="max"))
        tape.gradient(loss, w)
        raise AssertionError("a gradient through all_reduce(op='max') raised nothing")
    except ValueError as e:
        assert "sum and mean only" in str(e), e


@check
def sender_thread_as_configured():
    """The engine's sender thread (kf_send) runs where there is a peer to write to and KUNGFU_SEND_THREAD is 1,
    or, by default (-1), where this process may run on at least two cores per worker on its host (so not on
    a 2-core machine with 2 or more workers); never with 0. test_collectives_with_the_sender_thread forces
    it on."""
    names = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.add(f.read().strip())
    setting = os.environ.get("KUNGFU_SEND_THREAD", "-1")
    wanted = {"1": True, "0": False}.get(setting, len(os.sched_getaffinity(0)) >= 2 * kungfu.local_size())
    assert ("kf_send" in names) == (wanted and kungfu.size() > 1), (setting, sorted(names))


def run_checks():
    return mp.run_checks(CHECKS + collectives_meeting_checks.CHECKS, kungfu.rank())


def main():
    kungfu.init()
    # No barrier before finalizing on purpose: the error checks leave the workers' totals of collectives
    # unequal (a worker that fails a mismatch at once starts fewer than one that got further), and a peer's
    # finalizing notice must still fail none of the collectives a slower worker is finishing.
    sys.exit(1 if run_checks() else 0)


if __name__ == "__main__":
    main()
