"""TF MultiWorkerMirroredStrategy baseline: one CPU worker per process (TF_CONFIG set by the driver), RING
collectives, all_reduce through the replica context inside strategy.run inside a tf.function, as a training
step would issue it. Only element 0 is fetched, so the timing holds the collective, not a 64 MiB copy."""
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
import json  # noqa: E402

import tensorflow as tf  # noqa: E402

import harness  # noqa: E402


class MwmsCollective:
    def __init__(self):
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        task = json.loads(os.environ['TF_CONFIG'])['task']
        self.rank = task['index']
        self.size = self.strategy.num_replicas_in_sync
        self._scalar = self._make_step(tf.zeros([1], tf.float32))  # barrier and agreement

    def _make_step(self, x):
        strategy = self.strategy

        @tf.function
        def step(v):
            def replica_fn(v):
                # identity places the value on this replica's device (a function argument has none, and the
                # cross-device ops then see no destination); on CPU it forwards the buffer without a copy
                return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(v))

            return strategy.experimental_local_results(strategy.run(replica_fn, args=(v,)))[0][:1]

        return lambda v=x: step(v).numpy()

    def barrier(self):
        self._scalar()

    def sum_over_ranks(self, value):
        return int(round(float(self._scalar(tf.constant([float(value)]))[0])))

    def prepare(self, nbytes):
        step = self._make_step(tf.ones([nbytes // 4], tf.float32))
        last = [None]

        def run():
            last[0] = step()

        return run, (lambda: float(last[0][0]))


def main():
    plan = harness.load_plan()
    coll = MwmsCollective()
    series = harness.measure_series(coll, plan)
    harness.write_results(plan, coll.rank, {plan['series']: series})


if __name__ == '__main__':
    main()
