"""StrategySwitchPolicy: switches once, by step or when a monitored threshold is crossed."""

import pytest

from policies.scheduled import scheduled
from policies.strategy_switch import strategy_switch
from policy_runs import python_caller
from policy_runs import simulate


def no_metrics(step, batch):
    return {}


def test_switches_at_the_step_once():
    log, final = simulate(python_caller([strategy_switch("ssgd", at_step=25)]), 100, no_metrics)
    assert log == {25: {"strategy": "ssgd"}} and final["strategy"] == "ssgd"
    p = strategy_switch("ssgd", at_step=25, interval=10)  # the first call at or after the step
    log, _ = simulate(python_caller([p]), 100, no_metrics)
    assert log == {30: {"strategy": "ssgd"}}


def test_a_resumed_run_past_the_step_switches_before_training():
    """Restored from a checkpoint (which holds no strategy) past at_step: before_train switches, as the
    uninterrupted run had; after_step, due at one step only, would never come again."""
    from policies.context import Context

    p = strategy_switch("ssgd", at_step=10)
    assert p.due("before_train", 14) and not p.due("before_train", 0)
    resumed = Context(step=14, batch_size=8, cluster_size=2, learning_rate=0.1, strategy="sma", resumed=True)
    p.before_train(resumed)
    assert resumed.strategy == "ssgd"
    early = Context(step=6, batch_size=8, cluster_size=2, learning_rate=0.1, strategy="sma", resumed=True)
    strategy_switch("ssgd", at_step=10).before_train(early)
    assert early.strategy == "sma"  # not yet: after_step switches at step 10 as usual
    later_fit = Context(step=14, batch_size=8, cluster_size=2, learning_rate=0.1, strategy="sma")
    strategy_switch("ssgd", at_step=10).before_train(later_fit)
    assert later_fit.strategy == "sma"  # not resumed (a later fit of the same run): left alone


def test_a_step_switch_is_called_once_a_threshold_switch_every_interval():
    p = strategy_switch("ssgd", at_step=25, interval=10)
    assert [s for s in range(200) if p.due("after_step", s)] == [30]
    q = strategy_switch("ssgd", at_step=25, gns_above=100, interval=10)
    assert [s for s in range(1, 60) if q.due("after_step", s)] == [10, 20, 30, 40, 50]
    assert not q.due("before_step", 10)


def test_switches_on_the_noise_scale_once_and_does_not_switch_back():
    gns = {10: None, 20: 0.0, 30: 900.0, 40: 1500.0, 50: 100.0, 60: 2000.0}
    p = strategy_switch("ssgd", gns_above=1000, interval=10)
    back = scheduled({45: {"strategy": "sma"}})  # someone else switches back: not fought
    log, final = simulate(python_caller([p, back]), 70, lambda step, batch: {"gns": gns.get(step)})
    assert log == {40: {"strategy": "ssgd"}, 45: {"strategy": "sma"}}
    assert final["strategy"] == "sma"


def test_switches_on_a_low_snr_but_not_on_no_estimate():
    snr = {1: 0.0, 2: None, 3: 0.5, 4: 0.04, 5: 0.01}
    p = strategy_switch("pair_averaging", snr_below=0.05)
    log, _ = simulate(python_caller([p]), 6, lambda step, batch: {"snr": snr.get(step)}, strategy="ssgd")
    assert log == {4: {"strategy": "pair_averaging"}}


def test_any_trigger_wins_and_warmup_delays_the_thresholds_only():
    p = strategy_switch("ssgd", at_step=50, gns_above=10, warmup_steps=20)
    log, _ = simulate(python_caller([p]), 60, lambda step, batch: {"gns": 100.0})
    assert log == {20: {"strategy": "ssgd"}}
    p = strategy_switch("ssgd", at_step=5, gns_above=10, warmup_steps=20)
    log, _ = simulate(python_caller([p]), 60, lambda step, batch: {"gns": 100.0})
    assert log == {5: {"strategy": "ssgd"}}


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "give a trigger: at_step=, gns_above= or snr_below="),
    (dict(to="allreduce", at_step=5), "unknown strategy 'allreduce'"),
    (dict(to=3, at_step=5), "unknown strategy 3"),  # an index past the end (once a RecursionError)
    (dict(to=-1, at_step=5), "unknown strategy -1"),
    (dict(to=True, at_step=5), "unknown strategy True"),  # not the index 1
    (dict(to=1.5, at_step=5), "unknown strategy 1.5"),
    (dict(to=float("nan"), at_step=5), "unknown strategy nan"),
    (dict(at_step=0), "at_step must be a whole number >= 1"),
    (dict(gns_above=-1), "gns_above must be a finite number > 0"),
    (dict(snr_below=float("inf")), "snr_below must be a finite number > 0"),
    (dict(at_step=5, interval=0), "interval must be a whole number >= 1"),
])
def test_validation_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        strategy_switch(**kwargs)


def test_a_strategy_is_a_name_or_its_index():
    assert strategy_switch(1, at_step=5).to == strategy_switch(1.0, at_step=5).to == "sma"


def test_repr_and_compilable():
    p = strategy_switch("ssgd", at_step=100)
    assert repr(p) == ("strategy_switch(to='ssgd', at_step=100, gns_above=None, snr_below=None, "
                       "warmup_steps=0, interval=1)")
    assert p.compilable
