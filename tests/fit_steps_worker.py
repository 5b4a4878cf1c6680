"""The worker of test_training_mp.py's epoch-end checks, started by kfrun on 2 workers. Not a test module.

    python -m kungfu.launcher -np 2 --timeout 5 -- python tests/fit_steps_worker.py CASE

Rank 1's data gives one batch more than rank 0's, in a way fit's count of steps per epoch, compared before
the first step, does not show. CASE:
  unknown       datasets of unknown length (a .filter()): fit knows no count;
  arrays        arrays of 9 and 8 rows, batch 4, steps_per_epoch=2: Keras keeps the arrays' iterator across
                epochs, so rank 0's epoch 1 ends after one batch ("ran out of data") and rank 1's after two;
  dataset       datasets of 4 and 5 batches, not repeated, steps_per_epoch=5: rank 0's epoch 0 ends at the
                fetch that finds its data exhausted;
  stopped       the same data everywhere, but a callback listed before BroadcastGlobalVariablesCallback stops
                rank 0's fit after epoch 0 (EarlyStopping judging its own shard): rank 1's epoch-end check
                must say first that another worker left training, not that its own data ran out.
BroadcastGlobalVariablesCallback compares the batches begun at each epoch's end: the worker whose data ran
out first must raise ValueError there saying why (after KUNGFU_TIMEOUT), and never start its next epoch with
the other's extra batch as its partner (which, with the same shapes, trained on silently); the other fails
in its extra step. Prints one KFCHECK line per worker (tests/mp.py).
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import sys  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
from kungfu.keras import callbacks as kf_callbacks  # noqa: E402

BATCH = 4


def _data(case, rank):
    """(fit's data arguments, the epoch where rank 0 runs out)."""
    if case == "arrays":
        x = np.random.RandomState(rank).normal(size=(9 - rank, 3)).astype(np.float32)  # rank 0: 4 + 4 + 1 rows
        return dict(x=x, y=x[:, :1], batch_size=BATCH, steps_per_epoch=2), 1
    x = np.random.RandomState(rank).normal(size=((4 + rank) * BATCH, 3)).astype(np.float32)  # 4 and 5 batches
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1]))
    if case == "unknown":
        ds = ds.filter(lambda a, b: True).batch(BATCH)
        assert ds.cardinality() == tf.data.UNKNOWN_CARDINALITY
        return dict(x=ds), 0
    assert case == "dataset", case
    return dict(x=ds.batch(BATCH), steps_per_epoch=5), 0


def epochs_that_end_apart_fail():
    rank = kungfu.rank()
    data, short_epoch = _data(sys.argv[1], rank)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    epochs = []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

    try:
        model.fit(**data, epochs=3, verbose=0, callbacks=[kf_callbacks.BroadcastGlobalVariablesCallback(0), Epochs()])
    except ValueError as e:
        if rank != 0 or f"epoch {short_epoch} ran out of data" not in str(e):
            raise AssertionError(f"unexpected ValueError on rank {rank}: {e}") from e
    except tf.errors.OpError as e:
        if rank != 1:
            raise AssertionError(f"unexpected {type(e).__name__} on rank {rank}: {e.message}") from e
    else:
        raise AssertionError("fit with epochs of different lengths did not raise")
    if epochs != list(range(short_epoch + 1)):
        raise AssertionError(f"rank {rank} began epochs {epochs}: it trained past epoch {short_epoch}")


def a_worker_that_stops_alone_is_named():
    rank = kungfu.rank()
    x = np.random.RandomState(rank).normal(size=(2 * BATCH, 3)).astype(np.float32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1)), loss="mse")

    class StopRank0(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = self.model.stop_training or rank == 0

    callbacks = [StopRank0(), kf_callbacks.BroadcastGlobalVariablesCallback(0)]
    try:
        model.fit(x, x[:, :1], batch_size=BATCH, epochs=3, verbose=0, callbacks=callbacks)
    except ValueError as e:
        if rank != 1 or "another worker left training before this worker's epoch 0 ended" not in str(e) or \
                "rank 0" not in str(e):
            raise AssertionError(f"unexpected ValueError on rank {rank}: {e}") from e
    else:
        if rank != 0:
            raise AssertionError("rank 1 trained on after rank 0 stopped")


def main():
    kungfu.init()
    check = a_worker_that_stops_alone_is_named if sys.argv[1] == "stopped" else epochs_that_end_apart_fail
    sys.exit(1 if mp.run_checks([check], kungfu.rank()) else 0)


if __name__ == "__main__":
    main()
