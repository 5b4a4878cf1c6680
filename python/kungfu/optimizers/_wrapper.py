"""The distributed optimizer: any Keras 3 optimizer, with a synchronisation strategy that can change
between any two steps.

How it wraps. DistributedOptimizer(opt) (_factory.py) makes a subclass of type(opt) with DistributedMixin
in front and builds a new instance from opt.get_config() (as Horovod does; a learning-rate schedule or
callable is handed over as is, see _factory._rebuild): the result *is* an Adam (or
whatever opt was) to Keras, so model.compile, model.fit, checkpoints and learning-rate schedules
work unchanged. The subclass keeps the base class's name and module, so a model saved with it loads
with the plain base optimizer. Only build() and apply() are overridden; apply_gradients() goes through
apply(). Wrapping an optimizer that has been used keeps its state: build() copies its variables.

How a step runs. apply() builds the three strategies' work as the branches of one tf.switch_case on
a strategy variable (an int32 tf.Variable), then lets the base optimizer apply the gradients:
  ssgd: gradients <- their mean over workers (all-reduce; sparse ones all-gathered); at the first
        step after another strategy, the model and the optimizer's slots are first set to their mean,
        and its step counts and loss scale to rank 0's;
  sma:  variables move toward the workers' mean (all-reduce of the model); own gradients;
  pair_averaging: variables averaged with a random peer's published model; own gradients; after
        the update, the model is published (a second switch, on the same variable).
Variables whose gradient is None take part in none of them: neither exchanged, averaged nor published.
The step function is traced once; changing the strategy is one variable assignment, with no
retrace. The switch must happen at the same step on every worker (a collective in one branch waits
for the same collective on every worker): set it on every worker between the same two steps, or
from a policy, whose decisions agree across workers.

With one worker, apply() is the base optimizer's: every strategy is plain local training.

Monitors (monitor=["gns", "variance", "snr"]): kungfu.monitor.Monitors keeps their variables and
graph code. The ssgd branch computes them from the gradients' own all-reduce, before the optimizer's
update; the sma branch all-reduces the gradients for their norms on due steps; pair_averaging steps
leave them as they were (no step the workers share). With one worker,
every strategy is local training and the estimates pair consecutive steps' gradients
(Monitors.update_one_worker). See docs/monitoring.md ("Using monitors").

Policies (policies=[...]): compilable kungfu.policies whose after_step is traced into apply() after
the update and the monitors (kungfu/_policy/graph.py), so a step's monitors, decisions and controls are
all ops of its graph; their before_train hooks run once, in Python, when apply() is first traced.
"""

import tensorflow as tf

from .. import _lib
from .. import _variables
from .. import monitor as _monitor
from ..ops import _naming
from . import _accumulation
from . import _averaging
from . import _keras
from . import _reduce
from ._strategy import STRATEGIES
from ._strategy import checked_index
from ._strategy import strategy_index
from ._strategy import strategy_index_tensor


class _Settings:
    """KungFu's state on a wrapped optimizer. A plain object, so Keras and tf.train.Checkpoint do not
    track the strategy variable as an optimizer variable."""

    def __init__(self, strategy, alpha, fusion_bytes, sparse_as_dense, compression="none"):
        with tf.init_scope(), tf.device("CPU:0"):  # may be wrapped inside a tf.function
            self.strategy = tf.Variable(strategy_index(strategy), trainable=False, dtype=tf.int32,
                                        name="kungfu_strategy")
            # The strategy of the latest exchange (-1: none yet); how many pair averaging phases have
            # begun (the current one's copies' tag, see _averaging.py); and the steps since SMA began
            # (its monitors' due steps). Both counts agree across workers whatever steps each took
            # before, unlike the optimizer's iterations (uneven pair averaging, a loss scale's skips).
            self.last_strategy = tf.Variable(-1, trainable=False, dtype=tf.int32, name="kungfu_last_strategy")
            self.pair_phase = tf.Variable(0, trainable=False, dtype=tf.int64, name="kungfu_pair_phase")
            self.sma_steps = tf.Variable(0, trainable=False, dtype=tf.int64, name="kungfu_sma_steps")
            # Which set of variables the latest step exchanged (-1: none yet; ids from pair_sets): a step
            # over another set (a layer frozen, an output left without loss) begins a pair averaging phase.
            self.last_set = tf.Variable(-1, trainable=False, dtype=tf.int32, name="kungfu_last_set")
        self.store_prefix = None  # pair averaging's for the whole model, given when the exchange is first traced
        self.pair_sets = {}  # the exchanged variables' indices in the optimizer -> (their store prefix, an id)
        self.alpha = alpha
        self.fusion_bytes = fusion_bytes
        self.sparse_as_dense = sparse_as_dense
        self.compression = compression  # "none" or "fp16": how S-SGD sends dense gradients
        self.monitors = None  # kungfu.monitor.Monitors when monitors were requested
        self.state_from = None  # a used optimizer's variables, copied into the wrapper when it is built
        self.restore_into = None  # an unbuilt optimizer a checkpoint restore waits on, built with the wrapper
        self.policies = None  # kungfu._policy.graph.CompiledPolicies when policies were given


class DistributedMixin:
    """Put in front of a Keras optimizer class by DistributedOptimizer(); see the module doc."""

    _kungfu = None  # _Settings, set by DistributedOptimizer

    @property
    def strategy(self):
        """The current strategy's name: "ssgd", "sma" or "pair_averaging"; None when strategy_variable was
        assigned an index of none (the next step then fails, naming it). It does not raise: Keras reads
        it before every assignment of opt.strategy, which must stay the way out."""
        index = int(self._kungfu.strategy.numpy())
        return STRATEGIES[index] if 0 <= index < len(STRATEGIES) else None

    @strategy.setter
    def strategy(self, strategy):
        self.set_strategy(strategy)

    def set_strategy(self, strategy):
        """Switches the strategy from the next step on; no retrace. Call it at the same step on every
        worker. strategy: a name of STRATEGIES or its index; inside tf.function also a tensor (a tf.string
        name or an integer index, checked when the step runs). It assigns strategy_variable."""
        if isinstance(strategy, (tf.Tensor, tf.Variable)):
            return self._kungfu.strategy.assign(strategy_index_tensor(strategy))
        return self._kungfu.strategy.assign(strategy_index(strategy))

    @property
    def strategy_variable(self):
        """The int32 tf.Variable holding the strategy's index in STRATEGIES, for in-graph control."""
        return self._kungfu.strategy

    @property
    def policy_stopped(self):
        """Whether a policy compiled into this optimizer (policies=[...]) called ctx.stop(); False without
        policies. model.fit stops on it when a kungfu.keras.PolicyCallback is among its callbacks."""
        policies = self._kungfu.policies
        return policies is not None and bool(policies.stop_flag.numpy())

    def _forget_policy_stop(self):
        """A new model.fit starts (PolicyCallback.on_train_begin): a stop asked for in an earlier one is done with."""
        if self._kungfu.policies is not None:
            self._kungfu.policies.stop_flag.assign(False)

    @property
    def sma_alpha(self):
        return self._kungfu.alpha

    @property
    def local_batch_size(self):
        """This worker's batch size as the monitors know it (None without monitors or batch size)."""
        m = self._kungfu.monitors
        return float(m.batch.numpy()) if m is not None and m.has_batch else None

    @local_batch_size.setter
    def local_batch_size(self, n):
        self.set_local_batch_size(n)

    def set_local_batch_size(self, n):
        """Tells the monitors this worker's new batch size, from the next step on; no retrace."""
        m = self._kungfu.monitors
        if m is None:
            raise ValueError(f"{self.name} has no monitors, so no batch size to set; pass monitor=[...] and "
                             "local_batch_size= to DistributedOptimizer")
        return m.set_local_batch_size(n)  # ValueError when the monitors were made without a batch size

    def build(self, variables):
        super().build(variables)
        pending = self._kungfu.restore_into if self._kungfu is not None else None
        if pending is not None:  # see DistributedOptimizer: the waiting restore lands when pending is built
            self._kungfu.restore_into = None
            pending.build(variables)
            self._kungfu.state_from = list(pending.variables)
            self._kungfu.iterations_from = pending.iterations
        source = self._kungfu.state_from if self._kungfu is not None else None
        if source is not None:
            self._kungfu.state_from = None
            _keras.copy_state(source, self)

    def apply(self, grads, trainable_variables=None):
        _lib.require_init(f"{type(self).__name__} (a kungfu distributed optimizer)")
        if self._kungfu is None:  # e.g. type(opt).from_config(opt.get_config()): the config has no kungfu settings
            raise ValueError(f"{self.name} is a kungfu distributed optimizer class made without "
                             "DistributedOptimizer(), so it has none of its settings; wrap a plain Keras "
                             "optimizer with kungfu.optimizers.DistributedOptimizer (or SynchronousSGDOptimizer, ...)")
        _keras.refuse_loss_scale_outside(self)
        policies = self._kungfu.policies
        if policies is None:
            return self._kungfu_apply(grads, trainable_variables)
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        first = len(graph.get_operations()) if graph is not None else 0
        result = self._kungfu_apply(grads, trainable_variables)
        if not policies.started:
            with tf.init_scope():  # before_train hooks run in Python, once, when the step is first traced
                policies.start()
        with tf.name_scope("kungfu_policies"):  # after the update, the monitors and the publish
            policies.build(graph.get_operations()[first:] if graph is not None else [])
        return result

    def _kungfu_apply(self, grads, trainable_variables):
        grads = list(grads)
        m = self._kungfu.monitors
        if grads and m is not None:
            m.tick(grads)
        if not grads or _lib.size() == 1:
            variables = trainable_variables if trainable_variables is not None else (
                self._trainable_variables if self.built else None)
            if grads and m is not None and variables is not None:
                m.update_one_worker(grads, list(variables), self.iterations)
            return super().apply(grads, trainable_variables)
        if trainable_variables is None:
            if not self.built:
                return super().apply(grads, None)  # raises Keras's own error
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
            if not self.built:
                with tf.name_scope(self.name):
                    self.build(variables)
                self.built = True
        if len(grads) != len(variables):
            raise ValueError(f"apply: got {len(grads)} gradients for {len(variables)} variables")
        self._check_variables_are_known(variables)  # Keras's own error, before the exchange looks them up
        # Variables without a gradient are left alone by every strategy: neither averaged nor published.
        live = [v for g, v in zip(grads, variables) if g is not None]
        steps, accumulator = _keras.accumulating(self)
        if steps and self._kungfu.monitors is None:
            is_update = tf.equal((accumulator._iterations + 1) % steps, 0)  # as the base class decides it
            if accumulator is not self:  # a LossScaleOptimizer's inner optimizer
                _accumulation.apply_scaled_accumulated(self, super().apply, grads, variables, is_update, accumulator)
                self._kungfu_publish(live, is_update)
                return
            with tf.name_scope("kungfu"):
                grads = _accumulation.exchange_accumulated(self, grads, variables, is_update)
        else:
            is_update = None  # every step exchanges (with monitors: they measure each micro-batch)
            with tf.name_scope("kungfu"):
                grads = self._kungfu_exchange(grads, variables)
        super().apply(grads, variables)
        self._kungfu_publish(live, is_update)

    def _kungfu_exchange(self, grads, variables, layout=None):
        """The strategy's work before the update; returns the gradients to apply. layout: which of the
        optimizer's variables these are, when the caller left some out (_reduce.present_layout); by default
        that of grads' Nones."""
        kf = self._kungfu
        live = [i for i, g in enumerate(grads) if g is not None]
        g_live, v_live = [grads[i] for i in live], [variables[i] for i in live]
        if layout is None:  # checked in the exchange: see present_layout
            layout = _reduce.present_layout(live, len(grads))
        if kf.sparse_as_dense:  # before the branches, which must all return the same structure
            g_live = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in g_live]
        current, last, switched, phase, prefix = self._kungfu_strategy_step(v_live)

        def pair():
            _averaging.pair_average(v_live, prefix, self.iterations, phase)
            return g_live

        branches = {"ssgd": lambda: self._kungfu_ssgd(g_live, v_live, switched, layout),
                    "sma": lambda: self._kungfu_sma(g_live, v_live, last, layout),
                    "pair_averaging": pair}
        new = tf.switch_case(current, [_scoped(s, branches[s]) for s in STRATEGIES])
        out = list(grads)
        for i, g in zip(live, new):
            out[i] = g
        return out

    def _kungfu_strategy_step(self, v_live):
        """This step's strategy bookkeeping, before the branches: (the strategy's index, the last step's
        (-1: none yet), whether it changed since then, the pair averaging phase, the pair store prefix of
        v_live)."""
        kf = self._kungfu
        prefix, set_id = self._kungfu_pair_store(v_live)
        # Assigned by hand, strategy_variable may hold an index of none: fail the step, naming it.
        current = checked_index(kf.strategy.read_value(), f"{self.name}: strategy_variable holds")
        last = kf.last_strategy.read_value()
        switched = tf.logical_and(tf.not_equal(current, last), tf.greater_equal(last, 0))
        pair_index = strategy_index("pair_averaging")
        # A new phase on entering pair averaging, or on a step over another set of variables than the last
        # one's: a peer's copy of this set published before (say, before a layer was frozen and unfrozen
        # again) is out of date, and must count as none.
        new_set = tf.not_equal(kf.last_set.read_value(), set_id)
        entering_pair = tf.logical_and(tf.equal(current, pair_index),
                                       tf.logical_or(tf.not_equal(last, pair_index), new_set))
        phase = kf.pair_phase.assign(tf.where(entering_pair, kf.pair_phase + 1, kf.pair_phase))
        kf.last_strategy.assign(current)
        kf.last_set.assign(set_id)
        return current, last, switched, phase, prefix

    def _kungfu_ssgd(self, g_live, v_live, switched, layout):
        """The ssgd branch: the gradients' mean over the workers. Coming from another strategy, the
        workers' models (and optimizer states) have drifted apart, and the same mean gradient would keep
        them apart: on the switching step they first start from their mean."""
        import keras

        kf = self._kungfu
        scale = self.dynamic_scale if isinstance(self, keras.optimizers.LossScaleOptimizer) else None
        own_scale = None if scale is None else tf.identity(scale)  # read before the state is synced
        synced = tf.cond(switched, lambda: self._kungfu_average_state(v_live), lambda: tf.constant(False))
        with tf.control_dependencies([synced]):
            if scale is not None:
                # A LossScaleOptimizer's gradients come scaled by this worker's own loss scale, which under
                # model averaging drifted from the others'; the sync just gave every worker rank 0's, by
                # which the update unscales the mean. So on the switching step each worker's gradients
                # are rescaled to rank 0's scale first (a factor of 1 on every other step).
                inverse = tf.where(switched, own_scale / scale, tf.ones_like(own_scale))
                g_live = [_divided(g, inverse) for g in g_live]
            m = kf.monitors
            if m is None or not m.reduces:
                return _reduce.mean_gradients(g_live, v_live, kf.fusion_bytes, kf.sparse_as_dense,
                                              compression=kf.compression, layout=layout)
            reduced, updated = self._kungfu_mean_with_monitors(g_live, v_live, m.due(self.iterations), layout=layout)
            # The estimates run before the update, not beside it: with workers sharing cores, running
            # them beside the update cost 4 to 5 points more CPU per step (benchmarks/monitoring.py).
            with tf.control_dependencies([updated]):
                return [tf.identity(g) if isinstance(g, tf.Tensor) else g for g in reduced]

    def _kungfu_sma(self, g_live, v_live, last, layout):
        """The sma branch: the model moves toward the workers' mean; the gradients stay this worker's."""
        kf = self._kungfu
        m = kf.monitors
        if m is not None and m.reduces:
            # SMA exchanges models, not gradients: on the monitors' due steps the gradients are
            # all-reduced too, for their norms alone, so that the estimates (and the policies that
            # read them, e.g. a switch to S-SGD once the noise scale has grown) go on under SMA. Due
            # by the steps since SMA began, which every worker counts alike.
            sma_index = strategy_index("sma")
            steps = kf.sma_steps.assign(tf.where(tf.equal(last, sma_index), kf.sma_steps + 1, 0))
            _monitor.when(m.due(steps), lambda: self._kungfu_mean_with_monitors(
                g_live, v_live, True, unscale=m.loss_scale is not None, layout=layout)[1])
        _averaging.sma_update(v_live, kf.alpha, kf.fusion_bytes, layout)
        return g_live

    def _kungfu_mean_with_monitors(self, grads, variables, due, unscale=False, layout=None):
        """(the gradients' mean over the workers, the monitors' update op): both squared norms the
        monitors need come out of the gradients' own all-reduce (fused into KfGroupAllReduceNorms, or this
        worker's norm riding in the all-reduce beside them), so the monitors cost no collective of their
        own. unscale: divide each worker's gradients by its own loss scale first (SMA, where the workers'
        scales may differ: a LossScaleOptimizer skips overflowing steps on each worker alone). layout: as
        _reduce.mean_gradients'."""
        kf, m = self._kungfu, self._kungfu.monitors
        if unscale:
            scale = tf.cast(m.loss_scale(), tf.float32)
            grads = [_divided(g, scale) for g in grads]
        if _reduce.norms_fusable(grads, kf.sparse_as_dense):
            reduced, local_sq, reduced_sq = _reduce.mean_gradients_with_norms(
                grads, variables, kf.fusion_bytes, kf.sparse_as_dense, tf.convert_to_tensor(due, tf.bool),
                kf.compression, layout)
            return reduced, m.update(due, local_sq, reduced_sq=reduced_sq, scaled=not unscale)
        out = _reduce.mean_gradients(grads, variables, kf.fusion_bytes, kf.sparse_as_dense,
                                     extra=[m.local_sq_norm(grads, due)], compression=kf.compression, layout=layout)
        reduced = out[:len(grads)]
        return reduced, m.update(due, out[-1], reduced, scaled=not unscale)

    def _kungfu_average_state(self, variables):
        """Sets the model's variables and this optimizer's slots (momenta, moments: its float state) to
        their mean over the workers, and its counters (step counts, a loss scale's step counter) and loss
        scale to rank 0's; returns True. From then on S-SGD's steps are the same bits on every worker:
        the step count drives Adam's bias correction and learning-rate schedules, and a
        LossScaleOptimizer's scale and counter decide which steps it skips and its next scale (a mean
        scale would not be a power of 2, and the counters of workers that skipped different steps differ)."""
        import keras

        scaled = isinstance(self, keras.optimizers.LossScaleOptimizer)
        rates = [getattr(o, "_learning_rate", None) for o in (self, self.inner_optimizer if scaled else None)]
        scale = self.dynamic_scale if scaled else None
        averaged, copied = [], []
        for v in self.variables:
            if any(v is rate for rate in rates):  # the learning rate is set, not learnt: left alone
                continue
            (averaged if tf.as_dtype(v.dtype).is_floating and v is not scale else copied).append(v)
        _averaging.average_variables(list(variables) + averaged, self._kungfu.fusion_bytes)
        if copied:
            _variables.broadcast_variables(copied, root=0)
        return tf.constant(True)

    def _kungfu_pair_store(self, variables):
        """(the store prefix of pair averaging's copies of `variables`, a small id of that set): the whole
        model's prefix (_averaging.new_store_prefix, given once), and for a part of it (variables whose
        gradients were None left out) a prefix of that part's own, so that what a worker requests is always
        what its peers published under that name."""
        kf = self._kungfu
        everything = getattr(self, "_trainable_variables", None) or list(variables)
        if kf.store_prefix is None:
            kf.store_prefix = _averaging.new_store_prefix(everything)
        indices = tuple(self._get_variable_index(v) for v in variables)
        found = kf.pair_sets.get(indices)
        if found is None:
            found = kf.pair_sets[indices] = (_averaging.part_prefix(kf.store_prefix, indices, len(everything)),
                                             len(kf.pair_sets))
        return found

    def _kungfu_publish(self, variables, is_update=None):
        """Publishes `variables` (those of the step's exchange) for the peers' pair averaging, when it runs."""
        if not variables:
            return
        prefix = self._kungfu_pair_store(variables)[0]
        is_pair = tf.equal(self._kungfu.strategy, strategy_index("pair_averaging"))
        if is_update is not None:  # with gradient accumulation, the model changes only on updates
            is_pair = tf.logical_and(is_pair, is_update)

        def publish():
            _averaging.publish(variables, prefix, self._kungfu.pair_phase.read_value())
            return tf.constant(True)

        tf.cond(is_pair, publish, lambda: tf.constant(False))


def _divided(g, scale):
    """A gradient (dense, or IndexedSlices) divided by scale."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / tf.cast(scale, g.values.dtype), g.indices, g.dense_shape)
    return g / tf.cast(scale, g.dtype)


def _scoped(name, fn):
    """fn as a branch with its collectives under the strategy's own scope, so their derived keys differ (in
    a graph by the name scope, eagerly by the key scope): workers on different strategies at one step (a
    switch made on some workers only) wait for each other until the deadline instead of pairing one's
    model with another's gradients."""
    def branch():
        with tf.name_scope(name), _naming.key_scope(name):
            return fn()
    return branch
