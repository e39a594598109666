#!/usr/bin/env python3
"""Two builds of libflare.so side by side on the CPU: forward and backward at bench_cpu.py's race shapes
(batch 60 x 4 heads x head dim 64, non-causal), each pair timed interleaved (a, b, a, b, ...; median of
--runs), and whether the two builds' outputs are bitwise equal. Topic cpu-ab.

--decode instead: the KV-cache decode step of bench_decode.py (1 query token, 32 q heads over 8 kv heads, head
dim 128, dense full cache) at batch 1 over 1K keys with one copy of the cache (it stays in the last-level
cache: the pass's arithmetic rate), and batch 1 / 4 over 8K and 32K keys reading the next of copies that add up
to at least 1 GiB (memory); GB/s of cache read, and the largest difference between the two builds' outputs.

--features instead: bench_features.py's shape (8192 tokens, seqlen 2048, width 1024), forward and backward
without the features, full and causal: fp32 and bf16 at head dim 128, bf16 at 256 and 512 (the rows its
ratios are taken against).

  python3 bench/cpu/ab_libs.py OLD.so NEW.so --out bench/results/cpu-ab-<date>-<sha>.json
  python3 bench/cpu/ab_libs.py OLD.so NEW.so --decode --dtypes bf16 --runs 40 --out ...
  python3 bench/cpu/ab_libs.py OLD.so NEW.so --features --runs 5 --out ...
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "python")]

import meta  # noqa: E402
import bench_decode  # noqa: E402
import bench_features  # noqa: E402
from bench_cpu import RACE_BATCH, RACE_HEADDIM, RACE_HEADS, RACE_SEQLENS, FlareRunner  # noqa: E402
from flare._capi import Flare  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_DTYPES = ["fp32", "fp16"]  # the race and decode rows' dtypes without --dtypes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES),
                    help="dtypes to time (default: fp32 fp16; with --features, each of its shapes' dtypes)")
    ap.add_argument("--decode", action="store_true", help="decode steps instead of the race shapes")
    ap.add_argument("--features", action="store_true", help="bench_features.py's shapes instead of the race shapes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = [Flare(args.old), Flare(args.new)]
    gen = torch.Generator().manual_seed(0)
    if args.decode:
        rows = decode_rows(libs, args, gen)
    elif args.features:
        rows = feature_rows(libs, args, gen)
    else:
        rows = race_rows(libs, args, gen)
    doc = {"meta": {**meta.provenance(__file__), "device": meta.cpu_description(), "threads": args.threads,
                    "libs": {"old": str(args.old), "new": str(args.new)}, "runs": args.runs},
           "rows": rows}
    meta.write_result(args.out, doc)
    print(f"wrote {args.out}")


# (batch, keys, MiB the cache copies add up to at least; 0: one copy)
DECODE_SHAPES = [(1, 1024, 0), (1, 8192, 1024), (1, 32768, 1024), (4, 8192, 1024)]


def decode_rows(libs, args, gen):
    rows = []
    for dtype_name in args.dtypes or DEFAULT_DTYPES:
        dtype = DTYPES[dtype_name]
        for batch, keys, rotate_mib in DECODE_SHAPES:
            nbytes = bench_decode.kv_bytes(batch, keys, dtype)
            copies = max(1, -(-rotate_mib * 2 ** 20 // nbytes))
            q = torch.randn(batch, 1, bench_decode.NHEADS, bench_decode.HEADDIM, generator=gen).to(dtype)
            caches = [tuple(torch.randn(batch, keys, bench_decode.NHEADS_K, bench_decode.HEADDIM,
                                        generator=gen).to(dtype) for _ in range(2)) for _ in range(copies)]
            runners = [bench_decode.FlareDecode(lib, q, caches, args.threads, 0) for lib in libs]
            for r in runners:
                r()
            diff = (runners[0].out.float() - runners[1].out.float()).abs().max().item()
            times = [[], []]
            for _ in range(args.runs):
                for i, r in enumerate(runners):
                    t0 = time.perf_counter()
                    r()
                    times[i].append((time.perf_counter() - t0) * 1e3)
            old_ms, new_ms = (statistics.median(t) for t in times)
            rows.append({"pass": "decode", "dtype": dtype_name, "batch": batch, "seqlen_q": 1, "seqlen_k": keys,
                         "nheads": bench_decode.NHEADS, "nheads_k": bench_decode.NHEADS_K,
                         "headdim": bench_decode.HEADDIM, "cache_copies": copies,
                         "old_ms": round(old_ms, 4), "new_ms": round(new_ms, 4),
                         "old_gbps": round(nbytes / old_ms * 1e-6, 2), "new_gbps": round(nbytes / new_ms * 1e-6, 2),
                         "speedup": round(old_ms / new_ms, 3), "max_abs_diff": float(f"{diff:.3e}")})
            print(f"decode {dtype_name} batch {batch} x {keys} keys ({copies} copies): old {old_ms:.3f} new "
                  f"{new_ms:.3f} ms  x{old_ms / new_ms:.2f}  max diff {diff:.2e}", flush=True)
    return rows


# (dtype, head dim) of the --features rows; each runs forward and backward, full and causal.
FEATURE_SHAPES = [("fp32", 128), ("bf16", 128), ("bf16", 256), ("bf16", 512)]


def feature_rows(libs, args, gen):
    rows = []
    for dtype_name, headdim in FEATURE_SHAPES:
        if args.dtypes and dtype_name not in args.dtypes:
            continue
        batch, heads = bench_features.TOKENS // bench_features.SEQLEN, bench_features.WIDTH // headdim
        make = lambda: torch.randn(batch, bench_features.SEQLEN, heads, headdim, generator=gen).to(DTYPES[dtype_name])  # noqa: E731
        q, k, v, dout = make(), make(), make(), make()
        for causal in (False, True):
            runners = [FlareRunner(lib, q, k, v, dout, causal, args.threads) for lib in libs]
            rows += timed_passes(runners, args, {"dtype": dtype_name, "batch": batch, "nheads": heads,
                                                 "headdim": headdim, "seqlen_q": bench_features.SEQLEN,
                                                 "seqlen_k": bench_features.SEQLEN, "causal": causal})
    return rows


def timed_passes(runners, args, shape):
    """Forward then backward of two FlareRunners, interleaved: a row each with both medians and whether the
    outputs are bitwise equal."""
    rows = []
    for pass_ in ("fwd", "bwd"):
        for r in runners:
            r.fwd()
            r.bwd()
        # Alternating order: each call allocates its outputs, and the allocator can hand one library recycled
        # pages and the other fresh ones round after round (seen as a steady 0.6-0.85x on one row that
        # interleaved single-library timings put level).
        old_ms, new_ms, _ = bench_features.interleaved_ms(*(getattr(r, pass_) for r in runners), args.runs,
                                                          warm_up=False)
        outs = [(r.out,) if pass_ == "fwd" else (r.dq, r.dk, r.dv) for r in runners]
        equal = all(torch.equal(a, b) for a, b in zip(*outs))
        rows.append({"pass": pass_, **shape, "old_ms": round(old_ms, 4), "new_ms": round(new_ms, 4),
                     "speedup": round(old_ms / new_ms, 3), "bitwise_equal": equal})
        print(f"{pass_} {shape['dtype']} {shape['seqlen_q']}x{shape['seqlen_k']} hd{shape['headdim']}"
              f"{' causal' if shape['causal'] else ''}: old {old_ms:.2f} new {new_ms:.2f} ms"
              f"  x{old_ms / new_ms:.2f}  bitwise-equal {equal}", flush=True)
    return rows


def race_rows(libs, args, gen):
    rows = []
    for dtype_name in args.dtypes or DEFAULT_DTYPES:
        for sq, sk in RACE_SEQLENS:
            make = lambda s: torch.randn(RACE_BATCH, s, RACE_HEADS, RACE_HEADDIM, generator=gen).to(DTYPES[dtype_name])  # noqa: E731
            q, k, v, dout = make(sq), make(sk), make(sk), make(sq)
            runners = [FlareRunner(lib, q, k, v, dout, False, args.threads) for lib in libs]
            rows += timed_passes(runners, args, {"dtype": dtype_name, "batch": RACE_BATCH, "nheads": RACE_HEADS,
                                                 "headdim": RACE_HEADDIM, "seqlen_q": sq, "seqlen_k": sk,
                                                 "causal": False})
    return rows


if __name__ == "__main__":
    main()
