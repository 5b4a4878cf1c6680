"""How the learning rate follows the global batch size: the rules, and a policy that applies them.

    lr = scaled_learning_rate("sqrt", base_lr=0.1, base_batch=64, batch=256)    # 0.2
    policies = [kp.scheduled({500: {"batch_size": 256}}), kp.lr_scaling("linear")]

Rules, with B0 the base batch size and lr0 the learning rate that suits it:
- "linear": lr0·B/B0 (Goyal et al.: keeps the update per sample the same; suits SGD at moderate B).
- "sqrt": lr0·sqrt(B/B0) (keeps the update's noise the same; the safer choice for adaptive optimizers).
- "adascale": lr0·gain, gain = (var + sqr)/(var/scale + sqr), scale = B/B0 (AdaScale, Pollux). With
  the noise scale φ = tr Σ/|G|² (metrics["gns"], in samples), var/sqr = φ/B0, so
  gain = (φ/B0 + 1)/(φ/B + 1): about B/B0 while B << φ (noise dominates, linear scaling is right),
  levelling off at 1 + φ/B0 once B >> φ (more samples no longer help). Without an estimate
  (φ <= 0 or not finite) the gain is 1.
- None: the learning rate is left as it is (lr0).

The functions work on Python numbers (math=PyMath) and on tensors (math=the graph context's math), so
the compiled policies call the same code.
"""

from . import _readings as rd
from .base import BasePolicy
from .context import PyMath

RULES = ("linear", "sqrt", "adascale")


def check_rule(rule, who):
    """rule if it is one of RULES or None; ValueError naming them otherwise."""
    if rule is not None and rule not in RULES:
        raise ValueError(f"{who}: unknown learning-rate rule {rule!r}; choose one of "
                         f"{', '.join(map(repr, RULES))}, or None to leave the learning rate alone")
    return rule


def adascale_gain(base_batch, batch, gns, math=PyMath):
    """AdaScale's gain (φ/B0 + 1)/(φ/B + 1) for going from base_batch to batch; 1 without an estimate."""
    phi = math.where(rd.is_estimate(math, gns), gns, 0.0)
    return (phi / base_batch + 1.0) / (phi / batch + 1.0)


def scaled_learning_rate(rule, base_lr, base_batch, batch, gns=0.0, math=PyMath):
    """The learning rate for global batch `batch` by `rule`, given base_lr suits base_batch.

    gns is the gradient noise scale in samples (used by "adascale" only). Batch sizes must be > 0."""
    check_rule(rule, "scaled_learning_rate")
    if rule is None:
        return base_lr
    if rule == "linear":
        return base_lr * (batch / base_batch)
    if rule == "sqrt":
        return base_lr * math.sqrt(batch / base_batch)
    return base_lr * adascale_gain(base_batch, batch, gns, math)


class LRScalingPolicy(BasePolicy):
    """Sets the learning rate by a rule whenever the global batch size changes.

    Args:
        rule: "linear", "sqrt", "adascale" (see the module doc) or None (do nothing).
        base_lr: the learning rate that suits base_batch; default: the learning rate at the first call.
        base_batch: the global batch size base_lr suits; default: the batch size at the first call.

    At every after_step, and at every before_epoch, it compares the batch size (as it is then: a policy
    earlier in the same list that changed it has already updated the reading) with the one it saw at its
    previous call, and on a difference sets lr = rule(base_lr, base_batch, batch). before_epoch follows
    changes made at an epoch boundary (scheduled(..., by="epoch") before it, or by hand between epochs)
    before the epoch's first step; one made by hand in the middle of an epoch is followed at the next
    after_step, so the step after it still runs at the old rate. At the first call the "previous" batch is
    base_batch, so an explicit base_batch other than the starting batch sets the rate at once. The rate
    is always derived from the base values, never from the current rate, so a schedule that changes the
    rate in between is overridden at the next batch change. Compilable.
    """

    compilable = True

    def __init__(self, rule, base_lr=None, base_batch=None):
        self.rule = check_rule(rule, "lr_scaling")
        self.base_lr = rd.check_number("lr_scaling", "base_lr", base_lr, low=0, low_open=True, allow_none=True)
        self.base_batch = rd.check_number("lr_scaling", "base_batch", base_batch, low=1, integer=True,
                                          allow_none=True)

    def due(self, hook, step):
        if hook == "before_train":  # a resumed run's catching up (past step 0)
            return self.rule is not None and step > 0
        return super().due(hook, step)

    def before_train(self, ctx):
        catch_up_rate(self, ctx, self.rule, self.base_lr, self.base_batch)

    def after_step(self, ctx):
        if self.rule is None:
            return
        lr, seen = follow_batch(self, ctx, self.rule, self.base_lr, self.base_batch)
        ctx.set_learning_rate(lr, when=seen)

    def before_epoch(self, ctx):  # a change at the epoch boundary: before the epoch's first step
        self.after_step(ctx)

    def __repr__(self):
        return f"lr_scaling(rule={self.rule!r}, base_lr={self.base_lr!r}, base_batch={self.base_batch!r})"


def catch_up_rate(policy, ctx, rule, base_lr, base_batch):
    """In a resumed run's before_train (ctx.resumed), caps the learning rate at the rule's rate for the batch
    size the run starts at. The checkpoint holds the rate reached, but not the batch size it went with (the
    dataset starts at its own, or a schedule's catching up sets one): without this the run trained on at
    the grown rate with the starting batch (gns_batch_size at 8 with the rate for 118: the loss blew up)
    until the next change. A lower restored rate stays: a schedule or ReduceLROnPlateau may have lowered it
    since the last batch change, and the rule would not have raised it again before the next. Needs base_lr
    and base_batch (the runner warns when they are missing, as the first values seen after a resume are not
    the original run's) and a known batch size."""
    if rule is None or not getattr(ctx, "resumed", False) or base_lr is None or base_batch is None:
        return
    if ctx.batch_size is None:
        return
    batch = rd.reading(ctx, "batch_size", policy)
    rate = scaled_learning_rate(rule, base_lr, base_batch, batch, 0.0, ctx.math)
    restored = ctx.learning_rate
    ctx.set_learning_rate(rate if restored is None else ctx.math.minimum(restored, rate))


def base_values(policy, ctx, base_lr, base_batch):
    """(base_lr, base_batch): the configured ones, else those of the first call (kept in policy's state)."""
    s = ctx.state(policy, based=0.0, base_lr=0.0, base_batch=0.0)
    first = s.based < 0.5
    lr0 = ctx.learning_rate if base_lr is None else base_lr
    b0 = ctx.batch_size if base_batch is None else base_batch
    if lr0 is None:
        raise ValueError(f"{policy!r} needs the learning rate: the runner does not know it, so pass base_lr=")
    s.update(when=first, based=1.0, base_lr=lr0, base_batch=b0)
    return s.base_lr, s.base_batch


def follow_batch(policy, ctx, rule, base_lr, base_batch):
    """(lr, changed): the rule's rate for the current batch, and whether the batch differs from the one
    seen at the previous call (base_batch at the first). Updates the policy's memory of the batch."""
    batch = rd.reading(ctx, "batch_size", policy)
    lr0, b0 = base_values(policy, ctx, base_lr, base_batch)
    s = ctx.state(policy, last_batch=0.0)
    last = ctx.math.where(s.last_batch > 0, s.last_batch, b0)
    changed = ctx.math.abs(batch - last) > 0.5
    s.update(last_batch=batch)
    gns = rd.metric(ctx, "gns") if rule == "adascale" else 0.0  # the other rules need no monitor
    lr = scaled_learning_rate(rule, lr0, b0, batch, gns, ctx.math)
    return lr, changed


def lr_scaling(rule, base_lr=None, base_batch=None):
    """A policy that sets the learning rate by `rule` ("linear", "sqrt", "adascale" or None) whenever the
    global batch size changes, relative to base_lr at base_batch (default: the first values seen).
    Put it after the policies that change the batch size. See LRScalingPolicy."""
    return LRScalingPolicy(rule, base_lr=base_lr, base_batch=base_batch)
