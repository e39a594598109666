"""Head dims past 256 on the CPU (headdim up to 576, headdim_v up to 512): flare.ops and the flash_attn API
against torch's own SDPA (math backend) in fp32 and fp64, gradients included, an fp64 gradcheck, the KV-cache
pass at 512, the SDPA provider, and the errors past the range."""

import pytest
import torch
import torch.nn.functional as F

import flare.sdpa
from flare import ops
from flare._capi import FlareArgumentError
from flare.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

# (headdim, headdim_v): square 512, DeepSeek MLA's 576 / 512, and a narrow side each way.
DIMS = [(512, 512), (576, 512), (320, 512), (512, 64)]
TOL = {torch.float32: 2e-5, torch.float64: 1e-6}  # fp64: lse and the scale cross the ABI in fp32


def sdpa_reference(q, k, v, causal=False, scale=None):
    """torch's math SDPA over flare's (batch, seqlen, nheads, headdim) layout; causal with seqlen_q == seqlen_k
    (where SDPA's top-left alignment is flare's bottom-right one)."""
    hq, hk = q.shape[2], k.shape[2]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, scale=scale, enable_gqa=hq != hk)
    return out.transpose(1, 2)


def rand(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_ops_forward_backward_match_sdpa(dims, dtype, causal):
    d, dv = dims
    sq, sk = (41, 41) if causal else (23, 67)
    q, k, v = rand(2, sq, 4, d, dtype=dtype), rand(2, sk, 2, d, dtype=dtype), rand(2, sk, 2, dv, dtype=dtype)
    out, lse = ops.fwd(q, k, v, None, None, None, 0, 0, None, 0.0, causal, -1, -1, 0.0, False)
    ref = sdpa_reference(q, k, v, causal)
    assert out.shape == (2, sq, 4, dv) and lse.shape == (2, 4, sq)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, atol=5 * TOL[dtype], rtol=5 * TOL[dtype])


def test_gradcheck_fp64_wide():
    # As test_ops.test_gradcheck_fp64: lse crosses the ABI in fp32, hence atol 1e-5, rtol 1e-3. fast_mode
    # compares v^T J u for random u, v instead of every column of J: the full Jacobian of ~5000 inputs would
    # take 10 s of the CI budget, and a wrong scale, mask or head-dim offset still moves the projection by O(1).
    q, k, v = rand(1, 3, 2, 320, dtype=torch.float64), rand(1, 5, 1, 320, dtype=torch.float64), \
        rand(1, 5, 1, 288, dtype=torch.float64)
    f = lambda q, k, v: ops.fwd(q, k, v, None, None, None, 0, 0, None, 0.0, True, -1, -1, 0.0, False)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v), atol=1e-5, rtol=1e-3, fast_mode=True)
    # and every column of J for a tiny q against fixed k and v
    q = rand(1, 1, 1, 264, dtype=torch.float64)
    k, v = torch.randn(1, 3, 1, 264, dtype=torch.float64), torch.randn(1, 3, 1, 264, dtype=torch.float64)
    g = lambda q: ops.fwd(q, k, v, None, None, None, 0, 0, None, 0.0, False, -1, -1, 0.0, False)[0]  # noqa: E731
    assert torch.autograd.gradcheck(g, (q,), atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flash_attn_api_matches_sdpa(dtype):
    q, k, v = rand(2, 37, 8, 576, dtype=dtype), rand(2, 37, 1, 576, dtype=dtype), rand(2, 37, 1, 512, dtype=dtype)
    out = flash_attn_func(q, k, v, causal=True)
    ref = sdpa_reference(q, k, v, causal=True)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, atol=5 * TOL[dtype], rtol=5 * TOL[dtype])

    # varlen: each sequence as its own dense call
    lens_q, lens_k = [5, 0, 19], [30, 4, 19]
    cu_q = torch.tensor([0, 5, 5, 24], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 34, 53], dtype=torch.int32)
    qv = torch.randn(24, 4, 512, dtype=dtype)
    kv, vv = torch.randn(53, 2, 512, dtype=dtype), torch.randn(53, 2, 512, dtype=dtype)
    out = flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, max(lens_q), max(lens_k))
    for b in range(3):
        if lens_q[b] == 0:
            continue
        s = slice(cu_q[b], cu_q[b + 1])
        t = slice(cu_k[b], cu_k[b + 1])
        ref = sdpa_reference(qv[s][None], kv[t][None], vv[t][None])[0]
        torch.testing.assert_close(out[s], ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kvcache_decode_at_512(dtype):
    # One new token per sequence appended to a cache and attended with the cache's keys (the decode path for
    # fp32; fp64 takes the forward's tiles).
    batch, cap, hk, h, d = 3, 80, 1, 8, 512
    k_cache, v_cache = torch.randn(batch, cap, hk, d, dtype=dtype), torch.randn(batch, cap, hk, d, dtype=dtype)
    lens = torch.tensor([0, 41, 79], dtype=torch.int32)
    q = torch.randn(batch, 1, h, d, dtype=dtype)
    k_new, v_new = torch.randn(batch, 1, hk, d, dtype=dtype), torch.randn(batch, 1, hk, d, dtype=dtype)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens)
    for b in range(batch):
        n = int(lens[b]) + 1
        torch.testing.assert_close(k_cache[b, n - 1], k_new[b, 0])
        ref = sdpa_reference(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n])
        torch.testing.assert_close(out[b:b + 1], ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.skipif(not flare.sdpa.available(), reason=f"torch {torch.__version__} has no SDPA provider hook")
def test_sdpa_provider_at_512():
    q = torch.randn(1, 4, 29, 512, requires_grad=True)
    k, v = torch.randn(1, 4, 29, 512, requires_grad=True), torch.randn(1, 4, 29, 512, requires_grad=True)
    flare.sdpa.activate()
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    finally:
        flare.sdpa.deactivate()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_head_dims_past_the_range_are_rejected():
    q, k = torch.randn(1, 4, 2, 577), torch.randn(1, 4, 2, 577)
    with pytest.raises(FlareArgumentError, match=r"q\.shape\[3\] \(headdim\) is 577: headdim \(q, k\) must be in "
                                                 r"1\.\.576 and headdim_v \(v, out\) in 1\.\.512"):
        flash_attn_func(q, k, k)
    q, v = torch.randn(1, 4, 2, 576), torch.randn(1, 4, 2, 576)
    with pytest.raises(FlareArgumentError, match=r"v\.shape\[3\] \(headdim_v\) is 576"):
        flash_attn_func(q, q, v)
    with pytest.raises(FlareArgumentError, match=r"v_cache\.shape\[3\] \(headdim_v\) is 513"):
        flash_attn_with_kvcache(torch.randn(1, 1, 2, 64), torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 513))
