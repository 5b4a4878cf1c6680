"""examples/monitor_gns.py runs to the end on 2 workers, prints the monitors' values and writes its plot.

A smoke test that the script users copy still works with the monitor API (tests/monitor_worker.py checks
the values themselves).
"""

import os
import re

import pytest

from conftest import REPO
from mp import launch_script

pytestmark = pytest.mark.usefixtures("kungfu_library")


def test_monitor_gns(tmp_path):
    script = os.path.join(REPO, "examples", "monitor_gns.py")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    out_dir = tmp_path / "plot"
    code, out = launch_script(2, script, ["--epochs=3", f"--out={out_dir}"], pid_dir, timeout=60, budget=120)
    assert code == 0, out[-6000:]
    for pattern in (r"^\[0\] 2 worker\(s\), 32 examples per worker per step, global batch 64$",
                    r"^\[0\] epoch  3/3 step +\d+: loss \d+\.\d+  gns +\d+\.\d  grad_variance \S+  snr \d+\.\d+",
                    r"^\[0\] wrote the plot .*monitor_gns\.png$"):
        assert re.search(pattern, out, re.MULTILINE), f"no line matches {pattern!r} in:\n{out[-6000:]}"
    # on 2 workers there are estimates: the workers' gradients differ, so their variance is > 0
    variance = re.search(r"^\[0\] epoch  3/3 .* grad_variance (\S+)", out, re.MULTILINE).group(1)
    assert float(variance) > 0, out[-6000:]
    png = out_dir / "monitor_gns.png"
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
