"""fabric_lin/sharded_checkpoint.py: FSDP-sharded training checkpoints (Fabric's layout: model and optimizer in DCP
shards, the rest in meta.pt), written by a 2-process job on the CPU (FSDP1 through Fabric's own functions, and
FSDP2), read in one process: converted to the unsharded weights, resumed whole as a one-process train state, a
damaged shard named, foreign pickles in the metadata refused.

Run as a script (`python tests/test_sharded_checkpoint.py CHECKPOINT_DIR KIND`), this file is the 2-process job that
writes the sharded checkpoint."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
from fabric_lin.model import GPT, Block
from helpers import TouchOnUnpickle, assert_same_tensors, free_port, write_checkpoint_dir_files


# ---------------------------------------------------------------- the job: FSDP on 2 CPU processes


def _fsdp_worker(rank: int, world_size: int, ckpt_dir: str, port: int, kind: str) -> None:
    """Shard gla-debug across the CPU processes, train two steps, and save as Fabric's
    FSDPStrategy(state_dict_type="sharded") does: DCP of {"model", "optimizer"} into the directory
    lit_model.pth, the rest with torch.save into lit_model.pth/meta.pt from rank 0.

    kind "fsdp1": torch's FullyShardedDataParallel (what Fabric wraps), saved through Fabric's own
    sharded state-dict context and DCP save function. kind "fsdp2": `fully_shard` (DTensor shards)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    config = Config.from_checkpoint(ckpt_dir)
    torch.manual_seed(0)
    model = GPT(config)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # pretrain's two parameter groups (weight decay, and none for norms and biases)
    from fabric_lin.pretrain import no_decay_parameter_names
    from fabric_lin.weights import canonical_name

    no_decay = no_decay_parameter_names(model)
    groups = [[p for n, p in model.named_parameters() if (canonical_name(n) in no_decay) == flag] for flag in (False, True)]
    optimizer = torch.optim.AdamW([{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}], lr=1e-2)
    torch.manual_seed(1 + rank)  # each rank its own data
    for _ in range(2):
        x = torch.randint(0, config.vocab_size, (1, 17))
        model(x[:, :-1], targets=x[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    path = Path(ckpt_dir) / "lit_model.pth"
    if kind == "fsdp1":
        from lightning_fabric.strategies.fsdp import (
            _distributed_checkpoint_save,
            _get_full_state_dict_context,
            _get_sharded_state_dict_context,
        )

        with _get_sharded_state_dict_context(model):
            state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer)}
        assert all(type(t).__name__ == "ShardedTensor" for t in state["model"].values())
        _distributed_checkpoint_save(state, path)
        with _get_full_state_dict_context(model, world_size=world_size, rank0_only=False):
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        state_dict = model.state_dict()
        assert all(isinstance(t, torch.distributed.tensor.DTensor) for t in state_dict.values())
        dcp.save({"model": state_dict, "optimizer": optimizer.state_dict()}, checkpoint_id=path)
        full = {k: v.full_tensor() for k, v in state_dict.items()}
    if rank == 0:
        from fabric_lin.checkpoint import get_rng_states

        meta = {"iter_num": 4, "step_count": 2, "train_dataloader": {"next_position": 4}, "rng_states": get_rng_states()}
        torch.save(meta, path / "meta.pt")
        torch.save(full, Path(ckpt_dir).parent / "expected_weights.pth")
    dist.barrier()
    # as Checkpointer.save does after its barrier: the ranks share out the checksums, rank 0 writes the manifest
    from fabric_lin.checkpoint import write_manifest

    write_manifest(_ProcessGroupFabric(), Path(ckpt_dir))
    dist.destroy_process_group()


class _ProcessGroupFabric:
    """What write_manifest asks of Fabric, over the process group of the workers above."""

    def __init__(self):
        import torch.distributed as dist

        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def broadcast(self, obj, src=0):
        import torch.distributed as dist

        objects = [obj]
        dist.broadcast_object_list(objects, src=src)
        return objects[0]

    def barrier(self):
        import torch.distributed as dist

        dist.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_fsdp_sharded_checkpoint_converts_on_cpu_to_the_unsharded_weights(tmp_path, kind):
    config = Config.from_name("gla-debug", num_layers=2)
    ckpt_dir = tmp_path / "out" / "step-00000002"
    write_checkpoint_dir_files(ckpt_dir, config)
    proc = subprocess.run(
        [sys.executable, __file__, str(ckpt_dir), kind], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = ckpt_dir / "lit_model.pth"
    assert weights.is_dir() and len(list(weights.glob("*.distcp"))) == 2 and (weights / "meta.pt").is_file()
    # every file of the sharded lit_model.pth/ is in the manifest
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    assert {n for n in manifest["files"] if n.startswith("lit_model.pth/")} == {
        f"lit_model.pth/{p.relative_to(weights).as_posix()}" for p in weights.rglob("*") if p.is_file()
    } >= {"lit_model.pth/.metadata", "lit_model.pth/__0_0.distcp", "lit_model.pth/__1_0.distcp", "lit_model.pth/meta.pt"}

    out = tmp_path / "model"
    convert_pretrained_checkpoint(ckpt_dir, out)
    expected = torch.load(tmp_path / "out" / "expected_weights.pth", weights_only=True)
    got = torch.load(out / "lit_model.pth", weights_only=True)
    assert_same_tensors(got, expected)
    # training moved the weights away from the shared init: the comparison is not of two inits
    torch.manual_seed(0)
    init = GPT(config).state_dict()
    assert not torch.equal(init["layers.0.attn.q_proj.weight"], got["layers.0.attn.q_proj.weight"])
    assert (out / "tokenizer.model").is_file() and Config.from_checkpoint(out) == config
    # a shard damaged afterwards is named, and the checkpoint not converted
    with open(weights / "__1_0.distcp", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    with pytest.raises(ValueError, match=r"the checkpoint is damaged: lit_model.pth/__1_0.distcp's bytes changed since it was written"):
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model2")


def adamw_with_pretrain_groups(model):
    from fabric_lin.pretrain import no_decay_parameter_names

    no_decay = no_decay_parameter_names(model)
    groups = [[p for n, p in model.named_parameters() if (n in no_decay) == flag] for flag in (False, True)]
    return torch.optim.AdamW([{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}], lr=1e-2)


@pytest.mark.slow
def test_fabric_fsdp_checkpoint_resumes_whole_in_one_process(tmp_path):
    """A 2-process FSDP checkpoint in Fabric's format (model and optimizer in DCP shards, the rest in
    meta.pt) restores a one-process train state: weights, AdamW's moments and steps, each under its
    parameter in pretrain's two groups, equal those of the same two steps taken in one process (the two
    processes' batches, gradients averaged as FSDP does)."""
    from lightning_fabric.strategies import SingleDeviceStrategy

    from fabric_lin.checkpoint import load_train_state, train_state
    from fabric_lin.sharded_checkpoint import load_sharded_train_state

    config = Config.from_name("gla-debug", num_layers=2)
    ckpt_dir = tmp_path / "out" / "step-00000002"
    write_checkpoint_dir_files(ckpt_dir, config)
    proc = subprocess.run([sys.executable, __file__, str(ckpt_dir), "fsdp1"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]

    batches = []  # as the workers draw them
    for rank in range(2):
        torch.manual_seed(1 + rank)
        batches.append([torch.randint(0, config.vocab_size, (1, 17)) for _ in range(2)])
    torch.manual_seed(0)
    reference = GPT(config)
    reference_optimizer = adamw_with_pretrain_groups(reference)
    for step in range(2):
        for rank in range(2):
            x = batches[rank][step]
            (reference(x[:, :-1], targets=x[:, 1:]) / 2).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()

    class Loader:  # what fabric.load does with the data loader: hands it its state
        def load_state_dict(self, state):
            self.state = state

    torch.manual_seed(5)
    model = GPT(config)
    optimizer = adamw_with_pretrain_groups(model)
    optimizer.param_groups[0]["lr"] = 3.0  # restored from the checkpoint
    class OneDeviceFabric:  # what load_train_state asks of Fabric in a run without FSDP
        strategy = SingleDeviceStrategy(device=torch.device("cpu"))
        lines = []

        def print(self, line):
            self.lines.append(line)

    state = train_state(model, optimizer, Loader())
    load_train_state(OneDeviceFabric(), ckpt_dir, state)
    assert OneDeviceFabric.lines[-1] == f"{ckpt_dir / 'lit_model.pth'} is sharded and this run is not: its tensors are reassembled whole"
    saved_rng = torch.load(ckpt_dir / "lit_model.pth" / "meta.pt", weights_only=True)["rng_states"]
    assert torch.equal(torch.get_rng_state(), saved_rng["torch"])

    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-9, msg=name)
    moments = {name: reference_optimizer.state[p] for name, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(optimizer.state[p][key], moments[name][key], rtol=1e-6, atol=1e-12, msg=f"{name} {key}")
        assert torch.count_nonzero(optimizer.state[p]["exp_avg"]) > 0, name  # two steps were taken
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(1e-2, 0.1), (1e-2, 0.0)]
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(g["params"]) for g in reference_optimizer.param_groups]
    assert state["train_dataloader"].state == {"next_position": 4}
    assert state["iter_num"] == 4 and state["step_count"] == 2

    # a run whose model has other parameters is told which
    other = GPT(Config.from_name("gla-debug", num_layers=1))
    with pytest.raises(ValueError, match=r"the checkpoint's model does not fit this run's: missing \[\], unexpected \['layers.1"):
        load_sharded_train_state(ckpt_dir / "lit_model.pth", train_state(other, torch.optim.AdamW(other.parameters()), Loader()))


def test_sharded_metadata_with_foreign_pickle_is_refused(tmp_path):
    import pickle

    from fabric_lin.sharded_checkpoint import load_sharded_model_state

    weights = tmp_path / "lit_model.pth"
    weights.mkdir()
    (weights / ".metadata").write_bytes(pickle.dumps(TouchOnUnpickle(tmp_path / "pwned")))
    with pytest.raises(ValueError, match="refers to posix.system|refers to os.system"):
        load_sharded_model_state(weights)
    assert not (tmp_path / "pwned").exists()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    # fork: the workers inherit the imports instead of repeating them
    mp.start_processes(_fsdp_worker, args=(2, sys.argv[1], free_port(), sys.argv[2]), nprocs=2, start_method="fork")
