"""The learning-rate schedule: a pure function of the optimizer step, so a checkpoint needs no
scheduler state and a resumed run continues the same curve."""
import math
from dataclasses import dataclass
from typing import Optional

from fabric_lin.errors import InvalidValue


def learning_rate(step: int, base_lr: float, min_lr: float, warmup_steps: int, max_steps: int,
                  schedule: str = "cosine", decay_fraction: float = 0.1) -> float:
    """The learning rate for optimizer step `step` (0-based).

    cosine: linear warmup 0 -> base_lr over `warmup_steps`, then cosine to min_lr at `max_steps`.
    wsd:    linear warmup, constant base_lr until (1 - decay_fraction) * max_steps (the stable part
            includes the warmup, as flame's warmup_stable_decay), then linear decay to min_lr (flame's decays
            along a cosine, to 0: transformers' get_wsd_schedule).
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        span = max(max_steps - warmup_steps, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(int(round(max_steps * decay_fraction)), 1)
        decay_start = max(max_steps - decay_steps, warmup_steps)
        if step < decay_start:
            return base_lr
        progress = min((step - decay_start) / max(max_steps - decay_start, 1), 1.0)
        return base_lr - (base_lr - min_lr) * progress
    raise InvalidValue(f"train.lr_schedule must be 'cosine' or 'wsd', got {schedule!r}")


@dataclass(frozen=True)
class TokenSchedule:
    """A run's schedule, counted in tokens: `unit` tokens make one schedule step (the tokens per step of the
    run's first attempt) and the schedule has `steps` of them. Counting tokens is counting steps, until a
    resume changes the global batch size; then the learning rate and the end of the run still follow the
    tokens trained on (train.max_steps counts steps of the first size)."""

    unit: int
    steps: int

    @classmethod
    def of_run(cls, max_steps: Optional[int], max_tokens: Optional[int], unit: int) -> "TokenSchedule":
        return cls(unit, max_steps if max_steps is not None else max_tokens // unit)

    def end_step(self, step: int, tokens_seen: int, tokens_per_step: int) -> int:
        """The optimizer step at which a run now at `step`, having trained on `tokens_seen`, ends."""
        return step + max(self.steps * self.unit - tokens_seen, 0) // tokens_per_step

    def position(self, tokens_seen: int) -> float:
        """Where `learning_rate` is, in schedule steps: the optimizer step itself where the batch never changed."""
        return tokens_seen / self.unit
