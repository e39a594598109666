"""Shared pytest setup: import flare from this source tree, and the naive fp64 reference attention."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# Test the package in this tree (python/flare), with the library of this tree unless FLARE_LIBRARY says
# otherwise; an installed copy of flare is not what these tests are about.
sys.path.insert(0, str(REPO / "python"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def reference_attention(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None, scale=None,
                        sinks=None, dropout=None):
    """Naive attention in fp64 over the dense layout q (b, sq, h, d), k/v (b, sk, hk, d) -> (out, lse).
    Written from the math in docs/semantics.md, independent of flare. sinks (h): a logit per head whose exp
    joins each row's softmax denominator (learnable sinks). dropout: (p, keep) with keep a bool (b, h, sq, sk)
    mask: P is multiplied by keep / (1 - p) before P V (lse stays undropped). Differentiable in every tensor
    argument."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd = kd.repeat_interleave(h // hk, dim=2)
    vd = vd.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", qd, kd) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq).view(sq, 1) + (sk - sq)  # bottom-right aligned query position
    j = torch.arange(sk).view(1, sk)
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1, h) if alibi_slopes.dim() == 2 else alibi_slopes.double().view(1, h)
        s = s - slopes.view(slopes.shape[0], h, 1, 1) * (i - j).abs().double()
    visible = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is None:
        lse = torch.logsumexp(s, dim=-1)  # (b, h, sq)
    else:
        sink = sinks.double().view(1, h, 1, 1).expand(b, h, sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    if dropout is not None:
        p = p * dropout[1].double() / (1.0 - dropout[0])
    out = torch.einsum("bhij,bjhd->bihd", p, vd)
    return out, lse


def tolerance(dtype):
    """(atol, rtol) for comparing a result of this dtype with the fp64 reference."""
    # fp64: the ABI carries softmax_scale as fp32 (and the default 1/sqrt(headdim) is rounded to it), so
    # fp64 results agree to about fp32's epsilon relative to the scores, not to fp64 rounding.
    return {torch.float64: (1e-6, 1e-6), torch.float32: (2e-5, 2e-5),
            torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}[dtype]


def assert_close_ref(actual, expected, dtype):
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, equal_nan=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
