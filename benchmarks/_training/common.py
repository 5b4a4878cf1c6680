"""What every training worker shares, so that all systems train the same model on the same data and are
timed the same way.

The driver passes the plan through the environment (PLAN_ENV, JSON): the models, the per-worker batch,
steps per epoch, warm-up and timed epochs, the output folder and the series name. A worker trains each
model with model.fit for warmup + epochs epochs of `steps` steps and writes one JSON file per rank:
    {model: {"epochs": [seconds of each timed epoch, ...], "weights": digest, ...extra counters}}

Timing: an epoch-hook callback (EpochTimer). Only epoch hooks are overridden, so Keras keeps its
asynchronous batch dispatch, exactly as in a user's fit; each epoch ends with Keras turning the logs into
Python numbers, which waits for the epoch's last step, so an epoch's time covers all of its steps. The
warm-up epochs (tracing, first collectives, connection set-up) are dropped.

Data: synthetic, made once per process from a fixed seed per rank and kept in memory (tf.data from_tensor_slices,
batch, cache, repeat), so input costs are the same small memcpy for every system and nothing is downloaded.
"""
import json
import os
import time

PLAN_ENV = 'KF_TRAIN_PLAN'
MODELS = ('mlp', 'cnn')
CLASSES = 10
DISTINCT_BATCHES = 8  # batches of distinct random rows; the dataset cycles through them


def load_plan():
    return json.loads(os.environ[PLAN_ENV])


def input_shape(name):
    return {'mlp': (784,), 'cnn': (28, 28, 1)}[name]


def build_model(name, seed=1):
    """mlp: 784-512-512-10 (0.67 M parameters, 2.7 MB of float32 gradients).
    cnn: conv32-pool-conv64-pool-dense128-dense10 on 28x28x1 (0.23 M parameters, 0.9 MB, far more compute
    per parameter)."""
    import keras
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    if name == 'mlp':
        body = [layers.Dense(512, activation='relu'), layers.Dense(512, activation='relu')]
    elif name == 'cnn':
        body = [layers.Conv2D(32, 3, activation='relu'), layers.MaxPooling2D(),
                layers.Conv2D(64, 3, activation='relu'), layers.MaxPooling2D(), layers.Flatten(),
                layers.Dense(128, activation='relu')]
    else:
        raise ValueError('unknown model %r; choose from %s' % (name, ', '.join(MODELS)))
    return keras.Sequential([keras.Input(input_shape(name))] + body + [layers.Dense(CLASSES)], name=name)


def compile_model(model, optimizer):
    import keras
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def plain_sgd():
    import keras
    return keras.optimizers.SGD(0.01, momentum=0.9)


def arrays(name, rows, rank=0):
    """Random inputs in [0, 1) and labels; every rank draws its own, so workers train on different data."""
    import numpy as np
    rng = np.random.RandomState(7 + rank)
    x = rng.uniform(size=(rows,) + input_shape(name)).astype(np.float32)
    return x, rng.randint(0, CLASSES, size=rows).astype(np.int64)


def dataset(name, batch, rank=0, shard_options=None):
    """Endless batches of `batch` rows. shard_options: tf.data.Options for a tf.distribute strategy."""
    import tensorflow as tf
    x, y = arrays(name, DISTINCT_BATCHES * batch, rank)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).cache().repeat()
    if shard_options is not None:
        ds = ds.with_options(shard_options)
    return ds.prefetch(2)


def epoch_timer():
    """A Keras callback recording each epoch's wall time in .seconds (one entry per epoch)."""
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self._t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._t0)

    return EpochTimer()


def file_barrier(plan, rank, ranks, tag, timeout=300):
    """Waits until all `ranks` processes of this launch reached `tag` (a file each in the plan's out_dir)."""
    open(os.path.join(plan['out_dir'], 'barrier-%s-%d' % (tag, rank)), 'w').close()
    deadline = time.monotonic() + timeout
    paths = [os.path.join(plan['out_dir'], 'barrier-%s-%d' % (tag, r)) for r in range(ranks)]
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
            raise TimeoutError('rank %d waited %d s at %r for rank(s) %s' % (rank, timeout, tag, missing))
        time.sleep(0.01)


def start_together(plan, rank, ranks, model_name):
    """A callback that holds every process at the first timed epoch until all got there. Processes that
    do not communicate (plain Keras side by side, KungFu with its collectives skipped) would otherwise
    start, trace and time at different moments and not compete for the cores during the timed epochs."""
    import keras

    class StartTogether(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == plan['warmup']:
                file_barrier(plan, rank, ranks, model_name)

    return StartTogether()


def train(model, data, plan, callbacks=()):
    """Runs fit for warmup + epochs epochs of plan['steps'] steps; returns the timed epochs' seconds.
    The timer comes last, so an epoch's time starts after the other callbacks' on_epoch_begin."""
    timer = epoch_timer()
    model.fit(data, steps_per_epoch=plan['steps'], epochs=plan['warmup'] + plan['epochs'], verbose=0,
              shuffle=False, callbacks=list(callbacks) + [timer])
    return timer.seconds[plan['warmup']:]


def weights_digest(model):
    """Per variable, the sum of its values: equal on every worker after synchronous training (each worker
    trained on its own data, so equal weights mean the gradients were averaged), different otherwise."""
    import numpy as np
    return [float(np.sum(w, dtype=np.float64)) for w in model.get_weights()]


def log(rank, text):
    if rank == 0:
        print('[%s] %s' % (time.strftime('%H:%M:%S'), text), flush=True)


def write_results(plan, rank, results):
    path = os.path.join(plan['out_dir'], 'rank%d.json' % rank)
    with open(path + '.tmp', 'w') as f:
        json.dump(results, f)
    os.replace(path + '.tmp', path)  # the driver never reads a half-written file
