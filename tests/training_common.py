"""The data, model and single-process reference shared by the training checks (training_worker.py,
training_strategy_checks.py). Every worker computes every global batch and the reference itself."""

import keras
import numpy as np

import kungfu

STEPS, LOCAL_BATCH, FEATURES, CLASSES = 20, 8, 12, 5
TOLERANCE = 1e-5


def dataset(size):
    """STEPS global batches of size * LOCAL_BATCH rows, the same on every process."""
    rng = np.random.RandomState(7)
    x = rng.normal(size=(STEPS * size * LOCAL_BATCH, FEATURES)).astype(np.float32)
    y = rng.randint(0, CLASSES, size=len(x)).astype(np.int64)
    return x, y


def shard(a, rank, size):
    """This worker's rows of every global batch: rows [r*b, (r+1)*b) of each block of size*b."""
    blocks = a.reshape(STEPS, size, LOCAL_BATCH, *a.shape[1:])
    return blocks[:, rank].reshape(STEPS * LOCAL_BATCH, *a.shape[1:])


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference_weights(make_optimizer, seed=100):
    """One process, no cluster, plain optimizer, on the whole global batches."""
    x, y = dataset(kungfu.size())
    model = make_model(seed)
    model.compile(optimizer=make_optimizer(), loss=loss_fn())
    model.fit(x, y, batch_size=kungfu.size() * LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def assert_close(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        err = float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) if np.size(w) else 0.0
        if not err <= TOLERANCE:
            raise AssertionError(f"{what}: weight {i} differs from the single-process reference by {err:g}")


def local_data():
    x, y = dataset(kungfu.size())
    return shard(x, kungfu.rank(), kungfu.size()), shard(y, kungfu.rank(), kungfu.size())


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def adam():
    return keras.optimizers.Adam(0.01)
