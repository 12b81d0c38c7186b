"""Model configurations: one `Config` dataclass and the named models as plain data."""
import difflib
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, List, Literal, Optional, Union

import yaml

from fabric_lin.errors import InvalidValue, MissingFile, process_rank
from fabric_lin.files import read_yaml

CONFIG_FILE = "model_config.yaml"  # the model's Config, in a checkpoint and in a model directory
# keys of LitGPT's Config, whose checkpoints hold a lit_model.pth and a model_config.yaml of that name too
LITGPT_KEYS = ("n_embd", "n_layer", "block_size")
# how a user changes one field of a named model's config, for messages that ask for another vocab_size
OTHER_VOCAB_SIZE = ("`fabric-lin pretrain list NAME > model.yaml` writes the model's config: set vocab_size there and "
                    "give --model_config model.yaml in place of --model_name")


@dataclass
class Config:
    name: str = ""
    block_type: Literal["gla", "gdn", "deltanet", "transformer"] = "gla"
    """gla: Gated Linear Attention; gdn: Gated DeltaNet; deltanet: DeltaNet (the delta rule without decay);
    transformer: the softmax-attention baseline"""
    vocab_size: int = 32000
    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 4
    # Grouped key/value heads (MQA/GQA; GLA and transformer). None means one key/value head per query head.
    num_kv_heads: Optional[int] = None
    # GLA, DeltaNet: key width = hidden_size * expand_k, value width = hidden_size * expand_v (all heads together).
    # GDN: key width per head = head_dim, value width per head = head_dim * expand_v (fla's meaning there).
    expand_k: float = 0.5
    expand_v: float = 1.0
    head_dim: Optional[int] = None
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: int = 16
    conv_size: int = 4  # GDN, DeltaNet: width of the causal depthwise convolutions after q, k and v
    # SwiGLU width; None = 256 * ceil(int(hidden_size * hidden_ratio * 2 / 3) / 256)
    intermediate_size: Optional[int] = None
    hidden_ratio: int = 4
    norm_eps: float = 1e-6
    # eps of the per-head RMSNorm on the GLA/GDN output; None: norm_eps, as flash-linear-attention's models
    # use (checkpoints trained with another value keep it in their model_config.yaml)
    head_norm_eps: Optional[float] = None
    tie_embeddings: bool = False
    initializer_range: float = 0.02
    # transformer layers: RoPE base
    rope_base: float = 10000.0
    max_seq_length: int = 2048
    # hybrids (gla, gdn, deltanet): the layers (0-based) that are softmax-attention blocks instead, with their own heads
    # (fla's `attn` config key: layers, num_heads, num_kv_heads)
    attn_layers: List[int] = field(default_factory=list)
    attn_num_heads: Optional[int] = None
    attn_num_kv_heads: Optional[int] = None

    def __post_init__(self):
        # YAML hands over whatever was written ('128' quoted, a quoted "false" that is truthy), so the
        # types are checked before any arithmetic turns them into an obscure error or a silent change
        optional = {"num_kv_heads", "intermediate_size", "head_dim", "head_norm_eps", "attn_num_heads",
                    "attn_num_kv_heads"} | ({"hidden_ratio"} if self.intermediate_size is not None else set())
        for name, kind in _FIELD_KINDS.items():
            value = getattr(self, name)
            if not (value is None and name in optional or is_kind(value, kind)):
                raise InvalidValue(f"model config {name} must be {kind}, got {value!r}")
        if not isinstance(self.attn_layers, (list, tuple)) or not all(is_kind(i, "an integer") for i in self.attn_layers):
            raise InvalidValue(f"model config attn_layers must be a list of layer indices, got {self.attn_layers!r}")
        twice = sorted({i for i in self.attn_layers if list(self.attn_layers).count(i) > 1})
        if twice:  # most likely a typo for another layer, which would stay a linear-attention one
            raise InvalidValue(f"model config attn_layers {list(self.attn_layers)} lists layer {twice[0]} twice; "
                               "give each softmax-attention layer once")
        self.attn_layers = sorted(self.attn_layers)
        if self.block_type not in ("gla", "gdn", "deltanet", "transformer"):
            raise InvalidValue(f"block_type must be 'gla', 'gdn', 'deltanet' or 'transformer', got {self.block_type!r}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_norm_eps is None:
            self.head_norm_eps = self.norm_eps
        if self.intermediate_size is None:
            if not self.hidden_ratio > 0:
                raise InvalidValue(f"model config hidden_ratio must be positive, got {self.hidden_ratio!r}")
            raw = int(self.hidden_size * self.hidden_ratio * 2 / 3)
            self.intermediate_size = 256 * math.ceil(raw / 256)
        for size in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "gate_low_rank_dim", "max_seq_length", "conv_size"):
            if getattr(self, size) < 1:
                raise InvalidValue(f"model config {size} must be at least 1, got {getattr(self, size)}")
        for name in ("expand_k", "expand_v", "gate_logit_normalizer", "rope_base"):
            if not getattr(self, name) > 0:
                raise InvalidValue(f"model config {name} must be positive, got {getattr(self, name)!r}")
        for name in ("norm_eps", "head_norm_eps", "initializer_range"):
            if getattr(self, name) < 0:
                raise InvalidValue(f"model config {name} must not be negative, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidValue(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self._check_settings_read()
        if self.block_type == "gdn":
            self._check_gdn()
        if self.block_type == "deltanet" and self.num_kv_heads != self.num_heads:
            raise InvalidValue(
                f"block_type 'deltanet' has one key/value head per head: num_kv_heads ({self.num_kv_heads}) must equal "
                f"num_heads ({self.num_heads}) or be left out"
            )
        # the widths split into heads, named by the keys they come from
        if self.block_type in ("gla", "deltanet"):
            widths = {f"hidden_size * expand_k = {self.hidden_size} * {self.expand_k}": self.key_dim,
                      f"hidden_size * expand_v = {self.hidden_size} * {self.expand_v}": self.value_dim}
        elif self.block_type == "transformer":
            widths = {"hidden_size": self.hidden_size}
        else:
            widths = {}
        for source, width in widths.items():
            if width < self.num_heads or width % self.num_heads:
                raise InvalidValue(f"{source} = {width} must be a positive multiple of num_heads={self.num_heads}")
        if self.block_type == "transformer" and self.head_k_dim % 2:
            raise InvalidValue(
                f"hidden_size / num_heads = {self.hidden_size} / {self.num_heads} = {self.head_k_dim}: the rotary"
                " embedding needs an even head dim"
            )
        self._check_attn_layers()

    def _check_settings_read(self) -> None:
        """Refuse a setting, other than its default, that this block_type's layers never read (GLA's gate widths on
        a DeltaNet model, a short convolution on a transformer): the model built would not be the one asked for."""
        readers = dict(_FAMILY_SETTINGS)
        if self.attn_layers:  # a hybrid's softmax-attention layers take their rotary embedding's base
            readers["rope_base"] = (self.block_type,)
        defaults = {f.name: f.default for f in fields(self)}
        for name, families in readers.items():
            value = getattr(self, name)
            if self.block_type not in families and value != defaults[name]:
                read_by = ", ".join(repr(f) for f in families) + (" (and a hybrid's attn_layers)" if name == "rope_base" else "")
                hint = " (its key width per head is head_dim)" if name == "expand_k" and self.block_type == "gdn" else ""
                raise InvalidValue(
                    f"model config {name} = {value!r} is read by block_type {read_by} only; this model is block_type "
                    f"{self.block_type!r}{hint}: leave {name} out or at its default {defaults[name]!r}"
                )

    def _check_gdn(self) -> None:
        if self.head_dim is None or self.head_dim < 1:
            raise InvalidValue(f"block_type 'gdn' needs head_dim, the key width of each head (e.g. 128), got {self.head_dim!r}")
        if self.num_kv_heads != self.num_heads:
            raise InvalidValue(
                f"block_type 'gdn' has one key/value head per head: num_kv_heads ({self.num_kv_heads}) must equal "
                f"num_heads ({self.num_heads}) or be left out"
            )
        head_v = self.head_dim * self.expand_v
        if head_v != int(head_v):
            raise InvalidValue(f"head_dim * expand_v = {self.head_dim} * {self.expand_v} = {head_v} must be a whole number")

    def _check_attn_layers(self) -> None:
        if not self.attn_layers:
            if self.attn_num_heads is not None or self.attn_num_kv_heads is not None:
                raise InvalidValue("model config attn_num_heads / attn_num_kv_heads are set but attn_layers is empty")
            return
        if self.block_type == "transformer":
            raise InvalidValue("model config attn_layers makes hybrids of gla, gdn or deltanet models; a transformer is all attention")
        bad = [i for i in self.attn_layers if not 0 <= i < self.num_layers]
        if bad:
            raise InvalidValue(f"model config attn_layers {bad} out of range: the layers are 0 .. {self.num_layers - 1}")
        if self.attn_num_heads is None:
            raise InvalidValue("model config attn_layers needs attn_num_heads, the softmax-attention layers' heads")
        if self.attn_num_kv_heads is None:
            self.attn_num_kv_heads = self.attn_num_heads
        kv = self.attn_kv_heads
        if self.attn_num_heads < 1 or kv < 1 or self.attn_num_heads % kv:
            raise InvalidValue(f"attn_num_heads ({self.attn_num_heads}) must be a positive multiple of attn_num_kv_heads ({kv})")
        if self.hidden_size % self.attn_num_heads or (self.hidden_size // self.attn_num_heads) % 2:
            raise InvalidValue(
                f"hidden_size / attn_num_heads = {self.hidden_size} / {self.attn_num_heads} must be a whole, even head dim"
                " (the rotary embedding)"
            )

    @property
    def attn_kv_heads(self) -> int:
        """Key/value heads of the softmax-attention layers of a hybrid."""
        return self.attn_num_kv_heads if self.attn_num_kv_heads is not None else self.attn_num_heads

    # derived widths (all heads together, and per head)
    @property
    def key_dim(self) -> int:
        if self.block_type in ("gla", "deltanet"):
            return int(self.hidden_size * self.expand_k)
        if self.block_type == "gdn":
            return self.num_heads * self.head_dim
        return self.hidden_size

    @property
    def value_dim(self) -> int:
        if self.block_type in ("gla", "deltanet"):
            return int(self.hidden_size * self.expand_v)
        if self.block_type == "gdn":
            return self.num_heads * int(self.head_dim * self.expand_v)
        return self.hidden_size

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.num_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.num_heads

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Config":
        if name not in name_to_config:
            close = difflib.get_close_matches(name, name_to_config, n=3, cutoff=0.4)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise InvalidValue(f"Unknown model name {name!r}.{hint} Known names: {', '.join(name_to_config)}")
        return cls(**{**name_to_config[name], **overrides})

    @classmethod
    def from_file(cls, path: Union[str, Path], **overrides: Any) -> "Config":
        path = Path(path)
        if not path.is_file():
            raise MissingFile(f"{path} does not exist: expected a model_config.yaml")
        data = read_yaml(path)
        if not isinstance(data, dict):  # an empty file reads as None
            held = "nothing (the file is empty)" if data is None else f"a {type(data).__name__}"
            raise InvalidValue(f"{path} holds {held}: expected a mapping of Config fields (name, block_type, "
                               f"hidden_size, ...)")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        refuse_litgpt_config(path, data)
        if unknown:
            raise InvalidValue(f"{path}: unknown keys {unknown}; valid keys are {sorted(valid)}")
        try:
            return cls(**{**data, **overrides})
        except ValueError as e:
            raise InvalidValue(f"{path}: {e}") from None

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Union[str, Path], **overrides: Any) -> "Config":
        return cls.from_file(Path(checkpoint_dir) / CONFIG_FILE, **overrides)

    def to_dict(self) -> dict:
        return asdict(self)

    def flag(self, config_file: Union[str, Path]) -> str:
        """The pretrain flag that builds this model, read from `config_file`: --model_name where it is a named model
        as it stands (but for max_seq_length, which a model directory sets to the length its run trained at, and a run
        trains at its train.max_seq_length), else --model_config <config_file>."""
        named = self.name in name_to_config and Config.from_name(self.name, max_seq_length=self.max_seq_length) == self
        return f"--model_name {self.name}" if named else f"--model_config {config_file}"

    def save(self, path: Union[str, Path]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)


# settings that only some families' layers read, and the block types that read them (rope_base: also a hybrid)
_FAMILY_SETTINGS = {
    "expand_k": ("gla", "deltanet"),
    "expand_v": ("gla", "gdn", "deltanet"),
    "head_dim": ("gdn",),
    "gate_low_rank_dim": ("gla",),
    "gate_logit_normalizer": ("gla",),
    "conv_size": ("gdn", "deltanet"),
    "rope_base": ("transformer",),
}

_FIELD_KINDS = {
    **dict.fromkeys(["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "gate_low_rank_dim",
                     "intermediate_size", "max_seq_length", "head_dim", "conv_size", "attn_num_heads",
                     "attn_num_kv_heads"], "an integer"),
    **dict.fromkeys(["expand_k", "expand_v", "gate_logit_normalizer", "hidden_ratio", "norm_eps", "head_norm_eps",
                     "initializer_range", "rope_base"], "a number"),
    "tie_embeddings": "true or false",
}


def is_kind(value: Any, kind: str) -> bool:
    if kind == "true or false":
        return isinstance(value, bool)
    number = numbers.Integral if kind == "an integer" else numbers.Real
    return isinstance(value, number) and not isinstance(value, bool)


configs = [
    # flame's gla_340M.json: untied embeddings
    dict(name="gla-340M", hidden_size=1024, num_layers=24, num_heads=4, expand_k=0.5, expand_v=1.0),
    dict(name="gla-1.3B", hidden_size=2048, num_layers=24, num_heads=4, expand_k=0.5, expand_v=1.0),
    # Mistral-7B's shapes (32 heads of 128, 8 key/value heads, SwiGLU 14336), so convert_from_llama
    # copies q/k/v/o and the MLP one to one.
    dict(
        name="gla-7B", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        expand_k=1.0, expand_v=1.0, intermediate_size=14336,
    ),
    # Gated DeltaNet as flash-linear-attention's GatedDeltaNetConfig counts them (num_heads * head_dim =
    # 0.75 * hidden_size); gdn-1.3B is that config's defaults
    dict(name="gdn-340M", block_type="gdn", hidden_size=1024, num_layers=24, num_heads=4, head_dim=128, expand_v=2.0),
    dict(name="gdn-1.3B", block_type="gdn", hidden_size=2048, num_layers=21, num_heads=6, head_dim=256, expand_v=2.0),
    # DeltaNet as flash-linear-attention's training recipes ship it (flame's delta_net_340M.json: 8 heads of 128);
    # deltanet-1.3B is fla's DeltaNetConfig defaults (16 heads of 128)
    dict(name="deltanet-340M", block_type="deltanet", hidden_size=1024, num_layers=24, num_heads=8, expand_k=1.0, expand_v=1.0),
    dict(name="deltanet-1.3B", block_type="deltanet", hidden_size=2048, num_layers=24, num_heads=16, expand_k=1.0, expand_v=1.0),
    # Llama-style baseline: RoPE + SDPA, 16 heads of 64, same MLP and budget as gla-340M
    dict(name="transformer-340M", block_type="transformer", hidden_size=1024, num_layers=24, num_heads=16),
    # tiny models for tests and the CPU quick start (vocabulary of the sample corpus tokenizer)
    dict(name="gla-debug", vocab_size=4096, hidden_size=128, num_layers=4, num_heads=2, expand_k=0.5, expand_v=1.0),
    dict(name="gdn-debug", block_type="gdn", vocab_size=4096, hidden_size=128, num_layers=4, num_heads=2, head_dim=48,
         expand_v=2.0),
    dict(name="deltanet-debug", block_type="deltanet", vocab_size=4096, hidden_size=128, num_layers=4, num_heads=2,
         expand_k=1.0, expand_v=1.0),
    dict(name="transformer-debug", block_type="transformer", vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4),
]
name_to_config = {c["name"]: c for c in configs}


def refuse_litgpt_config(path: Path, data: Any) -> None:
    """Refuse the model_config.yaml `path` (read as `data`) where it is LitGPT's: its directory is a LitGPT checkpoint,
    whose lit_model.pth would otherwise be taken for a fabric-lin model directory's, or its keys listed as unknown."""
    if isinstance(data, dict) and set(LITGPT_KEYS) <= set(data):
        raise InvalidValue(
            f"{path} is LitGPT's model config ({', '.join(LITGPT_KEYS)}), not fabric-lin's: {Path(path).parent} is a LitGPT "
            f"checkpoint, which no fabric-lin command reads; for a Llama or Mistral, give fabric-lin convert_from_llama "
            f"the Hugging Face directory (safetensors) it was downloaded from")


def resolve_model_config(model_name: Optional[str], model_config: Optional[Config]) -> Config:
    """The model a run builds: the one `model_name` names, or `model_config` as given (exactly one of them)."""
    if (model_name is None) == (model_config is None):
        raise InvalidValue("give exactly one of --model_name and --model_config (`fabric-lin pretrain list` shows the names)")
    if model_name is not None:
        return Config.from_name(model_name)
    # before Fabric: under torchrun every process gets here, and the first speaks for them
    if model_config.name in name_to_config and process_rank() == 0:
        # `--model_config.name gla-debug --model_config.vocab_size 512` builds Config's defaults under gla-debug's name;
        # a field that differs from the named model but holds Config's default is one such config likely never gave,
        # while a recipe's model changed field by field (`--model_config.hidden_size 256`) differs in its changes alone
        defaults = Config().to_dict()
        named = Config.from_name(model_config.name).to_dict()
        differing = [key for key, value in named.items() if getattr(model_config, key) != value]
        differs = [f"{key} {getattr(model_config, key)!r} ({model_config.name}: {named[key]!r})" for key in differing]
        if any(getattr(model_config, key) == defaults[key] for key in differing):
            print(f"Note: the model_config named {model_config.name} differs from that model in {'; '.join(differs)} "
                  f"(a model_config given field by field starts from Config's defaults, not from the model it names; "
                  f"`fabric-lin pretrain list {model_config.name} > model.yaml` writes that model's whole config, to "
                  f"edit and give as --model_config model.yaml)", flush=True)
    return model_config
