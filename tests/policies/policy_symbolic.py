"""A stand-in for the graph context, with no TensorFlow: readings that behave like tensors.

A compilable policy's after_step is traced once in the graph, with float64 scalar tensors as readings.
A tensor cannot be truth-tested (if, and, or, not, min(), max()), converted (int(), float(), round()) or
compared with == into a Python bool. Sym does what a tensor does here: arithmetic and comparisons give
new Syms, and every forbidden use raises NotCompilable. Each Sym also carries its value (numpy
float64 or bool), computed as TensorFlow would (division by zero gives inf, not an error; where()
evaluates both sides), so a run on Syms gives the decisions the compiled policy would take, to compare
with the Python hook's. SymMath is ctx.math on Syms; SymContext the context; SymRun keeps the policies'
state between calls as the graph keeps variables. Each call's list of operations is recorded, and a
compiled policy must perform the same operations at every call (it is traced once).
"""

import numbers

import numpy as np

STRATEGIES = ("ssgd", "sma", "pair_averaging")
METRICS = ("gns", "grad_variance", "snr", "samples_per_sec", "step_time", "loss")


class NotCompilable(TypeError):
    """The policy used a reading in a way a graph tensor does not allow."""


def _forbid(what, fix):
    def method(self, *args):
        raise NotCompilable(f"{what} on a reading, which is a tensor in the graph: {fix}")
    return method


class Sym:
    """A float64 or bool scalar 'tensor' with its value; see the module doc."""

    __slots__ = ("value", "log")

    def __init__(self, value, log):
        self.value = np.asarray(value)
        self.log = log  # the SymRun's list of operations for the current call

    __bool__ = _forbid("truth-testing (if/and/or/not/min/max)", "use ctx.math.where/all/any/minimum and when=")
    __float__ = _forbid("float()", "keep it a tensor; use ctx.math")
    __int__ = _forbid("int()", "keep it a tensor; use ctx.math.floor/round")
    __index__ = _forbid("use as an index", "keep it a tensor")
    __round__ = _forbid("round()", "use ctx.math.round")
    __eq__ = _forbid("==", "compare with ctx.math.abs(a - b) < 0.5, or <= and >=")
    __ne__ = _forbid("!=", "compare with ctx.math.abs(a - b) > 0.5")
    __hash__ = object.__hash__

    def __repr__(self):
        return f"Sym({self.value!r})"

    def _bin(name, fn, reflected=False, compare=False):
        def method(self, other):
            a, b = (other, self) if reflected else (self, other)
            return op(name, fn, a, b, numeric=not compare)
        return method

    __add__, __radd__ = _bin("add", np.add), _bin("add", np.add, True)
    __sub__, __rsub__ = _bin("sub", np.subtract), _bin("sub", np.subtract, True)
    __mul__, __rmul__ = _bin("mul", np.multiply), _bin("mul", np.multiply, True)
    __truediv__, __rtruediv__ = _bin("div", np.divide), _bin("div", np.divide, True)
    __mod__, __rmod__ = _bin("mod", np.mod), _bin("mod", np.mod, True)
    __pow__, __rpow__ = _bin("pow", np.power), _bin("pow", np.power, True)
    __lt__, __le__ = _bin("lt", np.less, compare=True), _bin("le", np.less_equal, compare=True)
    __gt__, __ge__ = _bin("gt", np.greater, compare=True), _bin("ge", np.greater_equal, compare=True)
    del _bin

    def __neg__(self):
        return op("neg", np.negative, self)


def _value(x, *, numeric):
    """A Sym's or a constant's value; TypeError for what a graph op would reject."""
    if isinstance(x, Sym):
        v = x.value
    elif isinstance(x, (bool, np.bool_)):
        v = np.asarray(bool(x))
    elif isinstance(x, numbers.Real):
        v = np.asarray(float(x))
    else:
        raise NotCompilable(f"a graph op got {x!r} ({type(x).__name__}); only numbers and readings fit")
    if numeric and v.dtype == bool:
        raise NotCompilable("arithmetic on a bool: in the graph, conditions do not mix with numbers; "
                            "use ctx.math.where")
    return v


def op(name, fn, *args, numeric=True, log=None):
    """Applies fn to the values of args (Syms or constants) and records the operation."""
    if log is None:
        log = next(a.log for a in args if isinstance(a, Sym))
    with np.errstate(all="ignore"):
        value = fn(*(_value(a, numeric=numeric) for a in args))
    log.append(name)
    return Sym(value, log)


def _cond(x):
    v = _value(x, numeric=False)
    if v.dtype != bool:
        raise NotCompilable(f"a condition must be a bool, got a number {x!r}; compare it (x > 0)")
    return v


class SymMath:
    """ctx.math on Syms, bound to the run's operation log."""

    def __init__(self, log):
        self.log = log

    def _op(self, name, fn, *args, numeric=True):
        return op(name, fn, *args, numeric=numeric, log=self.log)

    def where(self, cond, a, b):
        c = _cond(cond)
        return self._op("where", lambda x, y: np.where(c, x, y), a, b)

    def minimum(self, a, b):
        return self._op("minimum", np.minimum, a, b)

    def maximum(self, a, b):
        return self._op("maximum", np.maximum, a, b)

    def clip(self, x, lo, hi):
        return self.minimum(self.maximum(x, lo), hi)  # as PyMath and the graph's TfMath: hi wins if lo > hi

    def sqrt(self, x):
        return self._op("sqrt", np.sqrt, x)

    def floor(self, x):
        return self._op("floor", np.floor, x)

    def round(self, x):
        return self._op("round", lambda v: np.floor(v + 0.5), x)

    def log2(self, x):
        return self._op("log2", np.log2, x)

    def exp2(self, x):
        return self._op("exp2", np.exp2, x)

    def abs(self, x):
        return self._op("abs", np.abs, x)

    def all(self, *conds):
        vs = [_cond(c) for c in conds]
        return Sym(np.logical_and.reduce(vs) if vs else np.asarray(True), self._logged("all"))

    def any(self, *conds):
        vs = [_cond(c) for c in conds]
        return Sym(np.logical_or.reduce(vs) if vs else np.asarray(False), self._logged("any"))

    def not_(self, cond):
        return Sym(np.logical_not(_cond(cond)), self._logged("not"))

    def isfinite(self, x):
        return self._op("isfinite", np.isfinite, x)

    def _logged(self, name):
        self.log.append(name)
        return self.log


class SymState:
    """ctx.state on Syms: the graph's variables. update() assigns where(when, new, old) at once."""

    def __init__(self, store, math):
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "_math", math)

    def __getattr__(self, name):
        try:
            return self._store[name]
        except KeyError:
            raise AttributeError(f"policy state has no {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError("write policy state with state.update(when=..., name=value)")

    def update(self, when=True, **values):
        unknown = set(values) - set(self._store)
        if unknown:
            raise AttributeError(f"policy state has no {', '.join(sorted(unknown))}")
        for name, value in values.items():
            self._store[name] = self._math.where(when, value, self._store[name])


class SymContext:
    """The graph context's after_step view: every reading a float64 Sym, every metric present (0 when
    not estimated), actions that record (when, value) and update the readings as where(when, new, old)."""

    def __init__(self, run, *, step, batch_size, learning_rate, strategy, cluster_size, metrics, epoch=0):
        self.math = SymMath(run.log)
        self._run = run
        sym = lambda v: Sym(float(v), run.log)  # noqa: E731 (a reading)
        self.step, self.epoch = sym(step), sym(epoch)
        self.samples_seen = sym(0)
        self.batch_size, self.cluster_size = sym(batch_size), sym(cluster_size)
        self.local_batch_size = self.batch_size / self.cluster_size
        self.learning_rate = sym(learning_rate)
        self.strategy = sym(STRATEGIES.index(strategy))
        self.metrics = {k: sym(0.0 if metrics.get(k) is None else metrics[k]) for k in METRICS}
        self.actions = []  # (field, when, value) in the order taken

    def is_strategy(self, name):
        return self.math.abs(self.strategy - STRATEGIES.index(name)) < 0.5

    def _act(self, field, value, when):
        _cond(when)
        self.actions.append((field, when, value))

    def set_batch_size(self, n, when=True):
        self._act("batch_size", n, when)
        self.batch_size = self.math.where(when, n, self.batch_size)
        self.local_batch_size = self.batch_size / self.cluster_size

    def set_learning_rate(self, lr, when=True):
        self._act("learning_rate", lr, when)
        self.learning_rate = self.math.where(when, lr, self.learning_rate)

    def set_strategy(self, name, when=True):
        if name not in STRATEGIES:
            raise NotCompilable(f"set_strategy takes a constant strategy name in the graph, got {name!r}")
        self._act("strategy", name, when)
        self.strategy = self.math.where(when, STRATEGIES.index(name), self.strategy)

    def stop(self, when=True):
        self._act("stop", True, when)

    def state(self, policy, **initial):
        store = self._run.variables.setdefault(id(policy), {})
        for name, value in initial.items():
            if name not in store:
                if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                    raise NotCompilable(f"state {name}={value!r}: graph state is float64 variables; "
                                        "start it with a number")
                store[name] = Sym(float(value), self._run.log)
        return SymState(store, self.math)

    def changes(self):
        """What the actions decided, as Context.changes would hold it."""
        out = {}
        for field, when, value in self.actions:
            if not _cond(when):
                continue
            if field == "batch_size":
                out[field] = int(_value(value, numeric=True))
            elif field == "learning_rate":
                out[field] = float(_value(value, numeric=True))
            else:
                out[field] = value  # a strategy name, or True for stop
        return out


class SymRun:
    """Calls compilable policies' after_step on SymContexts, keeping their state as graph variables,
    and checks that every call performs the same operations (a graph is traced once)."""

    def __init__(self, policies):
        self.policies = list(policies)
        for p in self.policies:
            assert p.compilable, f"{p!r} is not compilable"
        self.variables = {}
        self.log = []
        self.traces = {}  # policy index -> the operations of its first call

    def after_step(self, **readings):
        ctx = SymContext(self, **readings)
        step = readings["step"]
        for i, p in enumerate(self.policies):
            if step % p.interval:
                continue
            self.log.clear()
            p.after_step(ctx)
            trace = self.traces.setdefault(i, list(self.log))
            if trace != self.log:
                raise NotCompilable(f"{p!r} performed different operations at step {step} than at its first "
                                    "call: its code branches on something other than its configuration")
        return ctx.changes()
