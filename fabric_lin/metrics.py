"""What a training run reports, written from one place (`MetricsWriter`): `out_dir/metrics.jsonl`
(rank 0, one JSON object per line), the Fabric loggers (TensorBoard, CSV or wandb) and the console.

metrics.jsonl holds these kinds of record, each with its "step" and "attempt":
    every optimizer step     loss (averaged over ranks), lr, grad_norm, data_fingerprint
    the first step           time_to_first_step_s, compiled_graphs, startup_phases_s
    every train.log_interval tokens_per_sec, tokens, skipped_steps, and where known mfu,
                             max_memory_gb, recompilations
    every validation         val_loss, val_ppl
    a resume with changes    resume_changes (`--resume_changes`: what changed, each value before and after)
    a checkpoint saved       checkpoint (its directory's name in out_dir: step-XXXXXXXX or final)

It reads as one history of the run, each step once. "attempt" numbers the runs of the command that made the
history (1, then one more for each resume). A resumed attempt starts from its checkpoint's step: the records
that earlier attempts wrote after that step (steps trained again now) move to metrics.superseded.jsonl, and the
loggers drop them too (TensorBoard's `purge_step`, the CSV file's later rows), so that a plot of either is one curve.
"""
import csv
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from lightning_fabric.loggers import CSVLogger, TensorBoardLogger
from lightning_fabric.loggers.csv_logs import _ExperimentWriter
from lightning_fabric.loggers.logger import rank_zero_experiment

from fabric_lin.errors import InvalidValue, MissingPackage
from fabric_lin.files import naming_the_file

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"
REWRITE_FILE = f".tmp-{METRICS_FILE}"  # metrics.jsonl's next version, renamed over it when complete


def process_start_time() -> float:
    """Wall-clock time at which Python started in this process.

    /proc/self/stat's start time is that of the process ID, which `exec` keeps: where a shell ran other
    commands and then exec'ed Python (`bash -c "sleep 3; fabric-lin pretrain ..."` does, for its last
    command), it is the shell's start. The entry point (`fabric_lin.cli`, first thing in the process)
    records the time and the CPU time used by then; Python's start-up before it is CPU work, so their
    difference is when Python started, give or take the start-up's waits for the disk. The later of the
    two is taken; without the entry point (a script importing fabric_lin), /proc's; elsewhere, this import."""
    start = None
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        start = time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    entered = None
    for name in ("fabric_lin.cli", "__main__"):  # `python -m fabric_lin.cli` runs it as __main__
        entered = getattr(sys.modules.get(name), "ENTERED_AT", None) if name in sys.modules else None
        if entered is not None:
            break
    if entered is not None:
        wall, cpu = entered
        start = wall - cpu if start is None else max(start, wall - cpu)
    return time.time() if start is None else start


PROCESS_START = process_start_time()


def compiled_graphs() -> int:
    """How many frames torch.compile (Dynamo) has compiled in this process, first compilations included."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


class MetricsWriter:
    """One run's metrics. Per-step values stay on the device until `flush` (one device-to-host transfer
    per log interval, not per step); tokens/s is measured over the steps since the last progress line,
    without the time spent `paused` (validation, saving)."""

    def __init__(self, fabric, out_dir: Path, max_steps: int, tokens_per_step: int,
                 flops_per_token: Optional[float] = None, peak_flops: Optional[float] = None,
                 count_recompilations: bool = False):
        self.fabric = fabric
        self.path = Path(out_dir) / METRICS_FILE
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.count_recompilations = count_recompilations
        self.startup: Dict[str, float] = {"launched": time.time() - PROCESS_START}
        self.pending: List[Tuple[int, torch.Tensor, float, torch.Tensor, torch.Tensor]] = []
        self.graphs_at_first_step = 0
        self.attempt = 1

    def write(self, *records: Dict[str, Any]) -> None:
        if self.fabric.global_rank == 0:
            with naming_the_file(self.path), open(self.path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps({**record, "attempt": self.attempt}) + "\n" for record in records)

    def begin_attempt(self, step: int) -> None:
        """This attempt trains on from optimizer step `step`: the records of later steps leave metrics.jsonl for
        metrics.superseded.jsonl, and the logger drops them (rank 0 does it). Step 0 is a start without a checkpoint
        (no checkpoint is saved before step 1), which validates step 0 again: every earlier record goes."""
        if self.fabric.global_rank != 0:
            return
        last_kept = step if step > 0 else -1
        kept, superseded, attempts = [], [], [0]
        superseded_path = self.path.with_name(SUPERSEDED_FILE)
        if superseded_path.exists():
            attempts += [r.get("attempt", 0) for r in read_records(superseded_path)]
        if self.path.exists():
            for record in read_records(self.path):
                (kept if record.get("step", 0) <= last_kept else superseded).append(record)
                attempts.append(record.get("attempt", 0))
        self.attempt = max(attempts) + 1
        if superseded:
            cut = superseded_path.exists() and ends_inside_a_line(superseded_path)
            with open(superseded_path, "a", encoding="utf-8") as f:
                if cut:  # a kill cut the last record being moved: the first one moved now starts a line of its own
                    f.write("\n")
                f.writelines(json.dumps(record) + "\n" for record in superseded)
                f.flush()
                os.fsync(f.fileno())
        if self.path.exists():
            tmp = self.path.with_name(REWRITE_FILE)
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(record) + "\n" for record in kept)
                f.flush()
                # on disk before the rename: a crash of the machine could otherwise leave an empty metrics.jsonl
                os.fsync(f.fileno())
            os.replace(tmp, self.path)  # moved records are in the superseded file first: none is lost
        for logger in self.fabric.loggers:
            if isinstance(logger, (RunTensorBoardLogger, RunCSVLogger)):
                logger.drop_records_after(last_kept)

    def log_checkpoint(self, step: int, name: str) -> None:
        self.write({"step": step, "checkpoint": name})

    def delete_history(self) -> List[str]:
        """Delete the history an earlier run left in out_dir (`--overwrite true`), so that this run's starts at
        attempt 1 with nothing superseded: the names of the files deleted."""
        deleted = []
        for name in (METRICS_FILE, SUPERSEDED_FILE, REWRITE_FILE):
            path = self.path.with_name(name)
            if path.exists():
                path.unlink()
                deleted.append(name)
        return deleted

    def log_hyperparams(self, hparams: Dict[str, Any]) -> None:
        if not isinstance(self.fabric.logger, CSVLogger):  # Fabric's CSVLogger cannot; hyperparameters.yaml has them
            self.fabric.logger.log_hyperparams(hparams)

    def startup_phase(self, name: str) -> None:
        """A phase of the start-up ended now (reported with the time to the first step)."""
        self.startup[name] = time.time() - PROCESS_START

    def start(self, step: int, max_steps: int) -> None:
        """The training loop starts, at optimizer step `step`, to end at `max_steps`."""
        self.startup_phase("loop started")
        self.max_steps = max_steps
        self.start_step = self.window_step = step
        self.paused_s = 0.0  # in validation and saving, since the loop started
        self.steady_start = None  # (the time, paused_s) at the end of the first step
        self.run_start = self.window_start = time.perf_counter()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside is left out of tokens/s (which measures training, not validation or saving)."""
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.window_start += time.perf_counter() - paused
            self.paused_s += time.perf_counter() - paused

    def stop_clock(self) -> float:
        """The training steps are over (the final validation and save are not training): seconds since the loop started."""
        self.end = time.perf_counter()
        return self.end - self.run_start

    def add_step(self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor, fingerprint: torch.Tensor) -> None:
        self.pending.append((step, loss.detach(), lr, grad_norm.detach(), fingerprint))

    def flush(self) -> List[float]:
        """Write the pending per-step records (rank 0) and return their losses, averaged over ranks."""
        if not self.pending:
            return []
        fabric = self.fabric
        losses = torch.stack([p[1] for p in self.pending]).float()
        fingerprints = torch.stack([p[4] for p in self.pending])
        if fabric.world_size > 1:
            losses = fabric.all_reduce(losses, reduce_op="mean")
            fingerprints = fabric.all_reduce(fingerprints, reduce_op="sum")
        norms = torch.stack([p[3].float() for p in self.pending])
        loss_values, norm_values, fingerprint_values = losses.tolist(), norms.tolist(), fingerprints.tolist()
        self.write(*(
            {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "data_fingerprint": data}
            for (step, _, lr, _, _), loss, norm, data in zip(self.pending, loss_values, norm_values, fingerprint_values)
        ))
        self.pending.clear()
        return loss_values

    def log_first_step(self, step: int) -> None:
        """The time from process start to the first optimizer step, and where the start-up went."""
        if self.fabric.device.type == "cuda":
            torch.cuda.synchronize(self.fabric.device)  # the step done, not only queued
        seconds = time.time() - PROCESS_START
        self.steady_start = (time.perf_counter(), self.paused_s)
        self.graphs_at_first_step = compiled_graphs()
        self.fabric.print(
            f"Time to first optimizer step: {seconds:.1f}s (from process start; "
            + ", ".join(f"{name} at {t:.1f}s" for name, t in self.startup.items())
            + f"); torch.compile graphs so far: {self.graphs_at_first_step}"
        )
        self.fabric.log_dict({"time_to_first_step_s": seconds}, step=step)
        self.write({"step": step, "time_to_first_step_s": seconds, "compiled_graphs": self.graphs_at_first_step,
                    "startup_phases_s": dict(self.startup)})

    def log_progress(self, step: int, lr: float, grad_norm: torch.Tensor, skipped_steps: int, tokens: int) -> None:
        """Flush, then log the speed since the last progress line and print the progress line."""
        losses = self.flush()  # waits for the GPU: the window ends here
        now = time.perf_counter()
        tokens_per_sec = (step - self.window_step) * self.tokens_per_step / max(now - self.window_start, 1e-9)
        metrics = {
            "loss": losses[-1], "lr": lr, "grad_norm": float(grad_norm), "tokens_per_sec": tokens_per_sec,
            "tokens": tokens, "skipped_steps": skipped_steps,
        }
        if self.peak_flops is not None:
            metrics["mfu"] = self.flops_per_token * tokens_per_sec / (self.peak_flops * self.fabric.world_size)
        if self.fabric.device.type == "cuda":
            metrics["max_memory_gb"] = torch.cuda.max_memory_allocated(self.fabric.device) / 1e9
        if self.count_recompilations:
            # graphs Dynamo built after the first step: a shape, dtype or mode it had not seen
            # (validation's no_grad is one); each costs seconds to minutes of compilation
            metrics["recompilations"] = compiled_graphs() - self.graphs_at_first_step
        self.fabric.log_dict(metrics, step=step)
        # the losses are in metrics.jsonl per step already; the speed figures are added
        self.write({"step": step, **{k: v for k, v in metrics.items() if k not in ("loss", "lr", "grad_norm")}})
        eta = self.seconds_per_step(step, now) * (self.max_steps - step)
        self.fabric.print(progress_line(step, self.max_steps, metrics, eta))
        self.window_start, self.window_step = now, step

    def seconds_per_step(self, step: int, now: float) -> float:
        """Wall-clock seconds per step up to `step`, validation and saving included (the steps left pause for them
        too), from the end of the first step on where a step followed it: the first step's compilation and warm-up
        happen once, and spread over every step left they lengthened the ETA by their time x steps left / steps done
        (a minute's compilation: 34 hours at step 10 of 20,480)."""
        if self.steady_start is not None and step > self.start_step + 1:
            return (now - self.steady_start[0]) / (step - self.start_step - 1)
        return (now - self.run_start) / max(step - self.start_step, 1)

    def log_validation(self, step: int, validation: Optional[Tuple[float, int]]) -> None:
        """A validation's (loss, tokens it covered); None: no validation data."""
        if validation is None:
            return
        val_loss, val_tokens = validation
        val_ppl = math.exp(min(val_loss, 100.0))
        self.fabric.log_dict({"val_loss": val_loss, "val_ppl": val_ppl}, step=step)
        self.fabric.print(f"step {step}: val_loss {val_loss:.4f} | val_ppl {val_ppl:.2f}")
        self.write({"step": step, "val_loss": val_loss, "val_ppl": val_ppl, "val_tokens": val_tokens})

    def log_summary(self, step_count: int, tokens: int, elapsed: float) -> None:
        """The end of the run: its tokens and time, and its speed in steady state: from the end of the first step
        on (compilation and warm-up left out), without validation and saving."""
        trained_tokens = (step_count - self.start_step) * self.tokens_per_step
        summary = f"Training finished: {tokens:,} tokens in total ({trained_tokens:,} in this run) | elapsed {format_seconds(elapsed)}"
        steady_steps = step_count - self.start_step - 1
        if self.steady_start is not None and steady_steps > 0:
            start, paused_before = self.steady_start
            seconds = self.end - start - (self.paused_s - paused_before)
            summary += (f" | {steady_steps * self.tokens_per_step / max(seconds, 1e-9):,.0f} tokens/s after the first step "
                        "(compilation and warm-up left out, as are validation and saving)")
        if self.fabric.device.type == "cuda":
            summary += f" | peak memory {torch.cuda.max_memory_allocated(self.fabric.device) / 1e9:.2f} GB"
        self.fabric.print(summary)
        self.write({"step": step_count, "tokens_per_sec_after_first_step": (
            steady_steps * self.tokens_per_step / max(seconds, 1e-9) if self.steady_start is not None and steady_steps > 0 else None)})

    def close(self, status: str) -> None:
        # Fabric's CSV logger writes its file only every 100 logged steps, and at finalize
        for logger in self.fabric.loggers:
            try:
                logger.finalize(status)
            except OSError as error:
                if status != "failed":
                    raise
                # the run failed already (e.g. the disk is full): that failure is the one to report
                self.fabric.print(f"Warning: the {type(logger).__name__} could not write its last records: {error}")


def progress_line(step: int, max_steps: int, m: Dict[str, float], eta: float) -> str:
    line = (
        f"step {step}/{max_steps} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | grad_norm {m['grad_norm']:.3f} | "
        f"{m['tokens_per_sec']:,.0f} tok/s"
    )
    if "mfu" in m:
        line += f" | MFU {100 * m['mfu']:.1f}%"
    if "max_memory_gb" in m:
        line += f" | mem {m['max_memory_gb']:.1f} GB"
    if m.get("recompilations"):
        line += f" | recompilations {m['recompilations']}"
    return line + f" | ETA {format_seconds(eta)}"


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def ends_inside_a_line(path: Path) -> bool:
    """Whether a file holds text after its last newline (a line cut short by a kill)."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def recorded_checkpoints(out_dir: Path) -> List[str]:
    """The checkpoints that out_dir/metrics.jsonl records as saved, in the order they were saved."""
    path = Path(out_dir) / METRICS_FILE
    return [r["checkpoint"] for r in read_records(path) if "checkpoint" in r] if path.is_file() else []


def read_records(path: Path) -> List[Dict[str, Any]]:
    """The records of a metrics file; a line cut short by a kill is left out."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class RunTensorBoardLogger(TensorBoardLogger):
    """TensorBoard's log of one run across its attempts: a resumed run writes into the version directory of
    the run it continues (a fresh one into a new version), and from the step it resumes at, TensorBoard drops
    what earlier attempts wrote (SummaryWriter's `purge_step`): one curve, each step once."""

    def __init__(self, root_dir: Path, continuing: bool):
        super().__init__(root_dir=root_dir, name="tensorboard")
        if continuing:
            versions = self._get_next_version()
            self._version = max(versions - 1, 0)

    def drop_records_after(self, step: int) -> None:
        # SummaryWriter's arguments, kept by TensorBoardLogger until it makes the writer at its first record
        self._kwargs["purge_step"] = step + 1


class RunCSVLogger(CSVLogger):
    """The CSV log of one run across its attempts, as `RunTensorBoardLogger` keeps TensorBoard's: a resumed run writes
    on into the metrics.csv of the run it continues (a fresh one into a new version), from which the rows after the
    step it resumes at are dropped: each step once. Each row is written as it is logged: Fabric's CSVLogger writes
    every 100th step's, which the recipes' log intervals never log, so a killed run's CSV file held nothing."""

    def __init__(self, root_dir: Path, continuing: bool):
        super().__init__(root_dir=root_dir, name="csv", flush_logs_every_n_steps=1)
        if continuing:
            self._version = max(self._get_next_version() - 1, 0)
        self.keep_through_step: Optional[int] = None  # None: keep every earlier row

    def drop_records_after(self, step: int) -> None:
        self.keep_through_step = step

    @property
    @rank_zero_experiment
    def experiment(self) -> "_ExperimentWriter":
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedCSVWriter(self.log_dir, self.keep_through_step)
        return self._experiment


class ContinuedCSVWriter(_ExperimentWriter):
    """Fabric's writer of metrics.csv, which deletes the file it finds; this one keeps its rows through
    `keep_through_step` (and its columns), and leaves out a row cut short by a kill."""

    def __init__(self, log_dir: str, keep_through_step: Optional[int]):
        self.keep_through_step = keep_through_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = [row for row in reader if self._kept(row)]
            self.metrics_keys = list(reader.fieldnames or [])
        tmp = path.with_name(f".tmp-{path.name}")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)

    def _kept(self, row: Dict[str, Optional[str]]) -> bool:
        if None in row.values():  # fewer fields than the header: the line a kill cut short
            return False
        try:
            step = int(float(row["step"]))
        except (KeyError, ValueError):
            return False
        return self.keep_through_step is None or step <= self.keep_through_step


def make_logger(name: str, out_dir: Path, hparams: Dict[str, Any], continuing: bool = False):
    """`continuing`: the run resumes one in out_dir (TensorBoard and CSV then write on into its version). The loggers
    write under out_dir/logs/."""
    logs = out_dir / "logs"
    if logs.exists() and not logs.is_dir():
        raise InvalidValue(f"{logs} is a file, where the {name} logger writes its directory: move or remove it")
    if name == "tensorboard":
        try:  # what Lightning's TensorBoardLogger writes with, found only at its first record
            import torch.utils.tensorboard  # noqa: F401  (needs the tensorboard package)
        except ImportError as e:
            try:
                import tensorboardX  # noqa: F401  (Lightning's other writer)
            except ImportError:
                raise MissingPackage(f"logger_name=tensorboard needs the tensorboard package: pip install tensorboard, "
                                     f"or --logger_name csv ({e})") from e
        return RunTensorBoardLogger(logs, continuing)
    if name == "csv":
        return RunCSVLogger(logs, continuing)
    if name == "wandb":
        try:  # Weights & Biases' own logger for Lightning Fabric
            from wandb.integration.lightning.fabric import WandbLogger
        except ImportError as e:
            raise MissingPackage(f"logger_name=wandb needs the wandb package: pip install wandb, or --logger_name csv ({e})") from e
        return WandbLogger(project="fabric-lin", name=out_dir.name, save_dir=str(logs), resume="allow", config=hparams)
    raise InvalidValue(f"logger_name must be tensorboard, csv or wandb, got {name!r}")
