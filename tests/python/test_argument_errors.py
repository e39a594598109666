"""Bad arguments through the Python layer: each gets a FlareArgumentError that names it, before any work or
allocation, instead of a wrapped value, a misread default, uninitialised memory or a stray Python error."""

import pytest
import torch

import flare
from flare import FlareArgumentError, ops
from flare.flash_attn_interface import flash_attn_func


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
