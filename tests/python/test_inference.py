"""The inference path on the CPU: vLLM's paged varlen call reaching the library without a Python gather,
flash_attn_with_kvcache on paged and dense caches (page sizes 1, 3, 16, 256) and at every split count, and
flare.merge_attention_states against the fp64 reference over the union of two key sets."""

import pytest
import torch

import flare
from flare import ops
from flare.flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache
from conftest import assert_close_ref, reference_attention

PAGE_SIZES = (1, 3, 16, 256)


def _page(k, v, lens, page):
    """Dense varlen keys k/v (total, hk, d) cut into a shuffled paged cache: (k_cache, v_cache, block_table)."""
    columns = max(-(-n // page) for n in lens) + 1
    num_blocks = len(lens) * columns + 2
    ids = torch.randperm(num_blocks)
    table = ids[:len(lens) * columns].reshape(len(lens), columns).to(torch.int32)
    kc = torch.randn(num_blocks, page, *k.shape[1:], dtype=k.dtype)
    vc = torch.randn(num_blocks, page, *v.shape[1:], dtype=v.dtype)
    start = 0
    for b, n in enumerate(lens):
        for j in range(n):
            blk, row = int(table[b, j // page]), j % page
            kc[blk, row], vc[blk, row] = k[start + j], v[start + j]
        start += n
    return kc, vc, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", PAGE_SIZES)
def test_vllm_paged_varlen_call_matches_dense(dtype, page, monkeypatch):
    lens_q, lens_k = [1, 3, 1, 2], [300, 0, 17, 257]
    h, hk, d = 8, 2, 64
    cu_q = torch.tensor([0, 1, 4, 5, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 300, 317, 574], dtype=torch.int32)
    q = torch.randn(7, h, d, dtype=dtype)
    k, v = torch.randn(574, hk, d, dtype=dtype), torch.randn(574, hk, d, dtype=dtype)
    dense = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 300, causal=True)
    kc, vc, table = _page(k, v, lens_k, page)
    seen = []
    real_fwd = ops.fwd_call
    monkeypatch.setattr(ops, "fwd_call", lambda q, k, *a: seen.append(k.shape) or real_fwd(q, k, *a))
    out = torch.full_like(q, float("nan"))
    # vLLM's call (keywords, no cu_seqlens_k): the cache goes to the op as it is, rank 4.
    got = flash_attn_varlen_func(q=q, k=kc, v=vc, cu_seqlens_q=cu_q, max_seqlen_q=3,
                                 seqused_k=torch.tensor(lens_k, dtype=torch.int32), max_seqlen_k=300,
                                 causal=True, block_table=table, out=out)
    assert got is out and seen == [kc.shape]
    assert torch.equal(out, dense)
    for b in range(4):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_k[b]:
            ref, _ = reference_attention(q[qs][None], k[ks][None], v[ks][None], causal=True)
            assert_close_ref(out[qs], ref[0], dtype)


def _kvcache_inputs(dtype, lens, capacity, new, seqlen_q=1, h=8, hk=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    q = torch.randn(batch, seqlen_q, h, d, generator=g).to(dtype)
    kc = torch.randn(batch, capacity, hk, d, generator=g).to(dtype)
    vc = torch.randn(batch, capacity, hk, d, generator=g).to(dtype)
    kn = torch.randn(batch, new, hk, d, generator=g).to(dtype)
    vn = torch.randn(batch, new, hk, d, generator=g).to(dtype)
    return q, kc, vc, kn, vn, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_kvcache_paged_matches_dense_with_append(page):
    # Ragged: an empty cache, one filled to the brim by the append, appends that cross pages.
    lens, capacity, new = [0, 509, 254, 130], 512, 3
    q, kc, vc, kn, vn, seqlens = _kvcache_inputs(torch.bfloat16, lens, capacity, new, seqlen_q=3)
    kc_p, vc_p, table = _page(kc.reshape(-1, *kc.shape[2:]), vc.reshape(-1, *vc.shape[2:]), [capacity] * 4, page)
    dense_out, dense_lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True,
                                                   return_softmax_lse=True)
    out, lse = flash_attn_with_kvcache(q, kc_p, vc_p, kn, vn, cache_seqlens=seqlens, block_table=table,
                                       causal=True, return_softmax_lse=True)
    assert torch.equal(out, dense_out) and torch.equal(lse, dense_lse)
    for b, n in enumerate(lens):
        for j in range(n + new):
            blk, row = int(table[b, j // page]), j % page
            assert torch.equal(kc_p[blk, row], kc[b, j]) and torch.equal(vc_p[blk, row], vc[b, j])


def test_kvcache_repeated_block_while_appending_writes_nothing():
    q, kc, vc, kn, vn, seqlens = _kvcache_inputs(torch.float32, [4, 4], 8, 2)
    kc_p, vc_p = kc.reshape(4, 4, *kc.shape[2:]).clone(), vc.reshape(4, 4, *vc.shape[2:]).clone()
    before = kc_p.clone()
    table = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)  # both sequences append into block 1
    with pytest.raises(flare.FlareArgumentError, match="both name block 1"):
        flash_attn_with_kvcache(q, kc_p, vc_p, kn, vn, cache_seqlens=seqlens, block_table=table)
    assert torch.equal(kc_p, before)
    for bad, words in (([[0, 9], [2, 3]], r"block_table\[0\]\[1\] is 9"), ([[0, 1], [-2, 3]], r"is -2")):
        with pytest.raises(flare.FlareArgumentError, match=words):
            flash_attn_with_kvcache(q, kc_p, vc_p, kn, vn, cache_seqlens=seqlens,
                                    block_table=torch.tensor(bad, dtype=torch.int32))
        assert torch.equal(kc_p, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_split_count_matches_unsplit(dtype):
    lens = [1500, 7]
    q, kc, vc, _, _, seqlens = _kvcache_inputs(dtype, lens, 1501, 0, h=32, hk=8, d=128)
    unsplit, unsplit_lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=1,
                                                   return_softmax_lse=True)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    for splits in (2, 3, 8, 13, 64, 0):
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=splits,
                                           return_softmax_lse=True)
        torch.testing.assert_close(out.float(), unsplit.float(), atol=atol, rtol=atol)
        torch.testing.assert_close(lse, unsplit_lse, atol=1e-5, rtol=1e-5)
    for b, n in enumerate(lens):
        ref, _ = reference_attention(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n])
        assert_close_ref(unsplit[b:b + 1], ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("varlen", [False, True])
def test_merge_attention_states_matches_union(dtype, varlen):
    q = torch.randn(2, 5, 4, 32, dtype=torch.float64)
    ka, va = torch.randn(2, 37, 2, 32, dtype=torch.float64), torch.randn(2, 37, 2, 32, dtype=torch.float64)
    kb, vb = torch.randn(2, 11, 2, 32, dtype=torch.float64), torch.randn(2, 11, 2, 32, dtype=torch.float64)
    out_a, lse_a = reference_attention(q, ka, va)
    out_b, lse_b = reference_attention(q, kb, vb)
    ref, ref_lse = reference_attention(q, torch.cat([ka, kb], 1), torch.cat([va, vb], 1))
    parts = [out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float()]
    if varlen:  # (total, nheads, d) with (nheads, total)
        parts = [parts[0].flatten(0, 1), parts[1].permute(1, 0, 2).flatten(1), parts[2].flatten(0, 1),
                 parts[3].permute(1, 0, 2).flatten(1)]
        ref, ref_lse = ref.flatten(0, 1), ref_lse.permute(1, 0, 2).flatten(1)
    out, lse = flare.merge_attention_states(*parts)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_ref(out, ref, dtype)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # The torch formula (what CUDA tensors run) agrees with the library's.
    t_out, t_lse = ops._merge_torch(*parts)
    torch.testing.assert_close(t_out.float(), out.float(), atol=1e-2 if dtype != torch.float32 else 1e-6, rtol=0)
    torch.testing.assert_close(t_lse, lse)


def test_merge_attention_states_empty_parts_and_errors():
    out_a, out_b = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    lse_a = torch.tensor([[[float("-inf"), 0.5], [float("-inf"), float("-inf")], [1.0, 2.0]]])
    lse_b = torch.tensor([[[0.3, float("-inf")], [float("-inf"), float("-inf")], [1.0, 2.0]]])
    out, lse = flare.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0, 0, 0], out_b[0, 0, 0]) and torch.equal(out[0, 1, 0], out_a[0, 1, 0])
    assert (out[0, :, 1] == 0).all() and lse[0, 1].isinf().all()
    assert not out.isnan().any()
    torch.testing.assert_close(out[0, :, 2], (out_a[0, :, 2] + out_b[0, :, 2]) / 2)
    t_out, t_lse = ops._merge_torch(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(t_out, out)
    torch.testing.assert_close(t_lse, lse)
    with pytest.raises(flare.FlareArgumentError, match="lse_b has shape"):
        flare.merge_attention_states(out_a, lse_a, out_b, lse_b[:, :, :1])
    with pytest.raises(flare.FlareArgumentError, match="must have rank 4"):
        flare.merge_attention_states(out_a[0, 0], lse_a, out_b, lse_b)


def test_first_inference_call_skips_the_custom_op():
    # A process's first call through a torch.library custom op imports torch._dynamo (its kernels are wrapped to
    # disable dynamo): 1-4 s. Calls that record no gradient run flare's computation directly (ops.fwd_call), so
    # a fresh process's first forward imports nothing of the sort; one that records a gradient takes the op.
    import subprocess
    import sys
    from pathlib import Path
    script = (
        "import sys, torch, flare\n"
        "q = torch.randn(1, 33, 2, 16)\n"
        "out = flare.flash_attn_func(q, q, q, causal=True)\n"
        "print(int('torch._dynamo' in sys.modules))\n"
        "g = torch.randn(1, 33, 2, 16, requires_grad=True)\n"
        "flare.flash_attn_func(g, g, g).sum().backward()\n"
        "print(int('torch._dynamo' in sys.modules), int(g.grad is not None))\n")
    env = dict(__import__("os").environ, PYTHONPATH=str(Path(flare.__file__).resolve().parents[1]))
    lines = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           check=True).stdout.split("\n")
    assert lines[0] == "0", "the first no-grad forward went through the custom op (it imported torch._dynamo)"
    assert lines[1] == "1 1", f"the forward that records a gradient should take the op, with autograd: {lines[1]}"
