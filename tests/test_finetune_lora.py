"""LoRA through peft on fabric-lin's fla-format export, as tutorials/finetune_lora.md does it, for GLA, Gated DeltaNet
and DeltaNet: the adapted model trains (its loss falls, the exported weights stay as they are and every adapter
moves), merge_and_unload folds the adapters into exactly the targeted weights, and the merged model, saved and
brought back by convert_from_hf, gives fabric-lin's model the merged fla model's logits; the tutorial script's targets
name every family convert_to_hf exports. And the two places where the road is blocked, each as the tutorial describes
it: fla's fused SwiGLU (the export's default) reads mlp.down_proj's weight itself, so an adapter there gets no
gradient, and peft cannot wrap fla's short convolutions.

fla's layers are Triton kernels, run here in Triton's interpreter (conftest.fla_in_interpreter), in fp32, on the
families' debug models cut to one layer and a vocabulary of 512: the kernels' backward passes into every adapted
projection run as in a deeper model, at half the cost of two layers (the export's naming of every layer is
test_convert_fla_cpu's). fla's fused cross-entropy runs on GPUs only, so the loss is torch's
(fuse_cross_entropy=False). fla, transformers and peft are imported inside the tests: their imports take seconds,
which every pytest-xdist worker would pay while collecting.
"""
import pytest
import torch
from safetensors.torch import load_file

from conftest import export_model, fla_in_interpreter, perturb_vectors
from fabric_lin.config import Config
from fabric_lin.convert.hf import convert_from_hf
from fabric_lin.generate import load_model
from fabric_lin.model import GPT

# the tutorial's targets: the attention's projections and the MLP's, never the gates, convolutions or norms
MLP = ["gate_proj", "up_proj", "down_proj"]
TARGETS = {
    "gla": ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", *MLP],
    "gdn": ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", *MLP],
    "deltanet": ["q_proj", "k_proj", "v_proj", "o_proj", *MLP],
}
NUM_LAYERS, VOCAB, SEQ_LEN, STEPS = 1, 512, 16, 3
# fp32 throughout; fla's kernels (recurrent, or chunked for GDN) and fabric-lin's chunked PyTorch path add in other
# orders, as the adapted model and the merged one do, which leaves at most 1e-6 on these logits (std 0.24; the three
# steps moved them by about 1, the loss from 6.2 to 5.3): test_convert_fla_cpu's tolerance for the same comparison
TOL = 1e-4

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="fla's kernels run in Triton's interpreter here, on the CPU"),
    pytest.mark.usefixtures("one_thread"),  # the interpreter's programs are many tiny tensor ops
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """family -> the directory of its debug model exported as `fabric-lin convert_to_hf` writes it (norm weights
    and gate biases moved off their init, so that a misplaced one would show in the logits)."""
    root = tmp_path_factory.mktemp("exports")
    exported = {}
    for family in TARGETS:
        config = Config.from_name(f"{family}-debug", num_layers=NUM_LAYERS, vocab_size=VOCAB)
        torch.manual_seed(0)
        model = GPT(config)
        perturb_vectors(model)
        exported[family] = export_model(model, config, root / family)
    return exported


def load_fla(export_dir, **fla_config):
    """fla's model of an export in fp32, with torch's cross-entropy (fla's fused one needs a GPU)."""
    from transformers import AutoModelForCausalLM

    import fla  # noqa: F401  (registers fla's model types with transformers)

    return AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32, fuse_cross_entropy=False, **fla_config)


def adapted_module_names(family: str) -> set:
    return {f"model.layers.{i}.{'mlp' if name in MLP else 'attn'}.{name}"
            for i in range(NUM_LAYERS) for name in TARGETS[family]}


@pytest.mark.parametrize("family", TARGETS)
def test_lora_trains_merges_and_comes_back_to_fabric_lin(exports, family, tmp_path):
    from peft import LoraConfig, get_peft_model

    export_dir = exports[family]
    exported = load_file(export_dir / "model.safetensors")
    tokens = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with fla_in_interpreter():
        # the tutorial's settings: the unfused SwiGLU, so that down_proj's adapter is in the computation
        adapted = get_peft_model(load_fla(export_dir, fuse_swiglu=False),
                                 LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[family]))
        adapters = {name: p.detach().clone() for name, p in adapted.named_parameters() if p.requires_grad}
        expected = {f"base_model.model.{module}.lora_{ab}.default.weight"
                    for module in adapted_module_names(family) for ab in "AB"}
        assert set(adapters) == expected

        # no weight decay: an adapter moves by its gradients alone (lora_A's first one is zero, lora_B starting at 0)
        optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
        adapted.train()  # as a training loop does: fla's layers then keep no cache for decoding
        losses = []
        for _ in range(STEPS):
            loss = adapted(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses

        # the exported weights as they were, bit for bit; every adapter tensor moved (lora_B from its zeros)
        base = {name.removeprefix("base_model.model.").replace(".base_layer", ""): p
                for name, p in adapted.named_parameters() if not p.requires_grad}
        assert sorted(base) == sorted(exported)
        assert [name for name, p in base.items() if not torch.equal(p, exported[name])] == []
        trained = {name: p for name, p in adapted.named_parameters() if p.requires_grad}
        assert [name for name, p in trained.items() if torch.equal(p, adapters[name])] == []

        # still in training mode (no cache; nothing drops out) and with autograd recording: fla's GDN layer then
        # runs its chunked kernels, not its recurrent one, five times slower in the interpreter
        adapted_logits = adapted(input_ids=tokens).logits.detach()
        merged = adapted.merge_and_unload()
        merged_logits = merged(input_ids=tokens).logits.detach()
        merged.save_pretrained(tmp_path / "merged")

    # the merge changed exactly the targeted weights, and computes what the adapted model computed
    merged_state = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged_state) == sorted(exported)
    changed = {name for name in exported if not torch.equal(merged_state[name], exported[name])}
    assert changed == {f"{module}.weight" for module in adapted_module_names(family)}
    assert (merged_logits - adapted_logits).abs().max().item() < TOL

    # back into fabric-lin, read as `fabric-lin generate` reads a model directory
    convert_from_hf(tmp_path / "merged", tmp_path / "model_dir")
    ours = load_model(tmp_path / "model_dir", torch.device("cpu"), torch.float32)
    with torch.no_grad():
        ours_logits = ours(tokens)
    assert (ours_logits - merged_logits).abs().max().item() < TOL


def test_fused_swiglu_leaves_down_proj_adapter_without_gradient(exports):
    # as exported (fuse_swiglu: true), fla's MLP hands mlp.down_proj.weight to its fused SwiGLU kernel and never
    # calls the Linear, so the adapter peft put there is outside the computation: it would silently not train
    from peft import LoraConfig, get_peft_model

    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with fla_in_interpreter():
        # up_proj's adapter, beside it, is in the computation: the control
        adapted = get_peft_model(load_fla(exports["gla"]), LoraConfig(r=4, target_modules=["up_proj", "down_proj"]))
        with torch.no_grad():  # lora_B moved off its zeros, so that every adapter in the computation gets a gradient
            for name, p in adapted.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        adapted(input_ids=tokens, labels=tokens).loss.backward()
    grads = {name: p.grad for name, p in adapted.named_parameters() if p.requires_grad}
    without = sorted(name for name, grad in grads.items() if grad is None or not grad.any())
    assert without == sorted(name for name in grads if ".down_proj." in name) and len(without) == 2 * NUM_LAYERS


@pytest.mark.parametrize("rank, error", [
    (8, "Targeting a ShortConvolution with groups=96 and rank 8"),  # not a multiple of the channels: refused
    (96, "got multiple values for argument 'bias'"),  # a multiple: peft builds its adapter as fla's class, which fails
])
def test_peft_cannot_wrap_the_short_convolutions(exports, rank, error):
    # GDN's q_conv1d is fla's ShortConvolution, a depthwise nn.Conv1d (groups = channels = 2 heads x 48)
    from peft import LoraConfig, get_peft_model

    with pytest.raises((ValueError, TypeError), match=error):
        get_peft_model(load_fla(exports["gdn"]), LoraConfig(r=rank, target_modules=["q_conv1d"]))


def tutorial_script() -> str:
    """The fine-tuning script of tutorials/finetune_lora.md, as a user saves it."""
    import re
    from pathlib import Path

    tutorial = (Path(__file__).parents[1] / "tutorials" / "finetune_lora.md").read_text()
    return re.search(r"```python\n(.*?)```", tutorial, re.S).group(1)


def tutorial_targets() -> dict:
    """The TARGETS of tutorials/finetune_lora.md's script, as the script reads them: model_type -> module names."""
    import ast

    script = tutorial_script()
    assignment = next(node for node in ast.parse(script).body
                      if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TARGETS")
    return ast.literal_eval(assignment.value)


def test_the_tutorial_script_adapts_every_family_that_convert_to_hf_exports(monkeypatch, tmp_path):
    """The tutorial's script picks its targets by the export's model_type: it holds every model_type convert_to_hf
    writes (the Transformer baseline's was missing, a KeyError 'transformer'), the three tested above with the targets
    they are tested with, and the Transformer's each a Linear of fla's model that peft wraps. (fla's attention layer
    needs flash-attn, which has no CPU build, to be built at all: a stand-in for it here, never called.)"""
    import fla.layers.attn
    from peft import LoraConfig, get_peft_model

    from fabric_lin.convert.hf import MODEL_TYPES

    targets = tutorial_targets()
    assert sorted(targets) == sorted(MODEL_TYPES.values())
    assert {family: targets[MODEL_TYPES[family]] for family in TARGETS} == TARGETS
    monkeypatch.setattr(fla.layers.attn, "flash_attn_func", lambda *args, **kwargs: None)
    config = Config.from_name("transformer-debug", num_layers=NUM_LAYERS, vocab_size=VOCAB)
    adapted = get_peft_model(load_fla(export_model(GPT(config), config, tmp_path)),
                             LoraConfig(r=4, target_modules=targets["transformer"]))
    wrapped = {name.removeprefix("base_model.model.") for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == {f"model.layers.{i}.{'mlp' if name in MLP else 'attn'}.{name}"
                       for i in range(NUM_LAYERS) for name in targets["transformer"]}


def test_the_tutorial_script_stops_at_a_target_that_names_no_module(exports, tmp_path, monkeypatch):
    """peft passes over a target that names no module of the model where another one does: the tutorial's script with
    a misspelt target stops before training, naming it, where it trained the other adapters without a word. (The
    script as a user saves it, on the CPU: its .cuda() leaves the model where it is.)"""
    import runpy
    import sys

    script = tmp_path / "finetune_lora.py"
    script.write_text(tutorial_script().replace('"o_proj"', '"o_prj"'))
    (tmp_path / "train.jsonl").write_text('{"text": "A document of ones own."}\n')
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *args, **kwargs: self)
    monkeypatch.setattr(sys, "argv", [str(script), str(exports["gla"]), str(tmp_path / "train.jsonl"), str(tmp_path / "out")])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(script), run_name="__main__")
    assert info.value.code == ("targets that name no module of the model: ['o_prj'] (its Linear layers: down_proj, "
                               "g_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj)")
    assert not (tmp_path / "out").exists()


def test_the_tutorial_quotes_what_stops_its_script_on_a_cpu(exports, tmp_path, monkeypatch):
    """On a machine without a GPU, the script as a user saves it stops at its first `.cuda()`, before fla's kernels
    run: section 7 quotes that error, not only the one fla's kernels give."""
    import runpy
    import sys
    from pathlib import Path

    script = tmp_path / "finetune_lora.py"
    script.write_text(tutorial_script())
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "A document of ones own."}\n')
    monkeypatch.setattr(sys, "argv", [str(script), str(exports["gla"]), str(data), str(tmp_path / "out")])
    with pytest.raises((RuntimeError, AssertionError)) as info:  # torch built with CUDA, or without
        runpy.run_path(str(script), run_name="__main__")
    said = str(info.value).split(".")[0]
    tutorial = " ".join((Path(__file__).parents[1] / "tutorials" / "finetune_lora.md").read_text().split())
    assert said in tutorial, said


def test_the_tutorial_script_copies_every_file_of_the_export_s_tokenizer():
    """The merged directory gets what convert_to_hf writes beside the weights for the tokenizer: its files and
    trained_with.json, the record convert_from_hf carries on to the model directory (without it, the model directory
    named the merged directory as its tokenizer's source and the pretraining data's record was gone)."""
    import ast
    import re

    from fabric_lin.data.tokenizer import TOKENIZER_FILES, TRAINED_WITH_FILE

    copied = re.search(r"for name in (\(.*?\)):\n\s+shutil\.copy\(export_dir / name", tutorial_script())
    assert copied, "the script's copy of the tokenizer files"
    assert sorted(ast.literal_eval(copied.group(1))) == sorted((*TOKENIZER_FILES, TRAINED_WITH_FILE))
