"""What the benchmark scripts share: how a GPU time is taken, how a result document is written, and how
--variants (other launch settings to time) are read.

    from common import exit_on_user_error, kernel_ms, out_arg, parse_variants, time_ms, write_result

    fwd_ms = time_ms(lambda: op(*inputs))                        # triton.testing.do_bench: L2 flushed per call
    us = 1e3 * time_ms(lambda: op(*inputs), back_to_back=100)    # 100 calls between two CUDA events
    by_kernel = kernel_ms(fwd_bwd, calls=5)                      # torch.profiler, ms per call by kernel
    parser.add_argument("--out", type=out_arg)                   # a file that cannot be written: refused up front
    write_result(report, args.out, fla_ran=True)                 # print it, write --out atomically
    exit_on_user_error(main)                                     # a mistake in what was given: one line, exit 2
    variants = parse_variants(["wide:dqkw.BV=128"], SHIPPED)     # --variants NAME:KEY=VALUE,... -> launches

A result document is the script's own JSON object with a "run" record in front (the command line, the
date, the fabric-lin commit, the machine and its package versions), so that a file copied into
benchmarks/results/ says by itself how it was made. The scripts run as `python benchmarks/<name>.py`,
which puts this folder on the import path.
"""
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent

# environment variables that change what a benchmark measures, recorded when set
RECORDED_ENV = ("CUDA_VISIBLE_DEVICES", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_INTERPRET")


def time_ms(fn: Callable[[], object], *, back_to_back: Optional[int] = None, grad_to_none: Optional[Sequence] = None,
            warmup: int = 25, rep: int = 100) -> float:
    """Mean GPU milliseconds of one call of `fn`.

    By default `triton.testing.do_bench`: calls for about `warmup` ms, then for about `rep` ms, each timed
    on its own after L2 is flushed and the gradients of `grad_to_none` are dropped. A kernel then reads
    its inputs from memory, as in a training step, where the other layers' work has evicted them.

    back_to_back=N: 5 calls, then N calls issued back to back between two CUDA events, L2 not flushed.
    For kernels of a few tens of microseconds, where do_bench's per-call flush and event pair are a
    large share of what is timed.
    """
    import torch

    if back_to_back is None:
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(back_to_back):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / back_to_back


def kernel_ms(fn: Callable[[], object], *, calls: int = 5, warmup: int = 3) -> Dict[str, float]:
    """GPU milliseconds per call of `fn`, by kernel name (torch.profiler, GPU activity only), largest first.

    `fn` is called `warmup` times unprofiled, so that compilation and autotuning stay out, then `calls`
    times under the profiler. Wall time says how long the host took to launch the kernels as well;
    this says how long the GPU ran them. If `fn` runs a backward pass, it should drop the inputs'
    gradients itself, or the accumulation kernels are counted too."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for event in prof.key_averages():
        # the attribute's name changed between torch versions
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us > 0 and event.count > 0:
            rows[event.key] = device_us / 1e3 / calls
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def _version(*distributions: str) -> Optional[str]:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine(fla_ran: bool = False) -> Dict:
    """The machine and the versions a result depends on. The GPU is asked of torch only where the script
    has imported it already (a CPU benchmark does not pay for importing it)."""
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_available()
    record = {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "cuda": torch.version.cuda if torch is not None else None,
        "triton": _version("triton", "pytorch-triton"),
    }
    if fla_ran:  # the peer's version matters only where it was measured
        fla = sys.modules.get("fla")
        record["fla"] = _version("flash-linear-attention", "fla-core") or getattr(fla, "__version__", None)
    return record


def run_record(fla_ran: bool = False) -> Dict:
    """How this result was made: the command line, the date, the code and the machine."""
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": shlex.join(["python", *sys.argv]),
        "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": None if dirty is None else bool(dirty),
        "machine": machine(fla_ran),
    }


def write_result(report: Dict, out: Optional[str] = None, *, fla_ran: bool = False, indent: int = 1,
                 echo: bool = True) -> Dict:
    """Print `report` with the run record in front, as one JSON document, and write it to `out` if given.

    The file is written under a temporary name in the same folder and renamed over `out` last, so that
    an interrupted run never leaves a half-written result where a complete one is expected.
    fla_ran: flash-linear-attention was measured in this run (its version is then recorded).
    echo: False writes the file without printing (a document rewritten as each of its parts ends)."""
    document = {"run": run_record(fla_ran), **report}
    text = json.dumps(document, indent=indent) + "\n"
    if echo:
        print(text, end="", flush=True)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        umask = os.umask(0)
        os.umask(umask)
        try:
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make the result readable by its writer only
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return document


def shape_arg(text: str) -> tuple:
    """argparse type of a --shapes value, "B,T,H,K,V": five positive integers. A value of another form is refused by
    argparse in one line naming it (exit code 2)."""
    import argparse

    parts = text.split(",")
    if len(parts) != 5 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not B,T,H,K,V (five positive integers, e.g. 16,2048,4,128,256)")
    return tuple(int(part) for part in parts)


def positive_int(text: str) -> int:
    """argparse type of a count (tokens, layers, steps): a whole number of at least 1. Another value is refused by
    argparse in one line naming it (exit code 2), before the model is built."""
    import argparse

    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def out_path_problem(path: str) -> Optional[str]:
    """Why a result file cannot be written at `path` (a directory there, a file where one of its folders would be
    made), or None. Asked before a benchmark's work, which may take hours, rather than when its result is written."""
    from fabric_lin.files import file_in_the_way

    if Path(path).is_dir():
        return f"{path} is a directory, expected a file name"
    blocking = file_in_the_way(Path(path).parent)
    if blocking is not None:
        return f"{path} cannot be written: {blocking} is a file, expected a directory or nothing there"
    return None


def out_arg(text: str) -> str:
    """argparse type of a --out value: a path where a result file can be written. Another is refused by argparse in
    one line naming it (exit code 2)."""
    import argparse

    problem = out_path_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Run `main`; a mistake in what it was given (a missing directory, a value out of range: fabric-lin's
    `UserError`, or a file system error naming its file) ends the script with one line on stderr and exit
    code 2, as the `fabric-lin` command does. Any other error is a bug and keeps its traceback, as does every
    error with FABRIC_LIN_DEBUG=1."""
    try:
        main()
    except Exception as e:
        from fabric_lin.cli import anticipated_cause, debug_enabled

        failure = anticipated_cause(e)
        if failure is None or debug_enabled():
            raise
        print(f"{Path(sys.argv[0]).name}: error: {failure}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def lift_fla_gdn_hopper_guard() -> bool:
    """fla 0.6.0 refuses its gated delta rule's backward pass on Hopper with Triton 3.4 to 3.7.0, whose results
    it says are wrong there. Lifted where fla is only timed or trained beside us as a peer; its output is never
    a reference on such a machine. Returns whether the guard was on."""
    import fla.ops.common.chunk_o as fla_chunk_o

    if getattr(fla_chunk_o, "TRITON_ABOVE_3_7_1", True) is False:
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
        return True
    return False


def parse_variants(texts: Sequence[str], shipped):
    """{name: launch bundle} from --variants "NAME:KEY=VALUE[,KEY=VALUE...]" strings, each a change to the
    `shipped` bundle (fabric_lin.ops.launch.with_settings: "kernel.field" for a KernelLaunch's field). A value
    is an integer, or "None"."""
    from fabric_lin.ops.launch import with_settings

    variants = {}
    for text in texts:
        name, sep, body = text.partition(":")
        if not sep or not body:
            raise SystemExit(f"--variants {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        settings = {}
        for item in body.split(","):
            key, _, value = item.partition("=")
            try:
                settings[key] = None if value == "None" else int(value)
            except ValueError:
                raise SystemExit(f"--variants {name}: {key}={value!r} is not an integer") from None
        try:
            variants[name] = with_settings(shipped, settings)
        except ValueError as e:
            raise SystemExit(f"--variants {name}: {e}") from None
    return variants
