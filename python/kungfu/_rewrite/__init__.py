"""kungfu.rewrite: a graph rewrite that makes a user's training-step tf.function distributed.

    step = kungfu.rewrite(train_step, strategy="ssgd")   # train_step: tape.gradient + opt.apply_gradients
    loss = step(x, y)                                     # gradients averaged over the workers

Layout, by responsibility:
  core.py          rewrite(), the Rewritten callable, one rewrite per concrete function
  find.py          finding the gradient tensors and the trainable-variable updates they feed
  graphdef.py      editing the traced GraphDef: cutting it around the gradients
  rebind.py        re-importing it into a new tf.function, captures re-bound, passes in between
  passes.py        the extension point: Gradient, PassContext, how passes run
  ssgd.py          the S-SGD pass: all-reduce (dense) and all-gather (IndexedSlices) means
  monitors.py      the S-SGD pass with kungfu.monitor's monitors (rewrite(..., monitors=[...]))
  _conventions.py  every assumption about TF/Keras graphs and TF internals, in one place
See docs/rewrite.md.
"""

from .core import STRATEGIES
from .core import Report
from .core import Rewritten
from .core import rewrite
from .passes import Gradient
from .passes import PassContext

__all__ = ["rewrite", "Rewritten", "Report", "Gradient", "PassContext", "STRATEGIES"]
