"""Small helpers the built-in policies share for reading a context the same way in Python and in the graph.

A compilable policy's after_step runs on plain numbers (Context) and on tensors (the graph context).
Tensors cannot be truth-tested, so these helpers never write `x or default` or `if x` on a reading:
None (Python only: "not known") becomes 0, and 0 is what the monitors report before their first
estimate, so "no estimate" is one test, `is_estimate`, in both worlds.

"No estimate yet" is not "not monitored": a monitor's metric (gns, grad_variance, snr) is in
ctx.metrics from the first step whenever its monitor is on (0 until its first estimate), in both worlds,
and missing only when it is off. A policy reading a missing one would wait for an estimate that never
comes, so metric() raises instead, naming the monitor to turn on: at the policy's first call as a
Python hook, at the step's first trace when compiled.
"""

import math as _math
import numbers


# The metrics computed by a monitor -> the monitor's name in monitors=[...] (kungfu.monitor).
MONITORED = {"gns": "gns", "grad_variance": "variance", "snr": "snr"}


def metric(ctx, name):
    """ctx.metrics[name], with None (Python only) read as 0, "no estimate yet"; a missing key reads as 0
    too, except for a monitor's metric, whose absence means its monitor is off: ValueError naming it."""
    metrics = ctx.metrics if ctx.metrics is not None else {}
    if name in MONITORED and name not in metrics:
        monitor = MONITORED[name]
        raise ValueError(f"ctx.metrics has no {name!r}: the {monitor!r} monitor is not on, so it would never get an "
                         f"estimate. Turn it on: kungfu.rewrite(..., monitors=[{monitor!r}], local_batch_size=...), "
                         f"or the optimizer wrapper's monitor=[{monitor!r}] (the Python runners read the "
                         "optimizer's monitors, or those given as monitors=)")
    value = metrics.get(name, 0.0)
    return 0.0 if value is None else value


def is_estimate(math, x):
    """Whether x is a usable positive estimate: finite and > 0 (a bool, or a bool tensor)."""
    return math.all(math.isfinite(x), x > 0)


def safe(math, ok, x, fallback):
    """x where ok, else fallback. Used before dividing, rounding or taking a root, because PyMath
    evaluates both sides of a where() and Python raises on 1/0, floor(inf) or sqrt(-1)."""
    return math.where(ok, x, fallback)


def reading(ctx, name, policy):
    """A reading the policy cannot work without; ValueError naming the fix when the runner lacks it."""
    value = getattr(ctx, name)
    if value is None:
        raise ValueError(f"{policy!r} needs ctx.{name}, which the runner does not know: give it the adaptive "
                         f"dataset (dataset=ds on kungfu.PolicyRunner or kungfu.keras.PolicyCallback, or, "
                         f"compiled into the step, on kungfu.rewrite or the kungfu optimizer), or set {name} "
                         f"in the Context you built")
    return value


def check_number(who, name, value, *, low=None, low_open=False, integer=False, allow_none=False):
    """Constructor validation: value is a finite real (an int if integer) >= low (> low if low_open)."""
    if value is None and allow_none:
        return None
    kind = "a whole number" if integer else "a finite number"
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and _math.isfinite(value)
          and (not integer or float(value).is_integer()))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if not ok:
        bound = "" if low is None else f" {'>' if low_open else '>='} {low}"
        none = " or None" if allow_none else ""
        raise ValueError(f"{who}: {name} must be {kind}{bound}{none}, got {value!r}")
    return int(value) if integer else float(value)
