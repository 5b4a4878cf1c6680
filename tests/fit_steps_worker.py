"""The worker of test_training_mp.py's unknown-length check, started twice by kfrun. Not a test module.

    python -m kungfu.launcher -np 2 --timeout 5 -- python tests/fit_steps_worker.py

Each worker's dataset has no known length (a .filter()), and rank 1's gives one batch more, so fit
cannot compare the step counts before it starts. BroadcastGlobalVariablesCallback compares them at the
epoch's end instead: rank 0, whose data ran out first, must raise ValueError there saying why (after
KUNGFU_TIMEOUT), and never start epoch 1 with rank 1's extra batch as its partner; rank 1 fails in its
extra step. Prints one KFCHECK line per worker (tests/mp.py).
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


def epochs_of_unknown_length_that_end_apart_fail():
    rank = kungfu.rank()
    rows = (4 + rank) * BATCH  # rank 0: 4 batches, rank 1: 5
    x = np.random.RandomState(rank).normal(size=(rows, 3)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).filter(lambda a, b: True).batch(BATCH)
    assert ds.cardinality() == tf.data.UNKNOWN_CARDINALITY
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    epochs = []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

    try:
        model.fit(ds, epochs=3, verbose=0, callbacks=[kf_callbacks.BroadcastGlobalVariablesCallback(0), Epochs()])
    except ValueError as e:
        if rank != 0 or "epoch 0 ran out of data" not in str(e):
            raise AssertionError(f"unexpected ValueError on rank {rank}: {e}") from e
    except tf.errors.OpError as e:
        if rank != 1:
            raise AssertionError(f"unexpected {type(e).__name__} on rank {rank}: {e.message}") from e
    else:
        raise AssertionError("fit with epochs of different lengths did not raise")
    if epochs != [0]:
        raise AssertionError(f"rank {rank} began epochs {epochs}: it trained past the first one")


def main():
    kungfu.init()
    sys.exit(1 if mp.run_checks([epochs_of_unknown_length_that_end_apart_fail], kungfu.rank()) else 0)


if __name__ == "__main__":
    main()
