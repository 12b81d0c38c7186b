"""fabric_lin.precompile: the first step's Triton kernels found by a pass whose launches are recorded instead of run,
and compiled by worker processes before their first launch.

Without a GPU, the pass runs in a process of its own (tests/precompile_child.py) with compiled (not interpreted)
Triton functions and benchmarks/kernel_registers.py's compile-only driver, and its workers compile for real (an
H100's target, with Triton's ptxas). The reference for which kernels a training step launches is Triton's
interpreter running the step. On a GPU, a step after the precompile must compile none of the kernels again.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.precompile import FoundKernel, Precompile, one_block_of_each_kind, precompile_first_step, precompile_workers
from helpers import REPO

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CHILD = REPO / "tests" / "precompile_child.py"


def run_child(mode: str, spec: dict, tmp_path, timeout: float = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(CHILD), mode, json.dumps(spec)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- which kernels


@pytest.mark.parametrize("layers, attn_layers, kept, kept_attn", [
    (4, [], 1, []),
    (6, [1, 4], 2, [1]),  # gla, attention
    (6, [0, 3], 2, [0]),  # attention first
])
def test_one_block_of_each_kind(layers, attn_layers, kept, kept_attn):
    config = Config(**{**Config.from_name("gla-debug").to_dict(), "num_layers": layers, "attn_layers": attn_layers,
                       "attn_num_heads": 2 if attn_layers else None})
    cut = one_block_of_each_kind(config)
    assert (cut.num_layers, cut.attn_layers) == (kept, kept_attn)
    assert {**cut.to_dict(), "num_layers": None, "attn_layers": None} == {**config.to_dict(), "num_layers": None, "attn_layers": None}
    transformer = one_block_of_each_kind(Config.from_name("transformer-debug"))
    assert (transformer.num_layers, transformer.attn_layers) == (1, [])


def test_launches_are_recorded_inside_only_and_the_hook_before_is_put_back():
    """Triton's jit_cache_hook answering True skips a launch: left set after the pass, every kernel of the run would
    be skipped (its outputs garbage). Whatever ends the pass, the hook set before it is back."""
    pytest.importorskip("triton")
    from triton import knobs

    from fabric_lin.precompile import launches_recorded

    def earlier(**kwargs):  # another user's hook, set before the pass
        return False

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = earlier
    try:
        with launches_recorded([]):
            assert knobs.runtime.jit_cache_hook is not earlier
        assert knobs.runtime.jit_cache_hook is earlier
        with pytest.raises(ValueError):
            with launches_recorded([]):
                raise ValueError("a check downstream of a skipped launch")
        assert knobs.runtime.jit_cache_hook is earlier
    finally:
        knobs.runtime.jit_cache_hook = before


# the models whose kernels `find` is asked for: every kind of block (test_one_block_of_each_kind_launches_every_...),
# and the training step the interpreter runs (test_found_kernels_are_those_the_interpreter_runs_in_a_training_step)
EVERY_KIND = [{"model": "gla-debug"},
              {"model": "gla-debug", "config": {"attn_layers": [1, 3], "attn_num_heads": 2}},
              {"model": "gdn-debug"},
              {"model": "deltanet-debug", "eos_id": 2},  # packed documents: the varlen kernels
              {"model": "transformer-debug"}]
TRAINING_STEP = {"model": "gla-debug", "config": {"num_layers": 2}, "batch": 2, "seq": 128}


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> list:
    """What `find` returns for EVERY_KIND and TRAINING_STEP, in that order, from one child process (its imports of
    torch, Triton and fabric-lin, about 2.5 s, paid once)."""
    return run_child("find", [*EVERY_KIND, TRAINING_STEP], tmp_path_factory.mktemp("find"))


@pytest.mark.slow
def test_one_block_of_each_kind_launches_every_kernel_of_the_whole_model(found):
    for spec, kinds in zip(EVERY_KIND, found):
        assert kinds["kernels"], f"no Triton kernel found: {spec}"
        assert {tuple(k) for k in kinds["kernels"]} == {tuple(k) for k in kinds["whole_model"]}, spec
        assert len({tuple(k) for k in kinds["kernels"]}) == len(kinds["kernels"])  # each specialization once


@pytest.mark.slow
def test_found_kernels_are_those_the_interpreter_runs_in_a_training_step(found):
    """The pass skips every launch (its tensors hold garbage); Triton's interpreter runs the same step for real."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the reference runs in Triton's interpreter (no GPU)")
    from triton.runtime import interpreter

    from fabric_lin.model import GPT

    step = found[len(EVERY_KIND)]
    launched = []
    run_grid = interpreter.GridExecutor.__call__

    def recorded(self, *args, **kwargs):
        launched.append(f"{self.fn.__module__}.{self.fn.__qualname__}")
        return run_grid(self, *args, **kwargs)

    config = Config(**{**Config.from_name(TRAINING_STEP["model"]).to_dict(), **TRAINING_STEP["config"]})
    model = GPT(config, fused=True)
    input_ids = torch.full((TRAINING_STEP["batch"], TRAINING_STEP["seq"]), 1, dtype=torch.int64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.GridExecutor, "__call__", recorded)
        model(input_ids, targets=input_ids).backward()
    assert len(set(launched)) >= 8
    assert {name for name, _ in step["kernels"]} == set(launched)


# ---------------------------------------------------------------- the workers


@pytest.mark.slow
def test_workers_compile_into_the_cache_a_launch_reads(tmp_path):
    names = ["_norm_fwd_kernel", "_swiglu_fwd_kernel"]
    result = run_child("compile", {"model": "gla-debug", "kernels": names, "workers": 2}, tmp_path)
    assert sorted({name.rsplit(".", 1)[1] for name in result["names"]}) == names
    assert result["hooked"] and result["hooks_left"] == 0
    assert len(result["entries"]) == len(result["names"])  # one cache entry per specialization
    assert result["entries_after_this_process"] == result["entries"]  # this process compiled nothing anew
    assert result["log"] == [f"Precompiled {len(result['names'])} of the first step's {len(result['names'])} Triton "
                             f"kernels in 2 processes, {result['log'][0].rsplit(', ', 1)[1]}"]


class StandIn:
    """A kernel as the workers see one: `preload(specialization)` compiles it (here: does what the text says) and
    `pre_run_hooks` run before each launch."""

    def __init__(self, marks):
        self.pre_run_hooks, self.marks = [], marks

    def add_pre_run_hook(self, hook):
        self.pre_run_hooks.append(hook)

    def preload(self, specialization: str):
        what, _, arg = specialization.partition(":")
        if what == "sleep":
            time.sleep(float(arg))
        elif what == "fail":
            raise ValueError(arg)
        elif what == "exit":
            os._exit(int(arg))
        (self.marks / specialization.replace(":", "-")).touch()  # in the worker: seen here through the file


def stand_in_kernels(tmp_path, *specializations):
    fn = StandIn(tmp_path)
    return fn, [FoundKernel(fn, 0, s, f"stand_in.kernel_{i}") for i, s in enumerate(specializations)]


def test_a_first_launch_waits_for_its_kernel_and_then_drops_the_hook(tmp_path):
    fn, kernels = stand_in_kernels(tmp_path, "sleep:0.5")
    logged = []
    precompile = Precompile(kernels, 1, log=logged.append)
    assert len(fn.pre_run_hooks) == 1
    fn.pre_run_hooks[0]("launch", "arguments", num_warps=4)  # as JITFunction.run calls it
    assert (tmp_path / "sleep-0.5").exists()
    assert fn.pre_run_hooks == [] and precompile.workers == []
    assert logged[0].startswith("Precompiled 1 of the first step's 1 Triton kernels in 1 process, ")


def test_a_kernel_that_fails_to_compile_is_a_warning_and_the_others_compile(tmp_path):
    fn, kernels = stand_in_kernels(tmp_path, "fail:no such intrinsic", "sleep:0")
    logged = []
    Precompile(kernels, 2, log=logged.append).wait_for(None)
    assert (tmp_path / "sleep-0").exists()
    assert logged[0] == ("Warning: precompiling Triton kernel stand_in.kernel_0 failed (ValueError: no such intrinsic); "
                         "it compiles at its first launch")
    assert logged[1].startswith("Precompiled 1 of the first step's 2 Triton kernels in 2 processes")
    assert fn.pre_run_hooks == []


def test_a_worker_that_dies_is_a_warning_and_another_takes_the_rest(tmp_path):
    fn, kernels = stand_in_kernels(tmp_path, "exit:3", "sleep:0.2", "sleep:0.3", "sleep:0.4")
    logged = []
    Precompile(kernels, 2, log=logged.append).wait_for(None)
    assert all((tmp_path / f"sleep-0.{i}").exists() for i in (2, 3, 4))
    assert logged[0] == ("Warning: a process precompiling Triton kernels ended with exit code 3 (kernels it left: "
                         "stand_in.kernel_0); they compile at their first launch")
    assert logged[1].startswith("Precompiled 3 of the first step's 4 Triton kernels in 2 processes")


def test_a_stalled_worker_is_ended_and_the_launch_goes_on(tmp_path):
    fn, kernels = stand_in_kernels(tmp_path, "sleep:60")
    logged = []
    precompile = Precompile(kernels, 1, log=logged.append, stall_s=1)
    start = time.time()
    precompile.wait_for(None)
    assert time.time() - start < 30
    assert logged == ["Warning: the processes precompiling Triton kernels reported nothing for 1 s; 1 kernel(s) left "
                      "to compile at their first launch"]
    assert fn.pre_run_hooks == [] and precompile.workers == []


def test_a_launch_whose_worker_died_goes_on_at_once_and_the_other_kernels_still_wait(tmp_path):
    """Two kernels of their own: the worker compiling the first dies. Its launch goes on once the worker is gone (it
    compiles the kernel itself), not after the other worker's compile; the other kernel's launch still waits for it."""
    dying, slow = StandIn(tmp_path), StandIn(tmp_path)
    kernels = [FoundKernel(dying, 0, "exit:3", "stand_in.dying"), FoundKernel(slow, 0, "sleep:20", "stand_in.slow")]
    logged = []
    precompile = Precompile(kernels, 2, log=logged.append)
    try:
        start = time.time()
        dying.pre_run_hooks[0]("launch")
        assert time.time() - start < 10
        assert dying.pre_run_hooks == [] and len(slow.pre_run_hooks) == 1
        assert logged == ["Warning: a process precompiling Triton kernels ended with exit code 3 (kernels it left: "
                          "stand_in.dying); they compile at their first launch"]
    finally:
        precompile._end_workers()


def test_a_worker_that_ends_before_taking_every_kernel_names_the_one_it_left_and_the_summary_comes(tmp_path):
    """The one worker ends (exit code 0) inside the first kernel's compile: that kernel is named, whatever the exit
    code, and the second, which no worker is left to take, is its launch's to compile; every kernel is done with."""
    fn, kernels = stand_in_kernels(tmp_path, "exit:0", "sleep:0")
    logged = []
    precompile = Precompile(kernels, 1, log=logged.append)
    fn.pre_run_hooks[0]("launch")
    assert logged == ["Warning: a process precompiling Triton kernels ended with exit code 0 (kernels it left: "
                      "stand_in.kernel_0); they compile at their first launch",
                      "Precompiled 0 of the first step's 2 Triton kernels in 1 process"]
    assert precompile.workers == [] and not (tmp_path / "sleep-0").exists()


def test_the_summary_comes_at_a_launch_of_a_kernel_already_compiled(tmp_path):
    """Kernels y (two specializations), x and z, compiled in the order y, x, y, z. y's launch waits for both of y's, x's
    report with them. Once z is compiled too, x's launch comes: every kernel is done, and the summary is said then,
    not at z's launch, which may never come (a specialization the run's step does not launch)."""
    y, x, z = StandIn(tmp_path), StandIn(tmp_path), StandIn(tmp_path)
    kernels = [FoundKernel(y, 0, "sleep:0", "stand_in.y"), FoundKernel(x, 0, "sleep:0.0", "stand_in.x"),
               FoundKernel(y, 0, "sleep:0.3", "stand_in.y"), FoundKernel(z, 0, "sleep:1", "stand_in.z")]
    logged = []
    precompile = Precompile(kernels, 1, log=logged.append)
    y.pre_run_hooks[0]("launch")
    assert logged == [] and len(z.pre_run_hooks) == 1
    # z compiled and its report sent: the worker, with no kernel left to take, has ended
    precompile.workers[0].join(timeout=30)
    assert (tmp_path / "sleep-1").exists() and precompile.workers[0].exitcode == 0
    x.pre_run_hooks[0]("launch")
    assert len(logged) == 1 and logged[0].startswith("Precompiled 4 of the first step's 4 Triton kernels in 1 process, ")
    assert precompile.workers == []


def test_workers_one_per_spare_core_at_most_eight(monkeypatch):
    import fabric_lin.precompile as precompile

    monkeypatch.setattr(precompile, "usable_cpu_cores", lambda: 16)
    assert [precompile_workers(n) for n in (1, 5, 19)] == [1, 5, 8]
    assert precompile_workers(19, processes_per_node=8) == 1  # 2 cores each: one runs the rank
    monkeypatch.setattr(precompile, "usable_cpu_cores", lambda: 1)
    assert precompile_workers(19) == 1


def test_nothing_is_done_on_the_cpu(capsys):
    import lightning_fabric as L

    fabric = L.Fabric(accelerator="cpu", devices=1)
    assert precompile_first_step(fabric, Config.from_name("gla-debug"), {"fused": False}, 2, 64, None) is None
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------- on a GPU


@needs_cuda
def test_a_step_after_the_precompile_compiles_none_of_the_kernels_again(tmp_path):
    result = run_child("gpu", {"model": "gla-debug", "batch": 4, "seq": 256}, tmp_path)
    assert result["same_rng"]
    assert result["found"] >= 10 and len(result["precompiled"]) == result["found"]
    assert result["log"][0].startswith(f"Compiling the first step's {result['found']} Triton kernels in ")
    assert result["log"][-1].startswith(f"Precompiled {result['found']} of the first step's {result['found']} Triton kernels")
    for mode in ("eager", "compiled"):
        assert result[mode]["new"] == [], mode
        assert result[mode]["loss"] == pytest.approx(8.3, abs=0.5)  # ln(4096) = 8.32: the kernels ran
