"""LR scaling rules and LRScalingPolicy: the numbers each rule gives, and when the policy acts."""

import math

import pytest

from policies.context import Context
from policies.lr_scaling import lr_scaling
from policies.lr_scaling import scaled_learning_rate


def test_rules_give_the_documented_numbers():
    assert scaled_learning_rate("linear", 0.1, 64, 256) == pytest.approx(0.4)
    assert scaled_learning_rate("sqrt", 0.1, 64, 256) == pytest.approx(0.2)
    assert scaled_learning_rate(None, 0.1, 64, 256) == 0.1
    # AdaScale: gain = (phi/B0 + 1) / (phi/B + 1)
    assert scaled_learning_rate("adascale", 0.1, 64, 128, gns=1000.0) == pytest.approx(
        0.1 * (1000 / 64 + 1) / (1000 / 128 + 1))
    assert scaled_learning_rate("linear", 0.1, 64, 32) == pytest.approx(0.05)  # shrinking too


def test_adascale_gain_is_linear_for_small_batches_and_levels_off_for_large_ones():
    lr = lambda b: scaled_learning_rate("adascale", 1.0, 10, b, gns=1e6)  # noqa: E731
    assert lr(40) == pytest.approx(4.0, rel=1e-3)  # B << phi: about B/B0
    cap = 1 + 1e6 / 10  # B >> phi: 1 + phi/B0
    assert lr(1e12) == pytest.approx(cap, rel=1e-3)


@pytest.mark.parametrize("gns", [0.0, -5.0, float("nan"), float("inf")])
def test_adascale_without_an_estimate_keeps_the_rate(gns):
    assert scaled_learning_rate("adascale", 0.1, 64, 512, gns=gns) == 0.1


def test_unknown_rule_names_the_choices():
    with pytest.raises(ValueError, match="'linear', 'sqrt', 'adascale'"):
        scaled_learning_rate("cubic", 0.1, 64, 128)
    with pytest.raises(ValueError, match="lr_scaling: unknown learning-rate rule"):
        lr_scaling("Linear")


def ctx(step, batch, lr=0.1, **metrics):
    return Context(step=step, batch_size=batch, learning_rate=lr, cluster_size=4, metrics=metrics)


def test_policy_follows_batch_changes_from_the_first_values():
    p = lr_scaling("linear")
    c = ctx(1, 64)
    p.after_step(c)
    assert c.changes == {}  # the first call only learns base_lr=0.1 at base_batch=64
    c = ctx(2, 64, lr=0.1)
    p.after_step(c)
    assert c.changes == {}
    c = ctx(3, 64, lr=0.1)
    c.set_batch_size(256)  # a policy before it in the same list
    p.after_step(c)
    assert c.changes == {"batch_size": 256, "learning_rate": pytest.approx(0.4)}
    c = ctx(4, 256, lr=0.4)
    p.after_step(c)
    assert c.changes == {}  # no change of batch: nothing to do
    c = ctx(5, 128, lr=0.4)
    p.after_step(c)
    assert c.changes == {"learning_rate": pytest.approx(0.2)}  # from the base values, not the current rate


def test_explicit_base_values_apply_at_the_first_call():
    p = lr_scaling("sqrt", base_lr=0.05, base_batch=32)
    c = ctx(1, 128, lr=1.0)
    p.after_step(c)
    assert c.changes == {"learning_rate": pytest.approx(0.1)}
    q = lr_scaling("sqrt", base_lr=0.05)  # base_batch: the first batch seen, so no change yet
    c = ctx(1, 128, lr=1.0)
    q.after_step(c)
    assert c.changes == {}


def test_adascale_policy_uses_the_noise_scale_at_the_change():
    p = lr_scaling("adascale")
    p.after_step(ctx(1, 64, gns=1000.0))
    c = ctx(2, 128, gns=2000.0)
    p.after_step(c)
    assert c.changes["learning_rate"] == pytest.approx(0.1 * (2000 / 64 + 1) / (2000 / 128 + 1))


def test_rule_none_does_nothing():
    p = lr_scaling(None)
    for step, batch in [(1, 64), (2, 128)]:
        c = ctx(step, batch)
        p.after_step(c)
        assert c.changes == {}


def test_unknown_learning_rate_needs_base_lr():
    c = Context(step=1, batch_size=64, cluster_size=4)
    with pytest.raises(ValueError, match="pass base_lr="):
        lr_scaling("linear").after_step(c)


def test_validation_and_repr():
    with pytest.raises(ValueError, match="base_lr must be a finite number > 0"):
        lr_scaling("linear", base_lr=0)
    with pytest.raises(ValueError, match="base_batch must be a whole number >= 1"):
        lr_scaling("linear", base_batch=2.5)
    assert repr(lr_scaling("sqrt", 0.1, 64)) == "lr_scaling(rule='sqrt', base_lr=0.1, base_batch=64)"
    assert math.isclose(lr_scaling("sqrt", 0.1, 64).base_lr, 0.1)
    assert lr_scaling("linear").compilable


def test_only_adascale_needs_the_gns_monitor():
    linear = lr_scaling("linear")
    linear.after_step(ctx(1, 64))  # no "gns" in the metrics: the linear rule does not read it
    c = ctx(2, 128)
    linear.after_step(c)
    assert c.changes == {"learning_rate": pytest.approx(0.2)}
    with pytest.raises(ValueError, match=r"ctx.metrics has no 'gns': the 'gns' monitor is not on"):
        lr_scaling("adascale").after_step(ctx(1, 64))
