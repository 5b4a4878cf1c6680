"""GNSBatchSizePolicy: the target, its bounds and rounding, the gain gate, cooldown, warmup, shrinking, the
learning rate that follows, and the step-time fit that decides how far growing pays."""

import pytest

from policies.context import Context
from policies.context import GRAPH_STATE_ATTR
from policies.context import state_values
from policies.gns_batch_size import gns_batch_size
from policies.gns_batch_size import predicted_gain


def ctx(step, batch, lr=0.1, cluster=4, **metrics):
    return Context(step=step, batch_size=batch, learning_rate=lr, cluster_size=cluster, metrics=metrics)


def eager(**kw):
    """A policy that may act at every call: no warmup, no cooldown, interval 1."""
    return gns_batch_size(**{"min_batch": 8, "max_batch": 4096, "interval": 1, "warmup_steps": 0,
                                "cooldown_steps": 0, **kw})


def run(policy, batch, steps, metrics, lr=0.1, cluster=4):
    """Calls after_step at steps 1..steps (as due), applying the changes; returns the batch sizes after
    each changing step as {step: batch} and the final (batch, lr)."""
    seen = {}
    for step in range(1, steps + 1):
        if step % policy.interval:
            continue
        c = ctx(step, batch, lr, cluster, **metrics(step, batch))
        policy.after_step(c)
        batch, lr = c.batch_size, c.learning_rate
        if "batch_size" in c.changes:
            seen[step] = batch
    return seen, batch, lr


def const(**metrics):
    return lambda step, batch: metrics


def state(policy):
    return Context().state(policy)


def test_grows_toward_the_noise_scale_by_at_most_max_change():
    # Without step times the prior (half of a step fixed cost) decides: doubling pays while
    # gns/B > ~2.7, so from 64 with gns 1000 it doubles three times and stops at 512.
    seen, batch, _ = run(eager(), 64, 10, const(gns=1000.0))
    assert seen == {1: 128, 2: 256, 3: 512}
    assert batch == 512
    seen, _, _ = run(eager(max_change=4.0), 64, 10, const(gns=10000.0))
    assert seen[1] == 256


def test_respects_the_bounds():
    seen, batch, _ = run(eager(max_batch=200), 64, 10, const(gns=10000.0))
    assert seen == {1: 128, 2: 200} and batch == 200
    seen, batch, _ = run(eager(min_batch=64), 512, 10, const(gns=10.0))
    assert seen == {1: 256, 2: 128, 3: 64} and batch == 64


def test_target_is_a_multiple_of_the_cluster_size_or_multiple_of():
    p = eager(min_gain=0.0, factor=0.5)
    p.after_step(ctx(1, 128, cluster=4, gns=333.0))  # 0.5 * 333 = 166.5 -> 168 = 42 * 4
    assert state(p).last_target == 168
    p = eager(min_gain=0.0, max_change=4.0)
    p.after_step(ctx(1, 60, cluster=3, gns=100.0))  # round(100 / 3) * 3 = 99
    assert state(p).last_target == 99
    p = eager(min_gain=0.0, max_change=4.0, multiple_of=48)
    c = ctx(1, 48, cluster=4, gns=100.0)  # 100 -> 96 = 2 * 48
    p.after_step(c)
    assert c.changes["batch_size"] == 96
    # bounds are rounded inward to the multiple: [10, 100] with multiples of 16 is [16, 96]
    p = gns_batch_size(10, 100, multiple_of=16, interval=1, warmup_steps=0, cooldown_steps=0, max_change=8.0)
    p.after_step(ctx(1, 32, gns=1e6))
    assert state(p).last_target == 96


def test_bounds_holding_no_multiple_of_the_cluster_size_are_refused_before_training():
    p = gns_batch_size(1, 3)
    assert p.due("before_train", 0)
    with pytest.raises(ValueError, match="no multiple of the cluster size 4 lies in"):
        p.before_train(Context(cluster_size=4))
    gns_batch_size(4, 64).before_train(Context(cluster_size=4))  # fine
    assert not gns_batch_size(2, 3, multiple_of=2).due("before_train", 0)  # checked when made


def test_no_change_below_min_gain_so_the_batch_does_not_churn():
    gain = predicted_gain(1000.0, 0.5, 0.5 / 256, 256, 512)  # the prior at B=256, gns=1000, towards 512
    assert 0.05 < gain < 0.2
    c = ctx(1, 256, gns=1000.0)
    eager(min_gain=gain + 1e-9).after_step(c)
    assert c.changes == {}
    c = ctx(1, 256, gns=1000.0)
    eager(min_gain=gain - 1e-9).after_step(c)
    assert c.changes["batch_size"] == 512
    # near the noise scale the gain is small: 5% is not reached, nothing changes however often it is asked
    seen, batch, _ = run(eager(), 480, 50, const(gns=520.0))
    assert seen == {} and batch == 480


def test_cooldown_spaces_the_changes():
    p = gns_batch_size(8, 4096, interval=10, warmup_steps=0, cooldown_steps=50)
    seen, _, _ = run(p, 64, 200, const(gns=100000.0))
    assert list(seen) == [10, 60, 110, 160]


def test_warmup_holds_the_batch():
    p = gns_batch_size(8, 4096, interval=10, warmup_steps=100, cooldown_steps=0)
    seen, _, _ = run(p, 64, 130, const(gns=100000.0))
    assert list(seen) == [100, 110, 120, 130]


def test_shrinks_unless_told_not_to():
    seen, _, _ = run(eager(), 512, 1, const(gns=50.0))
    assert seen == {1: 256}
    seen, batch, _ = run(eager(allow_shrink=False), 512, 5, const(gns=50.0))
    assert seen == {} and batch == 512


@pytest.mark.parametrize("gns", [0.0, None, -3.0, float("nan"), float("inf")])
def test_no_estimate_no_change(gns):
    c = ctx(1, 64, gns=gns)
    eager().after_step(c)
    assert c.changes == {}


def test_gns_not_monitored_raises_naming_the_monitor():
    """No "gns" key at all is not "no estimate yet": the monitor is off and the policy would never act."""
    with pytest.raises(ValueError, match=r"ctx.metrics has no 'gns': the 'gns' monitor is not on.*monitors=\['gns'\]"):
        eager().after_step(ctx(1, 64, step_time=0.1))


@pytest.mark.parametrize("rule,expected", [
    ("linear", [0.2, 0.4]),
    ("sqrt", [0.1 * 2 ** 0.5, 0.2]),
    ("adascale", [0.1 * (1e4 / 64 + 1) / (1e4 / 128 + 1), 0.1 * (1e4 / 64 + 1) / (1e4 / 256 + 1)]),
])
def test_learning_rate_follows_in_the_same_call(rule, expected):
    p = eager(lr_rule=rule)
    c = ctx(1, 64, lr=0.1, gns=1e4)
    p.after_step(c)
    assert c.changes == {"batch_size": 128, "learning_rate": pytest.approx(expected[0])}
    c = ctx(2, 128, lr=c.learning_rate, gns=1e4)
    p.after_step(c)
    assert c.changes == {"batch_size": 256, "learning_rate": pytest.approx(expected[1])}  # from base 0.1 at 64


def test_learning_rate_left_alone_without_a_rule_and_explicit_base_values():
    c = ctx(1, 64, lr=0.7, gns=1e4)
    eager(lr_rule=None).after_step(c)
    assert c.changes == {"batch_size": 128}
    c = ctx(1, 64, lr=0.7, gns=1e4)
    eager(lr_rule="linear", base_lr=0.05, base_batch=32).after_step(c)
    assert c.changes["learning_rate"] == pytest.approx(0.05 * 128 / 32)


def line(alpha, beta):
    return lambda step, batch: {"gns": 4000.0, "step_time": alpha + beta * batch}


def test_fixed_cost_dominated_steps_make_growing_to_the_noise_scale_pay():
    # t(B) = 0.1 + 1e-5 B: the fit (from the second batch size on) sees large batches nearly free,
    # and goes all the way to gns = 4000, where the prior alone would stop at 2048.
    _, batch, _ = run(eager(), 64, 20, line(0.1, 1e-5))
    assert batch == 4000
    _, batch, _ = run(eager(), 64, 20, const(gns=4000.0))
    assert batch == 2048


def test_per_sample_dominated_steps_stop_growing_once_measured():
    # t(B) = 1e-4 B: no fixed cost, so a larger batch only wastes samples. The prior makes the first two
    # doublings; with two batch sizes measured the fit stops it.
    seen, batch, _ = run(eager(), 64, 20, line(0.0, 1e-4))
    assert seen == {1: 128, 2: 256} and batch == 256


def test_step_time_fit_recovers_the_line():
    p = eager(min_gain=1e9)  # never changes: only the fit is exercised
    for step, batch in enumerate([100, 100, 300, 300, 300, 200, 200], start=1):
        c = ctx(step, batch, gns=0.0, step_time=0.05 + 2e-4 * batch)  # gns monitored, no estimate yet
        p.after_step(c)
        p._remember_batch(c, batch)
    alpha, beta = p._step_time_model(ctx(8, 200, step_time=0.05 + 2e-4 * 200), 200)
    assert alpha == pytest.approx(0.05) and beta == pytest.approx(2e-4)


def fit_after(times, batches):
    """(alpha, beta) of a never-changing policy (only the fit is exercised) after calls with these
    step times at these batch sizes, and its state."""
    p = eager(min_gain=1e9)
    for step, (t, batch) in enumerate(zip(times, batches), start=1):
        c = ctx(step, batch, gns=0.0, step_time=t)  # gns monitored, no estimate yet
        p.after_step(c)
        p._remember_batch(c, batch)
    return p._step_time_model(ctx(len(times) + 1, 200, step_time=0.0), 200), state(p)


def test_a_pause_between_steps_is_left_out_of_the_fit():
    # t(B) = 0.05 + 2e-4 B at 100, 300 and 200; one call reads a step that includes a 10 s pause (a
    # validation pass, a checkpoint): it would wreck the line, and is left out.
    batches = [100, 100, 300, 300, 300, 200, 200, 200]
    times = [0.05 + 2e-4 * b for b in batches]
    paused = list(times)
    paused[4] += 10.0
    (alpha, beta), s = fit_after(paused, batches)
    assert alpha == pytest.approx(0.05) and beta == pytest.approx(2e-4)
    assert s.rejected == 0  # the next usable time was taken again
    # ... and so is one at the first call with a batch size, judged against the one size seen so far
    paused = list(times)
    paused[3] += 10.0
    (alpha, beta), _ = fit_after(paused, batches)
    assert alpha == pytest.approx(0.05) and beta == pytest.approx(2e-4)


def test_steps_that_stay_slower_are_taken_after_two_rejections():
    # From the 5th call on every step takes 10x: two calls are left out as pauses, the third is taken,
    # and the fit follows the new times from there on (the old ones decay away).
    batches = ([100] * 3 + [300] * 3) * 20
    times = [(0.05 + 2e-4 * b) * (10 if i >= 4 else 1) for i, b in enumerate(batches)]
    (alpha, beta), s = fit_after(times, batches)
    assert alpha == pytest.approx(0.5, rel=0.05) and beta == pytest.approx(2e-3, rel=0.05)
    assert s.rejected == 0


def test_describe_last_and_state_for_logs():
    p = eager()
    assert p.describe_last() is None
    p.after_step(ctx(1, 64, gns=1000.0))
    assert p.describe_last() == "step 1: noise scale 1000, target 128 (predicted gain +25.8%): batch 64 -> 128"
    p.after_step(ctx(2, 512, gns=1000.0))
    assert p.describe_last().endswith("kept batch 512")
    s = state(p)
    assert (s.last_step, s.last_batch, s.last_change, s.num_changes) == (2, 512, 1, 1)
    p.after_step(ctx(3, 512, gns=0.0))  # no estimate: no target or gain to report
    assert p.describe_last() == "step 3: no usable noise scale estimate: kept batch 512"


def test_needs_the_batch_size_reading():
    with pytest.raises(ValueError, match="needs ctx.batch_size"):
        eager().after_step(Context(step=1, metrics={"gns": 1.0}))


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_batch=0, max_batch=10), "min_batch must be a whole number >= 1"),
    (dict(min_batch=64, max_batch=32), "max_batch must be a whole number >= 64"),
    (dict(min_batch=10, max_batch=15, multiple_of=16), "no multiple of multiple_of=16"),
    (dict(min_batch=8, max_batch=64, max_change=1.0), "max_change must be a finite number > 1"),
    (dict(min_batch=8, max_batch=64, lr_rule="cubic"), "unknown learning-rate rule"),
    (dict(min_batch=8, max_batch=64, prior_fixed_fraction=1.0), r"prior_fixed_fraction must be in \[0, 1\)"),
    (dict(min_batch=8, max_batch=64, interval=0), "interval must be a whole number >= 1"),
    (dict(min_batch=8, max_batch=64, allow_shrink="no"), "allow_shrink must be True or False"),
    (dict(min_batch=8, max_batch=64, factor=0), "factor must be a finite number > 0"),
])
def test_validation_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gns_batch_size(**kwargs)


def test_repr_shows_the_configuration():
    r = repr(gns_batch_size(64, 1024, lr_rule="linear"))
    assert r.startswith("gns_batch_size(64, 1024, interval=10,") and "lr_rule='linear'" in r
    assert gns_batch_size(64, 1024).compilable


class _FakeVariable:
    """What a compiled policy's memory is held in (a tf.Variable), as far as state_values reads it."""

    def __init__(self, value):
        self.value = value

    def numpy(self):
        return self.value


def test_describe_last_reads_a_compiled_policys_variables():
    p = eager()
    p.after_step(ctx(1, 64, gns=1000.0))  # the hook's memory, then a compiled copy's, which wins
    values = dict(last_step=7.0, last_batch=128.0, last_target=256.0, last_gain=0.1, last_gns=900.0,
                  last_change=7.0)
    p.__dict__[GRAPH_STATE_ATTR] = {k: _FakeVariable(v) for k, v in values.items()}
    assert state_values(p)["last_step"] == 7.0
    assert p.describe_last() == "step 7: noise scale 900, target 256 (predicted gain +10.0%): batch 128 -> 256"


def test_context_repr_names_its_readings():
    assert repr(Context(step=3, batch_size=64, cluster_size=2)).startswith("Context(step=3, epoch=0, ")
