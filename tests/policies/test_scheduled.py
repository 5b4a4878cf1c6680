"""ScheduledPolicy: entries apply exactly at their step (after that many completed steps) or epoch, and
the spec is validated with errors that say what to write."""

import pytest

from policies.context import Context
from policies.scheduled import scheduled
from policy_runs import python_caller
from policy_runs import simulate

SPEC = {0: {"batch_size": 64, "learning_rate": 0.1}, 500: {"batch_size": 256}, 2000: {"strategy": "ssgd"}}


def test_step_entries_apply_after_that_many_completed_steps():
    p = scheduled(SPEC)
    assert p.interval == 500  # gcd of the nonzero keys: called only where an entry can apply
    c = Context(step=0, batch_size=32, learning_rate=1.0, strategy="sma", cluster_size=4)
    p.before_train(c)
    assert c.changes == {"batch_size": 64, "learning_rate": 0.1}
    log, final = simulate(python_caller([p]), 2500, lambda step, batch: {})
    # changes made in after_step(ctx.step == k) govern the step before_step sees as ctx.step == k
    assert log == {500: {"batch_size": 256}, 2000: {"strategy": "ssgd"}}
    assert final == {"batch_size": 256, "learning_rate": 0.1, "strategy": "ssgd"}


def test_called_only_where_an_entry_applies():
    """Every call of a Python hook costs the workers two collectives: a schedule is due at its keys only."""
    p = scheduled(SPEC)
    assert [s for s in range(1, 3000) if p.due("after_step", s)] == [500, 2000]
    assert p.due("before_train", 0) and not p.due("before_epoch", 0) and not p.due("before_step", 500)
    later = Context(step=700, batch_size=256, learning_rate=0.1)
    assert p.due("before_train", 700)  # once a run: a resumed one catches up there
    p.before_train(later)  # a runner that goes on counting (a second fit), not resumed
    assert later.changes == {}  # does not go back to entry 0
    by_epoch = scheduled({0: {"learning_rate": 0.1}, 3: {"learning_rate": 0.01}}, by="epoch")
    assert by_epoch.due("before_epoch", 40) and not by_epoch.due("after_step", 3)
    assert not by_epoch.due("before_train", 0)
    assert not scheduled({5: {"batch_size": 8}}).due("before_train", 0)


def test_keys_that_share_no_divisor_run_every_step():
    p = scheduled({3: {"learning_rate": 0.3}, 5: {"learning_rate": 0.5, "batch_size": 8}})
    assert p.interval == 1
    log, _ = simulate(python_caller([p]), 10, lambda step, batch: {})
    assert log == {3: {"learning_rate": 0.3}, 5: {"learning_rate": 0.5, "batch_size": 8}}


def test_epoch_entries_apply_at_the_start_of_their_epoch():
    p = scheduled({0: {"learning_rate": 0.1}, 2: {"learning_rate": 0.01, "strategy": "ssgd"}}, by="epoch")
    assert not p.compilable
    got = {}
    for epoch in range(4):
        c = Context(epoch=epoch, step=epoch * 10, batch_size=64, learning_rate=1.0)
        p.before_epoch(c)
        p.after_step(c)  # the epoch form does nothing per step
        p.before_train(c)  # nor before training: entry 0 is epoch 0's
        got[epoch] = c.changes
    assert got == {0: {"learning_rate": 0.1}, 1: {}, 2: {"learning_rate": 0.01, "strategy": "ssgd"}, 3: {}}


def test_string_spec_reads_like_the_dict():
    p = scheduled("0: batch_size=64 learning_rate=0.1; 500: batch_size=256; 2000: strategy=ssgd")
    assert p.spec == SPEC
    assert repr(p) == f"scheduled({SPEC!r}, by='step')"


@pytest.mark.parametrize("spec,error,match", [
    ({-1: {"batch_size": 8}}, ValueError, "every key must be a whole number of steps >= 0"),
    ({True: {"batch_size": 8}}, ValueError, "whole number"),
    ({1.5: {"batch_size": 8}}, ValueError, "whole number"),
    ({"ten": {"batch_size": 8}}, ValueError, "whole number"),
    ({10: {"batchsize": 8}}, ValueError, "unknown setting.*batchsize.*batch_size, learning_rate, strategy"),
    ({10: {}}, ValueError, "entry 10 is empty"),
    ({10: 256}, TypeError, "entry 10 must be a dict"),
    ({10: {"batch_size": 0}}, ValueError, "entry 10: batch_size must be a whole number >= 1"),
    ({10: {"batch_size": 2.5}}, ValueError, "batch_size must be a whole number"),
    ({10: {"learning_rate": 0}}, ValueError, "learning_rate must be a finite number > 0"),
    ({10: {"learning_rate": float("nan")}}, ValueError, "learning_rate must be a finite number > 0"),
    ({10: {"strategy": "allreduce"}}, ValueError, "entry 10: .*unknown strategy 'allreduce'; choose one of ssgd"),
    ({}, ValueError, "the spec is empty"),
    ([(10, {"batch_size": 8})], TypeError, "spec must be a dict"),
    ("10 batch_size=8", ValueError, "write entries as '<key>: name=value"),
    ("10: batch_size", ValueError, "entry 10: cannot read 'batch_size'; write name=value"),
    ("10: learning_rate=fast", ValueError, "learning_rate='fast' is not a number"),
    ("10: batch_size=8; 10: strategy=sma", ValueError, "key 10 appears twice"),
    ("10: batch_size=8 batch_size=16", ValueError, "entry 10: batch_size is given twice"),
])
def test_spec_validation_names_the_fix(spec, error, match):
    with pytest.raises(error, match=match):
        scheduled(spec)


def test_by_must_be_step_or_epoch():
    with pytest.raises(ValueError, match="by must be 'step' or 'epoch'"):
        scheduled({1: {"batch_size": 8}}, by="batch")
    with pytest.raises(ValueError, match="whole number of epochs"):
        scheduled({-2: {"batch_size": 8}}, by="epoch")


def test_a_resumed_run_goes_on_with_the_settings_of_its_step_or_epoch():
    """A run restored from a checkpoint (ctx.resumed, the step past 0) gets what the entries up to its step
    set, merged: the batch size (no checkpoint holds it) and the rest, not entry 0's values again."""
    p = scheduled("0: batch_size=32 learning_rate=0.1; 6: batch_size=64 learning_rate=0.05; 10: strategy=1")
    for step, want in [(3, {"batch_size": 32, "learning_rate": 0.1}),
                       (6, {"batch_size": 64, "learning_rate": 0.05}),
                       (11, {"batch_size": 64, "learning_rate": 0.05, "strategy": "sma"})]:
        c = Context(step=step, batch_size=16, cluster_size=2, learning_rate=0.5, strategy="ssgd", resumed=True)
        assert p.due("before_train", step)
        p.before_train(c)
        assert c.changes == want, (step, c.changes)
    # then the entries after it apply at their keys as usual
    log, _ = simulate(python_caller([p]), 12, lambda step, batch: {})
    assert log[10] == {"strategy": "sma"}
    by_epoch = scheduled({0: {"learning_rate": 0.1}, 3: {"batch_size": 128}, 5: {"learning_rate": 0.01}}, by="epoch")
    c = Context(epoch=4, step=40, batch_size=16, learning_rate=0.5, resumed=True)
    by_epoch.before_epoch(c)
    assert c.changes == {"learning_rate": 0.1, "batch_size": 128}
    # A run's first epoch past 0 without ctx.resumed (fit(initial_epoch=4) after load_weights: a fresh
    # optimizer, no steps) catches up too, as Keras's LearningRateScheduler would; going on from the epoch
    # before, it does not.
    fresh = scheduled({0: {"learning_rate": 0.1}, 3: {"batch_size": 128}, 5: {"learning_rate": 0.01}}, by="epoch")
    c = Context(epoch=4, step=0, batch_size=16, learning_rate=0.5)
    fresh.before_epoch(c)
    assert c.changes == {"learning_rate": 0.1, "batch_size": 128}
    for epoch, want in [(5, {"learning_rate": 0.01}), (6, {})]:
        c = Context(epoch=epoch, step=10 * epoch, batch_size=128, learning_rate=0.1)
        fresh.before_epoch(c)
        assert c.changes == want, (epoch, c.changes)


def test_keys_may_be_any_whole_number_and_the_string_strategy_an_index():
    import numpy as np

    p = scheduled({np.int64(10): {"batch_size": 64}, 5.0: {"learning_rate": 0.1}, 0: {"strategy": "sma"}})
    assert list(p.spec) == [0, 5, 10] and all(type(k) is int for k in p.spec) and p.interval == 5
    assert scheduled("3: strategy=2").spec == scheduled({3: {"strategy": "pair_averaging"}}).spec
    with pytest.raises(ValueError, match="every key must be a whole number of steps >= 0, got 2.5"):
        scheduled({2.5: {"batch_size": 64}})
