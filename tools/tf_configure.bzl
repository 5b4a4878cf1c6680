"""@local_config_tf: TensorFlow's headers and flags for Bazel, from tf.sysconfig.

The repository is written by tools/tf_config.py (the build's one source of TF flags), run with
$PYTHON_BIN_PATH or else the first python3 on PATH. Bazel re-runs it when tools/tf_config.py changes,
when PYTHON_BIN_PATH changes, and on `bazel sync --configure` (do that after upgrading TensorFlow).
"""

def _tf_configure_impl(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH") or rctx.which("python3")
    if not python:
        fail("tf_configure: no python3 on PATH; set PYTHON_BIN_PATH to a Python with TensorFlow")
    script = rctx.path(Label("//tools:tf_config.py"))
    result = rctx.execute([python, script, "--bazel-repo", rctx.path("")], timeout = 300)
    if result.return_code != 0:
        fail("tf_configure: {} {} failed ({}):\n{}{}".format(
            python,
            script,
            result.return_code,
            result.stdout,
            result.stderr,
        ))

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = ["PYTHON_BIN_PATH"],
    configure = True,
    local = True,
)
