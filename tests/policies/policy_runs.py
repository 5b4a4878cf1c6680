"""Drives policies through a simulated run: the Python hooks on Contexts, or the symbolic graph stand-in.

simulate() keeps the training state (batch size, learning rate, strategy), asks `call` for each step's
changes from the readings, applies them, and returns the changes step by step. Both drivers see the same
readings, so their results can be compared decision for decision.
"""

from policies.base import due
from policies.context import Context
from policy_symbolic import SymRun


def python_caller(policies):
    """call(readings) -> changes: the due after_step hooks on one Context, as a runner does."""
    def call(**readings):
        ctx = Context(hook="after_step", **readings)
        for p in policies:
            if due(p, "after_step", readings["step"]):
                p.after_step(ctx)
        return ctx.changes
    return call


def symbolic_caller(policies):
    """call(readings) -> changes: the same through SymRun (raises NotCompilable on a tensor misuse)."""
    return SymRun(policies).after_step


def simulate(call, steps, metrics, *, batch_size=64, learning_rate=0.1, strategy="sma", cluster_size=4):
    """Runs steps 1..steps; metrics(step, batch_size) gives each step's metrics dict.
    Returns {step: changes} for the steps where something changed, and the final state."""
    state = {"batch_size": batch_size, "learning_rate": learning_rate, "strategy": strategy}
    log = {}
    for step in range(1, steps + 1):
        changes = call(step=step, cluster_size=cluster_size, metrics=metrics(step, state["batch_size"]), **state)
        for k in state:
            if k in changes:
                state[k] = changes[k]
        if changes:
            log[step] = dict(changes)
    return log, state


def both(make_policies, steps, metrics, **start):
    """simulate() with the Python hooks and with the symbolic graph, each on fresh policies."""
    py = simulate(python_caller(make_policies()), steps, metrics, **start)
    sym = simulate(symbolic_caller(make_policies()), steps, metrics, **start)
    return py, sym
