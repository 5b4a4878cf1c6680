"""Policies compiled into the training step on one process (kungfu.rewrite(..., policies=...) and the
optimizer wrappers' policies=): they decide as their Python hooks do, at the same steps, and a policy
that cannot be compiled, or reads what the graph lacks, is a clear error naming it. The hooks alone are
in test_policy_runner.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kungfu
from kungfu import optimizers
from kungfu.errors import PolicyError
from kungfu.policies import BasePolicy
from policy_util import HalveLrOnce, Recorder, model_and_data, step_fn

pytestmark = pytest.mark.usefixtures("kungfu_library")


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()


def test_python_hook_and_compiled_policy_decide_the_same_at_the_same_steps():
    model, x, y = model_and_data()
    opt = keras.optimizers.SGD(0.1)
    step = kungfu.rewrite(step_fn(model, opt))
    runner = kungfu.PolicyRunner([HalveLrOnce(at=5, stop_at=9)], optimizer=opt, batch_size=16)
    hook_lrs = []
    while not runner.stopped:
        runner.after_step(loss=step(x, y))
        hook_lrs.append(float(opt.learning_rate.numpy()))

    model, x, y = model_and_data()
    opt = keras.optimizers.SGD(0.1)
    step = kungfu.rewrite(step_fn(model, opt), policies=[HalveLrOnce(at=5, stop_at=9)], optimizer=opt,
                          batch_size=16)
    graph_lrs = []
    while not step.policy_stopped:
        step(x, y)
        graph_lrs.append(float(opt.learning_rate.numpy()))
    assert hook_lrs == graph_lrs
    assert hook_lrs == pytest.approx([0.1] * 5 + [0.05] * 5)  # decided after step 6 (interval 2), stop after 10
    assert runner.step == step.policy_step == 10
    assert [(s, h, sorted(c)) for s, _, h, c in runner.history] == [(6, "after_step", ["learning_rate"]),
                                                                    (10, "after_step", ["stop"])]


class RateByEpoch(BasePolicy):
    compilable = True

    def after_step(self, ctx):
        ctx.set_learning_rate(0.01 * (ctx.epoch + 1))


def test_a_compiled_policy_sees_the_epoch_index_the_python_hook_sees():
    """ctx.epoch is the index of the epoch in progress, from 0, in the graph as in the Python hook."""
    def run(compiled):
        model, x, y = model_and_data()
        opt = keras.optimizers.SGD(0.5)
        ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=8, shuffle=False)
        step = step_fn(model, opt)
        if compiled:
            step = kungfu.rewrite(step, policies=[RateByEpoch()], optimizer=opt, dataset=ds)
            runner = kungfu.PolicyRunner([], dataset=ds)  # no policies: keeps the same loop below
        else:
            runner = kungfu.PolicyRunner([RateByEpoch()], optimizer=opt, dataset=ds)
        rates = []
        for _ in range(2):
            runner.before_epoch()
            for xb, yb in ds.as_dataset():
                step(xb, yb)
                runner.after_step()
                rates.append(round(float(opt.learning_rate.numpy()), 6))
            runner.after_epoch()
        return rates

    assert run(compiled=False) == run(compiled=True) == [0.01, 0.01, 0.02, 0.02]



def test_a_compiled_policy_reading_what_the_graph_lacks_names_it():
    class ReadsLoss(BasePolicy):
        compilable = True

        def after_step(self, ctx):
            ctx.set_learning_rate(ctx.metrics["loss"], when=False)

    model, x, y = model_and_data()
    opt = keras.optimizers.SGD(0.1)
    step = kungfu.rewrite(step_fn(model, opt), policies=[ReadsLoss()], optimizer=opt)
    with pytest.raises(KeyError, match="policy ReadsLoss, compiled into the graph: 'loss' is not available to a "
                                       "policy compiled into the graph .*the step's loss and logs are not in the graph"):
        step(x, y)

    class Branches(BasePolicy):
        compilable = True

        def after_step(self, ctx):
            if ctx.step == 5:
                ctx.set_learning_rate(0.01)

    step = kungfu.rewrite(step_fn(model, opt), policies=[Branches()], optimizer=opt)
    with pytest.raises(TypeError, match="policy Branches, compiled into the graph: .*must be branch-free"):
        step(x, y)


def test_a_policy_reading_an_unmonitored_metric_names_the_monitor_in_both_paths():
    """Not monitored is not "no estimate yet": gns_batch_size would wait for an estimate that never comes."""
    import kungfu.policies as kp

    model, x, y = model_and_data()
    opt = keras.optimizers.SGD(0.1)
    with pytest.raises(PolicyError, match=r"ctx.metrics has no 'gns': the 'gns' monitor is not on"):
        kungfu.PolicyRunner([kp.gns_batch_size(4, 64, interval=1)], optimizer=opt, batch_size=16).after_step()
    step = kungfu.rewrite(step_fn(model, opt), policies=[kp.gns_batch_size(4, 64)], optimizer=opt, batch_size=16)
    with pytest.raises(ValueError, match=r"ctx.metrics has no 'gns'.*monitors=\['gns'\]"):
        step(x, y)


def test_a_strategy_switch_in_a_rewritten_step_points_to_the_optimizer_wrapper():
    import kungfu.policies as kp

    model, x, y = model_and_data()
    opt = keras.optimizers.SGD(0.1)
    step = kungfu.rewrite(step_fn(model, opt), policies=[kp.strategy_switch("sma", at_step=1)], optimizer=opt)
    with pytest.raises(PolicyError, match=r"runs S-SGD only.*DistributedOptimizer\(opt, policies=\[...\]\)"):
        step(x, y)


def test_a_compiled_schedule_applies_its_entry_0_before_the_first_step():
    import kungfu.policies as kp

    model, x, y = model_and_data()
    opt = keras.optimizers.SGD(0.1)
    lrs = []

    @tf.function
    def train_step(x, y):
        lrs.append(None)  # traced once
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return opt.learning_rate

    step = kungfu.rewrite(train_step, policies=[kp.scheduled({0: {"learning_rate": 0.5}, 2: {"learning_rate": 0.25}})],
                          optimizer=opt)
    used = [float(step(x, y)) for _ in range(3)]
    assert used == [0.5, 0.5, 0.25] and len(lrs) == 1

    # A batch size in entry 0 governs the first batch the loop pulls, which comes before the step's first call.
    # (A new optimizer: steps count from this one's iterations, and opt has taken 3. And a new step function:
    # train_step's trace for 16 rows holds the first optimizer, which it would go on updating, until that
    # one is collected and the trace's variables with it.)
    opt = keras.optimizers.SGD(0.1)
    ds = kungfu.data.AdaptiveDataset((np.tile(x, (4, 1)), np.tile(y, (4, 1))), global_batch_size=8)
    step = kungfu.rewrite(step_fn(model, opt), policies=[kp.scheduled({0: {"batch_size": 16}, 2: {"batch_size": 32}})],
                          optimizer=opt, dataset=ds)
    sizes = []
    for bx, by in ds.as_dataset():
        sizes.append(len(bx))
        step(bx, by)
        if len(sizes) == 3:
            break
    assert sizes == [16, 16, 32]


def test_a_rewritten_step_counts_from_a_checkpoint_restored_after_rewrite():
    """rewrite() starts the policies at once (entry 0 before the loop's first batch); a checkpoint restored
    after it moves the optimizer's step count, and the step's first call starts again from there."""
    import kungfu.policies as kp

    model, x, y = model_and_data()
    opt = keras.optimizers.SGD(0.3)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return opt.learning_rate

    step = kungfu.rewrite(train_step, policies=[kp.scheduled({0: {"learning_rate": 0.1}, 6: {"learning_rate": 0.01}})],
                          optimizer=opt)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.1)  # entry 0, at rewrite()
    opt.iterations.assign(5)  # as tf.train.Checkpoint(...).restore(...) of a run saved after 5 steps would
    opt.learning_rate.assign(0.3)
    used = [float(step(x, y)) for _ in range(3)]  # steps 6, 7, 8: the settings of step 5, then entry 6's
    assert used == pytest.approx([0.1, 0.01, 0.01]) and int(opt.iterations.numpy()) == 8


def test_policies_compiled_into_the_optimizer_switch_strategy_and_rate_in_fit():
    import kungfu.policies as kp

    model, x, y = model_and_data()
    policies = [kp.strategy_switch("sma", at_step=3), kp.scheduled({5: {"learning_rate": 0.05}})]
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1), policies=policies)
    model.compile(optimizer=opt, loss="mse")
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((opt.strategy, round(float(opt.learning_rate.numpy()), 6)))

    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[Record()])
    assert seen == [("ssgd", 0.1)] * 2 + [("sma", 0.1)] * 2 + [("sma", 0.05)] * 4
    with pytest.raises(ValueError, match="DistributedOptimizer: policy Recorder is not compilable"):
        optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1), policies=[Recorder()])


class LowerRateUnderSma(BasePolicy):
    compilable = True

    def after_step(self, ctx):
        ctx.set_learning_rate(0.5, when=ctx.math.any(ctx.strategy == "bogus", ctx.strategy == None))  # noqa: E711
        ctx.set_learning_rate(0.01, when=ctx.strategy == "sma")
        ctx.set_learning_rate(0.02, when=ctx.math.all(ctx.strategy != "sma", ctx.is_strategy("ssgd")))
        ctx.set_strategy(ctx.strategy)  # a reading given back as is keeps the strategy


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("strategy, rate", [("sma", 0.01), ("ssgd", 0.02)])
def test_a_compiled_policy_compares_the_strategy_with_a_name_as_the_hook_does(compiled, strategy, rate):
    model, x, y = model_and_data()
    kw = {"policies": [LowerRateUnderSma()]} if compiled else {}
    opt = optimizers.DistributedOptimizer(keras.optimizers.SGD(0.1), strategy=strategy, **kw)
    model.compile(optimizer=opt, loss="mse")
    callbacks = [] if compiled else [kungfu.keras.PolicyCallback([LowerRateUnderSma()])]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    assert float(opt.learning_rate.numpy()) == pytest.approx(rate) and opt.strategy == strategy


class SetRate(BasePolicy):
    compilable = True

    def after_step(self, ctx):
        ctx.set_learning_rate(0.05)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_policy_sets_the_rate_a_loss_scale_optimizer_trains_with(compiled):
    """Mixed precision as docs/training.md wraps it: the rate that counts is the inner optimizer's."""
    model, x, y = model_and_data()
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    opt = optimizers.SynchronousSGDOptimizer(lso, policies=[SetRate()] if compiled else None)
    step = step_fn(model, opt)
    if compiled:  # into the optimizer's step
        step(x, y)
    else:
        runner = kungfu.PolicyRunner([SetRate()], optimizer=opt)
        step(x, y)
        runner.after_step()
        assert runner.controls.learning_rate() == pytest.approx(0.05)
    assert float(opt.inner_optimizer.learning_rate.numpy()) == pytest.approx(0.05)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.05)
