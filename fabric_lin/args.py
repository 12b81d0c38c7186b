"""The small dataclasses that group `fabric-lin pretrain`'s options (`--train.*`, `--eval.*`,
`--optimizer.*`). jsonargparse turns each field into a flag and a YAML key."""
import math
from dataclasses import dataclass
from typing import Literal, Optional, Tuple


@dataclass
class TrainArgs:
    """Training schedule, batch arithmetic and checkpointing."""

    save_interval: Optional[int] = 1000
    """Optimizer steps between checkpoints (None: only the final one)"""
    log_interval: int = 1
    """Optimizer steps between log lines (losses of every step are still recorded)"""
    global_batch_size: int = 512
    """Sequences per optimizer step, summed over all devices and nodes"""
    micro_batch_size: int = 4
    """Sequences per forward/backward pass on one device"""
    lr_warmup_steps: int = 2000
    """Optimizer steps of linear learning-rate warmup from 0"""
    max_tokens: Optional[int] = None
    """Stop after this many training tokens (max_steps = max_tokens // (global_batch_size * max_seq_length))"""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (exactly one of max_tokens and max_steps is given)"""
    max_seq_length: int = 2048
    """Tokens per training sequence (each sample holds max_seq_length + 1 tokens: inputs and shifted targets)"""
    max_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value (None: no clipping, the norm is still logged)"""
    min_lr: float = 4e-5
    """Learning rate at the end of the decay"""
    lr_schedule: Literal["cosine", "wsd"] = "cosine"
    """cosine: warmup then cosine decay to min_lr. wsd: warmup, constant lr, then linear decay to min_lr"""
    wsd_decay_fraction: float = 0.1
    """wsd only: fraction of max_steps spent in the final decay (flame: 0.1)"""
    keep_last_n: Optional[int] = None
    """Keep only the newest n step-* checkpoints (None: keep all)"""
    max_nonfinite_steps: int = 10
    """Stop with an error after this many consecutive steps with a non-finite loss or gradient norm"""

    def gradient_accumulation_iters(self, devices: int, num_nodes: int) -> int:
        minimums = {"micro_batch_size": 1, "global_batch_size": 1, "max_seq_length": 1, "lr_warmup_steps": 0,
                    "max_nonfinite_steps": 1}
        for key, minimum in minimums.items():
            if getattr(self, key) < minimum:
                raise ValueError(f"train.{key} must be at least {minimum}, got {getattr(self, key)}")
        per_pass = self.micro_batch_size * devices * num_nodes
        iters, remainder = divmod(self.global_batch_size, per_pass)
        if remainder or iters == 0:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} must be a positive multiple of "
                f"train.micro_batch_size ({self.micro_batch_size}) x devices ({devices}) x num_nodes ({num_nodes}) "
                f"= {per_pass}"
            )
        return iters

    def total_steps(self) -> int:
        if (self.max_tokens is None) == (self.max_steps is None):
            raise ValueError(
                f"give exactly one of train.max_tokens ({self.max_tokens}) and train.max_steps ({self.max_steps})"
            )
        if self.max_steps is not None:
            if self.max_steps <= 0:
                raise ValueError(f"train.max_steps must be positive, got {self.max_steps}")
            return self.max_steps
        steps = self.max_tokens // (self.global_batch_size * self.max_seq_length)
        if steps <= 0:
            raise ValueError(
                f"train.max_tokens={self.max_tokens} is less than one optimizer step of "
                f"global_batch_size x max_seq_length = {self.global_batch_size * self.max_seq_length} tokens"
            )
        return steps


@dataclass
class EvalArgs:
    """Validation."""

    interval: int = 1000
    """Optimizer steps between validations"""
    max_iters: int = 100
    """Validation batches per device per validation"""
    initial_validation: bool = False
    """Validate before the first step"""
    final_validation: bool = True
    """Validate after the last step"""


@dataclass
class OptimizerArgs:
    """AdamW (fused on CUDA). Weight decay applies to matrices and embeddings, not to norms or biases."""

    lr: float = 4e-4
    weight_decay: float = 0.1
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8


def learning_rate(step: int, base_lr: float, min_lr: float, warmup_steps: int, max_steps: int,
                  schedule: str = "cosine", decay_fraction: float = 0.1) -> float:
    """The learning rate for optimizer step `step` (0-based): a pure function, so nothing to checkpoint.

    cosine: linear warmup 0 -> base_lr over `warmup_steps`, then cosine to min_lr at `max_steps`.
    wsd:    linear warmup, constant base_lr until (1 - decay_fraction) * max_steps (the stable part
            includes the warmup, as flame's warmup_stable_decay), then linear decay to min_lr.
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
    raise ValueError(f"train.lr_schedule must be 'cosine' or 'wsd', got {schedule!r}")
