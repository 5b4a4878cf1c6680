"""How a distributed optimizer is made: DistributedOptimizer(opt) and the three named constructors.

DistributedOptimizer makes (once per base class) a subclass of type(opt) with DistributedMixin
(_wrapper.py) in front, keeping the base's name, module and Keras registered name, so that Keras
serializes it as the base class; then it builds a new instance from opt's settings (_rebuild) and
attaches the KungFu settings, monitors and compiled policies.
"""

from .. import monitor as _monitor
from ..ops import _compression
from . import _reduce
from ._wrapper import DistributedMixin
from ._wrapper import _Settings
from ._wrapper import strategy_index

_classes = {}  # base optimizer class -> its distributed subclass


def DistributedOptimizer(optimizer, strategy="ssgd", alpha=0.1, fusion_bytes=None, sparse_as_dense=False,
                         monitor=None, monitor_interval=1, local_batch_size=None, monitor_alpha=0.1,
                         policies=None, dataset=None, compression=None):
    """optimizer (any Keras 3 optimizer), distributed over the workers. A used one, e.g. the optimizer
    keras.models.load_model restored (kungfu.keras.load_model does this), hands its state (step count,
    learning rate, slots) to the wrapper when the wrapper is built over the same model's variables.

    strategy: "ssgd", "sma" or "pair_averaging"; change it later with .strategy = ... or
    .set_strategy(...). alpha: SMA's step toward the average, in (0, 1]. fusion_bytes: size of the
    gradient buckets (default 4 MiB; 0: one collective per gradient). sparse_as_dense: all-reduce
    IndexedSlices gradients as dense tensors instead of all-gathering them. compression: None or "fp16",
    which sends S-SGD's dense float32/float64 gradients as float16 (half the bytes; see
    kungfu/ops/_compression.py). An optimizer made with gradient_accumulation_steps=N (Keras's own
    argument) exchanges once per update, every N steps, unless monitors are on (docs/training.md).
    monitor: None or a list from "gns", "variance", "snr", computed in S-SGD steps every
    monitor_interval steps; read them with kungfu.monitor.latest(). local_batch_size: this worker's
    batch size (an int, or a tf.Variable to follow; change it later with .set_local_batch_size(n)), needed by
    "gns" and "snr", and for samples_per_sec. monitor_alpha: the EMA weight of a new gradient noise
    scale estimate, in (0, 1] (smaller: smoother, slower to follow). See docs/monitoring.md.
    policies: None or a list of compilable kungfu.policies, compiled into every step after the update
    (as kungfu.rewrite(fn, policies=...) does): they read this optimizer's monitors and assign its
    learning rate and strategy, and the batch size of dataset= (a kungfu.data.AdaptiveDataset).
    See docs/policies.md.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras optimizer (keras.optimizers.Optimizer), got {type(optimizer).__name__}")
    if isinstance(optimizer, DistributedMixin):
        raise ValueError(f"{optimizer.name} is already a kungfu distributed optimizer; wrap the plain optimizer once")
    strategy_index(strategy, "DistributedOptimizer(strategy=...)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        raise ValueError(f"alpha must be a number in (0, 1], got {alpha!r}")
    fusion_bytes = _reduce.check_fusion_bytes(fusion_bytes)
    compression = _compression.check(compression, "DistributedOptimizer")
    names, monitor_interval = _monitor.check_arguments(monitor, monitor_interval, local_batch_size, monitor_alpha)
    base = type(optimizer)
    cls = _classes.get(base)
    if cls is None:
        # Same name and module as the base: Keras serializes the optimizer as the base class.
        cls = type(base.__name__, (DistributedMixin, base), {"__module__": base.__module__,
                                                              "__qualname__": base.__qualname__})
        _serialize_as(cls, base)
        _classes[base] = cls
    wrapped = _rebuild(optimizer, cls)
    wrapped._kungfu = _Settings(strategy, float(alpha), fusion_bytes, bool(sparse_as_dense), compression)
    if optimizer.built:  # a used optimizer (e.g. one keras.models.load_model restored): keep its state
        wrapped._kungfu.state_from = list(optimizer.variables)
        wrapped._kungfu.iterations_from = optimizer.iterations  # its step count until then (policies' start)
    elif _restore_pending(optimizer):
        # tf.train.Checkpoint(optimizer=opt).restore(...) into an unbuilt optimizer waits for opt's variables,
        # which the wrapper (a new optimizer) would never make: the wrapper builds opt beside itself, so
        # that the restore lands there, and takes its state (Horovod's order: restore, then wrap).
        wrapped._kungfu.restore_into = optimizer
    if monitor is not None:
        wrapped._kungfu.monitors = _monitor.Monitors(names, monitor_interval, local_batch_size, wrapped.name,
                                                     monitor_alpha)
        if isinstance(wrapped, keras.optimizers.LossScaleOptimizer):  # apply() gets scaled gradients
            wrapped._kungfu.monitors.loss_scale = lambda: (wrapped.dynamic_scale if wrapped.built  # as
                                                           else wrapped.initial_scale)  # scale_loss reads it
    if policies is not None:
        from .._policy.controls import Controls
        from .._policy.graph import CompiledPolicies

        controls = Controls("DistributedOptimizer", optimizer=wrapped, dataset=dataset,
                            monitors=wrapped._kungfu.monitors)
        wrapped._kungfu.policies = CompiledPolicies(policies, controls, "optimizer", "DistributedOptimizer")
    elif dataset is not None:
        raise ValueError("DistributedOptimizer: dataset= is for policies=[...]")
    return wrapped


def _restore_pending(optimizer):
    """Whether a checkpoint restore into optimizer waits for its variables (TensorFlow's Trackable keeps such
    restores as deferred dependencies; without that attribute, none is assumed)."""
    return bool(getattr(optimizer, "_deferred_dependencies", None))


def _serialize_as(cls, base):
    """Makes Keras name cls in a saved config as it names base. Keras looks a class's registered name up by the
    class object, so a base registered with keras.saving.register_keras_serializable ("MyPkg>MyAdam") would
    otherwise be saved as plain "MyAdam", which load_model cannot find. cls gets the base's name, and the
    name keeps loading the base itself (a saved model loads with the plain base optimizer)."""
    import keras

    name = keras.saving.get_registered_name(base)
    if ">" not in name or keras.saving.get_registered_object(name) is not base:
        return  # not registered: saved by module and class name, which are the base's already
    package, _, short = name.partition(">")
    keras.saving.register_keras_serializable(package, short)(cls)
    keras.saving.get_custom_objects()[name] = base


def _rebuild(optimizer, cls):
    """A new cls with optimizer's settings: its get_config(), except that a learning-rate schedule or
    callable is passed as the object itself (a config cannot always rebuild it: an unregistered schedule
    class, a lambda), a LossScaleOptimizer's inner optimizer is rebuilt the same way, a MultiOptimizer gets
    the caller's own map (its optimizers and selector, as they are), and AdamW's (or any optimizer's)
    exclude_from_weight_decay() choices, which the config lacks, are kept. A setting the config does not
    carry (a subclass's own __init__ argument left out of its get_config()) raises rather than being lost."""
    import keras

    what = type(optimizer).__name__
    try:
        if isinstance(optimizer, keras.optimizers.MultiOptimizer):  # its config would serialize the map
            new = cls(optimizer._optimizer_map, loss_scale_factor=optimizer.loss_scale_factor, name=optimizer.name)
        elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            config = optimizer.get_config()
            config.pop("inner_optimizer")
            inner = optimizer.inner_optimizer
            new = cls(_rebuild(inner, type(inner)), **config)
        else:
            config = optimizer.get_config()
            lr = getattr(optimizer, "_learning_rate", None)
            if lr is not None and not isinstance(lr, keras.Variable):
                config["learning_rate"] = lr
            new = cls.from_config(config)
    except TypeError as e:
        raise TypeError(f"kungfu.optimizers: cannot rebuild the {what} to wrap from its get_config() ({e}); a "
                        "custom optimizer's get_config() must return every __init__ argument, as Keras's own "
                        "optimizers' do") from e
    for attr in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if attr in vars(optimizer):
            setattr(new, attr, getattr(optimizer, attr))
    _check_settings_kept(optimizer, new, what)
    return new


def _check_settings_kept(optimizer, new, what):
    """Raises ValueError when a plain public setting of optimizer (a number, string or flag attribute)
    came out different in its rebuilt copy: its get_config() left it out."""
    lost = []
    for name, value in vars(optimizer).items():
        if name.startswith("_") or name == "built" or not isinstance(value, (bool, int, float, str)):
            continue
        rebuilt = vars(new).get(name, value)
        if rebuilt != value and not (value != value and rebuilt != rebuilt):  # NaN equals NaN here
            lost.append(f"{name}={value!r} (rebuilt: {rebuilt!r})")
    if lost:
        raise ValueError(f"kungfu.optimizers: the {what} to wrap is rebuilt from its get_config(), which does not "
                         f"carry {', '.join(lost)}; add them to its get_config(), as Keras's own optimizers do")


def SynchronousSGDOptimizer(optimizer, fusion_bytes=None, sparse_as_dense=False, compression=None, **monitors):
    """Synchronous SGD: every step applies the mean of all workers' gradients (all-reduce).
    compression="fp16" sends the gradients as float16. monitors: monitor=, monitor_interval=,
    local_batch_size=, monitor_alpha=, policies=, dataset=, as for DistributedOptimizer."""
    return DistributedOptimizer(optimizer, "ssgd", fusion_bytes=fusion_bytes, sparse_as_dense=sparse_as_dense,
                                compression=compression, **monitors)


def SynchronousAveragingOptimizer(optimizer, alpha=0.1, fusion_bytes=None, **monitors):
    """Synchronous model averaging: every step each worker moves its model a fraction alpha toward
    the workers' average model, then applies its own gradients. monitors: as for
    DistributedOptimizer (on due steps SMA all-reduces the gradients for them)."""
    return DistributedOptimizer(optimizer, "sma", alpha=alpha, fusion_bytes=fusion_bytes, **monitors)


def PairAveragingOptimizer(optimizer, fusion_bytes=None, **monitors):
    """Asynchronous decentralised SGD (AD-PSGD): every step each worker averages its model with that
    of one random peer, fetched from the peer's model store without waiting for the peer. monitors:
    as for DistributedOptimizer; computed only in S-SGD and SMA steps (after a switch away)."""
    return DistributedOptimizer(optimizer, "pair_averaging", fusion_bytes=fusion_bytes, **monitors)
