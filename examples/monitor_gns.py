"""The gradient noise scale, gradient variance and signal-to-noise ratio of synchronous SGD as training goes,
on scikit-learn's digits (8x8 images of handwritten digits), and a plot of them.

    kfrun -np 4 python examples/monitor_gns.py [--epochs=12 --batch_size=32 --out=DIR]
    python examples/monitor_gns.py                 (one worker: a rougher estimate, see below)

SynchronousSGDOptimizer(monitor=["gns", "variance", "snr"], local_batch_size=...) computes the monitors inside
the training step: each worker's squared gradient norm rides along in the gradients' all-reduce, and from it
and the squared norm of the averaged gradient come
  - gns, the simple noise scale B_simple = tr(Sigma) / |G|^2 (smoothed): the batch size at which the noise
    of a gradient estimate is about as large as the gradient itself. Batches well below it train about as
    well per sample; batches far above it waste samples. It usually grows as the loss falls;
  - grad_variance, the spread of the workers' gradients around their mean at this step;
  - snr, |G|^2 / (tr(Sigma) / global batch): the applied gradient's signal-to-noise ratio.
Every worker computes the same values (from all-reduced inputs). kungfu.monitor.latest() reads them; here a
small callback records them after every monitored step, rank 0 prints them once per epoch and draws
gns, loss and grad_variance over the steps into <out>/monitor_gns.png.

gns reads 0 ("no estimate") until the first estimate, and again whenever the smoothed estimate of |G|^2
is <= 0: late in training the true gradient is small against the noise of these batches, so the noise
scale is larger than they can measure (the plot leaves those steps out). Rank 0 says so when it happens.

One worker has no second batch size to compare: the wrapper pairs each step's gradients with the previous
step's instead, a biased estimate (docs/monitoring.md, "One worker"), and grad_variance is then the spread
between consecutive steps, not between workers.
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
import kungfu.monitor  # noqa: E402
from kungfu.keras import callbacks as kf_callbacks  # noqa: E402

flags.DEFINE_integer("epochs", 12, "Passes over the training set.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Examples per step on each worker; the global batch is size() times that.",
                     lower_bound=1)
flags.DEFINE_float("learning_rate", 0.05, "SGD's learning rate (momentum 0.9).")
flags.DEFINE_integer("monitor_interval", 1, "Run the gradient monitors every this many steps.", lower_bound=1)
flags.DEFINE_string("out", None, "Directory for rank 0's plot (default: a new temporary directory).")
flags.register_validator("learning_rate", lambda lr: lr > 0, "must be > 0")
FLAGS = flags.FLAGS


def digits_shard(rank, size, batch):
    """This worker's share of the 1500 training images (every size-th one), cut to whole batches: the
    monitors take every batch to hold local_batch_size examples."""
    x, y = load_digits(return_X_y=True)  # 1797 images, shipped inside scikit-learn
    order = np.random.RandomState(0).permutation(len(x))  # the same split on every worker
    x, y = (x[order] / 16.0).astype(np.float32), y[order]
    x, y = x[rank:1500:size], y[rank:1500:size]
    n = len(x) // batch * batch
    if n == 0:
        raise app.UsageError(f"--batch_size={batch} is more than this worker's {len(x)} training images")
    return x[:n], y[:n]


class RecordMonitors(keras.callbacks.Callback):
    """Records kungfu.monitor.latest() after every monitored step and the epoch's mean loss, and prints
    them once per epoch on rank 0. Reading the values after each step waits for that step, so Keras
    loses its asynchronous batch dispatch: fine for a small example, not for a fast training job, where
    MonitorCallback (once per epoch) is the cheaper choice."""

    def __init__(self, interval, epochs):
        super().__init__()
        self.interval, self.epochs = interval, epochs
        self.step = 0  # steps done so far, over all epochs
        self.steps, self.values = [], []  # per monitored step: its number, latest()
        self.epoch_steps, self.epoch_loss = [], []  # per epoch: steps done at its end, mean loss
        self.lost = False  # whether rank 0 already said that gns went back to 0

    def on_train_batch_end(self, batch, logs=None):
        if self.step % self.interval == 0:  # the monitors ran at this step (iterations % k == 0)
            self.steps.append(self.step + 1)
            self.values.append(kungfu.monitor.latest(self.model.optimizer))
        self.step += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_steps.append(self.step)
        self.epoch_loss.append(float(logs["loss"]))
        if kungfu.rank() == 0:
            v = self.values[-1]
            print(f"epoch {epoch + 1:2d}/{self.epochs} step {self.step:4d}: loss {logs['loss']:.4f}  "
                  f"gns {v['gns']:8.1f}  grad_variance {v['grad_variance']:.4g}  snr {v['snr']:.4f}  "
                  f"({v['samples_per_sec']:.0f} samples/s)", flush=True)
            if v["gns"] == 0 and not self.lost and any(u["gns"] > 0 for u in self.values):
                self.lost = True
                print("  gns 0 again: the smoothed |G|^2 estimate is <= 0, the gradient is lost in the noise "
                      "of these batches (no estimate; the noise scale is beyond what they can measure)", flush=True)


def plot(rec, path, size, global_batch):
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    gns = [v["gns"] if v["gns"] > 0 else float("nan") for v in rec.values]  # 0: no estimate, left out
    variance = [v["grad_variance"] for v in rec.values]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(rec.steps, gns, color="tab:blue")
    axes[0].axhline(global_batch, color="gray", linestyle="--", label=f"global batch ({global_batch})")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("gradient noise scale\n(B_simple, log scale)")
    axes[0].legend(loc="upper left")
    axes[1].plot(rec.epoch_steps, rec.epoch_loss, marker="o", color="tab:red")
    axes[1].set_ylabel("loss (epoch mean)")
    axes[2].plot(rec.steps, variance, color="tab:green")
    axes[2].set_ylabel("gradient variance\nacross workers")
    axes[2].set_xlabel("step")
    fig.suptitle(f"S-SGD on digits, {size} worker(s)" + ("" if size > 1 else ": one worker, consecutive steps"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv):
    del argv
    kungfu.init()
    rank, size = kungfu.rank(), kungfu.size()
    x, y = digits_shard(rank, size, FLAGS.batch_size)
    if rank == 0:
        print(f"{size} worker(s), {FLAGS.batch_size} examples per worker per step, global batch "
              f"{size * FLAGS.batch_size}", flush=True)
        if size == 1:
            print("one worker: no second batch size to compare, so the monitors pair consecutive steps, a "
                  "biased estimate; run it with kfrun -np 4 for the workers' own", flush=True)

    keras.utils.set_random_seed(rank)  # different initial models, made identical by the broadcast
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(FLAGS.learning_rate, momentum=0.9),
                                                    monitor=["gns", "variance", "snr"],
                                                    monitor_interval=FLAGS.monitor_interval,
                                                    local_batch_size=FLAGS.batch_size)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rec = RecordMonitors(FLAGS.monitor_interval, FLAGS.epochs)
    callbacks = [kf_callbacks.BroadcastGlobalVariablesCallback(root=0),
                 kf_callbacks.MetricAverageCallback(),  # the workers' mean loss, before rec reads it
                 rec]
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, callbacks=callbacks, verbose=0)

    if rank == 0:
        out = FLAGS.out or tempfile.mkdtemp(prefix="kungfu_gns_")
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "monitor_gns.png")
        plot(rec, path, size, size * FLAGS.batch_size)
        final = rec.values[-1]
        print(f"final: gns {final['gns']:.1f} (global batch {size * FLAGS.batch_size}), "
              f"grad_variance {final['grad_variance']:.4g}, snr {final['snr']:.4f}")
        print(f"wrote the plot {path}")


if __name__ == "__main__":
    app.run(main)
