"""The worker of test_gns_accuracy.py, started N times by kfrun. Not a test module itself.

    python -m kungfu.launcher -np N -- python tests/gns_accuracy_worker.py [--rewrite] B_SMALL [B_SMALL ...]

Prints one "KFCHECK <name> OK|FAIL ..." line per check (tests/mp.py), one check per B_SMALL. Synthetic
gradients with a known truth (as tests/monitor_reference.py's SyntheticGradients): a true gradient G
(|G|^2 = G_SQ) and a diagonal per-sample noise covariance Sigma (trace TRACE, unequal coordinates), the
same on every worker. Each step every worker draws its own mean of B_SMALL per-sample gradients,
G + N(0, Sigma / B_SMALL) (seeded by rank and step), and hands it, as the gradient of a dummy
variable, to a SynchronousSGDOptimizer(SGD(0.0), monitor=["gns", "snr", "variance"]): the real path,
where the wrapper all-reduces it (the local squared norm riding along) and updates the monitors in the
graph. After STEPS steps (the EMA, alpha 0.1, has long settled) the estimates must be within TOLERANCE
of the truth: EMA |G|^2, EMA tr Sigma, gns = tr Sigma / |G|^2, snr = |G|^2 B_big / tr Sigma, and the
mean over the last steps of grad_variance (a per-step value, not an EMA) against its expectation
tr Sigma (1/B_small - 1/B_big).

With --rewrite (test_rewrite_monitors.py) the gradients go through kungfu.rewrite(..., monitors=[...])
of a step whose loss has the synthetic gradient, one call per step, and the check also compares its
values with the wrapper's on the same gradients.

Margin: numpy runs of the same estimator (tests/monitor_reference.py, 30 seeds, DIM=1024, N=2 and
4, B_small 4 to 32) stay within 5% of the truth, the worst case being gns at N=2, B_small=4.
"""

import mp

mp.worker_started()  # first thing, so the test can kill this process on every path

import sys  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu  # noqa: E402

DIM, G_SQ, TRACE = 1024, 1.0, 8.0  # true gns = TRACE / G_SQ = 8
STEPS, TAIL = 400, 100  # steps in all; the last TAIL average grad_variance
TOLERANCE = 0.10


def truth(seed=7):
    """(G, per-coordinate noise variances), the same on every worker."""
    rng = np.random.default_rng(seed)
    direction = rng.standard_normal(DIM)
    g = direction * np.sqrt(G_SQ / np.sum(direction ** 2))
    weights = rng.uniform(0.5, 1.5, DIM)
    return g.astype(np.float32), (weights * (TRACE / np.sum(weights))).astype(np.float32)


def run(b_small):
    """Trains STEPS steps on synthetic gradients of batch b_small; returns (monitors, latest(),
    mean of grad_variance over the last TAIL steps)."""
    g_true, variances = truth()
    g_true, std = tf.constant(g_true), tf.constant(np.sqrt(variances / b_small))
    var = tf.Variable(tf.zeros([DIM]), name=f"dummy_b{b_small}")
    opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.0, name=f"sgd_b{b_small}"),
                                                    monitor=["gns", "snr", "variance"], local_batch_size=b_small)
    m = opt._kungfu.monitors
    rank = kungfu.rank()

    @tf.function
    def train():
        tail = tf.constant(0.0)
        for step in tf.range(STEPS):
            seed = tf.stack([tf.constant(1000 * b_small + rank, tf.int32), step])  # own noise per worker, step
            grad = g_true + std * tf.random.stateless_normal([DIM], seed=seed)
            opt.apply_gradients([(grad, var)])
            if step >= STEPS - TAIL:
                tail += m.read("grad_variance")
        return tail / TAIL

    tail = float(train())
    return m, kungfu.monitor.latest(opt), tail


def run_rewrite(b_small):
    """As run(), through kungfu.rewrite(monitors=...) of a step whose loss sum(var * g) has gradient g,
    one call per step; returns (monitors, latest(), tail mean of grad_variance)."""
    g_true, variances = truth()
    g_true, std = tf.constant(g_true), tf.constant(np.sqrt(variances / b_small))
    var = tf.Variable(tf.zeros([DIM]), name=f"rewrite_dummy_b{b_small}")
    opt = keras.optimizers.SGD(0.0)

    def synthetic_step(seed):
        grad = tf.stop_gradient(g_true + std * tf.random.stateless_normal([DIM], seed=seed))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var * grad)
        opt.apply_gradients(zip(tape.gradient(loss, [var]), [var]))

    step = kungfu.rewrite(tf.function(synthetic_step), monitors=["gns", "snr", "variance"], local_batch_size=b_small)
    rank, tail = kungfu.rank(), 0.0
    for t in range(STEPS):
        step(tf.constant([1000 * b_small + rank, t], tf.int32))  # the same noise as run()'s
        if t >= STEPS - TAIL:
            tail += float(step.monitors.read("grad_variance").numpy())
    if step.rewrite_count != 1:
        raise AssertionError(f"the step was rewritten {step.rewrite_count} times")
    inserted = step.report(tf.constant([0, 0], tf.int32)).inserted
    if len(inserted) != 1:  # the squared norm rides in the gradient's all-reduce
        raise AssertionError(f"expected one collective, got {[c.key for c in inserted]}")
    every3 = kungfu.rewrite(tf.function(synthetic_step), monitors=["variance"], monitor_interval=3)
    for t in range(7):
        every3(tf.constant([1000 * b_small + rank, t], tf.int32))
    if every3.monitors.update_count() != 3:
        raise AssertionError(f"monitor_interval=3: the monitors ran {every3.monitors.update_count()} "
                             "times in 7 steps, not 3")
    return step.monitors, kungfu.monitor.latest(step), tail / TAIL


def within(what, got, want):
    err = abs(got - want) / abs(want)
    if not err <= TOLERANCE:
        raise AssertionError(f"{what}: estimate {got:.5g}, truth {want:.5g}, off by {100 * err:.1f}% "
                             f"(> {100 * TOLERANCE:.0f}%)")
    return f"{what} {100 * err:.1f}%"


def check(b_small, rewrite=False):
    def fn():
        m, got, tail = (run_rewrite if rewrite else run)(b_small)
        b_big = kungfu.size() * b_small
        if m.update_count() != STEPS:
            raise AssertionError(f"the monitors ran {m.update_count()} times in {STEPS} steps")
        report = [
            within("|G|^2", float(m.read("g_sq").numpy()), G_SQ),
            within("tr Sigma", float(m.read("trace").numpy()), TRACE),
            within("gns", got["gns"], TRACE / G_SQ),
            within("snr", got["snr"], G_SQ * b_big / TRACE),
            within("grad_variance", tail, TRACE * (1.0 / b_small - 1.0 / b_big)),
        ]
        print(f"gns accuracy N={kungfu.size()} B_small={b_small}: " + ", ".join(report), flush=True)
        values = np.array([got["gns"], got["snr"], float(m.read("g_sq").numpy()), float(m.read("trace").numpy())],
                          np.float32)
        if not bool(kungfu.consensus(values)):
            raise AssertionError(f"workers differ on (gns, snr, |G|^2, tr Sigma): {values.tolist()}")
        if rewrite:  # the same gradients through the optimizer wrapper give the same numbers
            _, want, want_tail = run(b_small)
            for key in ("gns", "snr", "grad_variance"):
                g, w = (tail, want_tail) if key == "grad_variance" else (got[key], want[key])
                if not abs(g - w) <= 1e-4 * abs(w):
                    raise AssertionError(f"{key}: kungfu.rewrite {g!r}, optimizer wrapper {w!r}")

    fn.__name__ = f"{'rewrite_' if rewrite else ''}accurate_b{b_small}"
    return fn


def main():
    kungfu.init()
    rewrite = "--rewrite" in sys.argv[1:]
    checks = [check(int(b), rewrite) for b in sys.argv[1:] if b != "--rewrite"]
    sys.exit(1 if mp.run_checks(checks, kungfu.rank()) else 0)


if __name__ == "__main__":
    main()
