"""TF MultiWorkerMirroredStrategy baseline: one CPU worker per process (TF_CONFIG set by the driver), RING
collectives, the model built and compiled inside strategy.scope() and trained with model.fit.

The dataset is batched with the global batch (plan['batch'] times the number of workers), as MWMS expects;
the strategy splits each global batch so every worker computes on plan['batch'] rows, the same per-worker
work as the other systems. Auto-sharding is off: every worker makes its own synthetic data (seeded by its
rank), so there is nothing to shard.
"""
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
import json  # noqa: E402

import tensorflow as tf  # noqa: E402

import common  # noqa: E402


def _log_local_loss():
    """Keras 3.15's train step reduces its logs (the loss) over workers with reduction "auto", which under
    MWMS is strategy.reduce("MEAN", loss, axis=0), and that fails on a scalar ("Invalid reduction dimension 0
    for input with 0 dimensions"), so fit cannot run a step. Use "first" instead: each worker logs its own
    loss, as the kungfu run does, and the step holds no collective beyond the gradients' (a mean would add
    a scalar all-reduce per step, which would only slow MWMS down)."""
    from keras.src.backend.tensorflow import trainer

    original = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        return original(values, strategy, 'first' if reduction == 'auto' else reduction)

    trainer.reduce_per_replica = reduce_per_replica


def _check_local_batch(strategy, data, want):
    """Each worker must compute on `want` rows per step, as in the other systems."""
    x, _ = next(iter(strategy.experimental_distribute_dataset(data)))
    got = [int(t.shape[0]) for t in strategy.experimental_local_results(x)]
    if got != [want]:
        raise RuntimeError('MWMS gives this worker batches of %s rows, expected [%d]' % (got, want))


def _build_from_local_batch(model, strategy, batch):
    """Keras 3.15's fit cannot start under MWMS: before the first step it builds the model from one batch
    of the distributed dataset and, to get a plain batch, calls strategy.reduce eagerly on the per-replica
    batch, which MWMS refuses ("Attempt to convert a value (PerReplica...) to a Tensor";
    keras-team/keras#20585). Build from a plain local batch instead, inside the scope, as Keras would
    have; the training steps are Keras's own."""

    def build(iterator=None, data_batch=None):
        with strategy.scope():
            model._symbolic_build(data_batch=batch)

    model._maybe_symbolic_build = build


def main():
    plan = common.load_plan()
    _log_local_loss()
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    rank = json.loads(os.environ['TF_CONFIG'])['task']['index']
    workers = strategy.num_replicas_in_sync
    data_options = tf.data.Options()
    data_options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    results = {}
    for name in plan['models']:
        common.log(rank, '%s: %d workers, batch %d per worker' % (name, workers, plan['batch']))
        with strategy.scope():
            model = common.build_model(name)  # MWMS makes the workers' variables equal on creation
            common.compile_model(model, common.plain_sgd())
        data = common.dataset(name, plan['batch'] * workers, rank, data_options)
        _check_local_batch(strategy, data, plan['batch'])
        _build_from_local_batch(model, strategy, common.arrays(name, plan['batch'], rank))
        epochs = common.train(model, data, plan)
        results[name] = dict(epochs=epochs, weights=common.weights_digest(model))
    common.write_results(plan, rank, results)


if __name__ == '__main__':
    main()
