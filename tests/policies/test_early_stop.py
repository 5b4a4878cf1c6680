"""EarlyStopOnPlateau: stops after `patience` epochs without improvement."""

import pytest

from policies.context import Context
from policies.early_stop import early_stop


def epochs(policy, values, metric="loss"):
    """Feeds one value per epoch; returns the epoch at which it stopped, or None."""
    policy.before_train(Context())
    for epoch, v in enumerate(values):
        c = Context(epoch=epoch, metrics={metric: v})
        policy.after_epoch(c)
        if c.stopped:
            return epoch
    return None


def test_stops_after_patience_epochs_without_improvement():
    assert epochs(early_stop(patience=2), [1.0, 0.9, 0.95, 0.91, 0.5]) == 3
    assert epochs(early_stop(patience=2), [1.0, 0.9, 0.8, 0.7]) is None
    assert epochs(early_stop(patience=2, min_delta=0.2), [1.0, 0.9, 0.85, 0.6]) == 2  # small gains don't count


def test_max_mode_and_non_finite_values():
    assert epochs(early_stop("accuracy", patience=1, mode="max"), [0.5, 0.6, 0.59], "accuracy") == 2
    assert epochs(early_stop(patience=2), [1.0, float("nan"), float("nan")]) == 2


def test_state_resets_at_before_train():
    p = early_stop(patience=1)
    assert epochs(p, [1.0, 2.0]) == 1
    assert epochs(p, [3.0, 2.0]) is None


def test_missing_metric_names_the_ones_there_are():
    with pytest.raises(ValueError, match=r"'val_acc' is not in this epoch's metrics \(there are: loss, val_loss\)"):
        early_stop("val_acc").after_epoch(Context(metrics={"loss": 1.0, "val_loss": 0.5}))
    with pytest.raises(ValueError, match=r"'accuracy' is not in this epoch's metrics \(there are: loss\)"):
        early_stop("accuracy").after_epoch(Context(metrics={"loss": 1.0}))


def test_an_epoch_without_validation_is_skipped_with_one_warning(caplog):
    # fit(validation_freq=2): val_loss only every other epoch; the epochs without it neither count nor raise
    p = early_stop("val_loss", patience=2)
    p.before_train(Context())
    seen = [{"loss": 1.0}, {"loss": 0.9, "val_loss": 1.0}, {"loss": 0.8}, {"loss": 0.7, "val_loss": 1.1},
            {"loss": 0.6}, {"loss": 0.5, "val_loss": 1.2}]
    stopped = None
    with caplog.at_level("WARNING", logger="kungfu.policies"):
        for epoch, metrics in enumerate(seen):
            c = Context(epoch=epoch, metrics=metrics)
            p.after_epoch(c)
            if c.stopped:
                stopped = epoch
                break
    assert stopped == 5  # two validated epochs (3 and 5) without improvement on epoch 1's
    said = [r.getMessage() for r in caplog.records if "no validation metrics" in r.getMessage()]
    assert len(said) == 1 and "epoch 0" in said[0], said


@pytest.mark.parametrize("kwargs,match", [
    (dict(patience=0), "patience must be a whole number >= 1"),
    (dict(min_delta=-1), "min_delta must be a finite number >= 0"),
    (dict(mode="lower"), "mode must be 'min' or 'max'"),
    (dict(metric=""), "metric must be the name of an epoch metric"),
])
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        early_stop(**kwargs)


def test_repr_and_not_compilable():
    p = early_stop("val_loss", patience=3)
    assert repr(p) == "early_stop(metric='val_loss', patience=3, min_delta=0.0, mode='min')"
    assert not p.compilable
