"""MonitorCallback: the optimizer's monitors (gradient noise scale, ...) in each epoch's logs."""

import keras

from ... import _lib


def _scalar_metadata():
    """What tf.summary.scalar writes with each value (TensorBoard's scalars plugin), built here because
    tf.summary.scalar needs the tensorboard package, and tf.summary.write does not."""
    from tensorflow.core.framework import summary_pb2

    m = summary_pb2.SummaryMetadata()
    m.plugin_data.plugin_name = "scalars"
    m.data_class = summary_pb2.DATA_CLASS_SCALAR
    return m.SerializeToString()


_SCALAR_METADATA = None


class MonitorCallback(keras.callbacks.Callback):
    """At each epoch's end, adds the latest monitor values (kungfu.monitor.latest()) to logs, so the
    progress bar and History show them: gns, grad_variance, snr, samples_per_sec, step_time, those
    that are monitored. The values are those of the epoch's last monitored step.

    optimizer: a wrapped optimizer with monitors, or its name; by default the model's optimizer when
    it has monitors, else the most recently created one. It is looked up when training begins, so a
    missing one raises ValueError before the first step, not after an epoch. tensorboard_dir: also
    write them as TensorBoard scalars ("kungfu/<key>", step = epoch), on rank 0 only. Only
    on_train_begin, on_epoch_end and on_train_end are overridden, so Keras keeps its asynchronous batch
    dispatch. Put it before callbacks that read the logs (and after MetricAverageCallback, which would
    average step_time).
    """

    def __init__(self, optimizer=None, tensorboard_dir=None):
        super().__init__()
        self.optimizer = optimizer
        self.tensorboard_dir = tensorboard_dir
        self._writer = None
        self._found = None  # the Monitors read during this fit (found in on_train_begin)

    def _monitors(self):
        from ... import monitor

        model_opt = getattr(self.model, "optimizer", None) if self.optimizer is None else None
        if getattr(getattr(model_opt, "_kungfu", None), "monitors", None) is not None:
            return monitor.monitors_of(model_opt)
        try:
            return monitor.monitors_of(self.optimizer)
        except ValueError as e:
            if model_opt is None:
                raise ValueError(f"MonitorCallback: {e}") from None
            raise ValueError(f"MonitorCallback: the model's optimizer {model_opt.name!r} has no monitors, and no "
                             "other optimizer has any; wrap it with kungfu.optimizers.DistributedOptimizer(..., "
                             "monitor=[\"gns\", ...]) (or SynchronousSGDOptimizer, ...)") from None

    def on_train_begin(self, logs=None):
        # The model and its optimizer are known now and stay the same for the whole fit: a callback with
        # nothing to read fails here, before the first step, rather than at the end of the first epoch.
        _lib.require_init("MonitorCallback")
        self._found = self._monitors()

    def on_epoch_end(self, epoch, logs=None):
        _lib.require_init("MonitorCallback")
        m = self._found if self._found is not None else self._monitors()  # called outside fit: look it up
        values = {k: v for k, v in m.values().items() if v is not None}
        if logs is not None:
            logs.update(values)
        if self.tensorboard_dir is not None and _lib.rank() == 0:
            import tensorflow as tf

            global _SCALAR_METADATA
            if _SCALAR_METADATA is None:
                _SCALAR_METADATA = _scalar_metadata()
            if self._writer is None:
                self._writer = tf.summary.create_file_writer(self.tensorboard_dir)
            with self._writer.as_default():
                for k, v in values.items():
                    tf.summary.write(f"kungfu/{k}", tf.constant(v, tf.float32), step=epoch,
                                     metadata=_SCALAR_METADATA)
            self._writer.flush()

    def on_train_end(self, logs=None):
        self._found = None  # no reference kept between fits (the registry holds the Monitors weakly)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
