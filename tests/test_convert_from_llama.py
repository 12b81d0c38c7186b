"""convert_from_llama on tiny random Llama checkpoints written by hand with Hugging Face Llama names
(transformers is not needed)."""
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import fabric_lin_process
from fabric_lin.config import Config, name_to_config
from fabric_lin.convert.from_llama import convert_from_llama
from fabric_lin.convert.model_dir import load_model_dir_weights
from fabric_lin.model import GPT
from helpers import train_sentencepiece

GLA_ONLY = ["attn.g_proj.weight", "attn.gk_proj.0.weight", "attn.gk_proj.1.weight", "attn.gk_proj.1.bias", "attn.g_norm.weight"]
SHARED = [
    "attn_norm.weight", "attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "attn.o_proj.weight",
    "mlp_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]
LLAMA_OF = {
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
    **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}


def write_tiny_llama(
    directory: Path, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=64, tied=False,
    shards=1, model_type="mistral", dtype=torch.float32,
) -> dict:
    """A random Llama/Mistral in Hugging Face's layout: config.json and safetensors (sharded with an index)."""
    g = torch.Generator().manual_seed(7)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    head_dim = hidden // heads
    w = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": 1 + r(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": 1 + r(hidden),
            p + "post_attention_layernorm.weight": 1 + r(hidden),
            p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": r(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": r(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
            p + "self_attn.rotary_emb.inv_freq": torch.rand(head_dim // 2, generator=g),  # old checkpoints have it
            p + "mlp.gate_proj.weight": r(intermediate, hidden),
            p + "mlp.up_proj.weight": r(intermediate, hidden),
            p + "mlp.down_proj.weight": r(hidden, intermediate),
        })
    if not tied:
        w["lm_head.weight"] = r(vocab, hidden)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(
        architectures=["MistralForCausalLM" if model_type == "mistral" else "LlamaForCausalLM"], model_type=model_type,
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, vocab_size=vocab, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_theta=10000.0, torch_dtype=str(dtype).removeprefix("torch."),
    )
    (directory / "config.json").write_text(json.dumps(config))
    names = list(w)
    if shards == 1:
        save_file(w, directory / "model.safetensors")
    else:
        weight_map = {}
        for s in range(shards):
            part = {n: w[n].contiguous() for n in names[s::shards]}
            file_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, directory / file_name)
            weight_map.update({n: file_name for n in part})
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return w


@pytest.fixture
def mistral_shaped_gla(monkeypatch):
    """A tiny GLA with gla-7B's layout (expand_k=1, grouped key/value heads) so that q/k/v/o match."""
    monkeypatch.setitem(
        name_to_config, "gla-tiny-mistral",
        dict(name="gla-tiny-mistral", vocab_size=64, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             expand_k=1.0, expand_v=1.0, intermediate_size=512),
    )
    return "gla-tiny-mistral"


def check_model_dir_loads(out: Path) -> dict:
    config = Config.from_checkpoint(out)
    state = load_model_dir_weights(out)
    model = GPT(config)
    model.load_state_dict(state)  # strict: every name and shape
    logits = model(torch.randint(0, config.vocab_size, (1, 5)))
    assert torch.isfinite(logits).all()
    return state


def test_copies_every_matching_tensor_from_a_sharded_mistral(tmp_path, mistral_shaped_gla, capsys):
    llama = write_tiny_llama(tmp_path / "mistral", shards=3)
    train_sentencepiece(tmp_path / "mistral", vocab_size=64)
    report = convert_from_llama(tmp_path / "mistral", mistral_shaped_gla, tmp_path / "gla")

    expected_copied = ["embeddings.weight", "norm.weight", "lm_head.weight"] + [f"layers.{i}.{n}" for i in range(2) for n in SHARED]
    assert sorted(report["copied"]) == sorted(expected_copied)
    assert sorted(report["initialized"]) == sorted(f"layers.{i}.{n}" for i in range(2) for n in GLA_ONLY)
    assert sorted(report["ignored"]) == [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(2)]
    assert report["partial"] == []

    state = check_model_dir_loads(tmp_path / "gla")
    assert torch.equal(state["embeddings.weight"], llama["model.embed_tokens.weight"])
    assert torch.equal(state["lm_head.weight"], llama["lm_head.weight"])
    assert torch.equal(state["norm.weight"], llama["model.norm.weight"])
    for i in range(2):
        for ours, theirs in LLAMA_OF.items():
            assert torch.equal(state[f"layers.{i}.{ours}"], llama[f"model.layers.{i}.{theirs}"]), ours
        # the GLA-only weights are the model's init: N(0, 0.02) weights, zero bias, unit norm
        assert torch.equal(state[f"layers.{i}.attn.g_norm.weight"], torch.ones(32))
        assert torch.equal(state[f"layers.{i}.attn.gk_proj.1.bias"], torch.zeros(64))
        assert abs(state[f"layers.{i}.attn.g_proj.weight"].std().item() - 0.02) < 0.002
    config = Config.from_checkpoint(tmp_path / "gla")
    assert config.norm_eps == 1e-5 and config.name == "gla-tiny-mistral"
    assert (tmp_path / "gla" / "tokenizer.model").read_bytes() == (tmp_path / "mistral" / "tokenizer.model").read_bytes()
    assert "kept at init (10): layers.{i}.attn.g_proj.weight (x2)" in capsys.readouterr().out


def test_shape_mismatch_keeps_init_and_is_reported(tmp_path, capsys):
    # gla-debug: 2 heads, expand_k=0.5 -> q/k are 64 x 128; this Llama's q is 128 x 128, its k/v 64 x 128
    llama = write_tiny_llama(tmp_path / "llama", model_type="llama", layers=4, heads=4, kv_heads=2, vocab=4096)
    report = convert_from_llama(tmp_path / "llama", "gla-debug", tmp_path / "gla")
    layer0 = {n.removeprefix("layers.0.") for n in report["copied"] if n.startswith("layers.0.")}
    assert layer0 == set(SHARED) - {"attn.q_proj.weight", "attn.v_proj.weight"}  # gla-debug's v is 128 x 128
    assert {n.removeprefix("layers.0.") for n in report["initialized"] if n.startswith("layers.0.")} == set(GLA_ONLY) | {
        "attn.q_proj.weight", "attn.v_proj.weight"
    }
    assert "model.layers.0.self_attn.q_proj.weight" in report["ignored"]
    state = check_model_dir_loads(tmp_path / "gla")
    assert torch.equal(state["layers.3.attn.k_proj.weight"], llama["model.layers.3.self_attn.k_proj.weight"])
    assert "model.layers.0.self_attn.q_proj.weight has shape (128, 128), layers.0.attn.q_proj.weight needs (64, 128)" in capsys.readouterr().out


@pytest.mark.parametrize("llama_vocab", [80, 48])
def test_vocabulary_mismatch_truncates_or_extends(tmp_path, mistral_shaped_gla, capsys, llama_vocab):
    llama = write_tiny_llama(tmp_path / "mistral", vocab=llama_vocab)
    train_sentencepiece(tmp_path / "mistral", vocab_size=llama_vocab)  # the Llama's own: one piece a row
    report = convert_from_llama(tmp_path / "mistral", mistral_shaped_gla, tmp_path / "gla")
    assert sorted(report["partial"]) == ["embeddings.weight", "lm_head.weight"]
    # the vocabulary rows copied in part are used, not ignored
    assert sorted(report["ignored"]) == [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(2)]
    printed = capsys.readouterr().out
    assert "vocabulary sizes differ" in printed
    assert ("the tokenizer has 80 pieces but gla-tiny-mistral has vocab_size=64" in printed) == (llama_vocab > 64)
    state = check_model_dir_loads(tmp_path / "gla")
    rows = min(llama_vocab, 64)
    for ours, theirs in (("embeddings.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        assert state[ours].shape == (64, 128)
        assert torch.equal(state[ours][:rows], llama[theirs][:rows])
        if llama_vocab < 64:  # the new rows are freshly initialised, not zeros and not copies
            extra = state[ours][rows:]
            assert abs(extra.std().item() - 0.02) < 0.004


def test_tied_llama_fills_the_untied_lm_head_and_bf16_is_kept(tmp_path, mistral_shaped_gla):
    llama = write_tiny_llama(tmp_path / "llama", tied=True, model_type="llama", dtype=torch.bfloat16)
    report = convert_from_llama(tmp_path / "llama", mistral_shaped_gla, tmp_path / "gla")
    assert "lm_head.weight" in report["copied"]
    state = load_model_dir_weights(tmp_path / "gla")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert torch.equal(state["lm_head.weight"], llama["model.embed_tokens.weight"])
    # a config.json without the flag: the file without lm_head.weight is what says the head is the embedding
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    del config["tie_word_embeddings"]
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    report = convert_from_llama(tmp_path / "llama", mistral_shaped_gla, tmp_path / "gla", overwrite=True)
    assert "lm_head.weight" in report["copied"]
    assert torch.equal(load_model_dir_weights(tmp_path / "gla")["lm_head.weight"], llama["model.embed_tokens.weight"])


def test_the_seed_decides_the_weights_kept_at_init(tmp_path, mistral_shaped_gla):
    write_tiny_llama(tmp_path / "llama")
    states = []
    for seed, out in ((1, "a"), (1, "b"), (2, "c")):
        report = convert_from_llama(tmp_path / "llama", mistral_shaped_gla, tmp_path / out, seed=seed)
        states.append(load_model_dir_weights(tmp_path / out))
    kept = [name for name in report["initialized"] if name.endswith("proj.weight")]  # drawn at random, not ones/zeros
    assert kept and all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    assert not any(torch.equal(states[0][name], states[2][name]) for name in kept)


def test_bad_inputs_get_clear_errors(tmp_path, mistral_shaped_gla):
    write_tiny_llama(tmp_path / "wide", hidden=256, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="hidden_size=256 but gla-tiny-mistral has hidden_size=128"):
        convert_from_llama(tmp_path / "wide", mistral_shaped_gla, tmp_path / "gla")
    write_tiny_llama(tmp_path / "qwen", model_type="qwen2")
    with pytest.raises(ValueError, match="model_type 'qwen2'"):
        convert_from_llama(tmp_path / "qwen", mistral_shaped_gla, tmp_path / "gla")
    with pytest.raises(ValueError, match="Unknown model name 'gla-8B'"):
        convert_from_llama(tmp_path / "wide", "gla-8B", tmp_path / "gla")
    with pytest.raises(ValueError, match=r"model_name 'gdn-debug' is a gdn model; expected a GLA model"):
        convert_from_llama(tmp_path / "wide", "gdn-debug", tmp_path / "gla")
    write_tiny_llama(tmp_path / "fits")  # torch's generator takes 64 bits: a larger --seed was an OverflowError's traceback
    with pytest.raises(ValueError, match=rf"^--seed {2**64}: expected a 64-bit seed, 0 to {2**64 - 1}$"):
        convert_from_llama(tmp_path / "fits", mistral_shaped_gla, tmp_path / "gla", seed=2**64)
    assert not (tmp_path / "gla").exists()
    ok = tmp_path / "ok"
    write_tiny_llama(ok, shards=2)
    index = json.loads((ok / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "/etc/passwd"
    (ok / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="is not a relative path"):
        convert_from_llama(ok, mistral_shaped_gla, tmp_path / "gla")
    (tmp_path / "gla").mkdir(exist_ok=True)
    (tmp_path / "gla" / "x").write_text("")
    write_tiny_llama(tmp_path / "fine")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_from_llama(tmp_path / "fine", mistral_shaped_gla, tmp_path / "gla")


@pytest.mark.parametrize("key, value, kind", [("tie_word_embeddings", "false", "true or false"),
                                             ("rms_norm_eps", "1e-5x", "a number"), ("rms_norm_eps", [1e-5], "a number")])
def test_a_config_json_value_of_the_wrong_type_is_named(tmp_path, mistral_shaped_gla, key, value, kind):
    """A quoted or mistyped value in the Llama's config.json is refused naming its key, before anything is written:
    bool("false") is True (the lm_head was then copied from the embeddings, not from the Llama's own lm_head), and
    float() of "1e-5x" was a ValueError's traceback."""
    write_tiny_llama(tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'llama' / 'config.json'}: {key} must be {kind}, got {value!r}")):
        convert_from_llama(tmp_path / "llama", mistral_shaped_gla, tmp_path / "gla")
    assert not (tmp_path / "gla").exists()


def test_shards_that_are_missing_lack_a_tensor_or_lie_beside_another_export_are_named(tmp_path, mistral_shaped_gla):
    """The index lists a shard that is not there, places a tensor in a shard that lacks it, or the directory also holds a
    model.safetensors that the index does not list (two exports in one place): each refused, naming the file."""
    def sharded(name):
        write_tiny_llama(tmp_path / name, shards=2)
        return tmp_path / name, json.loads((tmp_path / name / "model.safetensors.index.json").read_text())

    missing, _ = sharded("missing")
    (missing / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard files \['model-00002-of-00002.safetensors'\] are listed but missing"):
        convert_from_llama(missing, mistral_shaped_gla, tmp_path / "gla")
    lacking, index = sharded("lacking")
    norm_file = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.norm.weight"] = next(f for f in index["weight_map"].values() if f != norm_file)
    (lacking / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks model.norm.weight, which the index places there"):
        convert_from_llama(lacking, mistral_shaped_gla, tmp_path / "gla")
    mixed, _ = sharded("mixed")
    save_file({"model.embed_tokens.weight": torch.zeros(64, 128)}, mixed / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds both model.safetensors and model.safetensors.index.json"):
        convert_from_llama(mixed, mistral_shaped_gla, tmp_path / "gla")
    assert not (tmp_path / "gla").exists()


def test_a_llama_whose_files_lack_a_weight_of_its_config_is_refused_naming_it(tmp_path, mistral_shaped_gla):
    """config.json's num_hidden_layers says 2, and the files hold one layer (a checkpoint cut down by hand, or an index
    left out of a download): the second layer's norms, attention and MLP kept their fresh init, said only as a count."""
    llama = write_tiny_llama(tmp_path / "cut", layers=2)
    one_layer = {name: tensor for name, tensor in llama.items() if ".layers.1." not in name}
    save_file(one_layer, tmp_path / "cut" / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'cut'} holds no model.layers.1.input_layernorm.weight, "
                                         r"model.layers.1.self_attn.q_proj.weight, "
                                         r"model.layers.1.self_attn.k_proj.weight, ... \(6 more\), which its "
                                         r"config.json's model \(num_hidden_layers 2\) has: a download or copy that "
                                         r"left files out\? Give the whole checkpoint$"):
        convert_from_llama(tmp_path / "cut", mistral_shaped_gla, tmp_path / "gla")
    assert not (tmp_path / "gla").exists()


def test_a_llama_directory_given_where_a_model_directory_belongs_names_convert_from_llama(tmp_path, capsys):
    """The Llama itself given to pretrain --initial_checkpoint_dir, generate, evaluate or convert_from_hf: each names
    convert_from_llama, the one command that reads it (pretrain listed a hundred mismatched tensors; the others sent
    the user to convert_from_hf, which refuses model_type llama); generate and evaluate in the same words, those of
    the loader they share."""
    from helpers import cli_error

    llama = tmp_path / "llama"
    write_tiny_llama(llama, model_type="llama")
    fix = (f"make a GLA {{}} from it with: fabric-lin convert_from_llama --checkpoint_dir {llama} --model_name <a GLA "
           f"model of its width and depth: fabric-lin pretrain list> --output_dir <DIR>\n")
    cases = {
        "pretrain": ["--model_name", "gla-debug", "--train.max_steps", "1", "--out_dir", str(tmp_path / "out"),
                     "--initial_checkpoint_dir", str(llama)],
        "generate": [str(llama)],
        "evaluate": [str(llama), "--max_batches", "0"],
        "convert_from_hf": [str(llama), "--output_dir", str(tmp_path / "converted")],
    }
    for command, args in cases.items():
        err = cli_error([command, *args], capsys)
        if command == "pretrain":
            assert err == (f"fabric-lin {command}: error: {llama} is a Hugging Face Llama/Mistral directory: "
                           f"--initial_checkpoint_dir reads a model directory; " + fix.format("one")), err
        else:
            assert err == (f"fabric-lin {command}: error: {llama / 'config.json'}: model_type 'llama' is a Llama/Mistral "
                           f"model, not one of fla's; " + fix.format("model directory")), err
    assert not (tmp_path / "out").exists() and not (tmp_path / "converted").exists()


def test_gla_7B_from_mistral_recipe_matches_the_conversion():
    import yaml

    from fabric_lin.args import TrainArgs

    path = Path(__file__).parents[1] / "config_hub" / "gla_7B_from_mistral.yaml"
    recipe = yaml.safe_load(path.read_text())
    # the model pretrain builds is the one convert_from_llama writes for Mistral-7B (rms_norm_eps 1e-5)
    assert Config(**recipe["model_config"]) == Config.from_name("gla-7B", norm_eps=1e-5)
    train = TrainArgs(**recipe["train"])
    assert train.gradient_accumulation_iters(devices=recipe["devices"], num_nodes=recipe["num_nodes"]) == 8
    assert (train.micro_batch_size, recipe["devices"], train.global_batch_size) == (4, 8, 256)
    assert (train.max_steps, train.lr_warmup_steps, train.max_seq_length) == (10240, 512, 2048)
    assert recipe["optimizer"]["lr"] == 3e-5
    assert recipe["data"]["init_args"]["use_starcoder"] is False
    assert recipe["initial_checkpoint_dir"] == recipe["tokenizer_dir"]
    # and the command line accepts every key
    proc = fabric_lin_process.run([*fabric_lin_process.FABRIC_LIN, "pretrain", "--config", str(path), "--print_config"], 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "initial_checkpoint_dir: checkpoints/gla-7B-from-mistral" in proc.stdout


def test_hugging_face_cache_snapshot_with_symlinked_shards(tmp_path, mistral_shaped_gla):
    # a hub cache: snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--mistralai--Tiny"
    snapshot = repo / "snapshots" / "abc123"
    llama = write_tiny_llama(snapshot, shards=2)
    (repo / "blobs").mkdir()
    for i, path in enumerate(sorted(snapshot.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        path.rename(blob)
        path.symlink_to(Path("..") / ".." / "blobs" / blob.name)
    report = convert_from_llama(snapshot, mistral_shaped_gla, tmp_path / "gla")
    assert len(report["copied"]) == 21
    state = load_model_dir_weights(tmp_path / "gla")
    assert torch.equal(state["layers.1.mlp.down_proj.weight"], llama["model.layers.1.mlp.down_proj.weight"])


def test_quantized_llama_is_refused(tmp_path, mistral_shaped_gla):
    llama = write_tiny_llama(tmp_path / "int8")
    # LLM.int8's layout: an int8 weight of the weight's own shape plus its row scales `.SCB`
    name = "model.layers.0.self_attn.q_proj.weight"
    scale = llama[name].abs().amax(dim=1)
    llama[name] = (llama[name] / scale[:, None] * 127).round().to(torch.int8)
    llama["model.layers.0.self_attn.q_proj.SCB"] = scale
    save_file(llama, tmp_path / "int8" / "model.safetensors")
    with pytest.raises(ValueError, match=r"int8: model\.layers\.0\.self_attn\.q_proj\.weight has dtype torch\.int8"):
        convert_from_llama(tmp_path / "int8", mistral_shaped_gla, tmp_path / "gla")

    config_path = tmp_path / "int8" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'quantization_config' key"):
        convert_from_llama(tmp_path / "int8", mistral_shaped_gla, tmp_path / "gla", overwrite=True)


@pytest.mark.parametrize(
    "name,vocab,value",
    [("model.layers.1.mlp.down_proj.weight", 64, 1e6), ("model.embed_tokens.weight", 80, 1e6),
     ("model.norm.weight", 64, float("nan"))],
    ids=["overflow", "overflow-vocab-rows", "nan"],
)
def test_copy_that_is_not_the_source_is_refused(tmp_path, mistral_shaped_gla, name, vocab, value):
    llama = write_tiny_llama(tmp_path / "llama", vocab=vocab)
    # the rounding of an ordinary float32 -> float16 conversion passes
    convert_from_llama(tmp_path / "llama", mistral_shaped_gla, tmp_path / "fine", dtype="float16")
    state = load_model_dir_weights(tmp_path / "fine")
    assert torch.equal(state["layers.1.mlp.down_proj.weight"], llama["model.layers.1.mlp.down_proj.weight"].half())

    llama[name].view(-1)[0] = value
    save_file(llama, tmp_path / "llama" / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(name)):
        convert_from_llama(tmp_path / "llama", mistral_shaped_gla, tmp_path / "gla", dtype="float16")


def test_a_checkpoint_dir_that_is_not_the_llamas_names_what_to_give(tmp_path, capsys):
    """--checkpoint_dir given the Llama's config.json, or a Hugging Face cache's repository directory (the Llama two
    levels down, in snapshots/<revision>/): the first was "<file>/config.json does not exist", the second
    "<dir>/config.json does not exist" without a word of the snapshot."""
    from helpers import cli_error

    snapshot = tmp_path / "models--mistralai--Tiny" / "snapshots" / "abc123"
    write_tiny_llama(snapshot)
    args = ["--model_name", "gla-debug", "--output_dir", str(tmp_path / "gla")]
    prefix = "fabric-lin convert_from_llama: error: --checkpoint_dir "
    assert cli_error(["convert_from_llama", "--checkpoint_dir", str(snapshot / "config.json"), *args], capsys) == (
        f"{prefix}{snapshot / 'config.json'} is a file: give the directory that holds it, {snapshot}\n")
    repo = tmp_path / "models--mistralai--Tiny"
    assert cli_error(["convert_from_llama", "--checkpoint_dir", str(repo), *args], capsys) == (
        f"{prefix}{repo} holds no config.json: expected a Hugging Face Llama/Mistral directory; below it: {snapshot} "
        "(a Hugging Face Llama/Mistral directory)\n")
    assert cli_error(["convert_from_llama", "--checkpoint_dir", str(tmp_path / "nothing"), *args], capsys) == (
        f"{prefix}{tmp_path / 'nothing'} does not exist: expected a Hugging Face Llama/Mistral directory\n")
    assert not (tmp_path / "gla").exists()


def test_a_tokenizer_that_cannot_be_copied_is_refused_before_any_weight_is_read(tmp_path, mistral_shaped_gla, monkeypatch):
    """A clone made without Git LFS holds a pointer in place of tokenizer.model: found when the model directory was
    written, after every weight of a 7B had been read and checked (minutes), where convert_to_hf reads its tokenizer
    before the weights."""
    from fabric_lin.convert import from_llama

    write_tiny_llama(tmp_path / "llama")
    (tmp_path / "llama" / "tokenizer.model").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 493443\n")
    read = []
    get = from_llama.SafetensorsReader.get
    monkeypatch.setattr(from_llama.SafetensorsReader, "get", lambda self, name: read.append(name) or get(self, name))
    with pytest.raises(ValueError, match=r"tokenizer.model is a Git LFS pointer, not the file's content"):
        convert_from_llama(tmp_path / "llama", mistral_shaped_gla, tmp_path / "gla")
    assert read == [] and not (tmp_path / "gla").exists()


def test_a_tokenizer_of_more_pieces_than_the_llamas_rows_is_refused_before_any_weight_is_read(tmp_path, mistral_shaped_gla,
                                                                                             monkeypatch):
    """Another model's tokenizer.model copied beside the Llama's weights: its ids are other pieces, and those past the
    Llama's embedding rows would be trained from a fresh init as if they were the Llama's."""
    from fabric_lin.convert import from_llama

    write_tiny_llama(tmp_path / "llama", vocab=48)
    train_sentencepiece(tmp_path / "llama", vocab_size=64)
    read = []
    get = from_llama.SafetensorsReader.get
    monkeypatch.setattr(from_llama.SafetensorsReader, "get", lambda self, name: read.append(name) or get(self, name))
    with pytest.raises(ValueError) as refused:
        convert_from_llama(tmp_path / "llama", mistral_shaped_gla, tmp_path / "gla")
    assert str(refused.value) == (
        f"--checkpoint_dir {tmp_path / 'llama'}: its tokenizer.model has 64 pieces, more than the 48 rows of the Llama's "
        "model.embed_tokens.weight, so it is not the tokenizer the Llama was trained with (ids 48 and up have no trained "
        "row); put the Llama's own tokenizer.model (and tokenizer_config.json) there")
    assert read == [] and not (tmp_path / "gla").exists()
