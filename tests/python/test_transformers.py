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


def _greedy(model, prompt, n):
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_continuous_batching_runs_through_flare(name, monkeypatch):
    """model.generate_batch (transformers' continuous batching) switches a "flare" model to "paged|flare":
    every request's tokens equal greedy generate() with eager attention."""
    import transformers.generation.continuous_batching.cache as cb_cache

    # On the CPU transformers sizes the paged cache from psutil's free memory; give it a fixed budget instead.
    monkeypatch.setattr(cb_cache, "get_device_and_memory_breakdown", lambda: (torch.device("cpu"), 1 << 30, 0, 0))
    calls = []
    real = flare_hf.flash_attn_varlen_func
    monkeypatch.setattr(flare_hf, "flash_attn_varlen_func", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = make_model(name, "flare")
    prompts = [[1, 2, 3, 4, 9, 10, 11], [5, 6, 7], [8] * 12]
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=config, warmup=False,
                               continuous_batching_config=transformers.ContinuousBatchingConfig(num_blocks=16,
                                                                                                max_batch_tokens=64))
    assert calls, "continuous batching did not run through flare"  # (generate_batch restores "flare" after)
    model.set_attn_implementation("eager")
    for i, prompt in enumerate(prompts):
        assert out[f"req_{i}"].generated_tokens == _greedy(model, prompt, 6), i


def test_paged_flare_needs_the_paged_cache():
    model = make_model("llama", "flare")
    model.set_attn_implementation("paged|flare")
    with pytest.raises(ValueError, match="paged\\|flare' is for continuous batching"):
        model(torch.randint(0, VOCAB, (1, 5)))


def test_static_cache_compiled_generate_fullgraph(monkeypatch, tmp_path):
    """generate() with a static cache, compiled with fullgraph=True (transformers drops fullgraph for
    flash-named implementations; "flare" needs no such relaxing): no graph break, left padding, same tokens
    as eager."""
    traced = []
    real = flare_hf._masked_without_host_sync
    monkeypatch.setattr(flare_hf, "_masked_without_host_sync",
                        lambda *a: traced.append(torch.compiler.is_compiling()) or real(*a))
    torch._dynamo.reset()
    model = make_model("llama", "flare")
    ids = torch.randint(1, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    compile_config = transformers.CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                         cache_implementation="static", compile_config=compile_config)
    assert compile_config.fullgraph and traced and all(traced), "the compiled graph did not take flare's path"
    model.set_attn_implementation("eager")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out[:, 9:].tolist() == ref[:, 9:].tolist()
