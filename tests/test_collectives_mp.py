"""Collectives across real worker processes started by kfrun (np 1 to 4).

Each np is one launch of tests/collectives_worker.py, which runs every check (values for every op,
dtype and reduction on odd sizes, broadcast from every root, all-gather with differing first dims,
consensus, mismatches, rank-dependent order, concurrency inside tf.function) and reports each one;
see that file. One more launch runs the same checks with the engine's sender thread forced on, one kills a
worker with SIGKILL in the middle of a collective, and another has one worker finalize while the others stay.

Every process a test starts is killed when the test ends, on every path (tests/mp.py).
"""

import json
import os
import re
import time

import pytest

from conftest import REPO
from mp import assert_checks_passed, launch

pytestmark = pytest.mark.usefixtures("kungfu_library")  # fails, naming the fix, when it is not built

WORKER = os.path.join(REPO, "tests", "collectives_worker.py")
FAILURES = os.path.join(REPO, "tests", "failures_worker.py")
CHECKS = ["all_reduce_values_eager", "eager_collectives_around_tf_meet_the_op", "all_reduce_values_in_one_function",
          "group_all_reduce_values", "group_all_reduce_with_norms_values",
          "broadcast_from_every_root", "all_gather_differing_first_dims", "python_objects", "barrier_and_consensus",
          "gradients_through_collectives",
          "mismatches_fail_on_every_worker", "rank_dependent_order_in_one_function",
          "independent_collectives_run_together", "unused_and_identical_collectives_run", "later_trace_and_saved_model",
          "forked_child_keeps_off_the_engine", "nested_calls_meet_in_order",
          "eager_collectives_from_several_threads", "sender_thread_as_configured"]


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_collectives(np_, tmp_path):
    code, out = launch(np_, [WORKER], tmp_path, timeout=30, budget=240)
    assert_checks_passed(code, out, CHECKS, np_)


def test_collectives_with_the_sender_thread(tmp_path):
    """The same checks with the engine's sender thread forced on, which the auto rule keeps off on a machine
    with fewer than two cores per worker (CI's): the 4 MB values go out in pieces of 1 MiB, each written by
    the sender thread while the TF kernels' collectives run on the loop (docs/engine.md, Threads)."""
    code, out = launch(2, [WORKER], tmp_path, timeout=30, budget=240, env={"KUNGFU_SEND_THREAD": "1"})
    assert_checks_passed(code, out, CHECKS, 2)


def test_peer_killed_mid_collective(tmp_path):
    timeout = 20
    start = time.monotonic()
    _, out = launch(3, [FAILURES, "kill"], tmp_path, timeout=timeout, budget=120)
    reports = {}
    for line in out.splitlines():
        m = re.match(r"^\[(\d+)\] KFKILL (.*)$", line)
        if m:
            reports[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(reports) == [0, 1], out[-4000:]  # every survivor reported; the victim (rank 2) did not
    for rank, report in reports.items():
        for step in ["victim", "after", "in-function"]:
            r = report[step]
            assert r["error"] == "UnavailableError", f"rank {rank} {step}: {r}"
            assert "peer " in r["message"] and "(rank 2)" in r["message"], f"rank {rank} {step}: peer not named: {r}"
            assert r["seconds"] < timeout, f"rank {rank} {step} took {r['seconds']} s"
        assert report["after"]["seconds"] < 2, "a collective after the peer died must fail at once"
    assert time.monotonic() - start < 100


def test_finalized_peer_is_named_as_having_left(tmp_path):
    code, out = launch(3, [FAILURES, "leave"], tmp_path, timeout=20, budget=120)
    assert code == 0, out[-4000:]
    reports = {}
    for line in out.splitlines():
        m = re.match(r"^\[(\d+)\] KFLEAVE (.*)$", line)
        if m:
            reports[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(reports) == [1, 2], out[-4000:]
    for rank, r in reports.items():
        assert r["error"] == "UnavailableError", f"rank {rank}: {r}"
        assert "(rank 0)" in r["message"] and "has left the cluster" in r["message"], f"rank {rank}: {r}"
        assert r["seconds"] < 2, f"rank {rank}: a collective after a peer left must fail at once: {r}"


def test_worker_that_exits_early_fails_its_peers_at_once(tmp_path):
    """sys.exit(3) on rank 1 while the others wait in a collective: they fail within seconds, not at the
    60 s timeout, and kfrun exits with rank 1's code."""
    start = time.monotonic()
    code, out = launch(3, [FAILURES, "exit"], tmp_path, timeout=60, budget=120)
    reports = {}
    for line in out.splitlines():
        m = re.match(r"^\[(\d+)\] KFEXIT (.*)$", line)
        if m:
            reports[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(reports) == [0, 2], out[-4000:]
    for rank, r in reports.items():
        assert r["error"] == "UnavailableError", f"rank {rank}: {r}"
        assert "(rank 1)" in r["message"] and "finalize" in r["message"], f"rank {rank}: {r}"
        assert r["seconds"] < 10, f"rank {rank}: took {r['seconds']} s (the timeout is 60 s)"
    assert code == 3, out[-4000:]
    assert time.monotonic() - start < 50, out[-4000:]


def test_a_worker_whose_collective_timed_out_does_not_wait_for_the_stalled_peer_again(tmp_path):
    """Rank 1 stalls: rank 0's all-reduce fails at the 4 s timeout naming it, and rank 0's finalize skips
    the barrier (the stalled peer would hold it another 4 s); kfrun then stops rank 1 as stalled."""
    code, out = launch(2, [FAILURES, "stall"], tmp_path, timeout=4, budget=90)
    m = re.search(r"^\[0\] KFSTALL (.*)$", out, re.M)
    assert m, out[-4000:]
    report = json.loads(m.group(1))
    assert report["error"] == "DeadlineExceededError" and "waiting for rank 1" in report["message"], report
    assert "leaving without waiting for the others" in out, out[-4000:]
    assert code == 124, out[-4000:]  # kfrun's code for a worker still running after the others finished
