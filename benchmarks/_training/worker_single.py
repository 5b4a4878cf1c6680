"""Plain Keras, no distribution: the same model, optimizer and per-worker batch in one process.

Run once on its own for "1 worker alone", and as two processes at the same time (no communication) to
measure what two workers' compute costs when they share this machine's cores: the baseline that tells
how much of a 2-worker step the distribution itself adds.
"""
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import common  # noqa: E402


def main():
    plan = common.load_plan()
    rank, ranks = int(os.environ.get('KF_TRAIN_RANK', '0')), int(os.environ.get('KF_TRAIN_RANKS', '1'))
    results = {}
    for name in plan['models']:
        common.log(rank, '%s: plain Keras, batch %d' % (name, plan['batch']))
        model = common.build_model(name)
        common.compile_model(model, common.plain_sgd())
        together = [common.start_together(plan, rank, ranks, name)] if ranks > 1 else []
        epochs = common.train(model, common.dataset(name, plan['batch'], rank), plan, together)
        results[name] = dict(epochs=epochs, weights=common.weights_digest(model))
    common.write_results(plan, rank, results)


if __name__ == '__main__':
    main()
