"""kungfu.data.AdaptiveDataset on one process: epochs, order, the last batch, batch-size changes in custom
loops (eagerly and inside a tf.function), no reading ahead, retracing, and errors. The plan's split among
workers is swept here on simulated ranks; real workers are in test_data_mp.py, model.fit in
test_data_keras.py.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import kungfu
from kungfu import errors
from kungfu.data import _plan

pytestmark = pytest.mark.usefixtures("kungfu_library")

N, SEED = 23, 3


@pytest.fixture(autouse=True, scope="module")
def cluster_of_one():
    kungfu.init()


def indexed(n=N):
    """x = the sample's index, so a batch says which samples it holds."""
    x = np.arange(n, dtype=np.int64)
    return x, x * 10


def epoch_batches(ds):
    return [x.numpy().tolist() for x, _ in ds.as_dataset()]


def test_each_epoch_is_a_seeded_permutation_seen_once():
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=5, seed=SEED)
    assert (ds.batch_size, ds.epoch, ds.samples_seen, len(ds)) == (5, 0, 0, 5)
    epochs = [epoch_batches(ds) for _ in range(3)]
    for e, batches in enumerate(epochs):
        assert [len(b) for b in batches] == [5, 5, 5, 5, 3]  # the last batch is partial
        assert sum(batches, []) == np.random.default_rng([SEED, e]).permutation(N).tolist()
    assert epochs[0] != epochs[1]
    assert (ds.epoch, int(ds.epoch_variable.numpy())) == (3, 3)
    assert (ds.samples_seen, int(ds.samples_seen_variable.numpy())) == (3 * N, 3 * N)
    x, y = next(iter(kungfu.data.AdaptiveDataset(indexed(), global_batch_size=5, seed=SEED).as_dataset()))
    assert x.numpy().tolist() == epochs[0][0] and (y.numpy() == x.numpy() * 10).all()  # same seed, same order


def test_a_resumed_run_starts_at_its_epoch_before_the_first_batch_only():
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=5, seed=SEED)
    assert ds.start_at_epoch(2) and ds.epoch == 2
    assert sum(epoch_batches(ds), []) == np.random.default_rng([SEED, 2]).permutation(N).tolist()  # epoch 2's
    assert (ds.epoch, int(ds.epoch_variable.numpy())) == (3, 3)
    assert not ds.start_at_epoch(0) and ds.epoch == 3  # a pass has begun: nothing changes
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="the epoch must be a whole number >= 0"):
            kungfu.data.AdaptiveDataset(indexed(), global_batch_size=5).start_at_epoch(bad)


def test_shuffle_false_keeps_the_order():
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=10, shuffle=False)
    assert epoch_batches(ds) == [list(range(10)), list(range(10, 20)), [20, 21, 22]]
    assert epoch_batches(ds)[0] == list(range(10))


def test_a_batch_size_above_the_data_takes_the_whole_epoch():
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=100, shuffle=False)
    assert epoch_batches(ds) == [list(range(N))]
    assert (ds.batch_size, len(ds), ds.local_batch_size) == (100, 1, float(N))


def test_dict_and_nested_data_keep_their_structure():
    x, y = indexed()
    ds = kungfu.data.AdaptiveDataset(({"a": x, "b": [x.astype(np.float32), x]}, y), 4, shuffle=False)
    assert ds.element_spec[0]["a"].shape.as_list() == [None]
    (feat, label) = next(iter(ds.as_dataset()))
    assert feat["a"].numpy().tolist() == [0, 1, 2, 3] and feat["b"][0].dtype == tf.float32
    assert label.numpy().tolist() == [0, 10, 20, 30]


def test_a_change_between_steps_lands_at_the_next_step():
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4, shuffle=False)
    sizes, seen = [], []
    for step, (x, _) in enumerate(ds.as_dataset()):
        sizes.append(len(x))
        seen.append(ds.samples_seen)  # counts what was handed out: nothing is read ahead
        if step == 1:
            ds.set_batch_size(7)
        if step == 2:
            ds.batch_size = np.int64(3)
    assert sizes == [4, 4, 7, 3, 3, 2]
    assert seen == np.cumsum(sizes).tolist()
    assert ds.local_batch_size == 2.0 and ds.batch_size == 3


def test_a_change_inside_a_tf_function_lands_at_the_next_step_without_retracing():
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4, shuffle=False)
    traces = []

    @tf.function(input_signature=list(ds.element_spec))
    def step(x, y):
        traces.append(1)
        n = tf.size(x, out_type=tf.int64)
        ds.set_batch_size(tf.where(tf.equal(x[0], 4), tf.constant(6, tf.int64), ds.batch_size_variable))
        return n

    assert [int(step(x, y)) for x, y in ds.as_dataset()] == [4, 4, 6, 6, 3]
    assert len(traces) == 1


def test_a_function_that_pulls_its_own_batch_orders_the_change_with_after():
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4, shuffle=False)

    @tf.function
    def step(iterator, k):
        x, _ = next(iterator)
        ds.set_batch_size(tf.where(tf.equal(k, 1), tf.constant(2, tf.int64), ds.batch_size_variable), after=x)
        return tf.size(x)

    iterator = iter(ds.as_dataset())
    assert [int(step(iterator, tf.constant(k))) for k in range(4)] == [4, 4, 2, 2]


@pytest.mark.parametrize("value, error, words", [
    (0, ValueError, "at least the number of workers"),
    (-3, ValueError, "at least the number of workers"),
    (2.5, TypeError, "must be an int"),
    (True, TypeError, "must be an int"),
    ("8", TypeError, "must be an int"),
    (None, TypeError, "must be an int"),
    (np.float32(4), TypeError, "must be an int"),
])
def test_bad_batch_sizes_say_what_is_wrong(value, error, words):
    with pytest.raises(error, match=words):
        kungfu.data.AdaptiveDataset(indexed(), global_batch_size=value)
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4)
    with pytest.raises(error, match=words):
        ds.set_batch_size(value)
    assert ds.batch_size == 4


def test_bad_batch_sizes_inside_a_function_fail_when_the_step_runs():
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="at least the number of workers"):
        tf.function(lambda: ds.set_batch_size(tf.constant(0)))()
    with pytest.raises(TypeError, match="integer tensor"):
        tf.function(lambda: ds.set_batch_size(tf.constant(4.0)))()
    ds.batch_size_variable.assign(0)  # bypassing set_batch_size: the next batch says how to fix it
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"set it with ds.set_batch_size"):
        next(iter(ds.as_dataset()))


@pytest.mark.parametrize("data, error, words", [
    ((np.zeros(5), np.zeros(6)), ValueError, r"different lengths \[5, 6\]"),
    (np.zeros((0, 3)), ValueError, "no samples"),
    ((), ValueError, "empty structure"),
    (None, ValueError, "needs data"),
    (np.float32(1), ValueError, "first \\(sample\\) dimension"),
    (np.array([object(), object()]), TypeError, "cannot become a tensor"),
    ([1.0, 2.0], ValueError, "lists count as tuples of arrays"),
    (tf.data.Dataset.range(3), TypeError, "got a _?RangeDataset, which it cannot cut: it needs the whole data set"),
    ((i for i in range(3)), TypeError, "got a generator, which it cannot cut"),
    (tf.sparse.eye(3), TypeError, "a tf.SparseTensor cannot be cut"),
])
def test_bad_data_says_what_is_wrong(data, error, words):
    with pytest.raises(error, match=words):
        kungfu.data.AdaptiveDataset(data, global_batch_size=1)


def test_bad_seed_says_what_is_wrong():
    with pytest.raises(TypeError, match="same on every worker"):
        kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4, seed=None)


def test_it_needs_init(monkeypatch):
    from kungfu import _lib

    monkeypatch.setattr(_lib, "_cluster", None)
    with pytest.raises(errors.NotInitializedError, match=r"needs kungfu.init\(\) to be called first"):
        kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4)


def test_starting_a_new_pass_mid_epoch_warns(caplog):
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4, shuffle=False)
    next(iter(ds.as_dataset()))
    with caplog.at_level(logging.WARNING, logger="kungfu"):
        first = next(iter(ds.as_dataset()))[0].numpy().tolist()
    assert "19 of its 23 samples not handed out" in caplog.text and "keras_callback" in caplog.text
    assert first == [0, 1, 2, 3] and ds.epoch == 2


def test_an_older_iterator_stops_once_a_new_epoch_begins():
    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4, shuffle=False)
    old = iter(ds.as_dataset())
    next(old)
    new = iter(ds.as_dataset())
    assert next(new)[0].numpy().tolist() == [0, 1, 2, 3]  # epoch 1 begins
    with pytest.raises(StopIteration):
        next(old)  # rather than hand out epoch 0's samples while epoch 1 runs
    assert next(new)[0].numpy().tolist() == [4, 5, 6, 7] and ds.samples_seen == 12


def test_the_monitors_accept_the_local_batch_size_variable():
    import keras

    ds = kungfu.data.AdaptiveDataset(indexed(), global_batch_size=4)
    opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(), monitor=["gns"],
                                                    local_batch_size=ds.local_batch_size_variable)
    assert ds.local_batch_size_variable.dtype == tf.float32 and opt is not None


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_plan_gives_every_worker_a_disjoint_nonempty_part_of_every_sample(size):
    """All ranks simulated: random batch-size changes, including sizes above the data and equal to size."""
    rng = np.random.RandomState(size)
    for n in (size, size + 1, 23, 64):
        order = _plan.permutation(n, SEED, 0, True)
        pos, parts = 0, [[] for _ in range(size)]
        while pos < n:
            b = int(rng.choice([size, size + 1, 5, 8, 100]))
            take = _plan.next_batch(n - pos, b, size)
            for rank in range(size):
                lo, hi = _plan.worker_slice(take, size, rank)
                assert hi > lo, f"n={n} size={size} b={b}: rank {rank} would get an empty batch"
                parts[rank].append(order[pos + lo:pos + hi])
            pos += take
        everything = np.concatenate([p for rank_parts in parts for p in rank_parts])
        assert sorted(everything.tolist()) == list(range(n))  # each sample once: disjoint and complete


def test_batches_left_counts_what_next_batch_takes():
    for size in (1, 2, 4):
        for n in range(size, 40):
            for b in range(size, 45):
                left, steps = n, 0
                while left:
                    left -= _plan.next_batch(left, b, size)
                    steps += 1
                assert _plan.batches_left(n, b, size) == steps, (n, b, size)


def test_fingerprint_of_object_arrays_is_their_values():
    """Workers compare fingerprints of their data: an object array's must not depend on where its items live."""
    from kungfu.data import _dataset

    def texts(suffix=""):
        return np.array([[f"s{i}{suffix}", f"t{i}"] for i in range(10)], dtype=object)

    assert _dataset._fingerprint([texts()]) == _dataset._fingerprint([texts()])
    assert _dataset._fingerprint([texts()]) != _dataset._fingerprint([texts("x")])


def test_fingerprint_sees_any_sample_of_a_small_array_and_spreads_over_a_large_one(monkeypatch):
    from kungfu.data import _dataset

    x = np.arange(1000 * 3, dtype=np.float32).reshape(1000, 3)
    y = x.copy()
    y[417, 1] += 1  # one value, away from the first, middle and last samples
    assert _dataset._fingerprint([x]) != _dataset._fingerprint([y])
    assert _dataset._fingerprint([x[:, :2]]) == _dataset._fingerprint([np.ascontiguousarray(x[:, :2])])
    monkeypatch.setattr(_dataset, "_WHOLE_BYTES", 1024)  # too large to read whole: samples spread over it
    monkeypatch.setattr(_dataset, "_SAMPLES", 100)
    for i in (0, 10, 20, 999):  # about every 10th sample, the first and last among them
        z = x.copy()
        z[i] += 1
        assert _dataset._fingerprint([x]) != _dataset._fingerprint([z]), i


def test_a_map_added_after_as_dataset_reads_nothing_ahead():
    """tf.data makes a stateless map parallel by default (map_parallelization), and a parallel map reads
    ahead: as_dataset() turns that off for what follows it, so a change still lands at the next batch."""
    ds = kungfu.data.AdaptiveDataset(np.arange(100, dtype=np.float32)[:, None], global_batch_size=10,
                                     shuffle=False)
    mapped = ds.as_dataset().map(lambda a: a * 2.0)
    assert mapped.options().experimental_optimization.map_parallelization is False
    sizes = []
    for step, batch in enumerate(mapped):
        sizes.append(int(batch.shape[0]))
        assert ds.progress()[0] == step + 1, f"step {step}: the dataset handed out {ds.progress()[0]} batches"
        if step == 1:
            ds.set_batch_size(40)
    assert sizes == [10, 10, 40, 40], sizes
