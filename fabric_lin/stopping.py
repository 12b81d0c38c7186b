"""When a run skips an update or stops: the signals that ask for a checkpoint and a stop, and each step's flags
(update skipped, stop requested) agreed across ranks without the host waiting for the GPU."""
import os
import signal
from collections import deque
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

if TYPE_CHECKING:  # the data modules read STOP_SIGNALS: data preparation need not import Lightning (~1.5 s)
    import lightning_fabric as L

# what a scheduler sends before preemption or at a time limit (SIGTERM; SIGUSR1 with SLURM's --signal), and Ctrl-C
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class StepFlags:
    """Each step's flags - update skipped (non-finite loss or gradient norm), stop requested (a signal, which
    may reach one rank only) - summed over ranks on the device, so that every rank skips the same updates
    and stops at the same step without the host waiting for the GPU after each step. The host reads a
    step's flags once they have arrived (`pop`), usually one step later."""

    def __init__(self, fabric: "L.Fabric"):
        self.fabric = fabric
        self.queue: deque = deque()  # (step, flags on the host or being copied there, copy-done event)
        self.nonfinite_in_a_row = 0  # skipped updates in a row, as far as the host knows

    def push(self, step: int, nonfinite: torch.Tensor, stop_requested: bool) -> torch.Tensor:
        """Queue this step's flags; returns 1.0 where any rank's update is to be skipped, else 0.0 (on the device)."""
        device = nonfinite.device
        flags = torch.stack([nonfinite.float(), torch.full((), float(stop_requested), device=device)])
        if self.fabric.world_size > 1:
            # not fabric.all_reduce: it starts with a barrier, which waits for the GPU
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.SUM)
        if device.type == "cuda":
            host = torch.empty(2, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flags, None
        self.queue.append((step, host, event))
        return (flags[0] > 0).float()

    def pop(self, wait_all: bool) -> List[Tuple[int, bool, bool]]:
        """(step, update skipped, stop requested) of the queued steps but the newest, or of all when
        wait_all (waiting for the GPU to get there)."""
        popped = []
        while self.queue and (wait_all or len(self.queue) > 1):
            step, host, event = self.queue.popleft()
            if event is not None:
                event.synchronize()
            skipped, stop = host.tolist()
            popped.append((step, skipped > 0, stop > 0))
        return popped

    def settle(self, wait: bool) -> Tuple[int, bool]:
        """Take in the flags that have arrived - all of them where `wait` (the host stops there anyway), or
        while updates are being skipped, so that a run of them stops where it should, or once a stop is
        asked for, so that the checkpoint counts the last step's skip too. Prints each skip. Returns (updates
        skipped among them, whether a stop was asked for)."""
        flags = self.pop(wait_all=wait or self.nonfinite_in_a_row > 0)
        stop = any(stop_requested for _, _, stop_requested in flags)
        if stop:
            flags += self.pop(wait_all=True)
        skipped = 0
        for step, step_skipped, _ in flags:
            self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if step_skipped else 0
            if step_skipped:
                skipped += 1
                self.fabric.print(f"step {step}: non-finite loss or gradient norm, update skipped ({self.nonfinite_in_a_row} in a row)")
        return skipped, stop


class StopRequest:
    """SIGTERM or SIGUSR1 (a scheduler's preemption notice) or SIGINT (Ctrl-C) -> checkpoint at the next
    step boundary and stop. A second Ctrl-C stops at once: KeyboardInterrupt, wherever the loop is (a
    checkpoint being written is removed, see Checkpointer.save; the complete ones stay)."""

    def __init__(self, announce: bool = True):
        self.requested = False
        self.interrupted = False  # a first Ctrl-C came
        self.signal_name: Optional[str] = None  # the first signal this process received
        self.announce = announce  # say so on the console (each node's first rank: a terminal's Ctrl-C reaches its node's ranks)

    def __enter__(self) -> "StopRequest":
        self.previous = {}
        for name in STOP_SIGNALS:
            if hasattr(signal, name):
                self.previous[name] = signal.signal(getattr(signal, name), self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for name, handler in self.previous.items():
            signal.signal(getattr(signal, name), handler)

    def requested_on_any_rank(self, fabric: "L.Fabric") -> bool:
        """Whether any rank received a signal (it may reach one of them only). With several processes it waits for
        the GPU: for the start of a run and between validation batches, not for every step (StepFlags carries the
        flag with each step's others)."""
        if fabric.world_size == 1:
            return self.requested
        flag = torch.tensor(float(self.requested), device=fabric.device)
        if fabric.world_size > 1:
            torch.distributed.all_reduce(flag)
        return flag.item() > 0

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.interrupted:
            raise KeyboardInterrupt(
                "a second Ctrl-C: stopped at once, without a checkpoint of this step; the ones saved before are whole: "
                "the same command with --resume auto continues from the newest"
            )
        self.interrupted = self.interrupted or name == "SIGINT"
        self.requested = True
        self.signal_name = self.signal_name or name
        if self.announce and name == "SIGINT":
            # os.write, not print: a handler that prints while the loop prints fails with a reentrant call
            os.write(2, b"\nCtrl-C: stopping with a checkpoint at the end of this step (Ctrl-C again to stop at once, without it)\n")
