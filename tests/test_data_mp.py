"""AdaptiveDataset across real workers started by kfrun (np 2 and 4); see tests/data_worker.py.

Every sample is seen exactly once per epoch across the workers, the workers' parts of a batch are
disjoint and split as documented, every worker takes the same number of steps, and a batch-size change
made between two steps (from Python, a Keras callback, or inside the step's graph) takes effect at the
next step on every worker: the test predicts each step's global batch from the schedule and the
documented rules, independently of the library, and compares what every worker trained on.
"""

import json
import os

import numpy as np
import pytest

import data_worker as w
from conftest import REPO
from mp import assert_checks_passed, launch

pytestmark = pytest.mark.usefixtures("kungfu_library")

WORKER = os.path.join(REPO, "tests", "data_worker.py")
CHECKS = ["custom_loop_schedule", "fit_ssgd_schedule", "workers_that_disagree_fail_clearly"]


def expected_batches(schedule, size):
    """[(epoch, samples of the global batch in order)] for each step: an epoch is the permutation of
    default_rng([SEED, epoch]); a step takes the next B, or all that is left when fewer than `size`
    would remain; a change after step s applies from step s + 1."""
    batches, b, step = [], schedule["batch"], 0
    for epoch in range(schedule["epochs"]):
        order, pos = np.random.default_rng([w.SEED, epoch]).permutation(w.N), 0
        while pos < w.N:
            take = w.N - pos if w.N - pos - b < size else b
            batches.append((epoch, order[pos:pos + take].tolist()))
            pos += take
            b = schedule["changes"].get(step, b)
            step += 1
    return batches


def check_records(records, schedule, size):
    """records[rank]: that worker's per-step records. Raises AssertionError naming the first problem."""
    want = expected_batches(schedule, size)
    for rank, mine in enumerate(records):
        assert len(mine) == len(want), f"rank {rank} took {len(mine)} steps, the plan has {len(want)}"
    for step, (epoch, batch) in enumerate(want):
        base, extra = divmod(len(batch), size)
        pos = 0
        for rank in range(size):
            got = records[rank][step]
            n = base + (1 if rank < extra else 0)  # contiguous parts, the first `extra` ranks one larger
            assert got["epoch"] == epoch, f"step {step}: rank {rank} is in epoch {got['epoch']}, want {epoch}"
            assert got["indices"] == batch[pos:pos + n], \
                f"step {step}: rank {rank} got {got['indices']}, want {batch[pos:pos + n]} (global batch {batch})"
            assert n > 0, f"step {step}: rank {rank} would get an empty batch"
            assert got["local_batch_size"] == pytest.approx(len(batch) / size), \
                f"step {step}: rank {rank} saw local_batch_size {got['local_batch_size']}, want {len(batch) / size}"
            if "global" in got:
                assert got["global"] == len(batch), f"step {step}: the all-reduced batch is {got['global']}"
            pos += n
    for epoch in range(schedule["epochs"]):
        seen = sorted(i for rank in range(size) for r in records[rank] if r["epoch"] == epoch for i in r["indices"])
        assert seen == list(range(w.N)), f"epoch {epoch}: the workers together did not see each sample once"


@pytest.mark.parametrize("np_", [2, 4])
def test_schedule_takes_effect_on_every_worker(np_, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    pids = tmp_path / "pids"
    pids.mkdir()
    code, output = launch(np_, [WORKER, str(out)], pids, timeout=30, budget=300)
    assert_checks_passed(code, output, CHECKS, np_)
    for name, schedule in (("custom", w.CUSTOM), ("fit", w.FIT)):
        records = []
        for rank in range(np_):
            with open(out / f"{name}.{rank}.json") as f:
                records.append(json.load(f))
        check_records(records, schedule, np_)


def test_expected_batches_follow_the_rules():
    """The test's own model of the plan: a change lands at the next step, no batch is below `size`."""
    batches = expected_batches({"batch": 10, "epochs": 1, "changes": {1: 4}}, 4)
    assert [len(b) for _, b in batches] == [10, 10] + [4] * 19 + [7]  # 83 = 19 * 4 + 7: the 3 join the last
    assert all(len(b) >= 4 for _, b in batches)
    assert sum(len(b) for _, b in batches) == w.N
