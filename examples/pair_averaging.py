"""Asynchronous pair averaging (AD-PSGD) with model.fit on scikit-learn's digits.

    kfrun -np 4 python examples/pair_averaging.py [--epochs=12 --batch_size=32]
    python examples/pair_averaging.py               (one worker: plain Keras training)

With PairAveragingOptimizer no worker waits for another: before each step a worker averages its model
with the latest model that one random peer has published, then applies its own gradients. The workers'
models therefore differ a little. For each epoch rank 0 prints the training and test accuracy (means
over the workers' models) and the spread: how far the workers' models are from their mean (the largest
relative L2 distance, ||w_rank - mean|| / ||mean||). At the end one all-reduce averages the models, so
every worker holds the same final model.

--final_epochs=N --final_strategy=sma|ssgd switches every worker to that strategy for the last N
epochs, from a callback at the same epoch on every worker, as a switch must be (the strategies'
collectives meet only when every worker runs the same one). The switch to S-SGD first sets every
worker's model and Adam's state to the workers' mean, so the spread is 0 from then on. SMA moves each
model only a fraction (alpha, 0.1) toward the mean at each step while each still takes its own
gradient step, so the spread settles at a level of its own, which can be above pair averaging's (on 2
workers a pair-averaging step averages fully with the only peer): end with ssgd for one model.
"""

import os

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

flags.DEFINE_integer("epochs", 12, "Passes over the training set.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Examples per step on each worker.", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.01, "Adam's learning rate (not scaled with the number of workers).")
flags.DEFINE_integer("final_epochs", 0, "Epochs at the end trained with --final_strategy (0: none; at most --epochs).",
                     lower_bound=0)
flags.DEFINE_enum("final_strategy", "sma", ["sma", "ssgd"], "The strategy of those epochs.")
flags.register_validator("learning_rate", lambda lr: lr > 0, "must be > 0")
flags.register_multi_flags_validator(["final_epochs", "epochs"], lambda f: f["final_epochs"] <= f["epochs"],
                                     "--final_epochs must be between 0 and --epochs")
FLAGS = flags.FLAGS


def digits_shard(rank, size):
    """This worker's share of the 1500 training images (every size-th one), and the whole test set."""
    x, y = load_digits(return_X_y=True)  # 1797 images, shipped inside scikit-learn
    order = np.random.RandomState(0).permutation(len(x))  # the same split on every worker
    x, y = (x[order] / 16.0).astype(np.float32), y[order]
    return x[rank:1500:size], y[rank:1500:size], x[1500:], y[1500:]


def spread(model):
    """max over workers of ||w - mean(w)|| / ||mean(w)||, w: the worker's weights as one vector."""
    w = np.concatenate([v.ravel() for v in model.get_weights()])
    mean = kungfu.all_reduce(w, op="mean").numpy()
    distance = np.array([np.linalg.norm(w - mean) / np.linalg.norm(mean)])
    return float(kungfu.all_reduce(distance, op="max").numpy()[0])


class Switch(keras.callbacks.Callback):
    """Sets the strategy for the last epochs; every worker calls it at the same epoch."""

    def __init__(self, optimizer, first_epoch, strategy):
        super().__init__()
        self.optimizer, self.first_epoch, self.strategy = optimizer, first_epoch, strategy

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.first_epoch:
            self.optimizer.strategy = self.strategy


class Report(keras.callbacks.Callback):
    """One line per epoch on rank 0; every worker takes part in the spread's all-reduces."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer = optimizer

    def on_epoch_end(self, epoch, logs=None):
        apart = spread(self.model)
        if kungfu.rank() == 0:
            print(f"epoch {epoch + 1:2d}/{FLAGS.epochs} {self.optimizer.strategy:<14} loss {logs['loss']:.3f}  "
                  f"accuracy {logs['accuracy']:.3f}  test accuracy {logs['val_accuracy']:.3f}  spread {apart:.4f}",
                  flush=True)


def main(argv):
    del argv
    kungfu.init()
    rank, size = kungfu.rank(), kungfu.size()
    x, y, x_test, y_test = digits_shard(rank, size)

    keras.utils.set_random_seed(rank)  # a different initial model on every worker, until the broadcast
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    # Each worker steps with its own gradients, from a batch of batch_size examples: its learning
    # rate is that of one process training with this batch size; nothing is scaled with size().
    opt = kungfu.optimizers.PairAveragingOptimizer(keras.optimizers.Adam(FLAGS.learning_rate))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [kf_callbacks.BroadcastGlobalVariablesCallback(root=0),  # the same start everywhere
                 kf_callbacks.MetricAverageCallback(),  # logs: the means over the workers
                 Report(opt)]
    if FLAGS.final_epochs:
        callbacks.append(Switch(opt, FLAGS.epochs - FLAGS.final_epochs, FLAGS.final_strategy))
    if rank == 0:
        print(f"pair averaging on {size} worker(s), {len(x)} training images each", flush=True)
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, validation_data=(x_test, y_test),
              callbacks=callbacks, verbose=0)

    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    accuracies = kungfu.all_gather(np.array([accuracy])).numpy()
    model.set_weights([kungfu.all_reduce(w, op="mean").numpy() for w in model.get_weights()])
    _, mean_accuracy = model.evaluate(x_test, y_test, verbose=0)
    if rank == 0:
        print("test accuracy of each worker's model: " + ", ".join(f"{a:.3f}" for a in accuracies))
        print(f"test accuracy of the workers' mean model, now on every worker: {mean_accuracy:.3f}")


if __name__ == "__main__":
    app.run(main)
