"""Hugging Face Llama / Mistral weights -> a GLA model directory, for continual pretraining.

The GLA model is built from its named config and every Llama weight whose shape matches is copied:

    Llama (HF names)                                  GLA
    model.embed_tokens.weight                         embeddings.weight
    model.layers.{i}.input_layernorm.weight           layers.{i}.attn_norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  layers.{i}.attn.{q,k,v,o}_proj.weight
    model.layers.{i}.post_attention_layernorm.weight  layers.{i}.mlp_norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight   layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight                                 norm.weight
    lm_head.weight (embed_tokens when tied)           lm_head.weight (when GLA's is untied)

The GLA-only weights (output gate g_proj, low-rank forget gate gk_proj, per-head g_norm) keep the
model's fresh init. Llama's RoPE has no GLA counterpart, so q and k are used without it. The norms'
eps is taken from the Llama (`rms_norm_eps`), as the weights were trained with it. A vocabulary of
another size is warned about: the embedding rows (and lm_head rows) are truncated, or the extra rows
keep their fresh init.
"""
import re
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

import torch

from fabric_lin.config import Config, is_kind
from fabric_lin.convert.model_dir import (
    HF_CONFIG_FILE,
    LLAMA_MODEL_TYPES,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX_FILE,
    models_below,
    parse_dtype,
    prepare_output_dir,
    refuse_mixed_exports,
    save_model_dir,
)
from fabric_lin.errors import InvalidValue, MissingFile
from fabric_lin.files import created_dir, read_json, short_list
from fabric_lin.weights import inside, meta_model, open_safetensors

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def convert_from_llama(
    checkpoint_dir: Optional[Path] = None,
    model_name: str = "gla-7B",
    output_dir: Optional[Path] = None,
    dtype: Optional[str] = None,
    overwrite: bool = False,
    seed: int = 42,
) -> Dict[str, List[str]]:
    """Initialise a GLA model from a Hugging Face Llama or Mistral checkpoint (safetensors).

    Args:
        checkpoint_dir: (required) the Hugging Face directory: config.json, model.safetensors or
            shards with model.safetensors.index.json, tokenizer.model.
        model_name: the GLA config to build (`fabric-lin pretrain list`); hidden size and layer count
            must match the Llama's.
        output_dir: (required) where to write the model directory (for `pretrain --initial_checkpoint_dir`).
        dtype: float32, bfloat16 or float16 (default: the Llama's embedding dtype).
        overwrite: write into a non-empty output_dir, in place of the model written there before (its other
            files stay), which is removed only once this one is written whole.
        seed: seed of the fresh init of the weights that are not copied.

    Returns the report: names `copied`, `initialized` (kept at init), `ignored` (Llama tensors not used).
    """
    from fabric_lin.data.tokenizer import weights_trained_with

    if checkpoint_dir is None:
        raise InvalidValue("--checkpoint_dir is required: the Hugging Face Llama or Mistral directory to convert")
    if output_dir is None:
        raise InvalidValue("--output_dir is required: where to write the model directory")
    if not -(2**63) <= seed < 2**64:  # torch.Generator's seeds are 64-bit (a negative one is taken as its two's complement)
        raise InvalidValue(f"--seed {seed}: expected a 64-bit seed, 0 to {2**64 - 1}")
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / HF_CONFIG_FILE
    expected = "expected a Hugging Face Llama/Mistral directory"
    if checkpoint_dir.is_file():
        raise InvalidValue(f"--checkpoint_dir {checkpoint_dir} is a file: give the directory that holds it, {checkpoint_dir.parent}")
    if not checkpoint_dir.is_dir():
        raise MissingFile(f"--checkpoint_dir {checkpoint_dir} does not exist: {expected}")
    if not config_path.is_file():
        below = models_below(checkpoint_dir)  # a Hugging Face cache's repository holds the Llama in snapshots/<revision>/
        raise MissingFile(f"--checkpoint_dir {checkpoint_dir} holds no {HF_CONFIG_FILE}: {expected}" + (f"; {below}" if below else ""))
    llama = read_json(config_path)
    if llama.get("model_type") not in LLAMA_MODEL_TYPES:
        raise InvalidValue(f"{config_path}: model_type {llama.get('model_type')!r}; expected one of {LLAMA_MODEL_TYPES}")
    if "quantization_config" in llama:
        # int8/4-bit weights are integers plus scale tensors (`.SCB`, ...): copied, they are not the weights
        method = llama["quantization_config"].get("quant_method") if isinstance(llama["quantization_config"], dict) else None
        raise InvalidValue(
            f"{config_path} has a 'quantization_config' key (quant_method {method!r}): a quantized checkpoint cannot "
            "be copied into a GLA model; convert the unquantized (float) checkpoint"
        )
    # read as written: float() fails on a quoted "abc" with a traceback, and bool() takes "false" for true
    for key, kind in (("rms_norm_eps", "a number"), ("tie_word_embeddings", "true or false")):
        if llama.get(key) is not None and not is_kind(llama[key], kind):
            raise InvalidValue(f"{config_path}: {key} must be {kind}, got {llama[key]!r}")
    eps = llama.get("rms_norm_eps")
    config = Config.from_name(model_name, norm_eps=float(1e-6 if eps is None else eps))
    if config.block_type != "gla":
        raise InvalidValue(f"model_name {model_name!r} is a {config.block_type} model; expected a GLA model")
    for ours, theirs in (("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers")):
        if llama.get(theirs) != getattr(config, ours):
            raise InvalidValue(
                f"{config_path}: {theirs}={llama.get(theirs)} but {model_name} has {ours}={getattr(config, ours)}; "
                "choose a GLA config of the Llama's width and depth"
            )
    output_dir = prepare_output_dir(Path(output_dir), overwrite, sources=[checkpoint_dir])
    # the tokenizer to copy, before the minutes of reading 7B weights: one that cannot be read (a Git LFS pointer, a
    # truncated download) or is not the one its trained_with.json records is refused at once
    weights_trained_with(checkpoint_dir, "--checkpoint_dir")

    reader = SafetensorsReader(checkpoint_dir)
    check_tokenizer_fits_the_llama(checkpoint_dir, reader)
    torch_dtype = parse_dtype(dtype) or reader.dtype("model.embed_tokens.weight")
    llama_tied = bool(llama.get("tie_word_embeddings", False)) or "lm_head.weight" not in reader.names
    sources = {name: llama_name(name, llama_tied) for name in meta_model(config).state_dict()}
    # a weight the Llama's config gives it and its files lack would keep its fresh init, said as a count only
    lacking = [source for source in sources.values() if source is not None and source not in reader.names]
    if lacking:
        raise InvalidValue(
            f"{checkpoint_dir} holds no {short_list(lacking, 3)}, which its {HF_CONFIG_FILE}'s model (num_hidden_layers "
            f"{llama.get('num_hidden_layers')}) has: a download or copy that left files out? Give the whole checkpoint")

    state, copied, initialized, partial = {}, [], [], []
    model = meta_model(config)
    torch.manual_seed(seed)
    for name, target in model.state_dict().items():
        source_name = sources[name]
        source = reader.get(source_name) if source_name in reader.names else None
        if source is not None and target.is_floating_point() and not source.is_floating_point():
            raise InvalidValue(
                f"{checkpoint_dir}: {source_name} has dtype {source.dtype}, expected a floating-point weight for {name} "
                "(a quantized checkpoint? convert the unquantized one)"
            )
        if source is not None and source.shape == target.shape:
            state[name] = source.to(torch_dtype)
            check_copy(state[name], source, f"{checkpoint_dir}: {source_name} -> {name}")
            copied.append(name)
            continue
        fresh = fresh_init(model, name).to(torch_dtype)
        vocab_rows = name in ("embeddings.weight", "lm_head.weight") and source is not None
        if vocab_rows and source.ndim == 2 and source.shape[1] == target.shape[1]:
            rows = min(source.shape[0], target.shape[0])
            fresh[:rows] = source[:rows].to(torch_dtype)
            check_copy(fresh[:rows], source[:rows], f"{checkpoint_dir}: {source_name}[:{rows}] -> {name}[:{rows}]")
            partial.append(name)
            print(
                f"Warning: vocabulary sizes differ: {source_name} has {source.shape[0]} rows, {model_name} has "
                f"vocab_size={target.shape[0]}; "
                + (f"rows {target.shape[0]}.. dropped" if source.shape[0] > target.shape[0] else f"rows {rows}.. keep their init")
            )
        else:
            if source is not None:
                print(f"Warning: {source_name} has shape {tuple(source.shape)}, {name} needs {tuple(target.shape)}: kept at init")
            initialized.append(name)
        state[name] = fresh
    used = {sources[n] for n in copied + partial}
    ignored = [n for n in reader.names if n not in used]

    with created_dir(output_dir):
        tokenizer_files = save_model_dir(state, config, output_dir, tokenizer_dir=checkpoint_dir,
                                         tokenizer_given_by="--checkpoint_dir")
    warn_tokenizer_vocab(output_dir, config)
    print(f"Built {model_name} from {checkpoint_dir} -> {output_dir} ({torch_dtype}), tokenizer files {tokenizer_files}")
    print(f"  copied from the Llama ({len(copied)}): {summarize(copied)}")
    if partial:
        print(f"  copied in part, vocabulary rows ({len(partial)}): {summarize(partial)}")
    print(f"  kept at init ({len(initialized)}): {summarize(initialized)}")
    if ignored:
        print(f"  Llama tensors not used ({len(ignored)}): {summarize(ignored)}")
    return {"copied": copied, "partial": partial, "initialized": initialized, "ignored": ignored}


def llama_name(name: str, llama_tied: bool) -> Optional[str]:
    """The HF Llama tensor that `name` is copied from (None: no counterpart)."""
    if name == "embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return "model.embed_tokens.weight" if llama_tied else "lm_head.weight"
    match = _LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def check_copy(copy: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """Refuse a copy that differs from the source by more than rounding to the copy's dtype: a value
    past the dtype's range (inf in float16 from 1e6) or a NaN in the source. Compared in fp32
    against the source as read, since the copy compared with a second cast of it always agrees."""
    finfo = torch.finfo(copy.dtype)
    try:
        torch.testing.assert_close(copy.float(), source.float(), rtol=finfo.eps, atol=finfo.smallest_normal)
    except AssertionError as e:
        details = "; ".join(line.strip() for line in str(e).splitlines()[1:] if line.strip())
        raise InvalidValue(
            f"{what}: the {copy.dtype} copy differs from the source by more than rounding (a value out of "
            f"{copy.dtype}'s range, or NaN): {details}"
        ) from None


def fresh_init(model: torch.nn.Module, name: str) -> torch.Tensor:
    """Tensor `name` as the model's own `reset_parameters` initialises it, materialising only the
    module that owns it (the rest of the model stays on the meta device)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if getattr(module, attr).device.type == "meta":
        module.to_empty(device="cpu", recurse=False)
        module.reset_parameters()
    return getattr(module, attr).detach().clone()


class SafetensorsReader:
    """Tensors of model.safetensors or of the shards of model.safetensors.index.json, read one at a time."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        index_path = self.directory / SAFETENSORS_INDEX_FILE
        if index_path.is_file():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InvalidValue(f"{index_path}: expected a non-empty 'weight_map' of tensor name -> shard file")
            refuse_mixed_exports(self.directory, weight_map.values(), index_path)
            files = {f: inside(self.directory, f, str(index_path)) for f in set(weight_map.values())}
            self.file_of = {name: files[f] for name, f in weight_map.items()}
        elif (self.directory / SAFETENSORS_FILE).is_file():
            with open_safetensors(self.directory / SAFETENSORS_FILE) as f:
                self.file_of = {name: self.directory / SAFETENSORS_FILE for name in f.keys()}
        else:
            found = sorted(p.name for p in self.directory.iterdir())
            raise MissingFile(
                f"{self.directory} holds neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE} (found {found[:8]}); "
                "only safetensors are read"
            )
        missing = sorted({str(p.name) for p in self.file_of.values() if not p.is_file()})
        if missing:
            raise MissingFile(f"{self.directory}: shard files {missing} are listed but missing")
        self.names = list(self.file_of)
        if "model.embed_tokens.weight" not in self.file_of:
            raise InvalidValue(f"{self.directory} has no model.embed_tokens.weight: not a Hugging Face Llama checkpoint")

    def get(self, name: str) -> torch.Tensor:
        with open_safetensors(self.file_of[name]) as f:
            if name not in f.keys():
                raise InvalidValue(f"{self.file_of[name]} lacks {name}, which the index places there")
            return f.get_tensor(name)

    def rows(self, name: str) -> int:
        """The first dimension of tensor `name`, from its file's header: no weight is read."""
        with open_safetensors(self.file_of[name]) as f:
            return f.get_slice(name).get_shape()[0]

    def dtype(self, name: str) -> torch.dtype:
        with open_safetensors(self.file_of[name]) as f:
            code = f.get_slice(name).get_dtype()
        return _SAFETENSORS_DTYPES.get(code) or self.get(name).dtype


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def check_tokenizer_fits_the_llama(checkpoint_dir: Path, reader: SafetensorsReader) -> None:
    """Refuse a tokenizer.model of more pieces than the Llama has embedding rows: the Llama was not trained with it (a
    tokenizer of another model copied in), so its ids are other pieces and those past the rows were never trained. One
    of fewer pieces is allowed: checkpoints pad their embedding to a round number of rows."""
    if not (checkpoint_dir / "tokenizer.model").is_file():
        return
    from fabric_lin.data.tokenizer import Tokenizer

    pieces, rows = Tokenizer(checkpoint_dir, "--checkpoint_dir").vocab_size, reader.rows("model.embed_tokens.weight")
    if pieces > rows:
        raise InvalidValue(
            f"--checkpoint_dir {checkpoint_dir}: its tokenizer.model has {pieces} pieces, more than the {rows} rows of "
            f"the Llama's model.embed_tokens.weight, so it is not the tokenizer the Llama was trained with (ids {rows} "
            f"and up have no trained row); put the Llama's own tokenizer.model (and tokenizer_config.json) there")


def warn_tokenizer_vocab(model_dir: Path, config: Config) -> None:
    if not (model_dir / "tokenizer.model").is_file():
        return
    from fabric_lin.data.tokenizer import Tokenizer

    vocab = Tokenizer(model_dir).vocab_size
    if vocab > config.vocab_size:
        print(f"Warning: the tokenizer has {vocab} pieces but {config.name} has vocab_size={config.vocab_size}: ids past it cannot be embedded")


def summarize(names: List[str]) -> str:
    """`layers.{i}.x` for names repeated across layers, with the count."""
    counts = Counter(re.sub(r"^(model\.)?layers\.\d+\.", r"\1layers.{i}.", n) for n in names)
    return ", ".join(f"{n} (x{c})" if c > 1 else n for n, c in counts.items()) or "none"
