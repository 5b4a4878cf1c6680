"""EarlyStopOnPlateau: stop training when an epoch metric stops improving. Python-only (an epoch hook).

    kp.early_stop("val_loss", patience=3, min_delta=1e-3)

Like keras.callbacks.EarlyStopping, but as a policy: the runner stops every worker at the same step
(the decision is agreed like any other), which a per-worker Keras callback cannot promise.
"""

import logging
import math as _math

from . import _readings as rd
from .base import BasePolicy

MODES = ("min", "max")
_log = logging.getLogger("kungfu.policies")


class EarlyStopOnPlateau(BasePolicy):
    """Calls ctx.stop() after `patience` epochs in a row without an improvement of at least min_delta.

    Args:
        metric: the epoch metric to watch (a key of ctx.metrics at after_epoch, e.g. "loss",
            "val_loss", "accuracy"). Default "loss".
        patience: epochs without improvement before stopping. Default 5.
        min_delta: the least change that counts as an improvement. Default 0.
        mode: "min" (lower is better, the default) or "max" (higher is better, e.g. accuracy).
    A missing metric raises ValueError naming the metrics there are, except a "val_" metric in an epoch
    without validation (fit's validation_freq), which is skipped; a NaN or inf counts as no improvement.
    """

    not_compilable_because = "it acts at the end of epochs, which run in Python only"

    def __init__(self, metric="loss", patience=5, min_delta=0.0, mode="min"):
        who = "early_stop"
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"{who}: metric must be the name of an epoch metric such as 'loss', got {metric!r}")
        if mode not in MODES:
            raise ValueError(f"{who}: mode must be 'min' or 'max', got {mode!r}")
        self.metric = metric
        self.patience = rd.check_number(who, "patience", patience, low=1, integer=True)
        self.min_delta = rd.check_number(who, "min_delta", min_delta, low=0)
        self.mode = mode
        self.best = None  # the best value so far, None before the first epoch
        self.wait = 0  # epochs since the last improvement
        self._warned = False  # said that an epoch had no validation

    def before_train(self, ctx):
        self.best, self.wait, self._warned = None, 0, False

    def after_epoch(self, ctx):
        value = (ctx.metrics or {}).get(self.metric)
        if value is None and self.metric.startswith("val_") and not any(
                k.startswith("val_") for k in (ctx.metrics or {})):
            # No validation this epoch (fit's validation_freq > 1, say): like Keras's EarlyStopping, skip it,
            # and say so once a run, for a fit that never validates.
            if not self._warned:
                self._warned = True
                _log.warning("early_stop: epoch %s has no validation metrics, so no %r (there are: %s); it waits "
                             "for an epoch with validation (pass validation_data to fit, or metric= one of these)",
                             ctx.epoch, self.metric, ", ".join(sorted(ctx.metrics or {})) or "none")
            return
        if value is None:
            have = ", ".join(sorted(ctx.metrics or {})) or "none"
            raise ValueError(f"early_stop: the metric {self.metric!r} is not in this epoch's metrics "
                             f"(there are: {have}); pass metric= one of them")
        value = float(value)
        sign = 1.0 if self.mode == "min" else -1.0
        improved = _math.isfinite(value) and (self.best is None or sign * (self.best - value) > self.min_delta)
        if improved:
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        ctx.stop(when=self.wait >= self.patience)

    def __repr__(self):
        return (f"early_stop(metric={self.metric!r}, patience={self.patience}, min_delta={self.min_delta}, "
                f"mode={self.mode!r})")


def early_stop(metric="loss", patience=5, min_delta=0.0, mode="min"):
    """A policy that stops training after `patience` epochs without an improvement of at least min_delta
    in `metric` (mode "min" or "max"). Python-only. See EarlyStopOnPlateau."""
    return EarlyStopOnPlateau(metric=metric, patience=patience, min_delta=min_delta, mode=mode)
