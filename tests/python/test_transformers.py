"""attn_implementation="flare" in HuggingFace transformers: tiny randomly initialised models (no downloads)
give the same logits, generated tokens and gradients as eager attention."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flare.integrations.transformers as flare_hf  # noqa: E402

flare_hf.register()

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MODELS = {  # name -> (config class, extra config): GQA everywhere; windows and softcap where the model has them
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", dict(sliding_window=7)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=6, attn_logit_softcapping=20.0,
                                    final_logit_softcapping=None, query_pre_attn_scalar=16)),
}


def make_model(name, attn):
    config_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                         dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def models(request):
    flare_model = make_model(request.param, "flare")
    eager_model = make_model(request.param, "eager")
    eager_model.load_state_dict(flare_model.state_dict())
    return flare_model, eager_model


ATOL = 2e-5


def test_no_padding(models):
    flare_model, eager_model = models
    ids = torch.randint(0, VOCAB, (2, 23))
    with torch.no_grad():
        mine = flare_model(ids).logits
        torch.testing.assert_close(mine, eager_model(ids).logits, atol=ATOL, rtol=1e-4)
        eager_model.set_attn_implementation("sdpa")
        try:
            torch.testing.assert_close(mine, eager_model(ids).logits, atol=ATOL, rtol=1e-4)
        finally:
            eager_model.set_attn_implementation("eager")


def test_left_padding(models):
    flare_model, eager_model = models
    ids = torch.randint(0, VOCAB, (3, 19))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    with torch.no_grad():
        mine = flare_model(ids, attention_mask=mask).logits
        theirs = eager_model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(mine[real], theirs[real], atol=ATOL, rtol=1e-4)


def test_packed_batch(models):
    flare_model, eager_model = models
    lengths = [9, 14, 5]
    seqs = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        mine = flare_model(packed, position_ids=position_ids).logits
        theirs = torch.cat([eager_model(s).logits for s in seqs], dim=1)
    torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=1e-4)


def test_generate_same_tokens(models):
    flare_model, eager_model = models
    ids = torch.randint(1, VOCAB, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        mine = flare_model.generate(ids, **kwargs)
        theirs = eager_model.generate(ids, **kwargs)
    assert torch.equal(mine, theirs)


def test_generate_no_padding_kv_cache(models):
    # decoding steps run seqlen_q = 1 against the cache: bottom-right causal, the dense path
    flare_model, eager_model = models
    ids = torch.randint(1, VOCAB, (1, 9))
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(flare_model.generate(ids, **kwargs), eager_model.generate(ids, **kwargs))


def test_training_step_gradients(models):
    flare_model, eager_model = models
    ids = torch.randint(0, VOCAB, (2, 17))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    # The label of the first real token is predicted from a padding position, whose output is garbage in
    # eager and 0 in flare: ignore it too, as a padding-aware training loop would.
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100
    grads = []
    for model in (flare_model, eager_model):
        model.train()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.eval()
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-4, rtol=1e-3, msg=name)


def test_flare_is_what_runs(monkeypatch):
    calls = []
    real = flare_hf.flash_attn_func

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(flare_hf, "flash_attn_func", counting)
    model = make_model("mistral", "flare")
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 12)))
    assert len(calls) == COMMON["num_hidden_layers"]
    assert calls[0]["window_size"] == (6, 6) and calls[0]["causal"]


def test_unknown_name_without_register_is_rejected():
    config = transformers.LlamaConfig(**COMMON)
    with pytest.raises(ValueError):
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flare_not_registered")
