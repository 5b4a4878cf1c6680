"""The S-SGD pass: every gradient becomes its mean over the workers.

Dense gradients are all-reduced (kungfu.group_all_reduce, op="mean") in buckets taken in backward-pass
order: a bucket closes once it holds fusion_bytes, so the last layers' bucket is in flight while the
backward pass still computes the first layers' gradients. Each bucket is one op, fused inside into
buffers of at most fusion_bytes; fusion_bytes=0 gives one collective per gradient.

mean_gradients(grads, ctx, extra=[...]) also averages a few more dense tensors in the last bucket (the
monitor pass's squared norm, monitors.py, when a gradient is sparse), so they cost no collective;
mean_gradients_with_norms gives the monitor pass both squared norms from the all-reduce itself.

An IndexedSlices gradient travels as an all-gather of its indices and of its values divided by size():
scattering every worker's rows, each scaled by 1/size, adds up to the mean of the dense gradients, and
each worker may contribute a different number of rows.

Keys are explicit, built from the function's name and the gradients' positions in the traced graph
(which every worker traces alike), not from variable names: those carry per-process uniquifying
suffixes (dense_3), so a worker that built one more model would wait on other keys until the timeout,
while a position that disagrees shows up as a shape mismatch, reported at once.
"""

import tensorflow as tf

from .. import ops as kf
from ..ops import _compression

DEFAULT_FUSION_BYTES = 4 << 20  # as kungfu.group_all_reduce's own default


def ssgd(grads, ctx):
    """Replaces each gradient with its mean over the workers (see the module doc)."""
    return mean_gradients(grads, ctx)[0]


def mean_gradients(grads, ctx, extra=()):
    """(the gradients' means over the workers, the means of the dense tensors extra).

    extra (e.g. a monitor's scalar) rides in the last bucket, the first layers' gradients, which waits
    for all of the backward pass anyway, so a value computed from every gradient costs no collective
    and delays no bucket; with no dense gradient it gets a collective of its own ('.../ssgd/extra').
    """
    fusion_bytes = ctx.options.get("fusion_bytes")
    if fusion_bytes is None:
        fusion_bytes = DEFAULT_FUSION_BYTES
    compression = _compression_of(ctx)
    out, extra = list(grads), list(extra)
    dense = [i for i, g in enumerate(grads) if not g.sparse]
    buckets = _buckets(dense, grads, fusion_bytes, compression)
    extra_means = []
    if extra and not buckets:
        key = ctx.key("ssgd", "extra")
        extra_means = kf.group_all_reduce(extra, op="mean", name=key, fusion_bytes=fusion_bytes)
        ctx.note("group_all_reduce", key, [])
    for b, bucket in enumerate(buckets):
        members = [grads[i] for i in bucket]
        rides = extra if b == len(buckets) - 1 else []
        key = ctx.key("ssgd", str(b))
        values = [g.values for g in members]
        reduced = kf.group_all_reduce(_compression.compress(values, compression) + rides, op="mean", name=key,
                                      fusion_bytes=fusion_bytes)
        ctx.note("group_all_reduce", key, members)
        for i, r in zip(bucket, _compression.decompress(reduced, values)):
            out[i] = grads[i].replace(values=r)
        if rides:
            extra_means = reduced[len(members):]
    for i, g in enumerate(grads):
        if g.sparse:
            out[i] = _gather_mean(g, ctx, ctx.key("ssgd", f"sparse{i}"))
    return out, list(extra_means)


def norms_fusable(grads):
    """Whether mean_gradients_with_norms takes these gradients: all dense and of a float dtype."""
    return all(not g.sparse and g.values.dtype in kf.NORM_DTYPES for g in grads)


def mean_gradients_with_norms(grads, ctx, norms):
    """(the gradients' means, the workers' mean local squared norm, the squared norm of the means), for
    gradients norms_fusable() accepts: the buckets of mean_gradients, each one
    kungfu.ops.group_all_reduce_with_norms, whose norms are summed as it copies the gradients. norms (a bool
    scalar tensor, equal on every worker) false gives 0s."""
    fusion_bytes = ctx.options.get("fusion_bytes")
    if fusion_bytes is None:
        fusion_bytes = DEFAULT_FUSION_BYTES
    compression = _compression_of(ctx)
    out, local, reduced = list(grads), [], []
    for b, bucket in enumerate(_buckets(list(range(len(grads))), grads, fusion_bytes, compression)):
        members = [grads[i] for i in bucket]
        key = ctx.key("ssgd", str(b))
        values = [g.values for g in members]
        means, local_sq, reduced_sq = kf.group_all_reduce_with_norms(_compression.compress(values, compression),
                                                                     norms=norms, op="mean", name=key,
                                                                     fusion_bytes=fusion_bytes)
        ctx.note("group_all_reduce", key, members)
        for i, r in zip(bucket, _compression.decompress(means, values)):
            out[i] = grads[i].replace(values=r)
        local.append(local_sq)
        reduced.append(reduced_sq)
    zero = tf.constant(0.0, tf.float32)
    return out, tf.add_n(local) if local else zero, tf.add_n(reduced) if reduced else zero


def _compression_of(ctx):
    """The wire format of the dense gradients: none on one worker, where nothing is sent (as the optimizer
    wrappers do), so that the step stays bit for bit the original."""
    return ctx.options.get("compression", "none") if ctx.size > 1 else "none"


def _buckets(positions, grads, fusion_bytes, compression):
    """Consecutive runs of positions, each closed once it holds fusion_bytes on the wire."""
    buckets, current, size = [], [], 0
    for i in positions:
        current.append(i)
        size += _nbytes(grads[i].values, fusion_bytes, compression)
        if size >= fusion_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def _nbytes(t, unknown, compression):
    n = t.shape.num_elements()
    return unknown if n is None else n * _compression.wire_dtype(t.dtype, compression).size


def _gather_mean(g, ctx, key):
    values = kf.all_gather(g.values, name=key + "/values")
    indices = kf.all_gather(g.indices, name=key + "/indices")
    ctx.note("all_gather", key + "/values", [g])
    ctx.note("all_gather", key + "/indices", [g])
    return g.replace(values=values / tf.cast(ctx.size, values.dtype), indices=indices)
