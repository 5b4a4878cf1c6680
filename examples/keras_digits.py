"""Synchronous SGD with model.fit on scikit-learn's digits (8x8 images of handwritten digits).

    kfrun -np 4 python examples/keras_digits.py [--epochs=20 --batch_size=32 --out=DIR]
    python examples/keras_digits.py                 (one worker: plain Keras training)

Every worker trains on its own shard of the training set and SynchronousSGDOptimizer averages the
gradients over the workers at each step. Each worker builds its model from its own random seed, as
separate processes would; BroadcastGlobalVariablesCallback makes them start identical (rank 0 prints
the check), and identical they stay. MetricAverageCallback makes the logged loss and accuracy the
workers' mean. Only rank 0 shows the progress bar and writes the checkpoint.
"""

import os
import tempfile

# Hides TF's C++ INFO and WARNING logs; TF 2.21's oneDNN start-up notice shows regardless (it comes before TF
# sets up logging: only TF_ENABLE_ONEDNN_OPTS=0, oneDNN off, drops it).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import kungfu  # noqa: E402
from kungfu.keras import callbacks as kf_callbacks  # noqa: E402

flags.DEFINE_integer("epochs", 20, "Passes over the training set.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Examples per step on each worker; the global batch is size() times that.",
                     lower_bound=1)
flags.DEFINE_float("learning_rate", 0.003, "Adam's learning rate (not scaled with the number of workers).")
flags.DEFINE_string("out", None, "Directory for rank 0's checkpoint (default: a new temporary directory).")
flags.register_validator("learning_rate", lambda lr: lr > 0, "must be > 0")
FLAGS = flags.FLAGS


def digits_shard(rank, size):
    """This worker's share of the 1500 training images (every size-th one), and the whole test set."""
    x, y = load_digits(return_X_y=True)  # 1797 images, shipped inside scikit-learn
    order = np.random.RandomState(0).permutation(len(x))  # the same split on every worker
    x, y = (x[order] / 16.0).astype(np.float32), y[order]
    return x[rank:1500:size], y[rank:1500:size], x[1500:], y[1500:]


def flat_weights(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


class ReportIdentical(keras.callbacks.Callback):
    """Asks every worker whether all hold the same weights (kungfu.consensus); rank 0 prints it.
    Listed after BroadcastGlobalVariablesCallback, its on_train_begin sees the broadcast's result."""

    def on_train_begin(self, logs=None):
        same = bool(kungfu.consensus(flat_weights(self.model)))
        if kungfu.rank() == 0:
            print(f"after the broadcast, the {kungfu.size()} worker(s) start identical: {same}", flush=True)


def main(argv):
    del argv
    kungfu.init()
    rank, size = kungfu.rank(), kungfu.size()
    x, y, x_test, y_test = digits_shard(rank, size)

    keras.utils.set_random_seed(rank)  # a different initial model on every worker, until the broadcast
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    same = bool(kungfu.consensus(flat_weights(model)))  # a collective: every worker calls it, rank 0 prints
    if rank == 0:
        print(f"before the broadcast, the workers' initial models are identical: {same}", flush=True)

    # Learning rate and batch: each step applies the mean gradient of a global batch of
    # size * batch_size examples, and an epoch takes size times fewer steps than on one worker.
    # Nothing is scaled for you: with plain SGD the usual rule is learning_rate * size (with a warm-up);
    # Adam, used here, is less sensitive to the batch size, so one rate works for 1 to 4 workers.
    opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.Adam(FLAGS.learning_rate))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    callbacks = [kf_callbacks.BroadcastGlobalVariablesCallback(root=0), ReportIdentical(),
                 kf_callbacks.MetricAverageCallback()]  # before the checkpoint, which then sees the mean
    if rank == 0:  # the workers' models are the same: one of them writes the checkpoint
        out = FLAGS.out or tempfile.mkdtemp(prefix="kungfu_digits_")
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "digits.weights.h5")
        callbacks.append(keras.callbacks.ModelCheckpoint(path, save_weights_only=True))
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, callbacks=callbacks,
              verbose=1 if rank == 0 else 0)

    _, accuracy = model.evaluate(x_test, y_test, verbose=0)  # the same model everywhere: the same result
    same = bool(kungfu.consensus(flat_weights(model)))
    if rank == 0:
        print(f"test accuracy: {accuracy:.3f} ({len(x_test)} images not trained on)")
        print(f"after training, the workers' models are identical: {same}")
        print(f"rank 0 wrote the checkpoint {path} (model.load_weights reads it back)")


if __name__ == "__main__":
    app.run(main)
