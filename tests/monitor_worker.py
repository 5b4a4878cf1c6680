"""The worker of test_monitor_integration.py's multi-process test, started N times by kfrun. Not a
test module itself.

    python -m kungfu.launcher -np N -- python tests/monitor_worker.py

Prints one "KFCHECK <name> OK|FAIL ..." line per check (tests/mp.py). Each worker trains a small
model on its own random data with SynchronousSGDOptimizer(monitor=[...]):
- gns_matches_reference: the wrapper's gns, grad_variance and snr equal tests/monitor_reference.py fed
  with the same squared norms: the workers' mean local |g|^2 (gathered with kungfu.all_gather) and
  the squared norm of the all-reduced gradient;
- gns_matches_reference_under_a_loss_scale: the same inside a LossScaleOptimizer, on the gradients
  without the loss scale; a step whose gradients overflow on one worker leaves the monitors alone;
- workers_agree: latest()'s gns, grad_variance and snr are bit-identical on every worker;
- fit_with_monitor_callback: model.fit with MonitorCallback logs gns and grad_variance per epoch, the
  same on every worker;
- interval_reads_the_batch_size_of_an_adaptive_dataset_in_fit: monitor_interval=2 in model.fit over a
  kungfu.data.AdaptiveDataset, whose batch size variable the monitors follow;
- interval_runs_every_k_steps_without_retrace: with monitor_interval=3 the monitors change only at
  steps 0, 3, 6, ..., a batch size change included, and the step is traced once;
- collective_stats_count_each_collective: kungfu.monitor.collective_stats() counts each collective of
  the step (the wrapper's gradient bucket among them) once per step, with the bytes and latency of
  each, a named all-reduce under its name and a loop of unnamed eager ones in one row (each with its
  exact value); the bytes sent by all workers equal those received.
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import sys  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
from kungfu.keras import callbacks as kf_callbacks  # noqa: E402
from kungfu.ops import monitor as monitor_ops  # noqa: E402
from monitor_reference import GradientNoiseScale  # noqa: E402

BATCH, FEATURES, CLASSES, STEPS = 8, 6, 3, 12


def setup(monitor_interval=1, local_batch_size=BATCH, sparse=False, loss_scale=False):
    """sparse: the model starts with an Embedding, whose gradient is an IndexedSlices (the wrapper then
    carries the local squared norm in the bucket instead of taking both norms from the all-reduce).
    loss_scale: mixed-precision style, SynchronousSGDOptimizer(LossScaleOptimizer(SGD)), the loss scaled
    by opt.scale_loss; the step returns the squared norms of the unscaled gradients. The step's third
    argument multiplies the loss (inf: an overflow)."""
    keras.utils.set_random_seed(1)  # the same model on every worker
    if sparse:
        model = keras.Sequential([keras.Input((FEATURES,), dtype="int32"), keras.layers.Embedding(20, 4),
                                  keras.layers.Flatten(), keras.layers.Dense(CLASSES)])
    else:
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(CLASSES)])
    base = keras.optimizers.SGD(0.05)
    if loss_scale:
        base = keras.optimizers.LossScaleOptimizer(base)
    opt = kungfu.optimizers.SynchronousSGDOptimizer(base, monitor=["gns", "variance", "snr"],
                                                    monitor_interval=monitor_interval,
                                                    local_batch_size=local_batch_size)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.RandomState(10 + kungfu.rank())  # different data on every worker
    x = rng.normal(size=(STEPS * BATCH, FEATURES)).astype(np.float32)
    if sparse:
        x = rng.randint(0, 20, size=x.shape).astype(np.int32)
    y = rng.randint(0, CLASSES, size=len(x)).astype(np.int64)
    traces = []

    @tf.function
    def step(x, y, factor=tf.constant(1.0)):
        traces.append(1)
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True)) * factor
            if loss_scale:
                value = opt.scale_loss(value)
        grads = tape.gradient(value, model.trainable_variables)
        if loss_scale:  # the scale scale_loss used: built, the optimizer's variable
            scale = opt.dynamic_scale if opt.built else opt.initial_scale
        true = [g / scale for g in grads] if loss_scale else grads
        local_sq = monitor_ops.squared_norm(true)  # as the wrapper computes it
        dense = [tf.convert_to_tensor(g) for g in true]
        global_sq = monitor_ops.squared_norm(kungfu.group_all_reduce(dense, op="mean"))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return local_sq, global_sq

    batches = [(x[t * BATCH:(t + 1) * BATCH], y[t * BATCH:(t + 1) * BATCH]) for t in range(STEPS)]
    return opt, step, batches, traces


def close(got, want, what, rtol=2e-3):
    if not abs(got - want) <= rtol * max(abs(want), 1e-6):
        raise AssertionError(f"{what}: wrapper {got!r}, numpy reference {want!r}")


CHECKS = []


OVERFLOW_STEP = 6  # with loss_scale: rank 1's gradients are inf there, so every worker skips the step


def check_gns_against_reference(sparse, loss_scale=False):
    opt, step, batches, _ = setup(sparse=sparse, loss_scale=loss_scale)
    m = opt._kungfu.monitors
    ref = GradientNoiseScale(alpha=0.1)
    n, b = kungfu.size(), float(BATCH)
    nonzero = 0
    for t, (x, y) in enumerate(batches):
        if loss_scale and t == OVERFLOW_STEP:
            def estimates():
                return {k: v for k, v in kungfu.monitor.latest(opt).items() if k in ("gns", "grad_variance", "snr")}

            before, scale = estimates(), float(opt.dynamic_scale.numpy())
            step(x, y, tf.constant(float("inf") if kungfu.rank() == 1 else 1.0))
            if estimates() != before or float(opt.dynamic_scale.numpy()) != scale / 2:
                raise AssertionError(f"an overflow step changed the monitors {before} -> {estimates()} "
                                     f"or did not halve the loss scale {scale}")
            continue
        local_sq, global_sq = step(x, y)
        mean_local = float(np.mean(kungfu.all_gather(tf.reshape(local_sq, [1])).numpy().astype(np.float64)))
        gns, g_sq, trace = ref.update(mean_local, float(global_sq), b, n * b)
        got = kungfu.monitor.latest(opt)
        close(float(m.read("g_sq").numpy()), g_sq, f"step {t} EMA |G|^2")
        close(float(m.read("trace").numpy()), trace, f"step {t} EMA tr Sigma")
        close(got["gns"], gns, f"step {t} gns")
        close(got["grad_variance"], max(mean_local - float(global_sq), 0.0), f"step {t} grad_variance")
        want_snr = g_sq * n * b / trace if g_sq > 0 and trace > 0 else 0.0
        close(got["snr"], want_snr, f"step {t} snr")
        nonzero += got["gns"] > 0
        if not (got["step_time"] >= 0 and got["samples_per_sec"] >= 0):
            raise AssertionError(f"step {t}: throughput {got}")
    if nonzero == 0 or not kungfu.monitor.latest(opt)["samples_per_sec"] > 0:
        raise AssertionError(f"no gns estimate or throughput after {STEPS} steps: {kungfu.monitor.latest(opt)}")


@CHECKS.append
def gns_matches_reference():  # both squared norms from the all-reduce (KfGroupAllReduceNorms)
    check_gns_against_reference(sparse=False)


@CHECKS.append
def gns_matches_reference_with_a_sparse_gradient():  # the local norm rides in the bucket
    check_gns_against_reference(sparse=True)


@CHECKS.append
def gns_matches_reference_under_a_loss_scale():  # the monitors measure the unscaled gradients
    check_gns_against_reference(sparse=False, loss_scale=True)


@CHECKS.append
def workers_agree():
    opt, step, batches, _ = setup()
    for x, y in batches:
        step(x, y)
        got = kungfu.monitor.latest(opt)
        values = np.array([got["gns"], got["grad_variance"], got["snr"]], np.float32)
        if not bool(kungfu.consensus(values)):
            spread = kungfu.all_gather(values.reshape(1, 3)).numpy()
            raise AssertionError(f"workers differ on (gns, grad_variance, snr): {spread.tolist()}")


@CHECKS.append
def fit_with_monitor_callback():
    opt, _, batches, _ = setup(monitor_interval=2)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[kf_callbacks.MonitorCallback()]).history
    values = np.array(history["gns"] + history["grad_variance"] + history["snr"], np.float32)
    if len(values) != 6 or not np.all(np.isfinite(values)) or not history["grad_variance"][-1] > 0:
        raise AssertionError(f"History: {history}")
    if not bool(kungfu.consensus(values)):
        raise AssertionError(f"workers logged different monitor values: {values.tolist()}")


@CHECKS.append
def interval_reads_the_batch_size_of_an_adaptive_dataset_in_fit():
    """monitor_interval=2 with local_batch_size=ds.local_batch_size_variable: the first due step must read
    the size of the batch it pulled (it read the variable's initial 0 once, and the op refused b=0)."""
    n = kungfu.size()
    rng = np.random.RandomState(3)  # the same data everywhere: the dataset shards it
    x = rng.normal(size=(40 * n, FEATURES)).astype(np.float32)
    y = rng.randint(0, CLASSES, size=len(x)).astype(np.int64)
    ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=4 * n, seed=1)
    opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.05), monitor=["gns", "variance"],
                                                    monitor_interval=2, local_batch_size=ds.local_batch_size_variable)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ds.as_dataset(), epochs=1, shuffle=False, verbose=0, callbacks=[ds.keras_callback()])
    m = opt._kungfu.monitors
    if m.update_count() != 5 or not float(m.read("grad_variance").numpy()) > 0:
        raise AssertionError(f"{m.update_count()} updates in 10 steps, grad_variance {m.read('grad_variance')}")


@CHECKS.append
def interval_runs_every_k_steps_without_retrace():
    k = 3
    opt, step, batches, traces = setup(monitor_interval=k)
    m = opt._kungfu.monitors
    before = None
    for t, (x, y) in enumerate(batches):
        if t == 5:
            opt.set_local_batch_size(2 * BATCH)  # follows a batch size change, without retracing
        step(x, y)
        if t == 0:
            first = len(traces)
        now = float(m.read("grad_variance").numpy())
        changed = before is None or now != before
        if changed != (t % k == 0):
            raise AssertionError(f"step {t}: grad_variance {'changed' if changed else 'stayed'} "
                                 f"({before} -> {now}) with monitor_interval={k}")
        before = now
    updates = m.update_count()
    if updates != (STEPS + k - 1) // k:
        raise AssertionError(f"the monitors ran {updates} times in {STEPS} steps with interval {k}")
    if len(traces) != first:
        raise AssertionError(f"the step was traced {len(traces) - first} more times after its first call")


UNNAMED_CALLS = 40


@CHECKS.append
def collective_stats_count_each_collective():
    opt, step, batches, _ = setup()
    kungfu.monitor.collective_stats(reset=True)
    for x, y in batches:
        step(x, y)
    for _ in range(2):
        kungfu.all_reduce(tf.ones([1000]), name="stats/named")
    # Unnamed eager calls share one key, told apart by the engine's count of its calls: a loop of them
    # is one row here (not a row, and an engine entry, per call) and each call still meets its own.
    size = kungfu.size()
    for i in range(UNNAMED_CALLS):
        got = kungfu.all_reduce(tf.fill([3], float(kungfu.rank() + i))).numpy()
        if not np.all(got == size * i + size * (size - 1) / 2):
            raise AssertionError(f"unnamed eager all_reduce {i}: {got}")
    stats = kungfu.monitor.collective_stats()
    unnamed = [k for k in stats if k.startswith("eager/all_reduce")]
    if unnamed != ["eager/all_reduce"] or stats["eager/all_reduce"]["calls"] != UNNAMED_CALLS:
        raise AssertionError(f"unnamed eager all_reduces counted as {({k: stats[k]['calls'] for k in unnamed})}")
    named = stats.get("stats/named", {})
    if named.get("calls") != 2 or not named["bytes_received"] >= 2 * 4000 or not named["mean_ms"] > 0:
        raise AssertionError(f"stats/named: {named}")
    # Two collectives per step: the test's own group all-reduce and the wrapper's bucket (the gradients,
    # and one more float: this worker's squared norm).
    per_step = {k: v for k, v in stats.items() if v["calls"] == STEPS}
    grad_bytes = 4 * sum(int(np.prod(v.shape)) for v in opt._trainable_variables)
    if len(per_step) != 2:
        raise AssertionError(f"expected 2 collectives run once per step, got {stats}")
    for key, v in per_step.items():  # every algorithm delivers at least the whole tensor to each worker
        if v["failed"] or not v["bytes_received"] >= STEPS * grad_bytes or not 0 < v["last_ms"] <= v["max_ms"]:
            raise AssertionError(f"{key}: {v} (gradients: {grad_bytes} bytes)")
    moved = np.array([sum(v["bytes_sent"] for v in stats.values()), sum(v["bytes_received"] for v in stats.values())])
    totals = kungfu.all_gather(moved.reshape(1, 2)).numpy().sum(axis=0)
    if totals[0] != totals[1]:
        raise AssertionError(f"bytes sent by all workers {totals[0]} != received {totals[1]}")


def main():
    kungfu.init()
    sys.exit(1 if mp.run_checks(CHECKS, kungfu.rank()) else 0)


if __name__ == "__main__":
    main()
