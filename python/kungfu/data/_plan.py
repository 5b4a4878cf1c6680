"""How an AdaptiveDataset cuts an epoch into global batches, and a global batch into the workers' parts.

Plain numpy and Python, no TensorFlow and no communication: every worker calls these functions with
the same inputs (the sample count, the seed, the epoch number, the global batch size, the number of
workers) and so reaches the same plan on its own. Only `rank` differs, and it picks a disjoint part.

The rules:
- An epoch is a permutation of the n samples: np.random.default_rng([seed, epoch]).permutation(n),
  or 0..n-1 in order when shuffle is off.
- A step takes the next B samples of it, B being the global batch size at that moment.
- No worker may get an empty batch (a mean loss over 0 samples is NaN, and the all-reduce would spread
  it to every worker). So when fewer than `size` samples would be left after a batch, that tail joins
  the batch: the last batch of an epoch has between `size` and B + size - 1 samples. A batch size
  larger than what is left takes what is left (a batch never crosses an epoch's end).
- A global batch of `take` samples is split like numpy.array_split: contiguous parts in rank order,
  the first take % size workers getting one sample more than the others.
"""

import numbers

import numpy as np


def check_batch_size(n, size):
    """n as a Python int, or TypeError / ValueError saying why it cannot be a global batch size."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"the global batch size must be an int, got {n!r} ({type(n).__name__})")
    n = int(n)
    if n < size:
        raise ValueError(f"the global batch size must be at least the number of workers ({size}), so that "
                         f"no worker gets an empty batch; got {n}")
    return n


def check_seed(seed):
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise TypeError(f"seed must be an int >= 0, the same on every worker (so that the workers shuffle "
                        f"alike); got {seed!r}")
    return int(seed)


def permutation(n, seed, epoch, shuffle):
    """The order of the n samples in epoch `epoch` (0-based): the same on every worker."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def next_batch(remaining, batch_size, size):
    """How many samples the next global batch takes when `remaining` (>= size) are left in the epoch."""
    if remaining - batch_size < size:  # the rest fits, or what would be left cannot feed every worker
        return remaining
    return batch_size


def batches_left(remaining, batch_size, size):
    """How many batches the rest of the epoch takes if the batch size stays batch_size."""
    full, tail = divmod(remaining, batch_size)
    if tail == 0:
        return full
    if tail < size and full > 0:  # the tail joins the last full batch
        return full
    return full + 1


def worker_slice(take, size, rank):
    """[lo, hi): worker rank's part of a global batch of `take` samples, as numpy.array_split cuts it."""
    base, extra = divmod(take, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)
