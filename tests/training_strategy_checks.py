"""Training checks of the strategies and exchange forms: a strategy switch between steps without
retracing, IndexedSlices against densified gradients (and sparse_as_dense under every strategy),
broadcast_variables (and its refusal of different layouts, with nothing assigned), fp16 compression,
every state agreeing after a switch to S-SGD, the monitors (and a threshold switch) under SMA, gradients of
different variables refused rather than averaged together, float16 weights averaged without overflow; and, in a launch
of its own, workers left on different strategies failing rather than pairing up.
Run by tests/training_worker.py with its own checks; pair averaging's are in training_pair_checks.py.
"""

import keras
import numpy as np
import tensorflow as tf

import kungfu
from kungfu.optimizers import _reduce

import mp
from training_common import LOCAL_BATCH, STEPS, adam, local_data, loss_fn, make_model, reference_weights, sgd

CHECKS, check = mp.check_list()


@check
def strategy_switch_without_retrace():
    x, y = local_data()
    model, loss = make_model(100), loss_fn()
    opt = kungfu.optimizers.SynchronousSGDOptimizer(sgd())
    traces, losses = [], []

    @tf.function
    def step(x, y):
        traces.append(1)
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return value

    schedule = ["ssgd"] * 5 + ["sma"] * 5 + ["pair_averaging"] * 5 + ["ssgd"] * 5
    for t, strategy in enumerate(schedule):
        opt.strategy = strategy
        losses.append(float(step(x[:LOCAL_BATCH], y[:LOCAL_BATCH])))  # one batch over and over: the loss must fall
        if t == 0:
            first = len(traces)  # the first call traces twice: it creates the optimizer's variables
    if len(traces) != first:
        raise AssertionError(f"the step was traced {len(traces) - first} more times after its first call; "
                             "switching strategies must not retrace")
    if opt.strategy != "ssgd" or int(opt.iterations.numpy()) != len(schedule):
        raise AssertionError(f"strategy {opt.strategy}, {int(opt.iterations.numpy())} iterations")
    if kungfu.size() > 1:  # an index out of range, assigned by hand, fails the step (switch_case would run pair)
        opt.strategy_variable.assign(len(kungfu.optimizers.STRATEGIES))
        try:
            step(x[:LOCAL_BATCH], y[:LOCAL_BATCH])
        except tf.errors.InvalidArgumentError as e:
            if "not the index of any strategy" not in e.message:
                raise AssertionError(f"unclear error for a strategy index out of range: {e.message}") from e
        else:
            raise AssertionError("a step with a strategy index out of range ran")
        opt.strategy = "ssgd"
    if not all(np.isfinite(losses)) or not np.mean(losses[-5:]) < np.mean(losses[:5]):
        raise AssertionError(f"training did not go on across the switches: losses {losses}")


@check
def indexed_slices_equal_densified():
    rank = kungfu.rank()
    table = tf.Variable(tf.zeros([10, 3]))
    ids = tf.constant([rank % 10, (3 * rank + 1) % 10, rank % 10])  # a repeated row, rows shared across workers

    def grads():
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(tf.gather(table, ids) * float(rank + 1))
        return tape.gradient(value, [table])

    def reduce_three_ways():
        g = grads()
        if not isinstance(g[0], tf.IndexedSlices):
            raise AssertionError(f"expected an IndexedSlices gradient, got {type(g[0]).__name__}")
        sparse = _reduce.mean_gradients(g, [table])[0]
        if not isinstance(sparse, tf.IndexedSlices):
            raise AssertionError("the sparse path densified the gradient")
        as_dense = _reduce.mean_gradients(g, [table], sparse_as_dense=True)[0]
        dense = kungfu.all_reduce(tf.convert_to_tensor(g[0]), op="mean")
        return tf.convert_to_tensor(sparse), as_dense, dense

    for how, fn in (("eagerly", reduce_three_ways), ("in tf.function", tf.function(reduce_three_ways))):
        sparse, as_dense, dense = fn()
        np.testing.assert_allclose(sparse.numpy(), dense.numpy(), rtol=1e-6, atol=1e-6, err_msg=f"sparse {how}")
        np.testing.assert_allclose(as_dense.numpy(), dense.numpy(), rtol=1e-6, atol=1e-6, err_msg=f"dense {how}")
    # The optimizer wrappers in a tf.function, with and without sparse_as_dense, under every strategy
    # (sparse_as_dense once failed to trace: its branches returned dense and sparse gradients).
    for sparse_as_dense in (False, True):
        opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=sparse_as_dense)
        step = tf.function(lambda: opt.apply_gradients(zip(grads(), [table])))
        for strategy in kungfu.optimizers.STRATEGIES:
            opt.strategy = strategy
            step()


@check
def broadcast_variables_copies_root_and_refuses_different_layouts():
    rank = kungfu.rank()
    a, b = tf.Variable(tf.fill([2, 3], float(rank))), tf.Variable(tf.fill([4], rank))
    kungfu.broadcast_variables([a], root=1)
    tf.function(lambda: kungfu.broadcast_variables([b], root=0))()
    if not (np.all(a.numpy() == 1.0) and np.all(b.numpy() == 0)):
        raise AssertionError(f"broadcast_variables gave {a.numpy()} from rank 1 and {b.numpy()} from rank 0")
    odd = tf.Variable(tf.fill([2, 3] if rank == 0 else [3, 2], float(rank)))  # the same size, another shape
    for how, fn, error in (("eagerly", lambda: kungfu.broadcast_variables([odd]), ValueError),
                           ("in tf.function", tf.function(lambda: kungfu.broadcast_variables([odd])),
                            tf.errors.InvalidArgumentError)):
        try:
            fn()
        except error as e:
            if "different variables" not in str(e):
                raise AssertionError(f"{how}: unclear error: {e}") from e
        else:
            raise AssertionError(f"{how}: no error for different layouts")
        if not np.all(odd.numpy() == float(rank)):
            raise AssertionError(f"{how}: the variable was overwritten although the layouts differ")


@check
def gradients_of_different_variables_fail_rather_than_mix():
    """Workers whose gradients are None for different variables of the same shape (a multi-task model whose
    batch had labels for one task on some workers, another on others) fail with InvalidArgumentError on every
    worker, under S-SGD (also accumulating), SMA and DistributedGradientTape, in a tf.function and eagerly: the exchange
    averaged a's gradient on one worker with b's on another, silently, and the workers' models parted."""
    rank = kungfu.rank()
    a, b = tf.Variable(tf.fill([4], 1.0)), tf.Variable(tf.fill([4], 1.0))
    mine = a if rank % 2 == 0 else b

    def with_optimizer(strategy, steps=1):
        accumulating = {"gradient_accumulation_steps": steps} if steps > 1 else {}
        opt = kungfu.optimizers.DistributedOptimizer(keras.optimizers.SGD(0.1, **accumulating), strategy=strategy)

        def apply():
            for _ in range(steps):  # with accumulation, the exchange comes at the last
                opt.apply_gradients([(tf.fill([4], float(rank + 1)) if v is mine else None, v) for v in (a, b)])
        return apply

    def with_tape():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(mine * float(rank + 1))
        return kungfu.DistributedGradientTape(tape).gradient(loss, [a, b])

    cases = [("ssgd", with_optimizer("ssgd")), ("sma", with_optimizer("sma")), ("tape", with_tape),
             ("accumulating", with_optimizer("ssgd", steps=2))]
    for name, fn in cases:
        for how, step in (("function", tf.function(fn)), ("eager", fn)):
            try:
                step()
            except tf.errors.InvalidArgumentError as e:
                if "None for different variables" not in e.message:
                    raise AssertionError(f"{name} ({how}): unexpected message: {e.message}") from e
            else:
                raise AssertionError(f"{name} ({how}): gradients of different variables were averaged together: "
                                     f"a = {a.numpy()}, b = {b.numpy()}")
    kungfu.barrier(name="mixed-nones/after")  # the workers still meet after the failures


@check
def half_precision_weights_average_without_overflow():
    """float16 weights near 33000 (float16's largest is 65504) stay finite and close under SMA, pair averaging
    and the switch to S-SGD: the averages summed in float16 first, giving inf (then NaN)."""
    rank = kungfu.rank()
    v = tf.Variable(tf.fill([4], tf.constant(33000.0 + 16.0 * rank, tf.float16)))
    opt = kungfu.optimizers.DistributedOptimizer(keras.optimizers.SGD(0.0), strategy="sma")
    step = tf.function(lambda: opt.apply_gradients([(tf.zeros([4], tf.float16), v)]))
    for i, strategy in enumerate(("sma", "pair_averaging", "pair_averaging", "ssgd")):
        opt.strategy = strategy
        step()
        kungfu.barrier(name=f"half-average/{i}")  # every copy published before the next request
        got = v.numpy().astype(np.float64)
        if not np.all(np.isfinite(got)) or np.any(np.abs(got - 33000.0) > 16.0 * kungfu.size()):
            raise AssertionError(f"after {strategy}: float16 weights near 33000 became {got}")


def _bytes_sent(fn):
    """fn's result and the payload bytes this worker's engine sent while it ran."""
    from kungfu import _lib

    kungfu.barrier()
    before = _lib.engine_stats()["bytes_sent"]
    out = fn()
    kungfu.barrier()
    return out, _lib.engine_stats()["bytes_sent"] - before


@check
def fp16_compression_halves_the_bytes_and_keeps_the_mean():
    """compression="fp16" on the three S-SGD paths: the same means to float16's precision, in float32,
    with about half the bytes on the wire; training still matches the reference to float16's precision."""
    x, y = local_data()
    xb, yb = x[:LOCAL_BATCH], y[:LOCAL_BATCH]
    model, loss = make_model(100), loss_fn()

    def tape_grads(compression):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=True))
        return kungfu.DistributedGradientTape(tape, fusion_bytes=0, compression=compression).gradient(
            value, model.trainable_variables)

    plain, plain_bytes = _bytes_sent(lambda: tape_grads(None))
    half, half_bytes = _bytes_sent(lambda: tape_grads("fp16"))
    for p, h in zip(plain, half):
        if h.dtype != tf.float32:
            raise AssertionError(f"a compressed gradient came back as {h.dtype.name}")
        np.testing.assert_allclose(h.numpy(), p.numpy(), rtol=2e-3, atol=1e-4, err_msg="tape, fp16 against plain")
    if not 0.4 * plain_bytes <= half_bytes <= 0.6 * plain_bytes:
        raise AssertionError(f"fp16 sent {half_bytes} bytes against {plain_bytes} uncompressed")

    x, y = local_data()
    model = make_model(100)
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(sgd(), compression="fp16"), loss=loss_fn())
    model.fit(x, y, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    want = reference_weights(sgd)
    for i, (g, w) in enumerate(zip(model.get_weights(), want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-3, err_msg=f"model.fit with fp16, weight {i}")

    model, opt, loss = make_model(100), adam(), loss_fn()

    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step = kungfu.rewrite(step, compression="fp16")
    for t in range(STEPS):
        step(x[t * LOCAL_BATCH:(t + 1) * LOCAL_BATCH], y[t * LOCAL_BATCH:(t + 1) * LOCAL_BATCH])
    for i, (g, w) in enumerate(zip(model.get_weights(), reference_weights(adam))):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-3, err_msg=f"kungfu.rewrite with fp16, weight {i}")


def _disagreeing(variables):
    """The paths of the variables whose bytes differ between workers."""
    return [getattr(v, "path", v.name) for i, v in enumerate(variables)
            if not bool(kungfu.consensus(np.asarray(v.numpy()), name=f"agree/{i}"))]


@check
def switch_to_ssgd_makes_every_state_agree():
    """After pair averaging at each worker's own pace (Adam under a decaying rate) or SMA with a loss scale
    that skipped a step on one worker only, the switch to S-SGD leaves every trainable weight and every
    optimizer variable (step counts, moments, loss scale and its counter) the same bits on every worker,
    and S-SGD keeps them so."""
    rank = kungfu.rank()
    if kungfu.size() == 1:
        return
    x, y = local_data()
    loss = loss_fn()
    decaying = keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 3, 0.5))
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0 ** 10,
                                                 dynamic_growth_steps=2)
    for first, inner, steps in (("pair_averaging", decaying, 3 + 2 * rank), ("sma", scaled, 4)):
        model = make_model(100)
        opt = kungfu.optimizers.DistributedOptimizer(inner, strategy=first)

        @tf.function
        def step(xb, yb, blow_up):
            with tf.GradientTape() as tape:
                value = loss(yb, model(xb, training=True)) * blow_up  # inf on one worker: the loss scale skips
            opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))

        for i in range(steps):
            step(x[:LOCAL_BATCH], y[:LOCAL_BATCH], np.float32(np.inf if (i == 1 and rank == 1) else 1.0))
        kungfu.barrier(name=f"agree/{first}")
        opt.strategy = "ssgd"
        for i in range(3):
            step(x[i * LOCAL_BATCH:(i + 1) * LOCAL_BATCH], y[i * LOCAL_BATCH:(i + 1) * LOCAL_BATCH], np.float32(1.0))
        differ = _disagreeing(model.trainable_variables + list(opt.variables))
        if differ:
            raise AssertionError(f"after {first} and a switch to S-SGD the workers differ in {differ}")


@check
def switch_to_ssgd_rescales_gradients_of_a_drifted_loss_scale():
    """Under SMA one worker's LossScaleOptimizer skipped an overflowing step and halved its scale, so at the
    switch to S-SGD the workers' gradients come scaled by different scales. The switching step must still
    apply the mean of the workers' true gradients to their mean model (it unscaled the mean by rank 0's
    scale alone, off by the ratio of the scales, on that one step)."""
    rank = kungfu.rank()
    if kungfu.size() == 1:
        return
    x, y = local_data()
    loss = loss_fn()
    model = make_model(100)
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0 ** 10,
                                                dynamic_growth_steps=1000)
    opt = kungfu.optimizers.DistributedOptimizer(inner, strategy="sma")

    @tf.function
    def step(xb, yb, blow_up):
        with tf.GradientTape() as tape:
            value = opt.scale_loss(loss(yb, model(xb, training=True)) * blow_up)
        opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))

    step(x[:LOCAL_BATCH], y[:LOCAL_BATCH], np.float32(np.inf if rank == 1 else 1.0))  # rank 1 skips, halves
    step(x[:LOCAL_BATCH], y[:LOCAL_BATCH], np.float32(1.0))
    scales = kungfu.all_gather(np.array([float(opt.dynamic_scale.numpy())]), name="lso-switch/scales").numpy()
    if len(set(scales.tolist())) < 2:
        raise AssertionError(f"the loss scales should differ before the switch: {scales}")
    xb, yb = x[LOCAL_BATCH:2 * LOCAL_BATCH], y[LOCAL_BATCH:2 * LOCAL_BATCH]
    with tf.GradientTape() as tape:
        value = loss(yb, model(xb, training=True))
    grads = tape.gradient(value, model.trainable_variables)
    want = [kungfu.all_reduce(v, op="mean", name=f"lso-switch/w{i}") - 0.05 *
            kungfu.all_reduce(g, op="mean", name=f"lso-switch/g{i}")
            for i, (v, g) in enumerate(zip(model.trainable_variables, grads))]
    opt.strategy = "ssgd"
    step(xb, yb, np.float32(1.0))
    for i, (v, w) in enumerate(zip(model.trainable_variables, want)):
        if not np.allclose(v.numpy(), w.numpy(), rtol=1e-4, atol=1e-6):
            raise AssertionError(f"variable {i} after the switching step: off by up to "
                                 f"{np.abs(v.numpy() - w.numpy()).max()} from the mean model minus the mean gradient")


@check
def monitors_and_a_threshold_switch_run_under_sma():
    """SMA exchanges models, not gradients: its due steps all-reduce the gradients for the monitors, so the
    estimates go on (the same on every worker) and a strategy_switch on the SNR fires from SMA."""
    import kungfu.policies as kp

    if kungfu.size() == 1:
        return
    x, y = local_data()
    loss = loss_fn()
    model = make_model(100)
    opt = kungfu.optimizers.DistributedOptimizer(
        keras.optimizers.SGD(0.05), strategy="sma", monitor=["gns", "snr"], monitor_interval=2,
        local_batch_size=LOCAL_BATCH, policies=[kp.strategy_switch("ssgd", snr_below=1e9)])

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=True))
        opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))

    strategies = []
    for i in range(4):
        step(x[i * LOCAL_BATCH:(i + 1) * LOCAL_BATCH], y[i * LOCAL_BATCH:(i + 1) * LOCAL_BATCH])
        strategies.append(opt.strategy)
    count = kungfu.monitor.update_count(opt)
    values = kungfu.monitor.latest(opt)
    if count < 1 or values["snr"] == 0:
        raise AssertionError(f"the monitors did not run under SMA: {count} updates, {values}")
    if not bool(kungfu.consensus(np.array([values["gns"], values["snr"]]), name="sma-monitors")):
        raise AssertionError(f"the workers' estimates differ: {values}")
    if strategies[-1] != "ssgd":
        raise AssertionError(f"strategy_switch(snr_below=...) never fired from SMA: {strategies}")


@check
def sma_monitors_agree_when_a_loss_scale_skips_a_step_on_one_worker():
    """Under SMA each worker's LossScaleOptimizer checks its own gradients, so one worker alone skips a step
    that overflows there: its step count and scale then differ from the others'. The monitors' due steps
    (counted from the start of SMA) and estimates (from gradients each divided by its own scale) still
    agree across workers: no worker waits in an all-reduce the others skip."""
    if kungfu.size() == 1:
        return
    rank = kungfu.rank()
    x, y = local_data()
    loss = loss_fn()
    model = make_model(100)
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0 ** 10)
    opt = kungfu.optimizers.DistributedOptimizer(inner, strategy="sma", monitor=["gns"], monitor_interval=2,
                                                 local_batch_size=LOCAL_BATCH)

    @tf.function
    def step(xb, yb, blow_up):
        with tf.GradientTape() as tape:
            value = opt.scale_loss(loss(yb, model(xb, training=True)) * blow_up)
        opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))

    for i in range(6):
        step(x[:LOCAL_BATCH], y[:LOCAL_BATCH], np.float32(np.inf if (i == 1 and rank == 1) else 1.0))
    counts = kungfu.all_gather(np.array([int(opt.iterations.numpy())]), name="lso-sma/iterations").numpy()
    if len(set(counts.tolist())) < 2:
        raise AssertionError(f"the overflow on rank 1 should have skipped a step there only: {counts}")
    values = kungfu.monitor.latest(opt)
    if kungfu.monitor.update_count(opt) < 2 or not values["gns"]:
        raise AssertionError(f"the monitors did not run: {kungfu.monitor.update_count(opt)} updates, {values}")
    if not bool(kungfu.consensus(np.array([values["gns"], kungfu.monitor.update_count(opt)]), name="lso-sma")):
        raise AssertionError(f"the workers' estimates differ: {values}")


def workers_on_different_strategies():
    """Rank 0 runs SMA and the others S-SGD, in a tf.function and eagerly: every worker fails at the deadline
    (each strategy's collectives have keys of their own) instead of pairing a model with gradients. Prints
    "KFDIFFER <json>" per case."""
    import json
    import time

    rank = kungfu.rank()
    for how in ("function", "eager"):
        v = tf.Variable(tf.fill([3], 10.0 * rank))
        opt = kungfu.optimizers.DistributedOptimizer(keras.optimizers.SGD(0.1), strategy="sma" if rank == 0 else "ssgd")

        def apply():
            opt.apply_gradients([(tf.fill([3], float(rank + 1)), v)])

        step = tf.function(apply) if how == "function" else apply
        start = time.perf_counter()
        try:
            step()
            report = {"error": None, "v": v.numpy().tolist()}
        except tf.errors.OpError as e:
            report = {"error": type(e).__name__, "message": e.message.splitlines()[0]}
        report.update(how=how, seconds=round(time.perf_counter() - start, 3))
        print("KFDIFFER " + json.dumps(report), flush=True)
