"""An ordinary training step made distributed by kungfu.rewrite, its code unchanged.

    kfrun -np 4 python examples/rewrite_step.py [--epochs=20 --batch_size=32 --out=DIR]
    python examples/rewrite_step.py                 (one worker: plain training)

train_step below is plain TensorFlow and Keras: a tf.GradientTape and opt.apply_gradients, nothing of
kungfu in it. kungfu.rewrite(train_step) traces it, finds its gradients in the traced graph and inserts
KungFu collectives on them (S-SGD: each gradient becomes its mean over the workers), so every worker
applies the same update to the same model. The data is scikit-learn's digits (8x8 images of handwritten
digits; synthetic look-alikes if scikit-learn is not installed), each worker training on its own
shard. Rank 0 prints what the rewrite inserted, then the loss and accuracy of every epoch; with --out it
saves the weights (rank 0 only: the models are the same on every worker).
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

flags.DEFINE_integer("epochs", 20, "Epochs to train.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Images per step on each worker; the global batch is size() times that "
                     "(at most each worker's share of the 1500 training images).", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.003, "Adam's learning rate.")
flags.DEFINE_string("out", "", "Directory for rank 0 to save the trained weights in; nothing is saved if empty.")
flags.register_validator("learning_rate", lambda lr: lr > 0, "must be > 0")
FLAGS = flags.FLAGS

TEST_IMAGES = 297  # held out of the 1797 digits; every worker evaluates on the same ones


def load_digits():
    """(images, labels, where from): 1797 8x8 digits as 64 floats in [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:  # look-alikes: a fixed random pattern per class, under noise
        rng = np.random.RandomState(0)
        patterns = rng.uniform(size=(10, 64))
        labels = rng.randint(0, 10, size=1797)
        images = np.clip(patterns[labels] + rng.normal(scale=0.6, size=(1797, 64)), 0, 1)
        return images.astype(np.float32), labels.astype(np.int32), "synthetic digits (scikit-learn not installed)"
    x, y = sklearn_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int32), "scikit-learn's digits"


def make_model():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def broadcast_from_rank_0(variables):
    """Every worker starts from rank 0's values: one eager broadcast per variable, in the same order everywhere."""
    for v in variables:
        v.assign(kungfu.broadcast(v, root=0))


def main(argv):
    del argv
    kungfu.init()
    rank, size = kungfu.rank(), kungfu.size()
    x, y, source = load_digits()
    order = np.random.RandomState(42).permutation(len(x))  # the same split on every worker
    test, train = order[:TEST_IMAGES], order[TEST_IMAGES:]
    shard = train[rank::size]  # this worker's images
    steps_per_epoch = (len(train) // size) // FLAGS.batch_size  # the same on every worker
    if steps_per_epoch == 0:
        raise app.UsageError(f"--batch_size={FLAGS.batch_size} is more than each worker's {len(train) // size} "
                             f"training images ({size} worker(s))")

    keras.utils.set_random_seed(rank)  # a different initial model on every worker, until the broadcast
    model = make_model()
    opt = keras.optimizers.Adam(FLAGS.learning_rate)
    opt.build(model.trainable_variables)  # create the optimizer's variables now, so they can be broadcast
    # Trainable variables only: model.variables also holds the seed generators' state (docs/training.md).
    broadcast_from_rank_0(model.trainable_variables + opt.variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(images, labels):  # an ordinary training step: nothing distributed in it
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = loss_fn(labels, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        correct = tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), labels)
        return loss, tf.reduce_mean(tf.cast(correct, tf.float32))

    step = kungfu.rewrite(train_step, strategy="ssgd")  # the same step, gradients averaged over the workers

    batch = (x[shard[:FLAGS.batch_size]], y[shard[:FLAGS.batch_size]])
    report = step.report(*batch)  # rewrites the step for this input signature (every batch has this shape)
    if rank == 0:
        print(f"{source}: {len(train)} training images over {size} worker(s) (global batch "
              f"{size * FLAGS.batch_size}), {TEST_IMAGES} test images", flush=True)
        print(f"kungfu.rewrite(train_step): {report}", flush=True)
    rng = np.random.RandomState(1 + rank)
    for epoch in range(1, FLAGS.epochs + 1):
        start, results = time.perf_counter(), []
        rng.shuffle(shard)
        for s in range(steps_per_epoch):
            chosen = shard[s * FLAGS.batch_size:(s + 1) * FLAGS.batch_size]
            results.append(step(x[chosen], y[chosen]))
        loss, accuracy = kungfu.all_reduce(tf.reduce_mean(results, axis=0), op="mean").numpy()  # over the workers
        seconds = float(kungfu.all_reduce(time.perf_counter() - start, op="max"))
        if rank == 0:
            logits = model(x[test], training=False)
            test_accuracy = float(np.mean(np.argmax(logits, axis=1) == y[test]))
            print(f"epoch {epoch}/{FLAGS.epochs}: loss {loss:.3f}, train accuracy {accuracy:.3f}, "
                  f"test accuracy {test_accuracy:.3f} ({seconds:.2f} s)", flush=True)
    same = bool(kungfu.consensus(tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)))
    if rank == 0:
        print(f"the workers' models are identical: {same}", flush=True)
        if FLAGS.out:
            os.makedirs(FLAGS.out, exist_ok=True)
            path = os.path.join(FLAGS.out, "rewrite_step.weights.h5")
            model.save_weights(path)
            print(f"saved the weights to {path}", flush=True)


if __name__ == "__main__":
    app.run(main)
