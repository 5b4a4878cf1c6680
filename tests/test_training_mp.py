"""Distributed training across real worker processes started by kfrun; see tests/training_worker.py.

S-SGD must match one process on the combined batch (model.fit, custom loops, eager and compiled)
on 2 and 4 workers; the strategy switch must not retrace; sparse gradients must equal densified
ones; SMA and pair averaging must learn scikit-learn's digits on 4 workers.
"""

import json
import os
import re

import pytest

from conftest import REPO
from mp import CHECK_LINE, assert_checks_passed, checks_problems, launch

pytestmark = pytest.mark.usefixtures("kungfu_library")

WORKER = os.path.join(REPO, "tests", "training_worker.py")
EQUIVALENCE = ["fit_equals_single_process", "custom_loop_equals_single_process", "strategy_switch_without_retrace",
               "gradient_buckets_are_in_flight_together", "indexed_slices_equal_densified",
               "fp16_compression_halves_the_bytes_and_keeps_the_mean", "metric_average_callback_agrees",
               "resumed_fit_equals_single_process", "gradient_accumulation_exchanges_once_per_update",
               "loss_scaled_accumulation_exchanges_once_per_update",
               "accumulation_survives_a_fit_that_ends_between_updates",
               "loss_scaling_skips_one_workers_overflow_everywhere",
               "unequal_steps_fail_at_once", "switch_to_ssgd_makes_every_state_agree",
               "switch_to_ssgd_rescales_gradients_of_a_drifted_loss_scale",
               "monitors_and_a_threshold_switch_run_under_sma",
               "sma_monitors_agree_when_a_loss_scale_skips_a_step_on_one_worker",
               "broadcast_callback_waits_for_a_subclassed_model_that_build_left_empty",
               "pair_averaging_leaves_variables_without_gradients_alone",
               "gradients_of_different_variables_fail_rather_than_mix",
               "half_precision_weights_average_without_overflow",
               "broadcast_callback_waits_for_a_model_built_on_its_first_batch",
               "broadcast_variables_copies_root_and_refuses_different_layouts",
               "pair_averaging_pairs_models_whatever_the_optimizers_are_named",
               "pair_averaging_meets_only_its_own_model_and_phase"]
DIGITS = ["sma_digits", "pair_averaging_digits"]
# On 4 workers, the checks whose outcome depends on how many there are: S-SGD against one process on the
# combined batch, shards and pairs, a worker that differs from the others. The rest (gradient accumulation,
# compression, loss scaling's arithmetic, broadcasts, dtypes: 70 of the 125 s that all of them take on 4
# workers on 2 cores) run on 2 workers only, through the same code.
EQUIVALENCE_4 = ["fit_equals_single_process", "custom_loop_equals_single_process", "strategy_switch_without_retrace",
                 "gradient_buckets_are_in_flight_together", "metric_average_callback_agrees",
                 "loss_scaling_skips_one_workers_overflow_everywhere", "unequal_steps_fail_at_once",
                 "switch_to_ssgd_makes_every_state_agree", "pair_averaging_meets_only_its_own_model_and_phase",
                 "pair_averaging_pairs_models_whatever_the_optimizers_are_named",
                 "sma_monitors_agree_when_a_loss_scale_skips_a_step_on_one_worker",
                 "pair_averaging_leaves_variables_without_gradients_alone"]


@pytest.mark.parametrize("np_", [2, 4])
def test_ssgd_equivalence_and_switch(np_, tmp_path):
    checks = EQUIVALENCE if np_ == 2 else EQUIVALENCE_4
    args = [WORKER, "equivalence"] + ([] if np_ == 2 else [",".join(checks)])
    code, out = launch(np_, args, tmp_path, timeout=60, budget=400)
    assert_checks_passed(code, out, checks, np_)
    if np_ == 2:  # every check the worker has is named above, so that none goes unreported unnoticed
        ran = {m.group(2) for m in map(CHECK_LINE.match, out.splitlines()) if m}
        assert ran == set(EQUIVALENCE), f"not listed: {sorted(ran - set(EQUIVALENCE))}"


def test_the_checks_on_4_workers_are_among_those_on_2():
    assert set(EQUIVALENCE_4) < set(EQUIVALENCE), sorted(set(EQUIVALENCE_4) - set(EQUIVALENCE))


def test_model_averaging_learns_digits(tmp_path):
    code, out = launch(4, [WORKER, "digits"], tmp_path, timeout=60, budget=400)
    for line in out.splitlines():  # shown with -s or on failure: how well each strategy did
        if re.match(r"^\[\d+\] KFDIGITS", line):
            print(line)
    assert_checks_passed(code, out, DIGITS, 4)


def test_workers_on_different_strategies_fail_instead_of_pairing_up(tmp_path):
    """Rank 0 on SMA, rank 1 on S-SGD: each strategy's collectives have keys of their own, so both fail at
    the 4 s deadline, in a tf.function and eagerly, instead of averaging rank 0's model with rank 1's
    gradients."""
    code, out = launch(2, [WORKER, "strategies_differ"], tmp_path, timeout=4, budget=90)
    reports = [json.loads(m.group(1)) for m in re.finditer(r"^\[\d+\] KFDIFFER (.*)$", out, re.M)]
    assert len(reports) == 4, out[-4000:]
    for r in reports:
        # The last case may see its peer's exit (closed the connection) just before its own deadline.
        assert r["error"] == "DeadlineExceededError" or (r["how"] == "eager" and r["error"] == "UnavailableError"), r
        assert r["seconds"] < 30, r
    assert code == 0, out[-4000:]


def test_pair_averaging_outlives_a_peer_that_finished_first(tmp_path):
    """Rank 0 finishes after 2 steps and its finalize leaves after the 4 s timeout; ranks 1 and 2 train on
    for about 7 s more under pair averaging, and a request to the departed rank 0 counts as no copy."""
    code, out = launch(3, [WORKER, "pair_leaver"], tmp_path, timeout=4, budget=90)
    found = re.finditer(r"^\[\d+\] KFOUTLIVE (.*)$", out, re.M)
    reports = {r["rank"]: r for r in (json.loads(m.group(1)) for m in found)}
    assert sorted(reports) == [0, 1, 2], out[-4000:]
    assert reports[1]["steps"] == reports[2]["steps"] == 45, reports  # without departed_ok: UnavailableError
    assert code == 0, out[-4000:]


@pytest.mark.parametrize("case", ["unknown", "arrays", "dataset"])
def test_epochs_that_end_apart_fail_at_the_epoch_end(tmp_path, case):
    """Data one batch longer on rank 1, which fit's step count does not show: see tests/fit_steps_worker.py."""
    worker = os.path.join(REPO, "tests", "fit_steps_worker.py")
    code, out = launch(2, [worker, case], tmp_path, timeout=5, budget=120)
    problems = checks_problems(out, ["epochs_that_end_apart_fail"], 2)
    assert not problems, "\n".join(problems) + "\n" + out[-4000:]


def test_a_worker_whose_callback_stopped_its_fit_alone_is_named_at_the_epoch_end(tmp_path):
    """EarlyStopping-like, listed before BroadcastGlobalVariablesCallback, on rank 0 only: see
    tests/fit_steps_worker.py."""
    worker = os.path.join(REPO, "tests", "fit_steps_worker.py")
    code, out = launch(2, [worker, "stopped"], tmp_path, timeout=5, budget=120)
    problems = checks_problems(out, ["a_worker_that_stops_alone_is_named"], 2)
    assert not problems, "\n".join(problems) + "\n" + out[-4000:]
