"""The worker of test_data_mp.py, started N times by kfrun. Not a test module itself.

    python -m kungfu.launcher -np N -- python tests/data_worker.py OUT_DIR

Every sample is its own index (x = i), so what a worker trained on is readable from its batches. Each
check writes, per step, the indices this worker got into OUT_DIR/<check>.<rank>.json; the test then
checks across workers that every sample is seen once per epoch, the shards are disjoint, and the batch
sizes change exactly at the steps the schedule says. Prints "KFCHECK <name> OK|FAIL ..." (tests/mp.py).

- custom_loop_schedule: a Python loop over as_dataset() that changes the batch size between steps; an
  all-reduce per step sums the workers' batch sizes (so a worker with an extra step would hang).
- fit_ssgd_schedule: model.fit with SynchronousSGDOptimizer (real all-reduces each step, so workers
  with different step counts would hang); the batch size changes from a callback's on_train_batch_end
  and from an assign inside the train step's graph; the step reads ds.local_batch_size_variable (as the
  monitors do) and must see its own batch's size.
- workers_that_disagree_fail_clearly: different seeds, or data pre-sharded by rank, raise ValueError on
  every worker at construction.
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402
from kungfu.keras.callbacks import BroadcastGlobalVariablesCallback  # noqa: E402

# Shared with test_data_mp.py, which computes the expected batches from them.
N, SEED = 103, 5
CUSTOM = {"batch": 10, "epochs": 2, "changes": {2: 7, 5: 16, 9: 5}}  # global step -> size from the next step
FIT = {"batch": 10, "epochs": 2, "changes": {3: 6, 9: 13, 13: 9}}  # step 9: assigned inside the graph
FIT_IN_GRAPH_STEP = 9


def data():
    x = np.arange(N, dtype=np.float32).reshape(N, 1)
    return x, 0.5 * x / N


def write(check, records):
    with open(os.path.join(sys.argv[1], f"{check}.{kungfu.rank()}.json"), "w") as f:
        json.dump(records, f)


def custom_loop_schedule():
    ds = kungfu.data.AdaptiveDataset(data(), global_batch_size=CUSTOM["batch"], seed=SEED)
    records, step = [], 0
    for epoch in range(CUSTOM["epochs"]):
        for x, _ in ds.as_dataset():
            mine = x.numpy()[:, 0].astype(int).tolist()
            total = int(kungfu.all_reduce(np.array([len(mine)], np.int64), op="sum", name="data/custom")[0])
            records.append({"epoch": epoch, "step": step, "indices": mine, "global": total,
                            "local_batch_size": ds.local_batch_size})
            if step in CUSTOM["changes"]:
                ds.set_batch_size(CUSTOM["changes"][step])
            step += 1
        if ds.epoch != epoch + 1:
            raise AssertionError(f"ds.epoch is {ds.epoch} after epoch {epoch}")
    if ds.samples_seen != CUSTOM["epochs"] * N:
        raise AssertionError(f"samples_seen {ds.samples_seen}, want {CUSTOM['epochs'] * N}")
    write("custom", records)


class Recorder(keras.Model):
    """A linear model whose train step keeps what it trained on, for the callback to read."""

    def __init__(self, ds):
        super().__init__()
        self.ds = ds
        self.dense = keras.layers.Dense(1)
        self.seen = tf.Variable(np.zeros(1, np.float32), shape=tf.TensorShape(None), trainable=False)
        self.local = tf.Variable(0.0, trainable=False)  # local_batch_size_variable as this step read it

    def call(self, x):
        return self.dense(x / N)

    def train_step(self, data):
        x, _ = data
        self.seen.assign(x[:, 0])
        with tf.control_dependencies([x]):  # read it once this step's batch exists
            self.local.assign(self.ds.local_batch_size_variable)
        at = tf.equal(self.optimizer.iterations, FIT_IN_GRAPH_STEP)
        self.ds.set_batch_size(tf.where(at, tf.constant(FIT["changes"][FIT_IN_GRAPH_STEP], tf.int64),
                                        self.ds.batch_size_variable.read_value()))
        return super().train_step(data)


class Record(keras.callbacks.Callback):
    def __init__(self, ds, model):
        super().__init__()
        self.ds, self.recorder, self.records, self.step, self.epoch = ds, model, [], 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.records.append({"epoch": self.epoch, "step": self.step, "batch": batch,
                             "indices": self.recorder.seen.numpy().astype(int).tolist(),
                             "local_batch_size": float(self.recorder.local.numpy())})
        if self.step in FIT["changes"] and self.step != FIT_IN_GRAPH_STEP:
            self.ds.set_batch_size(FIT["changes"][self.step])
        self.step += 1


def fit_ssgd_schedule():
    ds = kungfu.data.AdaptiveDataset(data(), global_batch_size=FIT["batch"], seed=SEED)
    keras.utils.set_random_seed(kungfu.rank())  # different starting weights: the broadcast evens them
    model = Recorder(ds)
    model(np.zeros((1, 1), np.float32))  # built before fit, for BroadcastGlobalVariablesCallback
    model.compile(optimizer=kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    record = Record(ds, model)
    history = model.fit(ds.as_dataset(), epochs=FIT["epochs"], shuffle=False, verbose=0,
                        callbacks=[BroadcastGlobalVariablesCallback(root=0), record, ds.keras_callback()])
    if len(history.history["loss"]) != FIT["epochs"]:
        raise AssertionError(f"fit ran {len(history.history['loss'])} epochs, want {FIT['epochs']}")
    flat = np.concatenate([np.ravel(w) for w in model.get_weights()])
    if not bool(kungfu.consensus(flat, name="data/weights")):
        raise AssertionError("the workers' weights differ after S-SGD")
    if ds.epoch != FIT["epochs"]:
        raise AssertionError(f"ds.epoch is {ds.epoch}, want {FIT['epochs']}")
    write("fit", record.records)


def workers_that_disagree_fail_clearly():
    x, y = data()
    big = 2 ** 127 + 5  # seeds of any size (np.random.SeedSequence().entropy has 128 bits) are compared too
    kungfu.data.AdaptiveDataset((x, y), 10, seed=big)
    # Below: different seeds (small, and big ones differing only above 64 bits); data pre-sharded by rank.
    for wrong in (lambda: kungfu.data.AdaptiveDataset((x, y), 10, seed=kungfu.rank()),
                  lambda: kungfu.data.AdaptiveDataset((x, y), 10, seed=big + (kungfu.rank() << 64)),
                  lambda: kungfu.data.AdaptiveDataset(x[:100][kungfu.rank()::kungfu.size()], kungfu.size())):
        try:
            wrong()
        except ValueError as e:
            if "the same on every worker" not in str(e):
                raise
        else:
            raise AssertionError("workers with different data or settings were not stopped")


def main():
    kungfu.init()
    checks = [custom_loop_schedule, fit_ssgd_schedule, workers_that_disagree_fail_clearly]
    sys.exit(1 if mp.run_checks(checks, kungfu.rank()) else 0)


if __name__ == "__main__":
    main()
