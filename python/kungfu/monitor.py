"""kungfu.monitor: the training monitors of the distributed optimizers, and their latest values.

    opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1), monitor=["gns", "variance"],
                                                    monitor_interval=8, local_batch_size=32)
    ... train ...
    kungfu.monitor.latest()
    # {"gns": ..., "grad_variance": ..., "snr": None, "samples_per_sec": ..., "step_time": ...}

How it works. A wrapped optimizer with monitors owns a Monitors object: non-trainable tf.Variables
(not tracked by Keras or checkpoints) that the training step's graph assigns. In the S-SGD branch,
every k-th step (iterations % k == 0, a tf.cond, so k costs no retrace), each worker's squared
gradient norm rides along in the gradients' own all-reduce (no extra collective), and the mean of the
workers' squared norms stands for |G_small|^2 in the gradient noise scale: every input is then
all-reduced, so every worker computes the same numbers. Throughput (step_time, samples_per_sec) is
measured in the graph at every step, with tf.timestamp(), and is this worker's own. See
docs/monitoring.md ("Using monitors"). kungfu.rewrite(fn, monitors=[...]) uses the same Monitors from
its monitor pass (kungfu/_rewrite/monitors.py), counting the step's calls instead of iterations.

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

MONITORS = ("gns", "variance", "snr")
KEYS = ("gns", "grad_variance", "snr", "samples_per_sec", "step_time")
_registry = []  # weakref.ref to Monitors, in creation order
_lock = threading.Lock()
_ids = itertools.count()


def _check_batch(n):
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not n > 0:
        raise ValueError(f"local_batch_size must be a number > 0 (this worker's batch size), got {n!r}")
    return float(n)


def check_arguments(monitor, interval, local_batch_size):
    """Validates the wrapper's monitor arguments; returns (names, interval). Raises ValueError."""
    if monitor is None:
        names = ()
    else:
        names = (monitor,) if isinstance(monitor, str) else tuple(monitor)
        bad = [m for m in names if m not in MONITORS]
        if bad:
            raise ValueError(f"unknown monitor(s) {', '.join(map(repr, bad))}; choose from {', '.join(MONITORS)}")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"monitor_interval must be an int >= 1 (run the monitors every k steps), got {interval!r}")
    if local_batch_size is None:
        if {"gns", "snr"} & set(names):
            raise ValueError("the 'gns' and 'snr' monitors need local_batch_size= (this worker's batch size, "
                             "an int or a tf.Variable)")
    elif not isinstance(local_batch_size, tf.Variable):
        _check_batch(local_batch_size)
    return names, interval


class Monitors:
    """The monitor state of one wrapped optimizer: its variables and the graph code that assigns them."""

    def __init__(self, names, interval, local_batch_size, name):
        self.names = frozenset(names)  # requested: a subset of MONITORS
        self.interval = interval  # k: the monitors run when iterations % k == 0
        self.name = name  # the optimizer's name, for latest(name)
        self.key = f"kungfu/gns/{name}/{next(_ids)}"  # the GNS op's EMA key, unique per optimizer
        self.has_batch = local_batch_size is not None
        with tf.init_scope(), tf.device("CPU:0"):  # may be built inside a tf.function
            if isinstance(local_batch_size, tf.Variable):
                self.batch = local_batch_size  # the user's own variable: follows their changes
            else:
                self.batch = tf.Variable(float(local_batch_size or 0), trainable=False, dtype=tf.float32,
                                         name="kungfu_local_batch_size")

            def var(v, dtype=tf.float32):
                return tf.Variable(v, trainable=False, dtype=dtype, name="kungfu_monitor")

            self.gns, self.g_sq, self.trace, self.snr, self.grad_variance = (var(0.0) for _ in range(5))
            self.step_time, self.samples_per_sec = var(0.0), var(0.0)
            self.last_time = var(0.0, tf.float64)  # tf.timestamp() of the previous apply(); 0: none yet
            self.updates = var(0, tf.int64)  # how many times the gradient monitors ran
        with _lock:
            _registry.append(weakref.ref(self))

    @property
    def reduces(self):
        """Whether the S-SGD step must carry the local squared norm (some gradient monitor is on)."""
        return bool(self.names)

    def set_local_batch_size(self, n):
        return self.batch.assign(tf.cast(_check_batch(n), self.batch.dtype))

    def tick(self, grads):
        """Throughput: the time since the previous apply(), taken once this step's gradients exist."""
        deps = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
        with tf.control_dependencies(deps):
            now = tf.timestamp()
        last = self.last_time.read_value()
        dt = now - last
        ok = (last > 0) & (dt > 0)
        step_time = tf.where(ok, tf.cast(dt, tf.float32), self.step_time.read_value())
        self.step_time.assign(step_time)
        samples = tf.cast(_lib.size(), tf.float32) * tf.cast(self.batch.read_value(), tf.float32)
        if self.has_batch:
            self.samples_per_sec.assign(tf.where(ok, samples / tf.where(ok, step_time, 1.0),
                                                 self.samples_per_sec.read_value()))
        self.last_time.assign(now)

    def due(self, iterations):
        return tf.equal(tf.math.floormod(tf.cast(iterations, tf.int64), self.interval), 0)

    def local_sq_norm(self, grads, due):
        """This worker's squared gradient norm on due steps, else 0 (it is all-reduced every step)."""
        return tf.cond(due, lambda: _ops.squared_norm(grads), lambda: tf.constant(0.0, tf.float32))

    def update(self, due, mean_local_sq, reduced_grads):
        """On due steps, the monitors from the workers' mean squared norm and the all-reduced gradients."""

        def run():
            global_sq = _ops.squared_norm(reduced_grads)
            if "variance" in self.names:
                self.grad_variance.assign(_ops.gradient_variance(mean_local_sq, global_sq))
            if {"gns", "snr"} & self.names:
                b = tf.cast(self.batch.read_value(), tf.float32)
                b_big = tf.cast(_lib.size(), tf.float32) * b
                r = _ops.gradient_noise_scale(mean_local_sq, global_sq, b, b_big, self.key)
                self.gns.assign(r["gns"])
                self.g_sq.assign(r["g_sq"])
                self.trace.assign(r["trace"])
                self.snr.assign(_ops.snr(r["g_sq"], r["trace"], b_big))
            self.updates.assign_add(1)
            return tf.constant(True)

        return tf.cond(due, run, lambda: tf.constant(False))

    def values(self):
        """The latest values as Python floats; None for what is not monitored (see latest())."""
        out = {
            "gns": float(self.gns.numpy()) if "gns" in self.names else None,
            "grad_variance": float(self.grad_variance.numpy()) if "variance" in self.names else None,
            "snr": float(self.snr.numpy()) if "snr" in self.names else None,
            "samples_per_sec": float(self.samples_per_sec.numpy()) if self.has_batch else None,
            "step_time": float(self.step_time.numpy()),
        }
        return out


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
    samples_per_sec is None without local_batch_size. 0 means "no estimate yet".

    optimizer: a wrapped optimizer, or an optimizer's name; or a kungfu.rewrite(..., monitors=[...])
    step, or its function's name; by default the most recently created one with monitors. gns,
    grad_variance and snr are the same on every worker (computed from all-reduced inputs); step_time
    and samples_per_sec are this worker's measurement.
    """
    return monitors_of(optimizer).values()
