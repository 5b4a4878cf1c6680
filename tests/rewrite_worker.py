"""The worker of test_rewrite.py's multi-process tests, started N times by kfrun. Not a test module itself.

    python -m kungfu.launcher -np N -- python tests/rewrite_worker.py

Runs every check in one process (TF costs seconds and 600 MB per process, so one launch per np) and
prints one line per check, "KFCHECK <name> OK <seconds>" or "KFCHECK <name> FAIL <reason>", then
"KFDONE". Every worker can compute the single-process reference itself, without the cluster: the
same model (same initial weights) trained in plain TF on the combined batch of all workers.
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import functools  # noqa: E402 (after the pid file on purpose)
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402

STEPS = 20
BATCH = 4  # rows per worker per step
TOLERANCE = 1e-5
CHECKS, check = mp.check_list()


def dataset(kind, rows, seed=0):
    """The fixed dataset every worker and the reference share."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype(np.float32) if kind == "mlp" else rng.integers(0, 20, (rows, 5), np.int32)
    return x, rng.normal(size=(rows, 3)).astype(np.float32)


class SharedEmbedding(keras.Model):
    """One embedding looked up twice (two IndexedSlices gradients, joined by concatenation) and, tied,
    also the output projection (a dense gradient too: all summed). Convention 7."""

    def __init__(self, tied):
        super().__init__()
        self.tied = tied
        self.emb, self.out = keras.layers.Embedding(20, 4), keras.layers.Dense(3)

    def call(self, x):
        h = tf.reduce_mean(self.emb(x), axis=1) + tf.reduce_mean(self.emb(tf.reverse(x, [1])), axis=1)
        return self.out(tf.matmul(h, self.emb.embeddings, transpose_b=True) if self.tied else h)


def build(kind, optimizer):
    keras.utils.set_random_seed(1)  # the same initial weights on every worker and in the reference
    if kind in ("twice", "tied"):
        model = SharedEmbedding(kind == "tied")
        model(np.zeros((1, 5), np.int32))
    elif kind == "mlp":
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(3)])
    else:
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4),
                                  keras.layers.Flatten(), keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(0.01) if optimizer == "adam" else keras.optimizers.SGD(0.1)
    return model, opt


def plain_step(model, opt, forward=None):
    """The user's unmodified training step; forward (default: model) computes the predictions."""
    forward = forward or model

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(forward(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def shard(a, step, rank, size, rows=BATCH):
    """Worker rank's rows of the combined batch of step `step`."""
    start = step * rows * size + rank * rows
    return a[start:start + rows]


def train(kind, optimizer, step_of, rank, size):
    """Weights after STEPS steps of step_of(model, opt) on worker rank's shards."""
    x, y = dataset(kind, STEPS * BATCH * size)
    model, opt = build(kind, optimizer)
    step = step_of(model, opt)
    for s in range(STEPS):
        step(shard(x, s, rank, size), shard(y, s, rank, size))
    return [v.numpy() for v in model.trainable_variables]


def assert_close(got, want, what, tolerance=TOLERANCE):
    for i, (g, w) in enumerate(zip(got, want)):
        err = float(np.max(np.abs(g - w))) if g.size else 0.0
        if g.shape != w.shape or err > tolerance:
            raise AssertionError(f"{what}: weight {i} {g.shape}: max |difference| {err:.3g} > {tolerance}")


@functools.lru_cache(maxsize=None)
def train_rewritten(kind, optimizer, fusion_bytes=None):
    """Weights after training with kungfu.rewrite(train_step) on this worker's shards (cached: several
    checks compare them)."""
    return train(kind, optimizer, lambda m, o: kungfu.rewrite(plain_step(m, o), fusion_bytes=fusion_bytes),
                 kungfu.rank(), kungfu.size())


@functools.lru_cache(maxsize=None)
def train_combined(kind, optimizer):
    """The reference: one process, plain TF, every step on the combined batch of all workers."""
    size = kungfu.size()
    x, y = dataset(kind, STEPS * BATCH * size)
    model, opt = build(kind, optimizer)
    step = plain_step(model, opt)
    for s in range(STEPS):
        step(shard(x, s, 0, 1, BATCH * size), shard(y, s, 0, 1, BATCH * size))
    return [v.numpy() for v in model.trainable_variables]


def ssgd_equivalence(kind, optimizer, fusion_bytes=None):
    assert_close(train_rewritten(kind, optimizer, fusion_bytes), train_combined(kind, optimizer),
                 f"{kind}/{optimizer} on {kungfu.size()} workers vs one process on the combined batch")


@check
def ssgd_mlp_sgd_matches_combined_batch():
    ssgd_equivalence("mlp", "sgd")


@check
def ssgd_mlp_adam_matches_combined_batch():
    ssgd_equivalence("mlp", "adam")


@check
def ssgd_embedding_sgd_matches_combined_batch():
    ssgd_equivalence("embedding", "sgd")


@check
def ssgd_embedding_adam_matches_combined_batch():
    ssgd_equivalence("embedding", "adam")


@check
def ssgd_embedding_looked_up_twice_matches_combined_batch():
    ssgd_equivalence("twice", "adam")


@check
def ssgd_tied_embedding_matches_combined_batch():
    ssgd_equivalence("tied", "sgd")


@check
def ssgd_one_collective_per_gradient_matches_combined_batch():
    ssgd_equivalence("mlp", "sgd", fusion_bytes=0)


def nested_forward_step(model, opt):
    """The forward pass in a tf.function of its own (a decorated predict()): TF runs its backward pass as
    a call of a function of its own, outside the tape's name scope (convention 9)."""
    return plain_step(model, opt, forward=tf.function(lambda x: model(x)))


@check
def ssgd_nested_forward_function_matches_combined_batch():
    got = train("mlp", "adam", lambda m, o: kungfu.rewrite(nested_forward_step(m, o)), kungfu.rank(), kungfu.size())
    assert_close(got, train_combined("mlp", "adam"), f"a nested forward tf.function on {kungfu.size()} workers")


def hand_written_step(model, opt):
    """The wrapper path written by hand: all-reduce the gradients, then apply them."""

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = kungfu.group_all_reduce(grads, op="mean")
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def wrapped_optimizer_step(model, opt):
    from kungfu.optimizers import SynchronousSGDOptimizer

    return plain_step(model, SynchronousSGDOptimizer(opt))


@check
def rewrite_equals_hand_written_all_reduce():
    got = train_rewritten("mlp", "sgd")
    want = train("mlp", "sgd", hand_written_step, kungfu.rank(), kungfu.size())
    # The same sums; only the packing of the gradients into one buffer differs (and with it, on a ring,
    # the order in which the workers' values are added): equal to float32 rounding.
    assert_close(got, want, "rewrite vs tape.gradient + group_all_reduce + apply_gradients", 1e-6)


@check
def rewrite_equals_synchronous_sgd_optimizer():
    got = train_rewritten("mlp", "sgd")
    want = train("mlp", "sgd", wrapped_optimizer_step, kungfu.rank(), kungfu.size())
    assert_close(got, want, "rewrite vs kungfu.optimizers.SynchronousSGDOptimizer", 1e-6)


@check
def sparse_rows_differ_across_workers():
    """Worker r looks up 2 * (r + 1) rows: the all-gather of an IndexedSlices takes any first dimension,
    and the update is the mean of the workers' gradients."""
    rank, size = kungfu.rank(), kungfu.size()
    rows = [2 * (r + 1) for r in range(size)]
    x, y = dataset("embedding", sum(rows), seed=2)
    parts = np.cumsum([0] + rows)
    model, opt = build("embedding", "sgd")
    kungfu.rewrite(plain_step(model, opt))(x[parts[rank]:parts[rank + 1]], y[parts[rank]:parts[rank + 1]])
    got = [v.numpy() for v in model.trainable_variables]

    ref, _ = build("embedding", "sgd")
    grads = []
    for r in range(size):  # each worker's own gradient, densified
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(ref(x[parts[r]:parts[r + 1]]) - y[parts[r]:parts[r + 1]]))
        grads.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, ref.trainable_variables)])
    want = [v.numpy() - 0.1 * np.mean([g[i].numpy() for g in grads], axis=0)
            for i, v in enumerate(ref.trainable_variables)]
    assert_close(got, want, "uneven IndexedSlices vs the mean of the workers' gradients", 1e-6)


@check
def tape_jacobians_stay_local():
    """DistributedGradientTape averages gradient() only: TF's jacobian calls self.gradient() per row."""
    rank, size = kungfu.rank(), kungfu.size()
    v = tf.Variable(tf.ones([3]) * (rank + 1))
    x = tf.ones([2, 3]) * (rank + 1)
    with tf.GradientTape(persistent=True) as plain:
        plain.watch(x)
        y, z, loss = v * v, x * x, tf.reduce_sum(v * v)
    tape = kungfu.DistributedGradientTape(plain)
    mean = np.mean([2.0 * (r + 1) for r in range(size)])
    np.testing.assert_allclose(tape.gradient(loss, v).numpy(), [mean] * 3, err_msg="gradient: the mean")
    np.testing.assert_allclose(np.diag(tape.jacobian(y, v).numpy()), [2.0 * (rank + 1)] * 3,
                               err_msg="jacobian: this worker's own")
    batch = tape.batch_jacobian(z, x).numpy()
    np.testing.assert_allclose([np.diag(b) for b in batch], np.full([2, 3], 2.0 * (rank + 1)),
                               err_msg="batch_jacobian: this worker's own")


def expect_already_distributed(step):
    x, y = dataset("mlp", BATCH)
    try:
        kungfu.rewrite(step)(x, y)
    except ValueError as e:
        if "already averages its gradients" not in str(e):
            raise
    else:
        raise AssertionError("kungfu.rewrite took a step that averages its gradients itself")


@check
def rewrite_refuses_a_step_with_distributed_gradient_tape():
    model, opt = build("mlp", "sgd")

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = kungfu.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    expect_already_distributed(train_step)


@check
def rewrite_refuses_a_step_with_synchronous_sgd_optimizer():
    model, opt = build("mlp", "sgd")
    expect_already_distributed(wrapped_optimizer_step(model, opt))


def main():
    kungfu.init()
    sys.exit(1 if mp.run_checks(CHECKS, kungfu.rank()) else 0)


if __name__ == "__main__":
    main()
