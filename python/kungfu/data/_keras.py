"""EpochCallback: makes Keras 3's model.fit run one epoch per pass over an AdaptiveDataset.

Why it is needed (Keras 3.15, TF backend). as_dataset() has no known length: its number of batches per
epoch depends on the batch-size changes still to come. For such a dataset fit ends an epoch when the
iterator runs dry, and then (1) warns "Your input ran out of data" every epoch, and (2) remembers the
first epoch's step count and cuts every later epoch there, starting a new iterator (a new pass) and
leaving the rest of a longer epoch unseen. This callback ends each epoch just after its last batch
instead, before the iterator runs dry: it sets model.stop_training, which ends fit's loop over the
epoch's batches, and clears it again in on_epoch_end, before fit checks it to stop training.

It also draws fit's progress bar (it is a ProgbarLogger, so Keras adds none of its own), its total
being the epoch's batches as planned at the current batch size, so later epochs do not show the
first one's count. List it last in callbacks, where Keras puts its own progress bar, so that the
logs it prints are those that callbacks before it (MetricAverageCallback) have averaged.
"""

import keras

from ._dataset import _register_collect_at_exit


class _EndOfEpoch:
    """model.stop_training's value while EpochCallback ends an epoch: true for fit, and distinct from the
    True that another callback sets to stop training, which is therefore kept."""

    def __bool__(self):
        return True

    def __repr__(self):
        return "kungfu.data.EpochCallback: end of epoch"


END_OF_EPOCH = _EndOfEpoch()


class EpochCallback(keras.callbacks.ProgbarLogger):
    """model.fit(ds.as_dataset(), epochs=E, shuffle=False, callbacks=[..., ds.keras_callback()])

    Ends each of fit's epochs exactly after the dataset's last batch of that epoch, and shows the progress
    bar. fit must be called without steps_per_epoch, and the model compiled with steps_per_execution=1
    (the default): with more, fit pulls several batches per call and a change could not land at a step.
    """

    def __init__(self, dataset):
        super().__init__()
        self._dataset = dataset
        self._steps_per_epoch = None  # fit's, from set_params
        _register_collect_at_exit()

    def set_params(self, params):
        keras.callbacks.Callback.set_params(self, params)  # keeps self.params, which ProgbarLogger's does not
        super().set_params(params)
        self._steps_per_epoch = params.get("steps")

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if self._steps_per_epoch is not None:
            raise ValueError("kungfu.data.EpochCallback: do not pass steps_per_epoch to fit: an epoch is one "
                             "pass over the AdaptiveDataset, whose step count follows the batch size")
        if getattr(self.model, "steps_per_execution", 1) != 1:
            raise ValueError("kungfu.data.EpochCallback: compile the model with steps_per_execution=1: with "
                             "more, fit pulls several batches at once and a batch-size change cannot take "
                             "effect at the next step")

    def on_epoch_begin(self, epoch, logs=None):
        self._dataset.start_at_epoch(epoch)  # fit(initial_epoch=e) of a fresh dataset: resume at epoch e
        self.target = len(self._dataset)  # a whole epoch at the current size; on_train_batch_end follows
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        handed_out, planned, finished = self._dataset.progress()
        if handed_out != batch + 1:
            # Something between as_dataset() and fit pulls batches ahead of the steps: fit would end the
            # epoch when the last one is pulled, leaving those pulled ahead untrained, and a batch-size
            # change would land late.
            raise ValueError(
                f"kungfu.data.EpochCallback: the AdaptiveDataset has handed out {handed_out} batches of this "
                f"epoch but fit has trained {batch + 1}: something pulls batches ahead of the steps (a "
                ".shuffle(), .prefetch(), .cache() or parallel .map() after as_dataset(), class_weight= in fit, "
                "or batches taken from the epoch before fit), so the epoch would end with batches untrained "
                "and batch-size changes would land late. Give fit ds.as_dataset() as it is: shuffle with "
                "AdaptiveDataset(..., shuffle=True), weight samples with (x, y, sample_weight) arrays")
        self.target = planned
        if self.progbar is not None:
            self.progbar.target = planned
        super().on_train_batch_end(batch, logs)
        if finished and not self.model.stop_training:
            self.model.stop_training = END_OF_EPOCH

    def on_epoch_end(self, epoch, logs=None):
        if self.model.stop_training is END_OF_EPOCH:
            self.model.stop_training = False
        super().on_epoch_end(epoch, logs)
