"""The Bazel-built library (`make bazel-build` -> build/bazel/_kungfu.so) works as the package's library.

KUNGFU_LIBRARY points the installed kungfu package at it; a fresh process then starts a one-worker
engine and runs an allreduce through the ops, and checks that the file it mapped is the Bazel one,
not the kungfu/_kungfu.so that pip installed.
"""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAZEL_LIBRARY = os.path.join(REPO, "build", "bazel", "_kungfu.so")

WORKER = textwrap.dedent("""
    import os
    import numpy as np
    import tensorflow as tf
    import kungfu
    from kungfu import _lib

    kungfu.init()
    assert kungfu.size() == 1, kungfu.size()
    x = tf.constant([1.0, -2.0, 3.5], dtype=tf.float32)
    y = kungfu.all_reduce(x)
    np.testing.assert_allclose(y.numpy(), x.numpy())
    expected = os.path.realpath(os.environ["KUNGFU_LIBRARY"])
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if line.rstrip().endswith(".so")}
    kungfu_libs = sorted(p for p in mapped if os.path.basename(p) == "_kungfu.so")
    assert kungfu_libs == [expected], kungfu_libs
    assert os.path.realpath(_lib.load().path) == expected, _lib.load().path
    kungfu.finalize()
    print("bazel library OK")
""")


def test_bazel_library_runs_an_allreduce(tmp_path):
    assert os.path.exists(BAZEL_LIBRARY), (
        f"{BAZEL_LIBRARY} is missing: run `make bazel-build` first (it runs `bazel build //:kungfu_ops`)")
    # A single worker, whatever launched pytest: no launcher or MPI variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUNGFU_", "OMPI_COMM_WORLD_", "PMIX_"))}
    env.update(KUNGFU_LIBRARY=BAZEL_LIBRARY, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", WORKER], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "bazel library OK" in proc.stdout
