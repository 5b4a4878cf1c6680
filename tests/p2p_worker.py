"""The worker of the multi-process tests in test_p2p.py, started N times by kfrun. Not a test module.

    python -m kungfu.launcher -np N -- python tests/p2p_worker.py checks
    python -m kungfu.launcher -np N -- python tests/p2p_worker.py dead

`checks` runs every check and prints "KFCHECK <name> OK|FAIL ..." lines (tests/mp.py). Every worker can
compute every rank's saved tensors, so each checks exact values on its own. `dead` makes the last rank
SIGKILL itself after saving; the others report (through the same KFCHECK lines) how their requests
to it failed.
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import os  # noqa: E402 (after the pid file on purpose)
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
from kungfu.ops import p2p  # noqa: E402

BIG = 1000003  # 4 MB of float32: four pieces of the default 1 MiB
SPECS = {"f32": ([5], tf.float32), "f64": ([2, 3], tf.float64), "i64": ([7], tf.int64), "u8": ([9], tf.uint8),
         "f16": ([4], tf.float16), "bf16": ([3], tf.bfloat16), "i32": ([], tf.int32), "empty": ([0], tf.float32),
         "big": ([BIG], tf.float32)}
BUSY_SECONDS = 3.0  # how long the target sleeps or computes
CHECKS, check = mp.check_list()


def data(rank, shape, dtype, save=0):
    """What rank saves the save-th time: small integers, exact in every dtype."""
    n = int(np.prod(shape))
    v = (np.arange(n, dtype=np.int64) * 7 + rank * 3 + save * 5) % 11 + (1 if dtype == tf.uint8 else -5)
    return v.reshape(shape).astype(dtype.as_numpy_dtype)


def assert_equal(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    bad = np.flatnonzero(got.astype(np.float64).ravel() != want.astype(np.float64).ravel())
    if bad.size:
        raise AssertionError(f"{what}: {bad.size} elements differ, first at {bad[0]}")


def zeros(shape, dtype):
    return tf.zeros(shape, dtype)


@check
def every_rank_gets_every_ranks_values_and_versions():
    rank, size = kungfu.rank(), kungfu.size()
    for save in range(2):  # the second save of each name has version 1
        for key, (shape, dtype) in SPECS.items():
            version = p2p.save_variable(data(rank, shape, dtype, save), name=f"v/{key}")
            assert int(version) == save, f"save {save} of {key}: version {int(version)}"
        kungfu.barrier(name=f"v/saved/{save}")
        for target in range(size):
            for key, (shape, dtype) in SPECS.items():
                value, version = p2p.request_variable(target, zeros(shape, dtype), name=f"v/{key}")
                assert_equal(value, data(target, shape, dtype, save), f"{key} from rank {target}, save {save}")
                assert int(version) == save, f"{key} from rank {target}: version {int(version)}, want {save}"
        kungfu.barrier(name=f"v/fetched/{save}")  # nobody saves again while others fetch


@check
def not_found_gives_default_and_mismatch_names_both_sides():
    rank, size = kungfu.rank(), kungfu.size()
    p2p.save_variable(tf.zeros([2, 3]), name="m/w")
    kungfu.barrier(name="m/saved")
    for target in range(size):
        default = tf.fill([4], float(rank))
        value, version = p2p.request_variable(target, default, name="m/never-saved")
        assert int(version) == -1 and np.all(value.numpy() == rank), f"not found from {target}: {version} {value}"
        try:
            p2p.request_variable(target, tf.zeros([3, 2]), name="m/w")
            raise AssertionError(f"a [3, 2] request of a [2, 3] copy from rank {target} did not fail")
        except tf.errors.InvalidArgumentError as e:
            for word in ["m/w", "6 float32 elements", "[3,2]"]:
                assert word in e.message, f"mismatch message lacks {word!r}: {e.message}"
    kungfu.barrier(name="m/done")


@check
def requests_in_one_function_from_every_rank():
    rank, size = kungfu.rank(), kungfu.size()

    @tf.function
    def step(x):
        with tf.control_dependencies([p2p.save_variable(x, name="f/w")]):
            own, own_version = p2p.request_variable(rank, tf.zeros_like(x), name="f/w")
        return own, own_version

    @tf.function
    def fetch_all(x):
        return [p2p.request_variable(t, tf.zeros_like(x), name="f/w") for t in range(size)]

    x = tf.constant(data(rank, [6], tf.float32))
    own, own_version = step(x)
    assert_equal(own, x.numpy(), "own copy in function")
    assert int(own_version) == 0, int(own_version)
    kungfu.barrier(name="f/saved")
    for target, (value, version) in enumerate(fetch_all(x)):
        assert_equal(value, data(target, [6], tf.float32), f"from rank {target} in function")
        assert int(version) == 0, f"from rank {target}: version {int(version)}"
    kungfu.barrier(name="f/done")


def busy_target(what, busy):
    """Rank 0 saves, then is busy (sleeping or computing) for BUSY_SECONDS; the others fetch from it
    meanwhile and must be done long before it is (its engine thread answers, not its program)."""
    rank = kungfu.rank()
    shape = [1 << 18]  # 1 MB
    if rank == 0:
        p2p.save_variable(data(0, shape, tf.float32), name=f"busy/{what}")
    kungfu.barrier(name=f"busy/{what}/saved")
    if rank == 0:
        busy()
    else:
        start = time.perf_counter()
        time.sleep(0.2)  # rank 0 is surely busy by now
        for _ in range(5):
            value, version = p2p.request_variable(0, tf.zeros(shape), name=f"busy/{what}")
            assert_equal(value, data(0, shape, tf.float32), f"from the {what} rank 0")
            assert int(version) == 0, int(version)
        elapsed = time.perf_counter() - start
        print(f"busy/{what}: 5 requests to rank 0 done {elapsed:.3f} s after the barrier", flush=True)
        if elapsed > BUSY_SECONDS - 1:
            raise AssertionError(f"5 requests to the {what} rank 0 took {elapsed:.2f} s; it was busy for "
                                 f"{BUSY_SECONDS} s, so they waited for it")
    kungfu.barrier(name=f"busy/{what}/done")


@check
def requests_complete_while_the_target_sleeps():
    busy_target("sleeping", lambda: time.sleep(BUSY_SECONDS))


@check
def requests_complete_while_the_target_computes():
    def compute():  # pure Python: holds the GIL the whole time, so nothing here can answer but the engine
        end, x = time.perf_counter() + BUSY_SECONDS, 0
        while time.perf_counter() < end:
            x += 1

    busy_target("computing", compute)


def dead_target_fails_requests_promptly():
    rank, size = kungfu.rank(), kungfu.size()
    victim = size - 1
    timeout = float(os.environ.get("KUNGFU_TIMEOUT", "60"))
    shape = [1000]
    start = time.perf_counter()
    error = None
    while time.perf_counter() - start < timeout:  # found until the victim dies, then Unavailable
        try:
            value, version = p2p.request_variable(victim, tf.zeros(shape), name="dead/w")
            assert_equal(value, data(victim, shape, tf.float32), "from the victim before it died")
        except tf.errors.UnavailableError as e:
            error = e
            break
        time.sleep(0.02)
    elapsed = time.perf_counter() - start
    assert error is not None, f"no UnavailableError within {timeout} s"
    assert f"(rank {victim})" in error.message and "dead/w" in error.message, error.message
    assert elapsed < timeout, f"took {elapsed:.1f} s"
    later = time.perf_counter()
    try:
        p2p.request_variable(victim, tf.zeros(shape), name="dead/w")
        raise AssertionError("a request to the dead rank succeeded")
    except tf.errors.UnavailableError:
        pass
    assert time.perf_counter() - later < 2, "a request to a peer known dead must fail at once"
    if size > 2:  # the survivors still answer each other
        other = (rank + 1) % (size - 1)
        value, version = p2p.request_variable(other, tf.zeros(shape), name="dead/w")
        assert_equal(value, data(other, shape, tf.float32), f"from the live rank {other}")


def run_dead():
    rank, size = kungfu.rank(), kungfu.size()
    p2p.save_variable(data(rank, [1000], tf.float32), name="dead/w")
    kungfu.barrier(name="dead/saved")
    if rank == size - 1:
        time.sleep(0.5)  # the others' requests succeed meanwhile
        os.kill(os.getpid(), signal.SIGKILL)
    return mp.run_checks([dead_target_fails_requests_promptly], rank)


def main():
    kungfu.init()
    if sys.argv[1] == "checks":
        sys.exit(1 if mp.run_checks(CHECKS, kungfu.rank()) else 0)
    sys.exit(1 if run_dead() else 0)


if __name__ == "__main__":
    main()
