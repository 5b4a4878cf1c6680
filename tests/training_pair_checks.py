"""Training checks of pair averaging (PairAveragingOptimizer): workers find each other's models whatever
their optimizers are named, a model averages only with copies of itself from its own phase (and a switch
to S-SGD in between sets the workers' models to their mean), variables without gradients are left alone;
and, in a launch of its own, a peer that finished first answers "none" rather than failing the others.
Run by tests/training_worker.py with its own checks and those of training_strategy_checks.py.
"""

import keras
import numpy as np
import tensorflow as tf

import kungfu

import mp
from training_common import LOCAL_BATCH, local_data, loss_fn, make_model, sgd

CHECKS, check = mp.check_list()


@check
def pair_averaging_pairs_models_whatever_the_optimizers_are_named():
    """Keras names optimizers per process ("sgd", "sgd_1"): an extra one on rank 0 must not keep the
    workers' pair averaging from finding each other's models (it once did, silently)."""
    rank = kungfu.rank()
    if rank == 0:
        keras.optimizers.SGD()  # takes the first automatic name on rank 0 only
    v = tf.Variable(tf.fill([3], float(rank)))
    opt = kungfu.optimizers.PairAveragingOptimizer(keras.optimizers.SGD(0.0))  # only the averaging moves v
    step = tf.function(lambda: opt.apply_gradients([(tf.zeros([3]), v)]))
    seen = []
    for i in range(4):
        step()
        seen.append(float(v.numpy()[0]))
        kungfu.barrier(name=f"pair-names/{i}")  # every model published before the next requests
    # From the second step on, every worker averages with a peer's published copy, which differs from its
    # own; later averages may bring it back to where it started, so look at every step.
    if all(x == float(rank) for x in seen):
        raise AssertionError(f"rank {rank}'s model never moved ({seen}): no peer's copy was found")


@check
def pair_averaging_meets_only_its_own_model_and_phase():
    """Two models of one layout, each with its own pair averaging optimizer, never average with each
    other; the switch to S-SGD sets the workers' drifted models to their mean; and after switching back,
    a peer's copy left from the first phase counts as none (lr 0 throughout: only averaging moves weights)."""
    rank = kungfu.rank()

    def make(value):
        v = tf.Variable(tf.fill([3], value))
        opt = kungfu.optimizers.PairAveragingOptimizer(keras.optimizers.SGD(0.0))
        return v, opt, tf.function(lambda: opt.apply_gradients([(tf.zeros([3]), v)]))

    def run(step, steps, tag):
        for i in range(steps):
            step()
            kungfu.barrier(name=f"pair-phase/{tag}/{i}")  # every copy published before the next requests

    a, opt_a, step_a = make(1.0)
    b, _, step_b = make(100.0)
    for i in range(3):
        run(step_a, 1, f"a{i}")
        run(step_b, 1, f"b{i}")
    if not (np.all(a.numpy() == 1.0) and np.all(b.numpy() == 100.0)):
        raise AssertionError(f"two models of one layout averaged with each other: {a.numpy()}, {b.numpy()}")
    a.assign(tf.fill([3], float(rank)))  # phase 1: the workers' models differ, and their copies too
    run(step_a, 2, "first")
    opt_a.strategy = "ssgd"
    run(step_a, 1, "ssgd")
    if not bool(kungfu.consensus(a.numpy(), name="pair-phase/synced")):
        raise AssertionError(f"after the switch to S-SGD the workers' models still differ: {a.numpy()}")
    a.assign(tf.fill([3], 5.0))  # the same on every worker; the stores still hold phase 1's copies
    opt_a.strategy = "pair_averaging"
    run(step_a, 2, "second")
    if not np.all(a.numpy() == 5.0):
        raise AssertionError(f"after switching back, a copy from the earlier phase was averaged in: {a.numpy()}")


@check
def pair_averaging_leaves_variables_without_gradients_alone():
    """Variables whose gradient is None (an output with no loss, a frozen layer) are neither averaged nor
    published, under every strategy; pair averaging goes on over the others, and over another set later
    (each set has its own store name: asking for a copy of the whole model's size once failed). Coming back
    to an earlier set begins a new phase, so copies published before count as none. lr 0 throughout: only
    averaging moves weights. Then the same through model.fit: a layer frozen between two fits."""
    rank = kungfu.rank()
    a, b = tf.Variable(tf.fill([3], float(rank))), tf.Variable(tf.fill([2], float(rank)))
    opt = kungfu.optimizers.PairAveragingOptimizer(keras.optimizers.SGD(0.0))
    both = tf.function(lambda: opt.apply_gradients([(tf.zeros([3]), a), (tf.zeros([2]), b)]))
    only_a = tf.function(lambda: opt.apply_gradients([(tf.zeros([3]), a), (None, b)]))

    def run(step, steps, tag):
        for i in range(steps):
            step()
            kungfu.barrier(name=f"pair-none/{tag}/{i}")  # every copy published before the next requests

    run(both, 2, "both")
    # 10^rank, not rank: a peer ahead by a step may already hold the mean of two others' values, which
    # with values 1 and 3 is 2, and averaging a 2 with it would look like no averaging at all.
    a.assign(tf.fill([3], 10.0 ** rank))
    b.assign(tf.fill([2], float(rank)))
    run(only_a, 2, "only_a")
    if not np.all(b.numpy() == float(rank)) or np.all(a.numpy() == 10.0 ** rank):
        raise AssertionError(f"over [a] alone, pair averaging gave a = {a.numpy()} and b = {b.numpy()}")
    a.assign(tf.fill([3], 7.0))  # the same on every worker; the stores hold older copies of [a, b]
    b.assign(tf.fill([2], 7.0))
    run(both, 2, "again")
    if not (np.all(a.numpy() == 7.0) and np.all(b.numpy() == 7.0)):
        raise AssertionError(f"back to [a, b], an out-of-date copy was averaged in: {a.numpy()}, {b.numpy()}")
    b.assign(tf.fill([2], float(rank)))
    for strategy in ("sma", "ssgd"):
        opt.strategy = strategy
        only_a()
    if not np.all(b.numpy() == float(rank)):
        raise AssertionError(f"SMA or the switch to S-SGD averaged a variable without gradients: {b.numpy()}")

    x, y = local_data()
    model = make_model(100 + rank)
    opt = kungfu.optimizers.PairAveragingOptimizer(sgd())
    for frozen in (False, True):
        model.layers[0].trainable = not frozen
        model.compile(optimizer=opt, loss=loss_fn())  # the same optimizer, over fewer variables
        before = model.layers[0].get_weights()
        model.fit(x[:4 * LOCAL_BATCH], y[:4 * LOCAL_BATCH], batch_size=LOCAL_BATCH, shuffle=False, verbose=0)
    if any(np.any(w != v) for w, v in zip(model.layers[0].get_weights(), before)):
        raise AssertionError("pair averaging changed a frozen layer")


def pair_averaging_outlives_a_departed_peer():
    """Rank 0 stops after 2 pair-averaging steps; its finalize waits the 4 s timeout for the others and
    leaves without them. The others train on for about 7 s, still drawing rank 0 as a peer: a request to it
    answers "none" (they keep their own model for that step) instead of failing. Prints "KFOUTLIVE <json>"."""
    import json
    import time

    rank = kungfu.rank()
    v = tf.Variable(tf.fill([3], float(rank)))
    opt = kungfu.optimizers.PairAveragingOptimizer(keras.optimizers.SGD(0.0))
    step = tf.function(lambda: opt.apply_gradients([(tf.zeros([3]), v)]))
    steps, start = 2 if rank == 0 else 45, time.perf_counter()
    for _ in range(steps):
        step()
        if rank != 0:
            time.sleep(0.15)
    print("KFOUTLIVE " + json.dumps({"rank": rank, "steps": steps, "seconds": round(time.perf_counter() - start, 3)}),
          flush=True)
