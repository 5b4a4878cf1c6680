"""Adaptive batch size: a fixed small batch, a fixed large batch and a batch that follows the gradient
noise scale, trained one after another in one launch, timed to a target test accuracy, and plotted.

    kfrun -np 4 python examples/adaptive_batch.py [--budget=14 --out_dir=DIR]     (about 2 minutes)
    kfrun -np 2 python examples/adaptive_batch.py --quick                        (a smoke run, ~30 s)

The task (generated here from fixed seeds, the same on every worker): 16x16 one-channel images of 10
classes; each class is a fixed random smoothed pattern, every image its class's pattern plus N(0, 2.5^2)
pixel noise, and 20% of the labels are replaced by random classes. 50,000 training and 8,000 test images.
The best possible test accuracy (the nearest pattern, against the noisy labels) is 0.823. The model
is Conv16-MaxPool-Conv32-Dense10 (25k parameters), trained by SynchronousSGDOptimizer over SGD with
momentum 0.9, its inputs from kungfu.data.AdaptiveDataset (each worker its part of every global batch).

The three runs (same initial model, broadcast from rank 0; the same seeds):
  small     global batch 64 (16 per worker on 4 workers), LR 0.025;
  large     global batch 256, LR 0.05;
  adaptive  starts at 64; kungfu.policies.gns_batch_size() moves the batch toward the gradient noise
            scale (the "gns" monitor) within [64, 1024], run by kungfu.PolicyRunner after every step.
            The LR stays at 0.05 (lr_rule=None): the rate that suits the batches of 256 and more where
            it spends most of its time; a batch that grows at a constant LR lowers the noise of SGD as
            training goes, the job a decaying LR does otherwise (0.025, or 0.025 with the "sqrt" rule,
            were slower in a trial).
The fixed runs' settings are the best of a sweep run once (--budget 14 on 4 workers, 2 cores), global
batch x LR: 64 x {0.0125, 0.025, 0.05, 0.1}, 128 x {0.025, 0.05, 0.1}, 256 x {0.025, 0.05, 0.1},
512 x {0.05, 0.1, 0.2}. 256 at 0.05 reached 0.80 first; of the 64s, 0.025 reached 0.79 first and ended
as high as any (README, "Adaptive training", has the numbers).

The policy's settings (flags below) and why. It decides every 4 steps (the noise scale is an EMA over
~10 steps), from step 16 on (the first estimates, made near the initial weights, read high), with a
cooldown of 8 steps, and never shrinks the batch (a low estimate should not undo the annealing).
min_gain=0: its time-to-loss model T(B) = (1 + gns/B)(alpha + beta B), alpha and beta fitted to the
measured step times, then moves the batch whenever it predicts no loss. multiple_of=64 with max_change=2:
batches of 64, 128, 192, 256, 384, ...; the fit needs step times at well-separated sizes (with 64 -> 96,
the single-step times of a loaded machine twice made the fit conclude that no larger batch pays, and the
batch stayed at 96 for the whole run). That model's optimum is sqrt(gns alpha/beta), not gns, so the batch
grows more slowly than the noise scale: to 256-1024 while gns reaches 1000-2000.

Time is training time only: the clock stops while the test set is evaluated (every --eval_every seconds
of training; each worker evaluates its part of it, an all-reduce adds up the counts), and each run
trains for --budget seconds. Rank 0's clock decides when to evaluate and when to stop; it is broadcast
every 4 steps, so every worker evaluates and stops after the same step (the collectives must match).
Rank 0 prints a table (training time and steps to each target accuracy, final accuracy, adaptive
against the best fixed run at --main_target) and what the policy changed and when, and writes
<out_dir>/adaptive_batch.png (batch size, noise scale, LR and test accuracy over training time) and
<out_dir>/adaptive_batch.md (the same results in markdown), both made by adaptive_report.py beside it.

--runs takes other runs too, e.g. --runs=fixed:512:0.1,fixed:256:0.025 for a learning-rate sweep.
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
import kungfu.monitor  # noqa: E402
import kungfu.policies as kp  # noqa: E402
from adaptive_report import plot, report  # noqa: E402  (beside this script: the tables and the plot)

# What --quick sets, each unless given on the command line (as the command line would spell it).
QUICK = {"train_size": "4000", "test_size": "1000", "budget": "2", "targets": "0.6,0.7", "main_target": "0.7"}

flags.DEFINE_list("runs", ["small", "large", "adaptive"], "Runs, in order: small, large, adaptive, or "
                  "fixed:GLOBAL_BATCH:LR.")
flags.DEFINE_float("budget", 14.0, "Seconds of training per run (evaluation not counted).")
flags.DEFINE_float("eval_every", 0.5, "Seconds of training between evaluations of the test set.")
flags.DEFINE_integer("small_batch", 64, "Global batch of the fixed small run.", lower_bound=1)
flags.DEFINE_float("small_lr", 0.025, "Learning rate of the fixed small run.")
flags.DEFINE_integer("large_batch", 256, "Global batch of the fixed large run.", lower_bound=1)
flags.DEFINE_float("large_lr", 0.05, "Learning rate of the fixed large run (from the sweep in the docstring).")
flags.DEFINE_float("lr", 0.05, "Learning rate of the adaptive run (at its first batch, min_batch).")
flags.DEFINE_integer("min_batch", 64, "gns_batch_size: smallest global batch (the adaptive run starts there).",
                     lower_bound=1)
flags.DEFINE_integer("max_batch", 1024, "gns_batch_size: largest global batch.", lower_bound=1)
flags.DEFINE_integer("interval", 4, "gns_batch_size: decide every this many steps.", lower_bound=1)
flags.DEFINE_integer("warmup_steps", 16, "gns_batch_size: no change before this step.", lower_bound=0)
flags.DEFINE_integer("cooldown_steps", 8, "gns_batch_size: steps after a change before the next.", lower_bound=0)
flags.DEFINE_float("factor", 1.0, "gns_batch_size: target global batch = factor * noise scale.")
flags.DEFINE_float("min_gain", 0.0, "gns_batch_size: least predicted gain in time to loss for a change.",
                   lower_bound=0.0)
flags.DEFINE_integer("multiple_of", 64, "gns_batch_size: the global batch is a multiple of this (and of the "
                     "cluster size).", lower_bound=1)
flags.DEFINE_float("max_change", 2.0, "gns_batch_size: one change scales the batch by at most this.")
flags.DEFINE_enum("lr_rule", "none", ["none", "linear", "sqrt", "adascale"], "gns_batch_size: how the LR "
                  "follows the batch (none: it stays).")
flags.DEFINE_list("targets", ["0.79", "0.80", "0.805"], "Test accuracies to time.")
flags.DEFINE_float("main_target", 0.80, "The target of the comparison (one of --targets).")
flags.DEFINE_integer("train_size", 50000, "Training images.", lower_bound=1)
flags.DEFINE_integer("test_size", 8000, "Test images.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the initial model and of the data order.", lower_bound=0)
flags.DEFINE_integer("threads", 1, "TensorFlow threads per worker (1 suits several workers per core; 0: TF's "
                     "default).", lower_bound=0)
flags.DEFINE_string("out_dir", ".", "Where rank 0 writes adaptive_batch.png and adaptive_batch.md.")
flags.DEFINE_bool("quick", False, "A smoke run (about 30 s): " + " ".join(f"--{k}={v}" for k, v in QUICK.items())
                  + ", each unless given explicitly.")
for name in ["budget", "eval_every", "small_lr", "large_lr", "lr", "factor"]:
    flags.register_validator(name, lambda v: v > 0, "must be > 0")
flags.register_validator("max_change", lambda v: v > 1, "must be > 1")
flags.register_multi_flags_validator(["min_batch", "max_batch"], lambda f: f["min_batch"] <= f["max_batch"],
                                     "--min_batch must be at most --max_batch")
FLAGS = flags.FLAGS

SIDE, CLASSES, NOISE, LABEL_NOISE = 16, 10, 2.5, 0.2
# Steps between two broadcasts of rank 0's clock (evaluate? stop?). An evaluation thus follows a step that
# is a multiple of 4, where the policy (interval 4) has just run: the step time it reads next, 4 steps
# later, is that of one step, not of one step and an evaluation.
CHECK_EVERY = 4


def log(*args):
    if kungfu.rank() == 0:
        print(*args, flush=True)


# ---- the task ---------------------------------------------------------------------------------

def make_images(n_train, n_test):
    """(x_train, y_train, x_test, y_test, bayes): the same on every worker (fixed seed). bayes is the test
    accuracy of the nearest class pattern, the best any model can do against the noisy labels."""
    rs = np.random.RandomState(1234)
    p = rs.normal(size=(CLASSES, SIDE + 2, SIDE + 2))  # smoothed: each pixel the mean of 5 neighbours
    patterns = (p[:, :-2, :-2] + p[:, 1:-1, 1:-1] + p[:, 2:, 2:] + p[:, 2:, :-2] + p[:, :-2, 2:]) / np.sqrt(5)
    n = n_train + n_test
    clean = rs.randint(0, CLASSES, size=n)
    x = (patterns[clean] + NOISE * rs.normal(size=(n, SIDE, SIDE))).astype(np.float32)
    y = np.where(rs.uniform(size=n) < LABEL_NOISE, rs.randint(0, CLASSES, size=n), clean).astype(np.int32)
    d2 = ((x[n_train:, None] - patterns[None]) ** 2).sum((-1, -2))
    bayes = float((d2.argmin(1) == y[n_train:]).mean())
    x = (x / np.sqrt(1 + NOISE ** 2))[..., None]  # pixels of unit variance
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:], bayes


def make_model():
    keras.utils.set_random_seed(FLAGS.seed)  # the same model everywhere (and broadcast anyway)
    return keras.Sequential([
        keras.Input((SIDE, SIDE, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(CLASSES),
    ])


# ---- one run ----------------------------------------------------------------------------------

def parse_run(spec):
    """(name, global batch, lr, adaptive) of a --runs entry."""
    if spec == "small":
        return "fixed small", FLAGS.small_batch, FLAGS.small_lr, False
    if spec == "large":
        return "fixed large", FLAGS.large_batch, FLAGS.large_lr, False
    if spec == "adaptive":
        return "adaptive", FLAGS.min_batch, FLAGS.lr, True
    _, batch, lr = spec.split(":")  # fixed:GLOBAL_BATCH:LR, checked by check_runs
    return f"fixed {batch} lr {lr}", int(batch), float(lr), False


def check_runs(specs):
    """The --runs validator: every entry one parse_run() takes, fixed batches >= 1 and LRs > 0."""
    if not specs:
        raise flags.ValidationError("name at least one run")
    for spec in specs:
        if spec in ("small", "large", "adaptive"):
            continue
        parts = spec.split(":")
        try:
            good = len(parts) == 3 and parts[0] == "fixed" and int(parts[1]) >= 1 and float(parts[2]) > 0
        except ValueError:  # not numbers
            good = False
        if not good:
            raise flags.ValidationError(f"{spec!r} is none of small, large, adaptive, fixed:GLOBAL_BATCH:LR "
                                        "(GLOBAL_BATCH an integer >= 1, LR > 0)")
    return True


def check_targets(targets):
    """The --targets validator: test accuracies in (0, 1]."""
    if not targets:
        raise flags.ValidationError("name at least one test accuracy")
    for t in targets:
        try:
            good = 0 < float(t) <= 1
        except ValueError:  # not a number
            good = False
        if not good:
            raise flags.ValidationError(f"{t!r} is not a test accuracy in (0, 1]")
    return True


flags.register_validator("runs", check_runs)
flags.register_validator("targets", check_targets)


def check_cluster(size):
    """UsageError for the flags that do not fit a cluster of size workers (each needs a share of every
    batch); the rest were checked as the flags were parsed."""
    if FLAGS.train_size < size:
        raise app.UsageError(f"--train_size={FLAGS.train_size} is less than the {size} worker(s)")
    for spec in FLAGS.runs:
        name, batch, _, _ = parse_run(spec)
        if batch < size:
            raise app.UsageError(f"--runs: {name} has a global batch of {batch}, less than the {size} worker(s)")
    m = int(np.lcm(FLAGS.multiple_of, size))
    if "adaptive" in FLAGS.runs and FLAGS.max_batch // m * m < FLAGS.min_batch:
        raise app.UsageError(f"--min_batch={FLAGS.min_batch} --max_batch={FLAGS.max_batch}: no multiple of {m} "
                             f"(of --multiple_of={FLAGS.multiple_of} and the {size} worker(s)) lies between them")


def gns_policy():
    lr_rule = None if FLAGS.lr_rule == "none" else FLAGS.lr_rule
    multiple_of = int(np.lcm(FLAGS.multiple_of, kungfu.size()))  # every worker gets the same share
    return kp.gns_batch_size(FLAGS.min_batch, FLAGS.max_batch, interval=FLAGS.interval,
                             warmup_steps=FLAGS.warmup_steps, cooldown_steps=FLAGS.cooldown_steps,
                             factor=FLAGS.factor, min_gain=FLAGS.min_gain, max_change=FLAGS.max_change,
                             multiple_of=multiple_of, allow_shrink=False, lr_rule=lr_rule)


class Clock:
    """Training time: wall time since start, less the pauses (evaluation)."""

    def __init__(self):
        self.start, self.paused = time.perf_counter(), 0.0

    def now(self):
        return time.perf_counter() - self.start - self.paused

    def agreed_now(self):
        """Rank 0's training time, on every worker (a broadcast: call it after the same step everywhere)."""
        return float(kungfu.broadcast(tf.constant([self.now()], tf.float64), root=0).numpy()[0])


def build(batch, lr, data):
    """The wrapped optimizer, the dataset, the train step and the test evaluation of a run's new model."""
    x, y, x_test, y_test = data
    model = make_model()
    ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=batch, seed=FLAGS.seed)
    opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(lr, momentum=0.9), monitor=["gns"],
                                                    local_batch_size=ds.local_batch_size_variable)
    opt.build(model.trainable_variables)
    # Trainable variables only: model.variables also holds the seed generators' state (docs/training.md).
    kungfu.broadcast_variables(model.trainable_variables + opt.variables, root=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(input_signature=list(ds.element_spec))  # batch dimension None: one trace for every size
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    xs, ys = tf.constant(x_test[kungfu.rank()::kungfu.size()]), tf.constant(y_test[kungfu.rank()::kungfu.size()])

    @tf.function
    def evaluate():  # this worker's part of the test set; the correct answers summed over the workers
        guess = tf.argmax(model(xs, training=False), axis=1, output_type=tf.int32)
        correct = tf.reduce_sum(tf.cast(tf.equal(guess, ys), tf.float32))
        return kungfu.all_reduce(correct, op="sum", name="adaptive_batch/evaluate") / len(y_test)

    return opt, ds, step, evaluate


def train(spec, data):
    """Trains one run for --budget seconds of training; returns its record: the evaluations (time, steps,
    samples, accuracy, gns, global batch, lr) and the policy's changes (time, step, global batch, lr,
    what it decided)."""
    name, batch, lr, adaptive = parse_run(spec)
    opt, ds, step, evaluate = build(batch, lr, data)
    policy = gns_policy() if adaptive else None
    runner = kungfu.PolicyRunner([policy], optimizer=opt, dataset=ds) if adaptive else None
    # repeat(): one iterator for every epoch (the dataset starts the next epoch when one ends); a new
    # iterator per epoch would cost a tf.data graph optimisation each time (0.1-1 s here).
    batches = iter(ds.as_dataset().repeat())
    # One step at LR 0 (SGD with momentum then changes nothing) so that TensorFlow's one-off work on the
    # first call (graph optimisation) is not on the clock; it takes the first batch of the data.
    opt.learning_rate.assign(0.0)
    step(*next(batches))
    opt.learning_rate.assign(lr)
    evaluate()
    warm = ds.samples_seen
    rec = {"name": name, "evals": [], "changes": [], "adaptive": adaptive}

    def record(t, steps):
        rec["evals"].append((t, steps, ds.samples_seen - warm, float(evaluate()), kungfu.monitor.latest(opt)["gns"],
                             ds.batch_size, float(opt.learning_rate.numpy())))

    clock, steps, next_eval = Clock(), 0, FLAGS.eval_every
    record(0.0, 0)
    clock.start = time.perf_counter()
    for xb, yb in batches:
        step(xb, yb)
        steps += 1
        if runner is not None:
            seen = len(runner.history)
            runner.after_step()
            if len(runner.history) > seen:
                rec["changes"].append((clock.now(), steps, ds.batch_size, float(opt.learning_rate.numpy()),
                                       policy.describe_last()))
        if steps % CHECK_EVERY:
            continue
        t = clock.agreed_now()
        if t >= next_eval or t >= FLAGS.budget:
            paused = time.perf_counter()
            record(t, steps)
            clock.paused += time.perf_counter() - paused
            next_eval = t + FLAGS.eval_every
        if t >= FLAGS.budget:
            rec["last"] = policy.describe_last() if policy else None
            return rec


# ---- main -------------------------------------------------------------------------------------

def main(argv):
    del argv
    if FLAGS.quick:
        for name, value in QUICK.items():
            if not FLAGS[name].present:  # a flag given explicitly wins
                setattr(FLAGS, name, FLAGS[name].parser.parse(value))
    targets = sorted(float(t) for t in FLAGS.targets)
    if FLAGS.main_target not in targets:
        raise app.UsageError(f"--main_target={FLAGS.main_target:g} is not one of --targets={','.join(FLAGS.targets)}")
    if FLAGS.threads:
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
        tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    kungfu.init()
    check_cluster(kungfu.size())
    start = time.time()
    x, y, x_test, y_test, bayes = make_images(FLAGS.train_size, FLAGS.test_size)
    log(f"{kungfu.size()} workers; {len(x)} training and {len(x_test)} test images, best possible test accuracy "
        f"{bayes:.3f}; {FLAGS.budget:g} s of training per run; load average {os.getloadavg()[0]:.1f}")
    records = []
    for spec in FLAGS.runs:
        rec = train(spec, (x, y, x_test, y_test))
        last = rec["evals"][-1]
        log(f"{rec['name']}: {last[1]} steps, {last[2]} samples in {last[0]:.1f} s of training, batch {last[5]}, "
            f"final test accuracy {last[3]:.3f}")
        records.append(rec)
    if kungfu.rank() != 0:
        return
    lines = report(records, targets, FLAGS.main_target, FLAGS.min_gain)
    load = os.getloadavg()
    print("\n" + "\n".join(lines) + f"\n\nThe whole launch took {time.time() - start:.0f} s; load average "
          f"{load[0]:.1f} (1 min), {load[1]:.1f} (5 min) on {os.cpu_count()} cores.", flush=True)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    png, md = os.path.join(FLAGS.out_dir, "adaptive_batch.png"), os.path.join(FLAGS.out_dir, "adaptive_batch.md")
    plot(records, FLAGS.main_target, bayes, png, kungfu.size())
    with open(md, "w") as f:
        f.write(f"# Adaptive batch size, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
                f"{kungfu.size()} workers, {os.cpu_count()} cores, load average {load[0]:.1f}; best possible test "
                f"accuracy {bayes:.3f}; {FLAGS.budget:g} s of training per run.\n\n" + "\n".join(lines)
                + "\n\n![adaptive batch](adaptive_batch.png)\n")
    print(f"wrote {png} and {md}", flush=True)


if __name__ == "__main__":
    app.run(main)
