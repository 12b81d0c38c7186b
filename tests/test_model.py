"""The model against itself: decoding token by token and a prompt appended to a cache against the full forward,
packed documents against separate ones, meta init against eager init (and a forward on the meta device), the
inputs named where they are no batch of token ids, the chunked loss and activation
checkpointing against the plain computation. Against float64 references written independently (every head layout,
grouped key/value heads included): test_model_edge_cases.py."""
import re

import pytest
import torch
import torch.nn.functional as F

from fabric_lin.config import Config
from fabric_lin.model import GPT
from fabric_lin.ops.cross_entropy import linear_cross_entropy
from helpers import assert_decoding_equals_the_full_forward, eager_model_built_as_from_meta


def tiny(name: str, **overrides) -> Config:
    return Config.from_name(name, vocab_size=97, hidden_size=64, num_layers=2, **overrides)


@pytest.mark.parametrize(
    "config",
    [tiny("gla-debug"), tiny("gla-debug", num_heads=4, num_kv_heads=2), tiny("transformer-debug"),
     tiny("transformer-debug", num_kv_heads=2)],
    ids=["gla", "gla-gqa", "transformer", "transformer-gqa"],
)
def test_token_by_token_decoding_reproduces_full_forward(config):
    assert_decoding_equals_the_full_forward(config)


def test_transformer_prompt_appended_to_cache():
    torch.manual_seed(0)
    model = GPT(tiny("transformer-debug")).eval()
    ids = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        first = model(ids[:, :12], cache=cache)
        second = model(ids[:, 12:], cache=cache)
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["gla-debug", "gdn-debug", "deltanet-debug", "transformer-debug"])
def test_a_model_on_the_meta_device_runs_for_its_shapes(name):
    """Built on the meta device, the model's forward gives its outputs' shapes without allocating (a check of a large
    model's shapes, or of a batch's, before any weights are read); it stopped on asking autocast about 'meta'."""
    with torch.device("meta"):
        model = GPT(tiny(name))
    ids = torch.zeros(2, 70, dtype=torch.long, device="meta")
    logits, loss = model(ids), model(ids, targets=ids)
    assert logits.device.type == loss.device.type == "meta"
    assert logits.shape == (2, 70, 97) and loss.shape == ()


def test_input_ids_other_than_a_batch_of_token_ids_are_named():
    model = GPT(tiny("gla-debug"))
    with pytest.raises(ValueError, match=r"^input_ids must be \[B, T\] token ids of dtype int64 or int32, got torch.int64 "
                                         r"of shape \(70,\); one sequence is input_ids\[None\]$"):
        model(torch.zeros(70, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^input_ids must be \[B, T\] token ids of dtype int64 or int32, got "
                                         r"torch.float32 of shape \(2, 70\)$"):
        model(torch.zeros(2, 70))


@pytest.mark.parametrize("name", ["gla-debug", "transformer-debug"])
@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_reset_parameters_equals_eager_init(name, tie):
    eager = eager_model_built_as_from_meta(tiny(name, tie_embeddings=tie), seed=1234)
    # the init is the one specified: N(0, 0.02) weights, zero biases, unit norms
    w = eager.layers[0].mlp.up_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(eager.layers[0].attn_norm.weight, torch.ones(64))
    if name == "gla-debug":
        assert torch.equal(eager.layers[0].attn.gk_proj[1].bias, torch.zeros_like(eager.layers[0].attn.gk_proj[1].bias))


def test_different_seeds_give_different_weights():
    torch.manual_seed(1)
    a = GPT(tiny("gla-debug"))
    torch.manual_seed(2)
    b = GPT(tiny("gla-debug"))
    assert not torch.equal(a.embeddings.weight, b.embeddings.weight)


def test_loss_with_targets_equals_full_cross_entropy_and_its_gradient():
    torch.manual_seed(0)
    model = GPT(tiny("gla-debug"))
    ids = torch.randint(0, 97, (3, 50))
    targets = torch.randint(0, 97, (3, 50))
    targets[0, :5] = -100
    loss = model(ids, targets=targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    reference = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref_grads = torch.autograd.grad(reference, list(model.parameters()))
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_cross_entropy_reference_in_chunks_smaller_than_the_rows():
    # the CPU path's loss (chunked, each chunk's logits recomputed in the backward pass) against one
    # F.cross_entropy over all rows: the same loss and gradients
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(11, 16, requires_grad=True)
    t = torch.randint(0, 11, (37,))
    loss = linear_cross_entropy(h, w, t, chunk_size=8, backend="torch")
    dh, dw = torch.autograd.grad(loss, [h, w])
    ref = F.cross_entropy(h @ w.T, t)
    ref_dh, ref_dw = torch.autograd.grad(ref, [h, w])
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(dh, ref_dh)
    torch.testing.assert_close(dw, ref_dw)


@pytest.mark.parametrize("name", ["gla-debug", "transformer-debug"])
def test_packed_documents_equal_separate_documents(name):
    torch.manual_seed(0)
    model = GPT(tiny(name)).eval()
    docs = [torch.randint(0, 97, (1, n)) for n in (20, 1, 70)]
    cu_seqlens = torch.tensor([0, 20, 21, 91])
    with torch.no_grad():
        packed = model(torch.cat(docs, dim=1), cu_seqlens=cu_seqlens)
        separate = torch.cat([model(d) for d in docs], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-4)


def test_packed_attention_scores_each_document_near_itself_only(monkeypatch):
    """Packed documents (reset_state_at_doc_boundaries packs a micro batch's rows into one): softmax attention scores
    each query against at most twice the longest document's keys, not against the whole packed row (the work of one
    row times the number of rows, and a mask of the row's length squared); its output and gradients are those of each
    document run on its own (grouped key/value heads, a document of one token, a packed length that no block fills)."""
    torch.manual_seed(0)
    model = GPT(tiny("transformer-debug", num_kv_heads=2))
    lengths = [16, 3, 1, 16, 9, 12, 16, 5] * 3
    docs = [torch.randint(0, 97, (1, n)) for n in lengths]
    packed_length, longest = sum(lengths), max(lengths)
    weights = torch.randn(1, packed_length, 97)
    scored = []
    attention = F.scaled_dot_product_attention

    def counted_attention(q, k, v, **kwargs):
        scored.append(q.shape[0] * q.shape[-2] * k.shape[-2])  # query-key pairs per head
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted_attention)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    packed = model(torch.cat(docs, dim=1), cu_seqlens=offsets)
    packed_grads = torch.autograd.grad((packed * weights).sum(), list(model.parameters()))
    # blocks of the longest document's length, each against itself and the block before; the last block padded
    bound = 2 * longest * (packed_length + longest)
    assert len(scored) == 2 and all(n <= bound < packed_length ** 2 for n in scored), scored
    separate = torch.cat([model(d) for d in docs], dim=1)
    separate_grads = torch.autograd.grad((separate * weights).sum(), list(model.parameters()))
    torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-4)
    for got, expected in zip(packed_grads, separate_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_gla_attention_layout_matches_design():
    model = GPT(Config.from_name("gla-debug"))
    attn = model.layers[0].attn
    c = model.config
    assert attn.q_proj.weight.shape == (c.key_dim, c.hidden_size) and attn.q_proj.bias is None
    assert attn.gk_proj[0].weight.shape == (16, c.hidden_size) and attn.gk_proj[0].bias is None
    assert attn.gk_proj[1].weight.shape == (c.key_dim, 16) and attn.gk_proj[1].bias is not None
    assert attn.g_norm.weight.shape == (c.head_v_dim,) and attn.g_norm.eps == c.norm_eps == 1e-6  # fla: norm_eps
    assert model.norm.eps == 1e-6


@pytest.mark.parametrize("name", ["gla-debug", "transformer-debug"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(name):
    # pretrain's activation_checkpointing wraps every Block (it takes and returns the residual stream as the
    # pair (x, delta)); recomputing the Blocks in the backward pass must not change the result
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from fabric_lin.model import Block

    config = Config.from_name(name, num_layers=2)
    torch.manual_seed(0)
    model = GPT(config)
    ids = torch.randint(0, config.vocab_size, (2, 70))
    targets = torch.roll(ids, -1, dims=1)
    results = []
    for wrap in (False, True):
        if wrap:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
            assert sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()) == config.num_layers
        model.zero_grad(set_to_none=True)
        loss = model(ids, targets=targets)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_transformer_has_no_length_limit_from_its_config():
    """RoPE is computed on the fly: the baseline takes sequences beyond model_config.max_seq_length, so
    train.max_seq_length is checked against the data only."""
    torch.manual_seed(0)
    model = GPT(Config.from_name("transformer-debug", num_layers=1, max_seq_length=16))
    ids = torch.randint(0, 4096, (1, 40))
    with torch.no_grad():
        long, short = model(ids), model(ids[:, :16])
    assert torch.isfinite(long).all()
    torch.testing.assert_close(long[:, :16], short)  # causal: the first 16 positions do not see the rest


@pytest.mark.parametrize("shape,dtype", [((2, 70, 1), torch.int64), ((2, 70), torch.bool), ((2, 70), torch.uint8),
                                         ((2, 70), torch.int16), ((2, 70), torch.uint16)])
def test_input_ids_of_three_dimensions_or_of_a_dtype_the_embedding_refuses_are_named(shape, dtype):
    """nn.Embedding takes int64 and int32 indices only: ids of a smaller integer dtype (as a uint16 chunk holds them)
    were torch's traceback from inside the model."""
    model = GPT(tiny("gla-debug"))
    shown = re.escape(f"got {dtype} of shape {shape}")
    with pytest.raises(ValueError, match=rf"^input_ids must be \[B, T\] token ids of dtype int64 or int32, {shown}$"):
        model(torch.zeros(shape, dtype=dtype))
    model(torch.zeros(2, 70, dtype=torch.int32))  # the other dtype it takes
