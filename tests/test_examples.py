"""The training examples run to the end under kfrun and say what they should, and reject bad flags.

Each example runs on 2 workers with few epochs: a smoke test that the scripts users copy still work
with the API, not a test of how well they train (tests/test_training_mp.py does that). A bad flag value
stops an example, run as one process, with a one-line usage error before it trains anything.
"""

import os
import re
import subprocess
import sys

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


@pytest.mark.parametrize("name, flags, error", [
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
])
def test_bad_flag_is_a_usage_error(name, flags, error):
    script = os.path.join(REPO, "examples", name)
    run = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-6000:]
    assert re.search(error, out, re.MULTILINE), f"no line matches {error!r} in:\n{out[-6000:]}"
    assert "Traceback" not in out, out[-6000:]
