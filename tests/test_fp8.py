"""FP8 training's setup on the CPU: the checks that refuse what cannot run (device, compute capability,
torchao, widths), which Linear layers are converted, and, with torchao's FP8 emulation on the CPU, that the
converted model trains close to the bf16/fp32 one, keeps its init and its checkpoints plain."""
import builtins
import importlib.util

import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.fp8 import FP8Args, check_fp8, check_fp8_shapes, convert_to_fp8, fp8_layers
from fabric_lin.model import GPT

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")


def small(name="gla-debug", **overrides) -> Config:
    return Config.from_name(name, num_layers=2, vocab_size=256, **overrides)


def test_recipe_and_device_checks_name_the_fix(monkeypatch):
    check_fp8(FP8Args("none"), torch.device("cpu"))  # nothing to check
    # an option that would do nothing is refused, not ignored
    with pytest.raises(ValueError, match="fp8.gate_projections .* with fp8.recipe 'fused' it would do nothing: leave it "
                                         "false \\(fused makes every product 16 or more wide in FP8, GLA's low-rank gate among "
                                         "them\\)"):
        check_fp8(FP8Args("fused", gate_projections=True), torch.device("cuda", 0))
    with pytest.raises(ValueError, match="with fp8.recipe 'none' it would do nothing"):
        check_fp8(FP8Args("none", gate_projections=True), torch.device("cpu"))
    with pytest.raises(ValueError, match="fp8.recipe must be one of \\('none', 'tensorwise', 'fused'\\), got 'e4m3'"):
        check_fp8(FP8Args("e4m3"), torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA GPU of compute capability 8.9 .* on the CPU: leave fp8.recipe at 'none'"):
        check_fp8(FP8Args("tensorwise"), torch.device("cpu"))
    # an A100 (8.0) has no FP8 tensor cores
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="NVIDIA A100-SXM4-80GB has 8.0"):
        check_fp8(FP8Args("tensorwise"), torch.device("cuda", 0))
    # an Ada GPU (8.9: L4, RTX 4090) has them
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_fp8(FP8Args("fused"), torch.device("cuda", 0))


def test_fp8_all_gather_is_refused_where_it_cannot_run(monkeypatch, tmp_path, capsys):
    """It gathers tensorwise FP8 weights: refused without a recipe, with fused, on the CPU, and where nothing is
    gathered (one GPU, DDP); the command line gives the reason in one line. (Its construction: test_parallelism.py.)"""
    with pytest.raises(ValueError, match="fp8.all_gather .* needs fp8.recipe 'tensorwise', got 'none'"):
        check_fp8(FP8Args("none", all_gather=True), torch.device("cuda", 0), sharded=True)
    with pytest.raises(ValueError, match="needs fp8.recipe 'tensorwise', got 'fused'"):
        check_fp8(FP8Args("fused", all_gather=True), torch.device("cuda", 0), sharded=True)
    with pytest.raises(ValueError, match="needs a CUDA GPU of compute capability 8.9"):
        check_fp8(FP8Args("tensorwise", all_gather=True), torch.device("cpu"), sharded=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="fp8.all_gather .* needs a sharded run .* this run is on one GPU or DDP"):
        check_fp8(FP8Args("tensorwise", all_gather=True), torch.device("cuda", 0), sharded=False)
    if importlib.util.find_spec("torchao") is not None:
        check_fp8(FP8Args("tensorwise", all_gather=True), torch.device("cuda", 0), sharded=True)
    from helpers import cli_error

    err = cli_error(["pretrain", "--model_name", "gla-debug", "--fp8.all_gather", "true", "--train.max_steps", "1",
                     "--out_dir", str(tmp_path / "out")], capsys)
    assert "fp8.all_gather gathers weights cast to FP8 with one scale per tensor" in err


def test_torchao_missing_or_too_old_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    real_import = builtins.__import__

    def without_torchao(name, *args, **kwargs):
        if name == "torchao" or name.startswith("torchao."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_torchao)
    with pytest.raises(ImportError, match="pip install 'fabric-lin\\[fp8\\]'"):
        check_fp8(FP8Args("tensorwise"), torch.device("cuda", 0))
    check_fp8(FP8Args("fused"), torch.device("cuda", 0))  # the fused ops' FP8 products need no torchao
    monkeypatch.setattr(builtins, "__import__", real_import)
    if importlib.util.find_spec("torchao") is not None:
        import torchao

        monkeypatch.setattr(torchao, "__version__", "0.7.0")
        with pytest.raises(ImportError, match="needs torchao 0.10 or newer, found 0.7.0"):
            check_fp8(FP8Args("tensorwise"), torch.device("cuda", 0))
        # the oldest taken, and a wheel of PyTorch's index, whose version carries the CUDA it was built for
        for version in ("0.10.0", "0.10.0+cu126"):
            monkeypatch.setattr(torchao, "__version__", version)
            check_fp8(FP8Args("tensorwise"), torch.device("cuda", 0))
        monkeypatch.setattr(torchao, "__version__", "0.9.1+cu126")
        with pytest.raises(ImportError, match=r"found 0.9.1\+cu126"):
            check_fp8(FP8Args("tensorwise"), torch.device("cuda", 0))


@pytest.mark.parametrize("name", ["gla-debug", "gdn-debug", "transformer-debug"])
def test_the_projections_are_converted_not_the_head_or_the_small_gates(name):
    overrides = {"attn_layers": [1], "attn_num_heads": 4} if name != "transformer-debug" else {}
    model = GPT(small(name, **overrides), float8=True)
    layers = fp8_layers(model, FP8Args("tensorwise"))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "lm_head" in linears and "lm_head" not in layers
    assert not any(part in n for n in layers for part in ("gk_proj", "a_proj", "b_proj"))
    expected = {n for n in linears if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj")}
    assert set(layers) == expected and len(expected) >= 2 * 7
    with_gates = set(fp8_layers(model, FP8Args("tensorwise", gate_projections=True)))
    # GLA's low-rank gate (128 -> 16 -> 64) has widths FP8 takes; GDN's a and b (one output per head) do not
    assert with_gates - expected == ({f"layers.0.attn.gk_proj.{i}" for i in (0, 1)} if name == "gla-debug" else set())


def test_widths_fp8_cannot_take_are_named():
    model = GPT(small(hidden_size=72, num_heads=2, expand_k=0.5, intermediate_size=200), float8=True)
    with pytest.raises(ValueError, match="multiples of 16; these are not: layers.0.attn.q_proj \\(36 x 72\\)"):
        check_fp8_shapes(model, FP8Args("tensorwise"))
    # multiples of 8 are not enough; each layer is named, and the conversion itself refuses them
    model = GPT(small(hidden_size=48, num_heads=2, expand_k=0.5, intermediate_size=128), float8=True)
    with pytest.raises(ValueError, match="these are not: layers.0.attn.q_proj \\(24 x 48\\), layers.0.attn.k_proj \\(24 x 48\\), "
                       "layers.1.attn.q_proj"):
        check_fp8_shapes(model, FP8Args("tensorwise"))
    if importlib.util.find_spec("torchao") is not None:
        with pytest.raises(ValueError, match="these are not: layers.0.attn.q_proj \\(24 x 48\\)"):
            convert_to_fp8(model, FP8Args("tensorwise"), emulate=True)


@needs_torchao
def test_a_fused_model_without_float8_is_refused():
    with pytest.raises(ValueError, match="float8=True"):
        convert_to_fp8(GPT(small(), fused=True), FP8Args("tensorwise"), emulate=True)


@needs_torchao
@pytest.mark.parametrize("name", ["gla-debug", "gdn-debug"])
def test_emulated_fp8_trains_close_to_full_precision_with_plain_checkpoints(name):
    from torchao.float8.float8_linear import Float8Linear

    config = small(name)
    torch.manual_seed(0)
    reference = GPT(config)
    model = GPT(config, float8=True)
    model.load_state_dict(reference.state_dict())
    converted = convert_to_fp8(model, FP8Args("tensorwise"), emulate=True)
    # emulated: FP8's rounding in higher precision, which runs on a GPU without FP8 products as on the CPU
    assert all(isinstance(model.get_submodule(n), Float8Linear) and model.get_submodule(n).config.emulate for n in converted)
    # plain checkpoints both ways: the same names and tensors
    assert model.state_dict().keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (reference, model):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        for _ in range(3):
            loss = m(ids, targets=torch.roll(ids, -1, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) / losses[0] < 0.02, losses  # FP8's rounding, not another model
    restored = GPT(config)
    restored.load_state_dict(model.state_dict())  # an FP8 run's weights resume in bf16


@needs_torchao
def test_conversion_keeps_the_models_init_on_the_meta_device():
    # under FSDP the model is built on the meta device and materialised module by module with reset_parameters
    # (the model's initializer_range, not torch's or the default's; the gate projections' biases zero)
    config = small(initializer_range=0.05)
    with torch.device("meta"):
        model = GPT(config, float8=True)
    convert_to_fp8(model, FP8Args("tensorwise", gate_projections=True), emulate=True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # what the materialised memory holds is anything's guess
    torch.manual_seed(0)
    model.reset_parameters()
    q, gate = model.layers[0].attn.q_proj, model.layers[0].attn.gk_proj[1]
    assert type(q).__name__ == type(gate).__name__ == "Float8Projection" and abs(q.weight.std().item() - 0.05) < 0.0075
    assert torch.equal(gate.bias, torch.zeros_like(gate.bias))


@needs_torchao
def test_conversion_keeps_the_parameters_and_their_order():
    # the optimizer's state follows model.parameters(): an FP8 run's optimizer state resumes in bf16 and the
    # reverse only if the conversion keeps the same tensors, in the same order
    model = GPT(small("gdn-debug"), float8=True)
    before = list(model.named_parameters())
    convert_to_fp8(model, FP8Args("tensorwise"), emulate=True)
    after = list(model.named_parameters())
    assert [n for n, _ in before] == [n for n, _ in after]
    assert all(a is b for (_, a), (_, b) in zip(before, after))


def test_the_recipes_option_parses_and_a_cpu_run_is_refused_in_one_line(capsys):
    from helpers import CONFIG_HUB, cli_error, parse_run_config

    for name in ("gla_340M", "gdn_340M"):  # the recipes document the option, off
        assert parse_run_config(CONFIG_HUB / f"{name}.yaml").fp8 == FP8Args("none", False)
    run = ["pretrain", "--config", str(CONFIG_HUB / "debug.yaml"), "--out_dir", "/nonexistent/never-created"]
    # torchao's per-row recipe is not one: it was slower than the per-tensor one at the same memory
    assert cli_error(run + ["--fp8.recipe", "rowwise"], capsys) == (
        "fabric-lin pretrain: error: fp8.recipe must be one of ('none', 'tensorwise', 'fused'), got 'rowwise'\n")
    if torch.cuda.is_available():
        return
    assert cli_error(run + ["--fp8.recipe", "tensorwise"], capsys) == (
        "fabric-lin pretrain: error: fp8.recipe 'tensorwise' needs a CUDA GPU of compute capability 8.9 or newer "
        "(Ada, Hopper); this run is on the CPU: leave fp8.recipe at 'none'\n")


def test_what_a_user_is_told_fp8_costs_is_the_measured_one(capsys):
    """Each recipe's figures, as its records hold them: the line an FP8 run prints, `pretrain --help`, the README, the
    performance tutorial and the recipes' comments quote them. gla-1.3B's real loop (bf16, tensorwise and fused in one
    run), gla-340M's step, the activation memory torchao's layers keep (the saved bytes per token of a Block against
    bf16's, at gla-340M and gla-1.3B) and fused's loss against bf16's over 300 steps on the long-document corpus."""
    import json
    import re

    from fabric_lin.cli import main as cli_main
    from fabric_lin.fp8 import FUSED_NOTE, TENSORWISE_NOTE
    from helpers import CONFIG_HUB, REPO

    results = REPO / "benchmarks" / "results"

    def record(name):
        return json.loads((results / name).read_text())

    activation = {record(name)["fp8"]["tensorwise"]["bytes_per_token_per_layer"]
                  / record(name)["fp8"]["none"]["bytes_per_token_per_layer"]
                  for name in ("2026-12-05-fp8-activation-memory.json", "2026-12-06-fp8-activation-memory-1.3B.json")}
    activation = {f"{ratio:.2f}x bf16's activation memory" for ratio in activation}
    assert len(activation) == 1, activation  # the notes quote one figure for both sizes
    same_run = record("2026-12-06-fp8-real-loop-1.3B-three-recipes-h100.json")["ratios"]
    speed = {recipe: same_run[f"gla-1.3B FP8 {recipe} vs bf16 (b), tokens/s"] for recipe in ("tensorwise", "fused")}
    memory = {recipe: same_run[f"gla-1.3B FP8 {recipe} vs bf16 (b), peak memory"] for recipe in ("tensorwise", "fused")}
    assert max(speed.values()) < 1.2 and memory["fused"] < 1 < memory["tensorwise"]  # what the texts conclude
    # gla-340M: tensorwise's real loop (a report whose JSON was not kept), fused's step in regime (a)
    tensorwise_340m = re.search(r"`--fp8.recipe tensorwise` \(b\) \| [\d.]+K \((\d\.\d\d)x bf16\)",
                                (results / "2026-12-06-fp8-training-step-h100.md").read_text()).group(1)
    fused_340m = record("2026-12-06-fp8-fused-regime-a-h100.json")["ratios"]["FP8 fused vs bf16 (a, compiled), tokens/s"]
    parity = record("2026-12-06-fp8-fused-parity-340M-long-documents-h100.json")
    assert parity["data"] == "long_documents"
    fused_loss = parity["ours_against"]["fp8-fused"]
    tensorwise = [f"{speed['tensorwise']:.2f}x bf16's tokens/s at {memory['tensorwise']:.2f}x its peak memory",
                  f"{tensorwise_340m}x at gla-340M", *activation]
    fused = [f"{speed['fused']:.2f}x bf16's tokens/s at {memory['fused']:.3f}x its peak memory",
             f"{fused_340m:.2f}x at gla-340M",
             f"within {100 * fused_loss['median_relative_difference']:.2f}% (median) of bf16's over {parity['steps']} steps",
             f"lower on {100 * (1 - fused_loss['share_of_steps_ours_lower']):.0f}% of the steps"]

    def flat(text):  # wrapped lines (and YAML comments) read as one
        return " ".join(" ".join(line.strip().lstrip("#") for line in text.split("\n")).split())

    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--help"])
    texts = {"TENSORWISE_NOTE": (TENSORWISE_NOTE, tensorwise), "FUSED_NOTE": (FUSED_NOTE, fused),
             "pretrain --help": (capsys.readouterr().out, tensorwise + fused[:3]),
             "README.md": ((REPO / "README.md").read_text(), tensorwise[:2] + fused[:3]),
             "tutorials/performance.md": ((REPO / "tutorials" / "performance.md").read_text(), tensorwise + fused)}
    for path in sorted(CONFIG_HUB.glob("*.yaml")):
        if "\nfp8:" in path.read_text():
            texts[path.name] = (path.read_text(), tensorwise[:2] + fused[:2])
    assert len(texts) > 5
    for name, (text, figures) in texts.items():
        for figure in figures:
            assert figure in flat(text), (name, figure)
    assert "\n" not in TENSORWISE_NOTE + FUSED_NOTE  # one line each in the run's log
