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


class _CountingKernel:
    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def call_boxed(self, *args, **kwargs):
        self.calls += 1
        return self.kernel.call_boxed(*args, **kwargs)


def test_masked_calls_go_to_torch_kernels(active, monkeypatch):
    torch.manual_seed(3)
    q = torch.randn(1, 2, 9, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 12, 16, requires_grad=True), torch.randn(1, 2, 12, 16, requires_grad=True)
    mask = torch.rand(9, 12) > 0.3
    mask[:, 0] = True
    flare_calls = _counting(monkeypatch)
    torch_kernels = {p: _CountingKernel(k_) for p, k_ in flare.sdpa._torch_kernels.items()}
    monkeypatch.setattr(flare.sdpa, "_torch_kernels", torch_kernels)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert not flare_calls and torch_kernels["fwd"].calls == 1 and torch_kernels["bwd"].calls == 1
    flare.sdpa.deactivate()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    flare.sdpa.activate()
    assert torch.equal(out, ref)  # the same kernel: the same bits
    for mine, theirs in zip(grads, ref_grads):
        assert torch.equal(mine, theirs)


def _meta_strides(op, *args, **kwargs):
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    return [t.stride() for t in op(*meta, **kwargs)]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_outputs_have_the_meta_strides(active, layout):
    b, h, s, d = 2, 3, 17, 16
    make = (lambda: torch.randn(b, h, s, d)) if layout == "bhsd" else (lambda: torch.randn(b, s, h, d).transpose(1, 2))
    q, k, v, dout = make(), make(), make(), make()
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    out, lse = fwd(q, k, v, is_causal=True)
    assert [out.stride(), lse.stride()] == _meta_strides(fwd, q, k, v, is_causal=True)
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    grads = bwd(dout, q, k, v, out, lse, 0.0, True)
    assert [g.stride() for g in grads] == _meta_strides(bwd, dout, q, k, v, out, lse, 0.0, True)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_under_torch_compile(active, monkeypatch, layout):
    torch.manual_seed(4)
    b, h, s, d = 2, 4, 33, 16

    def make():
        t = torch.randn(b, h, s, d) if layout == "bhsd" else torch.randn(b, s, h, d).transpose(1, 2)
        return t.requires_grad_()

    q, k, v = make(), make(), make()
    calls = _counting(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2,
                             fullgraph=True)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = compiled(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert calls, "the compiled graph did not reach flare"
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=2e-4)
