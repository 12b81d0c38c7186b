"""The first training step's Triton kernels compiled before it, by worker processes in parallel.

Triton compiles a kernel at its first launch, in the launching process: a cold start compiles the first step's
kernels one after another (about 20 for gla-340M, 15 s of an H100 machine's 45 s to the first step; the compiles
hold the GIL, so threads do not overlap them). Before the model is built, `precompile_first_step`:

1. finds them: a model of the run's config, cut to one Block of each kind, takes a forward and backward pass on a
   micro-batch of the run's shape with every Triton launch recorded instead of compiled and run (Triton's
   `jit_cache_hook` answering True skips the launch), so the values computed are meaningless and nothing waits for
   a compiler;
2. compiles them: forked worker processes (at most 8, one per spare CPU core) take the kernels in launch order and
   compile each into Triton's cache (`JITFunction.preload` of the specialization the hook was given), while this
   process builds the model and torch.compile traces it;
3. waits where it must: a pre-run hook on each kernel holds its first launch until the workers are done with it,
   which then loads from the cache. A kernel a worker could not compile is compiled at that launch, as without
   this module, after a warning.

The pass touches nothing the run keeps: its model is its own (built with the random generators' states restored
afterwards), its input token ids are constant, and the data loader is not read, so a run with it trains exactly as
one without (the resume guarantee of tests/test_pretrain_resume.py). On the CPU nothing is compiled: the model runs
PyTorch ops there. `--compile.precompile false` leaves every compile to the first launch.
"""
import dataclasses
import multiprocessing
import os
import signal
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from fabric_lin.batches import compute_loss
from fabric_lin.config import Config
from fabric_lin.cpu_cores import usable_cpu_cores

MAX_WORKERS = 8
# A worker that reports nothing for this long is taken for stuck (a compile takes seconds, tens on a busy CPU): the
# launches stop waiting for it and compile what is left themselves.
STALL_S = 180.0


@dataclasses.dataclass
class FoundKernel:
    """One specialization of a Triton kernel that a launch asked to compile."""

    fn: Any  # the triton.runtime.jit.JITFunction
    device: int  # the device index the launch ran on
    specialization: str  # Triton's serialized form of it, what JITFunction.preload takes
    name: str  # module.function, for messages


def precompile_supported() -> Optional[str]:
    """None where this Triton has what the precompile uses (knobs.runtime.jit_cache_hook, JITFunction.preload and
    pre-run hooks: Triton 3.4 on) and processes can be forked; else why not, in a few words."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError as error:
        return f"Triton does not import ({error})"
    if not hasattr(getattr(knobs, "runtime", None), "jit_cache_hook"):
        return "this Triton has no knobs.runtime.jit_cache_hook"
    if not all(hasattr(JITFunction, name) for name in ("preload", "add_pre_run_hook")):
        return "this Triton's JITFunction has no preload or add_pre_run_hook"
    if "fork" not in multiprocessing.get_all_start_methods():
        return "this platform cannot fork processes"
    return None


@contextmanager
def launches_recorded(found: List[FoundKernel]):
    """Inside, every Triton kernel launch that would compile a kernel is recorded in `found` (each specialization
    once, in launch order) and skipped: neither compiled nor run. Launches of kernels this process has already
    compiled run as usual."""
    from triton import knobs

    seen = set()

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        kernel = fn.jit_function
        if (id(kernel), str(key)) not in seen:
            seen.add((id(kernel), str(key)))
            found.append(FoundKernel(kernel, compile["device"], compile["specialization_data"],
                                     f"{fn.module}.{fn.name}"))
        return True  # Triton returns before compiling, and the launch returns without running

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        yield found
    finally:
        knobs.runtime.jit_cache_hook = previous


def one_block_of_each_kind(config: Config) -> Config:
    """The config with one Block of each kind its layers have, in the order they first appear: every Block is
    called alike (the first one too: its residual delta is zeros), so one of each kind launches every kernel
    specialization the whole model's layers do."""
    kinds = ["attention" if config.block_type == "transformer" or i in config.attn_layers else config.block_type
             for i in range(config.num_layers)]
    kept = list(dict.fromkeys(kinds))
    attn_layers = [i for i, kind in enumerate(kept) if kind == "attention" and config.block_type != "transformer"]
    return dataclasses.replace(config, num_layers=len(kept), attn_layers=attn_layers)


def find_kernels(model: torch.nn.Module, input_ids: torch.Tensor, eos_id: Optional[int],
                 forward_context: Callable = torch.enable_grad) -> Tuple[List[FoundKernel], Optional[Exception]]:
    """The Triton kernels a training micro-batch of `input_ids`' shape launches through `model` (forward under
    `forward_context()`, then backward), found without compiling or running any (`launches_recorded`). The
    model's gradients are left as they were. A pass that fails part way (its values are garbage: a launch
    computed nothing) returns the kernels found until then, with the error: (kernels, error or None)."""
    found: List[FoundKernel] = []
    grads = [p.grad for p in model.parameters()]
    error = None
    try:
        with launches_recorded(found):
            with forward_context():
                loss = compute_loss(model, input_ids, input_ids, eos_id)
            loss.backward()
    except Exception as e:  # a launch skipped upstream can trip a check downstream: what was found still holds
        error = e
    finally:
        for p, grad in zip(model.parameters(), grads):
            p.grad = grad
    return found, error


def _compile_taken_kernels(kernels: List[FoundKernel], next_index, results) -> None:
    """A worker (a forked child): take the next kernel no worker has taken, compile it into Triton's cache, report
    ("started", i, None), then (i, None or the error, the time it ended); until none is left."""
    from triton.runtime.driver import driver

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ends it when the training process ends (daemon) or is stopped
    try:
        forked = _DeviceOf(driver.active)
        driver.set_active(forked)
    except RuntimeError:  # no active driver: each compile fails and says so
        forked = _DeviceOf(None)
    while True:
        with next_index.get_lock():
            i = next_index.value
            next_index.value = i + 1
        if i >= len(kernels):
            break
        results.send(("started", i, None))
        forked.device = kernels[i].device
        try:
            kernels[i].fn.preload(kernels[i].specialization)
        except Exception as e:
            results.send((i, _first_line(e), time.time()))
        else:
            results.send((i, None, time.time()))
    results.close()


class _DeviceOf:
    """The driver a forked worker compiles with: the training process's, except for the current device, which the
    worker may not ask CUDA for (CUDA refuses a forked child) and is the launch's own. Compiling needs no device."""

    def __init__(self, active):
        self._active, self.device = active, 0

    def get_current_device(self):
        return self.device

    def __getattr__(self, name):
        return getattr(self._active, name)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


class Precompile:
    """Worker processes compiling `kernels` into Triton's cache, started at once; each kernel's first launch in this
    process waits until the workers are done with it (a pre-run hook, removed once it has waited). `log` takes the
    one-line warnings (a kernel that failed, a worker that ended early or stalled) and, once every worker is done,
    a summary."""

    def __init__(self, kernels: List[FoundKernel], workers: int, log: Callable[[str], None] = print,
                 stall_s: float = STALL_S):
        self.kernels, self.log, self.stall_s = kernels, log, stall_s
        self.unfinished = set(range(len(kernels)))  # neither compiled nor failed nor given up
        self.started_by: Dict[int, int] = {}  # kernel index -> the worker compiling it
        self.failed: Dict[int, str] = {}
        self.compiled, self.last_done = 0, None
        self.lock = threading.RLock()  # the backward pass's launches come from autograd's threads
        self.start = time.time()
        context = multiprocessing.get_context("fork")  # the kernels are this process's objects: nothing to pickle
        next_index = context.Value("i", 0)
        self.workers, self.readers = [], {}
        for w in range(workers):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=_compile_taken_kernels, args=(kernels, next_index, writer),
                                      name=f"fabric-lin precompile {w}", daemon=True)
            process.start()
            writer.close()
            self.workers.append(process)
            self.readers[reader] = w
        self.hooks = {}
        for kernel in kernels:
            if id(kernel.fn) not in self.hooks:
                self.hooks[id(kernel.fn)] = (kernel.fn, self._hook(kernel.fn))
                kernel.fn.add_pre_run_hook(self.hooks[id(kernel.fn)][1])

    def _hook(self, fn) -> Callable:
        def wait_before_first_launch(*args, **kwargs):
            self.wait_for(fn)
        return wait_before_first_launch

    def wait_for(self, fn=None) -> None:
        """Return once the workers are done with every specialization of kernel `fn` (None: of every kernel):
        each compiled, failed, or given up (left to its launch); fn's pre-run hook (None: every one) is removed."""
        with self.lock:
            if self.readers:  # what has come, of any kernel: the summary must not wait for a launch that never comes
                self._receive(0)
            while self.readers and any(fn is None or self.kernels[i].fn is fn for i in self.unfinished):
                if not self._receive(self.stall_s):
                    self.log(f"Warning: the processes precompiling Triton kernels reported nothing for "
                             f"{self.stall_s:.0f} s; {len(self.unfinished)} kernel(s) left to compile at their first "
                             "launch")
                    self._end_workers()
            for key in list(self.hooks) if fn is None else [id(fn)]:
                if key in self.hooks:
                    kernel_fn, hook = self.hooks.pop(key)
                    # a new list: the launch that runs this hook iterates over the old one
                    kernel_fn.pre_run_hooks = [h for h in kernel_fn.pre_run_hooks if h is not hook]
            if not self.unfinished and self.workers:
                self._finish()

    def _receive(self, timeout: float) -> bool:
        """Read the workers' reports, waiting up to `timeout` s for the first; False where none came."""
        ready = wait_for_any(list(self.readers), timeout)
        for reader in ready:
            worker = self.readers[reader]
            try:
                while True:
                    what, detail, done_at = reader.recv()
                    if what == "started":
                        self.started_by[detail] = worker
                    else:
                        self.unfinished.discard(what)
                        self.last_done = done_at
                        self.compiled += detail is None
                        if detail is not None:
                            self.failed[what] = detail
                            self.log(f"Warning: precompiling Triton kernel {self.kernels[what].name} failed "
                                     f"({detail}); it compiles at its first launch")
                    if not reader.poll():
                        break
            except (EOFError, OSError):  # the worker has ended
                del self.readers[reader]
                self._worker_ended(worker)
        return bool(ready)

    def _worker_ended(self, worker: int) -> None:
        """A worker's pipe closed: it took no more kernels, or died, leaving what it had started to the launches."""
        process = self.workers[worker]
        process.join(timeout=10)
        lost = sorted(i for i in self.unfinished if self.started_by.get(i) == worker)
        if process.exitcode != 0 or lost:
            names = ", ".join(self.kernels[i].name for i in lost) or "none"
            self.log(f"Warning: a process precompiling Triton kernels ended with exit code {process.exitcode} "
                     f"(kernels it left: {names}); they compile at their first launch")
        self.unfinished.difference_update(lost)
        if not self.readers:  # no worker left to take the kernels not started
            self.unfinished.clear()

    def _finish(self) -> None:
        """Every kernel is done with: read the workers' ends and say what was compiled."""
        deadline = time.time() + 10
        while self.readers and time.time() < deadline:
            self._receive(max(0.0, deadline - time.time()))
        took = f", {self.last_done - self.start:.1f} s" if self.last_done is not None else ""
        self.log(f"Precompiled {self.compiled} of the first step's {len(self.kernels)} Triton kernels in "
                 f"{len(self.workers)} process{'es' * (len(self.workers) != 1)}{took}")
        self._end_workers()

    def _end_workers(self) -> None:
        for process in self.workers:
            if process.is_alive():
                process.terminate()
            process.join(timeout=10)
        self.readers.clear()
        self.unfinished.clear()
        self.workers = []


def precompile_workers(kernels: int, processes_per_node: int = 1) -> int:
    """Worker processes for `kernels` kernels: one per CPU core of this process's share of the node's cores beyond
    the one it runs on, at most MAX_WORKERS, at least one."""
    share = usable_cpu_cores() // max(1, processes_per_node)
    return max(1, min(MAX_WORKERS, share - 1, kernels))


def precompile_first_step(fabric, config: Config, model_options: Dict[str, Any], micro_batch_size: int, seq_len: int,
                          eos_id: Optional[int], log: Callable[[str], None] = print) -> Optional[Precompile]:
    """On a CUDA device with the fused kernels: find the first training step's Triton kernels and start compiling
    them in worker processes (this module's docstring); None where there is nothing to do. Each of a node's
    processes finds them all and compiles its share, by local rank, into the cache they share."""
    if fabric.device.type != "cuda" or not model_options.get("fused"):
        return None
    unsupported = precompile_supported()
    if unsupported:
        log(f"Note: the first step's Triton kernels compile at their first launch, one after another "
            f"(compile.precompile: {unsupported})")
        return None
    from fabric_lin.model import GPT

    # one document per row (no EOS), int64 as the loop's batches
    input_ids = torch.full((micro_batch_size, seq_len), int(eos_id == 0), dtype=torch.int64, device=fabric.device)
    with torch.random.fork_rng(devices=[fabric.device]):  # the model's initialisation draws from them
        with fabric.init_tensor():
            model = GPT(one_block_of_each_kind(config), **model_options)
        kernels, error = find_kernels(model, input_ids, eos_id, fabric.autocast)
    del model, input_ids
    torch.cuda.empty_cache()  # the pass's memory back to the device, and its peak out of the run's figures
    torch.cuda.reset_peak_memory_stats(fabric.device)
    if error is not None:
        log(f"Warning: the pass that finds the first step's Triton kernels stopped early ({_first_line(error)}); "
            f"{len(kernels)} found before it are precompiled")
    processes = fabric.world_size // max(1, getattr(fabric.strategy, "num_nodes", 1))
    kernels = kernels[fabric.local_rank % processes::processes]
    if not kernels:
        return None
    workers = precompile_workers(len(kernels), processes)
    log(f"Compiling the first step's {len(kernels)} Triton kernels in {workers} background process"
        f"{'es' * (workers != 1)} (--compile.precompile false: each at its first launch instead)")
    return Precompile(kernels, workers, log)
