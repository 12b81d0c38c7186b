"""fabric_lin/lr_schedule.py: the learning rate at a step, warmup then cosine or WSD, and an unknown schedule named;
the schedule counted in tokens (its steps, where a run ends, where the learning rate is after the batch grew)."""
import pytest

from fabric_lin.lr_schedule import TokenSchedule, learning_rate


def test_cosine_schedule_values():
    kw = dict(base_lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule="cosine")
    assert learning_rate(0, **kw) == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak
    assert learning_rate(9, **kw) == pytest.approx(1e-3)
    assert learning_rate(10, **kw) == pytest.approx(1e-3)  # decay starts at the peak
    # halfway through the decay the cosine is at the midpoint of base and min
    assert learning_rate(60, **kw) == pytest.approx(0.5 * (1e-3 + 1e-4))
    assert learning_rate(110, **kw) == pytest.approx(1e-4)
    assert learning_rate(500, **kw) == pytest.approx(1e-4)  # clamped past the end
    # all warmup (lr_warmup_steps >= max_steps): past the end min_lr too, with no decay steps to divide by
    assert learning_rate(11, 1e-3, 1e-4, warmup_steps=10, max_steps=10) == pytest.approx(1e-4)
    assert learning_rate(25, 1e-3, 1e-4, warmup_steps=20, max_steps=10) == pytest.approx(1e-4)


def test_wsd_schedule_values():
    # flame: stable part = 90% of max_steps including the warmup, decay = last 10%
    kw = dict(base_lr=3e-4, min_lr=3e-5, warmup_steps=10, max_steps=200, schedule="wsd", decay_fraction=0.1)
    assert learning_rate(4, **kw) == pytest.approx(3e-4 * 5 / 10)
    assert learning_rate(10, **kw) == pytest.approx(3e-4)
    assert learning_rate(179, **kw) == pytest.approx(3e-4)
    assert learning_rate(180, **kw) == pytest.approx(3e-4)  # decay starts at 180 = 0.9 * 200
    assert learning_rate(190, **kw) == pytest.approx(3e-4 - (3e-4 - 3e-5) * 0.5)
    assert learning_rate(200, **kw) == pytest.approx(3e-5)
    assert learning_rate(300, **kw) == pytest.approx(3e-5)  # clamped past the end


def test_wsd_decay_takes_the_nearest_whole_number_of_steps():
    # 28% of 10 steps is 2.8: the decay takes 3 steps, from step 7 (not 2, from step 8)
    kw = dict(base_lr=1e-3, min_lr=0.0, warmup_steps=0, max_steps=10, schedule="wsd", decay_fraction=0.28)
    assert learning_rate(7, **kw) == pytest.approx(1e-3)
    assert learning_rate(8, **kw) == pytest.approx(1e-3 * 2 / 3)


def test_wsd_decay_starts_after_a_warmup_longer_than_the_stable_part():
    # the decay would start at step 4 (the last 80% of 20 steps), inside the warmup: it waits for the warmup's end
    kw = dict(base_lr=1e-3, min_lr=0.0, warmup_steps=10, max_steps=20, schedule="wsd", decay_fraction=0.8)
    assert learning_rate(9, **kw) == pytest.approx(1e-3)
    assert learning_rate(10, **kw) == pytest.approx(1e-3)  # the peak, not a drop after the warmup
    assert learning_rate(15, **kw) == pytest.approx(0.5e-3)  # halfway from step 10 to step 20


def test_wsd_decay_of_less_than_half_a_step_still_ends_at_min_lr():
    # 0.4% of 100 steps rounds to no step at all: the decay takes one, so the schedule ends at min_lr all the same (a
    # resume compares the finished run's learning rate at step 100 with the new schedule's)
    kw = dict(base_lr=1e-3, min_lr=1e-4, warmup_steps=0, max_steps=100, schedule="wsd", decay_fraction=0.004)
    assert learning_rate(99, **kw) == pytest.approx(1e-3)
    assert learning_rate(100, **kw) == pytest.approx(1e-4)


def test_a_position_between_two_steps_takes_the_curve_between_them():
    # a run resumed with a larger global batch reads the schedule at fractional steps (TokenSchedule.position)
    kw = dict(base_lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule="cosine")
    assert learning_rate(4.5, **kw) == pytest.approx(5.5e-4)  # warmup: (4.5 + 1) / 10 of the peak
    # 50.5 of the 100 decay steps: 1e-4 + 0.5 * 9e-4 * (1 + cos(0.505 pi)), cos(0.505 pi) = -0.0157073...
    assert learning_rate(60.5, **kw) == pytest.approx(5.429317072e-4, rel=1e-9)
    wsd = dict(base_lr=3e-4, min_lr=3e-5, warmup_steps=10, max_steps=200, schedule="wsd", decay_fraction=0.1)
    assert learning_rate(185.5, **wsd) == pytest.approx(3e-4 - 2.7e-4 * 5.5 / 20)  # 5.5 of the 20 decay steps


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="'linear'"):
        learning_rate(100, 1e-3, 1e-4, 10, 200, schedule="linear")


def test_token_schedule_steps_end_and_position_after_the_batch_grew():
    # a budget of 1000 tokens in steps of 64: 15 whole steps (train.max_tokens // tokens per step), not 16
    schedule = TokenSchedule.of_run(max_steps=None, max_tokens=1000, unit=64)
    assert schedule.steps == 15
    assert TokenSchedule.of_run(max_steps=7, max_tokens=None, unit=64).steps == 7
    # resumed at step 4 (256 tokens) with steps of 96 tokens: (960 - 256) // 96 = 7 more steps, and the learning
    # rate at 352 tokens is the schedule's at 352 / 64 = 5.5 steps, between its steps 5 and 6
    assert schedule.end_step(step=4, tokens_seen=256, tokens_per_step=96) == 11
    assert schedule.position(352) == 5.5
    # a checkpoint already past the budget (960 tokens) ends where it is, not at an earlier step
    assert schedule.end_step(step=20, tokens_seen=1280, tokens_per_step=64) == 20
