"""fabric_lin/lr_schedule.py: the learning rate at a step, warmup then cosine or WSD, and an unknown schedule named."""
import pytest

from fabric_lin.lr_schedule import learning_rate


def test_cosine_schedule_values():
    kw = dict(base_lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule="cosine")
    assert learning_rate(0, **kw) == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak
    assert learning_rate(9, **kw) == pytest.approx(1e-3)
    assert learning_rate(10, **kw) == pytest.approx(1e-3)  # decay starts at the peak
    # halfway through the decay the cosine is at the midpoint of base and min
    assert learning_rate(60, **kw) == pytest.approx(0.5 * (1e-3 + 1e-4))
    assert learning_rate(110, **kw) == pytest.approx(1e-4)
    assert learning_rate(500, **kw) == pytest.approx(1e-4)  # clamped past the end


def test_wsd_schedule_values():
    # flame: stable part = 90% of max_steps including the warmup, decay = last 10%
    kw = dict(base_lr=3e-4, min_lr=3e-5, warmup_steps=10, max_steps=200, schedule="wsd", decay_fraction=0.1)
    assert learning_rate(4, **kw) == pytest.approx(3e-4 * 5 / 10)
    assert learning_rate(10, **kw) == pytest.approx(3e-4)
    assert learning_rate(179, **kw) == pytest.approx(3e-4)
    assert learning_rate(180, **kw) == pytest.approx(3e-4)  # decay starts at 180 = 0.9 * 200
    assert learning_rate(190, **kw) == pytest.approx(3e-4 - (3e-4 - 3e-5) * 0.5)
    assert learning_rate(200, **kw) == pytest.approx(3e-5)


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="'linear'"):
        learning_rate(100, 1e-3, 1e-4, 10, 200, schedule="linear")
