"""qerl.attention_masks: the explicit masks of left-padded batches (no query row sees nothing)."""

import pytest
import torch

from qerl.attention_masks import left_padding_mask, model_mask, padded_causal_mask
from qerl.tiny import build_tiny_model


def test_padded_causal_mask_is_causal_padding_mask_plus_each_padding_query_itself():
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    allowed = padded_causal_mask(valid)[:, 0]  # (B, L, L)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    stock = causal[None] & valid[:, None, :]  # transformers' mask: pad keys hidden, causal
    assert allowed.any(-1).all()  # every query sees something
    assert torch.equal(allowed[valid], stock[valid])  # real queries: unchanged
    pad_rows = allowed[~valid]  # padding queries: exactly the real keys before them, and themselves
    assert torch.equal(pad_rows, stock[~valid] | torch.eye(5, dtype=torch.bool)[torch.nonzero(~valid)[:, 1]])
    # the engine's prefill: queries are the prompt's slots, keys include slots still to generate
    prefill = padded_causal_mask(torch.cat([valid, torch.zeros(2, 3, dtype=torch.bool)], 1), queries=5)
    assert prefill.shape == (2, 1, 5, 8) and torch.equal(prefill[:, 0, :, :5], allowed)
    assert not prefill[..., 5:].any()


def test_model_mask_formats():
    allowed = padded_causal_mask(torch.tensor([[0, 1, 1]], dtype=torch.bool))
    assert model_mask(allowed, eager=False, dtype=torch.bfloat16) is allowed
    additive = model_mask(allowed, eager=True, dtype=torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert (additive[allowed] == 0).all() and (additive[~allowed] == torch.finfo(torch.bfloat16).min).all()


def test_left_padding_mask_only_where_a_row_starts_with_padding():
    model = build_tiny_model("qwen2")
    unpadded = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # right padding only: no blind query
    assert left_padding_mask(model, unpadded) is unpadded
    padded = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    mask = left_padding_mask(model, padded)
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bool and mask.any(-1).all()
    ids = torch.randint(5, 100, (2, 4))
    position_ids = (padded.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        stock = model(input_ids=ids, attention_mask=padded, position_ids=position_ids).logits
    real = padded.bool()
    assert torch.equal(ours[real], stock[real])  # the real tokens' logits are the 2-D mask's, bit for bit
    model.config._attn_implementation = "flash_attention_2"  # (attribute only: takes no explicit mask)
    assert left_padding_mask(model, padded) is padded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_left_padded_backward_is_finite_on_cuda_gpu():
    """The shape at which the H200's cuDNN attention gave NaN dq for queries that see nothing
    (B = 32, L = 704, 14 heads of 64): through the explicit mask every gradient is finite. The 2-D
    mask's result is printed, not asserted (it depends on the SDPA backend and the shape)."""
    model = build_tiny_model("qwen2", dtype=torch.bfloat16, hidden_size=896, intermediate_size=256, num_layers=1,
                             num_heads=14, num_kv_heads=2).cuda()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (32, 704), generator=gen).cuda()
    pads = torch.randint(0, 120, (32,), generator=gen)
    attention_mask = (torch.arange(704)[None] >= pads[:, None]).long().cuda()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    finite = {}
    for name, mask in (("explicit", left_padding_mask(model, attention_mask)), ("2-D", attention_mask)):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        logits.float()[attention_mask.bool()].logsumexp(-1).sum().backward()
        finite[name] = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    print(f"gradients finite: {finite}")
    assert finite["explicit"]
