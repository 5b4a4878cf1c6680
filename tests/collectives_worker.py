"""The worker of test_collectives_mp.py, started N times by kfrun. Not a test module itself.

    python -m kungfu.launcher -np N -- python tests/collectives_worker.py checks
    python -m kungfu.launcher -np 3 -- python tests/collectives_worker.py kill

`checks` runs every multi-worker check in one process (TF costs seconds and 600 MB per process, so
one launch per np, not per case) and prints one line per check: "KFCHECK <name> OK <seconds>" or
"KFCHECK <name> FAIL <reason>", then "KFDONE". Every worker can compute every rank's input, so
each checks exact values on its own. `kill` makes the last rank SIGKILL itself in the middle of a
collective and prints how the others saw it: "KFKILL <json>".
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import json  # noqa: E402 (after the pid file on purpose)
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
from kungfu import _lib  # noqa: E402

REDUCE_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
COPY_DTYPES = REDUCE_DTYPES + [tf.uint8, tf.int8, tf.bool]
REDUCE_OPS = ["sum", "mean", "min", "max", "prod"]
BIG = 1000003
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def data(rank, shape, dtype, op="sum", salt=0):
    """Rank rank's input: small integers, so every reduction is exact in every dtype."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64) + salt
    if op == "prod":
        v = np.array([1, -1, 2, -2, 1, 1, -1])[(i * 3 + rank) % 7]  # |product of 4| <= 16
    else:
        v = (i * 7 + rank * 3) % 11 - 5
    if dtype == tf.bool:
        return (v > 0).reshape(shape)
    if dtype == tf.uint8:
        v = v + 5
    return v.reshape(shape).astype(dtype.as_numpy_dtype)


def expected_reduce(shape, dtype, op, size, salt=0):
    xs = np.stack([data(r, shape, dtype, op, salt).astype(np.float64) for r in range(size)])
    np_dtype = dtype.as_numpy_dtype
    if op == "sum":
        return xs.sum(0).astype(np_dtype)
    if op == "prod":
        return xs.prod(0).astype(np_dtype)
    if op == "min":
        return xs.min(0).astype(np_dtype)
    if op == "max":
        return xs.max(0).astype(np_dtype)
    total = xs.sum(0)
    if dtype.is_integer:  # the engine truncates toward zero, as C++ does
        return (np.sign(total) * (np.abs(total) // size)).astype(np_dtype)
    if dtype == tf.float64:
        return total / size
    return (total.astype(np.float32) / np.float32(size)).astype(np_dtype)  # half types divide in float32


def assert_equal(got, want, what):
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, want {want.shape}")
    if got.dtype != want.dtype:
        raise AssertionError(f"{what}: dtype {got.dtype}, want {want.dtype}")
    g, w = got.astype(np.float64), want.astype(np.float64)
    bad = np.flatnonzero(g.ravel() != w.ravel())
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} elements differ, first at {i}: {g.ravel()[i]} != {w.ravel()[i]}")


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


ROWS = [2, 0, 3, 1]  # rows of rank r: ROWS[r % 4], so some worker has none from np 2 on


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


def run_checks():
    return mp.run_checks(CHECKS, kungfu.rank())


def run_kill():
    """The last rank dies with SIGKILL while every rank is inside one all-reduce."""
    rank, size = kungfu.rank(), kungfu.size()
    victim = size - 1
    x = tf.ones([16 << 20])  # 64 MB: far too much to finish before the victim dies
    kungfu.barrier(name="before-kill")
    if rank == victim:
        threading.Thread(target=lambda: kungfu.all_reduce(x, name="victim"), daemon=True).start()
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    in_function = tf.function(lambda x: kungfu.all_reduce(x, name="in-function"))
    steps = {"victim": lambda: kungfu.all_reduce(x, name="victim"), "after": lambda: kungfu.all_reduce(x, name="after"),
             "in-function": lambda: in_function(x)}
    report = {"rank": rank}
    for step, fn in steps.items():
        start = time.perf_counter()
        try:
            fn()
            report[step] = {"error": None}
        except tf.errors.OpError as e:
            report[step] = {"error": type(e).__name__, "message": e.message.splitlines()[0]}
        report[step]["seconds"] = round(time.perf_counter() - start, 3)
    print("KFKILL " + json.dumps(report), flush=True)


def report_all_reduce(tag, x, name):
    """Prints `tag {"error", "message", "seconds"}` for one all-reduce expected to fail."""
    start = time.perf_counter()
    try:
        kungfu.all_reduce(x, name=name)
        report = {"error": None}
    except tf.errors.OpError as e:
        report = {"error": type(e).__name__, "message": e.message.splitlines()[0]}
    report["seconds"] = round(time.perf_counter() - start, 3)
    print(f"{tag} " + json.dumps(report), flush=True)


def run_leave():
    """Rank 0 calls kungfu.finalize(); the others take part in its barrier (the same call finalize makes)
    without leaving, then try one more collective: it must fail at once, naming rank 0 as having left
    the cluster (its goodbye), not as a closed connection (a crash)."""
    x = tf.ones([4])
    kungfu.barrier(name="before-leave")
    if kungfu.rank() == 0:
        kungfu.finalize()
        return
    assert _lib._finalize_barrier(), "the finalize barrier failed"
    report_all_reduce("KFLEAVE", x, "after-leave")
    time.sleep(1)  # let the other stayer report before this one's exit closes its connections
    os._exit(0)  # its own finalize would only find rank 0 gone


def run_exit():
    """Rank 1 leaves its loop with sys.exit(3) while the others start one more all-reduce: its finalize
    tells them it will not join, so theirs fail at once naming it (not at the timeout, while it waited
    in the finalize barrier). They then finalize too and meet it in that barrier."""
    x = tf.ones([4])
    kungfu.barrier(name="before-exit")
    if kungfu.rank() == 1:
        sys.exit(3)
    report_all_reduce("KFEXIT", x, "after-exit")


def run_stall():
    """Rank 1 stalls (it sleeps until kfrun stops it); rank 0's all-reduce times out naming it, and rank 0's
    finalize then leaves at once instead of waiting another timeout for it in the barrier."""
    kungfu.barrier(name="before-stall")
    if kungfu.rank() == 1:
        time.sleep(120)
    report_all_reduce("KFSTALL", tf.ones([4]), "stalled")


def main():
    kungfu.init()
    if sys.argv[1] == "checks":
        sys.exit(1 if run_checks() else 0)
    if sys.argv[1] == "leave":
        return run_leave()
    if sys.argv[1] == "exit":
        return run_exit()
    if sys.argv[1] == "stall":
        return run_stall()
    run_kill()


if __name__ == "__main__":
    main()
