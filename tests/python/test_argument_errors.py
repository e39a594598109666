"""Bad arguments through the Python layer: each gets a FlareArgumentError that names it, before any work or
allocation, instead of a wrapped value, a misread default, uninitialised memory or a stray Python error."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flare
from flare import FlareArgumentError, ops
from flare.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from conftest import assert_close_ref, reference_attention


def qkv(b=1, s=8, h=2, hk=2, d=16):
    return torch.randn(b, s, h, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)


def varlen(seqlens=(5, 3), h=2, d=16):
    total = sum(seqlens)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(total, h, d), torch.randn(total, h, d), torch.randn(total, h, d), cu


def fwd(q, k, v, window=(-1, -1), scale=0.0, softcap=0.0, max_seqlen=(0, 0), cu=(None, None)):
    return ops.fwd(q, k, v, cu[0], cu[1], None, max_seqlen[0], max_seqlen[1], None, scale, False, window[0],
                   window[1], softcap, False)


# ---- one exception class for argument errors, both a ValueError and a RuntimeError -----------------------


def test_argument_error_is_a_value_error_and_a_runtime_error():
    assert issubclass(FlareArgumentError, ValueError) and issubclass(FlareArgumentError, RuntimeError)
    assert flare.FlareArgumentError is FlareArgumentError and "FlareArgumentError" in flare.__all__
    q, k, _ = qkv(h=6, hk=4)
    with pytest.raises(FlareArgumentError, match="FLARE_INVALID_ARGUMENT.*heads"):  # the library's own check
        flash_attn_func(q, k, k)
    with pytest.raises(FlareArgumentError, match="arch_path"):
        flash_attn_func(*qkv(), arch_path="hopper")
    with pytest.raises(RuntimeError):  # what code written for flash_attn catches
        flash_attn_func(q, k, k)


# ---- meta tensors and devices ----------------------------------------------------------------------------


def test_meta_tensor_among_real_ones_raises():
    q, k, v = qkv()
    with pytest.raises(FlareArgumentError, match="k is on meta but q on cpu"):
        flash_attn_func(q, k.to("meta"), v)
    with pytest.raises(FlareArgumentError, match="alibi_slopes is on meta"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, device="meta"))
    qv, kv, vv, cu = varlen()
    with pytest.raises(FlareArgumentError, match="cu_seqlens_k is on meta"):
        flash_attn_varlen_func(qv, kv, vv, cu, cu.to("meta"), 5, 5)
    with pytest.raises(FlareArgumentError, match="cache_seqlens is on meta"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.tensor([3], device="meta"))
    # all on meta: shapes only, as torch's meta tensors are meant for
    out = flash_attn_func(q.to("meta"), k.to("meta"), v.to("meta"))
    assert out.device.type == "meta" and out.shape == q.shape


# ---- nothing narrows silently ----------------------------------------------------------------------------


def test_int32_fields_refuse_what_they_cannot_hold():
    q, k, v = qkv()
    with pytest.raises(FlareArgumentError, match=r"window_left=4294967296 does not fit"):
        flash_attn_func(q, k, v, window_size=(2**32, -1))
    with pytest.raises(FlareArgumentError, match=r"window_right=-4294967297 does not fit"):
        fwd(q, k, v, window=(-1, -2**32 - 1))
    with pytest.raises(FlareArgumentError, match=r"window_size\[0\]=2.5: must be an integer"):
        flash_attn_func(q, k, v, window_size=(2.5, -1))
    qv, kv, vv, cu = varlen()
    with pytest.raises(FlareArgumentError, match="max_seqlen_q=1099511627776 does not fit"):
        flash_attn_varlen_func(qv, kv, vv, cu, cu, 2**40, 5)
    with pytest.raises(FlareArgumentError, match="max_seqlen_k=5.0: must be an integer"):
        flash_attn_varlen_func(qv, kv, vv, cu, cu, 5, 5.0)
    kc, vc = torch.randn(1, 16, 2, 16), torch.randn(1, 16, 2, 16)
    with pytest.raises(FlareArgumentError, match="num_splits=4294967296 does not fit"):
        flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=3, num_splits=2**32)
    with pytest.raises(FlareArgumentError, match="cache_seqlens=4294967299 does not fit"):
        flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=2**32 + 3)


def test_index_tensors_are_checked_before_the_int32_cast():
    qv, kv, vv, _ = varlen((3, 4))
    wrapping = torch.tensor([0, 2**32 + 3, 7])  # int64: .to(int32) would read [0, 3, 7]
    with pytest.raises(FlareArgumentError, match="cu_seqlens_k holds 4294967299, past int32"):
        flash_attn_varlen_func(qv, kv, vv, torch.tensor([0, 3, 7]), wrapping, 4, 4)
    with pytest.raises(FlareArgumentError, match="cu_seqlens_q has dtype torch.float32"):
        flash_attn_varlen_func(qv, kv, vv, torch.tensor([0.0, 3.0, 7.0]), torch.tensor([0, 3, 7]), 4, 4)
    q = torch.randn(1, 1, 2, 16)
    kc, vc = torch.zeros(1, 16, 2, 16), torch.zeros(1, 16, 2, 16)
    kn, vn = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    with pytest.raises(FlareArgumentError, match="cache_seqlens holds 4294967299"):  # would append at slot 3
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([2**32 + 3]))
    with pytest.raises(FlareArgumentError, match="cache_seqlens has dtype torch.float32"):  # would truncate 3.7
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([3.7]))
    with pytest.raises(FlareArgumentError, match="block_table has dtype torch.bool"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, block_table=torch.ones(1, 1, dtype=torch.bool))
    assert not kc.any()  # nothing was appended
    # int64 within int32's range is taken
    out = flash_attn_varlen_func(qv, kv, vv, torch.tensor([0, 3, 7]), torch.tensor([0, 3, 7]), 4, 4)
    ref, _ = reference_attention(qv[:3][None], kv[:3][None], vv[:3][None])
    assert_close_ref(out[:3], ref[0], torch.float32)


def test_fp32_fields_refuse_values_that_round_to_0_or_infinity():
    q, k, v = qkv()
    with pytest.raises(FlareArgumentError, match="softmax_scale=1e-50 rounds to 0.*default scale"):
        flash_attn_func(q, k, v, softmax_scale=1e-50)
    with pytest.raises(FlareArgumentError, match="softcap=1e-50 rounds to 0.*no softcap"):
        flash_attn_func(q, k, v, softcap=1e-50)
    with pytest.raises(FlareArgumentError, match=r"softmax_scale=1e\+39 is past fp32's range"):
        fwd(q, k, v, scale=1e39)
    with pytest.raises(FlareArgumentError, match="softmax_scale=0: .*pass None for the default"):
        flash_attn_func(q, k, v, softmax_scale=0.0)
    # a small scale that fp32 holds is used as given, not replaced by the default
    out, lse = flash_attn_func(q, k, v, softmax_scale=1e-30, return_attn_probs=True)[:2]
    ref, ref_lse = reference_attention(q, k, v, scale=1e-30)
    assert_close_ref(out, ref, torch.float32)
    assert_close_ref(lse, ref_lse, torch.float32)


def test_sdpa_scale_zero_is_not_read_as_the_default():
    from flare import sdpa
    q, k, v = (torch.randn(1, 2, 7, 16) for _ in range(3))
    out, _ = sdpa._sdpa_forward(q, k, v, scale=0.0)  # uniform weights over the keys: the mean of v
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand_as(out))


def test_the_fake_kernels_raise_what_the_eager_calls_raise():
    q, k, v = qkv()
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        with pytest.raises(FlareArgumentError, match="window_left=4294967296 does not fit"):
            fwd(fq, fk, fv, window=(2**32, -1))
        with pytest.raises(FlareArgumentError, match="q has shape \\(16,\\) \\(rank 1\\)"):
            fwd(fq.flatten()[:16], fk, fv)
        with pytest.raises(FlareArgumentError, match="rotary_cos and rotary_sin must be given together"):
            cos = mode.from_tensor(torch.ones(8, 4))
            ops.fwd_kvcache(fq, fk, fv, None, None, None, None, None, None, cos, None, True, 0, None, 0.0, False,
                            -1, -1, 0.0)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, window_size=(2**32, -1)),
                             backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="window_left=4294967296 does not fit"):
        compiled(q, k, v)


# ---- a clear error before any work or allocation ---------------------------------------------------------


def _paged_case():
    k_cache, v_cache = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    q, cu_q = torch.randn(3, 2, 16), torch.tensor([0, 2, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 15], dtype=torch.int32)  # sequence 0: 2 blocks, sequence 1: 1 block
    return q, k_cache, v_cache, cu_q, cu_k


def test_paged_varlen_block_table_is_checked():
    q, kc, vc, cu_q, cu_k = _paged_case()
    good = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    out = flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 2, 12, block_table=good)
    keys, vals = kc[[2, 0]].reshape(-1, 2, 16)[:12], vc[[2, 0]].reshape(-1, 2, 16)[:12]
    ref, _ = reference_attention(q[:2][None], keys[None], vals[None])
    assert_close_ref(out[:2], ref[0], torch.float32)
    # The library reads and checks the table (no Python gather): bad entries among the blocks in use, a
    # sequence past its row of the table, a decreasing cu_seqlens_k; out= is left as it was.
    out = torch.full_like(q, float("nan"))
    with pytest.raises(FlareArgumentError, match=r"block_table\[0\]\[1\] is -1 but k has 4 blocks"):
        flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 2, 12, block_table=torch.tensor([[2, -1], [3, 0]]), out=out)
    assert out.isnan().all()
    with pytest.raises(FlareArgumentError, match=r"block_table\[1\]\[0\] is 4 "):
        flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 2, 12, block_table=torch.tensor([[2, 0], [4, 0]]), out=out)
    with pytest.raises(FlareArgumentError, match=r"sequence 0 has 12 keys but block_table has 1 columns of 8"):
        flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 2, 12, block_table=good[:, :1], out=out)
    with pytest.raises(FlareArgumentError, match=r"cu_seqlens_k\[2\] is 9 .* must be nondecreasing"):
        flash_attn_varlen_func(q, kc, vc, cu_q, torch.tensor([0, 12, 9]), 2, 12, block_table=good, out=out)
    with pytest.raises(FlareArgumentError, match=r"cu_seqlens_k and seqused_k are both absent"):
        flash_attn_varlen_func(q, kc, vc, cu_q, None, 2, 12, block_table=good, out=out)
    assert out.isnan().all()
    with pytest.raises(FlareArgumentError, match="block_table has dtype torch.float32"):
        flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 2, 12, block_table=good.float())


def test_out_is_checked_before_the_work(monkeypatch):
    qv, kv, vv, cu = varlen()
    calls = []
    real_fwd = ops.fwd_call
    monkeypatch.setattr(ops, "fwd_call", lambda *args: calls.append(1) or real_fwd(*args))
    bad = {
        "shape": (torch.empty(2, 8, 2, 16), r"out has shape \(2, 8, 2, 16\) but the result has shape \(8, 2,"),
        "last dim": (torch.empty(8, 2, 15), "out has shape \\(8, 2, 15\\)"),
        "dtype": (torch.empty(8, 2, 16, dtype=torch.float64), "out has dtype torch.float64 but the result"),
        "device": (torch.empty(8, 2, 16, device="meta"), "out is on meta but q on cpu"),
        "overlap": (torch.empty(8, 2, 1).expand(8, 2, 16), "stride-0"),
        "leaf": (torch.empty(8, 2, 16, requires_grad=True), "leaf that requires grad"),
    }
    for what, (out, message) in bad.items():
        with pytest.raises(FlareArgumentError, match=message):
            flash_attn_varlen_func(qv, kv, vv, cu, cu, 5, 5, out=out)
    assert calls == []
    out = torch.full((8, 2, 16), float("nan"))
    assert flash_attn_varlen_func(qv, kv, vv, cu, cu, 5, 5, out=out) is out and calls == [1]
    ref, _ = reference_attention(qv[:5][None], kv[:5][None], vv[:5][None])
    assert_close_ref(out[:5], ref[0], torch.float32)


def test_kvcache_that_requires_grad_is_not_written():
    q, kn, vn = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    kc, vc = torch.zeros(1, 16, 2, 16, requires_grad=True), torch.zeros(1, 16, 2, 16)
    with pytest.raises(FlareArgumentError, match="k_cache requires grad"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3)
    with torch.no_grad():  # the op has no autograd at all, so grad mode does not change the rule
        with pytest.raises(FlareArgumentError, match="k_cache requires grad"):
            flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3)
    assert not kc.detach().any() and not vc.any()
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3)  # reading it is fine


def test_kvcache_pairs_and_ranks():
    q, kc, vc = torch.randn(1, 1, 2, 16), torch.zeros(1, 16, 2, 16), torch.zeros(1, 16, 2, 16)
    cos = torch.ones(16, 4)
    with pytest.raises(FlareArgumentError, match="rotary_cos and rotary_sin must be given together"):
        flash_attn_with_kvcache(q, kc, vc, torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16), rotary_cos=cos,
                                cache_seqlens=3)
    with pytest.raises(FlareArgumentError, match="k_new and v_new .* must be given together"):
        flash_attn_with_kvcache(q, kc, vc, torch.randn(1, 1, 2, 16), None, cache_seqlens=3)
    with pytest.raises(FlareArgumentError, match=r"q has shape \(\) \(rank 0\) but must have rank 4"):
        flash_attn_with_kvcache(torch.tensor(1.0), kc, vc, cache_seqlens=3)
    assert not kc.any()


def test_zero_dim_and_wrong_rank_inputs():
    q, k, v = qkv()
    with pytest.raises(FlareArgumentError, match=r"q has shape \(\) \(rank 0\) but must have rank 4"):
        flash_attn_func(torch.tensor(1.0), k, v)
    with pytest.raises(FlareArgumentError, match=r"v has shape \(8, 2, 16\) \(rank 3\) but must have rank 4"):
        flash_attn_func(q, k, v[0])
    with pytest.raises(FlareArgumentError, match="k must be a torch.Tensor, got list"):
        ops.fwd_eager(q, [1.0], v, None, None, None, 0, 0, None, 0.0, False, -1, -1, 0.0, False)


def test_flare_checks_run_before_the_outputs_are_allocated(monkeypatch):
    """An expanded q of 2**31 heads is 16 bytes of memory; its output would be 128 GiB. flare refuses the head
    count, and that must come before anything is allocated."""
    q = torch.randn(1, 1, 1, 16).expand(1, 1, 2**31, 16)
    k = v = torch.randn(1, 1, 1, 16)
    real_empty = torch.empty

    def small_empty(*shape, **kwargs):
        size = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        assert math.prod(size) < 2**30, f"torch.empty{tuple(size)} before flare's checks"
        return real_empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", small_empty)
    with pytest.raises(FlareArgumentError, match="number of q heads"):
        flash_attn_func(q, k, v)
    with pytest.raises(FlareArgumentError, match="number of q heads"):
        flash_attn_with_kvcache(q, torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16), cache_seqlens=2)
