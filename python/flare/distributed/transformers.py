"""HuggingFace transformers with ring attention: attn_implementation="flare_ring".

    import flare.distributed.transformers as ring_hf
    ring_hf.register(group)             # after torch.distributed.init_process_group; once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flare_ring")
    batch = ring_hf.shard_inputs(input_ids, group=group)                      # (batch, seqlen) inputs
    batch = ring_hf.shard_packed_inputs(input_ids, cu_seqlens, group=group)  # (1, total) packed inputs
    logits = model(**batch).logits      # this rank's tokens only

Each rank runs the whole model on its shard of the tokens (zigzag by default): everything but attention is
per token, and attention runs as ring_attention over the group. The shard carries position_ids with the
tokens' global positions (per sequence when packed), so rotary embeddings see where each token really is;
packed batches carry the local cu_seq_lens_q/k and max_length_q/k that transformers hands to the
attention function. Causal masks, sliding windows and softcap come from the model as for flash-attention-2.

Labels: shifting inside the model would pair tokens across chunk boundaries. With labels=..., the shard
holds shift_labels, shifted on the whole sequence before sharding (-100 at each sequence's end), which
transformers' causal-LM loss takes instead of shifting (its mean is over this rank's tokens; average over
the ranks, or pass num_items_in_batch, for the global mean).

Not supported: padding masks (pack the sequences instead), attention dropout, attention sinks, KV caches
(generation: ring attention is for training and long prefill; run generation without it).
"""

from typing import Optional

import torch
from torch import Tensor

from .._capi import FlareArgumentError
from .ring import ring_attention, ring_attention_varlen
from .sharding import local_positions, local_positions_varlen, shard_sequence, shard_varlen

NAME = "flare_ring"
IGNORE_INDEX = -100


def make_attention_function(group=None, zigzag: bool = True):
    """A transformers attention function (AttentionInterface signature) running ring attention on `group`."""

    def flare_ring_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                     sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
        """query (batch, nheads, local_len, headdim), key/value (batch, nheads_k, local_len, headdim):
        this rank's tokens. Returns (attn_output (batch, local_len, nheads, headdim_v), None)."""
        if attention_mask is not None:
            raise NotImplementedError("flare_ring: padding masks are not supported; pack the sequences "
                                      "(shard_packed_inputs) instead of padding them")
        if dropout and dropout > 0.0:
            raise NotImplementedError(f"flare_ring: attention dropout={dropout} is not supported")
        if s_aux is not None:
            raise NotImplementedError("flare_ring: s_aux (attention sinks) is not supported")
        if query.shape[2] != key.shape[2]:
            raise NotImplementedError("flare_ring: queries and keys of different lengths (a KV cache?) are "
                                      "not supported; generate without ring attention")
        causal = module.is_causal if is_causal is None else is_causal
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
        options = dict(group=group, causal=causal, softmax_scale=scaling, window_size=window,
                       softcap=softcap or 0.0, zigzag=zigzag)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is None:
            return ring_attention(q, k, v, **options), None
        if q.shape[0] != 1:
            raise FlareArgumentError(f"flare_ring: packed sequences come as one row (batch 1), got batch {q.shape[0]}")
        cu_k = cu_q if cu_k is None else cu_k
        out = ring_attention_varlen(q[0], k[0], v[0], cu_q, cu_k, kwargs.get("max_length_q") or 0,
                                    kwargs.get("max_length_k") or 0, **options)
        return out.unsqueeze(0), None

    return flare_ring_attention_forward


def register(group=None, *, zigzag: bool = True, name: str = NAME) -> str:
    """Make attn_implementation=name (default "flare_ring") run ring attention over `group` (default: the
    world) in every transformers model of this process. Returns name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, make_attention_function(group, zigzag))
    # Like flash-attention-2: no mask tensor, only a 2D padding mask when there is padding (refused above).
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _shift_labels(labels: Tensor, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """labels[t + 1] at t, IGNORE_INDEX where t is the last token of its sequence."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[..., :-1] = labels[..., 1:]
    if cu_seqlens is not None:
        ends = cu_seqlens[1:].long() - 1
        shifted[..., ends[ends >= 0]] = IGNORE_INDEX
    return shifted


def shard_inputs(input_ids: Tensor, labels: Optional[Tensor] = None, *, group=None,
                 world_size: Optional[int] = None, rank: Optional[int] = None, zigzag: bool = True) -> dict:
    """Model inputs for this rank from input_ids (batch, seqlen) (seqlen divisible by 2W, W without
    zigzag): input_ids and position_ids of its tokens, and shift_labels when labels are given."""
    where = dict(world_size=world_size, rank=rank, group=group, zigzag=zigzag)
    ids = shard_sequence(input_ids, **where)
    positions = local_positions(input_ids.shape[1], device=input_ids.device, **where)
    batch = dict(input_ids=ids, position_ids=positions.unsqueeze(0).expand(ids.shape[0], -1))
    if labels is not None:
        batch["labels"] = batch["shift_labels"] = shard_sequence(_shift_labels(labels), **where)
    return batch


def shard_packed_inputs(input_ids: Tensor, cu_seqlens: Tensor, labels: Optional[Tensor] = None, *, group=None,
                        world_size: Optional[int] = None, rank: Optional[int] = None,
                        zigzag: bool = True) -> dict:
    """Model inputs for this rank from sequences packed into one row, input_ids (1, total) with offsets
    cu_seqlens (batch + 1; every length divisible by 2W, W without zigzag): input_ids, position_ids
    (positions inside each sequence), cu_seq_lens_q/k and max_length_q/k (local), and shift_labels when
    labels are given."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise FlareArgumentError(f"packed input_ids must be one row (1, total), got {tuple(input_ids.shape)}")
    where = dict(world_size=world_size, rank=rank, group=group, zigzag=zigzag)
    ids, cu_local, max_local = shard_varlen(input_ids[0], cu_seqlens, **where)
    positions = local_positions_varlen(cu_seqlens, **where).to(input_ids.device)
    cu_local = cu_local.to(input_ids.device)
    batch = dict(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), cu_seq_lens_q=cu_local,
                 cu_seq_lens_k=cu_local, max_length_q=max_local, max_length_k=max_local)
    if labels is not None:
        shifted = _shift_labels(labels[0], cu_seqlens.to(labels.device))
        batch["labels"] = batch["shift_labels"] = shard_varlen(shifted, cu_seqlens, **where)[0].unsqueeze(0)
    return batch
