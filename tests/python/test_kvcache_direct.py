"""flash_attn_with_kvcache's eager route around torch's op dispatch (ops.fwd_kvcache_eager(direct=True)): the
same results, cache writes and errors as the flare::fwd_kvcache op; the op itself wherever something must see
it (a dispatch mode, fake tensors); and the transformers integration's decode step, which takes that route when
no gradient is needed."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flare import ops
from flare._capi import FlareArgumentError
from flare.flash_attn_interface import flash_attn_func, flash_attn_with_kvcache
from flare.integrations.transformers import flare_attention_forward


def _case(dtype, paged=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, h, hk, d, cap = 3, 8, 2, 64, 75
    q = torch.randn(b, 2, h, d, generator=gen).to(dtype)
    if paged:
        page = 16
        blocks = b * (-(-cap // page)) + 1
        kc = torch.randn(blocks, page, hk, d, generator=gen).to(dtype)
        vc = torch.randn(blocks, page, hk, d, generator=gen).to(dtype)
        table = torch.randperm(blocks, generator=gen)[:b * (-(-cap // page))].reshape(b, -1).to(torch.int32)
    else:
        kc = torch.randn(b, cap, hk, d, generator=gen).to(dtype)
        vc = torch.randn(b, cap, hk, d, generator=gen).to(dtype)
        table = None
    k = torch.randn(b, 2, hk, d, generator=gen).to(dtype)
    v = torch.randn(b, 2, hk, d, generator=gen).to(dtype)
    seqlens = torch.tensor([0, 41, 70], dtype=torch.int32)
    return q, kc, vc, k, v, seqlens, table


OPTIONS = [
    dict(causal=True),
    dict(causal=True, append=True),
    dict(window_size=(20, 0), softcap=5.0, append=True),
    dict(causal=True, rotary=True, append=True, num_splits=3),
    dict(alibi=True, s_aux=True, return_softmax_lse=True),
    dict(causal=True, leftpad=True, softmax_scale=0.3, return_softmax_lse=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
def test_direct_route_matches_the_op(dtype, paged, options, monkeypatch):
    q, kc, vc, k, v, seqlens, table = _case(dtype, paged)
    kwargs = {name: value for name, value in options.items()
              if name not in ("append", "rotary", "alibi", "s_aux", "leftpad")}
    if table is not None:
        kwargs["block_table"] = table
    if options.get("rotary"):
        angles = torch.rand(80, 16)
        kwargs["rotary_cos"], kwargs["rotary_sin"] = angles.cos().to(dtype), angles.sin().to(dtype)
    if options.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(8)
    if options.get("s_aux"):
        kwargs["s_aux"] = torch.randn(8)
    if options.get("leftpad"):
        kwargs["cache_leftpad"] = torch.tensor([0, 5, 30], dtype=torch.int32)
    new = dict(k=k, v=v) if options.get("append") else {}

    through_op = []
    real_op = ops.fwd_kvcache
    monkeypatch.setattr(ops, "fwd_kvcache", lambda *a: through_op.append(1) or real_op(*a))
    kc_direct, vc_direct = kc.clone(), vc.clone()
    version = kc_direct._version
    direct = flash_attn_with_kvcache(q, kc_direct, vc_direct, cache_seqlens=seqlens, **new, **kwargs)
    assert not through_op, "a plain eager call should not go through torch's op dispatch"
    assert (kc_direct._version > version) == bool(new), "appending bumps the cache's version, as the op does"

    kc_op, vc_op = kc.clone(), vc.clone()
    expected = real_op(q, kc_op, vc_op, new.get("k"), new.get("v"), seqlens, None, kwargs.get("cache_leftpad"),
                       table, kwargs.get("rotary_cos"), kwargs.get("rotary_sin"), True,
                       kwargs.get("num_splits", 0), kwargs.get("alibi_slopes"), kwargs.get("softmax_scale", 0.0),
                       kwargs.get("causal", False), *kwargs.get("window_size", (-1, -1)), kwargs.get("softcap", 0.0),
                       kwargs.get("s_aux"))
    if options.get("return_softmax_lse"):
        assert torch.equal(direct[0], expected[0]) and torch.equal(direct[1], expected[1])
    else:
        assert torch.equal(direct, expected[0])
    assert torch.equal(kc_direct, kc_op) and torch.equal(vc_direct, vc_op)
    if new:
        assert not torch.equal(kc_direct, kc), "the new keys were appended"


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_and_fake_tensors_see_the_op():
    q, kc, vc, k, v, seqlens, _ = _case(torch.float32)
    plain = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=seqlens, causal=True)
    with _OpLog() as log:
        seen = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=seqlens, causal=True)
    assert any("flare.fwd_kvcache" in name for name in log.ops), log.ops
    assert torch.equal(seen, plain)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fkc, fvc = (mode.from_tensor(t) for t in (q, kc, vc))
        out = flash_attn_with_kvcache(fq, fkc, fvc, cache_seqlens=mode.from_tensor(seqlens), causal=True)
    assert out.shape == q.shape and type(out) is not torch.Tensor


def test_functorch_transforms_see_the_op():
    # Inside a functorch transform (vmap, grad) tensors are wrapped in a way type() does not show: the direct
    # routes of flash_attn_with_kvcache and of no-grad forwards (ops.fwd_call) both step aside for it.
    assert not ops._intercepted()
    seen = []

    def body(x):
        seen.append(ops._intercepted())
        return x * 2

    torch.func.vmap(body)(torch.ones(3, 2))
    assert seen == [True]


def test_direct_route_errors_as_the_op_and_writes_nothing():
    q, kc, vc, k, v, seqlens, table = _case(torch.float32, paged=True)
    bad = table.clone()
    bad[1, 0] = bad.numel() + 50  # a block past the cache
    kc0, vc0 = kc.clone(), vc.clone()
    with pytest.raises(FlareArgumentError) as direct:
        flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens, block_table=bad)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    with pytest.raises(FlareArgumentError) as through_op:
        ops.fwd_kvcache(q, kc, vc, k, v, seqlens, None, None, bad, None, None, True, 0, None, 0.0, False, -1, -1,
                        0.0)
    assert str(direct.value) == str(through_op.value) and "block_table" in str(direct.value)
    # What the Python layer checks (here an index tensor of floats) is refused by the op's own checks.
    with pytest.raises(FlareArgumentError, match="cache_seqlens has dtype torch.float32"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens.float(), block_table=table)


class _Attention:
    is_causal = True
    training = False
    layer_idx = 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_decode_step_matches_flash_attn_func(dtype):
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 8, 1, 64, generator=gen).to(dtype)      # (batch, heads, seqlen, dim) as a model holds them
    key = torch.randn(2, 2, 37, 64, generator=gen).to(dtype)
    value = torch.randn(2, 2, 37, 64, generator=gen).to(dtype)
    position_ids = torch.tensor([[36], [36]])
    out, _ = flare_attention_forward(_Attention, query, key, value, None, scaling=0.125, position_ids=position_ids)
    expected = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                               softmax_scale=0.125, causal=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    # With autograd on and an input that requires grad, the step keeps flash_attn_func's graph.
    query.requires_grad_(True)
    out, _ = flare_attention_forward(_Attention, query, key, value, None, scaling=0.125, position_ids=position_ids)
    out.float().sum().backward()
    assert query.grad is not None and torch.isfinite(query.grad).all()
