"""The worker of test_layers_mp.py, started N times by kfrun. Not a test module itself.

    python -m kungfu.launcher -np N -- python tests/layers_worker.py

Prints one "KFCHECK <name> OK|FAIL ..." line per check (tests/mp.py). Every check compares
kungfu.keras.SyncBatchNormalization on N workers, each with its part of a global batch, against plain
keras.layers.BatchNormalization in one process on the whole global batch, which each worker computes
itself without the cluster.
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
import kungfu.keras  # noqa: E402
from kungfu.keras import callbacks as kf_callbacks  # noqa: E402

FEATURES, CHANNELS, CLASSES, STEPS, LOCAL_BATCH = 6, 4, 3, 10, 8
TOLERANCE = 1e-5
CHECKS, check = mp.check_list()


def assert_close(got, want, what):
    err = float(np.max(np.abs(np.asarray(got) - np.asarray(want)))) if np.size(want) else 0.0
    if not err <= TOLERANCE:
        raise AssertionError(f"{what}: differs from one process on the global batch by {err:g}")


def uneven_rows():
    """How many rows of the global batch each rank holds: 5, 3, 7 and, on 4 workers, none for rank 3."""
    return [5, 3, 7, 0][:kungfu.size()]


def my_rows(a):
    counts = uneven_rows()
    start = sum(counts[:kungfu.rank()])
    return a[start:start + counts[kungfu.rank()]]


def bn_pair(**kwargs):
    """A SyncBatchNormalization and a BatchNormalization, built with the same weights (gamma and beta
    set away from 1 and 0, so that they matter)."""
    layers = kungfu.keras.SyncBatchNormalization(**kwargs), keras.layers.BatchNormalization(**kwargs)
    return layers


def build_both(layers, shape):
    for layer in layers:
        layer.build(shape)
        if layer.scale:
            layer.gamma.assign(np.linspace(0.5, 2.0, CHANNELS))
        if layer.center:
            layer.beta.assign(np.linspace(-1.0, 1.0, CHANNELS))


@check
def outputs_statistics_and_gradients_equal_the_global_batch():
    """Uneven batches (one empty on 4 workers), eagerly and in a tf.function: the outputs, moving statistics
    and input and weight gradients equal those of one BatchNormalization on the concatenated batch."""
    rng = np.random.RandomState(3)
    x_all = (rng.normal(size=(sum(uneven_rows()), CHANNELS)) * 3 + 5).astype(np.float32)
    upstream_all = rng.normal(size=x_all.shape).astype(np.float32)
    total = len(x_all)
    for compiled in (False, True):
        sync, plain = bn_pair(momentum=0.5)
        build_both((sync, plain), (None, CHANNELS))

        def forward_backward(layer, x, upstream):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * upstream) / total  # this worker's share of the global loss
            return (y, *tape.gradient(loss, [x, layer.gamma, layer.beta]))

        step = tf.function(forward_backward) if compiled else forward_backward
        for _ in range(2):  # two steps: the moving statistics move twice
            y, dx, dgamma, dbeta = step(sync, tf.constant(my_rows(x_all)), tf.constant(my_rows(upstream_all)))
            want = step(plain, tf.constant(x_all), tf.constant(upstream_all))
        # the weight gradients are shares of the global loss's: summed over workers they are its gradients
        dgamma, dbeta = kungfu.ops.all_reduce(dgamma), kungfu.ops.all_reduce(dbeta)  # before any check fails
        mode = "tf.function" if compiled else "eager"
        assert_close(y, my_rows(want[0].numpy()), f"{mode} outputs")
        assert_close(dx, my_rows(want[1].numpy()), f"{mode} input gradients")
        assert_close(dgamma, want[2], f"{mode} gamma gradients")
        assert_close(dbeta, want[3], f"{mode} beta gradients")
        assert_close(sync.moving_mean, plain.moving_mean, f"{mode} moving mean")
        assert_close(sync.moving_variance, plain.moving_variance, f"{mode} moving variance")
        assert_close(sync(my_rows(x_all), training=False), my_rows(plain(x_all, training=False).numpy()),
                     f"{mode} inference outputs")


@check
def a_large_mean_keeps_the_accuracy_of_batch_normalization():
    """Inputs of mean 100 and spread 0.1 (uneven batches, one empty on 4 workers), in float32, at the
    first step: the outputs, gradients and moving variance are about as close to BatchNormalization in
    float64 on the global batch as BatchNormalization's own in float32 (a seventh of the tolerances below
    or less, on 1, 2 and 4 workers). With the variance taken as E[x^2] - E[x]^2 in float32 the spread was
    lost to rounding: outputs off by 0.05 to 0.35, gradients by 1% to 11%, the moving variance by 2e-4
    to 1e-3."""
    rng = np.random.RandomState(6)
    x_all = (rng.normal(size=(sum(uneven_rows()), CHANNELS)) * 0.1 + 100).astype(np.float32)
    upstream_all = rng.normal(size=x_all.shape).astype(np.float32)

    def forward_backward(layer, x, upstream):
        build_both((layer,), (None, CHANNELS))
        x, upstream = tf.constant(x, layer.dtype), tf.constant(upstream, layer.dtype)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * upstream) / len(x_all)
        dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
        return [np.asarray(t, np.float64) for t in (y, dx, dgamma, dbeta, layer.moving_variance)]

    exact = forward_backward(keras.layers.BatchNormalization(momentum=0.5, dtype="float64"), x_all, upstream_all)
    plain = forward_backward(keras.layers.BatchNormalization(momentum=0.5), x_all, upstream_all)
    sync = forward_backward(kungfu.keras.SyncBatchNormalization(momentum=0.5), my_rows(x_all), my_rows(upstream_all))
    sync[2:4] = [kungfu.ops.all_reduce(g).numpy() for g in sync[2:4]]  # before any check fails
    # (what, tolerance, the errors' scale): outputs absolute, gradients relative to the largest one
    limits = [("outputs", 2e-3, 1.0), ("input gradients", 5e-4, np.abs(exact[1]).max()),
              ("gamma gradients", 5e-4, np.abs(exact[2]).max()), ("beta gradients", 5e-4, np.abs(exact[3]).max()),
              ("moving variance", 2e-7, 1.0)]
    for i, (what, tolerance, scale) in enumerate(limits):
        mine = (lambda a: a) if i >= 2 else my_rows  # outputs and input gradients: this worker's rows
        err = float(np.max(np.abs(sync[i] - mine(exact[i])), initial=0.0)) / scale
        plain_err = float(np.max(np.abs(mine(plain[i]) - mine(exact[i])), initial=0.0)) / scale
        if not err <= tolerance:
            raise AssertionError(f"mean 100, spread 0.1: {what} differ from float64 by {err:g} (BatchNormalization "
                                 f"in float32: {plain_err:g}; tolerance {tolerance:g})")


@check
def masked_steps_and_channels_first_equal_the_global_batch():
    rng = np.random.RandomState(4)
    rows = [max(n, 1) for n in uneven_rows()]  # a mask needs a row to mask
    x_all = rng.normal(size=(sum(rows), 5, CHANNELS)).astype(np.float32)
    mask_all = rng.uniform(size=(sum(rows), 5)) < 0.6
    start = sum(rows[:kungfu.rank()])
    mine = slice(start, start + rows[kungfu.rank()])
    sync, plain = bn_pair()
    build_both((sync, plain), (None, 5, CHANNELS))
    y = sync(x_all[mine], training=True, mask=tf.constant(mask_all[mine]))
    want = plain(x_all, training=True, mask=tf.constant(mask_all))
    assert_close(y, want.numpy()[mine], "masked outputs")
    assert_close(sync.moving_variance, plain.moving_variance, "masked moving variance")

    sync, plain = bn_pair(axis=1)  # channels first: statistics over every axis but 1
    x_all = np.transpose(x_all, (0, 2, 1))
    build_both((sync, plain), (None, CHANNELS, 5))
    y = sync(x_all[mine], training=True)
    assert_close(y, plain(x_all, training=True).numpy()[mine], "channels-first outputs")


def make_model(seed, norm):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8), norm(),
                             keras.layers.Activation("tanh"), keras.layers.Dense(CLASSES)])


@check
def fit_equals_one_process_and_the_model_saves():
    """model.fit with DistributedOptimizer on equal shards ends with the weights (moving statistics
    included) of one process training BatchNormalization on the global batches; the saved model loads
    back as SyncBatchNormalization."""
    size, rank = kungfu.size(), kungfu.rank()
    rng = np.random.RandomState(5)
    x = (rng.normal(size=(STEPS * size * LOCAL_BATCH, FEATURES)) * 2 + 1).astype(np.float32)
    y = rng.randint(0, CLASSES, size=len(x))
    blocks = lambda a: a.reshape(STEPS, size, LOCAL_BATCH, *a.shape[1:])[:, rank].reshape(-1, *a.shape[1:])  # noqa
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    model = make_model(100 + rank, kungfu.keras.SyncBatchNormalization)  # differs until the broadcast
    model.compile(optimizer=kungfu.optimizers.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss)
    model.fit(blocks(x), blocks(y), batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[kf_callbacks.BroadcastGlobalVariablesCallback(root=0)])
    reference = make_model(100, keras.layers.BatchNormalization)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    reference.fit(x, y, batch_size=size * LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    for i, (got, want) in enumerate(zip(model.get_weights(), reference.get_weights())):
        assert_close(got, want, f"model.fit weight {i}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = kungfu.keras.load_model(path)
    kinds = [type(layer).__name__ for layer in loaded.layers]
    if "SyncBatchNormalization" not in kinds:
        raise AssertionError(f"the saved model loaded back as {kinds}")
    assert_close(loaded(x[:4], training=False), model(x[:4], training=False), "the loaded model's outputs")


@check
def synchronized_true_is_refused():
    try:
        kungfu.keras.SyncBatchNormalization(synchronized=True)
    except ValueError as e:
        if "tf.distribute" not in str(e):
            raise
    else:
        raise AssertionError("SyncBatchNormalization(synchronized=True) was accepted")


def main():
    kungfu.init()
    sys.exit(1 if mp.run_checks(CHECKS, kungfu.rank()) else 0)


if __name__ == "__main__":
    main()
