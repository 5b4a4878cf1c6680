"""AdaptiveDataset: in-memory data whose global batch size can change between any two steps.

Threading and ownership. as_dataset() is a tf.data.Dataset.from_generator over _generate(), which runs
on a tf.data thread each time a step pulls a batch; the training loop, callbacks and policies run on the
main thread. What each side touches:
- batch_size_variable: written by set_batch_size (eagerly, or by an assign in a step's graph); read by
  the generator once per batch. A variable read is atomic, and the read happens when the step pulls its
  batch, after the previous step and its callbacks are done: that is what makes a change between step s
  and s+1 take effect at s+1. So there is no prefetching anywhere (tf.data's injected prefetch is off).
- local_batch_size_variable, epoch_variable, samples_seen_variable: written by the generator only.
- The Python counters (_epochs, _samples_seen) and the pass in progress (_pass): written by the
  generator, read by the properties and by the Keras callback, all under _lock.
One pass at a time: a new iterator starts a new epoch and ends the previous pass, whose iterator then
stops (it would otherwise hand out the same samples a second time).
"""

import atexit
import gc
import logging
import threading
import zlib

import numpy as np
import tensorflow as tf

from .. import _lib
from ..ops import _naming
from . import _plan

_log = logging.getLogger("kungfu")


class _Pass:
    """The epoch in progress: its number (0-based), the samples it has not handed out, the steps so far."""

    def __init__(self, epoch, n):
        self.epoch = epoch
        self.remaining = n
        self.steps = 0


class AdaptiveDataset:
    """In-memory data cut into global batches whose size can change between any two steps.

        ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=128, shuffle=True, seed=0)
        model.fit(ds.as_dataset(), epochs=3, shuffle=False, callbacks=[..., ds.keras_callback()])
        ds.set_batch_size(256)            # from the next batch on; also inside a tf.function

    data: a numpy array, or a tuple / dict (nested as you like) of arrays with the same first dimension:
    the whole data set, the same on every worker (it is checked); the dataset shards it itself. Each
    epoch is a permutation of the samples (seeded by seed and the epoch number; in order if shuffle is
    False); a step takes the next B of it, B the global batch size at that moment, and this worker gets
    its part of those B (see kungfu/data/_plan.py for the split and the last batch). Needs kungfu.init().
    See docs/data.md.
    """

    def __init__(self, data, global_batch_size, shuffle=True, seed=0):
        _lib.require_init("kungfu.data.AdaptiveDataset")
        self._rank, self._size = _lib.rank(), _lib.size()
        self._structure, self._arrays = _flatten(data)
        self._n = _sample_count(self._arrays, self._size)
        batch = _plan.check_batch_size(global_batch_size, self._size)
        self._seed, self._shuffle = _plan.check_seed(seed), bool(shuffle)
        self.element_spec = tf.nest.pack_sequence_as(self._structure, [
            tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)) for a in self._arrays])
        self._check_workers_agree(batch)
        with tf.init_scope(), tf.device("CPU:0"):  # CPU: the generator reads and writes them every batch
            self.batch_size_variable = tf.Variable(batch, dtype=tf.int64, trainable=False,
                                                   name="kungfu_global_batch_size")
            self.local_batch_size_variable = tf.Variable(0.0, dtype=tf.float32, trainable=False,
                                                         name="kungfu_local_batch_size")
            self.epoch_variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="kungfu_epoch")
            self.samples_seen_variable = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                     name="kungfu_samples_seen")
        self._lock = threading.Lock()
        self._epochs = 0  # epochs started
        self._samples_seen = 0  # global samples handed out, all workers together
        self._pass = None  # the _Pass in progress (or finished last), None before the first

    # ---- readings ----

    @property
    def batch_size(self):
        """The current global batch size (int). Inside a tf.function read batch_size_variable instead."""
        if not tf.executing_eagerly():
            raise RuntimeError("AdaptiveDataset.batch_size is a Python int, readable eagerly only; inside a "
                               "tf.function read ds.batch_size_variable")
        return int(self.batch_size_variable.numpy())

    @batch_size.setter
    def batch_size(self, n):
        self.set_batch_size(n)

    @property
    def local_batch_size(self):
        """local_batch_size_variable's value: the size of the latest global batch divided by size()."""
        return float(self.local_batch_size_variable.numpy())

    @property
    def epoch(self):
        """Epochs started: 0 before the first batch, 1 from the first batch of the first epoch on (counting
        from the epoch given to start_at_epoch, when a resumed run gave one)."""
        with self._lock:
            return self._epochs

    @property
    def samples_seen(self):
        """Samples handed out so far by all workers together (every global batch counts whole)."""
        with self._lock:
            return self._samples_seen

    @property
    def num_samples(self):
        return self._n

    def __len__(self):
        """Batches in one whole epoch at the current batch size (changes when the batch size does)."""
        return _plan.batches_left(self._n, self.batch_size, self._size)

    def progress(self):
        """(steps, planned, finished) of the epoch in progress: steps taken, steps it will have in all if
        the batch size stays, and whether its last batch has been handed out. (0, len(self), False)
        before the first batch."""
        with self._lock:
            p = self._pass
            if p is None:
                return 0, len(self), False
            return p.steps, p.steps + _plan.batches_left(p.remaining, self.batch_size, self._size), \
                p.remaining == 0

    # ---- control ----

    def set_batch_size(self, n, after=None):
        """Sets the global batch size from the next batch on, on this worker: change it at the same step on
        every worker (the policies do). n: an int >= size(); inside a tf.function also an integer tensor,
        checked when the step runs.

        Inside a tf.function the assign waits for the function's inputs (the batch, in model.fit's step
        and in a step called with its batch) and for `after` (tensors made from this step's batch: pass
        them when the function pulls its batch itself). Unordered, TensorFlow may run the assign before
        the step's batch is pulled, and the change would land one step early."""
        if tf.executing_eagerly():
            if isinstance(n, (tf.Tensor, tf.Variable, np.ndarray)) and n.shape == ():  # its value is checked
                n = n[()] if isinstance(n, np.ndarray) else n.numpy()
            return self.batch_size_variable.assign(_plan.check_batch_size(n, self._size))
        checks = []
        if isinstance(n, (tf.Tensor, tf.Variable)):
            if not n.dtype.is_integer:
                raise TypeError(f"the global batch size must be an integer tensor, got dtype {n.dtype.name}")
            n = tf.cast(n, tf.int64)
            checks.append(tf.debugging.assert_greater_equal(
                n, tf.constant(self._size, tf.int64),
                message=f"the global batch size must be at least the number of workers ({self._size})"))
        else:
            n = tf.constant(_plan.check_batch_size(n, self._size), tf.int64)
        after = [] if after is None else tf.nest.flatten(after)
        with tf.control_dependencies(checks + _step_inputs() + after):
            return self.batch_size_variable.assign(n)

    def start_at_epoch(self, epoch):
        """Resuming: makes the first pass epoch `epoch` (0-based; its shuffle order, and the epoch that
        epoch_variable and policies compiled with this dataset read) when no pass has begun yet; otherwise
        does nothing. Returns whether it did. ds.keras_callback() and PolicyRunner.before_epoch call it with
        fit's initial_epoch / the epoch given, so a resumed run goes on with the epochs it left."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"kungfu.data: the epoch must be a whole number >= 0, got {epoch!r}")
        with self._lock:
            if self._pass is not None or self._epochs == int(epoch):
                return False
            self._epochs = int(epoch)
        self.epoch_variable.assign(int(epoch))
        return True

    # ---- the pipeline ----

    def as_dataset(self):
        """A tf.data.Dataset of this worker's batches: iterating it once is one epoch. Its batch dimension
        is None, so a step traced on it serves every batch size. Do not add prefetching (or a parallel
        map) after it: a batch made ahead would miss a batch-size change made before its step."""
        _register_collect_at_exit()
        ds = tf.data.Dataset.from_generator(self._generate, output_signature=self.element_spec)
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False  # on by default: it would read ahead
        # Also on by default: it makes a stateless map the user adds after this one parallel, which reads
        # ahead (tested: batches lost and a batch-size change landing late). Options pass downstream.
        options.experimental_optimization.map_parallelization = False
        return ds.with_options(options)

    def keras_callback(self):
        """The callback model.fit needs to run one epoch per pass over the data (see EpochCallback)."""
        from ._keras import EpochCallback

        return EpochCallback(self)

    def _generate(self):
        """One epoch of this worker's batches. Runs on a tf.data thread, one batch per pull."""
        p = self._begin_pass()
        order = _plan.permutation(self._n, self._seed, p.epoch, self._shuffle)
        while True:
            batch = int(self.batch_size_variable.numpy())  # read now: the step pulling this batch is next
            if batch < self._size:  # assigned directly to the variable, not through set_batch_size
                raise ValueError(f"kungfu.data: the global batch size is {batch}, fewer than the {self._size} "
                                 f"workers; set it with ds.set_batch_size(n), n >= {self._size}")
            with self._lock:
                if p is not self._pass or p.remaining == 0:  # done, or a newer pass has begun
                    return
                start = self._n - p.remaining
                take = _plan.next_batch(p.remaining, batch, self._size)
                p.remaining -= take
                p.steps += 1
                self._samples_seen += take
                seen = self._samples_seen
            lo, hi = _plan.worker_slice(take, self._size, self._rank)
            self.local_batch_size_variable.assign(take / self._size)
            self.samples_seen_variable.assign(seen)
            rows = order[start + lo:start + hi]
            yield tf.nest.pack_sequence_as(self._structure, [a[rows] for a in self._arrays])

    def _begin_pass(self):
        with self._lock:
            old = self._pass
            if old is not None and 0 < old.remaining < self._n:
                _log.warning(
                    "kungfu.data: epoch %d began before epoch %d was finished (%d of its %d samples not handed "
                    "out). Iterate as_dataset() to its end each epoch; with model.fit, pass "
                    "callbacks=[ds.keras_callback()] and no steps_per_epoch.", old.epoch + 1, old.epoch,
                    old.remaining, self._n)
            self._pass = _Pass(self._epochs, self._n)
            self._epochs += 1
            epochs, p = self._epochs, self._pass
        self.epoch_variable.assign(epochs)
        return p

    def _check_workers_agree(self, batch):
        """Every worker must cut the same data the same way, or the shards overlap and miss samples."""
        if self._size == 1:
            return
        from .. import ops

        # A seed may be any int >= 0 (np.random.SeedSequence().entropy has 128 bits): compared as its low
        # 62 bits and a checksum of all of it, which fit an int64.
        seed = [self._seed % (1 << 62), zlib.crc32(str(self._seed).encode())]
        mine = np.array([self._n, batch, *seed, int(self._shuffle), _fingerprint(self._arrays)], np.int64)
        if not bool(ops.consensus(mine, name="kungfu/data/AdaptiveDataset")):
            raise ValueError(
                "kungfu.data.AdaptiveDataset: the workers passed different data or settings (sample count, "
                "global_batch_size, seed, shuffle, or the samples themselves). Pass the whole data set, "
                "the same on every worker: the dataset shards it itself (no x[kungfu.rank()::kungfu.size()]).")


def _step_inputs():
    """The data inputs of the tf.function being traced (seen through cond and loop bodies)."""
    graph = _naming.function_graph(tf.compat.v1.get_default_graph())
    return [t for t in getattr(graph, "inputs", ()) if t.dtype != tf.resource]


def _flatten(data):
    """(structure, arrays): data's nest of tuples and dicts (lists become tuples), and its arrays."""
    def normalize(d):
        if isinstance(d, dict):
            return {k: normalize(v) for k, v in d.items()}
        if isinstance(d, (tuple, list)):
            return tuple(normalize(v) for v in d)
        if isinstance(d, tf.data.Dataset) or not hasattr(d, "__len__") and hasattr(d, "__iter__"):
            raise TypeError(f"AdaptiveDataset: got a {type(d).__name__}, which it cannot cut: it needs the whole "
                            "data set in memory, as numpy arrays (a tuple or dict of them). For a tf.data.Dataset "
                            "that fits in memory, collect it first, e.g. next(iter(ds.batch(n))) with n its size")
        if isinstance(d, tf.SparseTensor):
            raise TypeError("AdaptiveDataset: a tf.SparseTensor cannot be cut into batches here; pass it dense "
                            "(tf.sparse.to_dense) or as its index and value arrays")
        return np.asarray(d)

    if data is None:
        raise ValueError("AdaptiveDataset needs data: a numpy array, or a tuple or dict of them")
    structure = normalize(data)
    arrays = tf.nest.flatten(structure)
    if not arrays:
        raise ValueError("AdaptiveDataset got an empty structure: pass a numpy array, or a tuple or dict of them")
    for a in arrays:
        if a.ndim == 0:
            raise ValueError(f"AdaptiveDataset: every array needs a first (sample) dimension; got a scalar {a!r} "
                             "(lists count as tuples of arrays, not as arrays: pass np.array([...]) for one "
                             "array of samples)")
        try:
            tf.as_dtype(a.dtype)
            tf.convert_to_tensor(a[:1])  # an object array converts only if its items do
        except (TypeError, ValueError):
            raise TypeError(f"AdaptiveDataset: an array of dtype {a.dtype} cannot become a tensor; convert its "
                            "items to numbers, str or bytes") from None
    return structure, arrays


def _sample_count(arrays, size):
    lengths = sorted({len(a) for a in arrays})
    if len(lengths) > 1:
        raise ValueError(f"AdaptiveDataset: the arrays have different lengths {lengths}; every array needs "
                         "one row per sample")
    n = lengths[0]
    if n == 0:
        raise ValueError("AdaptiveDataset: the data has no samples")
    if n < size:
        raise ValueError(f"AdaptiveDataset: {n} samples cannot feed {size} workers (each needs at least one "
                         "sample in every batch)")
    return n


_WHOLE_BYTES = 64 << 20  # an array up to this size is checksummed whole (crc32 runs at about 1 GB/s)
_SAMPLES = 4096  # otherwise this many samples, evenly spaced (and fewer for arrays of Python objects)


def _fingerprint(arrays):
    """A checksum of the data's dtypes, shapes and values, to compare across workers: all of each array
    up to _WHOLE_BYTES, else _SAMPLES samples spread over it, the first and last among them."""
    n = len(arrays[0])
    crc = 0
    for a in arrays:
        crc = zlib.crc32(f"{a.dtype.str}{a.shape}".encode(), crc)
        if a.dtype != object and a.nbytes <= _WHOLE_BYTES:
            crc = zlib.crc32(np.ascontiguousarray(a).data, crc)
            continue
        count = _SAMPLES if a.dtype != object else _SAMPLES // 16
        for i in np.unique(np.linspace(0, n - 1, min(n, count)).astype(np.int64)):
            crc = zlib.crc32(_sample_bytes(a, int(i)), crc)
    return crc


def _sample_bytes(a, i):
    if a.dtype == object:  # its bytes are pointers, different in every process: use the items' values
        return repr(np.asarray(a[i], dtype=object).tolist()).encode()
    return np.ascontiguousarray(a[i]).tobytes()


_collecting_at_exit = False  # whether the atexit hook below is registered


def _register_collect_at_exit():
    """An iterator over as_dataset() left unfinished (a loop that breaks out, model.fit's epochs, which
    EpochCallback ends early) can sit in a reference cycle that holds the tf.data iterator. If no garbage
    collection frees it before the interpreter shuts down, TensorFlow finalizes the generator then: it logs
    "Error occurred when finalizing GeneratorDataset iterator", and exits were seen to hang. Collecting at
    exit, while Python still runs, frees it quietly."""
    global _collecting_at_exit
    if not _collecting_at_exit:
        _collecting_at_exit = True
        atexit.register(gc.collect)
