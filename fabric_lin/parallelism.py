"""How several processes share a run: Fabric's strategy, and the model sharded with FSDP2.

One sharded path for every device type: `fully_shard` (FSDP2: DTensor parameters) on a device mesh of
`num_nodes x devices` processes, NCCL between GPUs and gloo between CPU processes, through Fabric's
`ModelParallelStrategy`, which calls `parallelize` with the model and its mesh. Across nodes the model is
replicated, within a node sharded (the meaning of FSDP1's HYBRID_SHARD); on one node it is plainly sharded.
Each `Block` is one unit (`fully_shard` on each, then on the root for the embedding, the final norm and the
head), or the whole model is (`parallelism.fsdp_unit model`). DistributedDataParallel stays selectable
(`parallelism.data_parallel ddp`).

The model is built on the meta device, sharded, and then materialised and initialised shard by shard
(`initialize_like_one_process`): its weights, gathered, are those of a one-process run with the same seed,
bit for bit.
"""
import contextlib
import os
import re
import threading
from datetime import timedelta
from functools import partial
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
from lightning_fabric.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from fabric_lin.args import ParallelismArgs
from fabric_lin.errors import InvalidValue, PeerLost
from fabric_lin.files import environment_variables


# What torch.distributed raises in a process whose peer process is gone (ended, or its node lost): gloo a RuntimeError
# from its TCP transport, the connection to the peer closed or reset, or a write into it refused; NCCL a
# DistBackendError for ncclRemoteError. A timeout is none of them: a peer that hangs times out too, and so do ranks
# that called different collectives (a bug).
GLOO_LOST_PEER = re.compile(r"gloo/transport/tcp/.*?(Connection closed by peer|Connection reset by peer|Broken pipe)")
NCCL_LOST_PEER = "remote process exited or there was a network error"
# The process id of the rank that Fabric's launcher starts the others from (`--devices N` without torchrun or SLURM),
# in the environment of the ranks it starts: their parent, which they watch while they join the process group
LAUNCHING_RANK_PID = "FABRIC_LIN_LAUNCHING_RANK_PID"


def lost_peer_cause(error: BaseException) -> Optional[str]:
    """The words of a torch.distributed error that say a peer process is gone ("gloo: Connection reset by peer"), or
    None for any other error."""
    gloo = GLOO_LOST_PEER.search(str(error)) if isinstance(error, RuntimeError) else None
    if gloo:
        return f"gloo: {gloo.group(1)}"
    if isinstance(error, torch.distributed.DistBackendError) and NCCL_LOST_PEER in str(error):
        return f"NCCL: {NCCL_LOST_PEER}"
    return None


@contextlib.contextmanager
def peer_lost_during(activity: str) -> Iterator[None]:
    """Within (or, as a decorator, within a function): an error of torch.distributed that says a peer process is gone
    becomes `PeerLost`, naming `activity` (the innermost one names it); any other error passes unchanged."""
    try:
        yield
    except RuntimeError as error:
        cause = lost_peer_cause(error)
        if cause is None:
            raise
        raise PeerLost(activity, cause) from error


@contextlib.contextmanager
def launching_rank_watched(on_lost: Callable[[PeerLost], None], poll_seconds: float = 0.2) -> Iterator[None]:
    """Within: the process group's rendezvous (Fabric's launch). In a rank that Fabric's launcher started, `on_lost` is
    called, from a thread of its own, as soon as the rank that started it is gone: torch.distributed would keep this
    one waiting for that rank's store for parallelism.timeout_minutes and longer (it tries again), in a call that
    neither an exception nor a signal interrupts, so `on_lost` must end the process itself. The launching rank passes
    its process id to the ranks it starts. Ranks started otherwise are not watched: torchrun ends the processes of a
    node when one of them fails, Fabric's launcher ends every rank when one it started fails, and a process on another
    node cannot be seen from here (`fabric_lin.rendezvous` bounds the wait for it)."""
    launcher = os.environ.get(LAUNCHING_RANK_PID)
    if launcher is None or os.environ.get("LOCAL_RANK", "0") == "0":  # not a rank that Fabric's launcher started
        with environment_variables({LAUNCHING_RANK_PID: str(os.getpid())}):
            yield
        return
    joined = threading.Event()

    def watch() -> None:
        while os.getppid() == int(launcher):  # once its parent is gone, a process is another's child
            if joined.wait(poll_seconds):
                return
        on_lost(PeerLost("the start-up", f"process {launcher}, the rank that started this one, ended before every "
                                         "process had joined"))

    threading.Thread(target=watch, name="launching-rank-watch", daemon=True).start()
    try:
        yield
    finally:
        joined.set()


def check_torchrun_processes(devices: int, num_nodes: int) -> None:
    """Under torchrun, refuse --devices and --num_nodes other than the processes torchrun started: Fabric takes
    torchrun's processes as they are, so with fewer devices each process trains as a run of its own (the same
    steps in each, checkpoints written over each other) or waits for ranks that never come. Under SLURM, Fabric
    checks the same itself."""
    if not all(name in os.environ for name in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")):
        return  # not launched by torchrun (Fabric's TorchElasticEnvironment looks for the same variables)
    per_node, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    nodes = world // per_node
    if (devices, num_nodes) != (per_node, nodes):
        raise InvalidValue(
            f"torchrun started {world} processes, {per_node} on each of {nodes} node(s) (its --nproc-per-node and "
            f"--nnodes), and this run has --devices {devices} --num_nodes {num_nodes}: give --devices {per_node} "
            f"--num_nodes {nodes}"
        )


def check_other_nodes_launched(num_nodes: int) -> None:
    """Refuse --num_nodes above 1 where nothing starts the command on the other nodes: without a launcher's variables
    Fabric starts this node's processes itself, as node 0, and they wait for the other nodes' processes, which never
    come. torchrun, SLURM's srun, LSF's jsrun and MPI are found as Fabric finds them; NODE_RANK (or torchrun's
    GROUP_RANK) is Fabric's own multi-node launch, the command started by hand on every node, which needs MASTER_ADDR
    and MASTER_PORT there too: without them, each node would meet at a port of its own choosing, on its own host."""
    from lightning_fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if num_nodes == 1:
        return
    if any(environment.detect() for environment in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment)):
        return
    if "NODE_RANK" in os.environ or "GROUP_RANK" in os.environ:
        unset = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if unset:
            raise InvalidValue(
                f"--num_nodes {num_nodes} with NODE_RANK set and {' and '.join(unset)} unset: set MASTER_ADDR (node 0's "
                f"address) and MASTER_PORT (a port free there) to the same values on every node"
            )
        return
    raise InvalidValue(
        f"--num_nodes {num_nodes}: nothing starts this command on the other node(s) (no torchrun, SLURM, LSF or MPI "
        f"variables, no NODE_RANK), so this node's processes would wait for theirs for ever; start it on every node "
        f"with torchrun or srun (tutorials/multi_node.md) or with NODE_RANK, MASTER_ADDR and MASTER_PORT set on each, "
        f"or give --num_nodes 1"
    )


def check_launch_variables(devices: int, num_nodes: int) -> None:
    """Refuse a launch variable that Fabric would read as what it is not, where more than one process meets: a
    MASTER_PORT that is no port number (Fabric's int() of it stopped the command with a traceback; torchrun checks its
    own), and, in Fabric's own launch (no torchrun, SLURM, LSF or MPI), a NODE_RANK (or GROUP_RANK) that is no node of
    --num_nodes: its processes took ranks past the run's last and waited for the others until the join bound."""
    from lightning_fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if devices * num_nodes == 1 or TorchElasticEnvironment.detect():
        return
    port = os.environ.get("MASTER_PORT")
    if port is not None and not (port.strip().isdecimal() and 1 <= int(port) <= 65535):
        raise InvalidValue(f"MASTER_PORT {port!r}: expected a port number from 1 to 65535 (a port free on node 0, the "
                           f"same on every node; on one node, leave it unset for a free one)")
    if any(environment.detect() for environment in (SLURMEnvironment, LSFEnvironment, MPIEnvironment)):
        return
    for name in ("NODE_RANK", "GROUP_RANK"):
        value = os.environ.get(name)
        if value is not None and not (value.strip().isdecimal() and int(value) < num_nodes):
            raise InvalidValue(f"{name} {value!r}: expected this node's number among the run's --num_nodes {num_nodes}, "
                               f"from 0 to {num_nodes - 1} (0 on node 0, whose address MASTER_ADDR is)")


def make_strategy(cuda: bool, devices: int, num_nodes: int, parallelism: ParallelismArgs,
                  precision: str) -> Union[str, Strategy]:
    """Fabric's strategy for `devices` processes on each of `num_nodes` nodes: "auto" for one process; else FSDP2
    through ModelParallelStrategy, or DDP (`parallelism.data_parallel`), over NCCL (GPUs) or gloo (CPU processes)."""
    if devices * num_nodes == 1:
        return "auto"
    backend = "nccl" if cuda else "gloo"
    # the rendezvous's and every collective's: init_process_group takes one for both
    timeout = timedelta(minutes=parallelism.timeout_minutes)
    if parallelism.data_parallel == "ddp":
        # gradients all-reduced in buckets as the backward pass produces them, into views of the buckets
        # (no copy); activation checkpointing, when on, is applied to the Blocks by build_model
        return DDPStrategy(process_group_backend=backend, gradient_as_bucket_view=True, timeout=timeout)
    check_sharded_precision(precision)
    # Fabric builds its mesh as (data_parallel_size, tensor_parallel_size) and hands every rank of the first
    # dimension its own samples (distributed_sampler_kwargs); there is no tensor parallelism here, so every rank
    # is a data-parallel rank: (world size, 1). Replication across nodes and sharding within one are FSDP's own
    # layout of that data parallelism, on a mesh of its own that `parallelize` makes (Fabric's mesh names its
    # second dimension tensor_parallel and its first would give the ranks of a node the same samples).
    return ModelParallelStrategy(
        parallelize_fn=partial(parallelize, num_nodes=num_nodes, parallelism=parallelism, precision=precision),
        data_parallel_size=devices * num_nodes, tensor_parallel_size=1,
        save_distributed_checkpoint=True,  # every rank writes its shards: torch.distributed.checkpoint
        process_group_backend=backend, timeout=timeout,
    )


def check_sharded_precision(precision: str) -> None:
    """FSDP2 has no loss scaler for fp16 gradients (Fabric's ModelParallelStrategy refuses 16-mixed)."""
    if precision == "16-mixed":
        raise InvalidValue(
            "precision 16-mixed cannot be sharded (FSDP2 has no loss scaler for fp16): use --precision bf16-mixed, "
            "or --parallelism.data_parallel ddp"
        )


def fsdp_mesh(device_type: str, world_size: int, num_nodes: int):
    """The mesh FSDP shards over: (num_nodes, devices per node), replicated along the first dimension and
    sharded along the second; one dimension (sharded) on one node. Ranks are numbered node by node, so the
    second dimension's groups are the processes of one node."""
    from torch.distributed.device_mesh import init_device_mesh

    if num_nodes == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (num_nodes, world_size // num_nodes), mesh_dim_names=("replicate", "shard"))


def mixed_precision_policy(precision: str):
    """bf16-mixed: each unit's weights gathered and computed in bf16 (half the bytes of each all-gather; the
    residual stream is then bf16 too, where one device keeps it in fp32 under autocast), gradients reduced in
    fp32 onto the fp32 shards. Other precisions: the parameters' own dtype throughout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def parallelize(model: nn.Module, device_mesh, *, num_nodes: int, parallelism: ParallelismArgs,
                precision: str) -> nn.Module:
    """Shard `model` with FSDP2 (built on the meta device; its Blocks already wrapped for activation checkpointing
    and compiled, its Linear layers converted to FP8, where asked) and materialise it on this rank's device,
    initialised as one process would initialise it. Fabric's ModelParallelStrategy calls it with its mesh, which
    gives the device type and the world size; FSDP's own mesh is `fsdp_mesh`'s."""
    from torch.distributed.fsdp import fully_shard

    mesh = fsdp_mesh(device_mesh.device_type, device_mesh.size(), num_nodes)
    shard = partial(fully_shard, mesh=mesh, reshard_after_forward=parallelism.fsdp_reshard_after_forward,
                    mp_policy=mixed_precision_policy(precision))
    if parallelism.fsdp_unit == "block":
        for block in model.layers:  # a Block, or the activation-checkpointing wrapper around it
            shard(block)
    shard(model)  # the rest (embedding, final norm, head), or everything with fsdp_unit "model"
    device = torch.device(device_mesh.device_type, torch.cuda.current_device()) if device_mesh.device_type == "cuda" \
        else torch.device(device_mesh.device_type)
    initialize_like_one_process(model, device)
    return model


def free_gathered_weights(model: nn.Module) -> None:
    """Shard again the weights a forward pass without a backward pass (validation) left gathered: with
    fsdp_reshard_after_forward false, FSDP2 frees them in the backward pass only. (A checkpoint saves the shards.)"""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def initialize_like_one_process(model: nn.Module, device: torch.device) -> None:
    """Materialise a model sharded on the meta device on `device`, and initialise it as `GPT.reset_parameters()`
    does in one process, from the global generator's current state: module by module in registration order,
    each module's own parameters drawn whole (at most one module's, e.g. the embedding, at a time) and this
    rank's shard kept. Drawn on the shards themselves, the numbers would depend on the mesh."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device=device)
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if module is model or not hasattr(module, "reset_parameters"):
            if own:
                raise TypeError(f"{type(module).__name__} has parameters {sorted(own)} that no reset_parameters() of "
                                "its own initialises")
            continue
        for name, param in own.items():
            whole = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(module, name, nn.Parameter(whole, requires_grad=False))
        module.reset_parameters()
        for name, param in own.items():
            whole = getattr(module, name)
            setattr(module, name, param)
            if isinstance(param, DTensor):
                # this rank's part of the whole tensor, cut where its shard lies (src_data_rank None: every rank
                # drew the whole tensor, so none sends anything)
                whole = distribute_tensor(whole.detach(), param.device_mesh, param.placements, src_data_rank=None).to_local()
                param = param.to_local()
            param.copy_(whole)
