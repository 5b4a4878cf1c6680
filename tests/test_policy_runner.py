"""The policy runners on one process: PolicyRunner, PolicyCallback and policies compiled by kungfu.rewrite.

What a policy decides, when it takes effect, that a policy compiled into the step decides as its Python
hook does, and the errors. The workers' agreement is in test_policy_mp.py; the built-in policies'
decisions are in tests/policies/.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kungfu
from kungfu import optimizers
from kungfu.errors import PolicyError
from kungfu.policies import BasePolicy

pytestmark = pytest.mark.usefixtures("kungfu_library")


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()


class HalveLrOnce(BasePolicy):
    """Compilable: halves the learning rate once, at the first call at or after step `at`; stops at `stop_at`."""

    compilable = True

    def __init__(self, at=4, stop_at=None, interval=2):
        self.at, self.stop_at, self.interval = at, stop_at, interval

    def after_step(self, ctx):
        s = ctx.state(self, done=0.0)
        hit = ctx.math.all(ctx.step >= self.at, s.done < 1)
        ctx.set_learning_rate(ctx.learning_rate * 0.5, when=hit)
        s.update(when=hit, done=1.0)
        if self.stop_at is not None:
            ctx.stop(when=ctx.step >= self.stop_at)


class Recorder(BasePolicy):
    """Records the hooks it sees, with step and epoch."""

    def __init__(self):
        self.calls = []

    def _note(self, ctx):
        self.calls.append((ctx.hook, ctx.step, ctx.epoch))

    before_train = before_epoch = before_step = after_step = after_epoch = after_train = _note


def model_and_data(seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    rng = np.random.RandomState(seed)
    return model, rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 3)).astype(np.float32)


def step_fn(model, opt):
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


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


def test_hooks_are_called_in_order_with_step_and_epoch():
    rec = Recorder()
    runner = kungfu.PolicyRunner([rec])
    runner.before_train()
    for _ in range(2):
        runner.before_epoch()
        for _ in range(2):
            runner.before_step()
            runner.after_step(loss=1.0)
        runner.after_epoch()
    runner.after_train()
    assert rec.calls == [("before_train", 0, 0),
                         ("before_epoch", 0, 0), ("before_step", 0, 0), ("after_step", 1, 0),
                         ("before_step", 1, 0), ("after_step", 2, 0), ("after_epoch", 2, 0),
                         ("before_epoch", 2, 1), ("before_step", 2, 1), ("after_step", 3, 1),
                         ("before_step", 3, 1), ("after_step", 4, 1), ("after_epoch", 4, 1),
                         ("after_train", 4, 2)]


def test_interval_skips_step_hooks_and_metrics_carry_the_logs():
    seen = []

    class Every3(BasePolicy):
        interval = 3

        def after_step(self, ctx):
            seen.append((ctx.step, ctx.metrics["loss"], ctx.batch_size, ctx.samples_seen))

    runner = kungfu.PolicyRunner([Every3()], batch_size=8)
    for i in range(7):
        runner.after_step({"loss": np.float32(i)})
    assert seen == [(3, 2.0, 8, 24), (6, 5.0, 8, 48)]


def test_idle_policies_cost_no_exchange(monkeypatch):
    """A runner exchanges decisions only for the hooks due: a schedule at its entries, a step switch once."""
    from kungfu._policy import agree

    calls = []
    exchange = agree.exchange
    monkeypatch.setattr(agree, "exchange", lambda outcome, key: calls.append(key) or exchange(outcome, key))
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))
    policies = [kungfu.policies.scheduled({0: {"learning_rate": 0.2}, 4: {"learning_rate": 0.05}}),
                kungfu.policies.scheduled({1: {"learning_rate": 0.3}}, by="epoch"),
                kungfu.policies.strategy_switch("sma", at_step=6)]
    runner = kungfu.PolicyRunner(policies, optimizer=opt)
    runner.before_train()
    for epoch in range(2):
        runner.before_epoch()
        for _ in range(5):
            runner.before_step()
            runner.after_step()
        runner.after_epoch()
    runner.after_train()
    assert [c.rsplit("/", 2)[-2] for c in calls] == ["before_train", "before_epoch", "after_step", "before_epoch",
                                                    "after_step"]
    assert [h[:3] for h in runner.history] == [(0, 0, "before_train"), (4, 0, "after_step"), (5, 1, "before_epoch"),
                                               (6, 1, "after_step")]
    assert (opt.strategy, float(opt.learning_rate.numpy())) == ("sma", pytest.approx(0.3))


def test_lr_scaling_follows_a_batch_change_at_an_epoch_boundary_from_the_epochs_first_step():
    x = np.zeros((40, 2), np.float32)
    ds = kungfu.data.AdaptiveDataset(x, 10, shuffle=False)
    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))
    runner = kungfu.PolicyRunner([kungfu.policies.scheduled({1: {"batch_size": 20}}, by="epoch"),
                                  kungfu.policies.lr_scaling("linear")], optimizer=opt, dataset=ds)
    used = []  # (global batch, learning rate) of each step
    runner.before_train()
    for epoch in range(3):
        runner.before_epoch()
        for _ in ds.as_dataset():
            runner.before_step()
            used.append((ds.batch_size, round(float(opt.learning_rate.numpy()), 6)))
            runner.after_step()
        runner.after_epoch()
        if epoch == 1:
            ds.set_batch_size(40)  # by hand, between epochs
    runner.after_train()
    assert used == [(10, 0.1)] * 4 + [(20, 0.2)] * 2 + [(40, 0.4)]


def test_strategy_changes_on_a_distributed_optimizer_and_is_refused_on_a_plain_one():
    class ToSma(BasePolicy):
        def after_step(self, ctx):
            ctx.set_strategy("sma", when=ctx.step == 2)

    opt = optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))
    runner = kungfu.PolicyRunner([ToSma()], optimizer=opt)
    runner.after_step()
    assert opt.strategy == "ssgd"
    runner.after_step()
    assert opt.strategy == "sma"
    plain = kungfu.PolicyRunner([ToSma()], optimizer=keras.optimizers.SGD(0.1))
    plain.after_step()
    with pytest.raises(PolicyError, match="DistributedOptimizer"):
        plain.after_step()


def test_a_policy_that_raises_gives_a_policy_error_naming_it():
    class Broken(BasePolicy):
        def after_step(self, ctx):
            raise ZeroDivisionError("no data")

    runner = kungfu.PolicyRunner([Broken()])
    with pytest.raises(PolicyError, match=r"policy Broken raised in after_step at step 1: ZeroDivisionError: "
                                          r"no data, on rank 0") as info:
        runner.after_step()
    assert isinstance(info.value.__cause__, ZeroDivisionError) and info.value.original is info.value.__cause__

    model, x, y = model_and_data()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(PolicyError, match="policy Broken raised") as info:  # Keras filters the traceback
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[kungfu.keras.PolicyCallback([Broken()])])
    assert isinstance(info.value.original, ZeroDivisionError)


def test_decisions_the_controls_cannot_carry_out_are_clear_errors():
    class SetBatch(BasePolicy):
        def after_step(self, ctx):
            ctx.set_batch_size(64)

    with pytest.raises(PolicyError, match="AdaptiveDataset"):
        kungfu.PolicyRunner([SetBatch()]).after_step()

    class SetLr(BasePolicy):
        def after_step(self, ctx):
            ctx.set_learning_rate(0.5)

    with pytest.raises(PolicyError, match="optimizer="):
        kungfu.PolicyRunner([SetLr()]).after_step()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    with pytest.raises(PolicyError, match="schedule"):
        kungfu.PolicyRunner([SetLr()], optimizer=keras.optimizers.SGD(schedule)).after_step()


def test_bad_arguments():
    with pytest.raises(TypeError, match="BasePolicy"):
        kungfu.PolicyRunner([object()])
    with pytest.raises(TypeError, match="BasePolicy"):
        kungfu.keras.PolicyCallback("gns")
    with pytest.raises(ValueError, match="not compilable"):
        kungfu.rewrite(lambda: None, policies=[Recorder()])
    with pytest.raises(ValueError, match="policies="):
        kungfu.rewrite(lambda: None, optimizer=keras.optimizers.SGD())
    with pytest.raises(ValueError, match="batch_size"):
        kungfu.PolicyRunner([Recorder()], batch_size=0)
    p = HalveLrOnce()
    p.interval = 0
    with pytest.raises(ValueError, match="interval"):
        kungfu.PolicyRunner([p])


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


def test_a_resumed_runner_warns_of_a_rate_rule_without_base_values(caplog):
    import kungfu.policies as kp

    opt = keras.optimizers.SGD(0.1)
    opt.iterations.assign(5)  # as restored from a checkpoint
    with caplog.at_level("WARNING", logger="kungfu.policies"):
        kungfu.PolicyRunner([kp.lr_scaling("linear")], optimizer=opt, batch_size=32).before_train()
        kungfu.PolicyRunner([kp.lr_scaling("linear", base_lr=0.1, base_batch=32),
                             kp.gns_batch_size(32, 64, lr_rule=None)], optimizer=opt, batch_size=32).before_train()
    said = [r.getMessage() for r in caplog.records if "pass base_lr= and base_batch=" in r.getMessage()]
    assert len(said) == 1 and "resumed at step 5: LRScalingPolicy" in said[0], said


@pytest.mark.parametrize("make, compiled", [("gns_batch_size", False), ("lr_scaling", False), ("lr_scaling", True)])
def test_a_resumed_rate_rule_sets_the_rate_of_the_batch_it_starts_at(make, compiled):
    """The checkpoint holds the rate reached (0.4, for a batch grown to 128), not the batch size: the run
    starts again at 32, and the rule sets 0.1 for it at once. gns_batch_size trained on at 0.4 with batch
    32 until its next change, and the loss blew up. (Compiled, gns_batch_size needs the gns monitor, which
    one worker cannot run; its before_train is the same Python either way.)"""
    import kungfu.policies as kp

    def policy():
        if make == "gns_batch_size":
            return kp.gns_batch_size(32, 256, lr_rule="linear", base_lr=0.1, base_batch=32)
        return kp.lr_scaling("linear", base_lr=0.1, base_batch=32)

    model, x, y = model_and_data()
    ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=32)
    base = keras.optimizers.SGD(0.4)
    base.build(model.trainable_variables)
    base.iterations.assign(50)  # as restored from a checkpoint
    if compiled:
        opt = optimizers.SynchronousSGDOptimizer(base, policies=[policy()], dataset=ds)
        step_fn(model, opt)(x[:32], y[:32])  # before_train runs as the step is traced, before the update
    else:
        opt = optimizers.SynchronousSGDOptimizer(base)
        kungfu.PolicyRunner([policy()], optimizer=opt, dataset=ds).before_train()
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.1)
    if not compiled:  # a lower restored rate (a schedule's, ReduceLROnPlateau's) stays
        opt.learning_rate.assign(0.01)
        kungfu.PolicyRunner([policy()], optimizer=opt, dataset=ds).before_train()
        assert float(opt.learning_rate.numpy()) == pytest.approx(0.01)
