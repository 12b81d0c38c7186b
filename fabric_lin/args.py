"""The small dataclasses that group `fabric-lin pretrain`'s options (`--train.*`, `--eval.*`,
`--optimizer.*`, `--parallelism.*`, `--compile.*`). jsonargparse turns each field into a flag and a
YAML key. Each group checks its own values (`validate`), naming the key, the value and what was expected."""
from dataclasses import dataclass, replace
from typing import Literal, Optional, Tuple

from fabric_lin.errors import InvalidValue

SHORTEST_SEQ_LENGTH = 1  # train.max_seq_length's least value


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
        minimums = {"micro_batch_size": 1, "global_batch_size": 1, "max_seq_length": SHORTEST_SEQ_LENGTH, "lr_warmup_steps": 0,
                    "max_nonfinite_steps": 1}
        for key, minimum in minimums.items():
            if getattr(self, key) < minimum:
                raise InvalidValue(f"train.{key} must be at least {minimum}, got {getattr(self, key)}")
        per_pass = self.micro_batch_size * devices * num_nodes
        iters, remainder = divmod(self.global_batch_size, per_pass)
        if remainder or iters == 0:
            raise InvalidValue(
                f"train.global_batch_size={self.global_batch_size} must be a positive multiple of "
                f"train.micro_batch_size ({self.micro_batch_size}) x devices ({devices}) x num_nodes ({num_nodes}) "
                f"= {per_pass}: {self.batch_sizes_that_share_out(devices * num_nodes)}"
            )
        return iters

    def batch_sizes_that_share_out(self, processes: int) -> str:
        """What to give where the global batch does not share out into micro batches over `processes`: the nearest
        global batches that do, and the largest micro batch up to the one given (which fits in memory) that
        accumulates to the global batch given, where its sequences share out over the processes at all."""
        per_pass = self.micro_batch_size * processes
        below = self.global_batch_size // per_pass * per_pass
        nearest = " or ".join(str(size) for size in (below, below + per_pass) if size > 0)
        fix = f"give a train.global_batch_size that is a multiple of {per_pass} (the nearest: {nearest}), or "
        per_process, spread = divmod(self.global_batch_size, processes)
        if spread:  # no micro batch helps: another number of processes, whose share the micro batch then divides
            fewer = max(n for n in range(1, processes) if self.global_batch_size % n == 0) if processes > 1 else None
            more = next((n for n in range(processes + 1, self.global_batch_size + 1) if self.global_batch_size % n == 0), None)
            counts = " or ".join(str(n) for n in (fewer, more) if n is not None)
            return fix + (f"a number of devices x num_nodes that divides it (the nearest: {counts}), with a "
                          f"train.micro_batch_size that divides each process's share")
        micro = max(size for size in range(1, min(self.micro_batch_size, per_process) + 1) if per_process % size == 0)
        return fix + f"a train.micro_batch_size that divides the {per_process} sequences of each process (e.g. {micro})"

    def total_steps(self) -> int:
        if self.max_tokens is None and self.max_steps is None:
            raise InvalidValue("give one of train.max_steps and train.max_tokens: where the run ends (both are null)")
        if self.max_tokens is not None and self.max_steps is not None:
            # a config file sets one of them, and a flag that gives the other does not unset it
            raise InvalidValue(
                f"give exactly one of train.max_tokens ({self.max_tokens}) and train.max_steps ({self.max_steps}): "
                f"set the other to null: --train.max_steps null to train {self.max_tokens} tokens, or "
                f"--train.max_tokens null to train {self.max_steps} steps"
            )
        if self.max_steps is not None:
            if self.max_steps <= 0:
                raise InvalidValue(f"train.max_steps must be positive, got {self.max_steps}")
            return self.max_steps
        steps = self.max_tokens // (self.global_batch_size * self.max_seq_length)
        if steps <= 0:
            raise InvalidValue(
                f"train.max_tokens={self.max_tokens} is less than one optimizer step of "
                f"global_batch_size x max_seq_length = {self.global_batch_size * self.max_seq_length} tokens"
            )
        return steps

    def validate(self) -> None:
        """The fields that `gradient_accumulation_iters` and `total_steps` do not check."""
        if self.save_interval is not None and self.save_interval < 1:
            raise InvalidValue(f"train.save_interval must be at least 1 (or null: only the final checkpoint), got {self.save_interval}")
        if self.log_interval < 1:
            raise InvalidValue(f"train.log_interval must be at least 1, got {self.log_interval}")
        if self.lr_schedule not in ("cosine", "wsd"):
            raise InvalidValue(f"train.lr_schedule must be 'cosine' or 'wsd', got {self.lr_schedule!r}")
        if self.lr_schedule == "wsd" and not 0.0 < self.wsd_decay_fraction <= 1.0:
            raise InvalidValue(f"train.wsd_decay_fraction must be in (0, 1], got {self.wsd_decay_fraction}")
        default_fraction = TrainArgs.wsd_decay_fraction
        if self.lr_schedule != "wsd" and self.wsd_decay_fraction != default_fraction:
            # a run given it without --train.lr_schedule wsd would train on the cosine schedule without a word
            raise InvalidValue(
                f"train.wsd_decay_fraction {self.wsd_decay_fraction} sets where lr_schedule 'wsd' decays, and this run's "
                f"lr_schedule is {self.lr_schedule!r}, which it leaves unchanged: give --train.lr_schedule wsd, or leave "
                f"train.wsd_decay_fraction at {default_fraction}"
            )
        if not 0.0 <= self.min_lr < float("inf"):
            raise InvalidValue(f"train.min_lr must be a finite number >= 0, got {self.min_lr}")
        if self.max_norm is not None and not 0.0 < self.max_norm < float("inf"):
            raise InvalidValue(f"train.max_norm must be a number > 0 (or null: no clipping), got {self.max_norm}")
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise InvalidValue(f"train.keep_last_n must be at least 1 (or null to keep all), got {self.keep_last_n}")


@dataclass
class EvalArgs:
    """Validation."""

    interval: int = 1000
    """Optimizer steps between validations"""
    max_iters: int = 8
    """Validation batches per validation, each of train.global_batch_size sequences (the samples of one optimizer
    step; every device reads its micro batches of them): the first max_iters x global_batch_size blocks of the
    validation split (all of it where it holds fewer), the same blocks whatever micro_batch_size, devices, nodes
    and data.num_workers, so that val_loss stays comparable across a resume that changes them"""
    initial_validation: bool = False
    """Validate before the first step"""
    final_validation: bool = True
    """Validate after the last step"""

    def validate(self) -> None:
        if self.interval < 1:
            raise InvalidValue(f"eval.interval must be at least 1 (optimizer steps between validations), got {self.interval}")
        if self.max_iters < 1:
            raise InvalidValue(f"eval.max_iters must be at least 1 (validation batches of train.global_batch_size sequences), "
                               f"got {self.max_iters}")


@dataclass
class OptimizerArgs:
    """AdamW (fused on CUDA). Weight decay applies to matrices and embeddings, not to norms or biases."""

    lr: float = 4e-4
    """Peak learning rate, reached at the end of the warmup (train.lr_warmup_steps) and decayed to train.min_lr"""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay, on matrices and embeddings only"""
    betas: Tuple[float, float] = (0.9, 0.95)
    """AdamW's decay rates of the gradient's running mean and of its square, each in [0, 1)"""
    eps: float = 1e-8
    """Added to the root of AdamW's second moment before it divides"""

    def validate(self, min_lr: float) -> None:
        """The values AdamW takes, and the schedule's end (train.min_lr) at or below its peak."""
        if not 0.0 <= self.lr < float("inf"):
            raise InvalidValue(f"optimizer.lr must be a finite number >= 0, got {self.lr}")
        if not 0.0 <= self.weight_decay < float("inf"):
            raise InvalidValue(f"optimizer.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise InvalidValue(f"optimizer.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not 0.0 < self.eps < float("inf"):
            raise InvalidValue(f"optimizer.eps must be a finite number > 0 (it keeps AdamW's division finite), got {self.eps}")
        if min_lr > self.lr == 0:
            raise InvalidValue(f"optimizer.lr 0 changes no weight at any step, and train.min_lr ({min_lr:g}) is above "
                               f"it: give a positive optimizer.lr (config_hub's 340M recipes: 3e-4); train.min_lr 0 too "
                               f"runs the steps without changing the weights")
        if min_lr > self.lr:
            raise InvalidValue(
                f"train.min_lr ({min_lr:g}) is above optimizer.lr ({self.lr:g}): the schedule decays from optimizer.lr to "
                f"train.min_lr, so it would rise instead; give a train.min_lr at or below optimizer.lr (the recipes use "
                f"10% of it: {0.1 * self.lr:g})"
            )


@dataclass
class ParallelismArgs:
    """How several processes (GPUs, or CPU processes) share the work. One process ignores all but
    activation_checkpointing."""

    data_parallel: Literal["fsdp", "ddp"] = "fsdp"
    """With several processes: "fsdp" shards the weights, gradients and optimizer state over a node's processes and
    replicates them across nodes (FSDP2's fully_shard on a (nodes, devices) mesh, HYBRID_SHARD's layout); "ddp"
    keeps all of them on every GPU (DistributedDataParallel, 16 bytes per parameter: 6.0 GB at gla-340M) and
    all-reduces the gradients in buckets, with less host work per step than FSDP's hooks around every Block"""
    fsdp_unit: Literal["block", "model"] = "block"
    """With FSDP: what one all-gather gathers. "block": each Block's weights, just before the Block runs
    (least memory). "model": all weights at once, one all-gather and one reduce-scatter per pass instead of
    one per Block (less host work), at the cost of the whole model's compute-dtype weights and full-size
    gradients on every GPU during the step and of communication that no longer overlaps the Blocks' compute"""
    fsdp_reshard_after_forward: bool = True
    """With FSDP: free each Block's gathered weights after its forward pass and gather them again for its
    backward pass (least memory). False keeps them from the forward pass to the backward pass (ZeRO-2 inside a
    node: one all-gather per micro-batch instead of two, for every Block's gathered weights held in between)"""
    activation_checkpointing: bool = False
    """Recompute each Block's activations in the backward pass (less memory, about a third more compute)"""
    timeout_minutes: float = 30.0
    """With several processes: how long a process waits for the others before it fails, in every exchange of data and
    at the start until every process has joined (on several nodes, but under torchrun, join_timeout_minutes bounds the
    start). A process that stops answering leaves the others waiting this long (one that ends is found at its next
    exchange). Rank 0 alone writes a one-file (DDP) checkpoint, searches the GLA kernels' launch settings
    (compile.kernel_autotune) and builds a data module's cached corpus while the others wait: keep it above the
    longest of these"""
    join_timeout_minutes: float = 10.0
    """With several nodes (not under torchrun, which bounds its own rendezvous): how long the processes wait at the
    start for all of them to join at MASTER_ADDR:MASTER_PORT (at most timeout_minutes) before they stop, saying how
    many joined; every node's command must have started by then"""

    def validate(self) -> None:
        if self.data_parallel not in ("fsdp", "ddp"):
            raise InvalidValue(f"parallelism.data_parallel must be 'fsdp' or 'ddp', got {self.data_parallel!r}")
        if self.fsdp_unit not in ("block", "model"):
            raise InvalidValue(f"parallelism.fsdp_unit must be 'block' or 'model', got {self.fsdp_unit!r}")
        if not self.timeout_minutes > 0:
            raise InvalidValue(f"parallelism.timeout_minutes must be positive, got {self.timeout_minutes!r}")
        if not self.join_timeout_minutes > 0:
            raise InvalidValue(f"parallelism.join_timeout_minutes must be positive, got {self.join_timeout_minutes!r}")


AUTO_MODE_FIX = "leave compile.mode at auto (CUDA graphs where they can run, else default)"


@dataclass
class CompileArgs:
    """torch.compile of the model (each Block compiled in place) and the kernels' launch settings."""

    enabled: Optional[bool] = None
    """Compile the model. null: on with CUDA, off on the CPU (where Inductor's build of C++ code for the Blocks takes
    minutes before the first step)"""
    cache: bool = True
    """Keep Triton's and torch.compile's caches in out_dir/compile_cache (TRITON_CACHE_DIR and
    TORCHINDUCTOR_CACHE_DIR), so that a resumed run, or any later run into the same out_dir, loads compiled
    kernels and graphs instead of building them again"""
    dynamic: bool = True
    """Compile the Blocks for any batch size and sequence length (marked dynamic), so that a new context
    length or a smaller batch (validation) does not compile them again. False: each new shape compiles anew"""
    mode: Literal["auto", "default", "reduce-overhead"] = "auto"
    """reduce-overhead: each compiled Block's forward and backward pass replays as a CUDA graph, one launch
    for all its kernels, so the host no longer holds the GPU back (one GPU only: FSDP gathers the weights
    into new memory each step, which a recorded graph cannot follow; not with reset_state_at_doc_boundaries,
    whose shapes change with every batch). default: kernels launched one by one. auto: reduce-overhead
    where it can run, default elsewhere"""
    kernel_autotune: bool = False
    """Search the GLA kernels' launch settings (tiles, warps) at this run's layer shape before training, about
    a minute on a GPU, instead of using the shipped settings. Kept in out_dir/compile_cache/gla_launch.json,
    keyed by GPU, dtype and head dims, so a resumed run or a new context length does not search again. On the CPU,
    whose GLA layers run PyTorch ops, nothing is searched and the run says so"""
    precompile: bool = True
    """Before the model is built, find the Triton kernels the first step launches (a pass of a one-Block copy of
    the model whose launches are recorded, not run) and compile them in background processes, at most 8, while the
    model is built and traced; each kernel's first launch waits for its compile, then loads it from Triton's cache.
    False: each kernel compiles at its first launch, one after another, inside the first step. CUDA only"""

    def resolve(self, cuda: bool, devices: int, num_nodes: int, reset_state_at_doc_boundaries: bool) -> "CompileArgs":
        """This run's settings: `enabled` null -> on with CUDA; mode "auto" -> "reduce-overhead" where CUDA
        graphs can run (one CUDA GPU, compile on, shapes that do not change with every batch), else "default".
        Raises, naming the keys, where the settings cannot run together."""
        if self.mode not in ("auto", "default", "reduce-overhead"):
            raise InvalidValue(f"compile.mode must be 'auto', 'default' or 'reduce-overhead', got {self.mode!r}")
        enabled = cuda if self.enabled is None else self.enabled
        graphs_can_run = cuda and enabled and devices * num_nodes == 1
        mode = self.mode
        if mode == "auto":
            mode = "reduce-overhead" if graphs_can_run and not reset_state_at_doc_boundaries else "default"
        if mode == "reduce-overhead" and not graphs_can_run:
            raise InvalidValue(
                "compile.mode 'reduce-overhead' (CUDA graphs) needs one CUDA GPU and compile.enabled true; got "
                f"cuda={cuda}, compile.enabled={enabled}, devices={devices}, num_nodes={num_nodes}: {AUTO_MODE_FIX}"
            )
        if mode == "reduce-overhead" and reset_state_at_doc_boundaries:
            # each batch's document count changes a tensor shape, and each new shape records another graph
            raise InvalidValue(f"compile.mode 'reduce-overhead' (CUDA graphs) cannot be used with "
                               f"reset_state_at_doc_boundaries: {AUTO_MODE_FIX}")
        return replace(self, enabled=enabled, mode=mode)

    @property
    def cuda_graphs(self) -> bool:
        """Whether the compiled Blocks replay as CUDA graphs (after `resolve`)."""
        return bool(self.enabled) and self.mode == "reduce-overhead"
