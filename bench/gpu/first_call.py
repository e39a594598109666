#!/usr/bin/env python3
"""First-call cost on the GPU: how long the first attention forward takes in a fresh process, flare against
torch's FLASH_ATTENTION (FA2) and CUDNN_ATTENTION backends, and what part of it is module loading.

Each measurement is its own fresh Python process (the parent only starts them and collects their JSON): it
imports torch, creates the CUDA context and the inputs (bf16, batch 1 x 1024 x 16 heads x 128, causal), then
times, each ended by a device synchronise:
  import_s   importing the implementation (flare: the package and its libflare.so; torch's: nothing new)
  first_s    the first forward call (module loading, the kernel's first launch, any lazy set-up)
  second_s   the second call, and steady_s the median of 20 more (the work itself)
Every implementation runs --repeats times, interleaved, and the rows carry the medians. The figure of merit:
flare's first_s over FA2's (the goal is <= 1.2).

  python3 bench/gpu/first_call.py --out $OUT     -> gpu-first-call-<date>-<sha>.json
  python3 bench/gpu/first_call.py --device cpu   the same on the CPU backend (a check of the script)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
IMPLS = ["flare", "flare-sm80", "torch-flash", "torch-cudnn"]
SHAPE = {"batch": 1, "seqlen": 1024, "nheads": 16, "headdim": 128}


def child(impl, device):
    """One fresh-process measurement; prints one JSON line."""
    start = time.perf_counter()
    import torch
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.init()
    b, s, h, d = SHAPE["batch"], SHAPE["seqlen"], SHAPE["nheads"], SHAPE["headdim"]
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16) for _ in range(3))
    sync()
    context_s = time.perf_counter() - start

    t0 = time.perf_counter()
    if impl.startswith("flare"):
        sys.path.insert(0, str(REPO / "python"))
        import flare
        path = "sm80" if impl == "flare-sm80" else "auto"
        extra = {"arch_path": path} if device == "cuda" else {}

        def call():
            return flare.flash_attn_func(q, k, v, causal=True, **extra)
    else:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    sync()
    import_s = time.perf_counter() - t0

    def timed():
        t = time.perf_counter()
        call()
        sync()
        return time.perf_counter() - t

    first_s = timed()
    second_s = timed()
    steady_s = statistics.median(timed() for _ in range(20))
    print(json.dumps({"impl": impl, "context_s": context_s, "import_s": import_s, "first_s": first_s,
                      "second_s": second_s, "steady_s": steady_s}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for the result JSON (default bench/results)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS)
    p.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.device)
        return 0

    sys.path[:0] = [str(REPO / "bench"), str(REPO / "python")]
    import meta as run_meta
    import torch
    run_meta.prefer_cuda_build()
    impls = args.impls if args.device == "cuda" else [i for i in args.impls if i == "flare"]
    samples = {impl: [] for impl in impls}
    for rep in range(args.repeats):
        for impl in impls:  # interleaved, so a drift in the machine falls on every implementation alike
            proc = subprocess.run([sys.executable, __file__, "--child", impl, "--device", args.device],
                                  capture_output=True, text=True, env=os.environ.copy(), timeout=300)
            if proc.returncode != 0:
                print(f"{impl}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                samples[impl].append({"error": proc.stderr.strip().splitlines()[-1][:400] if proc.stderr else "?"})
                continue
            sample = json.loads(proc.stdout.strip().splitlines()[-1])
            samples[impl].append(sample)
            print(f"repeat {rep}  {impl:<12} context {sample['context_s']:.3f} s  import {sample['import_s']:.3f} s  "
                  f"first {sample['first_s'] * 1e3:8.1f} ms  second {sample['second_s'] * 1e3:7.2f} ms  "
                  f"steady {sample['steady_s'] * 1e3:7.3f} ms", flush=True)
    rows = []
    for impl, got in samples.items():
        ok = [s for s in got if "error" in s] == [] and got
        row = {"pass": "fwd", "impl": impl, "dtype": "bf16", "batch": SHAPE["batch"], "seqlen_q": SHAPE["seqlen"],
               "seqlen_k": SHAPE["seqlen"], "nheads": SHAPE["nheads"], "nheads_k": SHAPE["nheads"],
               "headdim": SHAPE["headdim"], "causal": True, "samples": got}
        if ok:
            for field in ("context_s", "import_s", "first_s", "second_s", "steady_s"):
                row[field] = round(statistics.median(s[field] for s in got), 6)
            row["ms"] = round(row["steady_s"] * 1e3, 5)
        rows.append(row)
    by = {r["impl"]: r for r in rows if "first_s" in r}
    for r in rows:
        if "first_s" in r and "torch-flash" in by:
            r["first_vs_fa2"] = round(r["first_s"] / by["torch-flash"]["first_s"], 3)
    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta(),
            "repeats": args.repeats, "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "(unset)")}
    out_dir = args.out or REPO / "bench" / "results"
    topic = "gpu-first-call" if args.device == "cuda" else "cpu-first-call-check"
    path = run_meta.write_result(run_meta.default_result_path(out_dir, topic), {"meta": meta, "rows": rows})
    for r in rows:
        if "first_s" in r:
            print(f"{r['impl']:<12} first {r['first_s'] * 1e3:8.1f} ms (x{r.get('first_vs_fa2', float('nan')):.2f} FA2's)"
                  f"  import {r['import_s']:.3f} s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
