"""The gradient monitors on one worker (a cluster of one), where there is no second batch size: each due
step pairs this step's gradients with the previous step's (Monitors.update_one_worker). Checked: the
values after every step against a numpy reference of the same formula on the same synthetic gradients
(dense and IndexedSlices, interval 1 and 3, a batch size change that skips a step), through the optimizer
wrapper and through kungfu.rewrite; monitor_alpha; and on a real model trained with model.fit, the
estimate against the true noise scale computed from per-sample gradients.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kungfu
from kungfu import optimizers

import monitor_reference as ref

pytestmark = pytest.mark.usefixtures("kungfu_library")

ROWS, COLS = 6, 4  # the matrix variable; its gradient is an IndexedSlices in the sparse variant
MONITORS = ["gns", "variance", "snr"]


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()
    assert kungfu.size() == 1


def synthetic(steps, seed=0):
    """Per step: (the matrix gradient as (indices, rows) with a repeated index, the vector gradient).
    Their dense forms are what the monitors must see."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        indices = np.array([0, 2, 2, 5], np.int32)  # row 2 twice: summed in the dense gradient
        rows = rng.normal(0.5, 1.0, (4, COLS)).astype(np.float32)
        out.append((indices, rows, rng.normal(-0.3, 1.0, COLS).astype(np.float32)))
    return out


def dense(indices, rows):
    m = np.zeros((ROWS, COLS), np.float64)
    np.add.at(m, indices, rows)
    return m


def reference(grads, batches, interval, alpha, unpaired=()):
    """The values latest() must report after each step, and the update count, computed in numpy:
    a due step t (t % interval == 0) with the copy of step t - 1 (kept when t % interval == 0, at the
    same batch size) updates the EMAs with |g_t|^2 and |(g_t + g_{t-1}) / 2|^2 at batches b and 2b.
    unpaired: steps whose copy of the step before does not count for another reason."""
    gns_model, values, count = ref.GradientNoiseScale(alpha), [], 0
    gns = variance = snr = 0.0
    for t, (indices, rows, vec) in enumerate(grads):
        g = np.concatenate([dense(indices, rows).ravel(), vec])
        b = batches[t]
        if t % interval == 0 and t >= 1 and b == batches[t - 1] and t not in unpaired:
            p = np.concatenate([dense(*grads[t - 1][:2]).ravel(), grads[t - 1][2]])
            small, big, prev = np.sum(g ** 2), np.sum(((g + p) / 2) ** 2), np.sum(p ** 2)
            gns_model.update(small, big, b, 2 * b)
            variance = max((small + prev) / 2 - big, 0.0)  # = |g - p|^2 / 4
            count += 1
        if t % interval == 0:  # a skipped due step keeps the EMAs, but snr follows the batch size
            gns, g_sq, trace = gns_model.gns(), gns_model.g_sq, gns_model.trace
            snr = g_sq * b / trace if g_sq > 0 and trace > 0 else 0.0
        values.append((gns, variance, snr))
    return values, count


def check_values(got, want, t):
    for key, w in zip(("gns", "grad_variance", "snr"), want):
        assert got[key] == pytest.approx(w, rel=1e-4, abs=1e-6), f"step {t}: {key} {got[key]} vs reference {w}"


@pytest.mark.parametrize("interval, sparse", [(1, False), (1, True), (3, True)])
def test_wrapper_matches_the_reference(interval, sparse):
    grads = synthetic(20, seed=interval)
    batches = [16.0] * 10 + [32.0] * 10  # the change at step 10 skips the next due step
    alpha = 0.25
    matrix, vector = tf.Variable(tf.zeros([ROWS, COLS])), tf.Variable(tf.zeros([COLS]))
    batch = tf.Variable(16.0)
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.0), monitor=MONITORS,
                                             monitor_interval=interval, local_batch_size=batch, monitor_alpha=alpha)

    @tf.function
    def step(indices, rows, vec):
        g = tf.IndexedSlices(rows, indices, tf.constant([ROWS, COLS]))
        opt.apply_gradients([(g if sparse else tf.convert_to_tensor(g), matrix), (vec, vector)])

    want, count = reference(grads, batches, interval, alpha)
    for t, (indices, rows, vec) in enumerate(grads):
        batch.assign(batches[t])
        step(indices, rows, vec)
        check_values(kungfu.monitor.latest(opt), want[t], t)
    assert kungfu.monitor.update_count(opt) == count == opt._kungfu.monitors.update_count()
    assert want[-1][0] > 0  # the reference itself made estimates


def test_inside_a_loss_scale_optimizer_the_monitors_see_the_unscaled_gradients():
    """Mixed precision: apply() gets the gradients times the loss scale. The monitors must match the
    reference on the gradients themselves, leave a step whose gradients overflowed out, and not pair
    gradients taken at two different scales (the overflow halves the scale)."""
    grads = synthetic(13, seed=7)
    matrix, vector = tf.Variable(tf.zeros([ROWS, COLS])), tf.Variable(tf.zeros([COLS]))
    # The scale doubles after every 4 finite steps: in the apply() of steps 3 and 7.
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0), dynamic_growth_steps=4)
    opt = optimizers.SynchronousSGDOptimizer(lso, monitor=MONITORS, local_batch_size=16, monitor_alpha=0.25)

    @tf.function
    def step(indices, rows, vec):
        scale = opt.dynamic_scale if opt.built else opt.initial_scale  # what scale_loss multiplies by
        g = tf.convert_to_tensor(tf.IndexedSlices(rows, indices, tf.constant([ROWS, COLS])))
        opt.apply_gradients([(g * scale, matrix), (vec * scale, vector)])

    want, count = reference(grads[:10], [16.0] * 10, 1, 0.25, unpaired=(4, 8))
    for t, (indices, rows, vec) in enumerate(grads[:10]):
        step(indices, rows, vec)
        check_values(kungfu.monitor.latest(opt), want[t], t)
    scale = float(opt.dynamic_scale.numpy())
    assert scale == 4 * float(lso.initial_scale) and count == 7
    indices, rows, vec = grads[10]
    step(indices, rows, vec * np.float32("inf"))  # an overflow: the optimizer skips it, and so do the monitors
    assert float(opt.dynamic_scale.numpy()) == scale / 2
    check_values(kungfu.monitor.latest(opt), want[9], 10)
    step(*grads[11])  # its previous step's copy was taken at the old scale
    check_values(kungfu.monitor.latest(opt), want[9], 11)
    assert kungfu.monitor.update_count(opt) == count
    step(*grads[12])  # steps 11 and 12 pair up again
    assert kungfu.monitor.update_count(opt) == count + 1
    assert all(np.isfinite(v) and v > 0 for k, v in kungfu.monitor.latest(opt).items() if k in ("gns", "snr"))


def test_rewrite_matches_the_reference():
    grads = synthetic(12, seed=5)
    var = tf.Variable(tf.zeros([ROWS * COLS + COLS]))
    opt = keras.optimizers.SGD(0.0)

    def synthetic_step(g):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var * tf.stop_gradient(g))  # its gradient is g
        opt.apply_gradients(zip(tape.gradient(loss, [var]), [var]))

    step = kungfu.rewrite(tf.function(synthetic_step), monitors=MONITORS, local_batch_size=8)
    want, count = reference(grads, [8.0] * len(grads), 1, 0.1)  # the flat g is the wrapper test's
    for t, (indices, rows, vec) in enumerate(grads):
        step(tf.constant(np.concatenate([dense(indices, rows).ravel(), vec]), tf.float32))
        check_values(kungfu.monitor.latest(step), want[t], t)
    assert step.monitors.update_count() == count == len(grads) - 1
    assert step.rewrite_count == 1


def test_monitor_alpha_is_validated():
    for alpha in (0, 1.5, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="monitor_alpha must be a number in \\(0, 1\\]"):
            optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), monitor=["gns"], local_batch_size=8,
                                               monitor_alpha=alpha)
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), monitor=["gns"], local_batch_size=8,
                                             monitor_alpha=1)
    assert opt._kungfu.monitors.alpha == 1.0


def per_sample_truth(model, x, y):
    """(|G|^2, tr Sigma) of the MSE loss at the model's current weights, from every sample's gradient."""
    w, b = (v.numpy().astype(np.float64) for v in model.layers[-1].weights)
    residual = x @ w + b - y  # (n, out)
    per_w = 2 * x[:, :, None] * residual[:, None, :] / y.shape[1]  # d loss_i / d w, (n, in, out)
    per_b = 2 * residual / y.shape[1]
    per = np.concatenate([per_w.reshape(len(x), -1), per_b], axis=1)
    mean = per.mean(axis=0)
    return float(np.sum(mean ** 2)), float(np.sum(per.var(axis=0)))


def test_on_a_real_model_the_estimate_is_near_the_true_noise_scale():
    # Linear regression far from its optimum, with a small learning rate: the weights hardly move between
    # steps, so the consecutive-step estimate should be close to tr Sigma / |G|^2 from per-sample gradients.
    rng = np.random.default_rng(0)
    inputs, outputs, n, batch = 32, 4, 8192, 16
    x = rng.normal(size=(n, inputs)).astype(np.float32)
    y = (x @ rng.normal(size=(inputs, outputs)) + 3.0 + rng.normal(size=(n, outputs))).astype(np.float32)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(outputs)])
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(1e-4), monitor=MONITORS,
                                             local_batch_size=batch, monitor_alpha=0.02)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=True)
    values = kungfu.monitor.latest(opt)
    g_sq, trace = per_sample_truth(model, x.astype(np.float64), y.astype(np.float64))
    true_gns = trace / g_sq
    assert values["gns"] == pytest.approx(true_gns, rel=0.25), (values, true_gns)
    assert values["snr"] == pytest.approx(batch / values["gns"], rel=1e-4)
    # two independent gradients of batch b spread by tr Sigma / (2b) around their mean, on average
    assert 0.3 < values["grad_variance"] / (trace / (2 * batch)) < 3  # one step's value: noisy
    assert kungfu.monitor.update_count(opt) == n // batch - 1
