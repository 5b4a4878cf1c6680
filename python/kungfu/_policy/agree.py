"""How the Python-hook runners make every worker see the same readings and take the same decisions.

Two small eager collectives per hook call that has a due policy (none otherwise, none on one worker):
  1. mean_local_metrics: the metrics that are each worker's own (the step's loss and other logs,
     step_time, samples_per_sec) are replaced by their mean over the workers, so every worker's policies
     read the same context. The monitors' gns, grad_variance and snr are already the same everywhere.
  2. exchange: after the policies ran, every worker all-gathers every worker's outcome: the error it
     hit, if any, and its decisions. An error anywhere is raised on every worker; otherwise every
     worker applies rank 0's decisions (a policy with a private random state or local input still
     cannot make the workers diverge).
Keys are fixed per runner and hook; the engine matches the n-th call of a key on every worker.
Once per runner, at its first before_train, start_step agrees on where the step count starts.
"""

import json
import struct
import zlib

import numpy as np

from .. import _lib
from ..errors import PolicyError

AGREED_METRICS = frozenset({"gns", "grad_variance", "snr"})  # computed from all-reduced values


def _keys_checksum(keys):
    return float(zlib.crc32("\0".join(keys).encode()))


def mean_local_metrics(metrics, key, who):
    """metrics with every local float replaced by its mean over the workers (one all_reduce)."""
    if _lib.size() == 1:
        return metrics
    import tensorflow as tf

    from ..ops import all_reduce

    local = sorted(k for k, v in metrics.items() if k not in AGREED_METRICS and v is not None)
    checksum = _keys_checksum(local)
    vec = np.array([checksum] + [metrics[k] for k in local], np.float64)
    differ = PolicyError(f"{who}: the workers report different metrics (this worker: {', '.join(local)}); "
                         "every worker must log the same keys")
    try:
        out = all_reduce(tf.constant(vec), op="mean", name=key).numpy()
    except tf.errors.InvalidArgumentError as e:  # as many keys or not: every worker gets PolicyError
        raise differ from e
    if out[0] != checksum:  # the mean of equal checksums is exact; of different ones, not equal to ours
        raise differ
    return {**metrics, **{k: float(v) for k, v in zip(local, out[1:])}}


def exchange(outcome, key):
    """Every worker's outcome (a JSON-able dict), in rank order (one all_gather)."""
    if _lib.size() == 1:
        return [outcome]
    import tensorflow as tf

    from ..ops import all_gather

    data = json.dumps(outcome).encode()
    mine = np.frombuffer(struct.pack("<I", len(data)) + data, np.uint8)
    got = all_gather(tf.constant(mine), name=key).numpy().tobytes()
    outcomes, at = [], 0
    while at < len(got):
        (n,) = struct.unpack_from("<I", got, at)
        outcomes.append(json.loads(got[at + 4:at + 4 + n]))
        at += 4 + n
    if len(outcomes) != _lib.size():
        raise PolicyError(f"policy runner: expected {_lib.size()} outcomes from the workers, got {len(outcomes)}")
    return outcomes


def start_step(optimizer, key):
    """The steps the optimizer has taken (its `iterations`: a run that resumes from a checkpoint starts past
    0), rank 0's value on every worker (one broadcast): where only rank 0 restored and a broadcast callback
    has yet to copy its state, the others still read 0. 0 without an optimizer that counts its steps.
    (With a LossScaleOptimizer, steps skipped for overflow are not counted.)"""
    iterations = getattr(optimizer, "iterations", None) if optimizer is not None else None
    restored = getattr(getattr(optimizer, "_kungfu", None), "iterations_from", None)
    if restored is not None and not getattr(optimizer, "built", True):
        iterations = restored  # a kungfu wrapper of a used optimizer, not yet built: its state is copied then
    mine = 0 if iterations is None else int(np.asarray(iterations))
    if _lib.size() == 1:
        return mine
    import tensorflow as tf

    from ..ops import broadcast

    return int(broadcast(tf.constant(mine, tf.int64), root=0, name=key).numpy())
