"""ScheduledPolicy: batch size, learning rate and strategy on a step or epoch schedule.

    kp.scheduled({0: {"batch_size": 64, "learning_rate": 0.1},
                  500: {"batch_size": 256},
                  2000: {"strategy": "ssgd"}})
    kp.scheduled("0: batch_size=64 learning_rate=0.1; 500: batch_size=256; 2000: strategy=ssgd")
    kp.scheduled({0: {"learning_rate": 0.1}, 30: {"learning_rate": 0.01}}, by="epoch")

The spec maps a key to the settings that take effect there; a setting not named keeps its value.

by="step": key k means "after k completed steps", so entry k governs the step that before_step sees
as ctx.step == k (0-based), the (k+1)-th step, and on. It is applied in after_step when ctx.step == k,
the after_step of the k-th step (changes made in after_step take effect from the next step). Entry 0
comes before any step, so it is applied in before_train (of the first run only: a runner that goes on
counting steps, such as a PolicyCallback given to a second model.fit, does not apply it again). The
policy's interval is the greatest common divisor of the nonzero keys, and as a Python hook it is called
only at its keys' steps (due()), so it costs nothing in between. Step entries are
branch-free (one `when=` per entry), so this form compiles into the training step; entry 0 is still
applied by before_train, a Python hook.

by="epoch": entry e is applied in before_epoch when ctx.epoch == e (epochs count from 0), so it
governs epoch e and on. Python-only: epoch hooks do not compile.

Resuming (the runner reads ctx.resumed: the optimizer had taken steps before this run, e.g. restored
from a checkpoint): in before_train (by="step") or the run's first before_epoch (by="epoch"), it applies
what its entries up to that step or epoch set, merged in key order, so the run goes on with the settings
it had (the batch size, say, which no checkpoint holds). By epoch, so does a run's first before_epoch past
epoch 0 (fit(initial_epoch=e) after load_weights, with an optimizer that has taken no steps). Otherwise
entries apply exactly at their key.
"""

import math as _math
import numbers

from . import _readings as rd
from .base import BasePolicy
from .context import strategy_name

FIELDS = ("batch_size", "learning_rate", "strategy")
BY = ("step", "epoch")


def _check_value(field, value, where):
    if field == "batch_size":
        return rd.check_number(f"scheduled: {where}", "batch_size", value, low=1, integer=True)
    if field == "learning_rate":
        return rd.check_number(f"scheduled: {where}", "learning_rate", value, low=0, low_open=True)
    try:
        return strategy_name(value)
    except ValueError as e:
        raise ValueError(f"scheduled: {where}: {e}") from None


def _check_entry(key, entry, by):
    if isinstance(key, bool) or not isinstance(key, numbers.Real) or not _math.isfinite(key) \
            or key != int(key) or key < 0:
        raise ValueError(f"scheduled: every key must be a whole number of {by}s >= 0, got {key!r}")
    where = f"entry {key}"
    if not isinstance(entry, dict):
        raise TypeError(f"scheduled: {where} must be a dict of settings, e.g. {{'batch_size': 256}}, "
                        f"got {type(entry).__name__}")
    unknown = sorted(set(map(str, entry)) - set(FIELDS))
    if unknown:
        raise ValueError(f"scheduled: {where} has unknown setting(s) {', '.join(unknown)}; "
                         f"the settings are {', '.join(FIELDS)}")
    if not entry:
        raise ValueError(f"scheduled: {where} is empty; give at least one of {', '.join(FIELDS)}")
    return {f: _check_value(f, v, where) for f, v in entry.items()}


def parse_spec(text):
    """The dict form of a string spec: "0: batch_size=64 learning_rate=0.1; 500: strategy=ssgd"."""
    spec = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, settings = part.partition(":")
        try:
            key = int(key.strip())
        except ValueError:
            key = None
        if not sep or key is None:
            raise ValueError(f"scheduled: cannot read {part!r}; write entries as "
                             f"'<key>: name=value name=value', separated by ';'")
        if key in spec:
            raise ValueError(f"scheduled: key {key} appears twice in the spec; merge its settings")
        entry = {}
        for item in settings.split():
            name, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"scheduled: entry {key}: cannot read {item!r}; write name=value")
            if name in entry:
                raise ValueError(f"scheduled: entry {key}: {name} is given twice")
            entry[name] = (int(value) if value.isdigit() else value) if name == "strategy" \
                else _number(value, key, name)
        spec[key] = entry
    return spec


def _number(text, key, name):
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"scheduled: entry {key}: {name}={text!r} is not a number") from None
    return int(value) if name == "batch_size" and value.is_integer() else value


class ScheduledPolicy(BasePolicy):
    """Applies settings at given steps or epochs.

    Args:
        spec: {key: {"batch_size": int, "learning_rate": float, "strategy": name}} (any subset per
            entry), or the same as a string, "0: batch_size=64 learning_rate=0.1; 500: strategy=ssgd".
        by: "step" (keys count completed steps; compilable) or "epoch" (keys are epoch numbers from 0;
            Python-only). See the module doc for exactly when an entry applies.
    """

    compilable = True

    def __init__(self, spec, by="step"):
        if by not in BY:
            raise ValueError(f"scheduled: by must be 'step' or 'epoch', got {by!r}")
        if isinstance(spec, str):
            spec = parse_spec(spec)
        if not isinstance(spec, dict):
            raise TypeError(f"scheduled: spec must be a dict {{key: {{setting: value}}}} or a string, "
                            f"got {type(spec).__name__}")
        if not spec:
            raise ValueError("scheduled: the spec is empty; give at least one entry, e.g. {500: {'batch_size': 256}}")
        self.by = by
        checked = {}
        for k in sorted(spec, key=_sort_key):
            entry = _check_entry(k, spec[k], by)
            if int(k) in checked:
                raise ValueError(f"scheduled: key {int(k)} appears twice in the spec; merge its settings")
            checked[int(k)] = entry
        self.spec = checked
        self.compilable = by == "step"
        if by == "epoch":
            self.not_compilable_because = 'by="epoch" (epoch hooks run in Python only; by="step" compiles)'
        nonzero = [k for k in self.spec if k > 0]
        self.interval = _gcd(nonzero) if by == "step" and nonzero else 1

    def due(self, hook, step):
        # Called only where an entry applies: every other call would cost two collectives for nothing.
        if hook == "before_train":  # entry 0, or a resumed run's catching up (past step 0)
            return self.by == "step" and (0 in self.spec or step > 0)
        if hook == "after_step":
            return self.by == "step" and step > 0 and step in self.spec
        return hook == "before_epoch" and self.by == "epoch"

    def before_train(self, ctx):
        if self.by != "step":
            return
        if ctx.step == 0:
            if 0 in self.spec:
                _apply(ctx, self.spec[0], True)
        elif getattr(ctx, "resumed", False):  # not when a later fit of the same run goes on
            _apply(ctx, self.settings_at(ctx.step), True)

    def after_step(self, ctx):
        if self.by != "step":
            return
        for key, entry in self.spec.items():
            if key > 0:
                _apply(ctx, entry, ctx.math.abs(ctx.step - key) < 0.5)

    def before_epoch(self, ctx):
        if self.by != "epoch":
            return
        # A run that starts past epoch 0 without the epoch before it here (fit(initial_epoch=e) after
        # load_weights, whose fresh optimizer has taken no steps, so ctx.resumed is False) catches up too,
        # as Keras's LearningRateScheduler sets its rate from the epoch number.
        previous, self._last_epoch = getattr(self, "_last_epoch", None), ctx.epoch
        jumped = ctx.epoch > 0 and previous != ctx.epoch - 1
        if getattr(ctx, "resumed", False) or jumped:
            _apply(ctx, self.settings_at(ctx.epoch), True)
        elif ctx.epoch in self.spec:
            _apply(ctx, self.spec[ctx.epoch], True)

    def settings_at(self, key):
        """The settings the entries up to key (a step or an epoch) make, merged in key order."""
        merged = {}
        for k, entry in self.spec.items():
            if k <= key:
                merged.update(entry)
        return merged

    def __repr__(self):
        return f"scheduled({self.spec!r}, by={self.by!r})"


def _apply(ctx, entry, when):
    if "batch_size" in entry:
        ctx.set_batch_size(entry["batch_size"], when=when)
    if "learning_rate" in entry:
        ctx.set_learning_rate(entry["learning_rate"], when=when)
    if "strategy" in entry:
        ctx.set_strategy(entry["strategy"], when=when)


def _sort_key(key):
    ok = isinstance(key, numbers.Real) and not isinstance(key, bool) and _math.isfinite(key)
    return (0, float(key)) if ok else (1, repr(key))


def _gcd(keys):
    g = 0
    for k in keys:
        g = _math.gcd(g, k)
    return g


def scheduled(spec, by="step"):
    """A policy that sets batch_size, learning_rate and/or strategy at given steps (keys: completed
    steps; entry 0 before the first step) or epochs (by="epoch"). See ScheduledPolicy and the module doc."""
    return ScheduledPolicy(spec, by=by)
