"""fabric_lin/parallelism.py: the model sharded with FSDP2. Built on the meta device and sharded over 4 CPU processes
(a (2, 2) mesh of two nodes, Blocks as units; one node of 4, the whole model one unit), it starts from the weights of
one process with the same seed, bit for bit, each process holding its share, and validates a split whose last batch
is short (padded, an empty one too) to one process's loss. In one process (a mesh of one): each unit gathers and
frees its weights as asked, and validation leaves them sharded; Blocks wrapped for activation checkpointing and
compiled train under FSDP2 as without it; fused AdamW skips an update on sharded weights as the loop asks; bf16-mixed
gathers bf16 weights, keeps fp32 shards and gradients and reduces in fp32; FP8-converted layers gather their weights
in FP8 where asked; a parameter that no reset_parameters() initialises is refused. The strategy for each choice (one process on each of several nodes too), its timeout, and FSDP's mesh of nodes; 16-mixed
refused in one line; the errors of a lost peer told from others. A rank that Fabric's launcher started ends when the
rank that started it is gone before the rendezvous ends, and only then; the launching rank names itself to them.

Run as a script (`python tests/test_parallelism.py OUT_DIR`), this file is the 4-process job that shards the model and
writes what each layout's processes hold."""
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fabric_lin.args import ParallelismArgs
from fabric_lin.config import Config
from fabric_lin.model import GPT, Block
from fabric_lin.parallelism import parallelize
from fabric_lin.weights import canonical_name
from helpers import cli_error, free_port

SEED = 42
# The job validates each layout on a split of 116 blocks of 17 tokens (2 chunk files of 58) in micro batches of 3: the
# last of its global batches of 12 holds 8 blocks, so process 2 validates a short micro batch and process 3 an empty one
VAL_BLOCK, VAL_MICRO_BATCH, VAL_TOKENS = 17, 3, 2000
# (nodes, Fabric's world size, parallelism) of the job's layouts
LAYOUTS = {
    "2x2-block": (2, ParallelismArgs(fsdp_unit="block")),
    "1x4-model": (1, ParallelismArgs(fsdp_unit="model", fsdp_reshard_after_forward=False)),
}


def config() -> Config:
    return Config.from_name("gla-debug")


class ProcessGroupFabric:
    """What pretrain's validate asks of Fabric: the device, the number of processes, and a sum over them
    (torch.distributed's processes)."""

    device = torch.device("cpu")

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "sum"
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor


def validation_run(loader, micro_batch_size: int, max_iters: int):
    """What pretrain's validate reads of its run: the validation batches and their size, and how many optimizer
    steps' worth to read, one micro batch per process each; no stop asked for."""
    from types import SimpleNamespace

    from fabric_lin.args import EvalArgs, TrainArgs
    from fabric_lin.stopping import StopRequest

    return SimpleNamespace(val_dataloader=loader, eval=EvalArgs(max_iters=max_iters), accumulation=1,
                           train=TrainArgs(micro_batch_size=micro_batch_size), cuda_graphs=False,
                           eos_id=None, stop=StopRequest())


# ---------------------------------------------------------------- the job: 4 CPU processes


def _shard_worker(rank: int, world_size: int, out_dir: str, port: int) -> None:
    """Each layout: the model built on the meta device, the generator seeded as pretrain seeds it, sharded by
    `parallelize` (given a mesh as Fabric's ModelParallelStrategy makes it: every rank data-parallel), then validated
    on the whole split of out_dir/val; rank 0 writes the gathered weights, how many of their elements it holds itself
    and the validation's (loss, tokens)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fabric_lin.data.sample_order import ValidationLoader
    from fabric_lin.pretrain import validate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fabric_mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    for name, (nodes, parallelism) in LAYOUTS.items():
        with torch.device("meta"):
            model = GPT(config())
        torch.manual_seed(SEED)
        model = parallelize(model, fabric_mesh, num_nodes=nodes, parallelism=parallelism, precision="32-true")
        gathered = {n: p.full_tensor() for n, p in model.named_parameters()}
        held = sum(p.to_local().numel() for p in model.parameters())
        loader = ValidationLoader(Path(out_dir) / "val", VAL_BLOCK, VAL_MICRO_BATCH, num_workers=0)
        validation = validate(ProcessGroupFabric(), model, validation_run(loader, VAL_MICRO_BATCH, max_iters=100))
        if rank == 0:
            torch.save({"weights": gathered, "held": held, "validation": validation}, Path(out_dir) / f"{name}.pth")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    import numpy as np

    import fabric_lin_process
    from helpers import write_prepared

    out = tmp_path_factory.mktemp("sharded")
    tokens = np.random.default_rng(0).integers(0, config().vocab_size, VAL_TOKENS).astype(np.uint16)
    write_prepared(out / "val", tokens, tokenizer=None)
    # this file as a script, forked from an interpreter that has imported torch (it forks its four ranks in turn)
    proc = fabric_lin_process.run([sys.executable, __file__, str(out)], 300,
                                  {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}, scripts=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_sharded_model_starts_from_the_weights_of_one_process(sharded, layout):
    saved = torch.load(sharded / f"{layout}.pth", weights_only=True)
    torch.manual_seed(SEED)
    expected = GPT(config()).state_dict()
    assert sorted(map(canonical_name, saved["weights"])) == sorted(expected)
    for name, tensor in saved["weights"].items():
        assert torch.equal(tensor, expected[canonical_name(name)]), name
    # sharded over the processes of a node: each holds a half (two per node) or a quarter (four), not all
    total = sum(t.numel() for t in expected.values())
    processes_per_node = 4 // LAYOUTS[layout][0]
    assert total / processes_per_node <= saved["held"] < total / processes_per_node + 4 * len(expected)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_processes_validate_a_short_last_batch_as_one_process(sharded, layout):
    """Four processes validate the whole split, its last global batch short: one process's micro batch cut short and
    another's empty, padded, every process running as many forward passes (whose all-gathers the others wait for).
    The loss is the cross-entropy over every token of every block, as one process computes it on litdata's own
    reading of the blocks."""
    import numpy as np
    import torch.nn.functional as F

    from conftest import litdata_blocks

    blocks = torch.from_numpy(np.stack([np.frombuffer(block, dtype=np.int64)
                                        for block in litdata_blocks(sharded / "val", VAL_BLOCK)]))
    in_last_global_batch = len(blocks) % (4 * VAL_MICRO_BATCH)
    assert in_last_global_batch % VAL_MICRO_BATCH and in_last_global_batch < 3 * VAL_MICRO_BATCH, len(blocks)
    torch.manual_seed(SEED)
    model = GPT(config())
    with torch.no_grad():
        expected = F.cross_entropy(model(blocks[:, :-1]).flatten(0, 1), blocks[:, 1:].flatten()).item()
    loss, tokens = torch.load(sharded / f"{layout}.pth", weights_only=True)["validation"]
    assert tokens == blocks[:, 1:].numel()
    assert loss == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- one process


@pytest.fixture
def process_group():
    """A gloo process group of this process alone: a mesh of one, on which FSDP2 runs its whole machinery."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def one_process_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def sharded_model(cfg: Config, precision: str = "32-true", prepare=lambda model: None, **parallelism):
    """gla-debug built on the meta device, `prepare`d (wrapped, compiled, converted), sharded and initialised."""
    with torch.device("meta"):
        model = GPT(cfg)
    prepare(model)
    torch.manual_seed(SEED)
    return parallelize(model, one_process_mesh(), num_nodes=1, parallelism=ParallelismArgs(**parallelism),
                       precision=precision)


@pytest.mark.slow
def test_checkpointed_and_compiled_blocks_train_under_fsdp2_as_without_it(process_group, monkeypatch):
    """pretrain's order: activation checkpointing around each Block, then each Block compiled, then sharded. The
    loss and every gradient equal those of the plain model. (Compiled with the aot_eager backend: Dynamo and
    AOTAutograd as on a GPU, without generating kernels, which on the CPU takes minutes.)"""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    cfg = Config.from_name("gla-debug", num_layers=1)
    compile_block = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: compile_block(self, backend="aot_eager"))

    def checkpoint_and_compile(model):
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        for block in model.layers:
            block.compile()

    model = sharded_model(cfg, prepare=checkpoint_and_compile)
    assert all(block._compiled_call_impl is not None for block in model.layers)
    torch.manual_seed(SEED)
    reference = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 33))
    loss = model(ids[:, :-1], targets=ids[:, 1:])
    loss.backward()
    expected = reference(ids[:, :-1], targets=ids[:, 1:])
    expected.backward()
    assert torch.equal(loss.detach(), expected.detach())
    gradients = {canonical_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(gradients[name], p.grad, rtol=1e-6, atol=1e-9, msg=name)


def test_fused_adamw_found_inf_leaves_the_update_of_sharded_weights_out(process_group):
    """What the loop relies on to skip a non-finite step (test_stopping.py: plain tensors), on DTensor shards."""
    cfg = Config.from_name("gla-debug", num_layers=1)
    model = sharded_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, cfg.vocab_size, (1, 17))
    model(ids[:, :-1], targets=ids[:, 1:]).backward()
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    assert all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    optimizer.found_inf = torch.tensor(0.0)
    optimizer.step()
    assert not torch.equal(model.layers[0].attn.q_proj.weight.full_tensor(), before["layers.0.attn.q_proj.weight"])


def test_bf16_mixed_gathers_bf16_weights_and_keeps_fp32_shards_and_gradients(process_group):
    cfg = Config.from_name("gla-debug", num_layers=1)
    model = sharded_model(cfg, precision="bf16-mixed")
    gathered = []
    model.layers[0].register_forward_pre_hook(lambda block, args: gathered.append(block.attn.q_proj.weight.dtype))
    ids = torch.randint(0, cfg.vocab_size, (1, 17))
    model(ids[:, :-1], targets=ids[:, 1:]).float().backward()
    assert gathered == [torch.bfloat16]
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
    # and the gradients reduced over the processes in fp32 (in one process there is nothing to sum: the policy says it)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fabric_lin.parallelism import mixed_precision_policy

    assert mixed_precision_policy("bf16-mixed") == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def test_fp8_all_gather_gathers_the_converted_weights_in_fp8(process_group):
    """Construction only (FP8 products need a GPU): with fp8.all_gather each converted layer's shard is torchao's
    tensor that FSDP2 casts to FP8 before gathering; the weights are still the one-process init."""
    pytest.importorskip("torchao")
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from fabric_lin.fp8 import FP8Args, convert_to_fp8

    cfg = Config.from_name("gla-debug", num_layers=2, vocab_size=256)
    converted = []
    model = sharded_model(cfg, prepare=lambda model: converted.extend(
        convert_to_fp8(model, FP8Args("tensorwise", all_gather=True), emulate=True)))
    assert len(converted) == 2 * 8  # q, k, v, g, o; gate, up, down
    for name in converted:
        assert isinstance(model.get_submodule(name).weight.to_local(), WeightWithDynamicFloat8CastTensor), name
    assert not isinstance(model.layers[0].attn.gk_proj[0].weight.to_local(), WeightWithDynamicFloat8CastTensor)
    torch.manual_seed(SEED)
    expected = GPT(cfg).state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), expected[canonical_name(name)]), name


@pytest.mark.parametrize("unit, reshard", [("block", True), ("block", False), ("model", True)])
def test_the_units_gather_and_free_the_weights_as_asked(process_group, unit, reshard):
    """fsdp_unit block: each Block is a unit of its own, gathered as it runs; model: the root alone. Resharding after
    the forward pass frees a Block's gathered weights until its backward pass; without it they stay gathered."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    cfg = Config.from_name("gla-debug", num_layers=2)
    model = sharded_model(cfg, fsdp_unit=unit, fsdp_reshard_after_forward=reshard)
    assert [isinstance(block, FSDPModule) for block in model.layers] == [unit == "block"] * 2
    assert isinstance(model, FSDPModule)
    ids = torch.randint(0, cfg.vocab_size, (1, 17))
    loss = model(ids[:, :-1], targets=ids[:, 1:])
    sharded_between = isinstance(model.layers[0].attn.q_proj.weight, DTensor)
    assert sharded_between == reshard
    loss.backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())  # sharded again after the backward pass


@pytest.mark.parametrize("unit", ["block", "model"])
def test_validation_leaves_the_weights_sharded(process_group, unit):
    """A forward pass without a backward pass keeps the weights gathered where they are not freed after the forward
    pass; pretrain's validation shards them again, so the checkpoint after it saves shards."""
    from torch.distributed.tensor import DTensor

    from fabric_lin.pretrain import validate

    cfg = Config.from_name("gla-debug", num_layers=2)
    model = sharded_model(cfg, fsdp_unit=unit, fsdp_reshard_after_forward=False)
    run = validation_run([torch.randint(0, cfg.vocab_size, (1, 17))], micro_batch_size=1, max_iters=1)
    loss, tokens = validate(ProcessGroupFabric(), model, run)
    assert loss > 0 and tokens == 16
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_a_parameter_that_no_reset_parameters_initialises_is_refused():
    """Materialised from the meta device, a parameter is initialised by its own module's reset_parameters(): one of a
    module without it (or of the root) would keep whatever the memory held."""
    from fabric_lin.parallelism import initialize_like_one_process

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

    class Holder(torch.nn.Module):
        def __init__(self, root_parameter: bool):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            if root_parameter:
                self.bias = torch.nn.Parameter(torch.zeros(4))
            else:
                self.scale = Scale()

        def reset_parameters(self):
            pass

    for root_parameter, refused in ((False, "Scale has parameters ['weight']"), (True, "Holder has parameters ['bias']")):
        with torch.device("meta"):
            model = Holder(root_parameter)
        with pytest.raises(TypeError, match=rf"{re.escape(refused)} that no reset_parameters\(\) of its own initialises"):
            initialize_like_one_process(model, torch.device("cpu"))


def test_the_strategy_for_each_choice():
    """One process: Fabric's default. Several: FSDP2 through ModelParallelStrategy, every rank data-parallel (Fabric
    hands each its own samples) and `parallelize` told the nodes; or DDP. NCCL on GPUs, gloo on CPU processes."""
    from lightning_fabric.strategies import DDPStrategy, ModelParallelStrategy

    from fabric_lin.parallelism import make_strategy

    assert make_strategy(cuda=True, devices=1, num_nodes=1, parallelism=ParallelismArgs(), precision="bf16-mixed") == "auto"
    for cuda, backend in ((True, "nccl"), (False, "gloo")):
        fsdp = make_strategy(cuda, devices=2, num_nodes=2, parallelism=ParallelismArgs(fsdp_unit="model"),
                             precision="32-true")
        assert type(fsdp) is ModelParallelStrategy and fsdp._process_group_backend == backend
        assert (fsdp._data_parallel_size, fsdp._tensor_parallel_size) == (4, 1)
        assert fsdp._parallelize_fn.keywords["num_nodes"] == 2
        assert fsdp._parallelize_fn.keywords["parallelism"].fsdp_unit == "model"
        one_per_node = make_strategy(cuda, devices=1, num_nodes=2, parallelism=ParallelismArgs(), precision="32-true")
        assert type(one_per_node) is ModelParallelStrategy and one_per_node._data_parallel_size == 2
        ddp = make_strategy(cuda, devices=2, num_nodes=1, parallelism=ParallelismArgs(data_parallel="ddp"),
                            precision="16-mixed")
        assert type(ddp) is DDPStrategy and ddp._process_group_backend == backend
        assert ddp._ddp_kwargs["gradient_as_bucket_view"] is True


def test_the_processes_wait_for_each_other_as_long_as_parallelism_timeout_minutes_says():
    """The rendezvous's and every collective's timeout, for FSDP and DDP alike: the setting (30 minutes by default).
    The bound of the start on several nodes (fabric_lin.rendezvous) is checked as it."""
    from datetime import timedelta

    from fabric_lin.parallelism import make_strategy

    for data_parallel in ("fsdp", "ddp"):
        default = make_strategy(False, 2, 1, ParallelismArgs(data_parallel=data_parallel), "32-true")
        assert default._timeout == timedelta(minutes=30)
        shorter = make_strategy(False, 2, 1, ParallelismArgs(data_parallel=data_parallel, timeout_minutes=2.5), "32-true")
        assert shorter._timeout == timedelta(seconds=150)
    with pytest.raises(ValueError, match="parallelism.timeout_minutes must be positive, got 0"):
        ParallelismArgs(timeout_minutes=0).validate()
    with pytest.raises(ValueError, match="parallelism.join_timeout_minutes must be positive, got -1"):
        ParallelismArgs(join_timeout_minutes=-1).validate()


# What a process whose peer is gone gets from torch.distributed: gloo's errors as torch 2.14 raised them in the sharded
# tests (rank 0 killed), gloo's write error as its transport words it, NCCL's as reported by users
# (NVIDIA/nccl#2076); and errors that say something else
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:58781: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
              "Check the logs of the remote worker before reporting an error. GLHF!")
GLOO_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:10895"
GLOO_WRITE = "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] writev [10.0.0.2]:4021: Broken pipe"
NCCL_REMOTE = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, remote process exited or there "
               "was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or "
               "a remote process exiting prematurely.")
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
                "operation to complete")
NCCL_TIMEOUT = "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 1800000 ms"


@pytest.mark.parametrize("error, cause", [
    (RuntimeError(GLOO_RESET), "gloo: Connection reset by peer"),
    (RuntimeError(GLOO_CLOSED), "gloo: Connection closed by peer"),
    (RuntimeError(GLOO_WRITE), "gloo: Broken pipe"),
    (dist.DistBackendError(NCCL_REMOTE), "NCCL: remote process exited or there was a network error"),
])
def test_the_errors_of_a_lost_peer_name_what_the_run_was_doing(error, cause):
    from fabric_lin.errors import PeerLost
    from fabric_lin.parallelism import peer_lost_during

    with pytest.raises(PeerLost) as lost:
        with peer_lost_during("training"):
            with peer_lost_during("a checkpoint save"):  # the innermost names it
                raise error
    assert str(lost.value) == f"a peer process of the run ended or became unreachable during a checkpoint save ({cause})"
    assert lost.value.__cause__ is error


@pytest.mark.parametrize("error", [
    RuntimeError(GLOO_TIMEOUT), dist.DistBackendError(NCCL_TIMEOUT), RuntimeError("Connection reset by peer"),
    RuntimeError(NCCL_REMOTE), ValueError(GLOO_RESET),
], ids=["gloo-timeout", "nccl-timeout", "not-gloo", "not-a-dist-error", "not-a-runtime-error"])
def test_other_errors_pass_unchanged(error):
    from fabric_lin.parallelism import peer_lost_during

    with pytest.raises(type(error)) as raised:
        with peer_lost_during("training"):
            raise error
    assert raised.value is error


# The watch's test: a launching rank that starts two ranks as Fabric's launcher starts them (its children, told its
# process id), one still in the rendezvous and one past it, and ends once both are there; each rank writes
# <role>.ready, and <role>.lost if its watch calls on_lost, or <role>.done if it outlived the launching rank. The
# ranks are forked once the launching rank has imported fabric_lin.parallelism, so that they start at once (the
# launching rank itself is forked by the test as the suite's scripts are: fabric_lin_process)
LAUNCHING_RANK = """
import os, sys, time, traceback
from fabric_lin.parallelism import launching_rank_watched
out = sys.argv[1]


def watched_rank(role):
    parent = os.getppid()

    def on_lost(lost):
        open(os.path.join(out, role + ".lost"), "w").write(str(lost))
        os._exit(75)

    with launching_rank_watched(on_lost, poll_seconds=0.05):
        if role == "joining":  # a rendezvous that does not end
            open(os.path.join(out, role + ".ready"), "w").close()
            time.sleep(60)
    open(os.path.join(out, role + ".ready"), "w").close()
    deadline = time.time() + 60
    while os.getppid() == parent and time.time() < deadline:  # training on, past the launching rank's end
        time.sleep(0.05)
    time.sleep(0.5)
    open(os.path.join(out, role + ".done"), "w").close()


for role in ("joining", "joined"):
    if os.fork() == 0:
        os.environ.update(FABRIC_LIN_LAUNCHING_RANK_PID=str(os.getppid()), LOCAL_RANK="1")
        try:
            watched_rank(role)
            code = 0
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
deadline = time.time() + 60
while time.time() < deadline and not any(name.endswith(".lost") for name in os.listdir(out)) and not all(
        os.path.exists(os.path.join(out, role + ".ready")) for role in ("joining", "joined")):
    time.sleep(0.05)
time.sleep(0.5)  # a watch that fired while this rank is alive has written its file by now
seen = " ".join(sorted(os.listdir(out)))
open(os.path.join(out, "launcher.done"), "w").write(seen)
"""


def test_a_rank_in_the_start_up_ends_when_the_rank_that_started_it_is_gone(tmp_path):
    """Fabric's launcher starts ranks 1.. from rank 0: one waiting in the rendezvous when rank 0 ends is told at once
    (its on_lost called, from the watch's thread), naming rank 0's process; one past the rendezvous is not watched any
    more (it ends as its collectives fail), and neither is told while rank 0 lives."""
    import time

    import fabric_lin_process

    (tmp_path / "launcher.py").write_text(LAUNCHING_RANK)
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "launcher.log"
    launcher = fabric_lin_process.start([sys.executable, str(tmp_path / "launcher.py"), str(out)], log,
                                        {**os.environ, "OMP_NUM_THREADS": "1"}, scripts=True)
    assert launcher.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert (out / "launcher.done").read_text() == "joined.ready joining.ready"  # nothing told while rank 0 lived
    deadline = time.time() + 30
    while not ((out / "joining.lost").exists() and ((out / "joined.done").exists() or (out / "joined.lost").exists())) \
            and time.time() < deadline:
        time.sleep(0.1)
    assert (out / "joining.lost").read_text() == (
        f"a peer process of the run ended or became unreachable during the start-up (process {launcher.pid}, the "
        f"rank that started this one, ended before every process had joined)")
    assert (out / "joined.done").exists() and not (out / "joined.lost").exists(), log.read_text()[-3000:]


def test_the_launching_rank_names_itself_to_the_ranks_it_starts(monkeypatch):
    """Within the rendezvous, the rank that Fabric's launcher starts the others from puts its own process id in their
    environment, whatever its own held (it may itself have been started by a run's rank); afterwards it is as before."""
    from fabric_lin.parallelism import LAUNCHING_RANK_PID, launching_rank_watched

    told = []
    for inherited in (None, "1"):
        with monkeypatch.context() as env:
            env.delenv("LOCAL_RANK", raising=False)
            if inherited is None:
                env.delenv(LAUNCHING_RANK_PID, raising=False)
            else:
                env.setenv(LAUNCHING_RANK_PID, inherited)
            with launching_rank_watched(told.append, poll_seconds=0.01):
                assert os.environ[LAUNCHING_RANK_PID] == str(os.getpid())
            assert os.environ.get(LAUNCHING_RANK_PID) == inherited
    assert told == []


def test_fsdp_mesh_shards_over_a_nodes_processes_and_replicates_across_nodes(monkeypatch):
    """fully_shard on a 2-D mesh replicates along its first dimension and shards along its second; ranks count node by
    node, so the mesh (nodes, processes per node) shards each unit over one node's processes."""
    import torch.distributed.device_mesh as device_mesh

    from fabric_lin.parallelism import fsdp_mesh

    meshes = []
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda device_type, shape, mesh_dim_names: meshes.append(
        (shape, mesh_dim_names)))
    fsdp_mesh("cuda", world_size=8, num_nodes=2)
    fsdp_mesh("cuda", world_size=8, num_nodes=1)
    assert meshes == [((2, 4), ("replicate", "shard")), ((8,), ("shard",))]


def test_16_mixed_is_refused_where_the_run_would_be_sharded(tmp_path, capsys, monkeypatch):
    # 16-mixed runs on CUDA alone (on the CPU it is refused before this): two GPUs, as setup sees them; the refusal
    # comes before Fabric starts or anything touches a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--devices", "2", "--precision", "16-mixed",
                     "--train.max_steps", "1", "--out_dir", str(tmp_path / "out")], capsys)
    assert "precision 16-mixed cannot be sharded" in err and "--parallelism.data_parallel ddp" in err
    assert not (tmp_path / "out").exists()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    # fork: the workers inherit the imports instead of repeating them
    mp.start_processes(_shard_worker, args=(4, sys.argv[1], free_port()), nprocs=4, start_method="fork")
