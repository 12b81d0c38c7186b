"""convert_pretrained_checkpoint: training checkpoints (one device, FSDP-sharded) -> model directory,
verified against their manifest first; the converters' outputs: their file mode, and no directory left
behind by a failed conversion.

Run as a script (`python tests/test_convert_pretrained_checkpoint.py OUT_DIR`), this file is also the
2-process FSDP2 job that writes a sharded checkpoint in Fabric's layout on the CPU.
"""
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.convert.model_dir import load_model_dir_weights
from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
from fabric_lin.model import GPT, Block


def write_checkpoint_dir_files(ckpt_dir: Path, config: Config) -> None:
    """model_config.yaml, hyperparameters.yaml and tokenizer files, as pretrain writes beside lit_model.pth."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    config.save(ckpt_dir / "model_config.yaml")
    (ckpt_dir / "hyperparameters.yaml").write_text("model_name: gla-debug\n")
    (ckpt_dir / "tokenizer.model").write_bytes(b"sentencepiece model bytes for the copy test")
    (ckpt_dir / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')


def trained_model(config: Config, steps: int = 2, compile_prefix: bool = False):
    torch.manual_seed(0)
    model = GPT(config)
    # pretrain's two parameter groups (weight decay, and none for norms and biases)
    from fabric_lin.pretrain import no_decay_parameter_names
    from fabric_lin.weights import canonical_name

    no_decay = no_decay_parameter_names(model)
    groups = [[p for n, p in model.named_parameters() if (canonical_name(n) in no_decay) == flag] for flag in (False, True)]
    optimizer = torch.optim.AdamW([{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}], lr=1e-2)
    for _ in range(steps):
        x = torch.randint(0, config.vocab_size, (2, 17))
        model(x[:, :-1], targets=x[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def fabric_single_device_checkpoint(tmp_path: Path, config: Config, compiled: bool = False):
    from lightning.fabric import Fabric

    model, optimizer = trained_model(config)
    fabric = Fabric(accelerator="cpu", devices=1)
    ckpt_dir = tmp_path / "out" / "step-00000002"
    write_checkpoint_dir_files(ckpt_dir, config)
    # the state pretrain saves, with every kind of object it holds (NumPy's RNG state is an array)
    saved_model = torch.compile(model) if compiled else model
    state = {
        "model": saved_model,
        "optimizer": optimizer,
        "train_dataloader": {"current_epoch": 0, "num_samples_yielded": 8, "latest_worker_idx": 0},
        "iter_num": 4,
        "step_count": 2,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }
    fabric.save(ckpt_dir / "lit_model.pth", state)
    (ckpt_dir / "step.json").write_text('{"step_count": 2}\n')
    with_manifest(ckpt_dir)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ckpt_dir, expected


def load_whole_checkpoint(path: Path) -> dict:
    """A training checkpoint written by the tests or by pretrain, read whole: tensors, containers and
    the arrays of NumPy's RNG state (no other global is admitted)."""
    multiarray = getattr(np, "_core", None) or np.core
    allowed = [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def assert_same_tensors(got: dict, expected: dict):
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_single_device_checkpoint_converts_to_the_model_weights(tmp_path):
    config = Config.from_name("gla-debug")
    ckpt_dir, expected = fabric_single_device_checkpoint(tmp_path, config)
    out = tmp_path / "model"
    convert_pretrained_checkpoint(ckpt_dir, out)

    assert sorted(p.name for p in out.iterdir()) == ["lit_model.pth", "model_config.yaml", "tokenizer.model", "tokenizer_config.json"]
    assert (out / "tokenizer.model").read_bytes() == (ckpt_dir / "tokenizer.model").read_bytes()
    assert Config.from_checkpoint(out) == config
    # a plain state dict, loadable with weights_only=True
    raw = torch.load(out / "lit_model.pth", weights_only=True)
    assert_same_tensors(raw, expected)
    model = GPT(config)
    model.load_state_dict(load_model_dir_weights(out))
    x = torch.randint(0, config.vocab_size, (1, 9))
    ref, _ = trained_model(config)
    torch.testing.assert_close(model(x), ref(x))


def test_compile_prefix_is_stripped(tmp_path):
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, expected = fabric_single_device_checkpoint(tmp_path, config, compiled=True)
    full = load_whole_checkpoint(ckpt_dir / "lit_model.pth")
    saved = full["model"]
    # whether Fabric keeps `_orig_mod.` depends on its version; make sure the converter sees it
    if not any("_orig_mod." in k for k in saved):
        saved = {f"_orig_mod.{k}": v for k, v in saved.items()}
        full["model"] = saved
        torch.save(full, ckpt_dir / "lit_model.pth")
    convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    assert_same_tensors(torch.load(tmp_path / "model" / "lit_model.pth", weights_only=True), expected)


def test_dtype_cast(tmp_path):
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, expected = fabric_single_device_checkpoint(tmp_path, config)
    convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model", dtype="bfloat16")
    got = torch.load(tmp_path / "model" / "lit_model.pth", weights_only=True)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert_same_tensors(got, {k: v.bfloat16() for k, v in expected.items()})
    with pytest.raises(ValueError, match="dtype 'fp8' is not supported"):
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "other", dtype="fp8")


def test_refuses_non_empty_output_unless_overwrite(tmp_path):
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, expected = fabric_single_device_checkpoint(tmp_path, config)
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty.*notes.txt.*--overwrite"):
        convert_pretrained_checkpoint(ckpt_dir, out)
    assert not (out / "lit_model.pth").exists()
    convert_pretrained_checkpoint(ckpt_dir, out, overwrite=True)
    assert_same_tensors(torch.load(out / "lit_model.pth", weights_only=True), expected)
    assert (out / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="is the input directory"):
        convert_pretrained_checkpoint(ckpt_dir, ckpt_dir, overwrite=True)


def test_not_a_checkpoint_gets_a_clear_error(tmp_path):
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)
    with pytest.raises(FileNotFoundError, match=r"not a training checkpoint.*step-00000002"):
        convert_pretrained_checkpoint(ckpt_dir.parent, tmp_path / "model")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        convert_pretrained_checkpoint(tmp_path / "missing", tmp_path / "model")
    unfinished = ckpt_dir.parent / ".tmp-step-00000004"
    ckpt_dir.rename(unfinished)
    with pytest.raises(ValueError, match="unfinished checkpoint"):
        convert_pretrained_checkpoint(unfinished, tmp_path / "model")
    # a model directory given where a training checkpoint is expected
    unfinished.rename(ckpt_dir)
    convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    with pytest.raises(ValueError, match="already a model directory"):
        convert_pretrained_checkpoint(tmp_path / "model", tmp_path / "model2")


def test_config_mismatch_lists_the_differences(tmp_path):
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)
    Config.from_name("gla-debug", num_layers=2, hidden_size=256, num_heads=2).save(ckpt_dir / "model_config.yaml")
    with_manifest(ckpt_dir)  # written so: the manifest agrees, the model does not
    with pytest.raises(ValueError) as info:
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    message = str(info.value)
    assert "missing (14): layers.1.attn_norm.weight" in message
    assert "embeddings.weight: shape (4096, 128), expected (4096, 256)" in message
    assert not (tmp_path / "model" / "lit_model.pth").exists()


def test_pickled_code_in_checkpoint_is_refused(tmp_path):
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)
    full = load_whole_checkpoint(ckpt_dir / "lit_model.pth")
    full["hook"] = _Payload(tmp_path / "pwned")
    torch.save(full, ckpt_dir / "lit_model.pth")
    with_manifest(ckpt_dir)  # a file made so on purpose comes with a manifest that fits it
    with pytest.raises(ValueError, match="never unpickled beyond tensors"):
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    assert not (tmp_path / "pwned").exists()


def with_manifest(ckpt_dir: Path) -> Path:
    """The manifest pretrain writes last into a checkpoint directory."""
    from lightning.fabric import Fabric

    from fabric_lin.checkpoint import write_manifest

    write_manifest(Fabric(accelerator="cpu", devices=1), ckpt_dir)
    return ckpt_dir


def test_a_verified_checkpoint_converts_and_a_damaged_one_is_refused(tmp_path, capsys):
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, expected = fabric_single_device_checkpoint(tmp_path, config)
    convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    assert f"Converted {ckpt_dir} (single file)" in capsys.readouterr().out
    assert_same_tensors(torch.load(tmp_path / "model" / "lit_model.pth", weights_only=True), expected)
    size = (ckpt_dir / "lit_model.pth").stat().st_size
    with open(ckpt_dir / "lit_model.pth", "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match=rf"{ckpt_dir}: the checkpoint is damaged: lit_model.pth has {size // 2:,} bytes, "
                       rf"{size:,} when it was written \(truncated\). It is not converted"):
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_a_checkpoint_without_its_manifest_is_not_converted(tmp_path):
    """The manifest is written last: a directory without it was never completed (or lost it since)."""
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)
    (ckpt_dir / "manifest.json").unlink()
    with pytest.raises(ValueError, match=rf"{ckpt_dir}: the checkpoint is damaged: manifest.json is missing \(it is written "
                       r"last: the checkpoint was never completed, or lost it since\). It is not converted"):
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_exported_files_get_the_usual_mode(tmp_path):
    """Every file the converters write is a new file of mode 0o666 less the umask (safetensors and mkstemp
    give 0o600): checked under umask 027, where the usual mode is 0o640."""
    from fabric_lin.convert.hf import convert_to_hf

    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)
    os.chmod(ckpt_dir / "tokenizer.model", 0o600)  # a source's own mode is not copied
    previous = os.umask(0o027)
    try:
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "model").iterdir()}
        for name in ("tokenizer.model", "tokenizer_config.json"):  # the test's stand-in bytes are no SentencePiece model
            shutil.move(tmp_path / "model" / name, tmp_path / name)
        convert_to_hf(tmp_path / "model", tmp_path / "hf")
    finally:
        os.umask(previous)
    modes.update({p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()})
    assert modes == {name: oct(0o640) for name in ("lit_model.pth", "model_config.yaml", "tokenizer.model",
                                                   "tokenizer_config.json", "model.safetensors", "config.json")}


def test_a_failed_conversion_removes_the_directories_it_created(tmp_path, monkeypatch):
    import errno

    from fabric_lin.convert import model_dir

    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)

    def disk_full(obj, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(model_dir.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "models" / "a" / "model")
    assert not (tmp_path / "models").exists()
    (tmp_path / "kept").mkdir()  # a directory that was there before stays
    with pytest.raises(OSError):
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "kept")
    assert (tmp_path / "kept").is_dir()


class _Payload:
    """Unpickled, it runs `touch target`: the file's absence afterwards shows that no code ran."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


# ---------------------------------------------------------------- sharded: FSDP2 on 2 CPU processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        from lightning.fabric.strategies.fsdp import (
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


def test_fabric_fsdp_checkpoint_resumes_whole_in_one_process(tmp_path):
    """A 2-process FSDP checkpoint in Fabric's format (model and optimizer in DCP shards, the rest in
    meta.pt) restores a one-process train state: weights, AdamW's moments and steps, each under its
    parameter in pretrain's two groups, equal those of the same two steps taken in one process (the two
    processes' batches, gradients averaged as FSDP does)."""
    from lightning.fabric.strategies import SingleDeviceStrategy

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
    assert OneDeviceFabric.lines[-1] == f"{ckpt_dir / 'lit_model.pth'} is sharded (FSDP) and this run is not: its tensors are reassembled whole"
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
    (weights / ".metadata").write_bytes(pickle.dumps(_Payload(tmp_path / "pwned")))
    with pytest.raises(ValueError, match="refers to posix.system|refers to os.system"):
        load_sharded_model_state(weights)
    assert not (tmp_path / "pwned").exists()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    # fork: the workers inherit the imports instead of repeating them
    mp.start_processes(_fsdp_worker, args=(2, sys.argv[1], _free_port(), sys.argv[2]), nprocs=2, start_method="fork")
