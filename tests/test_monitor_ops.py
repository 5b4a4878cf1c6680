"""The monitor ops and their wrappers (kungfu.ops.monitor) on one process: values against the numpy
reference (monitor_reference.py), accuracy on synthetic gradients with a known noise scale, the handling
of non-finite and negative values, errors, shapes, and state across tf.function retracing.
"""

import numpy as np
import pytest
import tensorflow as tf

from kungfu.ops import monitor

import monitor_reference as ref

pytestmark = pytest.mark.usefixtures("kungfu_library")  # fails, naming the fix, when it is not built


def run_gns(key, alpha, steps):
    """Feeds (g_small_sq, g_big_sq, b_small, b_big) tuples to the op and to the reference; both outputs."""
    model = ref.GradientNoiseScale(alpha)
    got, want = [], []
    for args in steps:
        out = monitor.gradient_noise_scale(*args, key=key, alpha=alpha)
        got.append([float(out[k]) for k in ("gns", "g_sq", "trace")])
        want.append(model.update(*args))
    return np.array(got), np.array(want)


class GradientNoiseScaleTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.key = f"test/{self.id()}"
        monitor.reset_monitor(self.key)

    def test_known_values(self):
        out = monitor.gradient_noise_scale(1.0, 0.5, 8, 32, key=self.key)
        # |G|^2 = (32*0.5 - 8*1) / 24, tr = 0.5 / (1/8 - 1/32)
        self.assertAllClose([out["gns"], out["g_sq"], out["trace"]], [16.0, 1 / 3, 16 / 3], rtol=1e-6)
        for v in out.values():
            self.assertEqual(v.dtype, tf.float32)
            self.assertEqual(v.shape, ())

    def test_matches_reference_on_random_inputs(self):
        rng = np.random.default_rng(1)
        steps = []
        for _ in range(300):
            b_small = float(rng.integers(1, 64))
            b_big = b_small * float(rng.integers(2, 9))
            big = float(rng.uniform(0.1, 2.0))
            steps.append((big + float(rng.uniform(-0.5, 3.0)), big, b_small, b_big))  # some negative estimates
        for alpha in (0.1, 0.05, 1.0):
            monitor.reset_monitor(self.key)
            got, want = run_gns(self.key, alpha, steps)
            self.assertAllClose(got, want, rtol=1e-5, atol=1e-6)

    def test_synthetic_gradients_within_10_percent(self):
        for b_small, workers in ((8, 2), (16, 4), (4, 8), (64, 2)):
            monitor.reset_monitor(self.key)
            data = ref.SyntheticGradients(dim=2000, g_sq=1.0, trace=32.0, seed=b_small * 100 + workers)
            steps = [data.sq_norms(workers, b_small) + (b_small, b_small * workers) for _ in range(500)]
            got, want = run_gns(self.key, 0.05, steps)
            self.assertAllClose(got, want, rtol=1e-5, atol=1e-6)
            gns, g_sq, trace = got[-1]
            msg = f"B_small={b_small} N={workers}"
            self.assertAllClose(g_sq, data.g_sq, rtol=0.1, msg=msg)
            self.assertAllClose(trace, data.trace, rtol=0.1, msg=msg)
            self.assertAllClose(gns, data.trace / data.g_sq, rtol=0.1, msg=msg)

    def test_non_finite_input_leaves_ema_unchanged(self):
        before = monitor.gradient_noise_scale(1.0, 0.5, 8, 32, key=self.key)
        for bad in (float("nan"), float("inf"), -float("inf")):
            for args in ((bad, 0.5), (1.0, bad)):
                out = monitor.gradient_noise_scale(*args, 8, 32, key=self.key)
                for k in before:
                    self.assertEqual(float(out[k]), float(before[k]), msg=f"{k} after {args}")
        # an estimate that overflows float is not finite either
        out = monitor.gradient_noise_scale(3e38, 0.0, 8, 32, key=self.key)
        self.assertEqual(float(out["trace"]), float(before["trace"]))

    def test_nan_first_does_not_initialise(self):
        out = monitor.gradient_noise_scale(float("nan"), 0.5, 8, 32, key=self.key)
        self.assertAllEqual([out["gns"], out["g_sq"], out["trace"]], [0.0, 0.0, 0.0])
        out = monitor.gradient_noise_scale(1.0, 0.5, 8, 32, key=self.key)  # the first finite one initialises
        self.assertAllClose(out["gns"], 16.0)

    def test_negative_estimates_are_averaged_but_gns_stays_finite(self):
        # |G_big|^2 > |G_small|^2: negative tr Sigma
        out = monitor.gradient_noise_scale(0.5, 1.0, 8, 32, key=self.key)
        self.assertLess(float(out["trace"]), 0)
        self.assertEqual(float(out["gns"]), 0.0)
        # B_big |G_big|^2 < B_small |G_small|^2: negative |G|^2
        monitor.reset_monitor(self.key)
        out = monitor.gradient_noise_scale(10.0, 0.1, 8, 32, key=self.key)
        self.assertLess(float(out["g_sq"]), 0)
        self.assertEqual(float(out["gns"]), 0.0)
        # the negative estimate stays in the EMA (not clipped): a later positive one averages with it
        out = monitor.gradient_noise_scale(1.0, 0.5, 8, 32, key=self.key, alpha=0.5)
        self.assertAllClose(out["g_sq"], 0.5 * (32 * 0.1 - 80) / 24 + 0.5 / 3)
        self.assertTrue(np.isfinite(float(out["gns"])))

    def test_bad_batch_sizes_name_the_values(self):
        for b_small, b_big in ((32, 16), (8, 8), (0, 8), (-4, 8), (8, float("inf")), (float("nan"), 8)):
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"b_big > b_small > 0.*b_small=.*b_big="):
                monitor.gradient_noise_scale(1.0, 0.5, b_small, b_big, key=self.key)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "b_small=32 b_big=16"):
            monitor.gradient_noise_scale(1.0, 0.5, 32, 16, key=self.key)

    def test_argument_errors(self):
        with self.assertRaisesRegex(ValueError, "alpha"):
            monitor.gradient_noise_scale(1.0, 0.5, 8, 32, key=self.key, alpha=0.0)
        with self.assertRaisesRegex(ValueError, "key"):
            monitor.gradient_noise_scale(1.0, 0.5, 8, 32, key="")
        with self.assertRaisesRegex(ValueError, "scalar"):
            monitor.gradient_noise_scale([1.0, 2.0], 0.5, 8, 32, key=self.key)
        with self.assertRaises(TypeError):
            monitor.gradient_noise_scale("x", 0.5, 8, 32, key=self.key)

    def test_shape_function_rejects_non_scalars(self):
        ops = monitor._lib.op_module()

        @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
        def f(x):
            return ops.kf_gradient_noise_scale(x, 0.5, 8.0, 32.0, key=self.key)

        with self.assertRaisesRegex(ValueError, "rank"):
            f.get_concrete_function()

    def test_state_survives_retracing_and_reset_works(self):
        model = ref.GradientNoiseScale(0.1)

        @tf.function
        def step(g_small, g_big, b_small):  # a Python b_small retraces per value
            return monitor.gradient_noise_scale(g_small, g_big, b_small, 64.0, key=self.key)

        inputs = [(1.0, 0.5, 8.0), (2.0, 0.4, 16.0), (1.5, 0.6, 8.0), (3.0, 0.2, 32.0)]
        for g_small, g_big, b_small in inputs:
            out = step(tf.constant(g_small), tf.constant(g_big), b_small)
            want = model.update(g_small, g_big, b_small, 64.0)
            self.assertAllClose([out["gns"], out["g_sq"], out["trace"]], want, rtol=1e-5)
        self.assertEqual(step.experimental_get_tracing_count(), 3)
        # an eager call with the same key continues the same EMA
        out = monitor.gradient_noise_scale(1.0, 0.5, 8.0, 64.0, key=self.key)
        self.assertAllClose(out["g_sq"], model.update(1.0, 0.5, 8.0, 64.0)[1], rtol=1e-5)

        @tf.function
        def reset():
            monitor.reset_monitor(self.key)

        reset()
        out = step(tf.constant(1.0), tf.constant(0.5), 8.0)
        self.assertAllClose(out["g_sq"], ref.GradientNoiseScale().update(1.0, 0.5, 8.0, 64.0)[1], rtol=1e-6)

    def test_keys_are_independent(self):
        other = self.key + "/other"
        monitor.reset_monitor(other)
        monitor.gradient_noise_scale(1.0, 0.5, 8, 32, key=self.key)
        out = monitor.gradient_noise_scale(2.0, 0.5, 8, 32, key=other)
        self.assertAllClose(out["g_sq"], (32 * 0.5 - 16) / 24 + 0.0, atol=1e-7)
        monitor.reset_monitor(other)


class HelpersTest(tf.test.TestCase):

    def test_squared_norm(self):
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [1.0, 1.0]]), tf.constant([0, 2, 0]),
                                  tf.constant([4, 2]))
        dense_sparse = np.array([[2.0, 3.0], [0, 0], [3.0, 4.0], [0, 0]])  # repeated index 0 summed
        want = np.sum(a ** 2) + np.sum(dense_sparse ** 2) + 4.0
        got = monitor.squared_norm([tf.constant(a), None, sparse, tf.constant([2.0], tf.float16)])
        self.assertEqual(got.dtype, tf.float32)
        self.assertAllClose(got, want)
        self.assertAllClose(tf.function(monitor.squared_norm)([tf.constant(a), sparse]), want - 4.0)
        self.assertAllClose(monitor.squared_norm([]), 0.0)

    def test_squared_norm_is_one_op_in_every_float_dtype(self):
        rng = np.random.default_rng(4)
        big = rng.standard_normal(1_000_003)  # large enough to be split over threads
        parts = [big.astype(np.float32), rng.standard_normal((3, 5)), np.array([0.5, -2.0]), np.zeros((0, 4))]
        dtypes = [tf.float32, tf.float64, tf.bfloat16, tf.float16]
        tensors = [tf.constant(a, d) for a, d in zip(parts, dtypes)]
        want = sum(np.sum(t.numpy().astype(np.float64) ** 2) for t in tensors)
        self.assertAllClose(monitor.squared_norm(tensors), want, rtol=1e-6)
        self.assertAllClose(monitor.squared_norm([tf.constant([3, 4], tf.int32)]), 25.0)  # cast to float32
        graph = tf.function(monitor.squared_norm).get_concrete_function(tensors).graph
        self.assertEqual([op.type for op in graph.get_operations()].count("KfSquaredNorm"), 1)
        huge = (1 << 24) + 3  # above the kernel's threshold for splitting over the intra-op threads
        self.assertAllClose(monitor.squared_norm([tf.fill([huge], 0.5)]), huge * 0.25, rtol=1e-6)

    def test_consecutive_sq_norms_of_dense_pairs(self):
        rng = np.random.default_rng(5)
        g = [rng.standard_normal((40, 30)).astype(np.float32), rng.standard_normal(7)]
        p = [rng.standard_normal((40, 30)).astype(np.float32), rng.standard_normal(7)]
        small, big, prev = monitor.consecutive_sq_norms([tf.constant(g[0]), tf.constant(g[1])],
                                                        [tf.constant(p[0]), tf.constant(p[1])], previous=True)
        self.assertAllClose(small, sum(np.sum(a.astype(np.float64) ** 2) for a in g), rtol=1e-6)
        self.assertAllClose(big, sum(np.sum(((a + b) / 2.0) ** 2) for a, b in zip(g, p)), rtol=1e-6)
        self.assertAllClose(prev, sum(np.sum(b.astype(np.float64) ** 2) for b in p), rtol=1e-6)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "gradient 0 has shape .* previous one"):
            monitor.consecutive_sq_norms([tf.constant(g[0])], [tf.constant(p[0][:, :2])])
        with self.assertRaisesRegex(ValueError, "Dimension"):  # traced: the shape function catches it
            tf.function(monitor.consecutive_sq_norms)([tf.constant(g[0])], [tf.constant(p[0][:, :2])])

    def test_consecutive_sq_norms(self):
        g = [tf.constant([1.0, 2.0]), tf.IndexedSlices(tf.constant([[1.0]]), tf.constant([1]), tf.constant([3, 1]))]
        p = [tf.constant([3.0, 0.0]), tf.IndexedSlices(tf.constant([[3.0]]), tf.constant([1]), tf.constant([3, 1]))]
        small, big = monitor.consecutive_sq_norms(g, p)
        self.assertAllClose(small, 1 + 4 + 1)
        self.assertAllClose(big, 4 + 1 + 4)
        with self.assertRaisesRegex(ValueError, "previous"):
            monitor.consecutive_sq_norms(g, p[:1])

    def test_single_worker_gradient_noise_scale(self):
        key = "test/single"
        monitor.reset_monitor(key)
        g, p = [tf.constant([1.0, 2.0])], [tf.constant([3.0, 0.0])]
        out = monitor.single_worker_gradient_noise_scale(g, p, 16, key, prev_valid=False)
        self.assertAllEqual([out["gns"], out["g_sq"], out["trace"]], [0.0, 0.0, 0.0])  # skipped
        out = monitor.single_worker_gradient_noise_scale(g, p, 16, key)
        self.assertAllClose([out["g_sq"], out["trace"]], ref.GradientNoiseScale.estimate(5.0, 5.0, 16, 32))
        monitor.reset_monitor(key)

    def test_single_worker_on_independent_steps_is_unbiased(self):
        # with independent consecutive gradients (a model that does not move) the estimator is the two-batch one
        key = "test/single_unbiased"
        monitor.reset_monitor(key)
        data = ref.SyntheticGradients(dim=2000, g_sq=1.0, trace=32.0, seed=7)
        prev = data.step(1, 16)[0]
        for _ in range(500):
            cur = data.step(1, 16)[0]
            out = monitor.single_worker_gradient_noise_scale([tf.constant(cur)], [tf.constant(prev)], 16, key,
                                                             alpha=0.05)
            prev = cur
        self.assertAllClose(out["gns"], data.trace / data.g_sq, rtol=0.1)
        monitor.reset_monitor(key)

    def test_snr(self):
        self.assertAllClose(monitor.snr(2.0, 8.0, 32), 2.0 * 32 / 8.0)
        for g_sq, trace in ((1.0, 0.0), (1.0, -1.0), (-1.0, 1.0), (float("nan"), 1.0), (1.0, float("inf")),
                            (3e38, 1e-30)):
            value = monitor.snr(g_sq, trace, 32)
            self.assertEqual(float(value), 0.0, msg=f"snr({g_sq}, {trace})")

    def test_gradient_variance(self):
        rng = np.random.default_rng(3)
        grads = rng.standard_normal((4, 10)).astype(np.float32)
        mean = grads.mean(axis=0)
        want = np.mean(np.sum((grads - mean) ** 2, axis=1))
        mean_local = np.mean(np.sum(grads ** 2, axis=1))
        self.assertAllClose(monitor.gradient_variance(mean_local, np.sum(mean ** 2)), want, rtol=1e-5)
        self.assertEqual(float(monitor.gradient_variance(1.0, 1.0 + 1e-6)), 0.0)  # rounding below 0
        self.assertEqual(float(monitor.gradient_variance(float("nan"), 1.0)), 0.0)


if __name__ == "__main__":
    tf.test.main()


class RecordStepTest(tf.test.TestCase):
    """KfMonitorRecord: one op giving what gradient_noise_scale, snr and gradient_variance give apart."""

    def setUp(self):
        super().setUp()
        self.key, self.apart = f"test/{self.id()}", f"test/{self.id()}/apart"
        for k in (self.key, self.apart):
            monitor.reset_monitor(k)

    def test_equals_the_separate_functions_step_by_step(self):
        rng = np.random.default_rng(7)
        last_variance = 0.0
        for t in range(200):
            b = float(rng.integers(1, 64))
            big = float(rng.uniform(0.1, 2.0))
            small = big + float(rng.uniform(-0.5, 3.0))  # some negative estimates
            spread = big + float(rng.uniform(-0.2, 1.0))  # some negative variances (clipped to 0)
            if t % 17 == 5:
                small = float("nan")  # skipped by the EMAs, as the separate op skips it
            valid = t % 11 != 3
            got = monitor.record_step(small, big, spread, b, 4 * b, 4 * b, self.key, alpha=0.2, valid=valid)
            apart = monitor.gradient_noise_scale(small if valid else float("nan"), big, b, 4 * b, self.apart, 0.2)
            if valid:
                last_variance = float(monitor.gradient_variance(spread, big))
            want = [apart["gns"], apart["g_sq"], apart["trace"], monitor.snr(apart["g_sq"], apart["trace"], 4 * b),
                    last_variance]
            self.assertEqual(got.shape, (5,))
            self.assertAllClose(got, want, rtol=1e-5, atol=1e-6, msg=f"step {t}")

    def test_only_what_is_asked_and_errors(self):
        got = monitor.record_step(1.0, 0.5, 2.0, 8, 32, 32, self.key, gns=False, variance=True)
        self.assertAllClose(got, [0, 0, 0, 0, 1.5])
        got = monitor.record_step(1.0, 0.5, 2.0, 8, 32, 32, self.key, gns=True, variance=False)
        self.assertAllClose(got, [16.0, 1 / 3, 16 / 3, 2.0, 0], rtol=1e-6)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "needs b_big > b_small > 0, got b_small=8 b_big=8"):
            monitor.record_step(1.0, 0.5, 2.0, 8, 8, 8, self.key)
        with self.assertRaisesRegex(ValueError, r"alpha must be a number in \(0, 1\]"):
            monitor.record_step(1.0, 0.5, 2.0, 8, 32, 32, self.key, alpha=0)

    def test_in_a_function_with_a_tensor_valid(self):
        step = tf.function(lambda valid: monitor.record_step(1.0, 0.5, 2.0, 8.0, 32.0, 32.0, self.key, valid=valid))
        self.assertAllClose(step(tf.constant(False)), [0, 0, 0, 0, 0])  # nothing accepted yet
        self.assertAllClose(step(tf.constant(True)), [16.0, 1 / 3, 16 / 3, 2.0, 1.5], rtol=1e-6)


class StepClockTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.key = f"test/{self.id()}"
        monitor.reset_monitor(self.key)

    def test_times_the_gap_between_calls(self):
        import time
        self.assertAllEqual(monitor.step_clock(64.0, self.key), [0.0, 0.0])  # no previous call
        time.sleep(0.05)
        step_time, rate = monitor.step_clock(64.0, self.key).numpy()
        self.assertBetween(step_time, 0.05, 2.0)
        self.assertAllClose(rate, 64.0 / step_time, rtol=1e-5)
        monitor.reset_monitor(self.key)  # forgets the previous call
        self.assertAllEqual(monitor.step_clock(64.0, self.key), [0.0, 0.0])

    def test_without_samples_the_rate_stays_0(self):
        clock = tf.function(lambda: monitor.step_clock(0.0, self.key))
        clock()
        step_time, rate = clock().numpy()
        self.assertGreater(step_time, 0.0)
        self.assertEqual(rate, 0.0)
