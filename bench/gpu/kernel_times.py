#!/usr/bin/env python3
"""Per-kernel GPU times of one attention call, from torch.profiler: which passes a forward or backward runs
and what each costs, for flare and torch SDPA's backends (torch-flash = FA2 by default) on the BENCH.md
shapes (16384 tokens, width 2048, bf16), with bench_gpu.py's inputs and runners (each backend's memory
order, TORCH_LAYOUT; the backward as the gradient of one recorded forward, dout in the output's order).
Complements the variants tool (tools/cuda_variants.cu), which times flare's passes alone.

  python3 bench/gpu/kernel_times.py --impl torch-flash --pass bwd --headdim 64 --seqlen 512 1024
  python3 bench/gpu/kernel_times.py --impl flare torch-flash --json out.json

Each (impl, pass, shape) runs 3 warm-up calls, then REPS profiled calls; a kernel's time is the mean over the
profiled calls of its summed device time per call (kernels and memsets alike).
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meta  # noqa: E402
# The benchmark's own inputs and runners: the same memory orders (TORCH_LAYOUT) and dout handling.
from bench_gpu import (MODEL_WIDTH, TORCH_LAYOUT, TOTAL_TOKENS, Autograd, flare_autograd, sdpa,  # noqa: E402
                       sdpa_backends, torch_inputs)


def kernel_times(impl, pass_, headdim, seqlen, causal, reps):
    batch, heads = TOTAL_TOKENS // seqlen, MODEL_WIDTH // headdim
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, headdim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    if impl == "flare":
        runner = Autograd(flare_autograd(causal), q, k, v, dout)
    else:
        runner = Autograd(sdpa(sdpa_backends()[impl], causal), *torch_inputs(impl, q, k, v, dout))
    call = runner.fwd if pass_ == "fwd" else runner.bwd
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time / reps  # microseconds
    return {"impl": impl, "pass": pass_, "dtype": "bf16", "batch": batch, "seqlen_q": seqlen, "seqlen_k": seqlen,
            "nheads": heads, "nheads_k": heads, "headdim": headdim, "causal": causal,
            "kernels_us": {name: round(us, 2) for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])},
            "total_us": round(sum(per_kernel.values()), 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", nargs="+", choices=["flare"] + sorted(TORCH_LAYOUT), default=["flare", "torch-flash"])
    ap.add_argument("--pass", dest="pass_", nargs="+", choices=["fwd", "bwd"], default=["bwd"])
    ap.add_argument("--headdim", type=int, nargs="+", default=[64])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="no")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="also write the rows here, with the run's meta (BENCH.md)")
    args = ap.parse_args()
    for s in args.seqlen:
        if s <= 0 or TOTAL_TOKENS % s:
            ap.error(f"seqlen {s} must divide {TOTAL_TOKENS}")
    for d in args.headdim:
        if d <= 0 or MODEL_WIDTH % d:
            ap.error(f"headdim {d} must divide {MODEL_WIDTH}")
    if not torch.cuda.is_available():
        sys.exit("kernel_times.py: no CUDA device")
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = []
    for pass_ in args.pass_:
        for d in args.headdim:
            for causal in causals:
                for s in args.seqlen:
                    for impl in args.impl:
                        r = kernel_times(impl, pass_, d, s, causal, args.reps)
                        rows.append(r)
                        print(f"{impl:12s} {pass_} hd {d:3d} seqlen {s:5d} {'causal' if causal else 'full':6s} "
                              f"total {r['total_us']:8.1f} us")
                        for name, us in r["kernels_us"].items():
                            print(f"    {us:8.1f} us  {name[:110]}")
    if args.json:
        doc_meta = {**meta.provenance(__file__), **meta.device_meta(torch),
                    "timing": f"torch.profiler device time per kernel, mean of {args.reps} calls after 3 warm-up"}
        if "flare" in args.impl:
            doc_meta.update(meta.flare_meta())
        meta.write_result(args.json, {"meta": doc_meta, "rows": rows})


if __name__ == "__main__":
    main()
