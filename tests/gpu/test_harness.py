"""Checks of the GPU suite's own harness (attention_reference.py, cases.py), on the suite's device:
the reference's explicit backward against autograd, its forward against torch SDPA's math kernel in fp64,
and the accuracy rule rejecting answers that are wrong by a little or by a mask."""

import pytest
import torch
import torch.nn.functional as F

import flare
from attention_reference import (UNIT_ROUNDOFF, AttnOptions, check_close, check_lse, dense_attention,
                                 visible_keys)
from cases import DEVICE, Case, alibi_slopes, check_case, skip_module_without_device

skip_module_without_device()

OPTION_SETS = {
    "plain": AttnOptions(),
    "causal": AttnOptions(causal=True),
    "window": AttnOptions(window=(5, 3)),
    "softcap": AttnOptions(softcap=1.5, softmax_scale=0.6),
    "alibi-causal-window": AttnOptions(causal=True, window=(7, -1), alibi_slopes="batch"),
    "everything": AttnOptions(causal=True, window=(6, -1), softcap=4.0, alibi_slopes="head", softmax_scale=0.3),
}


def _options(name, batch, nheads):
    o = OPTION_SETS[name]
    slopes = alibi_slopes(o.alibi_slopes, batch, nheads, DEVICE) if isinstance(o.alibi_slopes, str) else None
    return AttnOptions(o.softmax_scale, o.causal, o.window, o.softcap, slopes)


@pytest.mark.parametrize("seqlens", [(11, 11), (7, 19), (19, 7)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_reference_backward_is_the_gradient(name, seqlens):
    b, h, hk, d, dv = 2, 4, 2, 8, 12
    sq, sk = seqlens
    opts = _options(name, b, h)
    q = torch.randn(b, sq, h, d, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k = torch.randn(b, sk, hk, d, dtype=torch.float64, device=DEVICE, requires_grad=True)
    v = torch.randn(b, sk, hk, dv, dtype=torch.float64, device=DEVICE, requires_grad=True)
    dout = torch.randn(b, sq, h, dv, dtype=torch.float64, device=DEVICE)
    explicit = dense_attention(q.detach(), k.detach(), v.detach(), opts, dout, compute=torch.float64)
    out = dense_attention(q, k, v, opts, compute=torch.float64)["out"]
    out.backward(dout)
    torch.testing.assert_close(explicit["out"], out.detach(), rtol=0, atol=1e-12)
    for name_, grad in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(explicit[name_], grad, rtol=1e-10, atol=1e-10, msg=name_)


@pytest.mark.parametrize("seqlens", [(11, 11), (7, 19), (19, 7)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", ["plain", "causal", "window", "alibi-causal-window"])
def test_reference_forward_matches_torch_math(name, seqlens):
    b, h, d = 2, 3, 16
    sq, sk = seqlens
    opts = _options(name, b, h)
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float64, device=DEVICE) for n in (sq, sk, sk))
    visible, distance = visible_keys(sq, sk, opts.causal, opts.window, DEVICE)
    bias = torch.zeros(b, h, sq, sk, dtype=torch.float64, device=DEVICE)
    if opts.alibi_slopes is not None:
        bias = bias - opts.alibi_slopes.double().view(b, h, 1, 1) * distance.double()
    bias = bias.masked_fill(~visible, float("-inf"))
    theirs = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            attn_mask=bias).transpose(1, 2)
    mine = dense_attention(q, k, v, opts, compute=torch.float64)
    rows = visible.any(dim=1)  # SDPA gives NaN where no key is visible; flare's semantics give 0
    torch.testing.assert_close(mine["out"][:, rows], theirs[:, rows], rtol=1e-10, atol=1e-10)
    assert torch.all(mine["out"][:, ~rows] == 0)
    assert torch.all(torch.isneginf(mine["lse"][:, :, ~rows]))


def _bf16_problem(causal=True):
    b, sq, sk, h, d = 2, 37, 53, 4, 32
    q, k, v = (torch.randn(b, n, h, d, device=DEVICE).to(torch.bfloat16) for n in (sq, sk, sk))
    opts = AttnOptions(causal=causal)
    return q, k, v, opts, dense_attention(q, k, v, opts), dense_attention(q, k, v, opts,
                                                                         round_dtype=torch.bfloat16)


def test_rule_accepts_a_correctly_rounded_answer():
    q, k, v, opts, ref, naive = _bf16_problem()
    check_close("out", ref["out"].to(torch.bfloat16), ref["out"], naive["out"], torch.bfloat16)
    check_lse(ref["lse"].clone(), ref["lse"])


def test_rule_rejects_wrong_answers():
    q, k, v, opts, ref, naive = _bf16_problem()
    good = ref["out"].to(torch.bfloat16)
    bad = good.clone()
    bad[1, 20, 2, 5] += 0.05  # one element off by a few bf16 ulps at its scale
    with pytest.raises(AssertionError, match="bound"):
        check_close("out", bad, ref["out"], naive["out"], torch.bfloat16)
    bad = good.clone()
    bad[0, 3, 1, 7] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        check_close("out", bad, ref["out"], naive["out"], torch.bfloat16)
    unmasked = dense_attention(q, k, v, AttnOptions())  # the causal mask forgotten
    with pytest.raises(AssertionError, match="bound"):
        check_close("out", unmasked["out"].to(torch.bfloat16), ref["out"], naive["out"], torch.bfloat16)
    lse = ref["lse"].clone()
    lse[0, 0, 0] += 1e-3 * max(1.0, lse[0, 0, 0].abs().item())
    with pytest.raises(AssertionError, match="softmax_lse"):
        check_lse(lse, ref["lse"])
    lse = ref["lse"].clone()
    lse[1, 2, 3] = float("-inf")
    with pytest.raises(AssertionError, match="-inf"):
        check_lse(lse, ref["lse"])
    assert UNIT_ROUNDOFF[torch.bfloat16] == 2.0 ** -8


def test_check_case_catches_a_broken_implementation(monkeypatch):
    """End to end on the suite's device: flare with its causal flag dropped must fail check_case."""
    honest = flare.flash_attn_func

    def without_causal(q, k, v, *args, **kwargs):
        kwargs["causal"] = False
        return honest(q, k, v, *args, **kwargs)

    case = Case(dtype=torch.bfloat16, batch=2, seqlen_q=29, seqlen_k=29, nheads=2, nheads_k=2, headdim=64,
                causal=True)
    check_case(case)  # the honest one passes
    monkeypatch.setattr(flare, "flash_attn_func", without_causal)
    with pytest.raises(AssertionError):
        check_case(case)
