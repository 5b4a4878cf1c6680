"""A tour of kungfu's collectives that checks its own results.

    kfrun -np 4 python3 examples/demo.py        (or: python3 -m kungfu.launcher -np 4 -- python3 examples/demo.py)

Every worker runs the same steps, each a few collectives whose exact result every worker can
compute on its own. The workers then agree (an all-reduce of their pass/fail flags and timings) and
rank 0 prints one table; the others print one line each. Exits 1 if any step failed anywhere.
"""

import os
import sys
import time

# Hides TensorFlow's C++ INFO and WARNING logs; ERRORs pass, such as oneDNN's "DT_HALF only on platforms with
# AVX-512" (the float16 checks). TF 2.21 prints its oneDNN notice (twice) regardless: it is logged before TF's
# logging is set up, where no level applies; only TF_ENABLE_ONEDNN_OPTS=0 (oneDNN off) drops it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402


def rank_data(r, n, dtype):
    """Worker r's input: small integers, exact in every dtype."""
    return ((np.arange(n) + 3 * r) % 7 - 3).astype(dtype)


def check_all_reduce(rank, size):
    for dtype in [np.float32, np.float64, np.float16, np.int32, np.int64]:
        xs = np.stack([rank_data(r, 1000, dtype).astype(np.float64) for r in range(size)])
        for op, want in [("sum", xs.sum(0)), ("min", xs.min(0)), ("max", xs.max(0))]:
            got = kungfu.all_reduce(rank_data(rank, 1000, dtype), op=op).numpy()
            np.testing.assert_array_equal(got, want.astype(dtype), err_msg=f"{op} {np.dtype(dtype).name}")
    got = kungfu.all_reduce(tf.fill([10], 2.0), op="prod")
    np.testing.assert_array_equal(got, np.full([10], 2.0**size, np.float32), err_msg="prod")
    got = kungfu.all_reduce(tf.fill([10], float(rank)), op="mean")
    np.testing.assert_allclose(got, np.full([10], (size - 1) / 2, np.float32), err_msg="mean")
    return "sum/min/max x 5 dtypes, prod, mean"


def check_group_all_reduce(rank, size):
    xs = [tf.fill([n], float(rank + 1)) for n in (1, 10, 100, 1 << 20)]
    for x, y in zip(xs, kungfu.group_all_reduce(xs)):
        np.testing.assert_array_equal(y, np.full(x.shape, size * (size + 1) / 2, np.float32))
    return "4 tensors: 3 fused in one bucket, 1 alone"


def check_broadcast(rank, size):
    for root in range(size):
        got = kungfu.broadcast(rank_data(rank, 100, np.int64), root=root).numpy()
        np.testing.assert_array_equal(got, rank_data(root, 100, np.int64), err_msg=f"root {root}")
    return f"int64 from each of {size} roots"


def check_all_gather(rank, size):
    rows = lambda r: r + 1  # noqa: E731 (worker r contributes r + 1 rows)
    got = kungfu.all_gather(np.full([rows(rank), 2], rank, np.int32)).numpy()
    want = np.concatenate([np.full([rows(r), 2], r, np.int32) for r in range(size)])
    np.testing.assert_array_equal(got, want)
    return f"first dims {[rows(r) for r in range(size)]}"


def check_barrier(rank, size):
    kungfu.barrier()
    return "all arrived"


def check_consensus(rank, size):
    assert bool(kungfu.consensus(tf.constant([1, 2, 3]))), "same values must agree"
    differs = bool(kungfu.consensus(tf.constant([rank])))
    assert differs == (size == 1), "rank-dependent values must disagree"
    return "same -> True, rank-dependent -> " + ("True (size 1)" if size == 1 else "False")


def check_in_function(rank, size):
    @tf.function
    def step(x):  # independent collectives in one function run concurrently
        return kungfu.all_reduce(x), kungfu.broadcast(x, root=size - 1), kungfu.all_gather(x)

    s, b, g = step(tf.fill([4], float(rank)))
    np.testing.assert_array_equal(s, np.full([4], size * (size - 1) / 2, np.float32))
    np.testing.assert_array_equal(b, np.full([4], size - 1, np.float32))
    np.testing.assert_array_equal(g, np.repeat(np.arange(size, dtype=np.float32), 4))
    return "all_reduce + broadcast + all_gather"


STEPS = [("all_reduce", check_all_reduce), ("group_all_reduce", check_group_all_reduce),
         ("broadcast", check_broadcast), ("all_gather", check_all_gather), ("barrier", check_barrier),
         ("consensus", check_consensus), ("tf.function", check_in_function)]


def main():
    kungfu.init()
    rank, size = kungfu.rank(), kungfu.size()
    results = []  # (name, ok, seconds, detail)
    for name, fn in STEPS:
        start = time.perf_counter()
        try:
            detail, ok = fn(rank, size), True
        except Exception as e:  # report, and keep the workers in step for the next one
            detail, ok = f"{type(e).__name__}: {e}".splitlines()[0][:60], False
        results.append((name, ok, time.perf_counter() - start, detail))
    # Agree on the outcome: a step passed only if it passed everywhere; report the slowest worker.
    oks = kungfu.all_reduce(np.array([float(r[1]) for r in results]), op="min", name="demo/ok").numpy()
    secs = kungfu.all_reduce(np.array([r[2] for r in results]), op="max", name="demo/seconds").numpy()
    failed = int((oks == 0).sum())
    if rank == 0:
        print(f"kungfu demo: {size} worker(s)")
        print(f"  {'step':<18}{'result':<8}{'time':>9}  detail")
        for (name, _, _, detail), ok, t in zip(results, oks, secs):
            print(f"  {name:<18}{'OK' if ok else 'FAIL':<8}{t * 1000:>7.1f}ms  {detail}")
        print(f"{len(STEPS) - failed} of {len(STEPS)} steps OK on every worker")
    else:
        mine = [name for name, ok, _, _ in results if not ok]
        print(f"rank {rank}: " + (f"FAILED {', '.join(mine)}" if mine else "all steps OK"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
