"""PolicyCallback: adaptation policies (kungfu.policies) run from model.fit."""

import keras

from ..._policy import PolicyRunner


class PolicyCallback(keras.callbacks.Callback):
    """Runs policies around model.fit's steps and epochs, on every worker, with the same decisions.

        ds = kungfu.data.AdaptiveDataset((x, y), global_batch_size=64)
        opt = kungfu.optimizers.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1), monitor=["gns"],
                                                        local_batch_size=ds.local_batch_size_variable)
        model.compile(optimizer=opt, loss=...)
        cb = kungfu.keras.PolicyCallback([kungfu.policies.gns_batch_size(64, 1024)], dataset=ds)
        model.fit(ds.as_dataset(), epochs=10, callbacks=[cb])

    policies: a list of kungfu.policies.BasePolicy. dataset: the kungfu.data.AdaptiveDataset model.fit
    iterates (needed to change the batch size). optimizer: by default the model's. monitors: where the
    metrics come from when not the optimizer's. The step's logs (loss, metrics) join ctx.metrics,
    averaged over the workers. A policy's ctx.stop() stops model.fit after that step (or epoch); from
    before_train, before_epoch or before_step, after one more step (Keras reads stop_training only then).
    It also stops model.fit when a policy compiled into the optimizer (DistributedOptimizer(...,
    policies=[...])) calls ctx.stop(): add PolicyCallback([]) to fit's callbacks for that alone.
    Given to a later fit, it goes on counting steps and epochs (a fit that starts again from epoch 0
    continues from the epochs done), and a stop asked for in an earlier fit is forgotten; given to fit of
    another model, or of the model compiled with a new optimizer (without optimizer=), it starts over with
    that optimizer. Counting starts at the optimizer's iterations, so a model restored from a checkpoint
    goes on from its step (ctx.resumed).
    .runner is the kungfu.PolicyRunner doing the work (its .history and summary() tell what changed).
    Batch-end hooks are overridden, so Keras dispatches steps synchronously (the callback needs the logs).
    The model must be compiled with steps_per_execution=1 (the default); fit raises ValueError otherwise.
    """

    def __init__(self, policies, dataset=None, optimizer=None, monitors=None, batch_size=None):
        super().__init__()
        self._args = dict(policies=policies, dataset=dataset, optimizer=optimizer, monitors=monitors,
                          batch_size=batch_size)
        from ... import policies as _policies

        _policies.base.check_policies(policies, "PolicyCallback")
        self.runner = None
        self._epoch_offset = None  # added to Keras's epoch numbers in this fit

    def _runner(self):
        if self.runner is None:
            a = dict(self._args)
            if a["optimizer"] is None:
                a["optimizer"] = getattr(self.model, "optimizer", None)
            self.runner = PolicyRunner(a.pop("policies"), **a)
        return self.runner

    def _start_over(self):
        """Given to fit of another model (a callbacks list reused, as in k-fold training): that model's
        optimizer is the one to control, counts start again from its steps, and the policies forget what
        they kept (their ctx.state memory, e.g. a cooldown counted in the other model's steps)."""
        for p in self.runner.policies:
            p.__dict__.pop("_kungfu_state", None)
        self.runner = None

    def _stop_if_asked(self):
        # policy_stopped: a policy compiled into a kungfu optimizer asked (plain optimizers lack it).
        if self.runner.stopped or getattr(self.runner.controls.optimizer, "policy_stopped", False):
            self.model.stop_training = True

    def on_train_begin(self, logs=None):
        if getattr(self.model, "steps_per_execution", 1) != 1:
            raise ValueError("kungfu.keras.PolicyCallback: compile the model with steps_per_execution=1: with "
                             "more, fit calls back only once per group of steps, so the policies would "
                             "count steps wrong and could act only between groups")
        self._epoch_offset = None
        if (self.runner is not None and self._args["optimizer"] is None
                and self.runner.controls.optimizer is not getattr(self.model, "optimizer", None)):
            self._start_over()
        runner = self._runner()
        opt = runner.controls.optimizer
        if (getattr(getattr(opt, "_kungfu", None), "state_from", None) is not None and not opt.built
                and self.model.built):
            # A kungfu wrapper of a used optimizer (a restored model's) copies that state when it is built,
            # which Keras does at the first step: build it now, or the copy would undo what the policies
            # set before training (a schedule's learning rate).
            opt.build(self.model.trainable_variables)
        forget = getattr(opt, "_forget_policy_stop", None)
        if forget is not None:
            forget()
        runner.before_train(logs)
        self._stop_if_asked()

    def on_epoch_begin(self, epoch, logs=None):
        runner = self._runner()
        if self._epoch_offset is None:  # this fit's first epoch: one that starts again from 0 goes on counting;
            self._epoch_offset = runner.epoch if epoch == 0 else 0  # initial_epoch= is taken as given
        runner.before_epoch(epoch + self._epoch_offset, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._runner().before_step()

    def on_train_batch_end(self, batch, logs=None):
        self._runner().after_step(logs)
        self._stop_if_asked()

    def on_epoch_end(self, epoch, logs=None):
        self._runner().after_epoch(logs)
        self._stop_if_asked()

    def on_train_end(self, logs=None):
        self._runner().after_train(logs)
