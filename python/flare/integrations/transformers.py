"""HuggingFace transformers: attn_implementation="flare".

    import flare.integrations.transformers as flare_hf
    flare_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flare")

register() adds flare_attention_forward to transformers' AttentionInterface and, for the masks, the same
mask function the flash-attention-2 integration uses (a 2D padding mask, or None when there is no padding),
so models build flare exactly the inputs they build for FA2. The attention function then takes one of
three routes, as FA2's does:
  - a padding mask: unpad q/k/v to the varlen layout, flash_attn_varlen_func, pad the output back
    (with a cache, query rows are taken from the right of the mask: left padding);
  - no mask, but position_ids that restart inside one packed row (batch 1), or cu_seq_lens_q/k given:
    varlen over the packed sequences;
  - otherwise the dense flash_attn_func; or, for a step against the cache (fewer queries than keys) that needs
    no gradient nor dropout, outside torch.compile, flash_attn_with_kvcache on the model's cache as it is (the same
    attention: its decode path, and a per-call host cost close to torch SDPA's).
GQA/MQA key/value heads go in as they are (no repeat_kv); with a cache, seqlen_q < seqlen_k and causal is
aligned bottom-right. sliding_window w becomes window_size (w - 1, w - 1), softcap is passed on, and so are
s_aux (GPT-OSS's learnable attention sinks, differentiable) and the attention dropout models ask for in
training (`dropout`, drawn from torch's default generator).

Under torch.compile nothing is read on the host: a padding mask is passed as each row's run of valid keys
(cu_seqlens_k + seqused_k), so the static-cache compiled generate() runs with fullgraph=True; the mask
function (flare_attention_mask) likewise skips FA2's host-side "is anything padded?" test while compiling.
register() also adds "paged|flare" (flare_paged_attention_forward) for continuous batching (generate_batch).
"""

import torch

from ..bert_padding import pad_input, unpad_input
from ..flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

NAME = "flare"


def _seqlens_to_cu(seqlens):
    return torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


def _packed_cu_seqlens(position_ids):
    """cu_seqlens of the sequences packed into one row: a sequence starts where position_ids is at its minimum."""
    flat = position_ids.reshape(-1)
    starts = (flat == flat.min()).nonzero().reshape(-1).to(torch.int32)
    cu = torch.cat([starts, torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)])
    return cu, int((cu[1:] - cu[:-1]).max())


def _is_packed(position_ids, batch):
    # One position (a decode step) restarts nothing; answering without reading it keeps the step free of a host
    # sync, so a CUDA graph can capture it.
    if position_ids is None or batch != 1 or position_ids.shape[-1] <= 1:
        return False
    expected = torch.arange(position_ids.shape[-1], device=position_ids.device) + position_ids.min()
    return bool((position_ids.reshape(-1) != expected).any())


def _masked_without_host_sync(q, k, v, attention_mask, options):
    """The padding-mask route with no data-dependent shape or host read, for torch.compile(fullgraph=True)
    (the static-cache compiled generate()): no unpadding. Each row's keys are the run of ones in its mask
    (left padding before it, unused static-cache slots after it), given to flash_attn_varlen_func as the
    sequence that starts at the run's first key (cu_seqlens_k) and holds its length (seqused_k); queries are
    all seqlen_q rows of each sequence, padding included (their output is not used). Holes inside a run are
    not supported here: generate() makes none."""
    batch, seqlen_q = q.shape[0], q.shape[1]
    mask = attention_mask.bool()
    seqlen_k = mask.shape[1]
    k, v = k[:, :seqlen_k], v[:, :seqlen_k]  # static caches can be longer than the mask
    used = mask.sum(dim=-1, dtype=torch.int32)
    first = mask.to(torch.int32).argmax(dim=-1).to(torch.int32)  # the first key of each row's run
    rows = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    cu_k = rows * seqlen_k + torch.nn.functional.pad(first, (0, 1))
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    out = flash_attn_varlen_func(flat(q), flat(k), flat(v), rows * seqlen_q, cu_k, seqlen_q, seqlen_k,
                                 seqused_k=used, **options)
    return out.reshape(batch, seqlen_q, *out.shape[1:])


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def flare_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: query (batch, nheads, seqlen_q, headdim), key/value
    (batch, nheads_k, seqlen_k, headdim), attention_mask the 2D padding mask (batch, seqlen_k) or None.
    Returns (attn_output (batch, seqlen_q, nheads, headdim_v), None)."""
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("flare: output_attentions=True is not supported (use eager)")
    causal = module.is_causal if is_causal is None else is_causal
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    options = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap or 0.0, s_aux=s_aux,
                   dropout_p=float(dropout or 0.0))

    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (batch, seqlen, heads, dim)
    batch, seqlen_q = q.shape[0], q.shape[1]
    position_ids = kwargs.get("position_ids")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")

    if attention_mask is not None and torch.compiler.is_compiling():
        return _masked_without_host_sync(q, k, v, attention_mask, options), None
    if attention_mask is not None:
        mask = attention_mask.bool()
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]  # static caches can be longer than the mask
        seqlens_k = mask.sum(dim=-1, dtype=torch.int32)
        indices_k = mask.reshape(-1).nonzero().reshape(-1)
        k_unpad = k.reshape(-1, *k.shape[2:])[indices_k]
        v_unpad = v.reshape(-1, *v.shape[2:])[indices_k]
        q_unpad, indices_q, cu_seqlens_q, max_q, _ = unpad_input(q, mask[:, -seqlen_q:])
        out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens_q, _seqlens_to_cu(seqlens_k), max_q,
                                     int(seqlens_k.max()), **options)
        return pad_input(out, indices_q, batch, seqlen_q), None

    if cu_q is not None and cu_k is not None:
        max_q = kwargs.get("max_length_q") or int((cu_q[1:] - cu_q[:-1]).max())
        max_k = kwargs.get("max_length_k") or int((cu_k[1:] - cu_k[:-1]).max())
    elif not torch.compiler.is_compiling() and _is_packed(position_ids, batch):
        cu_q, max_q = _packed_cu_seqlens(position_ids)
        cu_k, max_k = cu_q, max_q
    elif (seqlen_q < k.shape[1] and not options["dropout_p"] and not torch.compiler.is_compiling()
          and not _needs_grad(query, key, value, s_aux)):
        # Decoding against the model's cache without autograd or dropout: the KV-cache entry (its decode path
        # packs the query heads of a kv head and splits long caches across cores; its eager route skips torch's
        # op dispatch), the same attention as flash_attn_func's bottom-right aligned one.
        return flash_attn_with_kvcache(q, k, v, softmax_scale=scaling, causal=causal, window_size=window,
                                       softcap=softcap or 0.0, s_aux=s_aux), None
    else:
        return flash_attn_func(q, k, v, **options), None

    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    out = flash_attn_varlen_func(flat(q), flat(k), flat(v), cu_q, cu_k, max_q, max_k, **options)
    return out.reshape(batch, -1, *out.shape[1:]), None


def flare_paged_attention_forward(module, query, key, value, attention_mask=None, cache=None, cu_seq_lens_q=None,
                                  cu_seq_lens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_table=None,
                                  **kwargs):
    """attn_implementation="paged|flare": transformers' continuous batching (generate_batch, serving). The
    new tokens of every request come packed in one row: query (1, nheads, total_q, headdim), key/value
    (1, nheads_k, total_new, headdim). They are written into the PagedAttentionCache at write_index, each
    request's keys read back at read_index (cache.update), and attention runs as one flash_attn_varlen_func
    call over cu_seq_lens_q / cu_seq_lens_k, causal (aligned bottom-right: a request's new tokens follow its
    cached ones). Returns (attn_output (total_q, nheads, headdim), None)."""
    if cache is None or "read_index" not in kwargs or "write_index" not in kwargs:
        raise ValueError("flare: attn_implementation='paged|flare' is for continuous batching: it needs "
                         "transformers' PagedAttentionCache and its read/write indices (use 'flare' otherwise)")
    if block_table is not None:
        raise NotImplementedError("flare: paged|flare reads the cache through read_index; a block_table "
                                  "(transformers' fused decode path) is not supported")
    sliding_window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    window = (-1, -1) if not sliding_window else (sliding_window - 1, 0)
    if isinstance(cu_seq_lens_k, dict):  # models mixing full and sliding layers keep one set per layer type
        layer_type = "sliding_attention" if sliding_window else "full_attention"
        cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k[layer_type], max_seqlen_k[layer_type]
    k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                        read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    out = flash_attn_varlen_func(query.transpose(1, 2).squeeze(0), k, v, cu_seq_lens_q.to(torch.int32),
                                 cu_seq_lens_k.to(torch.int32), max_seqlen_q, max_seqlen_k,
                                 softmax_scale=kwargs.get("scaling", getattr(module, "scaling", None)),
                                 causal=True, window_size=window, softcap=kwargs.get("softcap") or 0.0,
                                 s_aux=kwargs.get("s_aux"))
    return out, None


def flare_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                         attention_mask=None, **kwargs):
    """The mask function of attn_implementation="flare": transformers' flash-attention one (the 2D padding mask,
    or None when nothing is padded), except under torch.compile, where the "is anything padded?" test would read
    the mask on the host and break the graph: there the 2D mask is always returned, and the attention function
    takes the route that needs no host read."""
    from transformers.masking_utils import flash_attention_mask

    if attention_mask is not None and torch.compiler.is_compiling():
        return attention_mask[:, -kv_length:]
    extra = {} if mask_function is None else {"mask_function": mask_function}
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                                **extra, **kwargs)


def register(name: str = NAME):
    """Make attn_implementation=name (default "flare") available to every transformers model, and
    "paged|<name>" for continuous batching (model.generate_batch, which switches a model loaded with
    attn_implementation=name to it by itself)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, flare_attention_forward)
    AttentionMaskInterface.register(name, flare_attention_mask)
    AttentionInterface.register(f"paged|{name}", flare_paged_attention_forward)
    return name
