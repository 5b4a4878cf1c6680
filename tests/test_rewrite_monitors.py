"""kungfu.rewrite(..., monitors=[...]): the training monitors on a rewritten step (python/kungfu/_rewrite/
monitors.py, docs/rewrite.md, docs/monitoring.md).

In this process (a cluster of one): the arguments are validated, latest() finds the step by object and by
name, the gradient monitors pair consecutive steps (one worker has no second batch size) and throughput
is measured, results stay bit-exact, and neither calls nor the interval retrace. Across processes (kfrun,
2 workers): tests/gns_accuracy_worker.py --rewrite checks the rewritten step's estimates against the truth
of synthetic gradients and against the optimizer wrapper's values on the same gradients.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kungfu
from conftest import REPO
from mp import assert_checks_passed, launch

pytestmark = pytest.mark.usefixtures("kungfu_library")

WORKER = os.path.join(REPO, "tests", "gns_accuracy_worker.py")


@pytest.fixture(scope="module", autouse=True)
def initialized():
    kungfu.init()


def model_and_step(kind="mlp", name="monitored_step"):
    keras.utils.set_random_seed(3)
    if kind == "mlp":
        layers = [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    else:  # tf.gather on the embedding: an IndexedSlices gradient
        layers = [keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4), keras.layers.Flatten(),
                  keras.layers.Dense(3)]
    model, opt = keras.Sequential(layers), keras.optimizers.SGD(0.1)
    traces = []

    def step(x, y):
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step.__name__ = name
    return model, tf.function(step), traces


def batch(kind="mlp", rows=8, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "embedding":
        x = rng.integers(0, 20, (rows, 5), np.int32)
    else:
        x = rng.normal(size=(rows, 6)).astype(np.float32)
    return tf.constant(x), tf.constant(rng.normal(size=(rows, 3)).astype(np.float32))


@pytest.mark.parametrize("kwargs, words", [
    (dict(monitors=["gns", "loss"]), "kungfu.rewrite: unknown monitor.*'loss'.*gns, variance, snr"),
    (dict(monitors=["gns"]), "kungfu.rewrite: the 'gns' and 'snr' monitors need local_batch_size"),
    (dict(monitors=["snr"]), "local_batch_size"),
    (dict(monitors=["variance"], monitor_interval=0), "monitor_interval must be an int >= 1"),
    (dict(monitors=["variance"], monitor_interval=1.5), "monitor_interval"),
    (dict(monitors=["gns"], local_batch_size=-4), "local_batch_size must be a number > 0"),
    (dict(monitors=["gns"], local_batch_size="8"), "local_batch_size"),
])
def test_bad_monitor_arguments_say_what_is_wrong(kwargs, words):
    with pytest.raises(ValueError, match=words):
        kungfu.rewrite(lambda: None, **kwargs)


def test_no_monitors_by_default():
    _, fn, _ = model_and_step(name="plain_step")
    step = kungfu.rewrite(fn)
    assert step.monitors is None
    with pytest.raises(ValueError, match="no monitors"):
        kungfu.monitor.latest(step)


@pytest.mark.parametrize("kind", ["mlp", "embedding"])
def test_size_one_values_are_finite_and_results_bit_exact(kind):
    original_model, original, _ = model_and_step(kind)
    model, fn, _ = model_and_step(kind, name=f"monitored_{kind}")
    step = kungfu.rewrite(fn, monitors=["gns", "variance", "snr"], local_batch_size=8)
    assert kungfu.monitor.latest(step) == kungfu.monitor.latest(f"monitored_{kind}") == kungfu.monitor.latest()
    for t in range(4):
        x, y = batch(kind, seed=t)
        assert step(x, y).numpy() == original(x, y).numpy()
    for w, g in zip(original_model.variables, model.variables):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
    values = kungfu.monitor.latest(step)
    assert set(values) == {"gns", "grad_variance", "snr", "samples_per_sec", "step_time"}
    assert all(np.isfinite(v) for v in values.values()), values
    # One worker: each step's gradients are paired with the previous step's (test_monitor_one_worker.py).
    assert values["grad_variance"] > 0
    assert values["snr"] == (pytest.approx(8 / values["gns"], rel=1e-4) if values["gns"] > 0 else 0.0)
    assert values["step_time"] > 0
    assert values["samples_per_sec"] == pytest.approx(8 / values["step_time"], rel=1e-5)
    assert step.monitors.update_count() == 3  # every step but the first, which has no previous one
    assert step.report(*batch(kind)).inserted  # the S-SGD collectives are still there


def test_unmonitored_keys_are_none_and_calls_do_not_retrace():
    _, fn, traces = model_and_step(name="variance_only")
    step = kungfu.rewrite(fn, monitors="variance", monitor_interval=3)
    for t in range(7):
        step(*batch(seed=t))
    values = kungfu.monitor.latest(step)
    assert values["gns"] is values["snr"] is values["samples_per_sec"] is None
    assert values["grad_variance"] > 0 and values["step_time"] > 0
    assert step.monitors.update_count() == 2  # calls 3 and 6 (0 has no previous step's gradients)
    assert step.rewrite_count == 1 and len(traces) == 1
    assert step.monitors.interval == 3


def test_a_batch_size_variable_is_followed():
    _, fn, _ = model_and_step(name="variable_batch")
    size = tf.Variable(8.0)
    step = kungfu.rewrite(fn, monitors=["gns"], local_batch_size=size)
    step(*batch())
    step(*batch())
    size.assign(16.0)
    step(*batch(rows=8, seed=1))
    values = kungfu.monitor.latest(step)
    assert values["samples_per_sec"] == pytest.approx(16 / values["step_time"], rel=1e-5)
    assert step.rewrite_count == 1


def test_across_workers_accurate_and_equal_to_the_wrapper(tmp_path):
    code, out = launch(2, [WORKER, "--rewrite", "8"], tmp_path, timeout=60, budget=150)
    assert_checks_passed(code, out, ["rewrite_accurate_b8"], 2)
