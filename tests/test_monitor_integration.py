"""The optimizer wrapper's monitors on one process (a cluster of size 1): argument errors, the
values latest() reports, the interval (no retrace), and MonitorCallback. The gradient monitors' values
on one worker are checked in test_monitor_one_worker.py, across real workers in tests/monitor_worker.py.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kungfu
from conftest import REPO
from kungfu import optimizers
from kungfu.keras import callbacks
from mp import assert_checks_passed, launch
from small_model import model_and_data

pytestmark = pytest.mark.usefixtures("kungfu_library")

WORKER = os.path.join(REPO, "tests", "monitor_worker.py")
MP_CHECKS = ["gns_matches_reference", "gns_matches_reference_with_a_sparse_gradient",
             "gns_matches_reference_under_a_loss_scale", "workers_agree",
             "fit_with_monitor_callback", "interval_reads_the_batch_size_of_an_adaptive_dataset_in_fit",
             "interval_runs_every_k_steps_without_retrace",
             "collective_stats_count_each_collective"]


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()


@pytest.mark.parametrize("kwargs, words", [
    (dict(monitor=["gns", "loss"]), "'loss'.*gns, variance, snr"),
    (dict(monitor=["gns"]), "local_batch_size"),
    (dict(monitor=["snr"]), "local_batch_size"),
    (dict(monitor=["variance"], monitor_interval=0), "monitor_interval"),
    (dict(monitor=["variance"], monitor_interval=2.0), "monitor_interval"),
    (dict(monitor=["gns"], local_batch_size=0), "local_batch_size"),
    (dict(monitor=["gns"], local_batch_size="32"), "local_batch_size"),
    # Not a name nor a list of names: a number would fail deep inside, a dict would give its keys.
    (dict(monitor=5), "None, a name, or a list or tuple of names from gns, variance, snr.*got int 5"),
    (dict(monitor={"gns": 1}, local_batch_size=8), "list or tuple of names.*got dict"),
])
def test_bad_monitor_arguments_say_what_is_wrong(kwargs, words):
    with pytest.raises(ValueError, match=words):
        optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), **kwargs)


def test_rewrite_refuses_the_same_monitor_arguments():
    with pytest.raises(ValueError, match="kungfu.rewrite: the monitors must be given as None, a name"):
        kungfu.rewrite(lambda: None, monitors=5)


def test_monitor_arguments_accept_numpy_integers_and_any_sequence_of_names():
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), monitor=("gns", "variance"),
                                             monitor_interval=np.int64(3), local_batch_size=np.int32(32))
    m = opt._kungfu.monitors
    assert m.names == {"gns", "variance"} and m.interval == 3 and type(m.interval) is int
    assert opt.local_batch_size == 32.0
    opt.set_local_batch_size(np.int64(16))
    assert opt.local_batch_size == 16.0
    other = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), monitor={"snr"}, local_batch_size=8)
    assert other._kungfu.monitors.names == {"snr"}
    with pytest.raises(ValueError, match="monitor_interval"):  # a bool is not a count of steps
        optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), monitor="variance", monitor_interval=True)


def test_a_batch_size_cannot_be_set_on_monitors_made_without_one():
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), monitor="variance")
    words = "monitors of 'sgd.*' were made without local_batch_size.*pass local_batch_size=.* when wrapping"
    with pytest.raises(ValueError, match=words):
        opt.set_local_batch_size(32)
    with pytest.raises(ValueError, match=words):
        opt.local_batch_size = 32
    assert opt.local_batch_size is None


def test_latest_needs_an_optimizer_with_monitors():
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="no monitors"):
        kungfu.monitor.latest(opt)
    with pytest.raises(ValueError, match="named 'nobody'"):
        kungfu.monitor.latest("nobody")
    with pytest.raises(ValueError, match="has no monitors, so no batch size to set"):
        opt.set_local_batch_size(8)
    for wrap in (optimizers.SynchronousAveragingOptimizer, optimizers.PairAveragingOptimizer):
        other = wrap(keras.optimizers.SGD(), monitor=["variance"], monitor_interval=2)
        assert kungfu.monitor.latest(other)["grad_variance"] == 0.0


def test_size_one_reports_finite_values_and_throughput():
    model, x, y = model_and_data()
    batch = tf.Variable(16.0)
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.05), monitor=["gns", "variance", "snr"],
                                             local_batch_size=batch)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    values = kungfu.monitor.latest()
    assert set(values) == {"gns", "grad_variance", "snr", "samples_per_sec", "step_time"}
    assert values == kungfu.monitor.latest(opt) == kungfu.monitor.latest(opt.name)
    assert all(np.isfinite(v) for v in values.values()), values
    # One worker: consecutive steps' gradients stand for the two batch sizes (test_monitor_one_worker.py).
    assert values["gns"] > 0 and values["grad_variance"] > 0
    assert values["snr"] == pytest.approx(16 / values["gns"], rel=1e-4)
    assert values["step_time"] > 0
    assert values["samples_per_sec"] == pytest.approx(16 / values["step_time"], rel=1e-5)
    opt.local_batch_size = 32  # assigns the user's variable
    assert float(batch.numpy()) == 32.0 and opt.local_batch_size == 32.0


def test_unmonitored_keys_are_none():
    model, x, y = model_and_data()
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.05), monitor=["variance"], monitor_interval=4)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    values = kungfu.monitor.latest()
    assert values["gns"] is None and values["snr"] is None and values["samples_per_sec"] is None
    assert values["grad_variance"] == 0.0 and values["step_time"] > 0


def test_interval_does_not_retrace():
    model, x, y = model_and_data()
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.05), monitor="gns", monitor_interval=3,
                                             local_batch_size=8)
    traces = []

    @tf.function
    def step(x, y):
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step(x[:8], y[:8])
    first = len(traces)
    for t in range(1, 7):
        opt.set_local_batch_size(8 + t)  # a changing batch size is a variable assignment
        step(x[:8], y[:8])
    assert len(traces) == first, f"retraced {len(traces) - first} times"
    assert int(opt.iterations.numpy()) == 7
    assert kungfu.monitor.latest(opt)["step_time"] > 0


def test_monitor_callback_puts_values_into_history(tmp_path):
    model, x, y = model_and_data()
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.05), monitor=["gns", "variance"],
                                             local_batch_size=16)
    model.compile(optimizer=opt, loss="mse")
    optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), monitor=["variance"])  # a later one: not used
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                        callbacks=[callbacks.MonitorCallback(tensorboard_dir=str(tmp_path))])
    for key in ("gns", "grad_variance", "samples_per_sec", "step_time"):
        assert len(history.history[key]) == 2, history.history
    assert "snr" not in history.history
    events = [os.path.join(tmp_path, n) for n in os.listdir(tmp_path) if n.startswith("events.out.tfevents")]
    tags = [(v.tag, e.step) for path in events
            for e in tf.compat.v1.train.summary_iterator(path) for v in e.summary.value]
    assert ("kungfu/gns", 0) in tags and ("kungfu/step_time", 1) in tags, tags


def test_monitor_callback_without_monitors_fails_before_the_first_step(monkeypatch):
    monkeypatch.setattr(kungfu.monitor, "_registry", [])  # no other optimizer's monitors to fall back on
    model, x, y = model_and_data()
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.05))
    model.compile(optimizer=opt, loss="mse")
    for callback, words in ((callbacks.MonitorCallback(), "the model's optimizer 'sgd.*' has no monitors"),
                            (callbacks.MonitorCallback(optimizer=opt), "has no monitors")):
        with pytest.raises(ValueError, match="MonitorCallback: .*" + words):
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])
        assert int(opt.iterations.numpy()) == 0  # not a step was lost


def test_collective_stats_on_one_worker():
    kungfu.monitor.collective_stats(reset=True)
    for _ in range(3):
        kungfu.all_reduce(tf.ones([10]), name="one/worker")
    stats = kungfu.monitor.collective_stats(reset=True)["one/worker"]
    assert stats["calls"] == 3 and stats["failed"] == 0
    assert stats["bytes_sent"] == stats["bytes_received"] == 0  # nothing to move with one worker
    assert 0 < stats["last_ms"] <= stats["max_ms"] and stats["mean_ms"] == pytest.approx(stats["total_ms"] / 3)
    assert "one/worker" not in kungfu.monitor.collective_stats()  # the reset emptied the table


@pytest.mark.parametrize("np_", [2, 4])
def test_monitors_across_workers(np_, tmp_path):
    code, out = launch(np_, [WORKER], tmp_path, timeout=60, budget=300)
    assert_checks_passed(code, out, MP_CHECKS, np_)
