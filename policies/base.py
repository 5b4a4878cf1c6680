"""BasePolicy: the hooks a policy overrides, and how the runners call them.

    class HalveLrOnPlateau(kungfu.policies.BasePolicy):
        def after_epoch(self, ctx):
            if ctx.metrics.get("loss", 0) > self.best:
                ctx.set_learning_rate(ctx.learning_rate / 2)
            self.best = min(self.best, ctx.metrics.get("loss", float("inf")))

A policy reads its context (policies/context.py: readings such as ctx.step, ctx.batch_size,
ctx.metrics) and acts through it (ctx.set_batch_size, set_learning_rate, set_strategy, stop). It never
touches TensorFlow, so it is tested with a hand-made Context. The runners (kungfu.PolicyRunner,
kungfu.keras.PolicyCallback) call the hooks on every worker, make the decisions agree (rank 0's are
adopted; see docs/policies.md) and apply them between steps.

Step hooks and the interval. before_step(ctx) sees ctx.step = the steps completed before this one;
after_step(ctx) sees ctx.step = the steps completed including this one (1 after the first step).
A policy with interval k has its step hooks called only when ctx.step % k == 0, so a policy that
decides every 10 steps costs nothing on the other 9 (no synchronisation between workers either).
A policy can narrow that further with due() (a schedule is called only at its entries' steps).

Compiled policies. A policy whose `compilable` is True can also run inside the training step's graph
(kungfu.rewrite(fn, policies=[...])): its after_step is traced once with a graph context whose
readings are tensors, under a tf.cond that is true every `interval` steps. Such a policy writes its
decisions branch-free: ctx.math for arithmetic and selection (ctx.math.where, minimum, sqrt, ...),
`when=` on the actions instead of `if` on a reading, and ctx.state(self, ...) for what it remembers
between calls. Then the same code gives the same decisions as a Python hook and in the graph. The
built-in policies are written so; a user's policy need not be (compilable stays False).
"""


class BasePolicy:
    """A policy: override the hooks you need; each gets a Context and returns nothing."""

    interval = 1  # step hooks run when ctx.step % interval == 0
    compilable = False  # True: after_step is branch-free (ctx.math, when=, ctx.state); see the module doc

    @property
    def name(self):
        """How errors and logs name this policy."""
        return type(self).__name__

    def before_train(self, ctx):
        """Once, before the first step."""

    def before_epoch(self, ctx):
        """At the start of every epoch (ctx.epoch is the epoch starting, from 0)."""

    def before_step(self, ctx):
        """Before a step (when ctx.step % interval == 0); changes apply to this step, except a batch size
        in a loop that has already pulled this step's batch (PolicyRunner's usual loop): the next one."""

    def after_step(self, ctx):
        """After a step (when ctx.step % interval == 0); changes apply from the next step."""

    def after_epoch(self, ctx):
        """At the end of every epoch (ctx.epoch is the epoch ending)."""

    def after_train(self, ctx):
        """Once, after the last step."""

    def overrides(self, hook):
        """Whether this policy's class defines hook itself (the runners skip hooks nobody overrides)."""
        return getattr(type(self), hook) is not getattr(BasePolicy, hook)

    def due(self, hook, step):
        """Whether the runners call hook at this step (ctx.step as the hook would see it). By default: when
        the class overrides the hook and, for the step hooks, step % interval == 0. Every call costs the
        workers two small collectives, so a policy may narrow this to skip calls that could change nothing
        (a schedule between its entries). The answer must depend only on hook, step and the policy's
        settings, never on what the policy has seen, so that every worker gives the same one. Compiled into
        the step, a policy runs every interval steps whatever this says."""
        if not self.overrides(hook):
            return False
        return hook not in STEP_HOOKS or step % self.interval == 0

    def __repr__(self):
        return f"{self.name}()"


HOOKS = ("before_train", "before_epoch", "before_step", "after_step", "after_epoch", "after_train")
STEP_HOOKS = ("before_step", "after_step")


def check_policies(policies, who):
    """policies as a list of BasePolicy (a single policy is accepted); raises TypeError naming who."""
    if isinstance(policies, BasePolicy):
        policies = [policies]
    try:
        policies = list(policies)
    except TypeError:
        raise TypeError(f"{who}: policies must be a list of kungfu.policies.BasePolicy, "
                        f"got {type(policies).__name__}") from None
    for p in policies:
        if not isinstance(p, BasePolicy):
            raise TypeError(f"{who}: every policy must be a kungfu.policies.BasePolicy (subclass it and "
                            f"override its hooks), got {type(p).__name__}")
        k = p.interval
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{who}: {p.name}.interval must be an int >= 1, got {k!r}")
    return policies


def due(policy, hook, step):
    """Whether a runner calls policy's hook at this step: policy.due(hook, step)."""
    return bool(policy.due(hook, step))
