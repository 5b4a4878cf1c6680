"""The worker of test_training_mp.py, started N times by kfrun. Not a test module itself.

    python -m kungfu.launcher -np N -- python tests/training_worker.py equivalence [CHECK,CHECK,...]
    python -m kungfu.launcher -np 4 -- python tests/training_worker.py digits
    python -m kungfu.launcher -np 2 --timeout 4 -- python tests/training_worker.py strategies_differ
    python -m kungfu.launcher -np 3 --timeout 4 -- python tests/training_worker.py pair_leaver

Prints one "KFCHECK <name> OK|FAIL ..." line per check (tests/mp.py). A comma-separated list of check
names after the mode runs only those.

`equivalence`: S-SGD on N workers, each on its shard of every global batch, must end with the
weights of one process trained on the whole global batches (within 1e-5 after 20 steps), for
model.fit, for a custom loop with DistributedGradientTape, and for opt.apply_gradients in a
tf.function and eagerly. Each worker computes that single-process reference itself, without the
cluster. Workers build their models from different seeds, so the fit check also shows that
BroadcastGlobalVariablesCallback makes them start identical (data, model and reference:
tests/training_common.py); so it does for a model built on its first batch, or one that model.build()
marked built without variables. Also: gradient buckets in flight together, MetricAverageCallback, training
resumed from a saved model by kungfu.keras.load_model, gradient accumulation (one exchange per
update, also inside a loss-scale optimizer), mixed precision with a loss-scale optimizer (an overflow
on one worker skips the step on all), and a clear error at once when the workers' model.fit would take
different numbers of steps; and, in the same launch, the strategies and exchange forms
(tests/training_strategy_checks.py) and pair averaging (tests/training_pair_checks.py).

`digits`: SMA and pair averaging reach 90% test accuracy on scikit-learn's digits, and the workers'
models end close to each other.
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import sys  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
import kungfu.keras  # noqa: E402
from kungfu.keras import callbacks as kf_callbacks  # noqa: E402

import training_pair_checks  # noqa: E402
import training_strategy_checks  # noqa: E402
from training_common import (CLASSES, FEATURES, LOCAL_BATCH, STEPS, adam, assert_close, dataset,  # noqa: E402
                             local_data, loss_fn, make_model, reference_weights, sgd)

CHECKS, check = mp.check_list()


@check
def fit_equals_single_process():
    broadcast = kf_callbacks.BroadcastGlobalVariablesCallback(root=0)  # one callback for both models' fits
    for make_optimizer in (sgd, adam):
        x, y = local_data()
        model = make_model(100 + kungfu.rank())  # different on every worker until the broadcast
        model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(make_optimizer()), loss=loss_fn())
        model.fit(x, y, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[broadcast])
        assert_close(model.get_weights(), reference_weights(make_optimizer), f"model.fit, {make_optimizer.__name__}")


@check
def broadcast_callback_waits_for_a_model_built_on_its_first_batch():
    """A Sequential without keras.Input has no variables until fit's first step: the callback broadcasts
    root's model before the second step. It leaves each worker its own dropout random state."""
    x, y = local_data()
    keras.utils.set_random_seed(100 + kungfu.rank())
    model = keras.Sequential([keras.layers.Dense(16, activation="tanh"), keras.layers.Dropout(0.5),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(adam()), loss=loss_fn())
    model.fit(x, y, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[kf_callbacks.BroadcastGlobalVariablesCallback(root=0)])
    flat = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables + model.optimizer.variables])
    if not bool(kungfu.consensus(flat, name="unbuilt/model")):
        raise AssertionError("the workers' models differ after fit with BroadcastGlobalVariablesCallback")
    mask = model.layers[1](tf.ones([1, 256]), training=True).numpy()
    if kungfu.size() > 1 and bool(kungfu.consensus(mask, name="unbuilt/dropout")):
        raise AssertionError("every worker drew the same dropout mask: the broadcast copied the seed state")


@check
def broadcast_callback_waits_for_a_subclassed_model_that_build_left_empty():
    """model.build(shape) marks a subclassed model with no build() method built without creating its layers'
    variables: the callback waits for them, as for a model built on its first batch, rather than build the
    optimizer over none (fit then failed at its first step) and take the model as broadcast. Its add_weight
    in __init__ makes one variable that build() leaves: building the optimizer over that one alone failed
    the same way ("Unknown variable")."""
    import warnings

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden, self.out = keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(CLASSES)
            self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

        def call(self, x):
            return self.out(self.hidden(x)) * self.scale

    x, y = local_data()
    keras.utils.set_random_seed(100 + kungfu.rank())
    model = Subclassed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras warns that build() leaves it unbuilt
        model.build((None, FEATURES))
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(adam()), loss=loss_fn())
    model.fit(x[:4 * LOCAL_BATCH], y[:4 * LOCAL_BATCH], batch_size=LOCAL_BATCH, shuffle=False, verbose=0,
              callbacks=[kf_callbacks.BroadcastGlobalVariablesCallback(root=0)])
    flat = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables + model.optimizer.variables])
    if flat.size < FEATURES * 16 or not bool(kungfu.consensus(flat, name="built-empty/model")):
        raise AssertionError("the workers' models differ after fit with BroadcastGlobalVariablesCallback")


def _train_custom(step, model):
    x, y = local_data()
    for t in range(STEPS):
        step(x[t * LOCAL_BATCH:(t + 1) * LOCAL_BATCH], y[t * LOCAL_BATCH:(t + 1) * LOCAL_BATCH])
    assert_close(model.get_weights(), reference_weights(adam), step.__name__)


@check
def custom_loop_equals_single_process():
    model, opt, loss = make_model(100), adam(), loss_fn()

    @tf.function
    def tape_step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        tape = kungfu.DistributedGradientTape(tape)
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    _train_custom(tape_step, model)

    for compiled in (True, False):
        model, loss = make_model(100), loss_fn()
        opt = kungfu.optimizers.SynchronousSGDOptimizer(adam())

        def wrapper_step(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        wrapper_step.__name__ = "apply_gradients in tf.function" if compiled else "apply_gradients eagerly"
        _train_custom(tf.function(wrapper_step) if compiled else wrapper_step, model)


@check
def gradient_buckets_are_in_flight_together():
    from kungfu import _lib

    x, y = local_data()
    model, loss = make_model(100), loss_fn()
    opt = kungfu.optimizers.SynchronousSGDOptimizer(sgd(), fusion_bytes=0)  # one collective per gradient

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))

    step(x[:LOCAL_BATCH], y[:LOCAL_BATCH])
    most = 0
    for _ in range(5):  # a worker that is ahead may finish a small collective before the next starts
        kungfu.barrier()
        _lib.reset_engine_stats()
        step(x[:LOCAL_BATCH], y[:LOCAL_BATCH])
        most = max(most, _lib.engine_stats()["max_in_flight"])
    if most < 2:
        raise AssertionError(f"at most {most} of the step's {len(model.trainable_variables)} gradient collectives "
                             "were in flight at once")


@check
def metric_average_callback_agrees():
    """The loss and a metric that logs one value per class (averaged element by element) agree."""

    class PredictedClasses(keras.metrics.Metric):
        def __init__(self):
            super().__init__(name="predicted")
            self.counts = self.add_weight(shape=(CLASSES,), initializer="zeros", name="counts")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.counts.assign_add(tf.reduce_sum(tf.one_hot(tf.argmax(y_pred, -1), CLASSES), 0))

        def result(self):
            return self.counts

    x, y = local_data()
    model = make_model(100)
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(sgd()), loss=loss_fn(),
                  metrics=[PredictedClasses()])
    history = model.fit(x, y, batch_size=LOCAL_BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[kf_callbacks.MetricAverageCallback()])
    value = np.array(history.history["loss"], np.float64)
    if not bool(kungfu.consensus(value)):
        raise AssertionError(f"MetricAverageCallback: workers logged different losses: {value}")
    counts = np.array(history.history["predicted"], np.float64)
    if counts.shape != (2, CLASSES) or not bool(kungfu.consensus(counts)):
        raise AssertionError(f"MetricAverageCallback: per-class values {counts.tolist()} differ across workers")
    if not np.allclose(counts.sum(axis=1), len(x)):  # each worker predicted its len(x) rows; so does the mean
        raise AssertionError(f"MetricAverageCallback: per-class means {counts.tolist()} do not add up to {len(x)}")


@check
def resumed_fit_equals_single_process():
    """Half the steps, model.save on rank 0, kungfu.keras.load_model on every worker, the other half:
    the weights of one uninterrupted single-process run (Adam's step count and moments survive)."""
    import os
    import shutil
    import tempfile

    x, y = local_data()
    half = STEPS // 2 * LOCAL_BATCH
    model = make_model(100)
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(adam()), loss=loss_fn())
    model.fit(x[:half], y[:half], batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    folder = kungfu.broadcast_object(tempfile.mkdtemp() if kungfu.rank() == 0 else None, root=0)
    path = os.path.join(folder, "model.keras")
    try:
        if kungfu.rank() == 0:
            model.save(path)
        kungfu.barrier()
        resumed = kungfu.keras.load_model(path)
        kungfu.barrier()  # every worker has read the file
    finally:
        if kungfu.rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if not isinstance(resumed.optimizer, kungfu.optimizers.DistributedMixin):
        raise AssertionError(f"load_model: the optimizer is a plain {type(resumed.optimizer).__name__}")
    if int(resumed.optimizer.iterations) != STEPS // 2:
        raise AssertionError(f"load_model: step count {int(resumed.optimizer.iterations)}, not {STEPS // 2}")
    resumed.fit(x[half:], y[half:], batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert_close(resumed.get_weights(), reference_weights(adam), "load_model and fit")


@check
def gradient_accumulation_exchanges_once_per_update():
    """gradient_accumulation_steps=2 (Horovod's backward_passes_per_step): S-SGD ends with the weights of
    one process accumulating over the whole global batches, bit for bit the same on every worker, with
    half the all-reduces of the same steps without accumulation; SMA, too, averages once per update."""
    from kungfu import _lib

    def accumulating():
        return keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2)

    def run(make_optimizer, wrap):
        """STEPS steps of a custom loop on this worker's shard: the model and the collectives they took."""
        x, y = local_data()
        model, opt, loss = make_model(100), wrap(make_optimizer()), loss_fn()

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                value = loss(yb, model(xb, training=True))
            opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))

        kungfu.barrier()
        before = _lib.engine_stats()["completed"]
        for t in range(STEPS):
            step(x[t * LOCAL_BATCH:(t + 1) * LOCAL_BATCH], y[t * LOCAL_BATCH:(t + 1) * LOCAL_BATCH])
        return model, _lib.engine_stats()["completed"] - before

    ssgd, sma = kungfu.optimizers.SynchronousSGDOptimizer, kungfu.optimizers.SynchronousAveragingOptimizer
    model, accumulated = run(accumulating, ssgd)
    assert_close(model.get_weights(), reference_weights(accumulating), "S-SGD with gradient accumulation")
    if not bool(kungfu.consensus(np.concatenate([w.ravel() for w in model.get_weights()]))):
        raise AssertionError("S-SGD with gradient accumulation: the workers' weights differ in their bits")
    _, every_step = run(sgd, ssgd)
    if every_step != STEPS or accumulated != STEPS // 2:
        raise AssertionError(f"S-SGD took {accumulated} collectives with accumulation over 2 steps and "
                             f"{every_step} without, in {STEPS} steps")
    _, accumulated = run(accumulating, sma)
    _, every_step = run(sgd, sma)
    if not (accumulated > 0 and 2 * accumulated == every_step):
        raise AssertionError(f"SMA took {accumulated} collectives with accumulation and {every_step} without")


@check
def loss_scaled_accumulation_exchanges_once_per_update():
    """LossScaleOptimizer(SGD(gradient_accumulation_steps=2)), the mixed-precision form (Keras refuses the
    argument on the loss-scale optimizer itself), inside S-SGD: one exchange per update too, and the
    weights of one process accumulating over the whole global batches. With an overflow on rank 1 alone in
    the first micro-step of the third update, every worker skips that update and halves the scale, and
    the next update accumulates two micro-batches again: the weights are those of one process that never
    saw global batches 4 and 5."""
    from kungfu import _lib

    def accumulating():
        return keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2)

    x, y = local_data()
    loss = loss_fn()
    for overflow_at in (None, 4):
        model = make_model(100)
        opt = kungfu.optimizers.SynchronousSGDOptimizer(
            keras.optimizers.LossScaleOptimizer(accumulating(), initial_scale=2.0 ** 10))

        @tf.function
        def step(xb, yb, blow_up):
            with tf.GradientTape() as tape:
                value = opt.scale_loss(loss(yb, model(xb, training=True)) * blow_up)
            opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))

        kungfu.barrier()
        before = _lib.engine_stats()["completed"]
        for t in range(STEPS):
            blow_up = np.inf if (t == overflow_at and kungfu.rank() == 1) else 1.0
            step(x[t * LOCAL_BATCH:(t + 1) * LOCAL_BATCH], y[t * LOCAL_BATCH:(t + 1) * LOCAL_BATCH],
                 np.float32(blow_up))
        exchanges = _lib.engine_stats()["completed"] - before
        state = np.array([int(opt.iterations), float(opt.dynamic_scale)], np.float64)
        agree = bool(kungfu.consensus(np.concatenate([w.ravel() for w in model.get_weights()] + [state])))
        if exchanges != STEPS // 2:
            raise AssertionError(f"{exchanges} collectives in {STEPS} micro-steps with accumulation over 2 "
                                 f"(overflow at {overflow_at})")
        if not agree:
            raise AssertionError(f"the workers' weights, steps or loss scale differ (overflow at {overflow_at})")
        if overflow_at is None:
            assert_close(model.get_weights(), reference_weights(accumulating), "loss-scaled accumulation")
            continue
        if state.tolist() != [STEPS // 2 - 1, 2.0 ** 9]:
            raise AssertionError(f"after one overflowing update: {state.tolist()} (updates, loss scale)")
        gx, gy = dataset(kungfu.size())
        rows = kungfu.size() * LOCAL_BATCH
        kept = np.r_[0:4 * rows, 6 * rows:len(gx)]  # every global batch but 4 and 5
        reference = make_model(100)
        reference.compile(optimizer=accumulating(), loss=loss_fn())
        reference.fit(gx[kept], gy[kept], batch_size=rows, epochs=1, shuffle=False, verbose=0)
        assert_close(model.get_weights(), reference.get_weights(), "loss-scaled accumulation with an overflow")


@check
def accumulation_survives_a_fit_that_ends_between_updates():
    """gradient_accumulation_steps=2 through model.fit, split into a fit of 3 steps (it ends half way
    through an update) and one of the rest, each with its own BroadcastGlobalVariablesCallback: the
    second broadcast must leave each worker's half-filled accumulators alone, so the weights are still
    those of one process over the whole global batches."""
    def accumulating():
        return keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2)

    x, y = local_data()
    first = 3 * LOCAL_BATCH
    model = make_model(100 + kungfu.rank())  # different on every worker until the first broadcast
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(accumulating()), loss=loss_fn())
    for part in (slice(None, first), slice(first, None)):
        model.fit(x[part], y[part], batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[kf_callbacks.BroadcastGlobalVariablesCallback(root=0)])
    assert_close(model.get_weights(), reference_weights(accumulating), "two fits with gradient accumulation")


@check
def loss_scaling_skips_one_workers_overflow_everywhere():
    """Under mixed_float16, with the LossScaleOptimizer inside the distributed one: a batch that overflows
    on rank 1 only (inputs beyond float16's range) is skipped on every worker, because the overflow check
    reads the averaged gradients; the workers end with the same steps, loss scale and weights."""
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = local_data()
        if kungfu.rank() == 1:
            x = x.copy()
            x[5 * LOCAL_BATCH:6 * LOCAL_BATCH] = 1e5
        model = make_model(100)
        opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.LossScaleOptimizer(sgd()))
        model.compile(optimizer=opt, loss=loss_fn())
        model.fit(x, y, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    state = np.array([int(opt.iterations), float(opt.dynamic_scale)], np.float64)
    if not bool(kungfu.consensus(state)) or not state[0] < STEPS:
        raise AssertionError(f"steps applied and loss scale {state.tolist()} differ across workers, or no step "
                             f"of {STEPS} was skipped")
    if not bool(kungfu.consensus(np.concatenate([w.ravel() for w in model.get_weights()]))):
        raise AssertionError("the workers' weights differ after a skipped step")


@check
def unequal_steps_fail_at_once():
    """Rank 0 with one batch more than the others: every worker's fit raises ValueError naming the step
    counts before the first step (not DeadlineExceededError at the last one); pair averaging takes them."""
    x, y = local_data()
    n = (STEPS // 2 + (1 if kungfu.rank() == 0 else 0)) * LOCAL_BATCH
    model = make_model(100)
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(sgd()), loss=loss_fn())
    try:
        model.fit(x[:n], y[:n], batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[kf_callbacks.BroadcastGlobalVariablesCallback(root=0)])
    except ValueError as e:
        want = f"rank 0: {STEPS // 2 + 1}, rank 1: {STEPS // 2}"
        if want not in str(e) or "different numbers of steps per epoch" not in str(e):
            raise AssertionError(f"unexpected error: {e}") from e
    else:
        raise AssertionError("fit with unequal steps per epoch did not raise")
    kungfu.barrier()
    model = make_model(100)
    model.compile(optimizer=kungfu.optimizers.PairAveragingOptimizer(sgd()), loss=loss_fn())
    model.fit(x[:n], y[:n], batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[kf_callbacks.BroadcastGlobalVariablesCallback(root=0)])
    kungfu.barrier()


def digits_shards():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.RandomState(0).permutation(len(x))  # the same split on every worker
    x, y = (x[order] / 16.0).astype(np.float32), y[order]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    return x_train[kungfu.rank()::kungfu.size()], y_train[kungfu.rank()::kungfu.size()], x_test, y_test


def digits_model():
    keras.utils.set_random_seed(kungfu.rank())
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10)])


def train_digits(optimizer):
    x, y, x_test, y_test = digits_shards()
    model = digits_model()
    model.compile(optimizer=optimizer, loss=loss_fn(), metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=15, verbose=0,
              callbacks=[kf_callbacks.BroadcastGlobalVariablesCallback(root=0)])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    mean = kungfu.all_reduce(flat, op="mean").numpy()
    spread = float(kungfu.all_reduce(np.array([np.linalg.norm(flat - mean) / np.linalg.norm(mean)]), op="max")[0])
    print(f"KFDIGITS {optimizer.strategy} accuracy={accuracy:.4f} spread={spread:.4f}", flush=True)
    if accuracy < 0.9:
        raise AssertionError(f"test accuracy {accuracy:.3f} < 0.9")
    if spread > 0.1:
        raise AssertionError(f"the workers' models are {spread:.3f} apart (relative L2 to their mean), above 0.1")


DIGITS_CHECKS = []


@DIGITS_CHECKS.append
def sma_digits():
    train_digits(kungfu.optimizers.SynchronousAveragingOptimizer(keras.optimizers.Adam(0.01), alpha=0.1))


@DIGITS_CHECKS.append
def pair_averaging_digits():
    train_digits(kungfu.optimizers.PairAveragingOptimizer(keras.optimizers.Adam(0.01)))


def main():
    kungfu.init()
    if sys.argv[1] == "strategies_differ":
        return training_strategy_checks.workers_on_different_strategies()
    if sys.argv[1] == "pair_leaver":
        return training_pair_checks.pair_averaging_outlives_a_departed_peer()
    checks = DIGITS_CHECKS
    if sys.argv[1] == "equivalence":
        checks = CHECKS + training_strategy_checks.CHECKS + training_pair_checks.CHECKS
    if len(sys.argv) > 2:  # only these checks, by name (comma-separated)
        wanted = sys.argv[2].split(",")
        unknown = sorted(set(wanted) - {fn.__name__ for fn in checks})
        if unknown:
            sys.exit(f"training_worker.py: no such check: {', '.join(unknown)}")
        checks = [fn for fn in checks if fn.__name__ in wanted]
    sys.exit(1 if mp.run_checks(checks, kungfu.rank()) else 0)


if __name__ == "__main__":
    main()
