"""Model configurations: one `Config` dataclass and the named models as plain data."""
import difflib
import math
import numbers
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


@dataclass
class Config:
    name: str = ""
    block_type: Literal["gla", "transformer"] = "gla"
    vocab_size: int = 32000
    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 4
    # Grouped key/value heads (MQA/GQA). None means one key/value head per query head.
    num_kv_heads: Optional[int] = None
    # GLA: key width = hidden_size * expand_k, value width = hidden_size * expand_v (all heads together)
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: int = 16
    # SwiGLU width; None = 256 * ceil(int(hidden_size * hidden_ratio * 2 / 3) / 256)
    intermediate_size: Optional[int] = None
    hidden_ratio: int = 4
    norm_eps: float = 1e-6
    head_norm_eps: float = 1e-5  # the per-head RMSNorm on the GLA output
    tie_embeddings: bool = False
    initializer_range: float = 0.02
    # transformer baseline only
    rope_base: float = 10000.0
    max_seq_length: int = 2048

    def __post_init__(self):
        # YAML hands over whatever was written ('128' quoted, a quoted "false" that is truthy), so the
        # types are checked before any arithmetic turns them into an obscure error or a silent change
        optional = {"num_kv_heads", "intermediate_size"} | ({"hidden_ratio"} if self.intermediate_size is not None else set())
        for name, kind in _FIELD_KINDS.items():
            value = getattr(self, name)
            if not (value is None and name in optional or _is_kind(value, kind)):
                raise ValueError(f"model config {name} must be {kind}, got {value!r}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.intermediate_size is None:
            if not self.hidden_ratio > 0:
                raise ValueError(f"model config hidden_ratio must be positive, got {self.hidden_ratio!r}")
            raw = int(self.hidden_size * self.hidden_ratio * 2 / 3)
            self.intermediate_size = 256 * math.ceil(raw / 256)
        if self.block_type not in ("gla", "transformer"):
            raise ValueError(f"block_type must be 'gla' or 'transformer', got {self.block_type!r}")
        for size in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "gate_low_rank_dim", "max_seq_length"):
            if getattr(self, size) < 1:
                raise ValueError(f"model config {size} must be at least 1, got {getattr(self, size)}")
        for name in ("expand_k", "expand_v", "gate_logit_normalizer", "rope_base"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model config {name} must be positive, got {getattr(self, name)!r}")
        for name in ("norm_eps", "head_norm_eps", "initializer_range"):
            if getattr(self, name) < 0:
                raise ValueError(f"model config {name} must not be negative, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        # the widths split into heads, named by the keys they come from
        if self.block_type == "gla":
            widths = {f"hidden_size * expand_k = {self.hidden_size} * {self.expand_k}": self.key_dim,
                      f"hidden_size * expand_v = {self.hidden_size} * {self.expand_v}": self.value_dim}
        else:
            widths = {"hidden_size": self.hidden_size}
        for source, width in widths.items():
            if width < self.num_heads or width % self.num_heads:
                raise ValueError(f"{source} = {width} must be a positive multiple of num_heads={self.num_heads}")
        if self.block_type == "transformer" and self.head_k_dim % 2:
            raise ValueError(
                f"hidden_size / num_heads = {self.hidden_size} / {self.num_heads} = {self.head_k_dim}: the rotary"
                " embedding needs an even head dim"
            )

    # derived widths
    @property
    def key_dim(self) -> int:
        return int(self.hidden_size * self.expand_k) if self.block_type == "gla" else self.hidden_size

    @property
    def value_dim(self) -> int:
        return int(self.hidden_size * self.expand_v) if self.block_type == "gla" else self.hidden_size

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
            raise ValueError(f"Unknown model name {name!r}.{hint} Known names: {', '.join(name_to_config)}")
        return cls(**{**name_to_config[name], **overrides})

    @classmethod
    def from_file(cls, path: Union[str, Path], **overrides: Any) -> "Config":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: expected a model_config.yaml")
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of Config fields, got {type(data).__name__}")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; valid keys are {sorted(valid)}")
        try:
            return cls(**{**data, **overrides})
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Union[str, Path], **overrides: Any) -> "Config":
        return cls.from_file(Path(checkpoint_dir) / "model_config.yaml", **overrides)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Union[str, Path]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)


_FIELD_KINDS = {
    **dict.fromkeys(["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "gate_low_rank_dim",
                     "intermediate_size", "max_seq_length"], "an integer"),
    **dict.fromkeys(["expand_k", "expand_v", "gate_logit_normalizer", "hidden_ratio", "norm_eps", "head_norm_eps",
                     "initializer_range", "rope_base"], "a number"),
    "tie_embeddings": "true or false",
}


def _is_kind(value: Any, kind: str) -> bool:
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
    # Llama-style baseline: RoPE + SDPA, 16 heads of 64, same MLP and budget as gla-340M
    dict(name="transformer-340M", block_type="transformer", hidden_size=1024, num_layers=24, num_heads=16),
    # tiny models for tests and the CPU quick start (vocabulary of the sample corpus tokenizer)
    dict(name="gla-debug", vocab_size=4096, hidden_size=128, num_layers=4, num_heads=2, expand_k=0.5, expand_v=1.0),
    dict(name="transformer-debug", block_type="transformer", vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4),
]
name_to_config = {c["name"]: c for c in configs}
