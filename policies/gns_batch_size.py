"""GNSBatchSizePolicy: move the global batch size toward the measured gradient noise scale, when it pays.

    policy = kp.gns_batch_size(min_batch=64, max_batch=2048, lr_rule="sqrt")

Why the noise scale. McCandlish et al.: to reach a given loss, the number of steps needed goes as
1 + φ/B, with φ = B_noise the gradient noise scale (metrics["gns"], in samples). Below φ a larger batch
saves steps almost in proportion; above it, it mostly wastes samples. So the target batch is factor·φ.

Why a gain model, and not just "go to φ". A step of batch B takes t(B) = α + β·B seconds (α: the fixed
cost per step, communication and overheads; β: the cost per sample), so the time to the loss goes as

    T(B) ∝ (1 + φ/B)·(α + β·B)

and the predicted gain of moving from B to the target B' is T(B)/T(B') − 1. The policy changes the batch
only when that gain is at least min_gain (5%: Pollux found that batch-size churn costs more than small
gains bring). α and β are fitted online: a decayed least-squares line through the (batch size, step time)
pairs seen at the policy's calls (metrics["step_time"]). Until two distinct batch sizes have been seen
the line is undetermined, and a prior stands in: α = f·t, β = (1 − f)·t/B at the current B and step time t,
f = prior_fixed_fraction (only the ratio T(B)/T(B') is used, so t cancels and no timing is needed).
The fit is clamped to α >= 0 and β >= 0.1% of the mean time per sample, so T stays positive. A step
time is the time between two steps, pauses included (validation, a checkpoint, logging), so one over 3x
what the fit expects is left out, unless the two before it were too (then the steps really are slower).
With the prior alone (f = 0.5) a doubling pays 5% while φ/B > ~2.7, so the batch first settles between
0.37·φ and 0.74·φ; the measured step times then decide whether going further pays (it does when the fixed cost
per step, e.g. communication, dominates).

Everything in after_step is branch-free (ctx.math, when=), so the policy compiles into the step.
"""

from . import _readings as rd
from .base import BasePolicy
from .context import state_values
from .lr_scaling import base_values
from .lr_scaling import catch_up_rate
from .lr_scaling import check_rule
from .lr_scaling import scaled_learning_rate

_FIT_DECAY = 0.95  # per call: the step-time fit forgets with a time constant of ~20 calls
_MIN_REL_SPREAD = 1e-6  # weighted var(B)/mean(B)^2 below this: one batch size only, use the prior
_MIN_BETA_FRACTION = 1e-3  # beta >= this * mean step time / mean batch: a larger batch is never free
_OUTLIER_FACTOR = 3.0  # a step time over this times the fit's expectation is a pause, not a step...
_MAX_REJECTED = 2  # ...unless this many in a row were: then it is taken
_NEVER = -1e30  # last_change before any change: the cooldown is then over


class GNSBatchSizePolicy(BasePolicy):
    """Grows (and may shrink) the global batch size toward factor · gradient noise scale.

    Args:
        min_batch, max_batch: bounds of the global batch size (rounded inward to multiple_of).
        interval: decide every `interval` steps (after_step when step % interval == 0). Default 10.
        factor: target = factor · gns. Default 1.0 (the noise scale itself).
        multiple_of: the batch is a multiple of this; default the cluster size, so every worker gets
            the same share. Read at every call (the cluster size is fixed for a job today; reading it
            each time is ready for resizing, which a later version adds). Bounds that hold no multiple
            of it are refused: when it is given, at once; the cluster size, in before_train.
        min_gain: change only for a predicted gain in time-to-loss of at least this (0.05: 5%).
        cooldown_steps: steps to wait after a change before the next (the noise-scale EMA and the
            step-time fit need that long to see the new batch). Default 100.
        warmup_steps: no change before this step (early noise-scale estimates are poor). Default 100.
        allow_shrink: whether the batch may also shrink when the noise scale falls. Default True.
        max_change: one decision moves the batch by at most this factor up or down. Default 2.0.
        lr_rule: how the learning rate follows a change ("linear", "sqrt", "adascale", None to leave
            it alone); set in the same call, relative to base_lr at base_batch. Default "sqrt".
        base_lr, base_batch: default the learning rate and batch size at the first call.
        prior_fixed_fraction: the share of a step's time taken to be fixed cost (α) until the step-time
            fit has two batch sizes. Default 0.5.

    For logs: describe_last() says what the last call decided; the state fields behind it are
    last_step, last_batch (before the decision), last_target, last_gain, last_gns, last_change (the step of
    the last change) and num_changes, read with policies.context.state_values(policy). Both work for the
    policy run as a Python hook and compiled into the step.
    """

    compilable = True

    def __init__(self, min_batch, max_batch, *, interval=10, factor=1.0, multiple_of=None, min_gain=0.05,
                 cooldown_steps=100, warmup_steps=100, allow_shrink=True, max_change=2.0, lr_rule="sqrt",
                 base_lr=None, base_batch=None, prior_fixed_fraction=0.5):
        who = "gns_batch_size"
        self.min_batch = rd.check_number(who, "min_batch", min_batch, low=1, integer=True)
        self.max_batch = rd.check_number(who, "max_batch", max_batch, low=self.min_batch, integer=True)
        self.interval = rd.check_number(who, "interval", interval, low=1, integer=True)
        self.factor = rd.check_number(who, "factor", factor, low=0, low_open=True)
        self.multiple_of = rd.check_number(who, "multiple_of", multiple_of, low=1, integer=True, allow_none=True)
        self.min_gain = rd.check_number(who, "min_gain", min_gain, low=0)
        self.cooldown_steps = rd.check_number(who, "cooldown_steps", cooldown_steps, low=0, integer=True)
        self.warmup_steps = rd.check_number(who, "warmup_steps", warmup_steps, low=0, integer=True)
        if not isinstance(allow_shrink, bool):
            raise ValueError(f"{who}: allow_shrink must be True or False, got {allow_shrink!r}")
        self.allow_shrink = allow_shrink
        self.max_change = rd.check_number(who, "max_change", max_change, low=1, low_open=True)
        self.lr_rule = check_rule(lr_rule, who)
        self.base_lr = rd.check_number(who, "base_lr", base_lr, low=0, low_open=True, allow_none=True)
        self.base_batch = rd.check_number(who, "base_batch", base_batch, low=1, integer=True, allow_none=True)
        f = rd.check_number(who, "prior_fixed_fraction", prior_fixed_fraction, low=0)
        if f >= 1:
            raise ValueError(f"{who}: prior_fixed_fraction must be in [0, 1) (the fixed share of a step's "
                             f"time), got {prior_fixed_fraction!r}")
        self.prior_fixed_fraction = f
        m = self.multiple_of
        if m is not None and (self.max_batch // m) * m < self.min_batch:
            raise ValueError(f"{who}: no multiple of multiple_of={m} lies in [min_batch={self.min_batch}, "
                             f"max_batch={self.max_batch}]; widen the bounds or change multiple_of")

    def due(self, hook, step):
        if hook == "before_train":  # the bounds against the cluster size; a resumed run's rate (past step 0)
            return self.multiple_of is None or (self.lr_rule is not None and step > 0)
        return super().due(hook, step)

    def before_train(self, ctx):
        m = ctx.cluster_size
        if self.multiple_of is None and m and (self.max_batch // m) * m < self.min_batch:
            raise ValueError(f"gns_batch_size: no multiple of the cluster size {m} lies in [min_batch="
                             f"{self.min_batch}, max_batch={self.max_batch}], so the batch could never move; "
                             "widen the bounds or pass multiple_of")
        catch_up_rate(self, ctx, self.lr_rule, self.base_lr, self.base_batch)  # adascale: gain 1 until gns comes

    def after_step(self, ctx):
        m = ctx.math
        batch = rd.reading(ctx, "batch_size", self)
        gns = rd.metric(ctx, "gns")
        valid = rd.is_estimate(m, gns)
        phi = m.where(valid, gns, 0.0)
        s = ctx.state(self, last_change=_NEVER, last_step=0.0, last_batch=0.0, last_target=0.0,
                      last_gain=0.0, last_gns=0.0, num_changes=0.0)
        if self.lr_rule is not None:
            lr0, b0 = base_values(self, ctx, self.base_lr, self.base_batch)  # first call's values, kept
        alpha, beta = self._step_time_model(ctx, batch)
        target, feasible = self._target(ctx, batch, phi)
        gain = predicted_gain(phi, alpha, beta, batch, m.maximum(target, 1.0))
        change = m.all(ctx.step >= self.warmup_steps, valid, feasible,
                       ctx.step - s.last_change >= self.cooldown_steps,
                       m.abs(target - batch) > 0.5, gain >= self.min_gain)
        if not self.allow_shrink:
            change = m.all(change, target > batch)
        ctx.set_batch_size(target, when=change)
        if self.lr_rule is not None:
            ctx.set_learning_rate(scaled_learning_rate(self.lr_rule, lr0, b0, target, phi, m), when=change)
        s.update(when=change, last_change=ctx.step, num_changes=s.num_changes + 1)
        s.update(last_step=ctx.step, last_batch=batch, last_target=target, last_gain=gain, last_gns=phi)
        self._remember_batch(ctx, m.where(change, target, batch))

    def _target(self, ctx, batch, phi):
        """(target, feasible): factor·φ rounded to the multiple, within max_change of batch, then within
        the bounds (the bounds win); feasible is False when no multiple lies within the bounds."""
        m = ctx.math
        mult = self.multiple_of if self.multiple_of is not None else rd.reading(ctx, "cluster_size", self)
        lo = _ceil_to(m, self.min_batch, mult)
        hi = _floor_to(m, self.max_batch, mult)
        # capped at max_batch first: it changes no result (the bounds come later) and keeps a huge φ
        # from overflowing in round()
        raw = mult * m.maximum(m.round(m.minimum(self.factor * phi, self.max_batch) / mult), 1.0)
        # minimum(maximum()) spelled out: the max_change window can be empty (a batch that is no multiple),
        # and then which bound wins matters; the bounds are applied last, so they always hold.
        stepped = m.minimum(m.maximum(raw, _ceil_to(m, batch / self.max_change, mult)),
                            _floor_to(m, batch * self.max_change, mult))
        return m.minimum(m.maximum(stepped, lo), hi), lo <= hi

    def _step_time_model(self, ctx, batch):
        """(alpha, beta) of t(B) = alpha + beta·B: the decayed least-squares fit of the (batch, step time)
        pairs, or the prior while the fit has seen one batch size only. A pair is taken only when the
        batch was the same at the previous call, so the step time was measured at this batch (the first
        steps after a change, with their retrace, are left out). A step time over _OUTLIER_FACTOR times
        what the fit expects is left out too (a pause between steps: validation, a checkpoint, logging),
        unless the ones before it were, _MAX_REJECTED in a row: then the steps really are slower."""
        m = ctx.math
        t = rd.metric(ctx, "step_time")
        s = ctx.state(self, fit_batch=0.0, s0=0.0, sb=0.0, sbb=0.0, st=0.0, sbt=0.0, rejected=0.0)
        usable = m.all(rd.is_estimate(m, t), m.abs(batch - s.fit_batch) < 0.5)
        s0, sb, sbb, st, sbt, rejected = s.s0, s.sb, s.sbb, s.st, s.sbt, s.rejected  # one read each
        # What the pairs so far say this batch takes: the fitted line; with one batch size seen, its mean
        # time scaled as if all of it were per sample (the most a larger batch can take).
        fitted, alpha, beta = _fit(m, s0, sb, sbb, st, sbt)
        seen = s0 > 0
        mean_t = st / m.where(seen, s0, 1.0)
        mean_b = sb / m.where(seen, s0, 1.0)
        expected = m.where(fitted, alpha + beta * batch,
                           mean_t * m.maximum(1.0, batch / m.where(mean_b > 0, mean_b, 1.0)))
        outlier = m.all(usable, seen, t > _OUTLIER_FACTOR * expected, rejected < _MAX_REJECTED)
        w = m.where(m.all(usable, m.not_(outlier)), 1.0, 0.0)
        t = m.where(w > 0, t, 0.0)  # a NaN must not enter the sums, even with weight 0
        d = _FIT_DECAY
        s0, sb, sbb, st, sbt = (d * s0 + w, d * sb + w * batch, d * sbb + w * batch * batch, d * st + w * t,
                                d * sbt + w * batch * t)
        s.update(s0=s0, sb=sb, sbb=sbb, st=st, sbt=sbt,
                 rejected=m.where(outlier, rejected + 1.0, m.where(usable, 0.0, rejected)))
        fitted, alpha, beta = _fit(m, s0, sb, sbb, st, sbt)
        f = self.prior_fixed_fraction
        return m.where(fitted, alpha, f), m.where(fitted, beta, (1.0 - f) / batch)

    def _remember_batch(self, ctx, batch):
        ctx.state(self, fit_batch=0.0).update(fit_batch=batch)

    def describe_last(self):
        """What the last call decided, as a line for logs; None before the first call."""
        s = state_values(self)
        values = {k: s.get(k) for k in ("last_step", "last_batch", "last_target", "last_gain", "last_gns",
                                        "last_change")}
        if values["last_step"] is None or float(values["last_step"]) <= 0:
            return None
        step, batch, target, gain, gns, changed = (float(v) for v in values.values())
        if not gns > 0:  # no usable estimate (none yet, or EMA |G|^2 <= 0): the batch is kept
            return f"step {step:.0f}: no usable noise scale estimate: kept batch {batch:.0f}"
        head = f"step {step:.0f}: noise scale {gns:.0f}, target {target:.0f} (predicted gain {gain:+.1%})"
        if changed == step:
            return f"{head}: batch {batch:.0f} -> {target:.0f}"
        return f"{head}: kept batch {batch:.0f}"

    def __repr__(self):
        names = ("interval", "factor", "multiple_of", "min_gain", "cooldown_steps", "warmup_steps",
                 "allow_shrink", "max_change", "lr_rule", "base_lr", "base_batch", "prior_fixed_fraction")
        args = ", ".join(f"{n}={getattr(self, n)!r}" for n in names)
        return f"gns_batch_size({self.min_batch}, {self.max_batch}, {args})"


def predicted_gain(phi, alpha, beta, batch, target):
    """T(batch)/T(target) − 1 with T(B) = (1 + φ/B)·(α + β·B): the fraction of the time to a given loss
    that moving to target saves (negative: it costs). Needs batch, target > 0 and α + β·B > 0."""
    def time_to_loss(b):
        return (1.0 + phi / b) * (alpha + beta * b)
    return time_to_loss(batch) / time_to_loss(target) - 1.0


def _fit(m, s0, sb, sbb, st, sbt):
    """(fitted, alpha, beta) from the decayed sums of the step-time fit: fitted is False while the pairs
    hold one batch size only (alpha and beta are then meaningless); alpha >= 0, and beta >=
    _MIN_BETA_FRACTION of the mean time per sample."""
    det = s0 * sbb - sb * sb
    fitted = det > _MIN_REL_SPREAD * sb * sb
    beta = (s0 * sbt - sb * st) / m.where(fitted, det, 1.0)
    alpha = (st - beta * sb) / m.where(s0 > 0, s0, 1.0)
    min_beta = _MIN_BETA_FRACTION * st / m.where(sb > 0, sb, 1.0)
    return fitted, m.maximum(alpha, 0.0), m.maximum(beta, min_beta)


def _ceil_to(m, x, mult):
    """The smallest multiple of mult >= x (ceil(y) = -floor(-y): ctx.math has floor only)."""
    return -m.floor(-x / mult) * mult


def _floor_to(m, x, mult):
    return m.floor(x / mult) * mult


def gns_batch_size(min_batch, max_batch, *, interval=10, factor=1.0, multiple_of=None, min_gain=0.05,
                   cooldown_steps=100, warmup_steps=100, allow_shrink=True, max_change=2.0, lr_rule="sqrt",
                   base_lr=None, base_batch=None, prior_fixed_fraction=0.5):
    """A policy that moves the global batch toward factor · gradient noise scale within [min_batch,
    max_batch] when the predicted gain in time-to-loss is at least min_gain, with the learning rate
    following by lr_rule. Needs the "gns" monitor (and "step_time" for the step-time fit). See
    GNSBatchSizePolicy for every parameter."""
    return GNSBatchSizePolicy(min_batch, max_batch, interval=interval, factor=factor, multiple_of=multiple_of,
                              min_gain=min_gain, cooldown_steps=cooldown_steps, warmup_steps=warmup_steps,
                              allow_shrink=allow_shrink, max_change=max_change, lr_rule=lr_rule,
                              base_lr=base_lr, base_batch=base_batch,
                              prior_fixed_fraction=prior_fixed_fraction)
