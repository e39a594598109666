"""Learnable attention sinks (GPT-OSS's s_aux) through the Python layers: flare.ops (forward, autograd for
q/k/v and the sinks, fp64 gradcheck), the flash_attn API's s_aux on every entry, the KV cache, and a tiny
GPT-OSS model from a config whose logits and gradients with attn_implementation="flare" match eager's."""

import pytest
import torch
from conftest import assert_close_ref, reference_attention

from flare import _capi, ops
from flare.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def _inputs(b, sq, sk, h, hk, d, dtype, requires_grad=False):
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, hk, d, dtype=dtype)
    v = torch.randn(b, sk, hk, d, dtype=dtype)
    sinks = torch.empty(h, dtype=torch.float32).uniform_(-1.0, 3.0)
    for t in (q, k, v, sinks):
        t.requires_grad_(requires_grad)
    return q, k, v, sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(37, 37), (20, 61), (50, 9)])
def test_forward_matches_reference(dtype, causal, sq, sk):
    q, k, v, sinks = _inputs(2, sq, sk, 4, 2, 32, dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, s_aux=sinks, return_attn_probs=True)[:2]
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal, sinks=sinks)
    assert_close_ref(out, ref_out, dtype)
    assert_close_ref(lse, ref_lse, torch.float32 if dtype != torch.float64 else torch.float64)


def test_rows_without_keys_have_the_sink_as_lse():
    # causal with 50 queries and 9 keys: the first 41 rows see nothing; out 0, lse = the sink.
    q, k, v, sinks = _inputs(1, 50, 9, 3, 1, 16, torch.float32)
    out, lse = ops.fwd(q, k, v, None, None, None, 0, 0, None, 0.0, True, -1, -1, 0.0, False, "auto", None, sinks)
    assert torch.equal(out[:, :41], torch.zeros_like(out[:, :41]))
    assert torch.equal(lse[0, :, :41], sinks.view(3, 1).expand(3, 41))
    assert (lse[0, :, 41:] > sinks.view(3, 1)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_reference(dtype):
    q, k, v, sinks = _inputs(2, 45, 70, 4, 2, 32, dtype, requires_grad=True)
    dout = torch.randn(2, 45, 4, 32, dtype=dtype)
    out = flash_attn_func(q, k, v, causal=True, window_size=(30, 0), s_aux=sinks)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref_out, _ = reference_attention(q, k, v, causal=True, window=(30, 0), sinks=sinks)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v, sinks), dout.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_ref(g, r, dtype)
    assert grads[3].dtype == sinks.dtype
    # dsinks sums every row of a head: compare relative to its size, at the dtype's output precision.
    atol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(grads[3].double(), ref_grads[3].double(), atol=atol * ref_grads[3].abs().max().item(),
                               rtol=0)


def test_gradcheck_fp64():
    q, k, v, sinks = _inputs(1, 6, 9, 2, 1, 8, torch.float64, requires_grad=True)
    sinks = sinks.detach().double().requires_grad_(True)

    def f(q, k, v, sinks):
        return ops.fwd(q, k, v, None, None, None, 0, 0, None, 0.0, True, -1, -1, 0.0, False, "auto", None,
                       sinks)[0]

    # The ABI carries lse in fp32, so fp64 gradients agree to about fp32's precision, not fp64's.
    assert torch.autograd.gradcheck(lambda q, k, v: f(q, k, v, sinks.detach()), (q, k, v), eps=1e-6, atol=1e-5,
                                    rtol=1e-4)
    # The sinks cross the ABI as fp32 too: a step of 1e-6 would be lost to their rounding, so the finite
    # differences take steps of 1e-3 (their O(step^2) error stays below the tolerance).
    assert torch.autograd.gradcheck(lambda s: f(q.detach(), k.detach(), v.detach(), s), (sinks,), eps=1e-3,
                                    atol=1e-4, rtol=1e-3)


def test_varlen_matches_dense_per_sequence():
    lens_q, lens_k = [5, 0, 17, 9], [8, 4, 17, 30]
    h, hk, d = 4, 2, 16
    sinks = torch.randn(h, requires_grad=True)
    qs = [torch.randn(n, h, d) for n in lens_q]
    ks = [torch.randn(n, hk, d) for n in lens_k]
    vs = [torch.randn(n, hk, d) for n in lens_k]
    cu_q = torch.tensor([0] + torch.cumsum(torch.tensor(lens_q), 0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.cumsum(torch.tensor(lens_k), 0).tolist(), dtype=torch.int32)
    out = flash_attn_varlen_func(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_q, cu_k, max(lens_q), max(lens_k),
                                 causal=True, s_aux=sinks)
    dout = torch.randn_like(out)
    (dsinks,) = torch.autograd.grad(out, (sinks,), dout)
    ref_dsinks = torch.zeros(h, dtype=torch.float64)
    for i, (q, k, v) in enumerate(zip(qs, ks, vs)):
        ref, _ = reference_attention(q[None], k[None], v[None], causal=True, sinks=sinks)
        assert_close_ref(out[cu_q[i]:cu_q[i + 1]], ref[0], torch.float32)
        if ref.numel():
            (g,) = torch.autograd.grad(ref, (sinks,), dout[cu_q[i]:cu_q[i + 1]][None].double())
            ref_dsinks += g.double()
    torch.testing.assert_close(dsinks.double(), ref_dsinks, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_kvcache_matches_reference(num_splits, seqlen_q):
    b, cap, h, hk, d = 2, 40, 8, 2, 32
    q = torch.randn(b, seqlen_q, h, d)
    k_cache, v_cache = torch.randn(b, cap, hk, d), torch.randn(b, cap, hk, d)
    lens = torch.tensor([13, 40], dtype=torch.int32)
    sinks = torch.randn(h) + 1.0
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, num_splits=num_splits,
                                  s_aux=sinks)
    for i in range(b):
        n = int(lens[i])
        ref, _ = reference_attention(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], causal=True,
                                     sinks=sinks)
        assert_close_ref(out[i:i + 1], ref, torch.float32)


def test_bad_sinks_are_refused():
    q, k, v, _ = _inputs(1, 4, 4, 4, 2, 8, torch.float32)
    with pytest.raises(_capi.FlareArgumentError, match=r"sinks has shape \(3\)"):
        flash_attn_func(q, k, v, s_aux=torch.zeros(3))
    with pytest.raises(_capi.FlareArgumentError, match="sinks has rank 2"):
        flash_attn_func(q, k, v, s_aux=torch.zeros(1, 4))
    with pytest.raises(_capi.FlareArgumentError, match="s_aux is a list"):
        flash_attn_func(q, k, v, s_aux=[0.0] * 4)


# ---- transformers: a tiny GPT-OSS from a config ----------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _gpt_oss(attn):
    import flare.integrations.transformers as flare_hf

    flare_hf.register()
    config = transformers.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                       layer_types=["sliding_attention", "full_attention"],
                                       max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # sinks start at zero; make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.uniform_(-1.0, 3.0)
    return model


def test_gpt_oss_logits_and_gradients_match_eager():
    flare_model, eager_model = _gpt_oss("flare"), _gpt_oss("eager")
    eager_model.load_state_dict(flare_model.state_dict())
    ids = torch.randint(0, 96, (2, 21))
    grads = []
    for model in (flare_model, eager_model):
        model.train()
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        grads.append((out.logits.detach(), [layer.self_attn.sinks.grad.clone() for layer in model.model.layers],
                      model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    (logits, sink_grads, wq), (ref_logits, ref_sink_grads, ref_wq) = grads
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)
    for g, r in zip(sink_grads, ref_sink_grads):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-3)
    torch.testing.assert_close(wq, ref_wq, atol=2e-5, rtol=1e-3)


def test_gpt_oss_generate_matches_eager():
    flare_model, eager_model = _gpt_oss("flare"), _gpt_oss("eager")
    eager_model.load_state_dict(flare_model.state_dict())
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        mine = flare_model.generate(ids, max_new_tokens=12, do_sample=False)
        ref = eager_model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(mine, ref)
