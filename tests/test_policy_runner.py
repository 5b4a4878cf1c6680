"""The policy runners on one process, with policies as Python hooks: when PolicyRunner calls the hooks, what
a decision does and when it takes effect, resuming, and the errors of both runners. What PolicyCallback
does in model.fit is in test_policy_callback.py, policies compiled into the step in test_policy_compiled.py,
the workers' agreement in test_policy_mp.py, the built-in policies' decisions in tests/policies/.
"""

import keras
import numpy as np
import pytest

import kungfu
from kungfu import optimizers
from kungfu.errors import PolicyError
from kungfu.policies import BasePolicy
from policy_util import HalveLrOnce, Recorder, model_and_data, step_fn

pytestmark = pytest.mark.usefixtures("kungfu_library")


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()


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
