#!/usr/bin/env python3
"""Host time of one flare call from Python, on tensors so small that the attention itself costs little:
  tensor_view             a torch tensor -> flare_tensor (python/flare/_capi.py, one struct.pack), against
  tensor_view_by_field    the same view set field by field (how it was built before, kept here to compare)
  op_fwd / eager_fwd      flare::fwd through torch's custom-op dispatch / ops.fwd_eager, same arguments
  op_bwd / eager_bwd      likewise for the backward
  c_fwd                   the C entry point alone (lib.fwd on prepared params): the floor of the above
and one decode step (1 query token against a cache of 16 keys, batch 1, 8 query heads over 8 kv heads, head
dim 64, fp32) through each layer, beside torch's own attention on the same tensors:
  c_kvcache               flare_fwd_kvcache on prepared params (the C ABI alone)
  op_kvcache              flare::fwd_kvcache through torch's custom-op dispatch
  flash_attn_with_kvcache flare.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...)
  ..._append              the same appending the step's k/v (k=, v=) first, as a decode loop calls it
  transformers_flare      flare's transformers attention function (integrations/transformers.py) on one
                          decode step as a model makes it: (batch, heads, seqlen, dim) tensors, no mask
  transformers_sdpa       transformers' own SDPA attention function on the same step
  sdpa                    torch.nn.functional.scaled_dot_product_attention on the (batch, heads, seqlen, dim)
                          tensors: the yardstick (issue goal: flash_attn_with_kvcache <= 1.5x its time)
Decode rows (group "decode-step") carry vs_sdpa = us_per_call / sdpa's. Each figure is the median over 7
rounds of the mean time per call (us) of --calls calls, time.perf_counter, one thread; each round times every
case of its group in turn.

  python3 bench/cpu/host_cost.py            writes bench/results/host-cost-<date>-<sha>.json
"""

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))

import meta as run_meta  # noqa: E402
from flare import _capi, ops  # noqa: E402


def tensor_view_by_field(t):
    view = _capi.flare_tensor()
    view.data = t.data_ptr()
    view.dtype = _capi._DTYPES[str(t.dtype)]
    view.device = _capi.flare_device(_capi._DEVICES[t.device.type], t.device.index or 0)
    view.rank = t.dim()
    for i, (size, stride) in enumerate(zip(t.shape, t.stride())):
        view.shape[i], view.strides[i] = size, stride
    return view


def per_call_us(cases, calls, rounds=7):
    """{name: us per call} for {name: fn}: each round times `calls` calls of every case in turn, and a case's
    figure is the median over the rounds of its mean per call. Interleaving keeps a drift in the machine's
    load (other processes on the cores) out of the ratios between cases."""
    for fn in cases.values():
        fn()
    means = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            means[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(values) for name, values in means.items()}


DECODE_SHAPE = ("batch 1, 1 query token, cache of 16 keys (capacity 32), 8 query heads over 8 kv heads, "
                "head dim 64, fp32 on the CPU, one thread")


class _Module:
    """What transformers' attention functions read from the attention module."""
    is_causal = True
    training = False
    layer_idx = 0


def decode_cases(lib):
    """One decode step through each layer (module docstring), all on the same tensors."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flare import flash_attn_with_kvcache
    from flare.integrations.transformers import flare_attention_forward

    batch, heads, heads_k, dim, used, capacity = 1, 8, 8, 64, 16, 32
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, heads, dim, generator=gen)
    k_cache = torch.randn(batch, capacity, heads_k, dim, generator=gen)
    v_cache = torch.randn(batch, capacity, heads_k, dim, generator=gen)
    k_new = torch.randn(batch, 1, heads_k, dim, generator=gen)
    v_new = torch.randn(batch, 1, heads_k, dim, generator=gen)
    seqlens = torch.full((batch,), used, dtype=torch.int32)
    # What a model holds: (batch, heads, seqlen, dim), the cache's first used + 1 keys.
    query = q.transpose(1, 2)
    key, value = (c[:, :used + 1].transpose(1, 2) for c in (k_cache, v_cache))
    position_ids = torch.tensor([[used]])
    scale = dim ** -0.5

    params = lib.kvcache_params()
    tv = _capi.tensor_view
    out = torch.empty_like(q)
    params.q, params.k_cache, params.v_cache, params.cache_seqlens = tv(q), tv(k_cache), tv(v_cache), tv(seqlens)
    params.out = tv(out)
    op_args = (q, k_cache, v_cache, None, None, seqlens, None, None, None, None, None, True, 0, None, 0.0, True,
               -1, -1, 0.0)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key[:, :, :used], value[:, :, :used])
    got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    assert torch.allclose(got.transpose(1, 2), expected, atol=1e-5), "flare and sdpa disagree"
    return {
        "c_kvcache": lambda keep=(q, k_cache, v_cache, seqlens, out): lib.fwd_kvcache(params),  # views into keep
        "op_kvcache": lambda: ops.fwd_kvcache(*op_args),
        "flash_attn_with_kvcache": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                                   causal=True),
        "flash_attn_with_kvcache_append": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                                                          cache_seqlens=seqlens, causal=True),
        "transformers_flare": lambda: flare_attention_forward(_Module, query, key, value, None, scaling=scale,
                                                              position_ids=position_ids),
        "transformers_sdpa": lambda: sdpa_attention_forward(_Module, query, key, value, None, scaling=scale,
                                                            position_ids=position_ids),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scale),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    q = torch.randn(1, 8, 2, 16)
    out, lse = ops.fwd_eager(q, q, q, None, None, None, 0, 0, None, 0.0, False, -1, -1, 0.0, False)
    fwd_args = (q, q, q, None, None, None, 0, 0, None, 0.0, False, -1, -1, 0.0, False)
    bwd_args = (q, q, q, q, out, lse, None, None, None, 0, 0, None, 0.0, False, -1, -1, 0.0, False)
    assert bytes(_capi.tensor_view(q)) == bytes(tensor_view_by_field(q)), "the two views differ"
    lib = _capi.library()
    params = lib.fwd_params()
    tv = _capi.tensor_view
    params.q, params.k, params.v, params.out, params.softmax_lse = tv(q), tv(q), tv(q), tv(out), tv(lse)
    cases = {
        "tensor_view": lambda: _capi.tensor_view(q),
        "tensor_view_by_field": lambda: tensor_view_by_field(q),
        "op_fwd": lambda: ops.fwd(*fwd_args),
        "eager_fwd": lambda: ops.fwd_eager(*fwd_args),
        "op_bwd": lambda: ops.bwd(*bwd_args),
        "eager_bwd": lambda: ops.bwd_eager(*bwd_args),
        "c_fwd": lambda: lib.fwd(params),
    }
    rows = []
    for name, us in per_call_us(cases, args.calls).items():
        rows.append({"what": name, "us_per_call": us})
        print(f"{name:30s} {us:8.1f} us")
    times = per_call_us(decode_cases(lib), args.calls)
    for name, us in times.items():
        rows.append({"what": name, "group": "decode-step", "us_per_call": us, "vs_sdpa": us / times["sdpa"]})
        print(f"{name:30s} {us:8.1f} us  {us / times['sdpa']:5.2f}x sdpa")
    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), "cpu": run_meta.cpu_description(),
            "flare_cpu_isa": lib.cpu_isa(),
            "shapes": "q = k = v (1, 8, 2, 16) fp32 on the CPU, one thread; decode rows: " + DECODE_SHAPE,
            "pointer_bytes": ctypes.sizeof(ctypes.c_void_p)}
    path = run_meta.write_result(run_meta.default_result_path(args.out, "host-cost"), {"meta": meta, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
