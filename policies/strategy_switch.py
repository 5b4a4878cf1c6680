"""StrategySwitchPolicy: switch the synchronisation strategy once, by step or by a monitored threshold.

    kp.strategy_switch("ssgd", at_step=2000)                     # model averaging early, S-SGD later
    kp.strategy_switch("ssgd", gns_above=4096, snr_below=0.05)  # when the gradients get noisy

Why. Model averaging (sma, pair_averaging) moves fast early, when the gradients are large and agree; later
the gradient noise dominates and synchronous SGD's exact averaging converges better (KungFu, OSDI 2020).
The noise scale rising, or the SNR of the applied gradient falling, says that moment has come.

The switch happens at the first call at which any trigger holds, and only once: the policy remembers it
(in its state) and never switches back, nor fights another policy that switches later. A resumed run
(ctx.resumed) at or past at_step switches in before_train, since no checkpoint holds the strategy; a switch
that a threshold made is not remembered across a resume (policy state is not saved): it happens again
when the threshold next holds. The gradient
monitors refresh in S-SGD and SMA steps, not in pair averaging's (docs/monitoring.md, "Strategies"):
from pair_averaging, a threshold sees the values of the last S-SGD or SMA step, so switch by at_step.
Branch-free, so it compiles into the training step.
"""

from . import _readings as rd
from .base import BasePolicy
from .context import strategy_name


class StrategySwitchPolicy(BasePolicy):
    """Switches to `to` when a trigger first holds, once.

    Args:
        to: the strategy to switch to: "ssgd", "sma" or "pair_averaging". Default "ssgd".
        at_step: switch after this many completed steps (at the first call with ctx.step >= at_step),
            so the new strategy governs the step before_step sees as ctx.step == at_step on (with
            interval 1).
        gns_above: switch when the gradient noise scale (metrics["gns"]) exceeds this.
        snr_below: switch when the signal-to-noise ratio (metrics["snr"]) falls below this. An SNR of 0,
            the monitors' "no estimate yet", never triggers.
        warmup_steps: the thresholds are not looked at before this step (early estimates are poor);
            at_step is not affected. Default 0.
        interval: call every `interval` steps. Default 1.
    At least one of at_step, gns_above, snr_below is needed; any one that holds triggers the switch.
    """

    compilable = True

    def __init__(self, to="ssgd", *, at_step=None, gns_above=None, snr_below=None, warmup_steps=0, interval=1):
        who = "strategy_switch"
        try:
            self.to = strategy_name(to)
        except ValueError as e:
            raise ValueError(f"{who}: {e}") from None
        self.at_step = rd.check_number(who, "at_step", at_step, low=1, integer=True, allow_none=True)
        self.gns_above = rd.check_number(who, "gns_above", gns_above, low=0, low_open=True, allow_none=True)
        self.snr_below = rd.check_number(who, "snr_below", snr_below, low=0, low_open=True, allow_none=True)
        if self.at_step is None and self.gns_above is None and self.snr_below is None:
            raise ValueError(f"{who}: give a trigger: at_step=, gns_above= or snr_below= (any one that "
                             f"holds switches to {self.to!r})")
        self.warmup_steps = rd.check_number(who, "warmup_steps", warmup_steps, low=0, integer=True)
        self.interval = rd.check_number(who, "interval", interval, low=1, integer=True)

    def due(self, hook, step):
        if hook == "before_train":  # a resumed run's catching up (past step 0)
            return self.at_step is not None and step > 0
        if hook != "after_step" or step % self.interval:
            return False
        if self.gns_above is None and self.snr_below is None:  # only at_step: one call can switch
            return step == self._first_due()
        return True

    def _first_due(self):
        """The step at which the uninterrupted run switches by at_step: the first call at or after it."""
        return -(-self.at_step // self.interval) * self.interval

    def before_train(self, ctx):
        """A resumed run (ctx.resumed: restored from a checkpoint, which holds no strategy) at or past at_step
        switches now, as the uninterrupted run had: after_step is due at one step only, which such a run
        never sees again. (A switch a threshold made is not remembered across a resume.)"""
        if self.at_step is None or not getattr(ctx, "resumed", False):
            return
        s = ctx.state(self, switched=0.0, switched_at=0.0)
        fire = ctx.math.all(s.switched < 0.5, ctx.step >= self._first_due())
        ctx.set_strategy(self.to, when=fire)
        s.update(when=fire, switched=1.0, switched_at=ctx.step)

    def after_step(self, ctx):
        m = ctx.math
        triggers = []
        if self.at_step is not None:
            triggers.append(ctx.step >= self.at_step)
        warm = ctx.step >= self.warmup_steps
        if self.gns_above is not None:
            gns = rd.metric(ctx, "gns")
            triggers.append(m.all(warm, rd.is_estimate(m, gns), gns > self.gns_above))
        if self.snr_below is not None:
            snr = rd.metric(ctx, "snr")
            triggers.append(m.all(warm, rd.is_estimate(m, snr), snr < self.snr_below))
        s = ctx.state(self, switched=0.0, switched_at=0.0)
        fire = m.all(s.switched < 0.5, m.any(*triggers))
        ctx.set_strategy(self.to, when=fire)
        s.update(when=fire, switched=1.0, switched_at=ctx.step)

    def __repr__(self):
        return (f"strategy_switch(to={self.to!r}, at_step={self.at_step!r}, gns_above={self.gns_above!r}, "
                f"snr_below={self.snr_below!r}, warmup_steps={self.warmup_steps!r}, interval={self.interval!r})")


def strategy_switch(to="ssgd", *, at_step=None, gns_above=None, snr_below=None, warmup_steps=0, interval=1):
    """A policy that switches the synchronisation strategy to `to` once: after at_step completed steps,
    or when the noise scale exceeds gns_above, or when the SNR falls below snr_below, whichever comes
    first. See StrategySwitchPolicy."""
    return StrategySwitchPolicy(to, at_step=at_step, gns_above=gns_above, snr_below=snr_below,
                                warmup_steps=warmup_steps, interval=interval)
