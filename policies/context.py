"""Context: what a policy reads and how it acts. Plain Python; the runners fill one in per hook call.

    policy = kungfu.policies.gns_batch_size(64, 1024, lr_rule="linear")
    ctx = Context(step=200, batch_size=128, cluster_size=4, learning_rate=0.1, metrics={"gns": 900.0})
    policy.after_step(ctx)
    ctx.changes          # {"batch_size": 256, "learning_rate": 0.2}: what the policy decided

Readings (attributes): step, epoch, samples_seen, batch_size (global), local_batch_size,
learning_rate, strategy ("ssgd", "sma" or "pair_averaging"), cluster_size, metrics (a dict: the
latest monitor values "gns", "grad_variance", "snr", "samples_per_sec", "step_time", and the step's
logs such as "loss"; a value not known is missing or None), resumed (True from before_train to the first
step of a run that resumes training: the optimizer had taken ctx.step steps already, e.g. restored from a
checkpoint). A reading not known to the runner is None.

Actions: set_batch_size(n), set_learning_rate(lr), set_strategy(name), stop(). Each takes
when= (default True): the action happens only if it is true, which lets a compilable policy act
without a Python `if` on a reading. An action updates the readings at once, so a later policy in
the same list sees it (a learning-rate rule after a batch-size policy reads the new batch size), and
records it in ctx.changes; the runner applies ctx.changes after the last policy.

ctx.math is the arithmetic a compilable policy uses (PyMath here; TensorFlow ops in the graph
context), and ctx.state(policy, name=initial, ...) the memory it keeps between calls.
"""

import math as _math
import numbers

STRATEGIES = ("ssgd", "sma", "pair_averaging")


class PyMath:
    """ctx.math on plain Python numbers. The graph context provides the same functions on tensors."""

    @staticmethod
    def where(cond, a, b):
        return a if cond else b

    minimum = staticmethod(min)
    maximum = staticmethod(max)

    @staticmethod
    def clip(x, lo, hi):
        return min(max(x, lo), hi)

    @staticmethod
    def sqrt(x):
        return _math.sqrt(x)

    @staticmethod
    def floor(x):
        return float(_math.floor(x))

    @staticmethod
    def round(x):
        """Rounds half up, floor(x + 0.5), in both backends (Python's round() rounds half to even)."""
        return float(_math.floor(x + 0.5))

    @staticmethod
    def log2(x):
        return _math.log2(x)

    @staticmethod
    def exp2(x):
        return 2.0 ** x

    @staticmethod
    def abs(x):
        return abs(x)

    @staticmethod
    def all(*conds):
        return all(bool(c) for c in conds)

    @staticmethod
    def any(*conds):
        return any(bool(c) for c in conds)

    @staticmethod
    def not_(cond):
        return not cond

    @staticmethod
    def isfinite(x):
        return x is not None and _math.isfinite(x)


class State:
    """A policy's memory between calls: attributes to read, update(when=..., **values) to write."""

    def __init__(self, values):
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"policy state has no {name!r}; declare it in ctx.state(policy, {name}=...)") from None

    def __setattr__(self, name, value):
        raise AttributeError("write policy state with state.update(when=..., name=value)")

    def update(self, when=True, **values):
        unknown = set(values) - set(self._values)
        if unknown:
            raise AttributeError(f"policy state has no {', '.join(sorted(unknown))}; declare it in ctx.state(...)")
        if when:
            self._values.update(values)


def _check_batch(n):
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not _math.isfinite(n) or n != int(n) or n < 1:
        raise ValueError(f"set_batch_size: the global batch size must be a whole number >= 1, got {n!r}")
    return int(n)


def _check_lr(lr):
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not _math.isfinite(lr) or lr <= 0:
        raise ValueError(f"set_learning_rate: the learning rate must be a finite number > 0, got {lr!r}")
    return float(lr)


def strategy_name(strategy, who="set_strategy"):
    """A strategy's name, from its name or its index in STRATEGIES; ValueError, naming who, otherwise."""
    if isinstance(strategy, numbers.Real) and not isinstance(strategy, bool):
        if _math.isfinite(strategy) and float(strategy).is_integer() and 0 <= int(strategy) < len(STRATEGIES):
            return STRATEGIES[int(strategy)]
    elif isinstance(strategy, str) and strategy in STRATEGIES:
        return strategy
    raise ValueError(f"{who}: unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} "
                     f"(or its index, 0 to {len(STRATEGIES) - 1})")


class Context:
    """A policy's view of training at one hook call. Construct one by hand to test a policy."""

    math = PyMath

    def __init__(self, *, step=0, epoch=0, samples_seen=None, batch_size=None, local_batch_size=None,
                 learning_rate=None, strategy=None, cluster_size=1, metrics=None, hook=None, resumed=False):
        self.step = step
        self.epoch = epoch
        self.samples_seen = samples_seen
        self.batch_size = batch_size
        if local_batch_size is None and batch_size is not None and cluster_size:
            local_batch_size = batch_size / cluster_size
        self.local_batch_size = local_batch_size
        self.learning_rate = learning_rate
        self.strategy = strategy
        self.cluster_size = cluster_size
        self.metrics = dict(metrics or {})
        self.hook = hook  # the hook being called ("after_step", ...), for messages
        self.resumed = resumed  # a resumed run's hooks before its first step (its policies may catch up)
        self.changes = {}  # what the policies decided: batch_size, learning_rate, strategy, stop
        self.stopped = False

    def is_strategy(self, name):
        """Whether the current strategy is name (a bool; a bool tensor in the graph context)."""
        return self.strategy == strategy_name(name)

    def set_batch_size(self, n, when=True):
        """Sets the global batch size from the next step (a whole number >= 1), split over the workers."""
        if when:
            n = _check_batch(n)
            self.batch_size = n
            self.local_batch_size = n / self.cluster_size if self.cluster_size else None
            self.changes["batch_size"] = n

    def set_learning_rate(self, lr, when=True):
        """Sets the optimizer's learning rate from the next step."""
        if when:
            self.learning_rate = self.changes["learning_rate"] = _check_lr(lr)

    def set_strategy(self, strategy, when=True):
        """Switches the synchronisation strategy ("ssgd", "sma", "pair_averaging") from the next step."""
        if when:
            self.strategy = self.changes["strategy"] = strategy_name(strategy)

    def stop(self, when=True):
        """Ends training after this step (model.fit stops; PolicyRunner.stopped becomes True)."""
        if when:
            self.stopped = self.changes["stop"] = True

    def state(self, policy, **initial):
        """policy's memory: a State with these names, created with the initial values on first use.
        Kept on the policy object, so a policy keeps its memory from one context to the next."""
        store = policy.__dict__.setdefault("_kungfu_state", {})
        for name, value in initial.items():
            store.setdefault(name, value)
        return State(store)

    def __repr__(self):
        fields = ("step", "epoch", "samples_seen", "batch_size", "learning_rate", "strategy", "cluster_size")
        return "Context(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in fields) + f", metrics={self.metrics!r})"


# On a policy compiled into a step, name -> the tf.Variable that holds that part of its memory (set by
# kungfu's graph context, python/kungfu/_policy/graph.py).
GRAPH_STATE_ATTR = "_kungfu_graph_state"


def state_values(policy):
    """policy's memory as it stands now, name -> value, for logs: what its Python hooks keep, and, where
    kungfu.rewrite or an optimizer compiled it into a step, the values in that step's variables (read
    eagerly; these win, as the compiled copy is the one that runs). Empty before the first call."""
    values = dict(policy.__dict__.get("_kungfu_state", {}))
    for name, variable in policy.__dict__.get(GRAPH_STATE_ATTR, {}).items():
        values[name] = variable.numpy()
    return values
