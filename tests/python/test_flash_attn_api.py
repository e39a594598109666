"""flare.flash_attn_interface: flash-attn 2.x's functions, layouts and return values, against the reference."""

import pytest
import torch

import flare
from flare.bert_padding import pad_input, unpad_input
from flare.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from conftest import assert_close_ref, reference_attention


def test_reexported_from_flare():
    assert flare.flash_attn_func is flash_attn_func
    assert flare.flash_attn_with_kvcache is flash_attn_with_kvcache


def test_dense_and_packed():
    q, k, v = torch.randn(2, 57, 4, 32), torch.randn(2, 57, 4, 32), torch.randn(2, 57, 4, 32)
    ref, ref_lse = reference_attention(q, k, v, causal=True, softcap=10.0, scale=0.3)
    out = flash_attn_func(q, k, v, causal=True, softcap=10.0, softmax_scale=0.3)
    assert_close_ref(out, ref, torch.float32)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, softcap=10.0, softmax_scale=0.3,
                                      return_attn_probs=True)
    assert probs.numel() == 0 and lse.shape == (2, 4, 57)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    qkv = torch.stack([q, k, v], dim=2)
    assert_close_ref(flash_attn_qkvpacked_func(qkv, softmax_scale=0.3, causal=True, softcap=10.0), ref,
                     torch.float32)
    q2, kv = torch.randn(2, 20, 4, 32), torch.randn(2, 57, 2, 2, 32)
    ref2, _ = reference_attention(q2, kv[:, :, 0], kv[:, :, 1], window=(7, 3))
    assert_close_ref(flash_attn_kvpacked_func(q2, kv, window_size=(7, 3)), ref2, torch.float32)


def test_alibi_per_batch():
    q, k, v = torch.randn(2, 30, 4, 16), torch.randn(2, 30, 4, 16), torch.randn(2, 30, 4, 16)
    slopes = torch.rand(2, 4)
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    for b in range(2):
        ref, _ = reference_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=True, alibi_slopes=slopes[b])
        assert_close_ref(out[b:b + 1], ref, torch.float32)


def test_unsupported_arguments_raise():
    # S_dmask comes from the dense functions only (tests/python/test_dropout.py covers dropout itself).
    q = torch.randn(1, 8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="S_dmask"):
        flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, 0.5, return_attn_probs=True)


def test_arch_path():
    # arch_path picks CUDA kernels: the CPU takes any of its names and ignores it, autograd runs through it, and
    # a name outside them is refused before anything runs.
    q, k, v = (torch.randn(1, 19, 2, 16, requires_grad=True) for _ in range(3))
    ref = flash_attn_func(q, k, v, causal=True)
    for path in ("auto", "sm80", "sm90"):
        out = flash_attn_func(q, k, v, causal=True, arch_path=path)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        out.sum().backward()
    cu = torch.tensor([0, 19], dtype=torch.int32)
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 19, 19, causal=True, arch_path="sm90")
    torch.testing.assert_close(out, ref[0], rtol=0, atol=0)
    qkv = torch.stack([q, k, v], dim=2).detach()
    flash_attn_qkvpacked_func(qkv, arch_path="sm80")
    with pytest.raises(ValueError, match="arch_path='hopper'"):
        flash_attn_func(q, k, v, arch_path="hopper")


def _varlen_case(seqlens_q, seqlens_k, h=4, hk=2, d=32):
    cu_q = torch.tensor([0] + seqlens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + seqlens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), hk, d, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), hk, d, requires_grad=True)
    return q, k, v, cu_q, cu_k


def test_varlen_matches_per_sequence_dense():
    seqlens_q, seqlens_k = [13, 1, 40], [29, 7, 40]
    q, k, v, cu_q, cu_k = _varlen_case(seqlens_q, seqlens_k)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True,
                                      return_softmax_lse=True)
    assert lse.shape == (4, q.shape[0])
    out.sum().backward()
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref, ref_lse = reference_attention(q[qs][None], k[ks][None], v[ks][None], causal=True)
        assert_close_ref(out[qs], ref[0], torch.float32)
        torch.testing.assert_close(lse[:, qs].double(), ref_lse[0], atol=1e-4, rtol=1e-4)
        qd, kd, vd = (t.detach()[s][None].requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
        flash_attn_func(qd, kd, vd, causal=True).sum().backward()
        torch.testing.assert_close(q.grad[qs], qd.grad[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(k.grad[ks], kd.grad[0], atol=1e-5, rtol=1e-4)


def test_varlen_packed_out_and_seqused_k():
    qkv = torch.randn(30, 3, 2, 16)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 20, causal=True)
    ref = flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 20, 20, causal=True)
    torch.testing.assert_close(out, ref)
    out2 = flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:].contiguous(), cu, cu, 20, 20, causal=True)
    torch.testing.assert_close(out2, ref)
    buf = torch.empty_like(ref)
    assert flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 20, 20, causal=True, out=buf) is buf
    torch.testing.assert_close(buf, ref)
    # seqused_k: sequence 1 uses only its first 6 keys
    used = torch.tensor([10, 6], dtype=torch.int32)
    q = torch.randn(30, 2, 16)
    out = flash_attn_varlen_func(q, qkv[:, 1], qkv[:, 2], cu, cu, 20, 20, seqused_k=used)
    ref, _ = reference_attention(q[10:][None], qkv[10:16, 1][None], qkv[10:16, 2][None])
    assert_close_ref(out[10:], ref[0], torch.float32)


def test_varlen_paged_block_table():
    block_size, hk, d = 16, 2, 32
    seqlens_k = [37, 5]
    k_cache, v_cache = torch.randn(8, block_size, hk, d), torch.randn(8, block_size, hk, d)
    block_table = torch.tensor([[6, 1, 3], [4, 0, 0]], dtype=torch.int32)
    cu_k = torch.tensor([0, 37, 42], dtype=torch.int32)
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    q = torch.randn(5, 4, d)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 3, 37, causal=True, block_table=block_table)
    for b, (qs, n) in enumerate(((slice(0, 3), 37), (slice(3, 5), 5))):
        keys = k_cache[block_table[b].long()].reshape(-1, hk, d)[:n]
        vals = v_cache[block_table[b].long()].reshape(-1, hk, d)[:n]
        ref, _ = reference_attention(q[qs][None], keys[None], vals[None], causal=True)
        assert_close_ref(out[qs], ref[0], torch.float32)


def _rotate(x, cos, sin, interleaved):
    """Rotary embedding of x (..., d) by rows cos/sin (..., rotary_dim / 2) over the first rotary_dim."""
    rd = cos.shape[-1] * 2
    xr, rest = x[..., :rd].double(), x[..., rd:].double()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        r = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        r = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([r, rest], dim=-1)


@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_append_rotary(interleaved):
    b, h, hk, d, cache_len, new = 2, 4, 2, 32, 40, 3
    k_cache, v_cache = torch.randn(b, cache_len, hk, d), torch.randn(b, cache_len, hk, d)
    k_orig = k_cache.clone()
    q, k_new, v_new = torch.randn(b, new, h, d), torch.randn(b, new, hk, d), torch.randn(b, new, hk, d)
    angles = torch.rand(cache_len, 8) * 3
    cos, sin = angles.cos(), angles.sin()
    seqlens = torch.tensor([10, 25], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, causal=True, rotary_interleaved=interleaved,
                                       return_softmax_lse=True)
    assert lse.shape == (b, h, new)
    for i in range(b):
        n = int(seqlens[i])
        pos = torch.arange(n, n + new)
        k_rot = _rotate(k_new[i], cos[pos][:, None].double(), sin[pos][:, None].double(), interleaved)
        q_rot = _rotate(q[i], cos[pos][:, None].double(), sin[pos][:, None].double(), interleaved)
        torch.testing.assert_close(k_cache[i, n:n + new].double(), k_rot, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_cache[i, n:n + new], v_new[i])
        torch.testing.assert_close(k_cache[i, :n], k_orig[i, :n])
        ref, _ = reference_attention(q_rot[None], k_cache[i, :n + new][None], v_cache[i, :n + new][None],
                                     causal=True)
        assert_close_ref(out[i:i + 1], ref, torch.float32)


def test_kvcache_int_seqlens_batch_idx_leftpad_paged():
    b, h, hk, d = 2, 4, 1, 16
    k_cache, v_cache = torch.randn(3, 50, hk, d), torch.randn(3, 50, hk, d)
    q = torch.randn(b, 1, h, d)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, cache_batch_idx=torch.tensor(
        [2, 0], dtype=torch.int32))
    for i, row in enumerate((2, 0)):
        ref, _ = reference_attention(q[i:i + 1], k_cache[row:row + 1, :20], v_cache[row:row + 1, :20])
        assert_close_ref(out[i:i + 1], ref, torch.float32)
    leftpad = torch.tensor([5, 0], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache[:2], v_cache[:2], cache_seqlens=torch.tensor([20, 30]),
                                  cache_leftpad=leftpad, causal=True)
    for i, (lo, hi) in enumerate(((5, 20), (0, 30))):
        ref, _ = reference_attention(q[i:i + 1], k_cache[i:i + 1, lo:hi], v_cache[i:i + 1, lo:hi], causal=True)
        assert_close_ref(out[i:i + 1], ref, torch.float32)
    # paged: blocks of 16 rows
    kp, vp = k_cache.reshape(-1, 10, hk, d)[:12].contiguous(), v_cache.reshape(-1, 10, hk, d)[:12].contiguous()
    table = torch.tensor([[3, 7, 1], [0, 11, 5]], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=torch.tensor([25, 11], dtype=torch.int32),
                                  block_table=table)
    for i, n in enumerate((25, 11)):
        keys, vals = kp[table[i].long()].reshape(-1, hk, d)[:n], vp[table[i].long()].reshape(-1, hk, d)[:n]
        ref, _ = reference_attention(q[i:i + 1], keys[None], vals[None])
        assert_close_ref(out[i:i + 1], ref, torch.float32)


def test_bert_padding_round_trip():
    x = torch.randn(3, 7, 4, 8)
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    unpadded, indices, cu, max_len, used = unpad_input(x, mask)
    assert unpadded.shape == (15, 4, 8) and cu.tolist() == [0, 7, 12, 15] and max_len == 7
    assert cu.dtype == torch.int32 and used.tolist() == [7, 5, 3]
    back = pad_input(unpadded, indices, 3, 7)
    torch.testing.assert_close(back, x * mask[:, :, None, None])


def test_compile_varlen_and_kvcache_fullgraph():
    q, k, v, cu_q, cu_k = _varlen_case([9, 4], [9, 4])
    f = torch.compile(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True),
                      fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(q, k, v), flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True))
    kc, vc = torch.zeros(2, 16, 2, 32), torch.zeros(2, 16, 2, 32)
    kn, vn, qn = torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32), torch.randn(2, 1, 4, 32)
    g = torch.compile(lambda q, kc, vc, kn, vn: flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3),
                      fullgraph=True, backend="aot_eager")
    out = g(qn, kc, vc, kn, vn)
    torch.testing.assert_close(kc[:, 3:4], kn)  # the in-place append survives compilation
    kc2, vc2 = torch.zeros(2, 16, 2, 32), torch.zeros(2, 16, 2, 32)
    torch.testing.assert_close(out, flash_attn_with_kvcache(qn, kc2, vc2, kn, vn, cache_seqlens=3))
