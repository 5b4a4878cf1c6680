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
    it has monitors, else the most recently created one. tensorboard_dir: also write them as
    TensorBoard scalars ("kungfu/<key>", step = epoch), on rank 0 only. Only on_epoch_end and
    on_train_end are overridden, so Keras keeps its asynchronous batch dispatch. Put it before
    callbacks that read the logs (and after MetricAverageCallback, which would average step_time).
    """

    def __init__(self, optimizer=None, tensorboard_dir=None):
        super().__init__()
        self.optimizer = optimizer
        self.tensorboard_dir = tensorboard_dir
        self._writer = None

    def _monitors(self):
        from ... import monitor

        if self.optimizer is None:
            model_opt = getattr(self.model, "optimizer", None)
            if getattr(getattr(model_opt, "_kungfu", None), "monitors", None) is not None:
                return monitor.monitors_of(model_opt)
        return monitor.monitors_of(self.optimizer)

    def on_epoch_end(self, epoch, logs=None):
        _lib.require_init("MonitorCallback")
        values = {k: v for k, v in self._monitors().values().items() if v is not None}
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
        if self._writer is not None:
            self._writer.close()
            self._writer = None
