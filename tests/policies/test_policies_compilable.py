"""The built-in policies keep their `compilable` promise: their after_step never truth-tests, converts or
==-compares a reading (it would fail on a graph tensor), performs the same operations at every call (a
graph is traced once), and, run on the symbolic stand-in for the graph context (policy_symbolic.py),
takes the same decisions at the same steps as the Python hook, through runs with missing, zero, NaN and
infinite metrics."""

import math
import random

import pytest

import policies as kp
from policies.base import BasePolicy
from policy_runs import both
from policy_runs import symbolic_caller
from policy_symbolic import NotCompilable


def noisy_metrics(seed):
    """Metrics as the monitors give them, noisier: no estimate for 30 steps, then a rising noise scale
    with jitter; step times that grow with the batch; gaps (None), NaN and inf now and then."""
    def metrics(step, batch):
        rng = random.Random(seed * 100003 + step)
        gns = 0.0 if step < 30 else (300.0 + 12.0 * step) * rng.uniform(0.7, 1.3)
        m = {"gns": gns, "snr": batch / gns if gns else 0.0, "loss": 2.0 / (1 + step),
             "step_time": (0.02 + 2e-5 * batch) * rng.uniform(0.9, 1.1)}
        if step % 37 == 0:
            m["gns"] = None
        if step % 53 == 0:
            m["gns"], m["step_time"] = float("nan"), float("inf")
        if step % 41 == 0:
            del m["step_time"]
        return m
    return metrics


CONFIGS = {
    "gns default": lambda: [kp.gns_batch_size(32, 8192, warmup_steps=20, cooldown_steps=30)],
    "gns eager, no shrink, adascale": lambda: [kp.gns_batch_size(
        16, 2000, interval=3, warmup_steps=0, cooldown_steps=0, allow_shrink=False, lr_rule="adascale",
        max_change=1.5, min_gain=0.01)],
    "gns multiple_of, linear, explicit bases": lambda: [kp.gns_batch_size(
        24, 1536, interval=5, multiple_of=24, cooldown_steps=10, warmup_steps=10, lr_rule="linear",
        base_lr=0.05, base_batch=32, factor=0.7, prior_fixed_fraction=0.8)],
    "gns without lr": lambda: [kp.gns_batch_size(8, 600, interval=2, warmup_steps=0, cooldown_steps=0,
                                                 lr_rule=None, min_gain=0.0)],
    "scheduled + lr_scaling": lambda: [kp.scheduled({7: {"batch_size": 96}, 50: {"batch_size": 400, "strategy": "ssgd"},
                                                     120: {"learning_rate": 0.3}}),
                                       kp.lr_scaling("sqrt")],
    "strategy switches": lambda: [kp.strategy_switch("ssgd", gns_above=1500, snr_below=0.05, warmup_steps=40),
                                  kp.strategy_switch("pair_averaging", at_step=150, interval=7)],
    "lr_scaling explicit": lambda: [kp.gns_batch_size(8, 4096, interval=4, warmup_steps=0, cooldown_steps=8,
                                                      lr_rule=None),
                                    kp.lr_scaling("adascale", base_lr=0.2, base_batch=16)],
}


def same_decisions(py_log, sym_log):
    assert py_log.keys() == sym_log.keys(), (py_log, sym_log)
    for step in py_log:
        a, b = py_log[step], sym_log[step]
        assert a.keys() == b.keys(), (step, a, b)
        for k in a:
            if k == "learning_rate":
                assert b[k] == pytest.approx(a[k], rel=1e-12), (step, a, b)
            else:
                assert a[k] == b[k], (step, a, b)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [1, 2])
def test_graph_and_python_decide_the_same(name, seed):
    (py_log, py_final), (sym_log, sym_final) = both(CONFIGS[name], 300, noisy_metrics(seed))
    assert py_log, f"{name}: the scenario should make the policies act at least once"
    same_decisions(py_log, sym_log)
    assert py_final["batch_size"] == sym_final["batch_size"]
    assert math.isclose(py_final["learning_rate"], sym_final["learning_rate"], rel_tol=1e-12)


def test_every_builtin_compilable_policy_is_covered():
    covered = {type(p) for make in CONFIGS.values() for p in make()}
    assert covered == {kp.GNSBatchSizePolicy, kp.ScheduledPolicy, kp.LRScalingPolicy, kp.StrategySwitchPolicy}


class _IfOnGns(BasePolicy):
    compilable = True  # falsely: it branches on a reading

    def after_step(self, ctx):
        if ctx.metrics["gns"] > 100:
            ctx.set_batch_size(256)


class _MinOfReadings(BasePolicy):
    compilable = True

    def after_step(self, ctx):
        ctx.set_batch_size(min(ctx.batch_size * 2, 512))


class _EqualsStep(BasePolicy):
    compilable = True

    def after_step(self, ctx):
        ctx.stop(when=ctx.step == 10)


@pytest.mark.parametrize("policy,match", [
    (_IfOnGns(), "truth-testing"), (_MinOfReadings(), "truth-testing"), (_EqualsStep(), "==")])
def test_the_symbolic_context_catches_what_a_graph_would_reject(policy, match):
    call = symbolic_caller([policy])
    with pytest.raises(NotCompilable, match=match):
        call(step=1, batch_size=64, learning_rate=0.1, strategy="ssgd", cluster_size=4, metrics={"gns": 500.0})
