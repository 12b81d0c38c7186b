"""fabric-lin's gradients against flash-linear-attention's (fla), for GLA, Gated DeltaNet and DeltaNet: from the
same weights (ours exported as `fabric-lin convert_to_hf` writes them, loaded by fla's `from_pretrained`) and the
same batch, the two models give the same mean next-token cross-entropy and the same gradient of it for every
parameter, in fp32. test_convert_fla_cpu.py compares the forward only; a missing or extra term in a backward pass,
a branch that passes no gradient or a parameter that gets none leaves the forward as it is and shows only here.
benchmarks/learning_parity.py trains the two side by side in bf16 on a GPU; with the fp32 gradients equal here, a
gap between their losses there is one of precision (bf16, the kernels' sums), not of what they compute.

The batch is fed as learning_parity.py feeds it: fla gets the T + 1 tokens with labels = the tokens (it predicts
labels[t + 1] at t and ignores the last position), fabric-lin the first T tokens with the next ones as targets;
fla's model is in training mode, as there. Each parameter's gradient is compared by max |ours - fla| / max |fla|,
under fla's name for it (convert.hf.to_hf_name); the two models must have the same parameters, of the same shapes,
each with a gradient (non-zero in fla's: every parameter takes part in the loss).

fla's layers are Triton kernels, run here in Triton's interpreter (conftest.fla_in_interpreter), in fp32, on the
families' debug models cut to one layer and a vocabulary of 512 (every kind of parameter and every backward path
of a block is there; test_finetune_lora.py makes the same cut), norm weights and gate biases moved off their init.
fla takes its chunked kernels (chunks of 64) for GLA and Gated DeltaNet, its recurrent one for DeltaNet (its
chunked DeltaNet kernel refuses fp32); fabric-lin's chunked form runs over two chunks, on its PyTorch path, and for
GLA on its Triton kernels too (the path that trains on a GPU). fla's fused cross-entropy runs on GPUs only, so its
loss is torch's (fuse_cross_entropy=False); fla's fused norms and SwiGLU run as exported.
"""
import pytest
import torch

from conftest import export_to_fla, fla_in_interpreter, perturb_vectors
from fabric_lin.config import Config
from fabric_lin.convert.hf import to_hf_name
from fabric_lin.model import GPT
from helpers import rel_err

FAMILIES = ("gla", "gdn", "deltanet")
NUM_LAYERS, VOCAB, BATCH = 1, 512, 2
SEQ_LEN = 70  # fabric-lin's targets: two chunks of its chunked form; fla sees 71 tokens, past its recurrent mode's 64
# Both models add in fp32 in other orders (fla's kernels by blocks of other sizes, its DeltaNet token by token):
# the gradients differ by at most about 1e-6 of their largest element (A_log's the most), the losses by 1e-6. A
# gradient scaled by 1.0002 fails; a missing or extra term, or a wrong factor, moves one by far more.
TOL = 1e-4
LOSS_TOL = 1e-5

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="fla's kernels run in Triton's interpreter here, on the CPU"),
    pytest.mark.usefixtures("one_thread"),  # the interpreter's programs are many tiny tensor ops
    pytest.mark.slow,
]


@pytest.fixture(scope="module", params=FAMILIES)
def fla_run(request) -> dict:
    """One family's debug model (config and weights), a batch of SEQ_LEN + 1 tokens, and fla's loss and gradients
    (by fla's parameter names; None where a parameter got none) from the same weights: computed once for both of
    fabric-lin's paths."""
    family = request.param
    config = Config.from_name(f"{family}-debug", num_layers=NUM_LAYERS, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = GPT(config)
    perturb_vectors(model)
    recurrent = {"attn_mode": "fused_recurrent"} if family == "deltanet" else {}
    with fla_in_interpreter():
        fla_model = export_to_fla(model, config, fuse_cross_entropy=False, **recurrent)[0].train()
        batch = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
        loss = fla_model(input_ids=batch, labels=batch).loss
        loss.backward()
    return {"family": family, "config": config, "weights": model.state_dict(), "batch": batch, "loss": loss.item(),
            "gradients": {name: p.grad for name, p in fla_model.named_parameters()}}


def assert_gradients_equal_flas(run: dict, fused: bool) -> None:
    model = GPT(run["config"], fused=fused)
    model.load_state_dict(run["weights"])
    batch = run["batch"]
    loss = model(batch[:, :-1], targets=batch[:, 1:])
    loss.backward()
    ours = {to_hf_name(name): p.grad for name, p in model.named_parameters()}
    theirs = run["gradients"]

    only_ours, only_fla = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    assert (only_ours, only_fla) == ([], []), f"in one model only: fabric-lin's {only_ours}, fla's {only_fla}"
    without = [name for name, grad in ours.items() if grad is None]
    assert without == [], f"no gradient in fabric-lin's model: {without}"
    without = [name for name, grad in theirs.items() if grad is None or not grad.any()]
    assert without == [], f"no gradient in fla's model: {without}"
    other_shapes = [name for name in ours if ours[name].shape != theirs[name].shape]
    assert other_shapes == [], f"other shapes than fla's: {other_shapes}"
    differences = {name: rel_err(ours[name], theirs[name]) for name in ours}
    worst = max(differences, key=differences.get)
    print(f"{run['family']} ({'fused' if fused else 'torch'}): loss {loss.item():.7f}, fla's {run['loss']:.7f}; "
          f"largest gradient difference {differences[worst]:.2e} ({worst})")
    assert abs(loss.item() - run["loss"]) <= LOSS_TOL, f"loss {loss.item()}, fla's {run['loss']}"
    off = {name: f"{d:.2e}" for name, d in differences.items() if not d <= TOL}
    assert off == {}, f"gradients off fla's by more than {TOL} of their largest element: {off}"


def test_torch_path_gradients_equal_flas(fla_run):
    assert_gradients_equal_flas(fla_run, fused=False)


# GLA's (the family of the gla-340M runs that train beside fla): fabric-lin's Triton path costs 2-4 s a family in
# the interpreter; test_gdn_model.py and test_deltanet.py compare the other two families' with their PyTorch paths
@pytest.mark.parametrize("fla_run", ["gla"], indirect=True)
def test_fused_path_gradients_equal_flas(fla_run):
    assert_gradients_equal_flas(fla_run, fused=True)
