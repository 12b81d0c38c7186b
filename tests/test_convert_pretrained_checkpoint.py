"""fabric_lin/convert/pretrained_checkpoint.py: a one-device training checkpoint -> model directory, verified against
its manifest first (damaged or manifest-less checkpoints refused), its compile prefixes stripped, cast on request,
pickled code refused; the converters' outputs: their file mode, and no directory left behind by a failed
conversion. (Sharded checkpoints: test_pretrain_sharded.py.)"""
import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.convert.model_dir import load_model_dir_weights
from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
from fabric_lin.model import GPT
from helpers import TouchOnUnpickle, assert_same_tensors, load_whole_checkpoint, write_checkpoint_dir_files


def trained_model(config: Config, steps: int = 2, compile_prefix: bool = False):
    torch.manual_seed(0)
    model = GPT(config)
    # pretrain's two parameter groups (weight decay, and none for norms and biases)
    from fabric_lin.model_setup import no_decay_parameter_names
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
    from lightning_fabric import Fabric

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


def with_manifest(ckpt_dir: Path) -> Path:
    """The manifest pretrain writes last into a checkpoint directory."""
    from lightning_fabric import Fabric

    from fabric_lin.checkpoint import write_manifest

    write_manifest(Fabric(accelerator="cpu", devices=1), ckpt_dir)
    return ckpt_dir


def test_single_device_checkpoint_converts_to_the_model_weights(tmp_path):
    config = Config.from_name("gla-debug")
    ckpt_dir, expected = fabric_single_device_checkpoint(tmp_path, config)
    out = tmp_path / "model"
    convert_pretrained_checkpoint(ckpt_dir, out)

    assert sorted(p.name for p in out.iterdir()) == ["lit_model.pth", "model_config.yaml", "tokenizer.model",
                                                     "tokenizer_config.json", "trained_with.json"]
    assert (out / "tokenizer.model").read_bytes() == (ckpt_dir / "tokenizer.model").read_bytes()
    # a checkpoint that records no tokenizer: the model directory records the one it copies
    recorded = json.loads((out / "trained_with.json").read_text())["tokenizer"]
    assert recorded["sha256"] == hashlib.sha256((ckpt_dir / "tokenizer.model").read_bytes()).hexdigest()
    assert recorded["vocab_size"] == 64
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


def test_a_training_checkpoint_or_run_is_never_an_output_dir(tmp_path):
    """--overwrite true lets a converter write into a non-empty directory, but never among a run's checkpoints: a model
    directory's lit_model.pth would replace a checkpoint's train state."""
    import shutil

    from fabric_lin.convert.hf import convert_to_hf

    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)
    other_step = shutil.copytree(ckpt_dir, ckpt_dir.parent / "step-00000004")
    saved = (other_step / "lit_model.pth").read_bytes()
    with pytest.raises(FileExistsError, match=rf"output_dir {other_step} is a training checkpoint, which a conversion "
                       r"does not write into \(its lit_model.pth would replace the checkpoint's\): choose another directory"):
        convert_pretrained_checkpoint(ckpt_dir, other_step, overwrite=True)
    assert (other_step / "lit_model.pth").read_bytes() == saved
    with pytest.raises(FileExistsError, match=rf"output_dir {ckpt_dir.parent} is a training run's directory \(it holds "
                       r"step-00000004, step-00000002\), which a conversion does not write into"):
        convert_pretrained_checkpoint(ckpt_dir, ckpt_dir.parent, overwrite=True)
    assert not (ckpt_dir.parent / "lit_model.pth").exists()
    convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    with pytest.raises(FileExistsError, match="is a training checkpoint"):
        convert_to_hf(tmp_path / "model", other_step, overwrite=True)
    assert sorted(p.name for p in other_step.iterdir()) == sorted(p.name for p in ckpt_dir.iterdir())
    # nor into prepared data (its tokenizer files, which its prepared.json records, would be the model's)
    from fabric_lin.data import Tokenizer
    from helpers import write_prepared

    data = tmp_path / "data"
    write_prepared(data, np.arange(64, dtype=np.uint16), Tokenizer(ckpt_dir))
    files_before = {p.name: p.read_bytes() for p in data.iterdir()}
    for convert in (convert_pretrained_checkpoint, convert_to_hf):
        with pytest.raises(FileExistsError, match=rf"^output_dir {data} is a prepared data directory \(it holds "
                           r"prepared.json\), which a conversion does not write into \(the model's tokenizer files would "
                           r"replace the data's\): choose another directory$"):
            convert(ckpt_dir if convert is convert_pretrained_checkpoint else tmp_path / "model", data, overwrite=True)
    assert {p.name: p.read_bytes() for p in data.iterdir()} == files_before
    # nor into a directory inside either: the model went with the checkpoint when its run pruned or replaced it, and
    # with the data when it was prepared again
    for inside, holder, kind in ((other_step / "model", other_step, "a training checkpoint"),
                                 (data / "models" / "a", data, "a prepared data directory")):
        with pytest.raises(FileExistsError, match=rf"^output_dir {inside} is inside {holder}, {kind}, whose files "):
            convert_pretrained_checkpoint(ckpt_dir, inside)
        assert not inside.exists() and not (data / "models").exists()
    # the weights file named in place of its checkpoint directory
    with pytest.raises(ValueError, match=rf"{ckpt_dir / 'lit_model.pth'} is the weights of the training checkpoint "
                       rf"{ckpt_dir}: pass that directory"):
        convert_pretrained_checkpoint(ckpt_dir / "lit_model.pth", tmp_path / "model2")


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


def test_config_mismatch_names_both_models(tmp_path):
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)
    Config.from_name("gla-debug", num_layers=2, hidden_size=256, num_heads=2).save(ckpt_dir / "model_config.yaml")
    with_manifest(ckpt_dir)  # written so: the manifest agrees, the model does not
    with pytest.raises(ValueError) as info:
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    assert str(info.value) == (
        f"{ckpt_dir / 'lit_model.pth'} holds a GLA model (1 layer, width 128; its layers hold attn.gk_proj.0.weight) and "
        f"{ckpt_dir / 'model_config.yaml'} describes gla-debug, a GLA model (2 layers, width 256): they were not written "
        f"together; put back the model_config.yaml written with these weights")
    assert not (tmp_path / "model" / "lit_model.pth").exists()


def test_pickled_code_in_checkpoint_is_refused(tmp_path):
    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)
    full = load_whole_checkpoint(ckpt_dir / "lit_model.pth")
    full["hook"] = TouchOnUnpickle(tmp_path / "pwned")
    torch.save(full, ckpt_dir / "lit_model.pth")
    with_manifest(ckpt_dir)  # a file made so on purpose comes with a manifest that fits it
    with pytest.raises(ValueError, match="never unpickled beyond tensors"):
        convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    assert not (tmp_path / "pwned").exists()


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
        convert_to_hf(tmp_path / "model", tmp_path / "hf")
    finally:
        os.umask(previous)
    modes.update({p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()})
    assert modes == {name: oct(0o640) for name in ("lit_model.pth", "model_config.yaml", "tokenizer.model",
                                                   "tokenizer_config.json", "trained_with.json", "model.safetensors",
                                                   "config.json")}


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


@pytest.mark.parametrize("command", ["convert_pretrained_checkpoint", "convert_to_hf"])
def test_a_full_disk_is_one_line_naming_the_file_and_leaves_no_model(tmp_path, command):
    """The output on a file system of 1.5 MiB, smaller than the model's weights (2 MB and more): torch.save's zip writer and
    safetensors report the failed write as errors of their own (a RuntimeError about file positions, a SafetensorError),
    which were tracebacks. The file system's error is the line, naming the file; the directory made for the output goes."""
    import fabric_lin_process
    from helpers import make_model_dir, run_with_a_small_tmpfs, small_config

    if command == "convert_pretrained_checkpoint":
        source, _ = fabric_single_device_checkpoint(tmp_path, Config.from_name("gla-debug", num_layers=1))
        written = "lit_model.pth"
    else:
        source = tmp_path / "model"
        make_model_dir(source, small_config())
        written = "model.safetensors"
    small, kept = tmp_path / "small", tmp_path / "kept"
    kept.mkdir()
    out = small / "model-out"
    result = run_with_a_small_tmpfs(small, "1536k", [*fabric_lin_process.FABRIC_LIN, command, str(source), "--output_dir",
                                                    str(out)], copy_to=kept)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.endswith(f"fabric-lin {command}: error: [Errno 28] No space left on device: '{out / written}'\n"), \
        result.stderr[-3000:]
    assert list(kept.iterdir()) == []


def test_a_model_of_another_kind_names_the_command_that_reads_it(tmp_path, capsys):
    """An fla export, LoRA adapters alone or a Hugging Face Llama given for a training checkpoint: each named as what it
    is with the command that reads it, where each was "not a training checkpoint: it has no lit_model.pth"."""
    from fabric_lin.convert.hf import convert_to_hf
    from helpers import cli_error, make_model_dir, small_config

    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "export")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (tmp_path / "llama").mkdir()  # what tells a Llama: its config.json's model_type
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    cases = {
        tmp_path / "export": f"an fla export: fabric-lin convert_from_hf {tmp_path / 'export'} --output_dir <DIR> makes a "
                             "model directory of it",
        tmp_path / "adapter": "LoRA adapters alone: merge them into the export they were trained on (merge_and_unload, "
                              "tutorials/finetune_lora.md) and convert the merged export with fabric-lin convert_from_hf",
        tmp_path / "llama": f"a Hugging Face Llama/Mistral directory: make a GLA model directory of it with: fabric-lin "
                            f"convert_from_llama --checkpoint_dir {tmp_path / 'llama'} --model_name <a GLA model of its "
                            "width and depth: fabric-lin pretrain list> --output_dir <DIR>",
    }
    for given, what in cases.items():
        err = cli_error(["convert_pretrained_checkpoint", str(given), "--output_dir", str(tmp_path / "out")], capsys)
        assert err == f"fabric-lin convert_pretrained_checkpoint: error: {given} is not a training checkpoint but {what}\n"
    assert not (tmp_path / "out").exists()


def test_an_output_dir_that_holds_a_model_says_overwrite_replaces_it(tmp_path, capsys):
    """The end of a run continued from checkpoints/gla-debug names checkpoints/gla-debug for its model directory too:
    converting into it is refused saying that --overwrite true would replace the model there, where the refusal only
    said to pass --overwrite true."""
    from helpers import cli_error

    config = Config.from_name("gla-debug", num_layers=1)
    ckpt_dir, _ = fabric_single_device_checkpoint(tmp_path, config)
    convert_pretrained_checkpoint(ckpt_dir, tmp_path / "model")
    before = (tmp_path / "model" / "lit_model.pth").read_bytes()
    err = cli_error(["convert_pretrained_checkpoint", str(ckpt_dir), "--output_dir", str(tmp_path / "model")], capsys)
    assert err == (f"fabric-lin convert_pretrained_checkpoint: error: output_dir {tmp_path / 'model'} holds a model "
                   "directory already: --overwrite true would replace its model with this one; to keep it, give another "
                   "--output_dir\n")
    assert (tmp_path / "model" / "lit_model.pth").read_bytes() == before


def test_an_output_dir_is_required(tmp_path):
    with pytest.raises(ValueError, match=r"^--output_dir is required: where to write the model directory$"):
        convert_pretrained_checkpoint(tmp_path)


def test_a_distributed_checkpoint_of_another_program_names_what_it_is(tmp_path, capsys):
    """flame (and torchtitan) save torch.distributed.checkpoint's files in <dump folder>/checkpoint/step-N/: given where
    a training checkpoint goes, the step directory or the one above it was "not a training checkpoint: it has no
    lit_model.pth", which a flame user reads as a file to find. Its shards are no fabric-lin checkpoint, and the way
    from them goes through flame's converter and convert_from_hf; the shards of a fabric-lin checkpoint taken out of it
    (Fabric's meta.pt beside them) are named so."""
    import torch.distributed.checkpoint as dcp

    from helpers import cli_error

    step = tmp_path / "exp" / "checkpoint" / "step-100"
    dcp.save({"model": GPT(Config.from_name("gla-debug", num_layers=1)).state_dict()}, checkpoint_id=step, no_dist=True)
    assert (step / ".metadata").is_file()
    for given in (step, step.parent):
        err = cli_error(["convert_pretrained_checkpoint", str(given), "--output_dir", str(tmp_path / "model")], capsys)
        assert err.startswith(f"fabric-lin convert_pretrained_checkpoint: error: {given} "
                              + ("is" if given == step else "holds step-100,")
                              + " a torch.distributed.checkpoint of another program (flame and torchtitan save theirs as "
                                "checkpoint/step-N), not a training checkpoint of fabric-lin's")
        assert err.endswith(f"(flame: python -m flame.utils.convert_dcp_to_hf --path {tmp_path / 'exp'} --step 100 "
                            "--config <model config> --tokenizer <tokenizer>) and give fabric-lin convert_from_hf the "
                            "directory it writes\n")
    torch.save({}, step / "meta.pt")
    err = cli_error(["convert_pretrained_checkpoint", str(step), "--output_dir", str(tmp_path / "model")], capsys)
    assert err == (f"fabric-lin convert_pretrained_checkpoint: error: {step} holds the shards of a sharded training "
                   f"checkpoint's lit_model.pth (Fabric's meta.pt beside them) without the checkpoint around them: give "
                   f"the checkpoint directory as pretrain wrote it, with its step.json and manifest.json\n")
    assert not (tmp_path / "model").exists()


def test_a_litgpt_checkpoint_is_named_as_such(tmp_path, capsys):
    """A LitGPT checkpoint directory holds a lit_model.pth and a model_config.yaml too, LitGPT's: convert_pretrained_
    checkpoint took it for a model directory of fabric-lin's ("convert_pretrained_checkpoint's output"), and the
    commands that read model directories listed a dozen of its keys as unknown."""
    import yaml

    from helpers import cli_error

    litgpt = tmp_path / "checkpoints" / "meta-llama" / "Llama-2-7b-hf"
    litgpt.mkdir(parents=True)
    (litgpt / "model_config.yaml").write_text(yaml.safe_dump(dict(
        name="Llama-2-7b-hf", hf_config={"name": "Llama-2-7b-hf", "org": "meta-llama"}, block_size=4096, vocab_size=32000,
        padding_multiple=64, padded_vocab_size=32000, n_layer=2, n_head=4, n_embd=64, rotary_percentage=1.0,
        parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=128)))
    torch.save({"transformer.wte.weight": torch.zeros(8, 64), "lm_head.weight": torch.zeros(8, 64)}, litgpt / "lit_model.pth")
    expected = (f"{litgpt / 'model_config.yaml'} is LitGPT's model config (n_embd, n_layer, block_size), not fabric-lin's: "
                f"{litgpt} is a LitGPT checkpoint, which no fabric-lin command reads; for a Llama or Mistral, give "
                f"fabric-lin convert_from_llama the Hugging Face directory (safetensors) it was downloaded from\n")
    for command in ("convert_pretrained_checkpoint", "convert_to_hf"):
        err = cli_error([command, str(litgpt), "--output_dir", str(tmp_path / "out")], capsys)
        assert err == f"fabric-lin {command}: error: {expected}"
    assert not (tmp_path / "out").exists()
