"""KungFu for TensorFlow 2: adaptive distributed training.

    import kungfu
    kungfu.init()                       # joins the cluster the launcher (kfrun) describes
    y = kungfu.all_reduce(x, op="mean")

Importing kungfu is cheap: it neither imports TensorFlow nor loads the library nor starts a thread.
init() loads the library and starts the engine; the collectives (all_reduce, group_all_reduce,
broadcast, all_gather, barrier, consensus; broadcast_object and all_gather_object for Python
objects) and the training API (DistributedGradientTape, broadcast_variables, rewrite,
kungfu.optimizers, kungfu.keras) import TensorFlow on first access.
Errors are in kungfu.errors. See docs/api.md and docs/training.md.
"""

import importlib as _importlib
import os as _os

from . import errors
from ._lib import finalize
from ._lib import init
from ._lib import initialized as is_initialized
from ._lib import local_rank
from ._lib import local_size
from ._lib import rank
from ._lib import size

_COLLECTIVES = ("all_reduce", "group_all_reduce", "broadcast", "all_gather", "barrier", "consensus",
                "broadcast_object", "all_gather_object")
# These need TensorFlow, so they are imported on first use (PEP 562): name -> (module, attribute).
_LAZY = {
    **{name: (".ops", name) for name in _COLLECTIVES},
    "DistributedGradientTape": ("._tape", "DistributedGradientTape"),
    "broadcast_variables": ("._variables", "broadcast_variables"),
    "rewrite": ("._rewrite", "rewrite"),
    "optimizers": (".optimizers", None),
    "monitor": (".monitor", None),
    "keras": (".keras", None),
    "policies": (".policies", None),
    "PolicyRunner": ("._policy", "PolicyRunner"),
    "data": (".data", None),
}

# Installed, kungfu.policies is a subpackage (setup.py maps it from policies/). In a source checkout
# (python/ on sys.path) it is the repository's policies/ directory, found through this extra path.
_SOURCE_ROOT = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "policies")) and \
        _os.path.isfile(_os.path.join(_SOURCE_ROOT, "policies", "__init__.py")):
    __path__.append(_SOURCE_ROOT)

__all__ = ["init", "finalize", "is_initialized", "rank", "size", "local_rank", "local_size", "errors", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        module, attribute = _LAZY[name]
        module = _importlib.import_module(module, __name__)
        value = module if attribute is None else getattr(module, attribute)
        globals()[name] = value  # later lookups find it directly (an eager collective is called per step)
        return value
    raise AttributeError(f"module 'kungfu' has no attribute {name!r}")


def __dir__():
    """What tab completion and dir(kungfu) show: the public API, the lazy names included (listing them
    imports nothing)."""
    return sorted(set(__all__) | {name for name in globals() if not name.startswith("_")})
