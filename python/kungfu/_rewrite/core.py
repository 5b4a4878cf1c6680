"""kungfu.rewrite: make a training step distributed by editing its traced graph.

A rewrite is made per concrete function: the traced graph bakes in shape-specific constants. The
callable rewrite() returns is a tf.function of the step's signature; each of its traces takes the
original's concrete function for the same arguments, finds its gradients (find.py) and rebuilds it
with the strategy's passes in between (rebind.py). So TensorFlow's own per-signature cache holds the
rewrites. There is one such tf.function per cluster size, since a pass may bake size() in (the S-SGD
pass does, for sparse gradients).
"""

import dataclasses
import functools
import threading

import tensorflow as tf

from .. import _lib
from .. import monitor as _monitor
from ..ops import _compression
from . import _conventions
from . import find
from . import passes as passes_lib
from . import rebind
from .monitors import MonitoredSSGD
from .ssgd import ssgd

STRATEGIES = {"ssgd": (ssgd,)}  # strategy -> its passes, applied in order


def rewrite(fn, strategy="ssgd", *, fusion_bytes=None, compression=None, monitors=None, monitor_interval=1,
            local_batch_size=None, monitor_alpha=_monitor.DEFAULT_ALPHA, policies=None, optimizer=None, dataset=None,
            batch_size=None):
    """Returns fn with KungFu collectives inserted on its gradients; fn's code does not change.

    fn: a training step (a tf.function, or a Python function, which is wrapped in one) that computes
    gradients with tf.GradientTape and applies them with an optimizer, e.g.
    opt.apply_gradients(zip(grads, model.trainable_variables)).
    strategy: "ssgd" (synchronous SGD): every gradient becomes its mean over the workers.
    fusion_bytes: dense gradients are all-reduced in buckets of about this many bytes, in backward-pass
    order, so that collectives overlap with the backward pass (default 4 MiB; 0: one per gradient).
    compression: None or "fp16", which sends dense float32/float64 gradients as float16 (half the bytes;
    see kungfu/ops/_compression.py).
    monitors: None or a list from "gns", "variance", "snr", computed every monitor_interval calls as
    the optimizer wrappers compute them; read them with kungfu.monitor.latest(step) (or the step's
    name). local_batch_size: this worker's batch size (a number or a tf.Variable), needed for "gns"
    and "snr", and for samples_per_sec. monitor_alpha: the EMA weight of a new noise-scale estimate, in
    (0, 1]. See docs/monitoring.md.
    policies: None or a list of compilable kungfu.policies (the built-in ones), compiled into the step:
    after the step's update, each one's after_step runs as ops under a tf.cond every policy.interval
    calls, reading the monitors and assigning the controls: the learning rate of optimizer=, the batch
    size of dataset= (a kungfu.data.AdaptiveDataset); batch_size= is the global batch size to read when
    there is no dataset. The policies' before_train hooks (a schedule's entry 0) run here, as Python
    hooks, if kungfu.init() has run (else at the step's first call, after the loop has pulled its first
    batch). Step.policy_stopped tells whether a policy asked to stop. See docs/policies.md.

    The returned callable takes fn's arguments. Each new input signature is rewritten once, at its first
    call (which needs kungfu.init()); a step whose gradients cannot be matched one to one with the
    trainable variables it updates raises ValueError then. See docs/rewrite.md.
    """
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"kungfu.rewrite: strategy must be one of {', '.join(sorted(STRATEGIES))}; got {strategy!r}")
    if fusion_bytes is not None and (isinstance(fusion_bytes, bool) or not isinstance(fusion_bytes, int)
                                     or fusion_bytes < 0):
        raise ValueError(f"kungfu.rewrite: fusion_bytes must be an int >= 0, got {fusion_bytes!r}")
    if not callable(fn):
        raise TypeError(f"kungfu.rewrite: fn must be a tf.function or a Python function, got {type(fn).__name__}")
    if isinstance(fn, Rewritten):
        raise TypeError("kungfu.rewrite: fn is a rewritten step already (its gradients are averaged): call it "
                        "as it is, or rewrite the original step with all the options at once")
    try:
        names, monitor_interval = _monitor.check_arguments(monitors, monitor_interval, local_batch_size,
                                                           monitor_alpha)
    except ValueError as e:
        raise ValueError(f"kungfu.rewrite: {e}") from None
    options = {"fusion_bytes": fusion_bytes,
               "compression": _compression.check(compression, "kungfu.rewrite")}
    passes = STRATEGIES[strategy]
    if monitors is not None:
        options.update(monitors=names, monitor_interval=monitor_interval, local_batch_size=local_batch_size)
        name = getattr(fn, "__name__", None) or "step"
        passes = tuple(MonitoredSSGD(names, monitor_interval, local_batch_size, name, monitor_alpha) if p is ssgd else p
                       for p in passes)
    compiled = None
    if policies is not None:
        from .._policy.controls import Controls
        from .._policy.graph import CompiledPolicies

        name = getattr(fn, "__name__", None) or "step"
        step_monitors = next((p.monitors for p in passes if isinstance(p, MonitoredSSGD)), None)
        controls = Controls("kungfu.rewrite", optimizer=optimizer, dataset=dataset, monitors=step_monitors,
                            batch_size=batch_size)
        compiled = CompiledPolicies(policies, controls, name)
        if _lib.initialized():
            compiled.start()  # before_train hooks now, before the loop pulls its first batch
    elif optimizer is not None or dataset is not None or batch_size is not None:
        raise ValueError("kungfu.rewrite: optimizer=, dataset= and batch_size= are for policies=[...]")
    return Rewritten(fn, passes, options, compiled)


@dataclasses.dataclass(frozen=True)
class Report:
    """What one rewrite found and inserted."""

    gradients: tuple  # (variable name, "dense" or "sparse"), in backward-pass order
    inserted: tuple  # passes.Inserted: the collectives, with their keys and variables

    def __str__(self):
        sparse = sum(k == "sparse" for _, k in self.gradients)
        lines = [f"{_count(len(self.gradients), 'gradient')} ({sparse} sparse), "
                 f"{_count(len(self.inserted), 'collective')} inserted:"]
        lines += [f"  {c.op} '{c.key}': {', '.join(c.variables)}" for c in self.inserted]
        return "\n".join(lines)


def _count(n, noun):
    return f"{n} {noun}" + ("" if n == 1 else "s")


class Rewritten:
    """The callable kungfu.rewrite returns: fn's signature, fn's results, fn's variables, distributed.

    It is a tf.function of fn's signature whose every trace rewrites fn's concrete function for the
    same arguments, so TensorFlow's own per-signature dispatch picks the rewrite and a call costs what
    a call of fn costs. One such tf.function per cluster size.
    """

    def __init__(self, fn, passes, options, policies=None):
        if not isinstance(fn, tf.types.experimental.PolymorphicFunction):
            fn = tf.function(fn)
        self._fn = fn
        self._passes = tuple(passes)
        self._options = dict(options)
        self._policies = policies  # graph.CompiledPolicies, or None
        self._called = False  # whether the step has been called (policies' start checked)
        self._name = getattr(fn, "__name__", None) or "step"
        self._lock = threading.Lock()
        self._functions = {}  # kungfu.size() -> the rewritten tf.function
        self._reports = {}  # (size, the rewritten trace's input signature) -> Report: one per rewrite
        functools.update_wrapper(self, fn.python_function, updated=())

    def __call__(self, *args, **kwargs):
        if self._policies is not None and not self._called:
            if not self._policies.started:
                self._policies.start()  # the policies' before_train hooks, in Python, once
            else:  # started by rewrite(): a checkpoint restored since then moves the start
                self._policies.restart_if_restored()
            self._called = True
        return self._function()(*args, **kwargs)

    def get_concrete_function(self, *args, **kwargs):
        """The rewritten ConcreteFunction for these arguments (rewriting it if new)."""
        return self._function().get_concrete_function(*args, **kwargs)

    def report(self, *args, **kwargs):
        """The Report of the rewrite for these arguments (rewriting it if new)."""
        return self._reports[_trace_key(_lib.size(), self.get_concrete_function(*args, **kwargs).graph)]

    @property
    def monitors(self):
        """The kungfu.monitor.Monitors of this step (rewrite(..., monitors=[...])), or None."""
        return next((p.monitors for p in self._passes if isinstance(p, MonitoredSSGD)), None)

    @property
    def policy_stopped(self):
        """Whether a compiled policy called ctx.stop() (False without policies)."""
        return self._policies is not None and bool(self._policies.stop_flag.numpy())

    @property
    def policy_step(self):
        """How many steps the compiled policies have counted (0 without policies)."""
        return 0 if self._policies is None else int(self._policies.step.numpy())

    @property
    def rewrite_count(self):
        """How many rewrites the step has made so far: one per input signature the rewritten tf.function
        traced, per cluster size. The rewritten step keeps the original's reduce_retracing: with True, a
        second batch size is traced once more with a None dimension, and then no more."""
        return len(self._reports)

    def _function(self):
        _lib.require_init(f"kungfu.rewrite({self._name})")
        size = _lib.size()
        with self._lock:
            if size not in self._functions:
                body = functools.update_wrapper(functools.partial(self._body, size), self._fn.python_function)
                self._functions[size] = tf.function(body, autograph=False, input_signature=self._fn.input_signature,
                                                    reduce_retracing=_conventions.reduce_retracing(self._fn))
            return self._functions[size]

    def _body(self, size, *args, **kwargs):
        arguments = _conventions.traced_arguments()  # before anything is captured
        cf = self._fn.get_concrete_function(*args, **kwargs)  # the original, for the same arguments
        what = f"kungfu.rewrite({self._name})"
        sites = find.find_gradients(cf, what)
        ctx = passes_lib.PassContext(function=self._name, size=size, options=self._options)
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations())
        outputs = rebind.rebuild(rebind.plan(cf, sites, what), arguments, self._passes, ctx)
        if self._policies is not None:  # after everything the step does, its update included
            self._policies.build(graph.get_operations()[first_op:])
        report = Report(gradients=tuple((s.name, "sparse" if s.indices else "dense") for s in sites),
                        inserted=tuple(ctx.inserted))
        with self._lock:
            # Keyed by signature: TensorFlow traces a signature again, to the same graph, when its
            # first trace created a variable (a collective's ordering token, a policy's state).
            self._reports[_trace_key(size, graph)] = report
        return outputs


def _trace_key(size, graph):
    """Which rewrite a traced FuncGraph is: the cluster size and the input signature it was traced for
    (set before the body runs)."""
    return size, repr(graph.structured_input_signature)
