"""evaluate, generate and convert_pretrained_checkpoint read a training checkpoint's model alone, and check only its
bytes (fabric_lin.model_bytes), not the optimizer's state beside it (twice as large): a byte of that state changed on
the disk leaves the model read whole and the text it generates that of the model directory, in either layout (one
file: torch.save's zip records; sharded: the ranges of the shard files that .metadata places the model in), while a
resume, which reads that state, still refuses the checkpoint; a byte of the model changed is refused as before. A
sharded checkpoint whose manifest records no checksum of its model's bytes is checked whole."""
import json
import zipfile
from pathlib import Path
from typing import Tuple

import pytest
import torch

from fabric_lin.checkpoint import verify_checkpoint, write_manifest
from fabric_lin.checkpoint_kinds import load_checkpoint
from fabric_lin.generate import main as generate
from fabric_lin.model_bytes import model_ranges, model_records
from helpers import cli_error, make_model_dir, small_config
from test_generate_checkpoints import PROMPT, OneProcess, training_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LAYOUTS = ("one file", "sharded")


def optimizer_state(state: dict, sharded: bool) -> dict:
    """AdamW's state after one step on a model of the weights `state`: keyed by parameter index as one device saves it,
    or by parameter name as FSDP2 does."""
    from fabric_lin.model import GPT

    model = GPT(small_config())
    model.load_state_dict(state)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    if not sharded:
        return saved
    names = [name for name, _ in model.named_parameters()]
    return {"state": {names[index]: value for index, value in saved["state"].items()}}


def zip_record_offset(path: Path, name: str) -> int:
    """Where the bytes of the record `name` of the zip archive `path` begin (after its local header)."""
    with zipfile.ZipFile(path) as archive:
        header = archive.getinfo(name).header_offset
    with open(path, "rb") as f:
        f.seek(header)
        local = f.read(30)
    return header + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")


def byte_of(checkpoint: Path, layout: str, entry: str) -> Tuple[Path, int]:
    """A file of the checkpoint and the place of a byte in it of the train state's `entry` ("model" or "optimizer"): the
    middle of its largest record (one file) or of its longest range (sharded)."""
    weights = checkpoint / "lit_model.pth"
    if layout == "sharded":
        (shard, ranges), = model_ranges(weights, entry).items()
        offset, length = max(ranges, key=lambda span: span[1])
        return weights / shard, offset + length // 2
    with zipfile.ZipFile(weights) as archive:
        of_model = model_records(archive)[1:]
        storages = [info for info in archive.infolist() if "/data/" in info.filename]
    chosen = [info for info in storages if (info.filename in of_model) == (entry == "model")]
    largest = max(chosen, key=lambda info: info.file_size)
    return weights, zip_record_offset(weights, largest.filename) + largest.file_size // 2


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def model_dir(tmp_path) -> Tuple[Path, dict]:
    directory = tmp_path / "model"
    return directory, make_model_dir(directory, small_config())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_byte_of_the_optimizer_s_state_changed_leaves_the_model_read_whole(model_dir, tmp_path, monkeypatch, layout):
    import fabric_lin.sharded_checkpoint as sharded_checkpoint

    directory, state = model_dir
    checkpoint = training_checkpoint(directory, tmp_path / "run" / "final", sharded=layout == "sharded",
                                     optimizer=optimizer_state(state, sharded=layout == "sharded"))
    expected = generate(directory, prompt=PROMPT, max_new_tokens=8, temperature=0.0, device="cpu")
    flip(*byte_of(checkpoint, layout, "optimizer"))
    assert not verify_checkpoint(checkpoint).ok  # a resume's check, which reads the optimizer's state too
    assert generate(checkpoint, prompt=PROMPT, max_new_tokens=8, temperature=0.0, device="cpu") == expected
    asked = []  # what the sharded read asks DCP for: the model's entry alone
    load = sharded_checkpoint.load_in_this_process
    monkeypatch.setattr(sharded_checkpoint, "load_in_this_process",
                        lambda path, wanted, *args: (asked.append(sorted(wanted)), load(path, wanted, *args))[1])
    read = load_checkpoint(checkpoint, "generate").state_dict
    assert read.keys() == state.keys() and all(torch.equal(read[name], state[name]) for name in state)
    assert asked == ([["model"]] if layout == "sharded" else [])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_byte_of_the_model_changed_is_refused(model_dir, tmp_path, capsys, layout):
    directory, state = model_dir
    checkpoint = training_checkpoint(directory, tmp_path / "run" / "final", sharded=layout == "sharded",
                                     optimizer=optimizer_state(state, sharded=layout == "sharded"))
    path, offset = byte_of(checkpoint, layout, "model")
    flip(path, offset)
    err = cli_error(["generate", str(checkpoint), "--prompt", PROMPT, "--device", "cpu"], capsys)
    changed = ("lit_model.pth/__0_0.distcp's bytes of the model changed since it was written (CRC-32 " if layout == "sharded"
               else "lit_model.pth's bytes changed since it was written (its record lit_model/data/")
    assert err.startswith(f"fabric-lin generate: error: {checkpoint}: the checkpoint is damaged: {changed}"), err
    if layout == "one file":
        assert ", of the model, does not give the CRC-32 that its zip directory records)." in err
    assert err.endswith("It is not read; generate from an older checkpoint of the run\n"), err


def test_a_sharded_checkpoint_whose_manifest_has_no_checksum_of_the_model_is_checked_whole(model_dir, tmp_path, capsys):
    directory, state = model_dir
    checkpoint = training_checkpoint(directory, tmp_path / "run" / "final", sharded=True,
                                     optimizer=optimizer_state(state, sharded=True))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert all("model_crc32" in entry for name, entry in manifest["files"].items() if name.endswith(".distcp"))
    for entry in manifest["files"].values():
        entry.pop("model_crc32", None)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    flip(*byte_of(checkpoint, "sharded", "optimizer"))
    assert "the checkpoint is damaged: lit_model.pth/__0_0.distcp's bytes changed since it was written" in cli_error(
        ["generate", str(checkpoint), "--prompt", PROMPT, "--device", "cpu"], capsys)
    write_manifest(OneProcess(), checkpoint)  # as pretrain writes it, with the model's checksum
    assert generate(checkpoint, prompt=PROMPT, max_new_tokens=2, temperature=0.0, device="cpu").startswith(PROMPT)


def small_train_state() -> dict:
    """A train state of a few small tensors: the model's, the optimizer's beside them, and a counter."""
    generator = torch.Generator().manual_seed(0)
    model = {"wte.weight": torch.randn(5, 3, generator=generator), "head.weight": torch.randn(70, generator=generator)}
    optimizer = {"state": {"wte.weight": {"exp_avg": torch.randn(5, 3, generator=generator), "step": torch.tensor(1.0)}}}
    return {"model": model, "optimizer": optimizer, "iter_num": 4}


def test_the_model_s_ranges_hold_its_tensors_alone_and_their_checksum_is_of_those_bytes(tmp_path, monkeypatch):
    """Each byte range that model_ranges places the model in holds one of its tensors whole, as torch.load reads it back
    from those bytes alone, every tensor once and nothing else (not the optimizer's, not the counter), in the order of
    the file; the manifest's model_crc32 is zlib's CRC-32 of those bytes one after the other, however many blocks they
    are read in, as 8 hex digits (those of 0 where a shard holds none of the model)."""
    import io
    import zlib

    import torch.distributed.checkpoint as dcp

    import fabric_lin.model_bytes as model_bytes
    from fabric_lin.model_bytes import ranges_crc32, shard_ranges_once, with_model_checksum

    state = small_train_state()
    dcp.save(state, checkpoint_id=tmp_path / "lit_model.pth", no_dist=True)
    shard = tmp_path / "lit_model.pth" / "__0_0.distcp"
    data = shard.read_bytes()
    (name, ranges), = model_ranges(tmp_path / "lit_model.pth").items()
    assert name == shard.name and ranges == sorted(ranges) and len(ranges) == len(state["model"])
    read = [torch.load(io.BytesIO(data[offset:offset + length]), weights_only=True) for offset, length in ranges]
    assert sorted(tensor.numel() for tensor in read) == [15, 70]
    assert all(any(torch.equal(tensor, kept) for tensor in read) for kept in state["model"].values())
    monkeypatch.setattr(model_bytes, "READ_BLOCK", 100)  # each tensor's bytes in several reads
    expected = zlib.crc32(b"".join(data[offset:offset + length] for offset, length in ranges))
    entry = with_model_checksum(tmp_path, "lit_model.pth/__0_0.distcp", {"size": len(data)}, shard_ranges_once(tmp_path))
    assert entry == {"size": len(data), "model_crc32": f"{expected:08x}"}
    assert ranges_crc32(shard, []) == "00000000"


def one_file_checkpoint(directory: Path) -> Path:
    """A training checkpoint of `small_train_state` in one file, and its manifest (what verify_checkpoint reads)."""
    directory.mkdir()
    torch.save(small_train_state(), directory / "lit_model.pth")
    write_manifest(OneProcess(), directory)
    return directory


def test_a_one_file_checkpoint_whose_zip_directory_does_not_read_is_refused(tmp_path):
    """A byte of the zip archive's end record changed: the file is no zip archive any more, so its records cannot be
    told apart, and the whole file's CRC-32 refuses it, as it does a resume."""
    checkpoint = one_file_checkpoint(tmp_path / "final")
    weights = checkpoint / "lit_model.pth"
    assert verify_checkpoint(checkpoint, model_only=True).ok
    flip(weights, weights.stat().st_size - 22)  # the end of central directory record's signature
    assert not zipfile.is_zipfile(weights)
    for model_only in (True, False):
        check = verify_checkpoint(checkpoint, model_only=model_only)
        assert check.describe().startswith("lit_model.pth's bytes changed since it was written (CRC-32 "), model_only


def test_a_one_file_checkpoint_saved_without_zip_checksums_is_checked_whole(tmp_path):
    """torch.save with its CRC-32s turned off (torch.utils.serialization.config.save.compute_crc32) records 0 for each
    record, data.pkl's too: the file is whole, and was refused as damaged; a byte of it changed is refused by the whole
    file's CRC-32 in the manifest."""
    from torch.utils.serialization import config

    computed = config.save.compute_crc32  # (monkeypatch's undo would delete the setting: a config module's own)
    config.save.compute_crc32 = False
    try:
        checkpoint = one_file_checkpoint(tmp_path / "final")
    finally:
        config.save.compute_crc32 = computed
    weights = checkpoint / "lit_model.pth"
    with zipfile.ZipFile(weights) as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
        storages = [info for info in archive.infolist() if "/data/" in info.filename]
    largest = max(storages, key=lambda info: info.file_size)  # the model's head.weight
    assert verify_checkpoint(checkpoint, model_only=True).ok
    flip(weights, zip_record_offset(weights, largest.filename) + largest.file_size // 2)
    assert verify_checkpoint(checkpoint, model_only=True).describe().startswith(
        "lit_model.pth's bytes changed since it was written (CRC-32 ")
