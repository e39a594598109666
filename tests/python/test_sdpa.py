"""flare as torch's SDPA flash provider (torch >= 2.11): same results as torch's own SDPA, through flare."""

import pytest
import torch
import torch.nn.functional as F

import flare.sdpa
from flare import ops

pytestmark = pytest.mark.skipif(not flare.sdpa.available(),
                                reason=f"torch {torch.__version__} has no register_flash_attention_impl")


@pytest.fixture
def active():
    flare.sdpa.activate()
    yield
    flare.sdpa.deactivate()


def _counting(monkeypatch):
    calls = []
    real = ops.fwd

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(ops, "fwd", counting)
    return calls


@pytest.mark.parametrize("sq,sk,causal,gqa", [(37, 37, True, False), (40, 24, True, False), (20, 33, False, True)])
def test_sdpa_matches_torch(active, monkeypatch, sq, sk, causal, gqa):
    hk = 2 if gqa else 4
    q = torch.randn(2, 4, sq, 32, requires_grad=True)
    k, v = torch.randn(2, hk, sk, 32, requires_grad=True), torch.randn(2, hk, sk, 32, requires_grad=True)
    calls = _counting(monkeypatch)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    assert calls, "SDPA did not reach flare"
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    flare.sdpa.deactivate()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    flare.sdpa.activate()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_sdpa_with_mask_uses_math_path(active):
    q, k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    mask = torch.rand(9, 12) > 0.3
    mask[:, 0] = True
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=2e-5, rtol=2e-5)
