"""Checkpoint conversion: training checkpoint -> model directory, model directory <-> Hugging Face
(flash-linear-attention's GLAForCausalLM) format, and Llama/Mistral weights -> GLA.

    model_dir.py              load_model_dir_weights, check_state_dict (used by pretrain and generate)
    pretrained_checkpoint.py  convert_pretrained_checkpoint
    hf.py                     convert_to_hf, convert_from_hf
    from_llama.py             convert_from_llama
"""
from fabric_lin.convert.model_dir import check_state_dict, load_model_dir_weights

__all__ = ["check_state_dict", "load_model_dir_weights"]
