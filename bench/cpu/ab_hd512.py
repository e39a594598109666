#!/usr/bin/env python3
"""Several builds of libflare.so round-robin on bench_features.py's head dim 512 row: a pass at head dims 256
and 512 over the same width (8192 tokens, seqlen 2048, width 1024: 4 heads against 2), full and causal.

Each round every build runs head dim 256 and 512 back to back (their order alternating by round, the builds'
order rotating by one each round), so a phase of the host that slows a build's two calls alike cancels in
their ratio. Per build and mask: TFLOP/s at 512 over 256 as the median of its rounds' ratios with the
quartiles (bench_features.py's hd512 figure), the median times, and each head dim's speedup over the first
build as the median of the rounds' own ratios. Outputs are compared bitwise with the first build's. Topic
cpu-ab.

  python3 bench/cpu/ab_hd512.py base=OLD.so new=NEW.so --commit base=<sha> --commit new=<sha> \\
      --rounds 21 --out bench/results/cpu-ab-<date>-<sha>.json
  python3 bench/cpu/ab_hd512.py base=OLD.so new=NEW.so --dtypes fp32 bf16 --rounds 9 --out ...
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
import bench_features  # noqa: E402
from bench_cpu import FlareRunner  # noqa: E402
from flops import attention_flops  # noqa: E402
from flare._capi import Flare  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADDIMS = (256, 512)


def named(text, what):
    """NAME=VALUE -> (NAME, VALUE)."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{what} must be NAME=VALUE, got {text!r}")
    return name, value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", type=lambda t: named(t, "a build"),
                    help="NAME=PATH of a libflare.so; the first is the one the others are compared with")
    ap.add_argument("--commit", action="append", default=[], type=lambda t: named(t, "--commit"),
                    help="NAME=SHA: the commit a build was made from, recorded with its rows (repeatable)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    ap.add_argument("--tokens", type=int, default=bench_features.TOKENS, help="batch x seqlen (default %(default)s)")
    ap.add_argument("--seqlen", type=int, default=bench_features.SEQLEN)
    args = ap.parse_args(argv)
    names = [n for n, _ in args.builds]
    if len(set(names)) != len(names):
        ap.error(f"build names must differ: {names}")
    commits = dict(args.commit)
    if set(commits) - set(names):
        ap.error(f"--commit names no build: {sorted(set(commits) - set(names))}")
    if args.rounds < 2:
        ap.error(f"--rounds must be at least 2 (quartiles), got {args.rounds}")
    if args.tokens % args.seqlen:
        ap.error(f"--tokens ({args.tokens}) must be a multiple of --seqlen ({args.seqlen})")
    torch.set_num_threads(args.threads)
    libs = {n: Flare(Path(p)) for n, p in args.builds}
    rows = []
    for dtype_name in args.dtypes:
        for causal in (False, True):
            rows += timed_builds(libs, commits, dtype_name, causal, args)
    doc = {"meta": {**meta.provenance(__file__), "device": meta.cpu_description(), "threads": args.threads,
                    "builds": {n: {"path": p, "commit": commits.get(n)} for n, p in args.builds},
                    "rounds": args.rounds, "tokens": args.tokens, "seqlen": args.seqlen,
                    "width": bench_features.WIDTH},
           "rows": rows}
    meta.write_result(args.out, doc)
    print(f"wrote {args.out}")
    return args.out


def timed_builds(libs, commits, dtype_name, causal, args):
    """The rows of one dtype and mask: every build's rounds at both head dims."""
    names = list(libs)
    batch = args.tokens // args.seqlen
    runners = {}
    for d in HEADDIMS:
        g = torch.Generator().manual_seed(d)
        shape = (batch, args.seqlen, bench_features.WIDTH // d, d)
        q, k, v, dout = (torch.randn(shape, generator=g).to(DTYPES[dtype_name]) for _ in range(4))
        runners[d] = {n: FlareRunner(libs[n], q, k, v, dout, causal, args.threads) for n in names}
        for r in runners[d].values():
            r.fwd()
            r.bwd()
    times = {n: {d: [] for d in HEADDIMS} for n in names}
    for i in range(args.rounds):
        for n in names[i % len(names):] + names[:i % len(names)]:
            for d in (HEADDIMS if i % 2 == 0 else HEADDIMS[::-1]):
                call = getattr(runners[d][n], args.pass_)
                t0 = time.perf_counter()
                call()
                times[n][d].append((time.perf_counter() - t0) * 1e3)
    outputs = lambda r: (r.out,) if args.pass_ == "fwd" else (r.dq, r.dk, r.dv)  # noqa: E731
    flops = {d: attention_flops(args.pass_, batch, bench_features.WIDTH // d, args.seqlen, args.seqlen, d, causal)
             for d in HEADDIMS}
    first = names[0]
    rows = []
    for n in names:
        t = times[n]
        ratios = [flops[512] / flops[256] * a / b for a, b in zip(t[256], t[512])]
        ratio, q1, q3 = bench_features.ratio_summary(ratios)
        speedup = {d: statistics.median(f / x for f, x in zip(times[first][d], t[d])) for d in HEADDIMS}
        equal = all(all(torch.equal(a, b) for a, b in zip(outputs(runners[d][n]), outputs(runners[d][first])))
                    for d in HEADDIMS)
        row = {"pass": args.pass_, "dtype": dtype_name, "build": n, "commit": commits.get(n), "causal": causal,
               "batch": batch, "seqlen": args.seqlen, "tflops_ratio": round(ratio, 4), "ratio_q1": round(q1, 4),
               "ratio_q3": round(q3, 4), "ms_256": round(statistics.median(t[256]), 3),
               "ms_512": round(statistics.median(t[512]), 3), "speedup_256": round(speedup[256], 4),
               "speedup_512": round(speedup[512], 4), "bitwise_equal": equal}
        rows.append(row)
        print(f"{args.pass_} {dtype_name} {'causal' if causal else 'full':6} {n:10} TFLOP/s 512/256 {ratio:.3f} "
              f"({q1:.3f}-{q3:.3f})  ms {row['ms_256']:8.2f} {row['ms_512']:8.2f}  vs {first}: "
              f"x{speedup[256]:.3f} x{speedup[512]:.3f}  bitwise-equal {equal}", flush=True)
    return rows


if __name__ == "__main__":
    main()
