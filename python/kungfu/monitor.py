"""kungfu.monitor: the training monitors of the distributed optimizers, and their latest values.

    opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1), monitor=["gns", "variance"],
                                                    monitor_interval=8, local_batch_size=32)
    ... train ...
    kungfu.monitor.latest()
    # {"gns": ..., "grad_variance": ..., "snr": None, "samples_per_sec": ..., "step_time": ...}

How it works. A wrapped optimizer with monitors owns a Monitors object: non-trainable tf.Variables
(not tracked by Keras or checkpoints) that the training step's graph assigns. In the S-SGD branch,
every k-th step (iterations % k == 0, a tf.cond, so k costs no retrace), the gradients' own all-reduce
(KfGroupAllReduceNorms) also gives the workers' mean squared gradient norm and the squared norm of the
mean gradient, summed as it copies the gradients (no extra collective, no pass of their own; with a
sparse gradient, this worker's norm rides in the last bucket instead); the mean of the workers' squared
norms stands for |G_small|^2 in the gradient noise scale: every input is then all-reduced, so every
worker computes the same numbers. One KfMonitorRecord op turns them into the estimates. Throughput
(step_time, samples_per_sec) is measured in the graph at every step by a KfStepClock op, and is this
worker's own. See docs/monitoring.md ("Using monitors"). kungfu.rewrite(fn, monitors=[...]) uses the
same Monitors from its monitor pass (kungfu/_rewrite/monitors.py), counting the step's calls instead of
iterations.

One worker has no second batch size: update_one_worker() pairs this step's gradients with the previous
step's (a copy kept in variables, made on the step before each due step), the pair standing for the big
batch. The estimate is biased (docs/monitoring.md, "One worker").

Cost: see docs/monitoring.md ("Cost"); with monitor_interval=1 no tf.cond is built for the interval.
collective_stats() reads the engine's per-collective counters (bytes, calls, latency).

Threading: the registry of monitors is guarded by a lock; a Monitors object is written by the
training step's ops and read by latest(), which reads whole variables (each value is consistent, the
set of values may straddle a step).
"""

import itertools
import numbers
import threading
import weakref

import tensorflow as tf

from . import _lib
from .ops import monitor as _ops

__all__ = ["Monitors", "latest", "update_count", "collective_stats", "MONITORS", "KEYS"]

MONITORS = ("gns", "variance", "snr")
KEYS = ("gns", "grad_variance", "snr", "samples_per_sec", "step_time")
DEFAULT_ALPHA = 0.1  # the EMA weight of a new GNS estimate (monitor_alpha=)
_NONE = -2  # _Previous.step before any copy: never equal to a step - 1
_registry = []  # weakref.ref to Monitors, in creation order
_lock = threading.Lock()
_ids = itertools.count()


def _check_batch(n):
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not n > 0:
        raise ValueError(f"local_batch_size must be a number > 0 (this worker's batch size), got {n!r}")
    return float(n)


def check_alpha(alpha):
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha <= 1:
        raise ValueError(f"monitor_alpha must be a number in (0, 1] (the EMA weight of a new estimate), got {alpha!r}")
    return float(alpha)


def _check_names(monitor):
    """monitor= as a tuple of names: None (no monitors), one name, or a list, tuple or set of names."""
    if monitor is None:
        return ()
    if isinstance(monitor, str):
        names = (monitor,)
    elif isinstance(monitor, (list, tuple, set, frozenset)):
        names = tuple(monitor)
    else:  # a dict would give its keys, a number nothing at all: refuse both rather than guess
        raise ValueError(f"the monitors must be given as None, a name, or a list or tuple of names from "
                         f"{', '.join(MONITORS)} (e.g. [\"gns\", \"variance\"]); got {type(monitor).__name__} "
                         f"{monitor!r}")
    bad = [m for m in names if m not in MONITORS]
    if bad:
        raise ValueError(f"unknown monitor(s) {', '.join(map(repr, bad))}; choose from {', '.join(MONITORS)}")
    return names


def check_arguments(monitor, interval, local_batch_size, alpha=DEFAULT_ALPHA):
    """Validates the wrapper's monitor arguments; returns (names, interval as an int). Raises ValueError,
    whatever the mistake (a wrong type included), naming what is accepted."""
    check_alpha(alpha)
    names = _check_names(monitor)
    if isinstance(interval, bool) or not isinstance(interval, numbers.Integral) or interval < 1:
        raise ValueError(f"monitor_interval must be an int >= 1 (a Python or numpy integer: run the monitors "
                         f"every k steps), got {interval!r}")
    if local_batch_size is None:
        if {"gns", "snr"} & set(names):
            raise ValueError("the 'gns' and 'snr' monitors need local_batch_size= (this worker's batch size, "
                             "a number or a tf.Variable)")
    elif not isinstance(local_batch_size, tf.Variable):
        _check_batch(local_batch_size)
    return names, int(interval)


def when(cond, fn):
    """fn() when cond is the Python True (no tf.cond to build), else tf.cond(cond, fn, False)."""
    if cond is True:
        return fn()
    return tf.cond(cond, fn, lambda: tf.constant(False))


def _dense(g, variable):
    """g as a dense tensor of variable's shape (an IndexedSlices' rows summed into place)."""
    if isinstance(g, tf.IndexedSlices):
        rows = variable.shape[0] if variable.shape[0] is not None else tf.shape(variable)[0]
        return tf.math.unsorted_segment_sum(g.values, g.indices, rows)
    return tf.convert_to_tensor(g)


class _Previous:
    """One worker's copy of the gradients of a step, for the consecutive-step estimate of the next."""

    def __init__(self):
        with tf.init_scope(), tf.device("CPU:0"):
            self.step = tf.Variable(_NONE, trainable=False, dtype=tf.int64, name="kungfu_monitor_prev_step")
            self.batch = tf.Variable(0.0, trainable=False, dtype=tf.float32, name="kungfu_monitor_prev_batch")
            self.scale = tf.Variable(0.0, trainable=False, dtype=tf.float32, name="kungfu_monitor_prev_scale")
        # (id(variable), dtype) -> (variable, the tf.Variable holding its gradient); the variable is kept
        # so that its id stays its own.
        self._slots = {}

    def slot(self, variable, dtype):
        key = (id(variable), dtype)
        if key not in self._slots:
            with tf.init_scope(), tf.device("CPU:0"):
                self._slots[key] = (variable, tf.Variable(tf.zeros(variable.shape, dtype), trainable=False,
                                                          name="kungfu_monitor_prev_grad"))
        return self._slots[key][1]


class Monitors:
    """The monitor state of one wrapped optimizer: its variables and the graph code that assigns them."""

    def __init__(self, names, interval, local_batch_size, name, alpha=DEFAULT_ALPHA):
        self.names = frozenset(names)  # requested: a subset of MONITORS
        self.interval = interval  # k: the monitors run when iterations % k == 0
        self.name = name  # the optimizer's name, for latest(name)
        self.alpha = check_alpha(alpha)  # EMA weight of a new GNS estimate
        self.key = f"kungfu/gns/{name}/{next(_ids)}"  # the GNS op's EMA key, unique per optimizer
        self.has_batch = local_batch_size is not None
        # A function giving the factor the gradients carry (a LossScaleOptimizer's dynamic_scale), set by
        # the optimizer wrapper; the monitors measure the gradients divided by it. None: no factor.
        self.loss_scale = None
        self._previous = None  # _Previous, made at the first one-worker step
        with tf.init_scope(), tf.device("CPU:0"):  # may be built inside a tf.function
            if isinstance(local_batch_size, tf.Variable):
                self.batch = local_batch_size  # the user's own variable: follows their changes
            else:
                self.batch = tf.Variable(float(local_batch_size or 0), trainable=False, dtype=tf.float32,
                                         name="kungfu_local_batch_size")

            def var(v, dtype=tf.float32):
                return tf.Variable(v, trainable=False, dtype=dtype, name="kungfu_monitor")

            # One vector per op that writes them, so that a step assigns each with one op.
            self.estimates = var(tf.zeros([len(_ops.RECORD_FIELDS)]))  # _ops.RECORD_FIELDS, in order
            self.clock = var(tf.zeros([len(_ops.CLOCK_FIELDS)]))  # _ops.CLOCK_FIELDS: step_time, samples_per_sec
            self.updates = var(0, tf.int64)  # how many times the gradient monitors ran (update_count())
        with _lock:
            _registry.append(weakref.ref(self))

    @property
    def reduces(self):
        """Whether the S-SGD step must carry the local squared norm (some gradient monitor is on)."""
        return bool(self.names)

    def update_count(self):
        """How many steps have computed the gradient monitors so far (on one worker: the due steps that
        had the previous step's gradients)."""
        return int(self.updates.numpy())

    def set_local_batch_size(self, n):
        if not self.has_batch:
            raise ValueError(
                f"the monitors of {self.name!r} were made without local_batch_size, so there is none to set: "
                "pass local_batch_size= (this worker's batch size; a tf.Variable if it will change) when "
                "wrapping the optimizer. It cannot be added later because the training step is traced "
                "without it (no samples_per_sec), and an assignment does not retrace the step")
        return self.batch.assign(tf.cast(_check_batch(n), self.batch.dtype))

    def read(self, field):
        """The latest value of one field (of _ops.RECORD_FIELDS or _ops.CLOCK_FIELDS) as a float32 tensor."""
        if field in _ops.CLOCK_FIELDS:
            return self.clock.read_value()[_ops.CLOCK_FIELDS.index(field)]
        return self.estimates.read_value()[_ops.RECORD_FIELDS.index(field)]

    def tick(self, grads):
        """Throughput: the time since the previous apply(), taken once this step's gradients exist (one
        KfStepClock op)."""
        deps = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
        samples = tf.cast(_lib.size(), tf.float32) * self._batch_after(deps) if self.has_batch else 0.0
        with tf.control_dependencies(deps):
            self.clock.assign(_ops.step_clock(samples, self.key))

    def due(self, iterations):
        """Whether the gradient monitors run at this step: the Python True with interval 1 (so no
        tf.cond is built), else a bool tensor."""
        if self.interval == 1:
            return True
        return tf.equal(tf.math.floormod(tf.cast(iterations, tf.int64), self.interval), 0)

    def local_sq_norm(self, grads, due):
        """This worker's squared gradient norm on due steps, else 0 (it is all-reduced every step)."""
        if due is True:
            return _ops.squared_norm(grads)
        return tf.cond(due, lambda: _ops.squared_norm(grads), lambda: tf.constant(0.0, tf.float32))

    def _batch_after(self, tensors):
        """This step's batch size, read once tensors (its gradients) exist. The batch variable may be one
        that the input pipeline assigns when the step pulls its batch (kungfu.data.AdaptiveDataset), and
        nothing else orders a plain read after that pull: it could see the previous batch's size."""
        with tf.control_dependencies([t for t in tensors if t is not None]):
            return tf.cast(self.batch.read_value(), tf.float32)

    def update(self, due, mean_local_sq, reduced_grads=None, reduced_sq=None, scaled=True):
        """On due steps, the monitors from the workers' mean squared norm and the all-reduced gradients
        (or their squared norm, reduced_sq, when the all-reduce gave it). scaled=False: the gradients were
        divided by the loss scale before the all-reduce (SMA), so the norms are not divided again."""

        # Read outside the tf.cond, after the gradients, as with monitor_interval=1: read inside the
        # branch, the first due step of model.fit over an AdaptiveDataset saw the batch size variable
        # from before its batch was pulled (0), and the gns op refused it.
        b = self._batch_after([mean_local_sq])

        def run():
            b_big = tf.cast(_lib.size(), tf.float32) * b
            big_sq = _ops.squared_norm(reduced_grads) if reduced_sq is None else reduced_sq
            (local_sq, big_sq), valid = self._unscaled(mean_local_sq, big_sq, divide=scaled)
            self._record(local_sq, big_sq, local_sq, b, b_big, b_big, valid)
            return tf.constant(True)

        return when(due, run)

    def update_one_worker(self, grads, variables, step):
        """One worker: on due steps, the monitors from this step's gradients g_t (batch b) and the
        previous step's g_{t-1}, their mean standing for a batch of 2b; the step before each due step
        keeps a copy of its gradients. A due step without the previous step's copy (the first, or the
        batch size changed) leaves the values as they were. Biased: see docs/monitoring.md."""
        if not self.reduces:
            return
        if self._previous is None:
            self._previous = _Previous()
        prev = self._previous
        pairs = [(_dense(g, v), v) for g, v in zip(grads, variables) if g is not None]
        slots = [prev.slot(v, g.dtype) for g, v in pairs]
        grads = [g for g, _ in pairs]
        step = tf.cast(step, tf.int64)
        b = self._batch_after(grads)

        def run():
            valid = tf.equal(prev.step.read_value(), step - 1) & tf.equal(prev.batch.read_value(), b)
            small, big, prev_sq = _ops.consecutive_sq_norms(grads, [s.read_value() for s in slots], previous=True)
            if self.loss_scale is not None:  # both steps' gradients must carry the same factor
                valid &= tf.equal(prev.scale.read_value(), self._scale())
            (small, big, prev_sq), finite = self._unscaled(small, big, prev_sq)
            self._record(small, big, (small + prev_sq) / 2, b, 2 * b, b, valid & finite)
            return tf.constant(True)

        when(self.due(step), run)

        def keep():  # after run() in program order, so its reads see the old copy (automatic control deps)
            for s, g in zip(slots, grads):
                s.assign(g)
            prev.step.assign(step)
            prev.batch.assign(b)
            if self.loss_scale is not None:
                prev.scale.assign(self._scale())
            return tf.constant(True)

        when(self.due(step + 1), keep)

    def _scale(self):
        return tf.cast(self.loss_scale(), tf.float32)

    def _unscaled(self, *squared_norms, divide=True):
        """The squared norms of the gradients without the loss scale (divide=False: they are already), and
        whether they are all finite (a LossScaleOptimizer skips a step whose scaled gradients overflowed;
        so do the monitors)."""
        if self.loss_scale is None:
            return squared_norms, True
        out = tuple(x / tf.square(self._scale()) for x in squared_norms) if divide else squared_norms
        return out, tf.reduce_all(tf.math.is_finite(tf.stack(out)))

    def _record(self, small_sq, big_sq, spread_sq, b, b_big, snr_batch, valid=True):
        """Assigns the monitors from one step's squared norms (one KfMonitorRecord op): small_sq of a
        gradient at batch b, big_sq of the mean gradient at b_big, spread_sq the mean squared norm of the
        gradients averaged (for the variance), snr_batch the batch of the applied gradient. valid (a bool
        tensor) false: the EMAs, gns and grad_variance stay as they were; snr is recomputed from the EMAs
        for snr_batch."""
        self.estimates.assign(_ops.record_step(small_sq, big_sq, spread_sq, b, b_big, snr_batch, self.key,
                                               self.alpha, valid, gns=bool({"gns", "snr"} & self.names),
                                               variance="variance" in self.names))
        self.updates.assign_add(1 if valid is True else tf.cast(valid, tf.int64))

    def values(self):
        """The latest values as Python floats; None for what is not monitored (see latest())."""
        est = dict(zip(_ops.RECORD_FIELDS, (float(x) for x in self.estimates.numpy())))
        clock = dict(zip(_ops.CLOCK_FIELDS, (float(x) for x in self.clock.numpy())))
        return {
            "gns": est["gns"] if "gns" in self.names else None,
            "grad_variance": est["grad_variance"] if "variance" in self.names else None,
            "snr": est["snr"] if "snr" in self.names else None,
            "samples_per_sec": clock["samples_per_sec"] if self.has_batch else None,
            "step_time": clock["step_time"],
        }


def _live():
    with _lock:
        _registry[:] = [r for r in _registry if r() is not None]
        return [r() for r in _registry]


def monitors_of(optimizer=None):
    """The Monitors of optimizer (a wrapped optimizer, a kungfu.rewrite step with monitors, or the name
    of either: the step's is its function's name), or of the most recently created one with monitors
    when None. Raises ValueError when there is none."""
    if optimizer is not None and not isinstance(optimizer, str):
        m = getattr(optimizer, "monitors", None)  # a kungfu.rewrite step
        if not isinstance(m, Monitors):
            m = getattr(getattr(optimizer, "_kungfu", None), "monitors", None)
        if m is None:
            raise ValueError(f"optimizer {getattr(optimizer, 'name', optimizer)!r} has no monitors; wrap it with "
                             "kungfu.optimizers.DistributedOptimizer(..., monitor=[...]) (or pass monitors=[...] "
                             "to kungfu.rewrite)")
        return m
    live = _live()
    if optimizer is not None:
        live = [m for m in live if m.name == optimizer]
    if not live:
        which = f"named {optimizer!r} " if optimizer is not None else ""
        raise ValueError(f"no optimizer {which}with monitors; pass monitor=[\"gns\", ...] to "
                         "kungfu.optimizers.DistributedOptimizer (or SynchronousSGDOptimizer, ...)")
    return live[-1]


def latest(optimizer=None):
    """The latest monitor values, a dict of Python floats keyed "gns", "grad_variance", "snr",
    "samples_per_sec" and "step_time". Every key is there; a monitor not requested is None, and
    samples_per_sec is None without local_batch_size. 0 means "no usable estimate" (none yet; for gns also
    while EMA |G|^2 is not positive).

    optimizer: a wrapped optimizer, or an optimizer's name; or a kungfu.rewrite(..., monitors=[...])
    step, or its function's name; by default the most recently created one with monitors. gns,
    grad_variance and snr are the same on every worker (computed from all-reduced inputs); step_time
    and samples_per_sec are this worker's measurement.
    """
    return monitors_of(optimizer).values()


def update_count(optimizer=None):
    """How many steps have computed the gradient monitors of optimizer (chosen as for latest()) so far:
    on 2 or more workers the due S-SGD steps, on one worker the due steps that had the previous step's
    gradients."""
    return monitors_of(optimizer).update_count()


def collective_stats(reset=False):
    """This worker's counters per collective, keyed by the name of the collective the engine ran (a
    group all-reduce's are "<key>/<i>", i the part's place in its fusion plan, e.g. a gradient bucket's
    "one_step_on_data/kungfu/switch_case/indexed_case/ssgd/group_all_reduce/0" in model.fit (the prefix
    follows the step's structure: ".../kungfu/cond/switch_case/..." with gradient accumulation) or
    "kungfu.rewrite/train_step/ssgd/0/0"; a kungfu.all_reduce(x, name="n") is "n"), counted by
    the engine since kungfu.init() or the last reset:

        {"calls": collectives finished OK, "failed": finished with an error,
         "bytes_sent", "bytes_received": payload bytes this worker moved for them,
         "mean_ms", "last_ms", "max_ms": completion latency (from the op handing its tensor to the
         engine to the engine finishing it: queueing, waiting for the peers, moving the data) of the
         calls that finished OK, in milliseconds; mean_ms is 0 before the first}

    reset=True also empties the counters, in the same step (no call is counted twice or lost), e.g. to
    read them per epoch. The table holds up to 1024 names; later names are counted together under
    "(other)". Needs kungfu.init(). See docs/monitoring.md ("Per-collective bytes and latency").
    """
    stats = _lib.collective_stats(reset)
    for s in stats.values():
        s["mean_ms"] = s["total_ms"] / s["calls"] if s["calls"] else 0.0
    return stats
