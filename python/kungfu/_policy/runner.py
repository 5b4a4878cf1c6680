"""PolicyRunner: calls adaptation policies around the steps of a custom training loop.

    runner = kungfu.PolicyRunner([kungfu.policies.gns_batch_size(64, 1024)], optimizer=opt, dataset=ds)
    runner.before_train()
    for epoch in range(epochs):
        runner.before_epoch()
        for x, y in ds.as_dataset():
            runner.before_step()
            loss = train_step(x, y)
            runner.after_step(loss=loss)
            if runner.stopped:
                break
        runner.after_epoch()
        if runner.stopped:
            break
    runner.after_train()

kungfu.keras.PolicyCallback drives the same runner from model.fit's callbacks. In this loop the batch is
pulled before before_step(), so a batch size a policy sets there applies from the next batch.

Resuming: the step count starts at the optimizer's `iterations` (rank 0's), so a run restored from a
checkpoint goes on from the step it was saved at, as Keras's learning-rate schedules do; its hooks up to its
first step see ctx.resumed, and a schedule applies there the settings its entries up to that step give.
With dataset=, before_epoch(epoch) of a dataset that has not begun a pass starts it at that epoch.

Each hook call: the policies due (BasePolicy.due: overridden hook, step hooks every `interval` steps) run in
order on one Context (policies/context.py), whose readings come from the Controls and whose metrics are
the monitors' latest values plus the logs passed in, local ones averaged over the workers; then the
workers exchange their outcomes and apply rank 0's decisions to the controls (agree.py), or all raise
PolicyError if a policy raised anywhere. With no policy due, a hook costs a few attribute reads.

Threading: a runner is driven by the training loop's thread; it is not meant to be shared.
"""

import itertools
import logging
import numbers

from .. import _lib
from ..errors import PolicyError
from ..policies import base
from ..policies.context import Context
from . import agree
from .controls import Controls

_log = logging.getLogger("kungfu.policies")
_ids = itertools.count()


def _float_logs(logs):
    """The scalar entries of logs (Keras logs, or loss=... given by hand) as floats."""
    out = {}
    for k, v in (logs or {}).items():
        if hasattr(v, "numpy"):
            v = v.numpy()
        if hasattr(v, "ndim") and getattr(v, "ndim", 1) == 0:
            v = v.item()
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            out[k] = float(v)
    return out


def _warn_of_unsaved_bases(policies, step):
    """A learning-rate rule whose base values default to the first ones it sees (lr_scaling,
    gns_batch_size(lr_rule=...)) would, in a resumed run, take the restored or caught-up values for them,
    which no checkpoint marks as the base: its rates then differ from the uninterrupted run's."""
    if _lib.rank() != 0:
        return
    for p in policies:
        uses_base = getattr(p, "rule", None) is not None or getattr(p, "lr_rule", None) is not None
        if uses_base and (getattr(p, "base_lr", 0) is None or getattr(p, "base_batch", 0) is None):
            _log.warning("training resumed at step %d: %s takes its base learning rate and batch size from the "
                         "first values it sees, which after resuming are not the original run's; pass base_lr= and "
                         "base_batch= (the original values) to keep its rates", step, p.name)


class PolicyRunner:
    """Runs policies (a list of kungfu.policies.BasePolicy) around the steps of a training loop.

    optimizer: the optimizer the step uses (its learning rate, its strategy if it is a kungfu
    distributed optimizer, its monitors if it has any). dataset: the kungfu.data.AdaptiveDataset the
    loop iterates (needed by policies that set the batch size). monitors: where the metrics come from
    when not the optimizer's (a kungfu.rewrite step with monitors, or its name). batch_size: the global
    batch size when there is no adaptive dataset (a fixed int, for the readings only).

    After each hook: .step (steps completed), .epoch, .stopped (a policy called ctx.stop()), and
    .history, a list of (step, epoch, hook, changes) for every change applied.
    """

    def __init__(self, policies, *, optimizer=None, dataset=None, monitors=None, batch_size=None, name=None):
        self.policies = base.check_policies(policies, "PolicyRunner")
        self.controls = Controls("PolicyRunner", optimizer=optimizer, dataset=dataset, monitors=monitors,
                                 batch_size=batch_size)
        self.step = 0
        self.epoch = 0
        self.samples_seen = 0
        self.stopped = False
        self.history = []
        self.resumed = False  # this run resumed training: the optimizer had taken steps before the first run
        self._started = False  # before_train has run once
        self._key = f"kungfu/policy/{name if name is not None else next(_ids)}"

    def before_train(self, logs=None):
        """Starts a training run: a stop asked for in an earlier run is forgotten (steps and epochs go on).
        The first run starts counting steps at the optimizer's `iterations` (past 0 when resumed)."""
        self.stopped = False
        if not self._started:
            _lib.require_init("PolicyRunner.before_train")
            self._started = True
            start = agree.start_step(self.controls.optimizer, f"{self._key}/start")
            if start > 0:
                self.step, self.resumed = start, True
                batch = self.controls.batch_size()
                if self.controls.dataset is None and batch is not None:
                    self.samples_seen = start * batch  # as compiled policies count it (step * batch)
                _warn_of_unsaved_bases(self.policies, start)
        self._run("before_train", logs)

    def before_epoch(self, epoch=None, logs=None):
        """epoch: its index (Keras passes it); by default the runner's own count, from 0."""
        if epoch is not None:
            self.epoch = int(epoch)
            if self.controls.dataset is not None:
                self.controls.dataset.start_at_epoch(self.epoch)  # no-op once it has begun a pass
        self._run("before_epoch", logs)

    def before_step(self, logs=None):
        self._run("before_step", logs)

    def after_step(self, logs=None, **metrics):
        """After each step; logs (a dict) and metrics (e.g. loss=loss) join ctx.metrics."""
        self.step += 1
        self.resumed = False
        batch = self.controls.batch_size()
        if self.controls.dataset is None and batch is not None:
            self.samples_seen += batch
        self._run("after_step", {**(logs or {}), **metrics})

    def after_epoch(self, logs=None):
        self._run("after_epoch", logs)
        self.epoch += 1

    def after_train(self, logs=None):
        self._run("after_train", logs)

    # ---- one hook call ------------------------------------------------------------------------

    def _run(self, hook, logs):
        _lib.require_init(f"PolicyRunner.{hook}")
        due = [p for p in self.policies if base.due(p, hook, self.step)]
        if not due:
            return
        ctx = self._context(hook, logs)
        before = {k: getattr(ctx, k) for k in ("batch_size", "learning_rate", "strategy")}
        outcome, cause = {"error": None, "changes": {}}, None
        for p in due:
            try:
                getattr(p, hook)(ctx)
            except Exception as e:  # every worker must hear of it, or the others would wait on this one
                outcome["error"] = f"policy {p.name} raised in {hook} at step {self.step}: {type(e).__name__}: {e}"
                cause = e
                break
        if outcome["error"] is None:
            outcome["changes"] = ctx.changes
        outcomes = agree.exchange(outcome, f"{self._key}/{hook}/decide")
        failed = [(r, o["error"]) for r, o in enumerate(outcomes) if o["error"]]
        if failed:
            rank, message = failed[0]
            more = f" (and on {len(failed) - 1} other worker(s))" if len(failed) > 1 else ""
            error = PolicyError(f"{message}, on rank {rank}{more}")
            error.original = cause  # kept here too: model.fit's traceback filtering drops __cause__
            raise error from cause
        changes = outcomes[0]["changes"]
        if any(o["changes"] != changes for o in outcomes[1:]):
            _log.warning("%s: the workers' policies decided differently at step %d; rank 0's decisions are applied",
                         hook, self.step)
        self._apply(hook, changes, before)

    def _context(self, hook, logs):
        c = self.controls
        metrics = {**c.metrics(), **_float_logs(logs)}
        metrics = agree.mean_local_metrics(metrics, f"{self._key}/{hook}/metrics", "PolicyRunner")
        batch = c.batch_size()
        samples = int(c.dataset.samples_seen) if c.dataset is not None else self.samples_seen
        return Context(step=self.step, epoch=self.epoch, samples_seen=samples, batch_size=batch,
                       learning_rate=c.learning_rate(), strategy=c.strategy(), cluster_size=c.cluster_size(),
                       metrics=metrics, hook=hook, resumed=self.resumed)

    def _apply(self, hook, changes, before):
        if not changes:
            return
        self.controls.apply(changes)
        if changes.get("stop"):
            self.stopped = True
        self.history.append((self.step, self.epoch, hook, dict(changes)))
        if _lib.rank() == 0:
            said = ", ".join(f"{k} {before[k]} -> {v}" if k in before else k for k, v in changes.items())
            _log.info("step %d (%s): %s", self.step, hook, said)

    def summary(self):
        """The changes applied so far, one readable line each."""
        lines = []
        for step, epoch, hook, changes in self.history:
            said = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in changes.items())
            lines.append(f"step {step} (epoch {epoch}, {hook}): {said}")
        return lines
