"""BroadcastGlobalVariablesCallback: every worker starts training from root's model and optimizer."""

import weakref

import keras
import tensorflow as tf

from ... import _lib
from ... import _variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of a model's first fit(), sets every worker's model variables (trainable and not)
    and optimizer variables (slots, iteration count) to root's. Given to the fit of another model (one
    callback list reused across k-fold runs), it broadcasts that model too.

    Workers then start identical even when each built its model from a different random seed, or
    when root restored a checkpoint the others do not have. A model that Keras builds on its first
    batch (a subclassed model, a Sequential without keras.Input; also a subclassed model with no build()
    method that model.build(shape) marked built, creating no variables) has none before fit's first
    step; it is broadcast before the second step instead (as Horovod does), so the first step's
    update is root's. Of the batch hooks only on_train_batch_begin is overridden, so Keras keeps its
    asynchronous batch dispatch.

    The state of Keras's random seed generators (dropout masks, noise and augmentation layers) is not
    broadcast: each worker keeps drawing its own random numbers, as one process would for each row of
    the global batch. Seed the workers differently (e.g. keras.utils.set_random_seed(seed + rank())).
    Nor are the optimizer's gradient accumulators (gradient_accumulation_steps): they hold each
    worker's own part of an update, so a fit that starts while one is half accumulated (the previous
    fit ended between two updates) goes on with every worker's part.

    Every fit() also checks that the workers take the same number of steps per epoch (an all-gather
    of fit's step count), unless the optimizer runs pair averaging, which waits for no other worker's
    step. With S-SGD a worker with one batch more would wait for the others' gradients at its last
    step until KUNGFU_TIMEOUT; instead every worker raises ValueError at once, naming the counts.
    The same count does not make the same epochs: fit cannot know the count of a dataset of unknown
    length (e.g. after .filter()), and with steps_per_epoch Keras ends an epoch early where a worker's
    input runs out (arrays one row longer on one worker; a dataset without .repeat()). So the workers
    also compare at every epoch's end how many batches they began (one small all-gather per epoch): one
    that ran out first waits there, and raises ValueError saying so, rather than pairing its next
    epoch's gradients with another worker's extra batches; the others fail in that extra step (both at
    KUNGFU_TIMEOUT). An epoch that a callback stopped (model.stop_training) is not compared: no step
    follows it.

    root_rank= is Horovod's spelling of root= (BroadcastGlobalVariablesCallback(root_rank=0)); giving both
    with different ranks raises ValueError.
    """

    def __init__(self, root=_variables.DEFAULT_ROOT, *, root_rank=None):
        super().__init__()
        self.root = _variables.root_alias(root, root_rank, "BroadcastGlobalVariablesCallback")
        self._broadcast_for = None  # a weakref to the model last broadcast (a reused callback meets new ones)
        self._check_epochs = False  # compare each epoch's batches (more than one worker, not pair averaging)
        self._steps = None  # fit's steps per epoch (None: unknown), for the epoch-end check's message
        self._batches = 0  # on_train_batch_begin calls in this epoch
        self._hooks = 0  # on_train_batch_begin calls in this fit (from the second on, a step has run)

    @property
    def _done(self):
        """Whether this fit's model has been broadcast: once per model, so the same callback given to the
        fit of a new model (k-fold, a hyper-parameter search) broadcasts that one too."""
        return self._broadcast_for is not None and self._broadcast_for() is self.model

    def on_train_begin(self, logs=None):
        _lib.require_init("BroadcastGlobalVariablesCallback")
        model = self.model
        self._hooks = 0
        self._steps = self.params.get("steps")
        # Not for a fit that starts under pair averaging, which waits for no one's step: its epochs may
        # differ (also the one a policy switches it to S-SGD at); nor at an epoch's end under it.
        self._check_epochs = False
        if not _pair_averaging(model):
            _check_same_steps(self._steps)
            self._check_epochs = _lib.size() > 1
        self._broadcast_once()

    def on_epoch_begin(self, epoch, logs=None):
        self._batches = 0

    def on_train_batch_begin(self, batch, logs=None):
        self._batches += 1
        self._hooks += 1
        if not self._done:  # the model was built by fit's first step
            self._broadcast_once(stepped=self._hooks > 1)

    def on_epoch_end(self, epoch, logs=None):
        # Batches begun, which workers with the same data count alike (Keras begins one more for the fetch
        # that finds a dataset exhausted). Not the optimizer's iterations: a loss-scale optimizer skips
        # those of an overflowing step, which under SMA is one worker's own.
        if self._check_epochs and not getattr(self.model, "stop_training", False) and not _pair_averaging(self.model):
            _check_same_epoch_end(self._batches, epoch, self._steps)

    def on_train_end(self, logs=None):
        if not self._done:  # a fit of one step
            self._broadcast_once(stepped=self._hooks > 0)

    def _broadcast_once(self, stepped=False):
        """Broadcasts the model once it is built; stepped: a training step has run (so it is as built as
        it will be, even if a layer that its call never uses has no variables)."""
        model = self.model
        if self._done or not _built(model, stepped):  # Keras builds it on the first batch
            return
        optimizer = getattr(model, "optimizer", None)
        seeds = _seed_states(model)
        variables = [v for v in model.variables if id(v) not in seeds]
        if optimizer is not None:
            if not optimizer.built and not stepped:  # over the complete list, as Keras's own fit would
                optimizer.build(model.trainable_variables)
            # Keras 3's own list (also read by the optimizer wrapper's accumulation; the gradient
            # accumulation checks of tests/training_worker.py fail if an upgrade renames it).
            own = {id(v) for v in getattr(optimizer, "_accumulated_gradients", None) or ()}
            variables += [v for v in optimizer.variables if id(v) not in own]
        _variables.broadcast_variables(variables, root=self.root, name="kungfu/broadcast_global_variables")
        self._broadcast_for = weakref.ref(model)


def _pair_averaging(model):
    """Whether model's optimizer runs pair averaging now, which waits for no other worker's step."""
    from ...optimizers import DistributedMixin

    optimizer = getattr(model, "optimizer", None)
    return isinstance(optimizer, DistributedMixin) and optimizer.strategy == "pair_averaging"


def _built(model, stepped):
    """Whether model has all its variables. model.built alone does not say: model.build(shape) on a
    subclassed model with no build() method marks it built and creates none of its layers' variables (Keras
    3.15 warns), while an add_weight in its __init__ may have made one. So every layer must be built too,
    Keras's own test before fit; or a step must have run. Broadcasting (and building the optimizer over) a
    part of the variables would leave the rest unbroadcast and make the first step fail ("Unknown variable").
    A model with a layer its call never uses (an auxiliary head) is therefore broadcast before the second
    step rather than the first, as a lazily built one is: still every worker trains from root's weights."""
    if not model.built:
        return False
    return stepped or all(layer.built for layer in model._flatten_layers(include_self=False))


def _seed_states(model):
    """ids of the state variables of model's layers' seed generators (Keras counts them as model
    variables). Reads Keras 3's Layer._flatten_layers and _seed_generators; the dropout check of
    tests/training_worker.py fails if an upgrade changes them."""
    import keras

    ids = set()
    for layer in model._flatten_layers(include_self=True):
        for g in getattr(layer, "_seed_generators", ()) or ():
            if isinstance(g, keras.random.SeedGenerator):
                ids.add(id(g.state))
    return ids


def _check_same_epoch_end(batches, epoch, steps=None):
    """ValueError unless every worker's epoch began the same number of batches. A worker whose data ran out
    first waits here while the others take their extra steps (waiting for its gradients): both sides fail
    at the timeout (or this one when the other, timed out first, has gone), and this side says why.
    steps: fit's steps per epoch, or None (unknown), for the message."""
    from ...ops import all_gather

    try:
        counts = [int(c) for c in all_gather(tf.constant([batches], tf.int64), name="kungfu/epoch_steps").numpy()]
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as e:
        if steps is None:
            why = "the workers' datasets, of unknown length, gave them different numbers of batches"
        else:
            why = (f"with {steps} steps per epoch, Keras ends an epoch early where a worker's input runs out (see its "
                   "\"ran out of data\" warning), and this worker's ran out where another's did not")
        data = (f"this worker's epoch {epoch} ran out of data after {batches} batch(es) begun, and another worker's "
                f"did not end with it (it still trained, waiting for this worker's gradients): {why}. Give each "
                "worker the same number of batches (e.g. kungfu.data.AdaptiveDataset, take() the same count, or "
                ".repeat() the data with the same steps_per_epoch)")
        stopped = ("a callback stopped that worker's fit on its own (such as EarlyStopping judging its own shard: "
                   "list MetricAverageCallback before it)")
        said = e.message or str(e)
        if isinstance(e, tf.errors.UnavailableError) and ("has begun to finalize" in said or "has left the cluster"
                                                          in said):
            # It left: after its extra step failed (data), or without this check (its fit was stopped).
            raise ValueError(f"model.fit: another worker left training before this worker's epoch {epoch} ended "
                             f"({said}). Either {stopped}, or {data}") from e
        raise ValueError(f"model.fit: {data}. Or {stopped}") from e
    if len(set(counts)) > 1:
        shown = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise ValueError(f"model.fit: the workers' epoch {epoch} began different numbers of batches ({shown}); "
                         "give each worker the same number of batches")


def _check_same_steps(steps):
    """ValueError on every worker unless every worker's fit() has the same steps per epoch (None: unknown)."""
    if _lib.size() == 1:
        return
    from ...ops import all_gather

    mine = -1 if steps is None else int(steps)
    counts = [int(c) for c in all_gather(tf.constant([mine], tf.int64), name="kungfu/fit_steps").numpy()]
    if len(set(counts)) > 1:
        shown = ", ".join(f"rank {r}: {'unknown' if c < 0 else c}" for r, c in enumerate(counts))
        raise ValueError(f"model.fit: the workers have different numbers of steps per epoch ({shown}); every "
                         "worker must take the same steps, or one waits for the others' gradients until the "
                         "timeout. Give each worker the same number of batches (e.g. trim the data to a multiple "
                         "of size() * batch_size, use kungfu.data.AdaptiveDataset) or .repeat() the data and pass "
                         "the same steps_per_epoch")
