"""Attention dropout through the Python layers: flare.ops and the flash_attn API against the fp64 reference
drawing flare's own mask (flare.ops.dropout_mask), forward and gradients, fp64 gradcheck at a fixed seed;
torch.manual_seed reproducing a run; dropout leaving the output unbiased; flash-attn 2's S_dmask; and
transformers training with attention_dropout, whose loss statistics match eager's."""

import pytest
import torch
from conftest import assert_close_ref, reference_attention

from flare import _capi, ops
from flare.flash_attn_interface import flash_attn_func, flash_attn_varlen_func


def _inputs(b, sq, sk, h, hk, d, dtype, requires_grad=False):
    q, k, v = torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype), \
        torch.randn(b, sk, hk, d, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def _keep(p, seed, offset, b, h, sq, sk):
    return torch.stack([ops.dropout_mask(p, seed, offset, i, h, sq, sk) for i in range(b)])


def _fwd(q, k, v, causal, p, seed, offset, sinks=None):
    return ops.fwd(q, k, v, None, None, None, 0, 0, None, 0.0, causal, -1, -1, 0.0, False, "auto", None, sinks,
                   p, seed, offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients_match_reference(dtype, causal):
    b, sq, sk, h, hk, d, p = 2, 45, 70, 4, 2, 32, 0.3
    seed, offset = -0x0123456789ABCDEF, 2**40 + 5  # any 64-bit patterns
    q, k, v = _inputs(b, sq, sk, h, hk, d, dtype, requires_grad=True)
    out, _ = _fwd(q, k, v, causal, p, seed, offset)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = _keep(p, seed, offset, b, h, sq, sk)
    ref, _ = reference_attention(q, k, v, causal=causal, dropout=(p, keep))
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    assert_close_ref(out, ref, dtype)
    for g, r in zip(grads, ref_grads):
        assert_close_ref(g, r, dtype)


def test_gradcheck_fp64_at_a_fixed_seed():
    q, k, v = _inputs(1, 6, 9, 2, 1, 8, torch.float64, requires_grad=True)
    f = lambda q, k, v: _fwd(q, k, v, True, 0.4, 99, 3)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_manual_seed_reproduces_and_seeds_differ():
    q, k, v = _inputs(2, 30, 30, 4, 4, 16, torch.float32)
    torch.manual_seed(7)
    a = flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    b = flash_attn_func(q, k, v, dropout_p=0.5)
    c = flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_dropout_leaves_the_output_unbiased():
    q, k, v = _inputs(1, 8, 24, 2, 2, 8, torch.float64)
    clean = flash_attn_func(q, k, v)
    runs = torch.stack([flash_attn_func(q, k, v, dropout_p=0.3) for _ in range(400)])
    mean, std = runs.mean(0), runs.std(0)
    bound = 5 * std / 400 ** 0.5 + 1e-9
    assert ((mean - clean).abs() <= bound).all()
    assert (std > 0).all()


def test_s_dmask_is_the_probabilities_with_dropped_ones_negated():
    q, k, v = _inputs(2, 13, 21, 4, 2, 16, torch.float32)
    sinks = torch.randn(4)
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=0.25, causal=True, s_aux=sinks, return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 13, 21)
    probs = torch.exp(reference_attention_scores(q, k, causal=True) - lse.double().unsqueeze(-1))
    assert_close_ref(s_dmask.abs(), probs, torch.float32)
    # The output is sum_j P_ij z_ij v_j with z from S_dmask's signs: S_dmask and out agree.
    keep = s_dmask > 0
    ref, _ = reference_attention(q, k, v, causal=True, sinks=sinks, dropout=(0.25, keep))
    assert_close_ref(out, ref, torch.float32)


def reference_attention_scores(q, k, causal):
    """Scaled scores (b, h, sq, sk) in fp64, -inf where causally masked (GQA by repetition)."""
    h, hk = q.shape[2], k.shape[2]
    kd = k.double().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), kd) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        visible = torch.arange(sk).view(1, sk) <= torch.arange(sq).view(sq, 1) + (sk - sq)
        s = s.masked_fill(~visible, float("-inf"))
    return s


def test_varlen_dropout_matches_per_sequence_reference():
    lens = [5, 17, 9]
    h, d, p = 2, 16, 0.2
    qs, ks, vs = ([torch.randn(n, h, d) for n in lens] for _ in range(3))
    cu = torch.tensor([0, 5, 22, 31], dtype=torch.int32)
    torch.manual_seed(11)
    out = flash_attn_varlen_func(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu, cu, 17, 17, dropout_p=p,
                                 causal=True)
    torch.manual_seed(11)
    seed, offset = torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64).tolist()  # what the call drew
    for i, n in enumerate(lens):
        keep = ops.dropout_mask(p, seed, offset, i, h, n, n)[None]
        ref, _ = reference_attention(qs[i][None], ks[i][None], vs[i][None], causal=True, dropout=(p, keep))
        assert_close_ref(out[cu[i]:cu[i + 1]], ref[0], torch.float32)


def test_bad_dropout_is_refused():
    q, k, v = _inputs(1, 4, 4, 2, 2, 8, torch.float32)
    for p in (-0.1, 1.0, float("nan")):
        with pytest.raises(_capi.FlareArgumentError, match="dropout_p is"):
            flash_attn_func(q, k, v, dropout_p=p)
    with pytest.raises(_capi.FlareArgumentError, match="dropout_p="):
        flash_attn_func(q, k, v, dropout_p="half")


# ---- transformers: attention_dropout in training --------------------------------------------------------

transformers = pytest.importorskip("transformers")


def test_llama_attention_dropout_loss_statistics_match_eager():
    import flare.integrations.transformers as flare_hf

    flare_hf.register()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.3,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    models = {attn: transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                                  dtype=torch.float32) for attn in ("flare", "eager")}
    models["eager"].load_state_dict(models["flare"].state_dict())
    ids = torch.randint(0, 64, (2, 24))
    losses = {}
    for attn, model in models.items():
        model.train()
        with torch.no_grad():
            losses[attn] = torch.tensor([model(ids, labels=ids).loss.item() for _ in range(60)], dtype=torch.float64)
        model.eval()
        with torch.no_grad():
            losses[attn + "-eval"] = model(ids, labels=ids).loss.item()
    # Without dropout the two agree; with it each draw differs, but the losses share their distribution.
    assert abs(losses["flare-eval"] - losses["eager-eval"]) < 1e-4
    a, b = losses["flare"], losses["eager"]
    assert a.std() > 0 and b.std() > 0
    spread = (a.var() / len(a) + b.var() / len(b)).sqrt()
    assert abs(a.mean() - b.mean()) < 5 * spread
    assert 0.5 < (a.std() / b.std()).item() < 2.0
