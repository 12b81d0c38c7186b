"""Model directory <-> Hugging Face format of flash-linear-attention (fla).

fla's `GLAForCausalLM` (model_type "gla"), `GatedDeltaNetForCausalLM` ("gated_deltanet") and
`TransformerForCausalLM` ("transformer") name their parameters as fabric-lin does, under a `model.` prefix,
with one exception:

    fabric-lin                          fla
    embeddings.weight                   model.embeddings.weight
    layers.{i}.attn.g_norm.weight       model.layers.{i}.attn.g_norm_swish_gate.weight   (GLA, fuse_norm: true)
                                        model.layers.{i}.attn.g_norm.weight              (GLA, fuse_norm: false)
    lm_head.weight                      lm_head.weight           (absent when embeddings are tied)

A hybrid's softmax-attention layers are fla's `attn` config key (layers, num_heads, num_kv_heads), their
q/k/v/o projections named alike. Config fields map one to one; fla's per-head output norm uses `norm_eps`,
as fabric-lin's `head_norm_eps` does by default. A model trained with another head_norm_eps keeps it under
the extra key "fabric_lin" (fla ignores it, `convert_from_hf` reads it back, so a round trip is exact);
loaded in fla, the head norm then runs with norm_eps. fla also fixes GLA's forget-gate low-rank width and
logit normalizer at 16; other values are refused.
"""
import json
import os
import re
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from fabric_lin.config import Config, is_kind
from fabric_lin.convert.model_dir import (
    atomic_write,
    cast_floating,
    HF_CONFIG_FILE,
    LLAMA_MODEL_TYPES,
    MODEL_TYPES,
    check_export_given,
    check_model_dir_given,
    check_state_dict,
    check_tokenizer_fits_model,
    copy_tokenizer,
    from_llama_command,
    load_model_dir_weights,
    load_safetensors_dir,
    model_written_aside,
    parse_dtype,
    prepare_output_dir,
    save_model_dir,
    save_safetensors_dir,
)
from fabric_lin.errors import InvalidValue, MissingFile
from fabric_lin.files import created_dir, read_json, short_list

# fla's architecture for each model_type
ARCHITECTURES = {"gla": "GLAForCausalLM", "gated_deltanet": "GatedDeltaNetForCausalLM", "delta_net": "DeltaNetForCausalLM",
                 "transformer": "TransformerForCausalLM"}
FLA_FIXED_GATE = {"gate_low_rank_dim": 16, "gate_logit_normalizer": 16}
FLA_ROPE_THETA = 10000.0  # the rotary base of fla's attention layers where a config.json leaves rope_theta out


def convert_to_hf(
    model_dir: Path, output_dir: Optional[Path] = None, dtype: Optional[str] = None, overwrite: bool = False, max_shard_gb: float = 5.0
) -> None:
    """Export a model directory in flash-linear-attention's Hugging Face format.

    The export (safetensors, config.json, tokenizer files and trained_with.json, the record of the tokenizer the
    weights were trained with) loads, with fla installed, through
    `AutoModelForCausalLM.from_pretrained(output_dir)`.

    Args:
        model_dir: a model directory (what convert_pretrained_checkpoint writes).
        output_dir: (required) where to write model.safetensors (or shards and an index), config.json, the tokenizer
            files and trained_with.json.
        dtype: cast floating-point weights to float32, bfloat16 or float16 (default: keep).
        overwrite: write into a non-empty output_dir, in place of the model written there before (its other
            files stay), which is removed only once this one is written whole.
        max_shard_gb: largest safetensors file; more weights than this are split into shards with an index.
    """
    if output_dir is None:
        raise InvalidValue("--output_dir is required: where to write the fla-format export")
    from fabric_lin.data.tokenizer import weights_trained_with

    if not 0 < max_shard_gb < float("inf"):
        raise InvalidValue(f"--max_shard_gb must be a size above 0 (GiB per safetensors file), got {max_shard_gb}")
    model_dir = Path(model_dir)
    check_model_dir_given(model_dir, "model_dir", "convert_to_hf")
    torch_dtype = parse_dtype(dtype)
    config = Config.from_checkpoint(model_dir)
    hf_config = fla_config(config)
    trained_with = weights_trained_with(model_dir, "model_dir")  # before the weights: a tokenizer not the model's is refused at once
    check_tokenizer_fits_model(model_dir, config, "model_dir")
    tokenizer_ids = special_token_ids(model_dir)
    output_dir = prepare_output_dir(Path(output_dir), overwrite, sources=[model_dir])  # before the minutes of reading
    state_dict = load_model_dir_weights(model_dir, config)

    state_dict = cast_floating(state_dict, torch_dtype)
    hf_state = {to_hf_name(name): tensor for name, tensor in state_dict.items()}
    floating = {t.dtype for t in hf_state.values() if t.is_floating_point()}
    hf_config["torch_dtype"] = str(floating.pop()).removeprefix("torch.") if len(floating) == 1 else "float32"
    hf_config.update(tokenizer_ids)

    with created_dir(output_dir), model_written_aside(output_dir) as staging:
        files = save_safetensors_dir(hf_state, staging, max_shard_bytes=int(max_shard_gb * 2**30))
        tokenizer_files = copy_tokenizer(model_dir, staging, trained_with, output_dir)
        if "tokenizer_config.json" in tokenizer_files:
            without_bos_token(staging / "tokenizer_config.json", output_dir / "tokenizer_config.json")
        elif tokenizer_files:
            write_hf_tokenizer_config(staging, model_dir)
            tokenizer_files.append("tokenizer_config.json")
        # config.json last: what transformers and convert_from_hf take for an export, which a kill -9 leaves none of
        atomic_write(staging / HF_CONFIG_FILE, lambda p: Path(p).write_text(json.dumps(hf_config, indent=2) + "\n"))
    print(f"Exported {model_dir} as fla {hf_config['architectures'][0]} ({len(hf_state)} tensors) -> {output_dir}: {files}")
    if config.block_type != "transformer" and config.head_norm_eps != config.norm_eps:
        print(
            f"Note: fla uses norm_eps={config.norm_eps} for the per-head output norm, where this model "
            f"used head_norm_eps={config.head_norm_eps}; fla's logits therefore differ from fabric-lin's, most where a "
            f"head's output is near zero (measured on a small model at init: up to about one logit standard deviation). "
            f"Train with head_norm_eps equal to norm_eps when fla must reproduce the logits exactly."
        )
    print(f"Tokenizer files: {tokenizer_files}")


def convert_from_hf(
    checkpoint_dir: Path, output_dir: Optional[Path] = None, dtype: Optional[str] = None, overwrite: bool = False, name: Optional[str] = None
) -> None:
    """Convert a flash-linear-attention checkpoint (safetensors) into a model directory.

    fla's GLAForCausalLM, GatedDeltaNetForCausalLM and TransformerForCausalLM are read.

    Args:
        checkpoint_dir: a directory with config.json and model.safetensors (or shards and model.safetensors.index.json).
        output_dir: where to write the model directory (required).
        dtype: cast floating-point weights to float32, bfloat16 or float16 (default: keep).
        overwrite: write into a non-empty output_dir, in place of the model written there before (its other
            files stay), which is removed only once this one is written whole.
        name: the model's name in model_config.yaml (default: the one recorded at export, else the directory name).
    """
    if output_dir is None:
        raise InvalidValue("--output_dir is required: where to write the model directory")
    from fabric_lin.data.tokenizer import weights_trained_with

    checkpoint_dir = Path(checkpoint_dir)
    torch_dtype = parse_dtype(dtype)
    check_export_given(checkpoint_dir, "convert_from_hf")
    output_dir = prepare_output_dir(Path(output_dir), overwrite, sources=[checkpoint_dir])  # before the weights are read
    # the tokenizer to copy, before the minutes of reading the weights: one that cannot be read (a Git LFS pointer), is
    # not the one its trained_with.json records, or has more pieces than the model has embeddings is refused at once
    weights_trained_with(checkpoint_dir, "checkpoint_dir")
    check_tokenizer_fits_model(checkpoint_dir, fla_checkpoint_config(checkpoint_dir, name), "checkpoint_dir")
    config, state_dict = read_fla_checkpoint(checkpoint_dir, name)
    state_dict = cast_floating(state_dict, torch_dtype)
    with created_dir(output_dir):
        tokenizer_files = save_model_dir(state_dict, config, output_dir, tokenizer_dir=checkpoint_dir,
                                         tokenizer_given_by="checkpoint_dir")
    print(f"Converted {checkpoint_dir} ({len(state_dict)} tensors) -> {output_dir}; tokenizer files {tokenizer_files}")


def read_fla_checkpoint(checkpoint_dir: Path, name: Optional[str] = None) -> Tuple[Config, Dict[str, torch.Tensor]]:
    """Our Config and state dict of a flash-linear-attention checkpoint directory (config.json and safetensors),
    the tensors checked against the config. `name`: the model's name (default: the one recorded at export, else
    the directory name)."""
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / HF_CONFIG_FILE
    config = fla_checkpoint_config(checkpoint_dir, name)
    if not any(checkpoint_dir.glob("*.safetensors")) and any(checkpoint_dir.glob("*.bin")):
        raise InvalidValue(
            f"{checkpoint_dir} holds PyTorch .bin weights; only safetensors are read (a .bin file is a pickle that "
            "can run code). Save it with `model.save_pretrained(dir, safe_serialization=True)`"
        )
    # a save with safe_serialization=False into an earlier export's directory leaves that export's safetensors
    # beside the new .bin, and every reader (transformers too) would take the stale safetensors without a word
    pickled = sorted(path.name for path in checkpoint_dir.glob("pytorch_model*.bin"))
    if pickled and any(checkpoint_dir.glob("*.safetensors")):
        raise InvalidValue(
            f"{checkpoint_dir} holds weights in two formats, safetensors and {short_list(pickled)}: which are meant "
            f"is unclear (only the safetensors would be read); remove the stale ones, or save again into an empty "
            f"directory with safe_serialization=True"
        )
    hf_state = load_safetensors_dir(checkpoint_dir)
    refuse_unmerged_lora(checkpoint_dir, hf_state)
    if config.tie_embeddings:
        hf_state.pop("lm_head.weight", None)  # tied: the same tensor as the embeddings
    state_dict = {from_hf_name(name): tensor for name, tensor in hf_state.items()}
    check_state_dict(state_dict, config, source=str(checkpoint_dir), config_file=config_path)
    return config, state_dict


def fla_checkpoint_config(checkpoint_dir: Path, name: Optional[str] = None) -> Config:
    """Our Config of a flash-linear-attention checkpoint directory's config.json. `name`: the model's name (default: the
    one recorded at export, else the directory name)."""
    config_path = Path(checkpoint_dir) / HF_CONFIG_FILE
    if not config_path.is_file():
        raise MissingFile(f"{config_path} does not exist: expected a Hugging Face checkpoint directory with config.json")
    return config_from_fla(read_json(config_path), config_path, name=name or Path(os.path.abspath(checkpoint_dir)).name)  # `.` too


# the names peft gives a layer it adapts: its own weight moves to `base_layer`, beside the adapters' `lora_A`, `lora_B`, ...
PEFT_LAYER_NAME = re.compile(r"\.(base_layer|lora_\w+?)\.")


def refuse_unmerged_lora(checkpoint_dir: Path, hf_state: Dict[str, torch.Tensor]) -> None:
    """Refuse the weights of a model saved while peft's LoRA layers were in it (merge_and_unload not called, or its
    result not the model saved): the adapted weights are not where fla's model has them, and what they compute is
    W + (lora_alpha / r) B A, which only the merge writes into W."""
    adapted = sorted(name for name in hf_state if PEFT_LAYER_NAME.search(name))
    if adapted:
        raise InvalidValue(
            f"{checkpoint_dir} holds peft's adapted layers, not merged ({', '.join(adapted[:2])}, ... {len(adapted)} in all): "
            f"save the model that merge_and_unload() returns (tutorials/finetune_lora.md, section 3)"
        )


def to_hf_name(name: str) -> str:
    if name == "lm_head.weight":
        return name
    if name.endswith(".attn.g_norm.weight"):
        name = name.replace(".attn.g_norm.weight", ".attn.g_norm_swish_gate.weight")
    return f"model.{name}"


def from_hf_name(name: str) -> str:
    if name == "lm_head.weight":
        return name
    name = name.removeprefix("model.")
    return name.replace(".attn.g_norm_swish_gate.weight", ".attn.g_norm.weight")


def fla_attn(config: Config) -> Optional[dict]:
    """fla's `attn` config key for a hybrid's softmax-attention layers (None without any)."""
    if not config.attn_layers:
        return None
    return dict(layers=list(config.attn_layers), num_heads=config.attn_num_heads, num_kv_heads=config.attn_kv_heads,
                qkv_bias=False, window_size=None, rope_theta=config.rope_base)


def fla_config(config: Config) -> dict:
    """config.json fields of fla's GLAConfig / GatedDeltaNetConfig / TransformerConfig for `config`."""
    common = dict(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_heads=config.num_heads,
        hidden_ratio=config.hidden_ratio,
        intermediate_size=config.intermediate_size,
        hidden_act="swish",
        max_position_embeddings=config.max_seq_length,
        norm_eps=config.norm_eps,
        initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_embeddings,
        use_cache=True,
        fuse_norm=True,
        fuse_swiglu=True,
        fuse_cross_entropy=True,
        # read by some fla versions' forward without a default in their config class
        fuse_linear_cross_entropy=False,
        use_l2warp=False,
        vocab_size=config.vocab_size,
    )
    ours = dict(name=config.name)
    if config.block_type != "transformer" and config.head_norm_eps != config.norm_eps:
        ours["head_norm_eps"] = config.head_norm_eps
    if config.block_type == "gla":
        wrong = {k: getattr(config, k) for k, v in FLA_FIXED_GATE.items() if getattr(config, k) != v}
        if wrong:
            raise InvalidValue(f"fla's GLA fixes {FLA_FIXED_GATE}; this model has {wrong}, so it cannot be exported to fla")
        specific = dict(
            num_kv_heads=config.num_kv_heads,
            elementwise_affine=True,
            expand_k=config.expand_k,
            expand_v=config.expand_v,
            attn_mode="chunk",
            use_short_conv=False,
            conv_size=4,
            use_output_gate=True,
            feature_map=None,
            clamp_min=None,
            use_gk=True,
            use_gv=False,
            attn=fla_attn(config),
        )
    elif config.block_type == "gdn":
        specific = dict(
            attn_mode="chunk",
            expand_v=config.expand_v,
            head_dim=config.head_dim,
            num_v_heads=None,
            use_gate=True,
            use_short_conv=True,
            allow_neg_eigval=False,
            conv_size=config.conv_size,
            output_gate_activation="swish",
            attn=fla_attn(config),
        )
    elif config.block_type == "deltanet":
        specific = dict(
            attn_mode="chunk",
            expand_k=config.expand_k,
            expand_v=config.expand_v,
            use_gate=False,
            use_beta=True,
            use_short_conv=True,
            use_output_norm=True,
            allow_neg_eigval=False,
            conv_size=config.conv_size,
            qk_norm="l2",
            qk_activation="silu",
            attn=fla_attn(config),
        )
    else:
        specific = dict(num_kv_heads=config.num_kv_heads, elementwise_affine=True, qkv_bias=False, qk_norm=False,
                        window_size=None, rope_theta=config.rope_base)
    model_type = MODEL_TYPES[config.block_type]
    return dict(architectures=[ARCHITECTURES[model_type]], model_type=model_type, **common, **specific, fabric_lin=ours)


def config_from_fla(hf: dict, path: Path, name: str) -> Config:
    """Our Config for an fla config.json; features fabric-lin's model does not have are refused."""
    model_type = hf.get("model_type")
    if model_type in LLAMA_MODEL_TYPES:
        raise InvalidValue(f"{path}: model_type {model_type!r} is a Llama/Mistral model, not one of fla's; make a GLA model "
                           f"directory from it with: {from_llama_command(path.parent)}")
    if model_type not in ARCHITECTURES:
        raise InvalidValue(
            f"{path}: model_type {model_type!r} is not supported; expected one of {list(ARCHITECTURES)} (fla's GLA, "
            "Gated DeltaNet, DeltaNet or transformer)"
        )

    def get(key, default=None):
        return hf.get(key, default) if hf.get(key) is not None else default

    def typed(key, default, kind):
        """`get(key, default)`, refused naming the key unless of `kind` (as Config names it): bool() or float() would
        take a quoted "false" for true, and fail on "abc" with a traceback."""
        value = get(key, default)
        if not is_kind(value, kind):
            raise InvalidValue(f"{path}: {key} must be {kind}, got {value!r}")
        return value

    unsupported = {
        "hidden_act": (get("hidden_act", "swish"), ("swish", "silu")),
        "elementwise_affine": (get("elementwise_affine", True), (True,)),
        # every fla family: learned mixes of earlier layers' outputs in place of the residual sums
        "attnres_block_size": (hf.get("attnres_block_size"), (None,)),
    }
    if model_type == "gla":
        unsupported.update(
            use_short_conv=(get("use_short_conv", False), (False,)),
            feature_map=(hf.get("feature_map"), (None,)),
            use_output_gate=(get("use_output_gate", True), (True,)),
            clamp_min=(hf.get("clamp_min"), (None,)),
            use_gk=(get("use_gk", True), (True,)),
            use_gv=(get("use_gv", False), (False,)),
        )
    elif model_type == "gated_deltanet":
        unsupported.update(
            use_gate=(get("use_gate", True), (True,)),
            use_short_conv=(get("use_short_conv", True), (True,)),
            allow_neg_eigval=(get("allow_neg_eigval", False), (False,)),
            num_v_heads=(get("num_v_heads", hf.get("num_heads")), (hf.get("num_heads"),)),
            output_gate_activation=(get("output_gate_activation", "swish"), ("swish", "silu")),
        )
    elif model_type == "delta_net":
        unsupported.update(
            use_gate=(get("use_gate", False), (False,)),
            use_beta=(get("use_beta", True), (True,)),
            use_short_conv=(get("use_short_conv", True), (True,)),
            use_output_norm=(get("use_output_norm", True), (True,)),
            allow_neg_eigval=(get("allow_neg_eigval", False), (False,)),
            qk_norm=(get("qk_norm", "l2"), ("l2",)),
            qk_activation=(get("qk_activation", "silu"), ("silu",)),
        )
    else:
        unsupported.update(
            qkv_bias=(get("qkv_bias", False), (False,)),
            qk_norm=(get("qk_norm", False), (False,)),
            window_size=(hf.get("window_size"), (None,)),
        )
    bad = [f"{k}={v!r} (supported: {', '.join(map(repr, ok))})" for k, (v, ok) in unsupported.items() if v not in ok]
    if bad:
        raise InvalidValue(f"{path}: fabric-lin's {model_type} model has no equivalent of " + "; ".join(bad))
    required = ["hidden_size", "num_hidden_layers", "num_heads", "vocab_size"] + (["head_dim"] if model_type == "gated_deltanet" else [])
    missing = [k for k in required if not isinstance(hf.get(k), int)]
    if missing:
        raise InvalidValue(f"{path}: missing or non-integer fields {missing}")
    ours = fabric_lin_key(hf, path)
    norm_eps = typed("norm_eps", 1e-6, "a number")
    block_type = {v: k for k, v in MODEL_TYPES.items()}[model_type]
    fields = dict(
        name=ours.get("name") or name,
        block_type=block_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_heads"],
        hidden_ratio=get("hidden_ratio", 4),
        intermediate_size=hf.get("intermediate_size"),
        norm_eps=norm_eps,
        tie_embeddings=typed("tie_word_embeddings", False, "true or false"),
        initializer_range=typed("initializer_range", 0.02, "a number"),
        max_seq_length=typed("max_position_embeddings", 2048, "an integer"),
    )
    if block_type in ("gla", "transformer"):
        fields.update(num_kv_heads=hf.get("num_kv_heads"))
    if block_type == "gla":
        fields.update(expand_k=get("expand_k", 0.5), expand_v=get("expand_v", 1.0), **FLA_FIXED_GATE)
    elif block_type == "gdn":
        fields.update(head_dim=hf["head_dim"], expand_v=get("expand_v", 2.0), conv_size=typed("conv_size", 4, "an integer"))
    elif block_type == "deltanet":
        fields.update(expand_k=get("expand_k", 1.0), expand_v=get("expand_v", 1.0), conv_size=typed("conv_size", 4, "an integer"))
    else:
        fields.update(rope_base=rope_theta(hf, "rope_theta", path))
    if block_type != "transformer":
        fields.update(head_norm_eps=float(ours.get("head_norm_eps", norm_eps)),  # fla: the head norm uses norm_eps
                      **attn_fields(hf.get("attn"), path))
    try:
        return Config(**fields)
    except (TypeError, ValueError) as e:
        raise InvalidValue(f"{path}: {e}") from None


def fabric_lin_key(hf: dict, path: Path) -> dict:
    """The "fabric_lin" mapping of an export's config.json ({} where it has none: an fla-trained model), its values
    checked, since float() fails on a quoted or null head_norm_eps and takes true for the eps 1.0."""
    ours = hf.get("fabric_lin")
    if ours is None:
        return {}
    if not isinstance(ours, dict):
        raise InvalidValue(f"{path}: fabric_lin must be a mapping (fabric-lin's own fields: name, head_norm_eps), got {ours!r}")
    if "head_norm_eps" in ours and not is_kind(ours["head_norm_eps"], "a number"):
        raise InvalidValue(f"{path}: fabric_lin.head_norm_eps must be a number, got {ours['head_norm_eps']!r}")
    if not isinstance(ours.get("name", ""), (str, type(None))):
        raise InvalidValue(f"{path}: fabric_lin.name must be a string, got {ours['name']!r}")
    return ours


def attn_fields(attn, path: Path) -> dict:
    """Our hybrid fields from fla's `attn` key: one set of heads for every attention layer, full context."""
    if attn is None:
        return {}
    specs = [attn] if isinstance(attn, dict) else attn

    def well_formed(spec) -> bool:
        """layers a list of layer indices, num_heads (and num_kv_heads, where given) a count: the sorting and the set
        of heads below fail on anything else."""
        return (isinstance(spec, dict) and isinstance(spec.get("layers"), list)
                and all(is_kind(i, "an integer") for i in spec["layers"]) and is_kind(spec.get("num_heads"), "an integer")
                and (spec.get("num_kv_heads") is None or is_kind(spec["num_kv_heads"], "an integer")))

    if not isinstance(specs, list) or not specs or not all(well_formed(s) for s in specs):
        raise InvalidValue(f"{path}: attn must be a mapping (or list of mappings) with layers (a list of layer indices) "
                           f"and num_heads (an integer), got {attn!r}")
    heads = {(s["num_heads"], s.get("num_kv_heads") or s["num_heads"]) for s in specs}
    unsupported = [f"{k}={s[k]!r}" for s in specs for k in ("qkv_bias", "window_size", "qk_norm") if s.get(k)]
    bases = {rope_theta(s, "attn.rope_theta", path) for s in specs}
    if len(heads) > 1 or unsupported or len(bases) > 1:
        raise InvalidValue(
            f"{path}: fabric-lin's hybrids have one set of attention heads over the whole context, no biases or q/k "
            f"norms; attn has {sorted(heads)} heads{', ' + ', '.join(unsupported) if unsupported else ''}"
        )
    (num_heads, num_kv_heads), = heads
    layers = sorted(i for s in specs for i in s["layers"])
    return dict(attn_layers=layers, attn_num_heads=num_heads, attn_num_kv_heads=num_kv_heads, rope_base=bases.pop())


def rope_theta(spec: dict, key: str, path: Path) -> float:
    """The rotary base of the attention that fla builds from `spec` (config.json, or one of its `attn` entries; `key`
    names it in an error): fla's default where rope_theta is left out. A null is refused, not read as the default:
    fla itself cannot build that attention (its rotary embedding takes float(rope_theta))."""
    value = spec.get("rope_theta", FLA_ROPE_THETA)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidValue(f"{path}: {key} must be a number, the rotary embedding's base (left out: fla's "
                           f"{FLA_ROPE_THETA:g}), got {value!r}")
    return float(value)


def special_token_ids(model_dir: Path) -> Dict[str, Optional[int]]:
    """bos/eos ids for config.json from the model directory's tokenizer, when it has one."""
    if not (model_dir / "tokenizer.model").is_file():
        return {}
    from fabric_lin.data.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}


def write_hf_tokenizer_config(output_dir: Path, model_dir: Path) -> None:
    """A tokenizer_config.json for `AutoTokenizer` (SentencePiece via LlamaTokenizer). fabric-lin trains
    on documents without BOS and with EOS at the end, so no BOS is added to a prompt."""
    from fabric_lin.data.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    piece = tokenizer.processor.IdToPiece
    data = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": piece(tokenizer.bos_id) if tokenizer.bos_id is not None else None,
        "eos_token": piece(tokenizer.eos_id) if tokenizer.eos_id is not None else None,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    atomic_write(output_dir / "tokenizer_config.json", lambda p: Path(p).write_text(json.dumps(data, indent=2) + "\n"))


def without_bos_token(path: Path, named: Path) -> None:
    """Set "add_bos_token": false in a copied tokenizer_config.json, keeping every other key; `named`: the file as the
    change is told, where it ends up.

    fabric-lin's documents have no BOS (data prep encodes with bos=False, eos=True; generate encodes
    prompts without BOS), but LlamaTokenizer prepends one when the key is true (Llama-2's file) or absent."""
    data = read_json(path)
    if data.get("add_bos_token") is False:
        return
    before = json.dumps(data["add_bos_token"]) if "add_bos_token" in data else "absent"
    data["add_bos_token"] = False
    atomic_write(path, lambda p: Path(p).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"))
    print(f"{named}: add_bos_token {before} -> false (fabric-lin's training data and generate have no BOS)")
