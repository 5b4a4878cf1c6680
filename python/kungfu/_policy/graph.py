"""Policies compiled into the training step: the graph context, and the ops that run them.

    step = kungfu.rewrite(train_step, monitors=["gns"], local_batch_size=ds.local_batch_size_variable,
                          policies=[kungfu.policies.gns_batch_size(64, 1024)], optimizer=opt, dataset=ds)

The optimizer wrappers compile them the same way into their apply():
kungfu.optimizers.SynchronousSGDOptimizer(opt, ..., policies=[...], dataset=ds), for model.fit.

CompiledPolicies.build() runs while the step is traced, after everything the step does (the update
included): it counts the step, and for each policy traces its after_step once, with a GraphContext,
inside a tf.cond that is true every `interval` steps. The policy's own code is what runs as a Python
hook (policies/base.py "Compiled policies"): GraphContext has the Context's readings as float64 tensors
read at that point, TfMath for ctx.math, actions that assign the control variables (controls.py) with
tf.where(when, new, current), and State kept in tf.Variables. So monitor -> decision -> control is ops
in the step, with no Python between steps, and the decisions match the Python hook's.

Agreement: step, batch size, learning rate, strategy and the monitors' gns/grad_variance/snr are the
same on every worker; step_time and samples_per_sec are all-reduced (mean) when a policy reads them,
as the Python runners do. A compiled policy cannot read the loss (the step's outputs are the user's).
"""

import collections
import math
import threading

import tensorflow as tf

from .. import _lib
from ..errors import PolicyError
from ..policies import base
from ..policies.context import GRAPH_STATE_ATTR
from ..policies.context import STRATEGIES
from ..policies.context import strategy_name
from .controls import is_distributed

F = tf.float64

# How many CompiledPolicies each label (a rewritten step's function name, or "optimizer") has had in
# this process: the count orders them the same way on every worker running the same program.
_instances = collections.Counter()
_lock = threading.Lock()


def _read(var):
    """A control variable's value now (a tf.Variable, or a Keras variable such as the learning rate)."""
    return tf.convert_to_tensor(var)


def _num(x):
    if isinstance(x, bool) or (isinstance(x, tf.Tensor) and x.dtype == tf.bool):
        return tf.convert_to_tensor(x)
    return tf.cast(x, F)


class TfMath:
    """ctx.math on tensors: the functions of policies.context.PyMath, with the same results."""

    @staticmethod
    def where(cond, a, b):
        return tf.where(tf.cast(cond, tf.bool), _num(a), _num(b))

    @staticmethod
    def minimum(*xs):
        out = _num(xs[0])
        for x in xs[1:]:
            out = tf.minimum(out, _num(x))
        return out

    @staticmethod
    def maximum(*xs):
        out = _num(xs[0])
        for x in xs[1:]:
            out = tf.maximum(out, _num(x))
        return out

    @staticmethod
    def clip(x, lo, hi):
        return tf.minimum(tf.maximum(_num(x), _num(lo)), _num(hi))

    sqrt = staticmethod(lambda x: tf.sqrt(_num(x)))
    floor = staticmethod(lambda x: tf.floor(_num(x)))
    round = staticmethod(lambda x: tf.floor(_num(x) + 0.5))
    abs = staticmethod(lambda x: tf.abs(_num(x)))
    exp2 = staticmethod(lambda x: tf.pow(tf.constant(2.0, F), _num(x)))
    not_ = staticmethod(lambda c: tf.logical_not(tf.cast(c, tf.bool)))
    isfinite = staticmethod(lambda x: tf.math.is_finite(_num(x)))

    @staticmethod
    def log2(x):
        v = tf.math.log(_num(x)) / math.log(2.0)
        r = tf.floor(v + 0.5)
        return tf.where(tf.abs(v - r) < 1e-9, r, v)  # exact at powers of two, as math.log2 is

    @staticmethod
    def all(*conds):
        return tf.reduce_all(tf.stack([tf.cast(c, tf.bool) for c in conds]))

    @staticmethod
    def any(*conds):
        return tf.reduce_any(tf.stack([tf.cast(c, tf.bool) for c in conds]))


class GraphState:
    """policies.context.State backed by tf.Variables (float64, or bool for bool initial values)."""

    def __init__(self, variables):
        object.__setattr__(self, "_vars", variables)

    def __getattr__(self, name):
        try:
            return self._vars[name].read_value()
        except KeyError:
            raise AttributeError(f"policy state has no {name!r}; declare it in ctx.state(policy, {name}=...)") from None

    def __setattr__(self, name, value):
        raise AttributeError("write policy state with state.update(when=..., name=value)")

    def update(self, when=True, **values):
        unknown = set(values) - set(self._vars)
        if unknown:
            raise AttributeError(f"policy state has no {', '.join(sorted(unknown))}; declare it in ctx.state(...)")
        for name, value in values.items():
            var = self._vars[name]
            var.assign(tf.where(tf.cast(when, tf.bool), tf.cast(value, var.dtype), var.read_value()))


_MONITORED = frozenset({"gns", "grad_variance", "snr"})


class _Metrics(dict):
    """ctx.metrics in the graph: the monitors' values, and the mean step time / throughput on demand."""

    def __init__(self, values, local, key):
        """values: name -> tensor; local: name -> a function reading this worker's value, all-reduced when
        a policy first asks for it."""
        super().__init__(values)
        self._local, self._key = local, key

    def __missing__(self, name):
        if name in self._local:
            from ..ops import all_reduce

            v = tf.cast(self._local[name](), F)
            self[name] = v if _lib.size() == 1 else all_reduce(v, op="mean", name=f"{self._key}/{name}")
            return self[name]
        has = ", ".join(sorted(set(self) | set(self._local))) or "nothing"
        fix = ("turn its monitor on (monitor=[...])" if name in _MONITORED else
               "the step's loss and logs are not in the graph (its outputs are yours)")
        raise KeyError(f"{name!r} is not available to a policy compiled into the graph (it has: {has}); {fix}, "
                       "or run the policy as a Python hook (PolicyRunner, PolicyCallback)")

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default


class _Strategy:
    """ctx.strategy in the graph: the strategy's index in STRATEGIES (.index, a float64 tensor), which
    compares with a name as the Python reading does (ctx.strategy == "sma" is a bool tensor) and converts
    to that index where a tensor is expected."""

    __hash__ = None

    def __init__(self, index):
        self.index = index

    def __eq__(self, other):
        if other is None or (isinstance(other, str) and other not in STRATEGIES):
            return tf.constant(False)  # as "sma" == None or == "bogus" is in Python
        return tf.equal(self.index, _strategy_index(other))

    def __ne__(self, other):
        return tf.logical_not(self == other)

    def __repr__(self):
        return f"<strategy index {self.index!r}>"


def _strategy_index(strategy):
    if isinstance(strategy, _Strategy):
        return strategy.index
    if isinstance(strategy, str):
        return tf.constant(float(STRATEGIES.index(strategy_name(strategy))), F)
    return tf.cast(strategy, F)


tf.register_tensor_conversion_function(_Strategy, lambda value, dtype=None, name=None, as_ref=False: (
    tf.cast(value.index, dtype) if dtype is not None else value.index))


class GraphContext:
    """The Context of a compiled policy's after_step: readings are tensors, actions assign variables."""

    math = TfMath

    def __init__(self, compiled, step, key):
        c = compiled.controls
        self._compiled, self._controls = compiled, c
        self.hook = "after_step"
        self.resumed = False  # read by before-step hooks only, which run as Python hooks
        self.step = tf.cast(step, F)
        self.cluster_size = _lib.size()
        self.batch_size = self._batch()
        self.local_batch_size = None if self.batch_size is None else self.batch_size / self.cluster_size
        self.learning_rate = (tf.cast(_read(c.learning_rate_variable()), F)
                              if c.optimizer is not None and _lr_settable(c) else None)
        self.strategy = (_Strategy(tf.cast(c.optimizer.strategy_variable.read_value(), F))
                         if c.optimizer is not None and is_distributed(c.optimizer) else None)
        m = c.monitors
        values, local = {}, {}
        if m is not None:
            for k, on in (("gns", "gns"), ("grad_variance", "variance"), ("snr", "snr")):
                if on in m.names:
                    values[k] = tf.cast(m.read(k), F)
            local["step_time"] = lambda: m.read("step_time")
            if m.has_batch:
                local["samples_per_sec"] = lambda: m.read("samples_per_sec")
        self.metrics = _Metrics(values, local, key)

    def _batch(self):
        c = self._controls
        if c.dataset is not None:
            return tf.cast(c.dataset.batch_size_variable.read_value(), F)
        return None if c.fixed_batch_size is None else tf.constant(float(c.fixed_batch_size), F)

    @property
    def epoch(self):
        ds = self._controls.dataset
        if ds is None:
            raise PolicyError("ctx.epoch is not known to a policy compiled into the graph without dataset=")
        # The dataset counts epochs started (1 in the first); ctx.epoch is the epoch's index, from 0.
        return tf.cast(tf.maximum(ds.epoch_variable.read_value() - 1, 0), F)

    @property
    def samples_seen(self):
        ds = self._controls.dataset
        if ds is not None:
            return tf.cast(ds.samples_seen_variable.read_value(), F)
        return None if self.batch_size is None else self.step * self.batch_size

    def is_strategy(self, name):
        if self.strategy is None:  # unknown, as in the Python Context
            strategy_name(name)
            return tf.constant(False)
        return self.strategy == strategy_name(name)

    def set_batch_size(self, n, when=True):
        var = self._controls.batch_size_target().batch_size_variable
        when, n = tf.cast(when, tf.bool), _num(n)
        ok = tf.logical_or(tf.logical_not(when), tf.logical_and(n >= 1, tf.equal(tf.floor(n), n)))
        with tf.control_dependencies([tf.debugging.Assert(ok, ["set_batch_size: not a whole number >= 1:", n])]):
            new = tf.where(when, n, tf.cast(_read(var), F))
        var.assign(tf.cast(new, var.dtype))
        self.batch_size, self.local_batch_size = new, new / self.cluster_size

    def set_learning_rate(self, lr, when=True):
        var = self._controls.learning_rate_variable()
        when, lr = tf.cast(when, tf.bool), _num(lr)
        ok = tf.logical_or(tf.logical_not(when), tf.logical_and(tf.math.is_finite(lr), lr > 0))
        with tf.control_dependencies([tf.debugging.Assert(ok, ["set_learning_rate: not a finite number > 0:", lr])]):
            new = tf.where(when, lr, tf.cast(_read(var), F))
        var.assign(tf.cast(new, var.dtype))
        self.learning_rate = new

    def set_strategy(self, strategy, when=True):
        var = self._controls.strategy_target().strategy_variable
        new = tf.where(tf.cast(when, tf.bool), _strategy_index(strategy), tf.cast(_read(var), F))
        var.assign(tf.cast(new, var.dtype))
        self.strategy = _Strategy(new)

    def stop(self, when=True):
        flag = self._compiled.stop_flag
        flag.assign(tf.logical_or(flag.read_value(), tf.cast(when, tf.bool)))

    def state(self, policy, **initial):
        return GraphState(self._compiled.state_variables(policy, initial))


def _lr_settable(controls):
    try:
        controls.learning_rate_variable()
        return True
    except PolicyError:
        return False


def _naming_the_policy(error, policy):
    """error (a KeyError or TypeError from a compiled policy's trace), of the same type, naming the policy;
    None when that type cannot be made from a message."""
    said = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    if isinstance(error, tf.errors.OperatorNotAllowedInGraphError):
        said += (" -- a compiled policy's after_step must be branch-free: no Python if, while or bool() on a "
                 "reading; use when= on the actions and ctx.math (docs/policies.md), or set compilable = False "
                 "and run it as a Python hook")
    try:
        return type(error)(f"policy {policy.name}, compiled into the graph: {said}")
    except TypeError:  # an exception class with another constructor: keep it as it is
        return None


class CompiledPolicies:
    """The policies of one kungfu.rewrite call (or one DistributedOptimizer), compiled into its step;
    shared by all its traces. label: names their collectives together with a per-label count (so
    two steps named alike, or optimizers Keras named "sgd" on one worker and "sgd_1" on another,
    still meet their own counterparts); who: the caller, for messages."""

    def __init__(self, policies, controls, label, who="kungfu.rewrite"):
        self.policies = base.check_policies(policies, who)
        for p in self.policies:
            if not p.compilable:
                why = getattr(p, "not_compilable_because", "its compilable is False")
                raise ValueError(f"{who}: policy {p.name} is not compilable into the graph ({why}); run it as "
                                 "a Python hook with kungfu.PolicyRunner or kungfu.keras.PolicyCallback")
        self.controls = controls
        with _lock:
            self.name = f"{label}/{_instances[label]}"
            _instances[label] += 1
        with tf.init_scope(), tf.device("CPU:0"):
            self.step = tf.Variable(0, trainable=False, dtype=tf.int64, name="kungfu_policy_step")
            self.stop_flag = tf.Variable(False, trainable=False, name="kungfu_policy_stop")
        self._state = {}  # (policy index, name) -> tf.Variable
        self.started = False  # whether start() ran the before_train hooks
        self.start_step = 0  # where start() began counting (the optimizer's iterations then)

    def start(self):
        """Runs the policies' before_train hooks once, as Python hooks (a schedule's entry 0, say): the
        step's graph has no "before training"; kungfu.rewrite's step calls this at its first call. The step
        count starts where the Python runner's does: at the optimizer's iterations (a resumed run)."""
        from .runner import PolicyRunner

        self.started = True
        c = self.controls
        runner = PolicyRunner(self.policies, optimizer=c.optimizer, dataset=c.dataset, monitors=c.monitors,
                              batch_size=c.fixed_batch_size, name=f"{self.name}/start")
        runner.before_train()
        self.step.assign(runner.step)
        self.start_step = runner.step

    def restart_if_restored(self):
        """kungfu.rewrite's step at its first call, when start() ran at rewrite() (before the loop pulls its
        first batch): a checkpoint restored since then moved the optimizer's step count, so start again
        from it (its catch-up lands from the next batch). One broadcast, on every worker."""
        from . import agree

        c = self.controls
        if c.optimizer is not None and agree.start_step(c.optimizer, f"kungfu/policy/{self.name}/first") \
                != self.start_step:
            self.start()

    def state_variables(self, policy, initial):
        i = next(j for j, p in enumerate(self.policies) if p is policy)
        out = {}
        for name, value in initial.items():
            if (i, name) not in self._state:
                with tf.init_scope(), tf.device("CPU:0"):
                    dtype = tf.bool if isinstance(value, bool) else F
                    self._state[(i, name)] = tf.Variable(value, trainable=False, dtype=dtype,
                                                         name=f"kungfu_policy_state_{name}")
            out[name] = self._state[(i, name)]
        # for logs read outside the step (policies.context.state_values, describe_last())
        policy.__dict__.setdefault(GRAPH_STATE_ATTR, {}).update(out)
        return out

    def build(self, after):
        """The policies' ops, run after the ops in after (the step's own); returns the last op."""
        with tf.control_dependencies(after):
            step = self.step.assign_add(1)
        done = step
        for i, p in enumerate(self.policies):
            key = f"kungfu/policy/{self.name}/{i}"

            def run(p=p, key=key):
                try:
                    p.after_step(GraphContext(self, step, key))
                except (KeyError, TypeError) as e:  # TypeError: OperatorNotAllowedInGraphError (an `if`) too
                    named = _naming_the_policy(e, p)
                    if named is None:
                        raise
                    raise named from e
                return tf.constant(True)

            with tf.control_dependencies([done]):
                done = tf.cond(tf.equal(step % p.interval, 0), run, lambda: tf.constant(False))
        return done
