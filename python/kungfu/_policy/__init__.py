"""The runners of kungfu.policies: Python hooks around steps, and policies compiled into the step.

  controls.py  the variables policies read and change (batch size, learning rate, strategy) and the metrics
  agree.py     how Python hooks agree across workers (averaged local metrics, rank 0's decisions, errors)
  runner.py    PolicyRunner (custom loops); kungfu.keras.PolicyCallback drives one from model.fit
  graph.py     GraphContext / CompiledPolicies: kungfu.rewrite(fn, policies=[...])
See docs/policies.md.
"""

from .controls import Controls
from .runner import PolicyRunner

__all__ = ["Controls", "PolicyRunner"]
