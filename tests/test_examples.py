"""The training examples run to the end under kfrun and say what they should, and reject bad flags.

Each example runs on 2 workers with few epochs: a smoke test that the scripts users copy still work
with the API, not a test of how well they train (tests/test_training_mp.py does that). A bad flag value
stops an example, run as one process, with a one-line usage error before it trains anything.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from mp import launch_script

pytestmark = pytest.mark.usefixtures("kungfu_library")


def run_example(name, flags, tmp_path):
    script = os.path.join(REPO, "examples", name)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    code, out = launch_script(2, script, flags, pid_dir, timeout=60, budget=240)
    assert code == 0, out[-6000:]
    return out


def expect(out, *patterns):
    for pattern in patterns:
        assert re.search(pattern, out, re.MULTILINE), f"no line matches {pattern!r} in:\n{out[-6000:]}"


def test_keras_digits(tmp_path):
    out = run_example("keras_digits.py", ["--epochs=2", f"--out={tmp_path / 'ckpt'}"], tmp_path)
    expect(out,
           r"^\[0\] before the broadcast, the workers' initial models are identical: False$",
           r"^\[0\] after the broadcast, the 2 worker\(s\) start identical: True$",
           r"^\[0\] test accuracy: 0\.\d+",
           r"^\[0\] after training, the workers' models are identical: True$",
           r"^\[0\] rank 0 wrote the checkpoint .*digits\.weights\.h5")
    assert os.listdir(tmp_path / "ckpt") == ["digits.weights.h5"]


def test_custom_loop(tmp_path):
    out = run_example("custom_loop.py", ["--epochs=2", "--steps_per_epoch=5"], tmp_path)
    expect(out,
           r"^\[0\] epoch 2/2: loss \d+\.\d+, accuracy \d\.\d+, \d+ images/s$",
           r"^\[0\] the workers' models are identical: True$")


def test_pair_averaging_and_switch(tmp_path):
    out = run_example("pair_averaging.py", ["--epochs=2", "--final_epochs=1", "--final_strategy=sma"], tmp_path)
    expect(out,
           r"^\[0\] epoch  1/2 pair_averaging +loss .* spread \d\.\d+$",
           r"^\[0\] epoch  2/2 sma +loss .* spread \d\.\d+$",
           r"^\[0\] test accuracy of each worker's model: 0\.\d+, 0\.\d+$",
           r"^\[0\] test accuracy of the workers' mean model, now on every worker: 0\.\d+$")


def test_adaptive_batch(tmp_path):
    out = run_example("adaptive_batch.py", ["--quick", "--test_size=500", f"--out_dir={tmp_path / 'out'}"], tmp_path)
    expect(out,
           r"^\[0\] 2 workers; 4000 training and 500 test images",  # --quick's train_size, the explicit test_size
           r"^\[0\] fixed small: \d+ steps, \d+ samples in \d+\.\d s of training, batch 64, final test accuracy",
           r"^\[0\] \| adaptive \| 64( -> \d+)? \| 0\.05 \| ",
           r"^\[0\] - Target: adaptive reaches 0\.7 in <= 0\.75x the time of the best fixed batch: (met|NOT met)\.$",
           r"^\[0\] What the policy did in the adaptive run: it started at global batch 64",
           r"^\[0\] wrote .*adaptive_batch\.png and .*adaptive_batch\.md$")
    assert sorted(os.listdir(tmp_path / "out")) == ["adaptive_batch.md", "adaptive_batch.png"]


BAD_FLAGS = [
    ("keras_digits.py", ["--epochs=0"], r"flag --epochs=0: 0 is not a positive integer"),
    ("keras_digits.py", ["--batch_size=0"], r"flag --batch_size=0: 0 is not a positive integer"),
    ("pair_averaging.py", ["--epochs=2", "--final_epochs=3"], r"--final_epochs must be between 0 and --epochs"),
    ("custom_loop.py", ["--steps_per_epoch=0"], r"flag --steps_per_epoch=0: 0 is not a positive integer"),
    ("rewrite_step.py", ["--batch_size=5000"], r"^--batch_size=5000 is more than each worker's 1500 training images"),
    ("monitor_gns.py", ["--monitor_interval=0"], r"flag --monitor_interval=0: 0 is not a positive integer"),
    ("adaptive_batch.py", ["--runs=fixed:64:-0.1"], r"'fixed:64:-0.1' is none of small, large, adaptive"),
    ("adaptive_batch.py", ["--targets=abc"], r"'abc' is not a test accuracy in \(0, 1\]"),
    ("adaptive_batch.py", ["--min_batch=512", "--max_batch=64"], r"--min_batch must be at most --max_batch"),
    # an explicit flag wins over --quick's value for it; --quick still sets the others
    ("adaptive_batch.py", ["--quick", "--main_target=0.9"], r"^--main_target=0.9 is not one of --targets=0.6,0.7$"),
]
PARALLEL = 2  # bad-flag cases running at once: each is a fresh process that imports TensorFlow (about 9 s of a core)


class BadFlagRuns:
    """The bad-flag cases, each run as `python example.py FLAGS` into an output file, PARALLEL at a time in
    the order of BAD_FLAGS (pytest's), so that the next one imports TensorFlow while a test checks the last.
    result(i) waits for case i, starting it first when it has not started (a -k selection), and returns its
    exit code (None when it was killed at its 120 s deadline) and output. close() kills what still runs."""

    def __init__(self, directory):
        self.directory = directory
        self.pending = list(range(len(BAD_FLAGS)))  # cases not started, in the order they start
        self.started = {}  # case index -> (Popen, its output file, its deadline)
        self.results = {}  # case index -> (exit code, output)

    def _start_next(self):
        i = self.pending.pop(0)
        name, flags, _ = BAD_FLAGS[i]
        out = open(self.directory / f"case{i}.out", "w+")
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, "examples", name), *flags], stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.started[i] = (proc, out, time.monotonic() + 120)

    def _reap(self):
        for i, (proc, out, deadline) in self.started.items():
            if i in self.results:
                continue
            late = proc.poll() is None and time.monotonic() > deadline
            if late:
                _kill_group(proc)
            if proc.returncode is not None:
                out.seek(0)
                self.results[i] = (None if late else proc.returncode, out.read())  # None: killed at the deadline
                out.close()

    def result(self, i):
        if i in self.pending:
            self.pending.remove(i)
            self.pending.insert(0, i)
        while i not in self.results:
            self._reap()
            while self.pending and len(self.started) - len(self.results) < PARALLEL:
                self._start_next()
            if i not in self.results:
                time.sleep(0.05)
        return self.results[i]

    def close(self):
        for i, (proc, out, _) in self.started.items():
            if i not in self.results:
                _kill_group(proc)
                out.close()


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session (start_new_session): whatever it started too
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module")
def bad_flag_runs(tmp_path_factory):
    runs = BadFlagRuns(tmp_path_factory.mktemp("bad_flags"))
    try:
        yield runs
    finally:
        runs.close()


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=[f"{n}-{' '.join(f)}" for n, f, _ in BAD_FLAGS])
def test_bad_flag_is_a_usage_error(case, bad_flag_runs):
    code, out = bad_flag_runs.result(case)
    error = BAD_FLAGS[case][2]
    assert code is not None, f"still running after 120 s:\n{out[-6000:]}"
    assert code != 0, out[-6000:]
    assert re.search(error, out, re.MULTILINE), f"no line matches {error!r} in:\n{out[-6000:]}"
    assert "Traceback" not in out, out[-6000:]
