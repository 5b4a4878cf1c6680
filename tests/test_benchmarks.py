"""The benchmarks still run: one small launch of each, whose report must have every row it asked for.

A smoke test, not a speed test: nothing here looks at the figures beyond their being there. It exists
because a benchmark mode that patches library internals (the training benchmark's collectives-skipped
run) broke silently once when the patched function gained an argument.
"""

import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.usefixtures("kungfu_library")


def run_benchmark(script, flags, budget):
    """Runs benchmarks/<script> flags...; returns its output. Kills everything it started on every path:
    SIGINT first (the drivers kill their launches on the way out), then SIGKILL to the session."""
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", script), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{script} did not finish within {budget} s:\n{out[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]
    return out


def table_row(report, *first_cells):
    """The cells of the first markdown table row whose leading cells are first_cells, or None."""
    for line in report.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if tuple(cells[:len(first_cells)]) == first_cells:
                return cells
    return None


NUMBER = re.compile(r"[0-9.]+")


def test_training_benchmark_runs_with_and_without_collectives(tmp_path):
    out_md = tmp_path / "training.md"
    out = run_benchmark("training.py", ["--quick", "--models=mlp", "--systems=kungfu,kungfu_nocomm",
                                        f"--out={out_md}"], budget=240)
    report = out_md.read_text()
    assert "Failed launches" not in report, report[-6000:] + "\n--- output ---\n" + out[-3000:]
    for label in ("KungFu S-SGD, 2 workers", "KungFu, collectives skipped, 2 workers"):
        row = table_row(report, label, "mlp")
        assert row is not None and NUMBER.fullmatch(row[2]), f"{label}: {row!r} (steps/s third)\n{report}"


def test_allreduce_benchmark_runs(tmp_path):
    out_md = tmp_path / "allreduce.md"
    # engine: the bare engine compiled from cc/ by build_engine.sh, the series a lent machine without
    # TensorFlow measures (so a broken build script shows here, not in that machine's scarce time).
    out = run_benchmark("allreduce.py", ["--np=2", "--sizes=4K,1M", "--systems=kungfu,engine,raw", "--rounds=1",
                                         "--seconds=0.3", f"--out={out_md}"], budget=300)
    report = out_md.read_text()
    assert "Not measured" not in report, report[-6000:] + "\n--- output ---\n" + out[-3000:]
    table = report[report.index("## Median time"):report.index("## Ratios")]
    for size in ("4 KiB", "1 MiB"):
        row = table_row(table, "2", size)  # then the op, the engine under TF, the engine alone, the raw ring
        assert row is not None and len(row) == 6 and all(NUMBER.fullmatch(c) for c in row[2:]), f"{row!r}\n{table}"
