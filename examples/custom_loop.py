"""A custom training loop: tf.GradientTape in a tf.function, with kungfu.DistributedGradientTape.

    kfrun -np 4 python examples/custom_loop.py [--epochs=5 --batch_size=32 --steps_per_epoch=30]
    python examples/custom_loop.py                  (one worker: plain TensorFlow training)

A small CNN learns to classify synthetic 16x16 images: each of 10 classes is a fixed random pattern,
and every image is its class's pattern under heavy noise. Each worker draws its own images (its shard
of an endless data set). DistributedGradientTape averages the gradients over the workers, so every
worker applies the same update; kungfu.broadcast_variables first makes their models and optimizer
states equal. For each epoch rank 0 prints the loss and training accuracy (means over the workers)
and the images per second of the whole cluster.
"""

import os
import time

# Hides TF's C++ INFO and WARNING logs; TF 2.21's oneDNN start-up notice shows regardless (it comes before TF
# sets up logging: only TF_ENABLE_ONEDNN_OPTS=0, oneDNN off, drops it).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import kungfu  # noqa: E402

flags.DEFINE_integer("epochs", 5, "Epochs to train.", lower_bound=1)
flags.DEFINE_integer("steps_per_epoch", 30, "Steps per epoch.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Images per step on each worker; the global batch is size() times that.",
                     lower_bound=1)
flags.DEFINE_float("learning_rate", 0.003, "Adam's learning rate (not scaled with the number of workers).")
flags.register_validator("learning_rate", lambda lr: lr > 0, "must be > 0")
FLAGS = flags.FLAGS

SIDE, CLASSES = 16, 10


def synthetic_images(rank, batch_size):
    """An endless tf.data stream of (images, labels) batches; each worker draws different images."""
    patterns = np.random.RandomState(0).normal(size=(CLASSES, SIDE, SIDE, 1)).astype(np.float32)  # the same everywhere
    rng = np.random.RandomState(1 + rank)

    def batches():
        while True:
            labels = rng.randint(0, CLASSES, size=batch_size)
            noise = rng.normal(scale=2.5, size=(batch_size, SIDE, SIDE, 1)).astype(np.float32)
            yield patterns[labels] + noise, labels.astype(np.int32)

    spec = (tf.TensorSpec([batch_size, SIDE, SIDE, 1], tf.float32), tf.TensorSpec([batch_size], tf.int32))
    return tf.data.Dataset.from_generator(batches, output_signature=spec).prefetch(2)


def make_model():
    return keras.Sequential([
        keras.Input((SIDE, SIDE, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(CLASSES),
    ])


def main(argv):
    del argv
    kungfu.init()
    rank, size = kungfu.rank(), kungfu.size()

    keras.utils.set_random_seed(rank)  # a different initial model on every worker, until the broadcast
    model = make_model()
    # A plain optimizer: DistributedGradientTape already averages the gradients (a kungfu optimizer
    # wrapper would average them a second time). The learning rate is not scaled with size(): each
    # step applies the mean gradient of size * batch_size images; with plain SGD, the usual rule is
    # learning_rate * size.
    opt = keras.optimizers.Adam(FLAGS.learning_rate)
    opt.build(model.trainable_variables)  # create the optimizer's variables now, so they can be broadcast
    # Trainable variables only: model.variables also holds the seed generators' state (docs/training.md).
    kungfu.broadcast_variables(model.trainable_variables + opt.variables, root=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = loss_fn(labels, logits)
        tape = kungfu.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)  # the mean over every worker
        opt.apply_gradients(zip(grads, model.trainable_variables))
        correct = tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), labels)
        return loss, tf.reduce_mean(tf.cast(correct, tf.float32))

    data = iter(synthetic_images(rank, FLAGS.batch_size))
    if rank == 0:
        print(f"training a CNN of {model.count_params()} weights on {size} worker(s), "
              f"global batch {size * FLAGS.batch_size} images", flush=True)
    for epoch in range(1, FLAGS.epochs + 1):
        start, results = time.perf_counter(), []
        for _ in range(FLAGS.steps_per_epoch):
            results.append(train_step(*next(data)))
        seconds = time.perf_counter() - start
        loss, accuracy = kungfu.all_reduce(tf.reduce_mean(results, axis=0), op="mean").numpy()  # over the workers
        seconds = float(kungfu.all_reduce(seconds, op="max"))  # the slowest worker sets the pace
        if rank == 0:
            rate = size * FLAGS.batch_size * FLAGS.steps_per_epoch / seconds
            note = " (includes tracing the step)" if epoch == 1 else ""
            print(f"epoch {epoch}/{FLAGS.epochs}: loss {loss:.3f}, accuracy {accuracy:.3f}, {rate:.0f} images/s{note}",
                  flush=True)
    same = bool(kungfu.consensus(tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)))
    if rank == 0:
        print(f"the workers' models are identical: {same}")


if __name__ == "__main__":
    app.run(main)
