"""kungfu.rewrite: make a training step distributed by editing its traced graph.

A rewrite is made per concrete function: the traced graph bakes in shape-specific constants, so each
new input signature is traced by the original tf.function, analysed (find.py) and rebuilt with the
strategy's passes (rebind.py). The result is cached per concrete function and cluster size (a pass may
bake size() in, as the S-SGD pass does for sparse gradients).
"""

import dataclasses
import functools
import threading

import tensorflow as tf

from .. import _lib
from . import find
from . import passes as passes_lib
from . import rebind
from .ssgd import ssgd

STRATEGIES = {"ssgd": (ssgd,)}  # strategy -> its passes, applied in order


def rewrite(fn, strategy="ssgd", *, fusion_bytes=None):
    """Returns fn with KungFu collectives inserted on its gradients; fn's code does not change.

    fn: a training step (a tf.function, or a Python function, which is wrapped in one) that computes
    gradients with tf.GradientTape and applies them with an optimizer, e.g.
    opt.apply_gradients(zip(grads, model.trainable_variables)).
    strategy: "ssgd" (synchronous SGD): every gradient becomes its mean over the workers.
    fusion_bytes: dense gradients are all-reduced in buckets of about this many bytes, in backward-pass
    order, so that collectives overlap with the backward pass (default 4 MiB; 0: one per gradient).

    The returned callable takes fn's arguments. Each new input signature is rewritten once, at its first
    call (which needs kungfu.init()); a step whose gradients cannot be matched one to one with the
    trainable variables it updates raises ValueError then. See docs/rewrite.md.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"kungfu.rewrite: strategy must be one of {', '.join(sorted(STRATEGIES))}; got {strategy!r}")
    if fusion_bytes is not None and (isinstance(fusion_bytes, bool) or not isinstance(fusion_bytes, int)
                                     or fusion_bytes < 0):
        raise ValueError(f"kungfu.rewrite: fusion_bytes must be an int >= 0, got {fusion_bytes!r}")
    if not callable(fn):
        raise TypeError(f"kungfu.rewrite: fn must be a tf.function or a Python function, got {type(fn).__name__}")
    return Rewritten(fn, STRATEGIES[strategy], {"fusion_bytes": fusion_bytes})


@dataclasses.dataclass(frozen=True)
class Report:
    """What one rewrite found and inserted."""

    gradients: tuple  # (variable name, "dense" or "sparse"), in backward-pass order
    inserted: tuple  # passes.Inserted: the collectives, with their keys and variables

    def __str__(self):
        lines = [f"{len(self.gradients)} gradients ({sum(k == 'sparse' for _, k in self.gradients)} sparse), "
                 f"{len(self.inserted)} collectives inserted:"]
        lines += [f"  {c.op} '{c.key}': {', '.join(c.variables)}" for c in self.inserted]
        return "\n".join(lines)


class Rewritten:
    """The callable kungfu.rewrite returns: fn's signature, fn's results, fn's variables, distributed."""

    def __init__(self, fn, passes, options):
        if not isinstance(fn, tf.types.experimental.PolymorphicFunction):
            fn = tf.function(fn)
        self._fn = fn
        self._passes = passes
        self._options = dict(options)
        self._name = getattr(fn, "__name__", None) or getattr(fn, "name", "step")
        self._lock = threading.Lock()
        self._cache = {}  # (original ConcreteFunction, size) -> (rewritten tf.function, Report)
        functools.update_wrapper(self, fn.python_function, updated=())

    def __call__(self, *args, **kwargs):
        return self._rewritten(args, kwargs)[0](*args, **kwargs)

    def get_concrete_function(self, *args, **kwargs):
        """The rewritten ConcreteFunction for these arguments (rewriting it if new)."""
        return self._rewritten(args, kwargs)[0].get_concrete_function(*args, **kwargs)

    def report(self, *args, **kwargs):
        """The Report of the rewrite for these arguments (rewriting it if new)."""
        return self._rewritten(args, kwargs)[1]

    @property
    def rewrite_count(self):
        """How many concrete functions have been rewritten so far."""
        return len(self._cache)

    def _rewritten(self, args, kwargs):
        _lib.require_init(f"kungfu.rewrite({self._name})")
        cf = self._fn.get_concrete_function(*args, **kwargs)
        key = (cf, _lib.size())
        entry = self._cache.get(key)
        if entry is None:
            with self._lock:
                entry = self._cache.get(key) or self._build(cf, args, kwargs)
                self._cache[key] = entry
        return entry

    def _build(self, cf, args, kwargs):
        what = f"kungfu.rewrite({self._name})"
        sites = find.find_gradients(cf, what)
        ctx = passes_lib.PassContext(function=self._name, size=_lib.size(), options=self._options)
        body = rebind.body_for(rebind.plan(cf, sites), self._passes, ctx)
        functools.update_wrapper(body, self._fn.python_function)
        new = tf.function(body, autograph=False, input_signature=self._fn.input_signature)
        new.get_concrete_function(*args, **kwargs)  # traces now: the passes fill ctx.inserted
        report = Report(gradients=tuple((s.name, "sparse" if s.indices else "dense") for s in sites),
                        inserted=tuple(ctx.inserted))
        return new, report
