"""Training checkpoint -> model directory.

The training checkpoint's format (one file, or FSDP-sharded in torch.distributed.checkpoint form) is
`fabric_lin.checkpoint`'s, which also reads it; only the model's tensors are taken. The sharded form is
consolidated in this process, on the CPU, without a process group. The checkpoint is verified against
its manifest first: a damaged one is not converted.
"""
from pathlib import Path
from typing import Optional

from fabric_lin.checkpoint import HPARAMS_FILE
from fabric_lin.checkpoint_kinds import at_the_trained_length, find_training_checkpoint, load_model_weights
from fabric_lin.config import CONFIG_FILE
from fabric_lin.convert.model_dir import (
    cast_floating,
    check_state_dict,
    check_training_checkpoint_given,
    parse_dtype,
    prepare_output_dir,
    save_model_dir,
)
from fabric_lin.errors import InvalidValue
from fabric_lin.files import created_dir, read_yaml
from fabric_lin.weights import MODEL_FILE, canonical_state_dict


def convert_pretrained_checkpoint(
    checkpoint_dir: Path, output_dir: Optional[Path] = None, dtype: Optional[str] = None, overwrite: bool = False
) -> None:
    """Write the model of a training checkpoint as a model directory.

    The model directory (lit_model.pth with the model's state dict alone, model_config.yaml, tokenizer
    files) is what `generate`, evaluation and `pretrain --initial_checkpoint_dir` read. The checkpoint is
    first verified against its manifest.

    Args:
        checkpoint_dir: a training checkpoint directory, e.g. out/pretrain/gla-340M/step-00002048
            or .../final; from one device or FSDP-sharded from many.
        output_dir: where to write the model directory (required).
        dtype: cast floating-point weights to float32, bfloat16 or float16 (default: keep).
        overwrite: write into a non-empty output_dir, in place of the model written there before (its other
            files stay), which is removed only once this one is written whole.
    """
    if output_dir is None:
        raise InvalidValue("--output_dir is required: where to write the model directory")
    checkpoint_dir = Path(checkpoint_dir)
    torch_dtype = parse_dtype(dtype)
    check_training_checkpoint_given(checkpoint_dir)
    output_dir = prepare_output_dir(Path(output_dir), overwrite, sources=[checkpoint_dir])  # before the checksums are read
    config, weights_path = find_training_checkpoint(checkpoint_dir, use="convert")
    hparams_path = checkpoint_dir / HPARAMS_FILE
    config = at_the_trained_length(config, read_yaml(hparams_path) if hparams_path.is_file() else None)

    state_dict = canonical_state_dict(load_model_weights(weights_path))
    form = f"sharded ({len(list(weights_path.glob('*.distcp')))} shard files)" if weights_path.is_dir() else "single file"
    check_state_dict(state_dict, config, source=str(weights_path), config_file=checkpoint_dir / CONFIG_FILE)
    state_dict = cast_floating(state_dict, torch_dtype)

    with created_dir(output_dir):
        tokenizer_files = save_model_dir(state_dict, config, output_dir, tokenizer_dir=checkpoint_dir,
                                         tokenizer_given_by="checkpoint_dir")
    n_params = sum(t.numel() for t in state_dict.values())
    print(
        f"Converted {checkpoint_dir} ({form}): {len(state_dict)} tensors, {n_params:,} parameters, "
        f"dtype {dtype or 'as saved'} -> {output_dir / MODEL_FILE}"
    )
    print(f"Copied {CONFIG_FILE} (max_seq_length {config.max_seq_length}) and tokenizer files {tokenizer_files}")
