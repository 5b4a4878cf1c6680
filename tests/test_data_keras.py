"""AdaptiveDataset under Keras 3's model.fit on one process: with ds.keras_callback() every fit epoch is one
whole pass (no "ran out of data" warning, no epoch cut at the first epoch's length), a change made in
on_train_batch_end or inside the train step lands at the next step, fit reads no batch ahead, the step is
traced as often for many batch sizes as for one, and the progress bar counts each epoch's own steps.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kungfu

pytestmark = pytest.mark.usefixtures("kungfu_library")

N, SEED = 50, 1


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()


def make_dataset(batch=8, weights=False):
    x = np.arange(N, dtype=np.float32).reshape(N, 1)
    data = (x, 0.5 * x / N) + ((np.ones(N, np.float32),) if weights else ())
    return kungfu.data.AdaptiveDataset(data, global_batch_size=batch, seed=SEED)


class Recorder(keras.Model):
    """A linear model whose train step keeps what it trained on and counts its traces."""

    def __init__(self, ds, in_graph_change=None):
        super().__init__()
        self.ds, self.in_graph_change, self.traces = ds, in_graph_change, 0
        self.dense = keras.layers.Dense(1)
        self.seen = tf.Variable(np.zeros(1, np.float32), shape=tf.TensorShape(None), trainable=False)
        self.local = tf.Variable(0.0, trainable=False)

    def call(self, x):
        return self.dense(x / N)

    def train_step(self, data):
        self.traces += 1  # Python: runs once per trace
        x = data[0]
        self.seen.assign(x[:, 0])
        with tf.control_dependencies([x]):  # read it once this step's batch exists, as a monitor must
            self.local.assign(self.ds.local_batch_size_variable)
        if self.in_graph_change is not None:  # (at step, to size): assigned under a cond, as policies do
            at, size = self.in_graph_change

            def change():
                self.ds.set_batch_size(size)
                return tf.constant(True)

            tf.cond(tf.equal(self.optimizer.iterations, at), change, lambda: tf.constant(False))
        return super().train_step(data)


class Record(keras.callbacks.Callback):
    """Per step: (epoch, samples trained on, local batch size read in the step); changes the batch size at
    (epoch, batch) keys of `changes`; checks that the dataset has handed out exactly the steps trained."""

    def __init__(self, ds, model, changes=None):
        super().__init__()
        self.ds, self.recorder, self.changes, self.rows, self.epoch = ds, model, changes or {}, [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        steps, _, _ = self.ds.progress()
        assert steps == batch + 1, f"epoch {self.epoch}: {steps} batches handed out after {batch + 1} steps"
        self.rows.append((self.epoch, self.recorder.seen.numpy().astype(int).tolist(),
                          float(self.recorder.local.numpy())))
        if (self.epoch, batch) in self.changes:
            self.ds.set_batch_size(self.changes[(self.epoch, batch)])


def fit(ds, epochs, changes=None, in_graph_change=None, verbose=0, extra=()):
    model = Recorder(ds, in_graph_change)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    record = Record(ds, model, changes)
    history = model.fit(ds.as_dataset(), epochs=epochs, shuffle=False, verbose=verbose,
                        callbacks=[record, *extra, ds.keras_callback()])
    return model, record.rows, history


def sizes_by_epoch(rows):
    out = {}
    for epoch, samples, local in rows:
        assert local == len(samples), f"the step read local_batch_size {local} for a batch of {len(samples)}"
        out.setdefault(epoch, []).append(len(samples))
    return [out[e] for e in sorted(out)]


def test_each_epoch_is_one_pass_and_a_callback_change_lands_at_the_next_step(capsys):
    ds = make_dataset(batch=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, rows, history = fit(ds, 3, changes={(1, 1): 3, (2, 0): 30}, verbose=1)
    assert [str(w.message) for w in caught] == []
    assert sizes_by_epoch(rows) == [[8] * 6 + [2], [8, 8] + [3] * 11 + [1], [3, 30, 17]]
    for epoch in range(3):
        samples = sorted(i for e, batch, _ in rows if e == epoch for i in batch)
        assert samples == list(range(N)), f"epoch {epoch} is not one whole pass"
    assert len(history.history["loss"]) == 3 and ds.epoch == 3 and ds.samples_seen == 3 * N
    out = capsys.readouterr().out
    for steps in (7, 14, 3):  # each epoch's bar ends at its own step count
        assert f"{steps}/{steps}" in out, out[-2000:]


def test_a_change_inside_the_train_step_lands_at_the_next_step():
    ds = make_dataset(batch=8)
    _, rows, _ = fit(ds, 2, in_graph_change=(2, 5))  # assigned during step 2, so step 3 has 5
    assert sizes_by_epoch(rows) == [[8, 8, 8, 5, 5, 5, 5, 5, 1], [5] * 10]


def test_sample_weights_ride_along():
    ds = make_dataset(batch=16, weights=True)
    _, rows, history = fit(ds, 1)
    assert sizes_by_epoch(rows) == [[16, 16, 16, 2]] and np.isfinite(history.history["loss"][0])


def test_the_step_is_traced_as_often_for_many_sizes_as_for_one():
    fixed, _, _ = fit(make_dataset(batch=8), 2)
    changes = {(e, b): 2 + (3 * e + b) % 9 for e in range(2) for b in range(40)}  # a new size every step
    varying, rows, _ = fit(make_dataset(batch=8), 2, changes=changes)
    assert len(set(len(batch) for _, batch, _ in rows)) >= 8
    assert varying.traces == fixed.traces <= 2  # Keras traces a step that creates variables twice


@pytest.mark.parametrize("first", [True, False])
def test_a_stop_requested_at_an_epochs_last_step_is_kept(first):
    class StopAtEndOfFirstEpoch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if ds.progress()[2]:
                self.model.stop_training = True

    ds = make_dataset(batch=10)
    stop = StopAtEndOfFirstEpoch()
    model = Recorder(ds)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    callbacks = [stop, ds.keras_callback()] if first else [ds.keras_callback(), stop]
    history = model.fit(ds.as_dataset(), epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    assert len(history.history["loss"]) == 1


def test_the_callback_refuses_what_would_misplace_a_change():
    ds = make_dataset()
    model = Recorder(ds)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    with pytest.raises(ValueError, match="do not pass steps_per_epoch"):
        model.fit(ds.as_dataset(), steps_per_epoch=3, shuffle=False, verbose=0, callbacks=[ds.keras_callback()])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(ds.as_dataset(), shuffle=False, verbose=0, callbacks=[ds.keras_callback()])


@pytest.mark.parametrize("ahead", ["shuffle", "prefetch", "class_weight"])
def test_the_callback_refuses_a_pipeline_that_pulls_batches_ahead(ahead):
    # Each pulls batches before fit trains them: the epoch would end at the last batch pulled, the rest
    # untrained (a shuffle buffer of the whole epoch: 1 step of 7), with no error. How many steps have run
    # when the check sees it depends on how far ahead the pipeline got (usually 1; 3 on a loaded machine).
    ds = make_dataset()
    model = Recorder(ds)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    data = {"shuffle": lambda d: d.shuffle(N), "prefetch": lambda d: d.prefetch(2)}.get(ahead, lambda d: d)(
        ds.as_dataset())
    extra = {"class_weight": {0: 1.0}} if ahead == "class_weight" else {}
    with pytest.raises(ValueError, match=r"has handed out \d+ batches of this epoch but fit has trained \d+: "
                                         r"something pulls batches ahead"):
        model.fit(data, epochs=2, shuffle=False, verbose=0, callbacks=[ds.keras_callback()], **extra)
