"""A numpy reference of the monitor operators (kf_ops/monitor_kernels.cc, docs/monitoring.md), and
synthetic gradients with a known true gradient and noise covariance. No TensorFlow, no kungfu: the
single-process test (test_monitor_ops.py) and the multi-process ones compare the ops with these.
"""

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)


def _finite_float(x):
    return bool(np.isfinite(x)) and abs(x) <= FLT_MAX


class GradientNoiseScale:
    """The EMA state of one KfGradientNoiseScale key, in float64 like the kernel."""

    def __init__(self, alpha=0.1):
        self.alpha = float(np.float32(alpha))  # the op's attr is a float32
        self.initialized = False
        self.g_sq = 0.0
        self.trace = 0.0

    @staticmethod
    def estimate(g_small_sq, g_big_sq, b_small, b_big):
        """(|G|^2, tr Sigma) of one step, or None when an input or an estimate is not finite."""
        g_small_sq, g_big_sq, b_small, b_big = (float(np.float32(x)) for x in (g_small_sq, g_big_sq, b_small, b_big))
        if not (np.isfinite(b_big) and b_big > b_small > 0):
            raise ValueError(f"needs b_big > b_small > 0, got b_small={b_small} b_big={b_big}")
        if not (np.isfinite(g_small_sq) and np.isfinite(g_big_sq)):
            return None
        g_sq = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
        trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
        if not (_finite_float(g_sq) and _finite_float(trace)):
            return None
        return g_sq, trace

    def update(self, g_small_sq, g_big_sq, b_small, b_big):
        """One step; returns (gns, g_sq, trace) as the op outputs them."""
        est = self.estimate(g_small_sq, g_big_sq, b_small, b_big)
        if est is not None and not self.initialized:
            self.initialized, (self.g_sq, self.trace) = True, est
        elif est is not None:
            a = self.alpha
            self.g_sq = (1 - a) * self.g_sq + a * est[0]
            self.trace = (1 - a) * self.trace + a * est[1]
        return self.gns(), self.g_sq, self.trace

    def gns(self):
        if not self.initialized or not (self.g_sq > 0) or not (self.trace > 0):
            return 0.0
        value = self.trace / self.g_sq
        return value if _finite_float(value) else 0.0


class SyntheticGradients:
    """Gradients of a model whose true gradient G and per-sample noise covariance Sigma are known.

    Per-sample gradients are G + e with e ~ N(0, Sigma), Sigma diagonal with trace `trace`; |G|^2 =
    `g_sq`. A mean over b samples is then exactly G + N(0, Sigma / b), so a worker's batch mean is
    drawn directly. step() returns N workers' batch means (each of `local_batch` samples); worker 0's is
    the small batch, their mean the big batch of N * local_batch samples, as an all-reduce makes it.
    """

    def __init__(self, dim, g_sq, trace, seed):
        self.rng = np.random.default_rng(seed)
        direction = self.rng.standard_normal(dim)
        self.G = direction * np.sqrt(g_sq / np.sum(direction ** 2))
        weights = self.rng.uniform(0.5, 1.5, dim)  # unequal per-coordinate variances
        self.variances = weights * (trace / np.sum(weights))
        self.g_sq, self.trace = float(np.sum(self.G ** 2)), float(np.sum(self.variances))

    def step(self, workers, local_batch):
        noise = self.rng.standard_normal((workers, self.G.size)) * np.sqrt(self.variances / local_batch)
        return self.G + noise

    def sq_norms(self, workers, local_batch):
        """(|G_small|^2, |G_big|^2) of one step: worker 0's gradient, and the mean over workers."""
        grads = self.step(workers, local_batch)
        return float(np.sum(grads[0] ** 2)), float(np.sum(grads.mean(axis=0) ** 2))
