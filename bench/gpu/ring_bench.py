#!/usr/bin/env python3
"""Ring attention across GPUs: one process per GPU over NCCL, against flare on one GPU.

For a global sequence of N tokens (batch 1, bf16, head dim 128, 16 heads: model width 2048) split over the
W GPUs (causal: zigzag; full: contiguous), every rank times, in step with the others:
  total    ring_attention with its transport (K/V, and dK/dV in the backward, sent around the ring);
  compute  the same calls with a transport that hands each block back unchanged (ring_compute.NullRing),
           so the difference is the communication the compute did not hide.
Rank 0 also times flare on all N tokens alone (the 1-GPU reference; skipped, with a note, where it would
not fit in memory). Each time is the slowest rank's (a ring step waits for it), the median of `reps` runs
after one warm-up, every run between barriers. Rows (BENCH.md's fields plus): gpus, tokens_per_s (N /
total), efficiency (T(1 GPU) / (W x total)), compute_ms, exposed_comm (1 - compute / total).
Passes: fwd, and fwd+bwd (one forward and its backward).

  python3 bench/gpu/ring_bench.py --out $OUT                      every GPU of the machine, N 32K..1M
  python3 bench/gpu/ring_bench.py --device cpu --gpus 2 --totals 2048 --headdim 32 --heads 2
                                                                  no GPU: gloo processes on the CPU backend
                                                                  (a check of the script, not a benchmark)
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python"))

from flops import attention_flops  # noqa: E402
import meta as run_meta  # noqa: E402
from ring_compute import NullRing, add_shape_args, passes, sync, time_ms  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=0, help="processes / GPUs (default: every GPU of the machine)")
    p.add_argument("--totals", type=int, nargs="+", default=[32768, 65536, 131072, 262144, 524288, 1048576],
                   help="global sequence lengths N")
    p.add_argument("--single-max", type=int, default=524288,
                   help="longest N timed on one GPU for the reference (its time grows as N^2)")
    add_shape_args(p)
    return p.parse_args(argv)


def timed(fn, reps, device, dev):
    """Median over reps of the slowest rank's wall time of fn() in ms, each run between barriers. dev: where
    the collectives' tensors live (NCCL takes CUDA tensors only)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        ms = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=dev)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        times.append(ms.item())
    return statistics.median(times)


def worker(rank, world, store, args, result_path):
    import flare.distributed.ring as ring_module
    from flare.distributed.comm import Ring
    from flare.flash_attn_interface import flash_attn_func

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600), device_id=torch.device("cuda", rank))
        dev = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        dev = torch.device("cpu")
    backend = "nccl" if device == "cuda" else "gloo"
    rows, notes, started = [], [], time.monotonic()
    try:
        for causal in (bool(c) for c in args.causals):
            for total in args.totals:
                go = torch.tensor([time.monotonic() - started < args.budget_s], dtype=torch.int32, device=dev)
                dist.broadcast(go, 0)  # every rank stops at the same shape
                if not go.item():
                    notes.append(f"budget spent: N={total} causal={causal} not run")
                    continue
                if total % (2 * world):
                    notes.append(f"N={total} does not split into {2 * world} chunks: not run")
                    continue
                local = total // world
                torch.manual_seed(rank)
                q, k, v = (torch.randn(1, local, args.heads, args.headdim, device=dev, dtype=torch.bfloat16)
                           for _ in range(3))
                attend = lambda a, b, c: ring_module.ring_attention(a, b, c, causal=causal, zigzag=causal)  # noqa
                total_ms = {p: timed(fn, args.reps, device, dev) for p, fn in passes(attend, q, k, v).items()}
                ring_module.Ring = lambda group=None: NullRing(world, rank, backend)
                try:
                    compute_ms = {p: timed(fn, args.reps, device, dev) for p, fn in passes(attend, q, k, v).items()}
                finally:
                    ring_module.Ring = Ring
                del q, k, v
                single_ms = {}
                if total <= args.single_max:
                    if rank == 0:
                        qs, ks, vs = (torch.randn(1, total, args.heads, args.headdim, device=dev,
                                                  dtype=torch.bfloat16) for _ in range(3))
                        alone = passes(lambda a, b, c: flash_attn_func(a, b, c, causal=causal), qs, ks, vs)
                        single_ms = {p: time_ms(fn, args.reps, device) for p, fn in alone.items()}
                        del qs, ks, vs
                    dist.barrier()
                if device == "cuda":
                    torch.cuda.empty_cache()
                flops = {p: attention_flops(p, 1, args.heads, total, total, args.headdim, causal)
                         for p in ("fwd", "bwd")}
                flops["fwd+bwd"] = flops["fwd"] + flops.pop("bwd")
                for p in ("fwd", "fwd+bwd"):
                    base = {"pass": p, "dtype": "bf16", "batch": 1, "seqlen_q": total, "seqlen_k": total,
                            "nheads": args.heads, "nheads_k": args.heads, "headdim": args.headdim,
                            "causal": causal}
                    if p in single_ms:
                        rows.append({**base, "impl": "flare", "gpus": 1, "ms": single_ms[p],
                                     "tflops": flops[p] / single_ms[p] / 1e9,
                                     "tokens_per_s": total / single_ms[p] * 1e3})
                    ms = total_ms[p]
                    row = {**base, "impl": "flare-ring", "gpus": world, "ms": ms, "tflops": flops[p] / ms / 1e9,
                           "tokens_per_s": total / ms * 1e3, "compute_ms": compute_ms[p],
                           "exposed_comm": max(0.0, 1.0 - compute_ms[p] / ms)}
                    if p in single_ms:
                        row["efficiency"] = single_ms[p] / (world * ms)
                    rows.append(row)
                if rank == 0:
                    eff = " / ".join(f"{r['efficiency']:.3f}" if "efficiency" in r else "-"
                                     for r in rows[-4:] if r["impl"] == "flare-ring")
                    print(f"N={total} {'causal' if causal else 'full'} W={world}: fwd {total_ms['fwd']:.1f} ms "
                          f"(compute {compute_ms['fwd']:.1f}), fwd+bwd {total_ms['fwd+bwd']:.1f} ms (compute "
                          f"{compute_ms['fwd+bwd']:.1f}); efficiency fwd / fwd+bwd {eff}", flush=True)
    finally:
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"rows": rows, "notes": notes}, f)
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    run_meta.prefer_cuda_build()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("ring_bench: no CUDA device (use --device cpu to check the script)")
    world = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and world > torch.cuda.device_count():
        sys.exit(f"ring_bench: --gpus {world}, but the machine has {torch.cuda.device_count()} GPUs")
    if world < 2:
        sys.exit("ring_bench: a ring needs 2 or more processes (on one GPU, bench/gpu/ring_compute.py times "
                 "each rank's compute)")
    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta(), "gpus": world,
            "shapes": f"batch 1, {args.heads} heads, head dim {args.headdim}, bf16; global seqlen N split over "
                      "the GPUs (causal: zigzag; full: contiguous)",
            "timing": f"slowest rank's wall time between barriers, median of {args.reps} after one warm-up; "
                      "compute_ms: the same calls without the transport (NullRing)"}
    if args.device == "cpu":
        meta["device"] = "cpu, gloo (a check of the script, not a benchmark)"
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "rows.json")
        mp.spawn(worker, args=(world, os.path.join(d, "store"), args, result), nprocs=world)
        with open(result) as f:
            body = json.load(f)
    out_dir = args.out or (REPO / "bench" / "results")
    topic = "ring" + ("-cpu-check" if args.device == "cpu" else "")
    path = run_meta.write_result(run_meta.default_result_path(out_dir, topic),
                                 {"meta": {**meta, "notes": body["notes"]}, "rows": body["rows"]})
    print(f"wrote {path} ({len(body['rows'])} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
