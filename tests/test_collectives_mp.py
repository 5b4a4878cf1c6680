"""Collectives across real worker processes started by kfrun (np 1 to 4).

Each np is one launch of tests/collectives_worker.py, which runs every check (values for every op,
dtype and reduction on odd sizes, broadcast from every root, all-gather with differing first dims,
consensus, mismatches, rank-dependent order, concurrency inside tf.function) and reports each one;
see that file. One more launch kills a worker with SIGKILL in the middle of a collective.

Every process a test starts is killed when the test ends, on every path: the launcher runs in its
own process group, and each worker writes its pid to a directory first thing, so leftovers are
SIGKILLed (with their process groups) in a finally block.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO

pytestmark = pytest.mark.usefixtures("kungfu_library")  # fails, naming the fix, when it is not built

WORKER = os.path.join(REPO, "tests", "collectives_worker.py")
CHECK_LINE = re.compile(r"^\[(\d+)\] KFCHECK (\S+) (OK|FAIL) ?(.*)$")
CHECKS = ["all_reduce_values_eager", "all_reduce_values_in_one_function", "group_all_reduce_values",
          "broadcast_from_every_root", "all_gather_differing_first_dims", "barrier_and_consensus",
          "mismatches_fail_on_every_worker", "rank_dependent_order_in_one_function",
          "independent_collectives_run_together", "unused_and_identical_collectives_run"]


def _kill(pid):
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def port_range():
    """Engine ports of this test process: 20 ports in 12000-19999, away from kfrun's default range, so that
    jobs running at the same time on this machine (other test runs, benchmarks) rarely pick the same port."""
    first = 12000 + (os.getpid() % 400) * 20
    return f"{first}-{first + 19}"


def launch(np_, mode, pid_dir, timeout, budget):
    """Runs the worker under kfrun; returns (exit code, output). Kills everything it started."""
    env = dict(os.environ, KF_TEST_PID_DIR=str(pid_dir), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "kungfu.launcher", "-np", str(np_), "--timeout", str(timeout), "--grace", "5",
           "--port-range", port_range(), "--", sys.executable, WORKER, mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=budget)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"kfrun -np {np_} {mode} did not finish within {budget} s:\n{out[-6000:]}")
    finally:
        _kill(proc.pid)
        for name in os.listdir(pid_dir):
            _kill(int(name))


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_collectives(np_, tmp_path):
    code, out = launch(np_, "checks", tmp_path, timeout=30, budget=240)
    results = {}  # (rank, check) -> "OK" or the failure reason
    for line in out.splitlines():
        m = CHECK_LINE.match(line)
        if m:
            results[(int(m.group(1)), m.group(2))] = "OK" if m.group(3) == "OK" else m.group(4)
    problems = [f"rank {rank} {check}: {results.get((rank, check), 'no report')}"
                for check in CHECKS for rank in range(np_) if results.get((rank, check)) != "OK"]
    assert not problems, "\n".join(problems) + "\n--- output tail ---\n" + out[-4000:]
    assert code == 0, out[-4000:]


def test_peer_killed_mid_collective(tmp_path):
    timeout = 20
    start = time.monotonic()
    _, out = launch(3, "kill", tmp_path, timeout=timeout, budget=120)
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
