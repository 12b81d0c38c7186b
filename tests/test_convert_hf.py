"""convert_to_hf / convert_from_hf: flash-linear-attention's GLAForCausalLM format, both ways: the round trip bit for
bit, fla's names, config fields, shards and tokenizer files, overwriting an earlier export, and what either direction
refuses in one line. (That an export computes fla's logits: test_convert_hf_logits.py.)"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fabric_lin.config import Config
from fabric_lin.convert.hf import config_from_fla, convert_from_hf, convert_to_hf, fla_config, to_hf_name
from fabric_lin.convert.model_dir import load_model_dir_weights
from helpers import make_model_dir, small_config


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_embeddings": True}, {"num_heads": 4, "num_kv_heads": 2}, {"block_type": "transformer", "num_heads": 4},
     {"head_norm_eps": 1e-5}, {"attn_layers": [1], "attn_num_heads": 4, "attn_num_kv_heads": 2},
     {"block_type": "gdn", "head_dim": 48, "expand_v": 2.0},
     {"block_type": "gdn", "head_dim": 32, "expand_v": 1.5, "attn_layers": [0], "attn_num_heads": 2, "rope_base": 500.0},
     {"norm_eps": 1e-5, "max_seq_length": 4096, "initializer_range": 0.01},
     {"block_type": "gdn", "head_dim": 48, "expand_v": 2.0, "conv_size": 3},
     {"block_type": "deltanet", "expand_k": 1.0, "expand_v": 1.0, "conv_size": 2},
     {"expand_k": 1.0, "intermediate_size": 384}],
    ids=["gla", "gla-tied", "gla-gqa", "transformer", "gla-own-head-eps", "gla-hybrid", "gdn", "gdn-hybrid",
         "gla-own-norm-eps-and-length", "gdn-conv-3", "deltanet-conv-2", "gla-wide-keys-own-mlp"],
)
def test_round_trip_is_exact(tmp_path, overrides):
    config = small_config(**overrides)
    state = make_model_dir(tmp_path / "model", config)
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "back")

    assert Config.from_checkpoint(tmp_path / "back") == config
    back = load_model_dir_weights(tmp_path / "back")
    assert sorted(back) == sorted(state)
    for name in state:
        assert torch.equal(back[name], state[name]), name
    assert (tmp_path / "back" / "tokenizer.model").read_bytes() == (tmp_path / "model" / "tokenizer.model").read_bytes()


def test_export_uses_fla_names_and_config_fields(tmp_path):
    config = small_config()
    state = make_model_dir(tmp_path / "model", config)
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json", "trained_with.json"]

    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert len(hf) == len(state)
    assert torch.equal(hf["model.embeddings.weight"], state["embeddings.weight"])
    assert torch.equal(hf["lm_head.weight"], state["lm_head.weight"])
    assert torch.equal(hf["model.layers.1.attn.g_norm_swish_gate.weight"], state["layers.1.attn.g_norm.weight"])
    assert torch.equal(hf["model.layers.0.attn.gk_proj.1.bias"], state["layers.0.attn.gk_proj.1.bias"])
    assert torch.equal(hf["model.norm.weight"], state["norm.weight"])

    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "gla" and cfg["architectures"] == ["GLAForCausalLM"]
    expected = dict(
        hidden_size=128, num_hidden_layers=2, num_heads=2, num_kv_heads=2, expand_k=0.5, expand_v=1.0,
        intermediate_size=config.intermediate_size, vocab_size=64, norm_eps=1e-6, tie_word_embeddings=False,
        attn_mode="chunk", use_short_conv=False, use_output_gate=True, hidden_act="swish", fuse_norm=True,
        elementwise_affine=True, feature_map=None, clamp_min=None, attn=None, bos_token_id=1, eos_token_id=2,
        torch_dtype="float32",
    )
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["fabric_lin"] == {"name": "gla-debug"}  # the head norm's eps is fla's (norm_eps): nothing to record
    tok = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert (tok["bos_token"], tok["eos_token"], tok["add_bos_token"]) == ("<s>", "</s>", False)


def test_tied_export_has_no_lm_head_and_bf16_cast(tmp_path):
    make_model_dir(tmp_path / "model", small_config(tie_embeddings=True))
    convert_to_hf(tmp_path / "model", tmp_path / "hf", dtype="bfloat16")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" not in hf and {t.dtype for t in hf.values()} == {torch.bfloat16}
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "bfloat16"


def test_a_tied_export_that_keeps_its_lm_head_imports(tmp_path):
    """A writer may keep a tied model's lm_head.weight (a copy of the embeddings) in the safetensors: imported, the model
    directory holds the embeddings alone, as the tied model has them."""
    state = make_model_dir(tmp_path / "model", small_config(tie_embeddings=True))
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    save_file({**hf, "lm_head.weight": hf["model.embeddings.weight"].clone()}, tmp_path / "hf" / "model.safetensors")
    convert_from_hf(tmp_path / "hf", tmp_path / "back")
    back = load_model_dir_weights(tmp_path / "back")
    assert sorted(back) == sorted(state) and torch.equal(back["embeddings.weight"], state["embeddings.weight"])


def test_a_llama_directory_given_to_convert_from_hf_names_convert_from_llama(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    with pytest.raises(ValueError, match=r"model_type 'llama' is a Llama/Mistral model, not one of fla's; make a GLA model "
                                         rf"directory from it with: fabric-lin convert_from_llama --checkpoint_dir {tmp_path / 'llama'} "):
        convert_from_hf(tmp_path / "llama", tmp_path / "out")


def test_sharded_export_with_index(tmp_path):
    state = make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "hf", max_shard_gb=100_000 / 2**30)  # 100 kB shards
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (tmp_path / "hf" / "model.safetensors").exists()
    # named as transformers names them, counting from 1
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    # filled in order: every shard within 100 kB but for a tensor larger than that alone (the MLP's 256 kB), and
    # none could have taken the first tensor of the next one without passing it
    contents = {f: load_file(tmp_path / "hf" / f) for f in shards}
    sizes = {f: sum(t.numel() * 4 for t in tensors.values()) for f, tensors in contents.items()}
    first_of = {}
    for name in state:
        first_of.setdefault(index["weight_map"][to_hf_name(name)], state[name].numel() * 4)
    assert all(sizes[f] <= 100_000 or len(contents[f]) == 1 for f in shards)
    assert all(sizes[a] + first_of[b] > 100_000 for a, b in zip(shards[:-1], shards[1:]))
    convert_from_hf(tmp_path / "hf", tmp_path / "back")
    back = load_model_dir_weights(tmp_path / "back")
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("size", [0.0, -1.0])
def test_a_shard_size_of_nothing_is_refused(tmp_path, size):
    # 0 wrote one file per tensor; nothing is written for it now. The line names the option alone: the CLI names the
    # command before it
    make_model_dir(tmp_path / "model", small_config())
    with pytest.raises(ValueError, match=f"^--max_shard_gb must be a size above 0 \\(GiB per safetensors file\\), got {size}"):
        convert_to_hf(tmp_path / "model", tmp_path / "hf", max_shard_gb=size)
    assert not (tmp_path / "hf").exists()


def test_export_of_what_is_not_a_model_directory_names_what_it_is(tmp_path, capsys):
    """convert_to_hf given an fla export, a training run's out_dir, a file or nothing: each named as what it is, with
    the command that makes a model directory of it (as generate, which reads model directories too), where it was
    "model_config.yaml does not exist" for all four."""
    from helpers import cli_error

    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "export")
    (tmp_path / "run" / "step-00000002").mkdir(parents=True)
    (tmp_path / "text.txt").write_text("a file")
    out = ["--output_dir", str(tmp_path / "out")]
    prefix = "fabric-lin convert_to_hf: error: "
    assert cli_error(["convert_to_hf", str(tmp_path / "export"), *out], capsys) == (
        f"{prefix}{tmp_path / 'export'} is a Hugging Face directory (config.json, no model_config.yaml), e.g. an fla "
        f"export: convert_to_hf reads a model directory; make one with: fabric-lin convert_from_hf {tmp_path / 'export'} "
        "--output_dir <DIR>\n")
    assert cli_error(["convert_to_hf", str(tmp_path / "run"), *out], capsys) == (
        f"{prefix}{tmp_path / 'run'} is a training run's directory (it holds step-00000002): convert_to_hf reads a model "
        f"directory; make one from a checkpoint with: fabric-lin convert_pretrained_checkpoint "
        f"{tmp_path / 'run' / 'step-00000002'} --output_dir <DIR>\n")
    for given in (tmp_path / "text.txt", tmp_path / "nothing"):
        assert cli_error(["convert_to_hf", str(given), *out], capsys) == f"{prefix}model_dir {str(given)!r} is not a directory\n"
    assert not (tmp_path / "out").exists()


def test_import_of_what_is_not_an_fla_export_names_what_it_is(tmp_path, capsys):
    """convert_from_hf given a model directory (the wrong way round), a training checkpoint, a run's out_dir, a file of
    an export, or nothing: each named as what it is, with the command that reads it, where each was "<path>/config.json
    does not exist" (for the file, a path below it)."""
    from helpers import cli_error

    config = small_config()
    make_model_dir(tmp_path / "model", config)
    convert_to_hf(tmp_path / "model", tmp_path / "export")
    checkpoint = tmp_path / "run" / "final"  # what tells a training checkpoint: step.json beside lit_model.pth
    checkpoint.mkdir(parents=True)
    config.save(checkpoint / "model_config.yaml")
    (checkpoint / "lit_model.pth").write_bytes(b"")
    (checkpoint / "step.json").write_text('{"step_count": 2}')
    out = ["--output_dir", str(tmp_path / "out")]
    prefix = "fabric-lin convert_from_hf: error: "
    to_model_dir = "--output_dir <DIR> makes a model directory of it\n"
    cases = {
        tmp_path / "model": (f"{tmp_path / 'model'} is a model directory (model_config.yaml) already, not an fla export; to "
                             f"export it in fla's format (the other way): fabric-lin convert_to_hf {tmp_path / 'model'} "
                             "--output_dir <DIR>\n"),
        checkpoint: (f"{checkpoint} is a training checkpoint, not an fla export: fabric-lin convert_pretrained_checkpoint "
                     f"{checkpoint} {to_model_dir}"),
        tmp_path / "run": (f"{tmp_path / 'run'} is a training run's directory (it holds final), not an fla export: "
                           f"fabric-lin convert_pretrained_checkpoint {checkpoint} {to_model_dir}"),
        tmp_path / "export" / "model.safetensors": (f"{tmp_path / 'export' / 'model.safetensors'} is a file: give "
                                                    f"convert_from_hf the export that holds it, {tmp_path / 'export'}\n"),
        tmp_path / "nothing": (f"{tmp_path / 'nothing'} does not exist: expected an fla export (config.json and "
                               "safetensors, as convert_to_hf writes them)\n"),
    }
    for given, message in cases.items():
        assert cli_error(["convert_from_hf", str(given), *out], capsys) == prefix + message
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_with_more_pieces_than_the_model_has_embeddings_is_not_converted(tmp_path, capsys):
    """A model directory or an export that holds no record of its tokenizer and a tokenizer.model of 80 pieces beside
    its model's 64 embeddings: neither converter writes anything. Both copied the tokenizer and recorded it in the
    output's trained_with.json as the one the weights were trained with; generate refused the result only later."""
    import shutil

    from helpers import cli_error, train_sentencepiece

    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "export")
    train_sentencepiece(tmp_path / "larger", vocab_size=80)
    for directory, command in ((tmp_path / "model", "convert_to_hf"), (tmp_path / "export", "convert_from_hf")):
        (directory / "trained_with.json").unlink(missing_ok=True)  # the export's, which convert_to_hf wrote
        shutil.copy(tmp_path / "larger" / "tokenizer.model", directory / "tokenizer.model")
        err = cli_error([command, str(directory), "--output_dir", str(tmp_path / "out")], capsys)
        assert err.startswith(f"fabric-lin {command}: error: {directory}: its tokenizer has 80 pieces and its model 64 "
                              f"embeddings, so the tokenizer is not the model's ({directory / 'tokenizer.model'} "
                              "(vocab_size=80, "), err
        assert not (tmp_path / "out").exists()


def test_lora_adapters_alone_given_for_a_model_name_the_merged_export(tmp_path, capsys):
    """The adapter/ directory of tutorials/finetune_lora.md (peft's save_pretrained of the adapters alone) given where a
    model goes: each command says what it is and which directory to give instead (generate said tokenizer.model
    does not exist, convert_from_hf that config.json does not)."""
    from helpers import cli_error

    adapters = tmp_path / "lora" / "adapter"  # as peft 0.21 writes it
    adapters.mkdir(parents=True)
    (adapters / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": "hf/gla-debug", "r": 8, "lora_alpha": 16,
         "target_modules": ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj"], "task_type": None}))
    save_file({"base_model.model.model.layers.0.attn.q_proj.lora_A.weight": torch.zeros(8, 64)},
              str(adapters / "adapter_model.safetensors"))
    (adapters / "README.md").write_text("---\nlibrary_name: peft\n---\n")
    what = (f"{adapters} holds LoRA adapters alone (peft's adapter_config.json), not a model: merge them into the "
            f"export they were trained on (merge_and_unload, tutorials/finetune_lora.md) and give ")
    model_dir = "the model directory that fabric-lin convert_from_hf makes of the merged export\n"
    out = ["--output_dir", str(tmp_path / "out")]
    cases = {
        "generate": ([str(adapters)], "generate the merged export\n"),
        "convert_to_hf": ([str(adapters), *out], "convert_to_hf " + model_dir),
        "pretrain": (["--model_name", "gla-debug", "--train.max_steps", "1", "--out_dir", str(tmp_path / "out"),
                      "--initial_checkpoint_dir", str(adapters)], "--initial_checkpoint_dir " + model_dir),
        "convert_from_hf": ([str(adapters), *out], "convert_from_hf the merged export\n"),
        "evaluate": ([str(adapters), "--max_batches", "0"], "evaluate the merged export\n"),
    }
    for command, (args, fix) in cases.items():
        assert cli_error([command, *args], capsys) == f"fabric-lin {command}: error: {what}{fix}", command
    assert not (tmp_path / "out").exists() and not (adapters / "evaluate").exists()


def test_export_refuses_what_fla_cannot_express(tmp_path):
    make_model_dir(tmp_path / "model", small_config(gate_low_rank_dim=32))
    with pytest.raises(ValueError, match="fla's GLA fixes .*gate_low_rank_dim': 32"):
        convert_to_hf(tmp_path / "model", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_import_refuses_unsupported_fla_features_and_bad_files(tmp_path):
    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())

    cfg_path.write_text(json.dumps({**cfg, "use_short_conv": True, "clamp_min": -1.0}))
    with pytest.raises(ValueError, match=r"no equivalent of use_short_conv=True .*clamp_min=-1.0"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")
    cfg_path.write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(ValueError, match="model_type 'mamba' is not supported"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")

    cfg_path.write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"hf holds a GLA model \(2 layers, .* and .*config.json describes gla-debug, a GLA "
                                         r"model \(3 layers, width 128\): .* put back the config.json written with these"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")

    cfg_path.write_text(json.dumps(cfg))
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    hf["model.layers.0.attn.q_proj.weight"] = hf["model.layers.0.attn.q_proj.weight"][:, :5].contiguous()
    hf["model.layers.0.attn.q_conv1d.weight"] = torch.zeros(3)
    save_file(hf, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ValueError) as info:
        convert_from_hf(tmp_path / "hf", tmp_path / "back")
    assert "unexpected (1): layers.0.attn.q_conv1d.weight" in str(info.value)
    assert "layers.0.attn.q_proj.weight: shape (64, 5), expected (64, 128)" in str(info.value)


def test_gdn_import_refuses_what_fabric_lin_cannot_express(tmp_path):
    make_model_dir(tmp_path / "model", small_config(block_type="gdn", head_dim=48, expand_v=2.0))
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for change, message in [
        ({"allow_neg_eigval": True, "use_gate": False}, r"no equivalent of use_gate=False .*allow_neg_eigval=True"),
        ({"num_v_heads": 4}, r"num_v_heads=4 \(supported: 2\)"),
        ({"output_gate_activation": "sigmoid"}, r"output_gate_activation='sigmoid'"),
        ({"head_dim": None}, r"missing or non-integer fields \['head_dim'\]"),
        ({"attn": [{"layers": [0], "num_heads": 4}, {"layers": [1], "num_heads": 2}]}, r"one set of attention heads"),
        ({"attn": {"layers": [1], "num_heads": 4, "window_size": 512}}, r"window_size=512"),
    ]:
        cfg_path.write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            convert_from_hf(tmp_path / "hf", tmp_path / "back")
    # a mismatched file is refused with the list of differences
    cfg_path.write_text(json.dumps(cfg))
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    hf["model.layers.0.attn.A_log"] = torch.zeros(3)
    del hf["model.layers.1.attn.v_conv1d.weight"]
    save_file(hf, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ValueError) as info:
        convert_from_hf(tmp_path / "hf", tmp_path / "back")
    assert "missing (1): layers.1.attn.v_conv1d.weight" in str(info.value)
    assert "layers.0.attn.A_log: shape (3,), expected (2,)" in str(info.value)
    assert not (tmp_path / "back").exists()


def test_index_may_not_point_outside_the_directory(tmp_path):
    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "hf", max_shard_gb=100_000 / 2**30)
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="points outside"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")


def test_pickle_weights_are_not_read(tmp_path):
    (tmp_path / "hf").mkdir()
    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "hf", overwrite=True)
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only safetensors are read"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")


def test_safetensors_beside_pickled_weights_are_refused(tmp_path, capsys):
    """A merged model saved with safe_serialization=False into the directory of an earlier export: the stale
    safetensors would be read without a word (as transformers reads them), so the two formats are refused."""
    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    torch.save(load_file(tmp_path / "hf" / "model.safetensors"), tmp_path / "hf" / "pytorch_model.bin")
    from helpers import cli_error

    assert cli_error(["convert_from_hf", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "back")], capsys) == (
        f"fabric-lin convert_from_hf: error: {tmp_path / 'hf'} holds weights in two formats, safetensors and "
        "pytorch_model.bin: which are meant is unclear (only the safetensors would be read); remove the stale ones, or "
        "save again into an empty directory with safe_serialization=True\n")
    assert not (tmp_path / "back").exists()


def test_sharded_weights_in_both_formats_and_a_bin_of_another_name(tmp_path):
    """The two formats refused when either is sharded (transformers names shards model-00001-of-00002.safetensors
    and pytorch_model-00001-of-00002.bin), and a .bin alone refused whatever its name."""
    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "hf", max_shard_gb=100_000 / 2**30)
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 1 and "model.safetensors" not in shards
    torch.save({}, tmp_path / "hf" / "pytorch_model-00001-of-00002.bin")
    with pytest.raises(ValueError, match="holds weights in two formats, safetensors and pytorch_model-00001-of-00002"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")
    for shard in shards:
        (tmp_path / "hf" / shard).unlink()
    (tmp_path / "hf" / "pytorch_model-00001-of-00002.bin").rename(tmp_path / "hf" / "model.bin")
    with pytest.raises(ValueError, match="holds PyTorch .bin weights; only safetensors are read"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_fla_trained_checkpoint_without_fabric_lin_key(tmp_path, monkeypatch):
    # as fla's own save_pretrained writes it: no "fabric_lin" entry, fuse_norm false -> attn.g_norm
    state = make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "flame-gla")
    cfg_path = tmp_path / "flame-gla" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["fabric_lin"]
    cfg.update(fuse_norm=False, num_kv_heads=None, intermediate_size=None, hidden_ratio=4)
    cfg_path.write_text(json.dumps(cfg))
    hf = load_file(tmp_path / "flame-gla" / "model.safetensors")
    hf = {k.replace("g_norm_swish_gate", "g_norm"): v for k, v in hf.items()}
    save_file(hf, tmp_path / "flame-gla" / "model.safetensors")

    convert_from_hf(tmp_path / "flame-gla", tmp_path / "back")
    config = Config.from_checkpoint(tmp_path / "back")
    # fla normalises heads with norm_eps; the MLP width follows from hidden_ratio as in fla's GatedMLP
    assert (config.name, config.head_norm_eps, config.num_kv_heads, config.intermediate_size) == ("flame-gla", 1e-6, 2, 512)
    back = load_model_dir_weights(tmp_path / "back")
    assert all(torch.equal(back[k], state[k]) for k in state)
    monkeypatch.chdir(tmp_path / "flame-gla")  # given as `.`: still named after its directory, not ''
    convert_from_hf(Path("."), tmp_path / "back-from-inside")
    assert Config.from_checkpoint(tmp_path / "back-from-inside").name == "flame-gla"


@pytest.mark.parametrize("first_sharded", [True, False], ids=["sharded-then-single", "single-then-sharded"])
def test_overwrite_leaves_only_the_latest_exports_weights(tmp_path, first_sharded):
    old = make_model_dir(tmp_path / "old", small_config(), seed=0)
    new = make_model_dir(tmp_path / "new", small_config(), seed=1)
    assert not torch.equal(old["embeddings.weight"], new["embeddings.weight"])
    shard_gb, single_gb = 100_000 / 2**30, 5.0
    convert_to_hf(tmp_path / "old", tmp_path / "hf", max_shard_gb=shard_gb if first_sharded else single_gb)
    convert_to_hf(tmp_path / "new", tmp_path / "hf", overwrite=True, max_shard_gb=single_gb if first_sharded else shard_gb)

    convert_from_hf(tmp_path / "hf", tmp_path / "back")
    back = load_model_dir_weights(tmp_path / "back")
    assert sorted(back) == sorted(new)
    for name in new:
        assert torch.equal(back[name], new[name]), name
    weights = sorted(p.name for p in (tmp_path / "hf").glob("model*"))
    if first_sharded:
        assert weights == ["model.safetensors"]
    else:  # no model.safetensors left for transformers to prefer, and no shard outside the index
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        assert weights == sorted(set(index["weight_map"].values()) | {"model.safetensors.index.json"})


def test_overwrite_replaces_a_model_of_the_other_format(tmp_path):
    """An export written over a model directory, and a model directory over an export, leave one model: the readers
    of each format (generate reads lit_model.pth and model_config.yaml, convert_from_hf config.json and the
    safetensors) would otherwise each find a model, a different one."""
    old = make_model_dir(tmp_path / "old", small_config(), seed=0)
    new = make_model_dir(tmp_path / "new", small_config(), seed=1)
    convert_to_hf(tmp_path / "old", tmp_path / "old_hf")
    convert_to_hf(tmp_path / "new", tmp_path / "new_hf")
    tokenizer_files = ["tokenizer.model", "tokenizer_config.json", "trained_with.json"]
    (tmp_path / "old" / "notes.txt").write_text("the user's own file stays")

    convert_to_hf(tmp_path / "new", tmp_path / "old", overwrite=True)  # an export over the old model directory
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == sorted(
        ["config.json", "model.safetensors", "notes.txt", *tokenizer_files])
    convert_from_hf(tmp_path / "new_hf", tmp_path / "old_hf", overwrite=True)  # a model directory over the old export
    assert sorted(p.name for p in (tmp_path / "old_hf").iterdir()) == sorted(["lit_model.pth", "model_config.yaml", *tokenizer_files])
    back = load_model_dir_weights(tmp_path / "old_hf")
    assert not torch.equal(old["embeddings.weight"], new["embeddings.weight"])
    assert all(torch.equal(back[name], new[name]) for name in new)


def test_overwrite_removes_the_earlier_models_evaluation(tmp_path):
    """evaluate writes a model directory's or an export's results into its evaluate/ (naming the directory, not the
    weights): left there by an overwrite, they were taken for the new model's, and a new evaluation was refused as
    one of an earlier evaluation. They go with the earlier model; other files of evaluate/ stay."""
    make_model_dir(tmp_path / "old", small_config(), seed=0)
    make_model_dir(tmp_path / "new", small_config(), seed=1)
    convert_to_hf(tmp_path / "old", tmp_path / "hf")
    for directory in (tmp_path / "old", tmp_path / "hf"):
        (directory / "evaluate").mkdir()
        for name in ("evaluate.json", "loss_by_position.png"):
            (directory / "evaluate" / name).write_text("the earlier model's")
    (tmp_path / "hf" / "evaluate" / "notes.txt").write_text("the user's own file stays")
    convert_to_hf(tmp_path / "new", tmp_path / "hf", overwrite=True)
    assert [p.name for p in (tmp_path / "hf" / "evaluate").iterdir()] == ["notes.txt"]
    convert_from_hf(tmp_path / "hf", tmp_path / "old", overwrite=True)
    assert not (tmp_path / "old" / "evaluate").exists()


def test_an_export_over_a_hugging_face_model_is_read_with_its_own_tokenizer(tmp_path):
    """An export written with --overwrite true over a directory of a Hugging Face model that save_pretrained wrote: its
    tokenizer.json stayed, which transformers' AutoTokenizer reads before the export's tokenizer.model, and its
    generation_config.json, whose end-of-text id generate takes: the export was read with the earlier model's."""
    transformers = pytest.importorskip("transformers")
    import sentencepiece as spm

    from helpers import train_sentencepiece

    make_model_dir(tmp_path / "model", small_config())  # a tokenizer of 64 pieces
    train_sentencepiece(tmp_path / "other", vocab_size=80, sentence="another tokenizer, for model {} of another kind")
    (tmp_path / "other" / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    transformers.AutoTokenizer.from_pretrained(tmp_path / "other").save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 79}')
    assert (tmp_path / "hf" / "tokenizer.json").is_file()

    convert_to_hf(tmp_path / "model", tmp_path / "hf", overwrite=True)
    read = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    pieces = spm.SentencePieceProcessor(model_file=str(tmp_path / "model" / "tokenizer.model"))
    assert len(read) == 64 and read.convert_ids_to_tokens(list(range(64))) == [pieces.IdToPiece(i) for i in range(64)]
    # without a generation_config.json, generate takes the ids of config.json, which are the export's
    assert not (tmp_path / "hf" / "generation_config.json").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == pieces.eos_id()


def test_directory_mixing_two_exports_is_refused(tmp_path):
    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "single")
    convert_to_hf(tmp_path / "model", tmp_path / "hf", max_shard_gb=100_000 / 2**30)
    (tmp_path / "hf" / "model.safetensors").write_bytes((tmp_path / "single" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"holds both model\.safetensors and model\.safetensors\.index\.json.*two exports"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")


def test_copied_tokenizer_config_gets_add_bos_token_false(tmp_path, capsys):
    make_model_dir(tmp_path / "model", small_config())
    llama2 = {  # Llama-2's tokenizer_config.json, abridged
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False},
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": False,
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": None,
        "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
    }
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(llama2))
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    exported = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert exported == {**llama2, "add_bos_token": False}
    assert list(exported) == list(llama2)
    assert "add_bos_token true -> false" in capsys.readouterr().out
    del llama2["add_bos_token"]  # absent: LlamaTokenizer adds a BOS all the same
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(llama2))
    convert_to_hf(tmp_path / "model", tmp_path / "hf-without-the-key")
    assert json.loads((tmp_path / "hf-without-the-key" / "tokenizer_config.json").read_text())["add_bos_token"] is False


def test_an_interrupted_export_leaves_no_file_of_it(tmp_path, monkeypatch):
    """Ctrl-C (or a full disk) while the tokenizer is copied left model.safetensors and config.json, an export that
    transformers loads, without its tokenizer; a directory that was there before keeps its own files."""
    from fabric_lin.convert import hf

    make_model_dir(tmp_path / "model", small_config())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf, "copy_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_to_hf(tmp_path / "model", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("the user's own file stays")
    with pytest.raises(KeyboardInterrupt):
        convert_to_hf(tmp_path / "model", tmp_path / "kept", overwrite=True)
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("overrides", [{}, {"block_type": "gdn", "head_dim": 48, "expand_v": 2.0}], ids=["gla", "gdn"])
def test_keys_absent_from_config_json_take_flas_defaults(tmp_path, overrides):
    # a config.json written by hand may leave out what fla's config classes default (GLAConfig, GatedDeltaNetConfig:
    # untied embeddings, norm_eps 1e-6, 2048 positions, initializer_range 0.02; GLA's expand_k 0.5 and expand_v 1,
    # GDN's expand_v 2 and conv_size 4); the model here has those values, so its round trip stays exact
    config = small_config(**overrides)
    state = make_model_dir(tmp_path / "model", config)
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    defaulted = ["tie_word_embeddings", "norm_eps", "max_position_embeddings", "initializer_range", "expand_v"]
    defaulted += ["expand_k"] if config.block_type == "gla" else ["conv_size"]
    for key in defaulted:
        del cfg[key]
    cfg_path.write_text(json.dumps(cfg))
    convert_from_hf(tmp_path / "hf", tmp_path / "back")
    assert Config.from_checkpoint(tmp_path / "back") == config
    back = load_model_dir_weights(tmp_path / "back")
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("name", ["gla-debug", "transformer-debug", "gdn-debug", "deltanet-debug"])
def test_attention_residuals_of_every_family_are_refused(tmp_path, name):
    """fla's attnres_block_size replaces the residual sums with learned mixes of earlier layers; fabric-lin's blocks
    have plain residuals, so no family may read such a config.json as one of its models."""
    hf = fla_config(Config.from_name(name, num_layers=2))
    path = tmp_path / "config.json"
    with pytest.raises(ValueError, match=rf"{path}: .*no equivalent of attnres_block_size=2 \(supported: None\)"):
        config_from_fla({**hf, "attnres_block_size": 2}, path, "x")


def test_a_null_rope_theta_is_refused_and_a_missing_one_is_flas_default(tmp_path):
    """fla builds its rotary embedding with float(rope_theta): a config.json whose rope_theta is null is no model fla can
    build, and was read as base 10000 (a transformer) or failed with a TypeError (a hybrid's attn). Left out, it is
    fla's default, 10000."""
    path = tmp_path / "config.json"
    transformer = fla_config(Config.from_name("transformer-debug", num_layers=2, rope_base=500.0))
    hybrid = fla_config(Config.from_name("gla-debug", num_layers=2, attn_layers=[1], attn_num_heads=2, rope_base=500.0))
    assert config_from_fla(transformer, path, "x").rope_base == config_from_fla(hybrid, path, "x").rope_base == 500.0
    with pytest.raises(ValueError, match=rf"^{path}: rope_theta must be a number, .*\(left out: fla's 10000\), got None$"):
        config_from_fla({**transformer, "rope_theta": None}, path, "x")
    with pytest.raises(ValueError, match=rf"^{path}: attn.rope_theta must be a number, .*got None$"):
        config_from_fla({**hybrid, "attn": {**hybrid["attn"], "rope_theta": None}}, path, "x")
    left_out = {k: v for k, v in transformer.items() if k != "rope_theta"}
    hybrid_left_out = {**hybrid, "attn": {k: v for k, v in hybrid["attn"].items() if k != "rope_theta"}}
    assert config_from_fla(left_out, path, "x").rope_base == config_from_fla(hybrid_left_out, path, "x").rope_base == 10000.0


@pytest.mark.parametrize("key, value, kind", [
    ("tie_word_embeddings", "false", "true or false"),  # bool("false") is True: the lm_head would have been dropped
    ("tie_word_embeddings", 0, "true or false"),
    ("norm_eps", "abc", "a number"),
    ("initializer_range", "0.02x", "a number"),
    ("max_position_embeddings", "2k", "an integer"),
    ("conv_size", "four", "an integer"),
])
def test_a_config_json_value_of_the_wrong_type_is_named_not_converted(tmp_path, key, value, kind):
    """A hand-edited config.json's quoted or mistyped value is refused naming its key: converted with bool() or float()
    it was a ValueError's traceback, or, for "false", a tied model that silently left out the export's lm_head."""
    path = tmp_path / "config.json"
    block_type = "gdn" if key == "conv_size" else "gla"
    hf = fla_config(Config.from_name(f"{block_type}-debug", num_layers=2))
    with pytest.raises(ValueError, match=rf"^{path}: {key} must be {kind}, got {value!r}$"):
        config_from_fla({**hf, key: value}, path, "x")
    assert config_from_fla({**hf, "norm_eps": 1e-5, "tie_word_embeddings": None}, path, "x").norm_eps == 1e-5


@pytest.mark.parametrize("change, message", [
    ({"fabric_lin": {"head_norm_eps": "1e-5x"}}, "fabric_lin.head_norm_eps must be a number, got '1e-5x'"),
    ({"fabric_lin": {"head_norm_eps": None}}, "fabric_lin.head_norm_eps must be a number, got None"),
    ({"fabric_lin": {"head_norm_eps": True}}, "fabric_lin.head_norm_eps must be a number, got True"),  # float(): 1.0
    ({"fabric_lin": {"name": 7}}, "fabric_lin.name must be a string, got 7"),
    ({"fabric_lin": "gla-debug"}, "fabric_lin must be a mapping (fabric-lin's own fields: name, head_norm_eps), got "
                                  "'gla-debug'"),
    ({"attn": {"layers": 1, "num_heads": 2}}, "attn must be a mapping (or list of mappings) with layers (a list of "
                                              "layer indices) and num_heads (an integer), got {'layers': 1, 'num_heads': 2}"),
    ({"attn": {"layers": [1], "num_heads": [2]}}, "attn must be a mapping"),
    ({"attn": {"layers": ["1", 0], "num_heads": 2}}, "attn must be a mapping"),
    ({"attn": {"layers": [1], "num_heads": 2, "num_kv_heads": [1]}}, "attn must be a mapping"),
], ids=["eps-quoted", "eps-null", "eps-true", "name-number", "not-a-mapping", "layers-one-index", "heads-list",
        "layers-mixed", "kv-heads-list"])
def test_a_wrong_type_in_fabric_lins_key_or_the_hybrids_attn_is_one_line(tmp_path, capsys, change, message):
    """The "fabric_lin" key that convert_to_hf adds to config.json, and fla's "attn" key of a hybrid, edited by hand
    to a value of another type: float() and the layers' sorting failed with a traceback, and true was read as the head
    norm's eps 1.0."""
    from helpers import cli_error

    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    err = cli_error(["convert_from_hf", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "back")], capsys)
    assert err.startswith(f"fabric-lin convert_from_hf: error: {path}: {message}")
    assert not (tmp_path / "back").exists()


def test_a_tokenizer_that_cannot_be_copied_is_refused_before_the_weights_are_read(tmp_path, monkeypatch):
    """An export whose tokenizer.model is a Git LFS pointer (a clone made without Git LFS), or has more pieces than the
    model has embeddings: refused after every weight had been read and checked, where convert_to_hf reads its tokenizer
    first."""
    from fabric_lin.convert import hf

    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "hf")
    read = []
    load = hf.load_safetensors_dir
    monkeypatch.setattr(hf, "load_safetensors_dir", lambda directory: read.append(directory) or load(directory))
    (tmp_path / "hf" / "trained_with.json").unlink()
    from helpers import train_sentencepiece

    train_sentencepiece(tmp_path / "hf", vocab_size=80, sentence="a tokenizer of more pieces than model {} embeds")
    with pytest.raises(ValueError, match=r"its tokenizer has 80 pieces and its model 64 embeddings"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")
    (tmp_path / "hf" / "tokenizer.model").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 493443\n")
    with pytest.raises(ValueError, match=r"tokenizer.model is a Git LFS pointer, not the file's content"):
        convert_from_hf(tmp_path / "hf", tmp_path / "back")
    assert read == [] and not (tmp_path / "back").exists()


def test_the_directory_above_a_model_names_the_models_below_it(tmp_path, capsys):
    """The output directory of tutorials/finetune_lora.md's script (adapter/ and merged/ in it) given where a model or a
    tokenizer goes: each command names what lies below it, where generate said tokenizer.model does not exist,
    convert_to_hf model_config.yaml does not exist and pretrain noted a missing tokenizer before refusing the weights."""
    from helpers import cli_error

    make_model_dir(tmp_path / "model", small_config())
    lora = tmp_path / "lora"
    convert_to_hf(tmp_path / "model", lora / "merged")
    (lora / "adapter").mkdir()
    (lora / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("A document of one's own.")
    below = f"below it: {lora / 'adapter'} (LoRA adapters alone), {lora / 'merged'} (an fla export)\n"
    out = ["--output_dir", str(tmp_path / "out")]
    not_a_model_dir = f"{lora} holds no model_config.yaml and no weights: {{}} reads a model directory; {below}"
    cases = {
        "convert_to_hf": ([str(lora), *out], not_a_model_dir.format("convert_to_hf")),
        "pretrain": (["--model_name", "gla-debug", "--train.max_steps", "1", "--out_dir", str(tmp_path / "out"),
                      "--initial_checkpoint_dir", str(lora)], not_a_model_dir.format("--initial_checkpoint_dir")),
        "convert_from_hf": ([str(lora), *out], f"{lora} holds no config.json: expected an fla export (config.json and "
                                               f"safetensors, as convert_to_hf writes them); {below}"),
        **{command: ([str(lora)] + (["--max_batches", "0"] if command == "evaluate" else []),
                     f"{lora} is not a checkpoint: it holds none of lit_model.pth, model.safetensors or config.json; "
                     f"expected a training checkpoint (a run's step-XXXXXXXX/ or final/), a model directory "
                     f"(convert_pretrained_checkpoint's output) or an fla export (convert_to_hf's output); {below}")
           for command in ("generate", "evaluate")},
        "convert_pretrained_checkpoint": ([str(lora), *out], f"{lora} is not a training checkpoint: it has no "
                                                             f"lit_model.pth; {below}"),
        "prepare_text": (["--input_dir", str(tmp_path / "text"), "--tokenizer_path", str(lora), *out],
                         f"--tokenizer_path: {lora / 'tokenizer.model'} does not exist: expected a SentencePiece "
                         f"tokenizer.model in {lora} "
                         f"(found: adapter, merged); {lora / 'merged'} holds one: give that directory\n"),
    }
    for command, (args, message) in cases.items():
        assert cli_error([command, *args], capsys) == f"fabric-lin {command}: error: {message}", command
    assert not (tmp_path / "out").exists() and not (lora / "evaluate").exists()


def test_an_adapted_model_saved_before_merging_is_named_so(tmp_path, capsys):
    """The peft model saved as it is adapted (its wrapped layers: q_proj.base_layer.weight, q_proj.lora_A.default.weight,
    ...) in place of what merge_and_unload returns: convert_from_hf and evaluate say to save the merged one, where they
    listed dozens of missing and unexpected tensors over several lines."""
    from helpers import cli_error

    make_model_dir(tmp_path / "model", small_config())
    convert_to_hf(tmp_path / "model", tmp_path / "adapted")
    weights = load_file(tmp_path / "adapted" / "model.safetensors")
    for i in range(2):
        name = f"model.layers.{i}.attn.q_proj"
        weight = weights.pop(f"{name}.weight")
        weights.update({f"{name}.base_layer.weight": weight, f"{name}.lora_A.default.weight": torch.zeros(8, weight.shape[1]),
                        f"{name}.lora_B.default.weight": torch.zeros(weight.shape[0], 8)})
    save_file(weights, str(tmp_path / "adapted" / "model.safetensors"))
    message = (f"{tmp_path / 'adapted'} holds peft's adapted layers, not merged (model.layers.0.attn.q_proj.base_layer.weight, "
               "model.layers.0.attn.q_proj.lora_A.default.weight, ... 6 in all): save the model that merge_and_unload() "
               "returns (tutorials/finetune_lora.md, section 3)\n")
    assert cli_error(["convert_from_hf", str(tmp_path / "adapted"), "--output_dir", str(tmp_path / "out")], capsys) == (
        f"fabric-lin convert_from_hf: error: {message}")
    assert cli_error(["evaluate", str(tmp_path / "adapted"), "--max_batches", "0"], capsys) == (
        f"fabric-lin evaluate: error: {message}")
    assert not (tmp_path / "out").exists()


def test_a_file_of_a_model_directory_names_the_directory(tmp_path, capsys):
    """The model's lit_model.pth given where its directory goes (as LitGPT's users give a checkpoint file): generate
    and convert_to_hf name the directory to give, where they said the file "is not a directory"."""
    from helpers import cli_error

    make_model_dir(tmp_path / "model", small_config())
    weights = tmp_path / "model" / "lit_model.pth"
    fix = f"{weights} is a file: give the model directory that holds it, {tmp_path / 'model'}\n"
    for command in ("generate", "evaluate"):  # in the words of the loader the two share
        assert cli_error([command, str(weights)], capsys) == (
            f"fabric-lin {command}: error: {weights} is a file: give the directory that holds it, {tmp_path / 'model'} "
            f"(a model directory)\n")
    assert cli_error(["convert_to_hf", str(weights), "--output_dir", str(tmp_path / "out")], capsys) == (
        f"fabric-lin convert_to_hf: error: model_dir {fix}")
    assert not (tmp_path / "out").exists()
