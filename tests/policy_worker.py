"""The worker of test_policy_mp.py, started N times by kfrun. Not a test module itself.

    python -m kungfu.launcher -np 4 -- python tests/policy_worker.py

Prints one "KFCHECK <name> OK|FAIL ..." line per check (tests/mp.py). Each check trains a little with
policies that change the strategy, the learning rate and the batch size, records what every step ran
with, and compares the records of all workers (all_gather): every change must take effect at the
same step everywhere, even when the policies see different local values; a policy that raises on
one worker must raise PolicyError on every worker, promptly.
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
from kungfu import optimizers  # noqa: E402
from kungfu.errors import PolicyError  # noqa: E402
import kungfu.policies as kp  # noqa: E402
from kungfu.policies import BasePolicy  # noqa: E402
from kungfu.policies.context import state_values  # noqa: E402

FEATURES, CLASSES = 6, 3


def data(n=256, seed=5):
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    return x, (x[:, :CLASSES].argmax(1)).astype(np.int64)


def compiled_model(opt):
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def same_everywhere(record, what):
    """Raises unless every worker's record (a float64 array of the same shape) equals rank 0's."""
    mine = np.asarray(record, np.float64)
    every = kungfu.all_gather(tf.constant(mine[None])).numpy()
    for r, theirs in enumerate(every):
        if not np.array_equal(theirs, every[0]):
            raise AssertionError(f"{what}: rank {r} recorded {theirs.tolist()}, rank 0 {every[0].tolist()}")
    return every[0]


class Record(keras.callbacks.Callback):
    """After the policy callback: what each step ran with (strategy index, learning rate, batch rows)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        opt = self.model.optimizer
        self.rows.append([float(opt.strategy_variable.numpy()), float(opt.learning_rate.numpy())])


class Schedule(BasePolicy):
    """Switches to SMA after step 4 and sets the learning rate to 0.05 after step 6."""

    def after_step(self, ctx):
        ctx.set_strategy("sma", when=ctx.step == 4)
        ctx.set_learning_rate(0.05, when=ctx.step == 6)


def strategy_and_learning_rate_change_at_the_same_step():
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))
    model = compiled_model(opt)
    x, y = data()
    rec = Record()
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=9, verbose=0,
              callbacks=[kungfu.keras.PolicyCallback([Schedule()]), rec])
    rows = same_everywhere(rec.rows, "strategy, learning rate per step")
    expect_strategy = [0] * 3 + [1] * 6  # the switch after step 4 is seen from step 4's record on
    got_strategy = [int(s) for s in rows[:, 0]]
    assert got_strategy == expect_strategy, got_strategy
    assert np.allclose(rows[:, 1], [0.1] * 5 + [0.05] * 4), rows[:, 1]


class LocalMind(BasePolicy):
    """Decides from this worker's own value: the runner must apply rank 0's decision everywhere."""

    def after_step(self, ctx):
        ctx.set_learning_rate(0.01 * (kungfu.rank() + 1))
        self.seen = ctx.metrics["own"]


def local_decisions_follow_rank_0_and_local_metrics_are_averaged():
    opt = keras.optimizers.SGD(0.1)
    policy = LocalMind()
    runner = kungfu.PolicyRunner([policy], optimizer=opt)
    runner.after_step(own=float(kungfu.rank()))
    assert abs(float(opt.learning_rate.numpy()) - 0.01) < 1e-9, float(opt.learning_rate.numpy())
    assert policy.seen == (kungfu.size() - 1) / 2, policy.seen  # mean of the ranks


def workers_logging_different_metrics_get_a_policy_error():
    """Rank 1 logs other metric names, then more of them: PolicyError on every worker both times (the
    count once surfaced as the all-reduce's InvalidArgumentError)."""
    for n, extra in enumerate(({"b": 1.0}, {"a": 1.0, "b": 2.0})):
        runner = kungfu.PolicyRunner([LocalMind()], optimizer=keras.optimizers.SGD(0.1))
        try:
            runner.after_step(**(extra if kungfu.rank() == 1 else {"a": 1.0}), own=0.0)
        except PolicyError as e:
            assert "the workers report different metrics" in str(e), str(e)
        else:
            raise AssertionError(f"case {n}: no PolicyError when rank 1 logs {sorted(extra)}")
        kungfu.barrier()


class FailsOnRank1(BasePolicy):
    def after_step(self, ctx):
        if kungfu.rank() == 1 and ctx.step == 3:
            raise RuntimeError("rank 1 cannot decide")


def a_policy_raising_on_one_worker_raises_on_every_worker():
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))
    model = compiled_model(opt)
    x, y = data()
    start = time.perf_counter()
    try:
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=8, verbose=0,
                  callbacks=[kungfu.keras.PolicyCallback([FailsOnRank1()])])
    except PolicyError as e:
        assert "policy FailsOnRank1 raised in after_step at step 3: RuntimeError: rank 1 cannot decide, on rank 1" \
            in str(e), str(e)
    else:
        raise AssertionError("model.fit did not raise PolicyError")
    took = time.perf_counter() - start
    assert took < 20, f"the error took {took:.1f} s to reach this worker (KUNGFU_TIMEOUT is 60 s)"
    kungfu.barrier()  # the workers carry on together after the error


class RecordBatch(keras.callbacks.Callback):
    """After the policy callback: each step's batch rows on this worker and the learning rate after it."""

    def __init__(self, ds):
        super().__init__()
        self.ds, self.rows = ds, []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append([self.ds.local_batch_size, float(self.model.optimizer.learning_rate.numpy())])


def batch_size_change_lands_at_the_same_step_in_fit():
    n = kungfu.size()
    x, y = data(32 * n)
    ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=4 * n, seed=3)
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))
    model = compiled_model(opt)
    policies = [kp.scheduled({3: {"batch_size": 8 * n}}), kp.lr_scaling("linear")]
    rec = RecordBatch(ds)
    model.fit(ds.as_dataset(), epochs=1, shuffle=False, verbose=0,
              callbacks=[kungfu.keras.PolicyCallback(policies, dataset=ds), rec, ds.keras_callback()])
    rows = same_everywhere(rec.rows, "local batch, learning rate per step")
    # 3 steps of 4 rows per worker, then (32 - 12) / 8 = 2.5: two of 8 and the last 4 rows joined to them?
    # no: the last batch holds what is left (4 per worker), so 8, 8 and 4 rows.
    assert rows[:, 0].tolist() == [4, 4, 4, 8, 8, 4], rows[:, 0].tolist()
    assert np.allclose(rows[:, 1], [0.1] * 2 + [0.2] * 4), rows[:, 1]  # doubled with the batch, after step 3


def _gns_run(compiled, x, y):
    """One custom-loop run of a rewritten S-SGD step whose batch size a GNS policy drives, the policy run
    either as a Python hook (PolicyRunner) or compiled into the step; returns [(global batch, lr)] per step."""
    n = kungfu.size()
    ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=2 * n, seed=4)
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    opt = keras.optimizers.SGD(0.05)
    model.build((None, FEATURES))
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(input_signature=list(ds.element_spec))
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    # Bounds allow a single change (2n -> 4n) and no shrink: then only the prior decides, not the
    # measured step times, which differ from run to run.
    policy = kp.gns_batch_size(2 * n, 4 * n, interval=2, warmup_steps=4, cooldown_steps=4, allow_shrink=False,
                               lr_rule="sqrt")
    common = dict(monitors=["gns"], local_batch_size=ds.local_batch_size_variable)
    if compiled:
        step = kungfu.rewrite(train_step, **common, policies=[policy], optimizer=opt, dataset=ds)
        runner = None
    else:
        step = kungfu.rewrite(train_step, **common)
        runner = kungfu.PolicyRunner([policy], optimizer=opt, dataset=ds, monitors=step)
    rows = []
    for xb, yb in ds.as_dataset():
        loss = step(xb, yb)
        if runner is not None:
            runner.after_step(loss=loss)
        rows.append([ds.batch_size, float(opt.learning_rate.numpy())])
        if len(rows) == 30:
            break
    return rows, policy.describe_last()


def compiled_gns_policy_decides_as_the_python_hook():
    n = kungfu.size()
    rng = np.random.RandomState(9)
    x = rng.normal(size=(200 * n, FEATURES)).astype(np.float32)
    y = rng.randint(0, CLASSES, size=len(x)).astype(np.int64)  # random labels: a large noise scale
    hook_rows, hook_last = _gns_run(False, x, y)
    graph_rows, graph_last = _gns_run(True, x, y)
    hook = same_everywhere(hook_rows, "hook run: batch, learning rate per step")
    graph = same_everywhere(graph_rows, "compiled run: batch, learning rate per step")
    # The log line reads the compiled policy's variables as it reads the hook's memory (the predicted
    # gain in it comes from measured step times, so the lines agree only in their shape).
    for last in (hook_last, graph_last):
        assert last is not None and last.startswith("step 30: noise scale "), last
        assert last.endswith(f"kept batch {4 * n}"), last
    assert np.array_equal(hook, graph), f"hook {hook.tolist()}\ncompiled {graph.tolist()}"
    assert hook[0, 0] == 2 * n and hook[-1, 0] == 4 * n, hook[:, 0].tolist()  # the policy did change the batch
    assert np.isclose(hook[-1, 1], 0.05 * np.sqrt(2)), hook[-1, 1]


def policies_compiled_into_the_optimizer_act_at_the_same_step():
    n = kungfu.size()
    x, y = data(48 * n)
    ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=4 * n, seed=3)
    policies = [kp.strategy_switch("sma", at_step=2), kp.scheduled({4: {"batch_size": 8 * n}}),
                kp.lr_scaling("linear")]
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1), policies=policies, dataset=ds)
    model = compiled_model(opt)
    rec, strategies = RecordBatch(ds), []

    class Strategy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            strategies.append(float(opt.strategy_variable.numpy()))

    model.fit(ds.as_dataset(), epochs=1, shuffle=False, verbose=0, callbacks=[rec, Strategy(), ds.keras_callback()])
    rows = same_everywhere(np.c_[rec.rows, strategies], "local batch, learning rate, strategy per step")
    # 48 rows a worker: 4 steps of 4, then 4 of 8; the changes are made in step 2's and step 4's graphs.
    assert rows[:, 0].tolist() == [4] * 4 + [8] * 4, rows[:, 0].tolist()
    assert np.allclose(rows[:, 1], [0.1] * 3 + [0.2] * 5), rows[:, 1]
    assert rows[:, 2].tolist() == [0] + [1] * 7, rows[:, 2].tolist()


class MeanStepTime(BasePolicy):
    """A compiled policy that reads an all-reduced metric every step: a collective in the step's graph."""

    compilable = True

    def after_step(self, ctx):
        ctx.state(self, step_time=0.0).update(step_time=ctx.metrics["step_time"])


def compiled_policies_meet_when_keras_names_the_optimizers_differently():
    """Rank 0 makes one more Keras optimizer first, so Keras numbers the wrapped one ("sgd_<n>") one higher
    there than elsewhere: the compiled policy's collectives must still meet."""
    if kungfu.rank() == 0:
        keras.optimizers.SGD(0.1)
    policy = MeanStepTime()
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1), monitor=["variance"],
                                              policies=[policy])
    # Earlier checks in this process made optimizers too, so compare the numbers Keras gave, not a fixed name.
    number = int(opt.name.rpartition("_")[2]) if opt.name != "sgd" else 0
    numbers = kungfu.all_gather(tf.constant([number], tf.int64)).numpy()
    assert all(numbers[0] == n + 1 for n in numbers[1:]), f"Keras optimizer numbers per rank: {numbers}"
    model = compiled_model(opt)
    x, y = data(16 * kungfu.size())
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    mean = same_everywhere([state_values(policy)["step_time"]], "the mean step time the policy saw")
    assert mean[0] > 0, mean


class EpochSeen(BasePolicy):
    """Compilable; remembers ctx.epoch, which compiled reads the dataset's epoch and as a hook fit's."""

    compilable = True

    def after_step(self, ctx):
        ctx.state(self, epoch=-1.0).update(epoch=ctx.epoch)


def a_resumed_run_goes_on_from_its_step_and_epoch():
    """Saved after 4 steps (1 epoch), loaded, trained on with fresh policies and dataset: the schedule's
    step count goes on from the optimizer's (rank 0's: in the hook run only rank 0 loads, the others get
    its state from the broadcast callback), the run starts with the settings of step 4 (the batch size
    included, which the file lacks), later entries land at their steps, and a compiled policy reads the
    epoch fit resumes at."""
    import os

    n = kungfu.size()
    x, y = data(24 * n)
    path = f"/tmp/kungfu_policy_resume_{os.getppid()}.keras"  # kfrun is every worker's parent
    spec = {0: {"batch_size": 4 * n, "learning_rate": 0.1}, 2: {"batch_size": 8 * n, "learning_rate": 0.05},
            4: {"strategy": "sma"}, 5: {"learning_rate": 0.02}}
    try:
        for compiled in (False, True):
            ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=4 * n, seed=3)
            policies = [kp.scheduled(spec), EpochSeen()]
            if compiled:
                opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.3), policies=policies, dataset=ds)
                callbacks = [ds.keras_callback()]
            else:
                opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.3))
                callbacks = [kungfu.keras.PolicyCallback(policies, dataset=ds), ds.keras_callback()]
            model = compiled_model(opt)
            model.fit(ds.as_dataset(), epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
            assert int(opt.iterations.numpy()) == 4, int(opt.iterations.numpy())  # 2 steps of 4n, 2 of 8n
            if kungfu.rank() == 0:
                model.save(path)
            kungfu.barrier()

            ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=4 * n, seed=3)  # at its own 4n again
            policies = [kp.scheduled(spec), EpochSeen()]
            if compiled:
                model = kungfu.keras.load_model(path, policies=policies, dataset=ds)
                callbacks = [ds.keras_callback()]
            else:
                model = (kungfu.keras.load_model(path) if kungfu.rank() == 0 else
                         compiled_model(optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.3))))
                callbacks = [kungfu.keras.callbacks.BroadcastGlobalVariablesCallback(0),
                             kungfu.keras.PolicyCallback(policies, dataset=ds), ds.keras_callback()]
            opt, rows = model.optimizer, []

            class Record(keras.callbacks.Callback):
                def on_train_batch_begin(self, batch, logs=None):
                    rows.append([float(opt.learning_rate.numpy())])

                def on_train_batch_end(self, batch, logs=None):  # (compiled, the catch-up runs in the first
                    rows[-1] += [float(opt.strategy_variable.numpy()), ds.local_batch_size,  # step's trace)
                                 float(state_values(policies[1])["epoch"])]

            model.fit(ds.as_dataset(), initial_epoch=1, epochs=2, shuffle=False, verbose=0,
                      callbacks=callbacks + [Record()])
            got = same_everywhere(rows, f"lr before; strategy, local batch, epoch after each step (compiled "
                                        f"{compiled})")
            # step 5 with step 4's settings (lr 0.05, sma, 8 rows), then entry 5's lr; epoch 1 throughout
            want = [[0.05, 1, 8, 1], [0.02, 1, 8, 1], [0.02, 1, 8, 1]]
            assert got.shape == (3, 4) and np.allclose(got, want), (compiled, got.tolist())
            assert int(opt.iterations.numpy()) == 7
    finally:
        kungfu.barrier()
        if kungfu.rank() == 0 and os.path.exists(path):
            os.remove(path)


def main():
    kungfu.init()
    checks = [strategy_and_learning_rate_change_at_the_same_step,
              local_decisions_follow_rank_0_and_local_metrics_are_averaged,
              workers_logging_different_metrics_get_a_policy_error,
              a_policy_raising_on_one_worker_raises_on_every_worker,
              batch_size_change_lands_at_the_same_step_in_fit,
              compiled_gns_policy_decides_as_the_python_hook,
              policies_compiled_into_the_optimizer_act_at_the_same_step,
              compiled_policies_meet_when_keras_names_the_optimizers_differently,
              a_resumed_run_goes_on_from_its_step_and_epoch]
    mp.run_checks(checks, kungfu.rank())


if __name__ == "__main__":
    main()
