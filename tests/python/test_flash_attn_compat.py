"""flare.flash_attn_compat: code written against flash_attn 2.x runs unchanged on flare."""

import importlib.metadata
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flare
import flare.flash_attn_compat as compat
from conftest import REPO, reference_attention


@pytest.fixture
def installed():
    compat.install()
    yield
    compat.uninstall()


# A script as a flash_attn user writes it: nothing of flare in it but the one install() line.
SNIPPET = textwrap.dedent("""
    import importlib.util, sys
    assert importlib.util.find_spec("flash_attn") is None, "flash_attn importable before install()"
    import flare.flash_attn_compat
    flare.flash_attn_compat.install()
    # ---- unchanged flash_attn code from here on
    import importlib.metadata
    import torch
    from packaging import version
    import flash_attn
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
    from flash_attn.flash_attn_interface import flash_attn_with_kvcache
    from flash_attn.layers.rotary import apply_rotary_emb

    assert version.parse(flash_attn.__version__) >= version.parse("2.6.0")
    assert version.parse(importlib.metadata.version("flash_attn")) >= version.parse("2.6.0")
    torch.manual_seed(0)
    b, s, h, d = 3, 37, 4, 32
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    cos, sin = torch.randn(s, d // 2).cos(), torch.randn(s, d // 2).sin()
    q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 30:] = False
    mask[2, 11:] = False
    q_u, indices, cu, max_s, _ = unpad_input(q, mask)
    k_u = index_first_axis(k.reshape(b * s, h, d), indices)
    v_u = index_first_axis(v.reshape(b * s, h, d), indices)
    out = pad_input(flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=True), indices, b, s)
    for i in range(b):
        n = int(mask[i].sum())
        dense = flash_attn_func(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], causal=True)
        assert torch.allclose(out[i:i + 1, :n], dense, atol=1e-5), i
        assert out[i, n:].abs().max() == 0 if n < s else True
    cache_k, cache_v = torch.zeros(b, 64, h, d), torch.zeros(b, 64, h, d)
    step = flash_attn_with_kvcache(q[:, :1], cache_k, cache_v, k[:, :1], v[:, :1], cache_seqlens=0)
    assert torch.allclose(step, v[:, :1], atol=1e-6)  # one key: the output is its value
    print("flash_attn snippet ok")
""")


def test_flash_attn_code_runs_unchanged():
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    run = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env,
                         cwd=REPO / "tests", timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "flash_attn snippet ok" in run.stdout


def test_not_installed_on_import():
    assert not compat.installed()
    assert "flash_attn" not in sys.modules


def test_modules_version_and_uninstall(installed):
    import flash_attn
    import flash_attn.bert_padding
    import flash_attn.layers.rotary

    assert flash_attn.__version__ == compat.VERSION == importlib.metadata.version("flash_attn")
    assert compat.VERSION.startswith("2.") and flare.__version__ in compat.VERSION
    assert flash_attn.bert_padding.index_first_axis is flare.bert_padding.index_first_axis
    assert flash_attn.layers.rotary.apply_rotary_emb is flare.rotary.apply_rotary_emb
    with pytest.raises(ModuleNotFoundError, match="flash_attn.ops.*provides flash_attn"):
        import flash_attn.ops  # noqa: F401
    compat.install()  # idempotent
    compat.uninstall()
    assert "flash_attn" not in sys.modules and not compat.installed()
    with pytest.raises(ModuleNotFoundError):
        import flash_attn  # noqa: F401,F811
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("flash_attn")
    compat.install()  # for the fixture's uninstall


def test_refuses_a_real_flash_attn(tmp_path, monkeypatch):
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("__version__ = '2.7.0'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"a real flash_attn is importable from .*flash_attn.*uninstall it"):
        compat.install()
    assert not compat.installed() and "flash_attn" not in sys.modules


def test_empty_row_lse_is_plus_inf_as_flash_attn_2(installed):
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    torch.manual_seed(1)
    q, k, v = torch.randn(1, 9, 2, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)  # rows 0..3 see no key
    own_out, own_lse, _ = flare.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, own_out)
    assert (lse[..., :4] == math.inf).all() and (own_lse[..., :4] == -math.inf).all()
    assert torch.equal(lse[..., 4:], own_lse[..., 4:]) and lse[..., 4:].isfinite().all()
    _, ref_lse = reference_attention(q, k, v, causal=True)
    assert torch.allclose(lse[..., 4:].double(), ref_lse[..., 4:], atol=1e-5)

    cu_q = torch.tensor([0, 3, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 4], dtype=torch.int32)  # the first sequence has no keys
    out, lse = flash_attn_varlen_func(torch.randn(6, 2, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16),
                                      cu_q, cu_k, 3, 4, return_softmax_lse=True)
    assert (lse[:, :3] == math.inf).all() and lse[:, 3:].isfinite().all()
    assert out[:3].abs().max() == 0


def _naive_rotary(x, cos, sin, positions, interleaved):
    """Rotation by complex multiplication, one position at a time: x (..., seqlen, heads, d)."""
    r = 2 * cos.shape[-1]
    out = x.double().clone()
    for t, p in enumerate(positions):
        angle = torch.complex(cos[p].double(), sin[p].double())
        xt = x[..., t, :, :r].double()
        pairs = xt.unflatten(-1, (-1, 2)) if interleaved else torch.stack(xt.chunk(2, -1), -1)
        z = torch.view_as_complex(pairs.contiguous()) * angle
        rot = torch.view_as_real(z)
        out[..., t, :, :r] = rot.flatten(-2) if interleaved else torch.cat((rot[..., 0], rot[..., 1]), -1)
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_against_complex_rotation(interleaved):
    torch.manual_seed(2)
    b, s, h, d, r = 2, 13, 3, 24, 16
    x = torch.randn(b, s, h, d)
    theta = torch.randn(40, r // 2)
    cos, sin = theta.cos(), theta.sin()
    got = flare.rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=5)
    assert torch.allclose(got.double(), _naive_rotary(x, cos, sin, range(5, 5 + s), interleaved), atol=1e-6)
    assert torch.equal(got[..., r:], x[..., r:])
    offsets = torch.tensor([0, 7])
    got = flare.rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    for i in range(b):
        want = _naive_rotary(x[i], cos, sin, range(int(offsets[i]), int(offsets[i]) + s), interleaved)
        assert torch.allclose(got[i].double(), want, atol=1e-6)
    # varlen: positions restart at each sequence
    cu = torch.tensor([0, 4, 13], dtype=torch.int32)
    flat = x[0]
    got = flare.rotary.apply_rotary_emb(flat, cos, sin, interleaved=interleaved, cu_seqlens=cu, max_seqlen=9)
    want = torch.cat([_naive_rotary(flat[:4], cos, sin, range(4), interleaved),
                      _naive_rotary(flat[4:], cos, sin, range(9), interleaved)])
    assert torch.allclose(got.double(), want, atol=1e-6)
    y = x.clone()
    assert flare.rotary.apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True) is y
    assert torch.allclose(y, flare.rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved))


def test_rotary_errors_and_grad():
    x = torch.randn(1, 8, 2, 8, requires_grad=True)
    cos, sin = torch.ones(8, 2), torch.zeros(8, 2)
    out = flare.rotary.apply_rotary_emb(x, cos, sin)
    assert torch.equal(out, x)  # angle 0
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(ValueError, match="needs cos/sin rows past their 8"):
        flare.rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=1)
    with pytest.raises(ValueError, match="more than headdim 8"):
        flare.rotary.apply_rotary_emb(x, torch.ones(8, 5), torch.zeros(8, 5))
    with pytest.raises(ValueError, match="max_seqlen is required"):
        flare.rotary.apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))


def test_index_first_axis_round_trip():
    x = torch.randn(10, 3, requires_grad=True)
    idx = torch.tensor([7, 2, 5])
    picked = flare.bert_padding.index_first_axis(x, idx)
    assert torch.equal(picked, x[idx])
    back = flare.bert_padding.index_put_first_axis(picked, idx, 10)
    assert torch.equal(back[idx], x[idx]) and back[[0, 1, 3, 4, 6, 8, 9]].abs().max() == 0
    back.sum().backward()
    assert x.grad.sum() == 9
