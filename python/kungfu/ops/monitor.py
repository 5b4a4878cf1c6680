"""Training monitors computed inside the graph: gradient noise scale, gradient variance, SNR.

The caller brings the squared gradient norms (this worker's, and the all-reduced one's, reduced however
it likes); these functions turn them into estimates. None of them talks to other workers, and none
needs kungfu.init(). Formulas, EMA and the handling of negative and non-finite values:
docs/monitoring.md ("Operators"). Every result is a float32 scalar tensor and never NaN or inf:
0 means "no usable estimate" (none yet; for gns also while EMA |G|^2 is not positive).

All work eagerly and inside tf.function. The gradient noise scale keeps an EMA per `key` in a
process-wide registry in the library, so it continues across retracing and across functions that use
the same key; reset_monitor(key) forgets it.
"""

import numbers

import tensorflow as tf

from .. import _lib
from . import _naming

_no_autograph = _naming.no_autograph


def _key(key, what):
    if not isinstance(key, str) or not key:
        raise ValueError(f"{what}: key must be a non-empty string, got {key!r}")
    return key


def _scalar(x, what, arg):
    x = tf.convert_to_tensor(x)
    if not (x.dtype.is_floating or x.dtype.is_integer):
        raise TypeError(f"{what}: {arg} must be a number, got dtype {x.dtype.name}")
    x = tf.cast(x, tf.float32)
    if x.shape.rank is not None and x.shape.rank != 0:
        raise ValueError(f"{what}: {arg} must be a scalar, got shape {x.shape}")
    return x


def _guard(x):
    """x where finite, else 0."""
    return tf.where(tf.math.is_finite(x), x, tf.zeros_like(x))


@_no_autograph
def gradient_noise_scale(local_sq_norm, global_sq_norm, local_batch, global_batch, key, alpha=0.1):
    """Gradient noise scale B_simple = EMA(tr Sigma) / EMA(|G|^2) from two batch sizes.

    local_sq_norm: |G_small|^2, this worker's squared gradient norm at its batch local_batch.
    global_sq_norm: |G_big|^2, the squared norm of the all-reduced (mean) gradient at global_batch.
    key: the monitor's name; its EMAs persist across calls (and retracing) until reset_monitor(key).
    alpha: EMA weight of a new estimate, in (0, 1].
    Returns {"gns", "g_sq", "trace"}: B_simple (0 = no usable estimate), EMA(|G|^2), EMA(tr Sigma).
    A NaN or inf norm leaves the EMAs unchanged (so feeding NaN skips a step). Raises
    tf.errors.InvalidArgumentError unless global_batch > local_batch > 0.
    """
    what = "gradient_noise_scale"
    key = _key(key, what)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha <= 1:
        raise ValueError(f"{what}: alpha must be a number in (0, 1], got {alpha!r}")
    args = [_scalar(x, what, arg) for x, arg in ((local_sq_norm, "local_sq_norm"), (global_sq_norm, "global_sq_norm"),
                                                  (local_batch, "local_batch"), (global_batch, "global_batch"))]
    gns, g_sq, trace = _lib.op_module().kf_gradient_noise_scale(*args, key=key, alpha=float(alpha))
    return {"gns": gns, "g_sq": g_sq, "trace": trace}


RECORD_FIELDS = ("gns", "g_sq", "trace", "snr", "grad_variance")  # record_step's vector, in order
CLOCK_FIELDS = ("step_time", "samples_per_sec")  # step_clock's vector, in order


@_no_autograph
def record_step(small_sq, big_sq, spread_sq, local_batch, global_batch, snr_batch, key, alpha=0.1, valid=True,
                gns=True, variance=True):
    """One monitored step's estimates in one op (KfMonitorRecord): a float32 vector of RECORD_FIELDS.

    With gns: gradient_noise_scale(small_sq, big_sq, local_batch, global_batch, key, alpha)'s three values
    and snr(g_sq, trace, snr_batch). With variance: gradient_variance(spread_sq, big_sq). valid (a bool
    or bool scalar tensor) false: the EMAs and the variance stay as they were (the snr is recomputed).
    What is not requested is 0. The same rules as the separate functions, in double, in one kernel.
    """
    what = "record_step"
    key = _key(key, what)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha <= 1:
        raise ValueError(f"{what}: alpha must be a number in (0, 1], got {alpha!r}")
    args = [_scalar(x, what, arg) for x, arg in ((small_sq, "small_sq"), (big_sq, "big_sq"), (spread_sq, "spread_sq"),
                                                  (local_batch, "local_batch"), (global_batch, "global_batch"),
                                                  (snr_batch, "snr_batch"))]
    valid = tf.convert_to_tensor(valid, tf.bool)
    return _lib.op_module().kf_monitor_record(*args, valid, key=key, alpha=float(alpha), gns=bool(gns),
                                               variance=bool(variance))


@_no_autograph
def step_clock(samples, key):
    """[step_time, samples_per_sec] (KfStepClock): the seconds since the previous call with this key, on
    the runtime's steady clock, and samples over them; 0s until a second call. reset_monitor(key)
    forgets the previous call."""
    return _lib.op_module().kf_step_clock(_scalar(samples, "step_clock", "samples"), key=_key(key, "step_clock"))


@_no_autograph
def reset_monitor(key):
    """Forgets the EMAs of the monitor named key (nothing happens when it has none)."""
    key = _key(key, "reset_monitor")
    return _lib.op_module().kf_reset_monitor(tf.constant(key))


def _values(g):
    """The dense values of g, duplicate IndexedSlices indices summed (the dense gradient's rows)."""
    if isinstance(g, tf.IndexedSlices):
        unique, idx = tf.unique(g.indices)
        return tf.math.unsorted_segment_sum(g.values, idx, tf.shape(unique)[0])
    return tf.convert_to_tensor(g)


_NORM_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)  # KfSquaredNorm's; others go as float32


def _normable(t):
    return t if t.dtype in _NORM_DTYPES else tf.cast(t, tf.float32)


@_no_autograph
def squared_norm(tensors):
    """sum of squares of every element of a list of tensors or tf.IndexedSlices, as a float32 scalar.

    None entries (variables without a gradient) are skipped. IndexedSlices count as the dense tensor
    they stand for: rows with repeated indices are summed before squaring. One op (KfSquaredNorm) sums
    the whole list, one pass over each tensor with no temporary; each tensor in its own precision
    (float for half and bfloat16), the total in double.
    """
    if isinstance(tensors, (tf.Tensor, tf.IndexedSlices, tf.Variable)):
        tensors = [tensors]
    parts = [_normable(_values(t)) for t in tensors if t is not None]
    if not parts:
        return tf.constant(0.0, tf.float32)
    return _lib.op_module().kf_squared_norm(parts)


def _half_sum(a, b):
    """(a + b) / 2, keeping IndexedSlices sparse when both are."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0) * 0.5, tf.concat([a.indices, b.indices], 0),
                                a.dense_shape)
    return (tf.convert_to_tensor(a) + tf.cast(tf.convert_to_tensor(b), a.dtype)) * 0.5


@_no_autograph
def consecutive_sq_norms(grads, prev_grads, previous=False):
    """(|g_t|^2, |(g_t + g_{t-1}) / 2|^2) for a single worker's gradient noise scale; with
    previous=True also |g_{t-1}|^2 (for the variance of the pair).

    With one worker there is no second batch size, so the mean of this step's and the previous step's
    gradients stands in for the big batch: feed these to gradient_noise_scale with local_batch=B and
    global_batch=2B (single_worker_gradient_noise_scale does). Biased: the two gradients are taken at
    different weights (with d the change of the true gradient, tr Sigma is off by 2B (G_t.d - |d|^2/4):
    low while the gradient shrinks along its direction, high when it turns), and correlated noise counts
    as signal (tr Sigma low). See docs/monitoring.md. The caller keeps prev_grads (e.g. in variables it
    assigns after each step). Dense pairs of equal shape are summed by one op
    (KfConsecutiveSquaredNorms) in one pass; pairs with an IndexedSlices in them go through squared_norm.
    """
    if len(grads) != len(prev_grads):
        raise ValueError(f"consecutive_sq_norms: {len(grads)} gradients but {len(prev_grads)} previous ones")
    pairs = [(g, p) for g, p in zip(grads, prev_grads) if g is not None and p is not None]
    dense = [(g, p) for g, p in pairs if not isinstance(g, tf.IndexedSlices) and not isinstance(p, tf.IndexedSlices)]
    sparse = [(g, p) for g, p in pairs if isinstance(g, tf.IndexedSlices) or isinstance(p, tf.IndexedSlices)]
    totals = [squared_norm([g for g, _ in sparse]), squared_norm([_half_sum(g, p) for g, p in sparse]),
              squared_norm([p for _, p in sparse])]
    if dense:
        gs = [_normable(tf.convert_to_tensor(g)) for g, _ in dense]
        ps = [tf.cast(tf.convert_to_tensor(p), g.dtype) for g, (_, p) in zip(gs, dense)]
        totals = [t + n for t, n in zip(totals, _lib.op_module().kf_consecutive_squared_norms(gs, ps))]
    return tuple(totals) if previous else tuple(totals[:2])


@_no_autograph
def single_worker_gradient_noise_scale(grads, prev_grads, batch, key, alpha=0.1, prev_valid=True):
    """gradient_noise_scale on one worker from consecutive steps (see consecutive_sq_norms for the bias).

    batch: this step's batch size B (the big batch counts as 2B). prev_valid: a bool (or bool scalar
    tensor); when false (the first step, or after the batch size changed) the step does not update the
    EMAs, since prev_grads then holds no real gradient.
    """
    small, big = consecutive_sq_norms(grads, prev_grads)
    valid = tf.convert_to_tensor(prev_valid, tf.bool)
    small = tf.where(valid, small, tf.constant(float("nan"), tf.float32))  # a NaN input skips the update
    batch = _scalar(batch, "single_worker_gradient_noise_scale", "batch")
    return gradient_noise_scale(small, big, batch, 2.0 * batch, key, alpha)


@_no_autograph
def snr(g_sq, trace, batch):
    """Gradient signal-to-noise ratio |G|^2 / (tr Sigma / batch), a float32 scalar.

    0 (no estimate) when g_sq <= 0, trace <= 0 or the result is not finite. Equals batch / B_simple.
    """
    g_sq, trace, batch = (_scalar(x, "snr", a) for x, a in ((g_sq, "g_sq"), (trace, "trace"), (batch, "batch")))
    ok = (g_sq > 0) & (trace > 0)
    value = g_sq * batch / tf.where(ok, trace, tf.ones_like(trace))
    return tf.where(ok, _guard(value), tf.zeros_like(value))


@_no_autograph
def gradient_variance(mean_local_sq_norm, global_sq_norm):
    """Variance of the gradients across workers this step: mean_i |g_i - g_mean|^2, a float32 scalar.

    Equals mean_i |g_i|^2 - |g_mean|^2. mean_local_sq_norm: the mean over workers of each worker's
    squared gradient norm (e.g. kungfu.all_reduce(squared_norm(grads), op="mean"); the caller chooses how
    to reduce it). global_sq_norm: the squared norm of the mean gradient. With N workers of batch b,
    its expectation is (N - 1) / N * tr Sigma / b. Negative values (rounding) give 0, and so do non-finite ones.
    """
    a = _scalar(mean_local_sq_norm, "gradient_variance", "mean_local_sq_norm")
    b = _scalar(global_sq_norm, "gradient_variance", "global_sq_norm")
    return tf.maximum(_guard(a - b), 0.0)
