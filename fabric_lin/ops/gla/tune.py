"""Opt-in search over the GLA kernels' launch settings (`GLALaunch` in launch.py).

The shipped settings need no search, so nothing is timed at start-up. `tune_launch` is for those who want
the last few percent on a new GPU or layer shape: it times forward+backward at one shape for each setting
of SEARCH_SPACE and returns the fastest whose output and gradients agree with those of the starting
settings (the shipped ones unless given). It changes no module state: the caller passes the result on
(`chunk_gla(..., launch=...)`, `GPT(config, fused=True, gla_launch=...)`).

The settings act mostly on separate kernels (state passes, output, dv, dq/dk) whose times add up, so each
group is searched exhaustively with the others held, and the groups are swept again until nothing
improves: close to the best of the full product of every setting, at a fraction of its cost.

Results are keyed by what decides the kernels' code and tiling - GPU, dtype, heads, key and value dims,
Triton version - and not by batch size or sequence length: a run with a new batch size or context reuses
the settings found (`cache_file`), it does not search again.
"""
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
import triton

from fabric_lin.ops.gla import chunk
from fabric_lin.ops.gla.launch import SHIPPED, GLALaunch
from fabric_lin.ops.launch import with_settings

# one group per kernel; within a group every combination is tried. Keys are GLALaunch fields, "kernel.field"
# for a KernelLaunch's. Left out: settings that only ever lost on an H200 (register caps on dq/dk and the
# output kernel, a second pipeline stage for dq/dk).
SEARCH_SPACE: List[Dict[str, tuple]] = [
    # sequential state passes; narrow tiles give a long single sequence (few heads) more programs
    {"state.BK": (64, 32), "state.BV": (64, 128, 32), "state.warps": (None, 4, 8)},
    {"output.warps": (8, 4, 16), "output.BV": (128, 256)},
    {"dv.warps": (4, 8), "dv.maxnreg": (168, 0)},
    {"dqk.warps": (8, 4, 16), "dqk_single_warps": (4, 8)},
    # 32-wide key tiles give the output kernel and dq/dk twice the programs, each holding smaller tiles
    {"output.BK": (64, 32)},
    {"dqk.BK": (64, 32)},
    {"output.stages": (1, 2), "dv.stages": (1, 2)},
]


def launch_key(H: int, K: int, V: int, dtype: torch.dtype, device: torch.device) -> str:
    """What the result depends on; batch size and sequence length are left out on purpose."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}|{dtype}|H={H}|K={K}|V={V}|triton={triton.__version__}"


def _combinations(group: Dict[str, tuple]) -> List[Dict]:
    combos = [{}]
    for key, values in group.items():
        combos = [dict(c, **{key: v}) for c in combos for v in values]
    return combos


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS difference of x from ref (in fp32)."""
    x, ref = x.float(), ref.float()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def tune_launch(
    B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
    start: GLALaunch = SHIPPED, max_rel_error: float = 0.02, max_rounds: int = 2,
    log: Callable[[str], None] = print, bench: Optional[Callable] = None,
) -> Dict[str, Any]:
    """Search the launch settings at shape (B, T, H, K, V) from `start`: {"launch" (a GLALaunch),
    "fwd_bwd_ms", "start_fwd_bwd_ms", "tried"}. A setting whose output or any gradient is further than
    max_rel_error (relative RMS) from `start`'s is rejected, as is one that fails to compile.
    `bench(fn, leaves)` gives fn's milliseconds (default: triton.testing.do_bench)."""
    if bench is None:
        from triton.testing import do_bench

        def bench(fn, leaves):
            return do_bench(fn, warmup=10, rep=40, grad_to_none=leaves)

    torch.manual_seed(0)
    q, k = (torch.randn(B, T, H, K, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, device=device, dtype=dtype, requires_grad=True)
    gk = (F.logsigmoid(torch.randn(B, T, H, K, device=device)) / 16).requires_grad_(True)
    do = torch.randn(B, T, H, V, device=device, dtype=dtype)
    leaves = [q, k, v, gk]

    def outputs(launch):
        for x in leaves:
            x.grad = None
        o, _ = chunk.chunk_gla_triton(q, k, v, gk, launch=launch)
        o.backward(do)
        return [o.detach()] + [x.grad for x in leaves]

    reference = outputs(start)
    tried = []

    def measure(launch: GLALaunch, changes: Dict) -> Optional[float]:
        try:
            errors = [rel_rms(x, ref) for x, ref in zip(outputs(launch), reference)]
            worst = max(errors)
            if not worst <= max_rel_error:  # also rejects NaN
                tried.append({"changes": changes, "rejected": f"relative RMS error {worst:.3g} > {max_rel_error}"})
                return None
            ms = bench(lambda: chunk.chunk_gla_triton(q, k, v, gk, launch=launch)[0].backward(do), leaves)
        except Exception as e:  # shared memory or registers exceeded: not a candidate
            tried.append({"changes": changes, "rejected": f"{type(e).__name__}: {str(e)[:200]}"})
            return None
        tried.append({"changes": changes, "fwd_bwd_ms": ms})
        return ms

    best, best_changes = start, {}
    best_ms = measure(start, {})
    if best_ms is None:
        raise RuntimeError(f"the starting launch settings do not run at shape {(B, T, H, K, V)}: {tried[-1]}")
    start_ms = best_ms
    for _ in range(max_rounds):
        improved = False
        for group in SEARCH_SPACE:
            for change in _combinations(group):
                candidate = with_settings(best, change)
                if candidate == best:
                    continue
                ms = measure(candidate, dict(best_changes, **change))
                if ms is not None and ms < best_ms:
                    best, best_ms, improved = candidate, ms, True
                    best_changes = dict(best_changes, **change)
        if not improved:
            break
    log(f"GLA launch search at {(B, T, H, K, V)} {dtype}: {len(tried)} settings, forward+backward "
        f"{start_ms:.3f} ms -> {best_ms:.3f} ms with {best_changes or 'the settings unchanged'}")
    return {"launch": best, "fwd_bwd_ms": best_ms, "start_fwd_bwd_ms": start_ms, "tried": tried}


def tuned_launch(
    B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, cache_file: Optional[Path] = None,
    device: str = "cuda", log: Callable[[str], None] = print, **search,
) -> GLALaunch:
    """The launch settings for (H, K, V, dtype) on this GPU: read from cache_file when it holds this key,
    searched (tune_launch at B, T) and written there otherwise."""
    key = launch_key(H, K, V, dtype, torch.device(device))
    cached = {}
    if cache_file is not None and Path(cache_file).exists():
        try:
            cached = json.loads(Path(cache_file).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cache_file}: not a JSON launch cache ({e}); delete it to search again") from e
        if not isinstance(cached, dict):
            raise ValueError(f"{cache_file}: expected a JSON object of launch settings by key; delete it to search again")
    if key in cached:
        launch = GLALaunch.from_dict(cached[key], source=f"{cache_file} entry {key!r} (delete it to search again)")
        log(f"GLA launch settings for {key} from {cache_file}")
        return launch
    launch = tune_launch(B, T, H, K, V, dtype, device, log=log, **search)["launch"]
    if cache_file is not None:
        cached[key] = dataclasses.asdict(launch)
        Path(cache_file).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{cache_file}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1) + "\n")
        tmp.replace(cache_file)  # atomic: a reader never sees half a file
    return launch
