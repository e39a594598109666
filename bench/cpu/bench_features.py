#!/usr/bin/env python3
"""CPU cost of the training features: attention dropout and learnable sinks against the same call without
them, and the largest head dims against head dim 256, in one process.

Rows (topic cpu-features), per dtype (fp32, bf16), pass (fwd, bwd) and mask (full, causal):
  feature=dropout   dropout_p 0.1 against none: goal ratio <= 1.15 (issue: dropout costs <= 15%)
  feature=sinks     one sink per head against none: goal ratio <= 1.03
  feature=hd512     head dim 512 against 256 in TFLOP/s (FLOPs scale with the head dim): goal >= 0.90
                    (skipped, with the reason in the row, when the library does not take head dim 512)
Each pair runs interleaved, in alternating order (a b, b a, a b, ...: neither call always follows the other,
so the allocator's and the caches' state after one call does not favour the same side), so drifting clocks
and neighbours hit both alike. A row's ratio is the median of the rounds' ratios (each round's two calls ran
back to back, so a phase of the host that slows both cancels in their ratio), with its lower and upper quartile
(ratio_q1, ratio_q3) and the ratio of the two medians beside it (ratio_of_medians); the row also holds both
medians (base_ms, with_ms) and the median minor page faults of a call of each (base_faults, with_faults).
With --sweeps S the whole table runs S times, each pair taking its share of the --runs rounds in each sweep
(order alternating across sweeps too), and a row sums up all its rounds: a phase of the host that slows one
kind of call for a few seconds then touches a few of every row's rounds instead of all of one row's.
Shape: 8192 tokens (batch 8192 / seqlen), seqlen 2048, width 1024 at head dim 128 (8 heads; 4 at 256, 2 at
512), the convention of bench_cpu.py. Inputs fresh N(0, 1); flare is called
through flare.ops' eager functions (the host cost, ~50 us, is far below these runs).

  python3 bench/cpu/bench_features.py            # writes bench/results/cpu-features-<date>-<sha>.json
  python3 bench/cpu/bench_features.py --quick    # fewer runs, writes under build/bench/
  python3 bench/cpu/bench_features.py --runs 15  # more rounds per pair: a narrower median on a noisy host
  python3 bench/cpu/bench_features.py --runs 15 --sweeps 5  # those rounds spread over the run
"""

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))

import meta  # noqa: E402
from flops import attention_flops  # noqa: E402

from flare import ops  # noqa: E402

TOKENS = 8192
SEQLEN = 2048
WIDTH = 1024
GOALS = {"dropout": ("ratio", 1.15), "sinks": ("ratio", 1.03), "hd512": ("tflops_ratio", 0.90)}


def inputs(headdim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    batch, heads = TOKENS // SEQLEN, WIDTH // headdim
    make = lambda: torch.randn(batch, SEQLEN, heads, headdim, generator=g).to(dtype)  # noqa: E731
    return make(), make(), make(), make(), torch.randn(heads, generator=g)


def caller(pass_, q, k, v, dout, causal, sinks=None, dropout_p=0.0):
    """A no-argument function running one pass; the backward is fed its own forward's out and lse."""
    fwd_args = (None, None, None, 0, 0, None, 0.0, causal, -1, -1, 0.0, False, "auto", None, sinks, dropout_p, 7, 3)
    if pass_ == "fwd":
        return lambda: ops.fwd_eager(q, k, v, *fwd_args)
    out, lse = ops.fwd_eager(q, k, v, *fwd_args)
    return lambda: ops.bwd_eager(dout, q, k, v, out, lse, None, None, None, 0, 0, None, 0.0, causal, -1, -1, 0.0,
                                 False, dropout_p, 7, 3)


def interleaved_ms(a, b, runs, warm_up=True):
    """Timed rounds of a and b (after one warm-up of each, unless the caller warmed them), the order alternating
    (a b, b a, ...): the medians (ms) of a and of b, and each round's time of b over its time of a."""
    ta, tb, ratios = interleaved_rounds(a, b, runs, warm_up)
    return statistics.median(ta), statistics.median(tb), ratios


def interleaved_rounds(a, b, runs, warm_up=True, start=0):
    """interleaved_ms's rounds, every time (ms) of a and of b and each round's ratio; round i of a series that
    began `start` rounds earlier takes the order of round start + i."""
    if warm_up:
        a(), b()
    ta, tb = [], []
    for i in range(start, start + runs):
        order = ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta))
        for fn, times in order:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return ta, tb, [y / x for x, y in zip(ta, tb)]


class FaultCount:
    """fn, counting the minor page faults (this process, every thread) each call takes."""

    def __init__(self, fn):
        self.fn, self.faults = fn, []

    def __call__(self):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.fn()
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)


def sweep_rounds(runs, sweeps):
    """The rounds each of `sweeps` sweeps takes of `runs`: as even as they divide, the earlier sweeps one more."""
    return [runs // sweeps + (1 if s < runs % sweeps else 0) for s in range(sweeps)]


def ratio_summary(pair_ratios, scale=1.0):
    """The median of scale x each round's ratio, with its quartiles."""
    values = sorted(scale * r for r in pair_ratios)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return statistics.median(values), q1, q3


def pairs_of_the_table():
    """The table's pairs in order, each built when reached (inputs from fixed seeds: every sweep builds the same):
    ((feature, dtype, pass, causal), (base, with) callables or the reason the row is skipped)."""
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for pass_ in ("fwd", "bwd"):
            for causal in (False, True):
                q, k, v, dout, sinks = inputs(128, dtype, seed=1)
                yield ("dropout", dtype_name, pass_, causal), (
                    caller(pass_, q, k, v, dout, causal), caller(pass_, q, k, v, dout, causal, dropout_p=0.1))
                yield ("sinks", dtype_name, pass_, causal), (
                    caller(pass_, q, k, v, dout, causal), caller(pass_, q, k, v, dout, causal, sinks))
                # Head dim 512 against 256 at the same width (half the heads): TFLOP/s.
                q5, k5, v5, d5, _ = inputs(512, dtype, seed=3)
                try:
                    ops.fwd_eager(q5[:1, :8], k5[:1, :8], v5[:1, :8], None, None, None, 0, 0, None, 0.0, causal, -1,
                                  -1, 0.0, False)
                except Exception as e:  # the row records why, rather than a number
                    yield ("hd512", dtype_name, pass_, causal), f"{type(e).__name__}: {e}"
                    continue
                q2, k2, v2, d2, _ = inputs(256, dtype, seed=2)
                yield ("hd512", dtype_name, pass_, causal), (caller(pass_, q2, k2, v2, d2, causal),
                                                             caller(pass_, q5, k5, v5, d5, causal))


def summary_row(key, r):
    """The result row of one pair from all its rounds, and its line of the printed table."""
    feature, dtype_name, pass_, causal = key
    mask = "causal" if causal else "full"
    head = dict(feature=feature, dtype=dtype_name, pass_=pass_, causal=causal, seqlen=SEQLEN)
    if "skipped" in r:
        line = f"{feature:8} {dtype_name:5} {pass_:4} {mask:6} skipped: {r['skipped']}"
        return dict(head, skipped=r["skipped"]), line
    base_ms, with_ms = statistics.median(r["ta"]), statistics.median(r["tb"])
    faults = dict(base_faults=statistics.median(r["fa"]), with_faults=statistics.median(r["fb"]))
    if GOALS[feature][0] == "ratio":
        goal = GOALS[feature][1]
        ratio, q1, q3 = ratio_summary(r["ratios"])
        row = dict(head, headdim=128, base_ms=base_ms, with_ms=with_ms, ratio=ratio, ratio_q1=q1, ratio_q3=q3,
                   ratio_of_medians=with_ms / base_ms, **faults, goal=goal, meets_goal=ratio <= goal)
        return row, (f"{feature:8} {dtype_name:5} {pass_:4} {mask:6} {base_ms:9.2f} {with_ms:9.2f} {ratio:6.3f}"
                     f" {q1:5.3f}-{q3:5.3f}  <= {goal}")
    batch = TOKENS // SEQLEN
    flops = {d: attention_flops(pass_, batch, WIDTH // d, SEQLEN, SEQLEN, d, causal) for d in (256, 512)}
    tf = {d: flops[d] / (ms * 1e-3) / 1e12 for d, ms in ((256, base_ms), (512, with_ms))}
    # TFLOP/s at 512 over 256 in one round = (flops 512 / flops 256) / (its ms 512 / ms 256).
    ratio, q1, q3 = ratio_summary([1 / x for x in r["ratios"]], scale=flops[512] / flops[256])
    goal = GOALS["hd512"][1]
    row = dict(head, base_ms=base_ms, with_ms=with_ms, tflops_256=tf[256], tflops_512=tf[512], tflops_ratio=ratio,
               ratio_q1=q1, ratio_q3=q3, ratio_of_medians=tf[512] / tf[256], **faults, goal=goal,
               meets_goal=ratio >= goal)
    return row, (f"hd512    {dtype_name:5} {pass_:4} {mask:6} {base_ms:9.2f} {with_ms:9.2f} {ratio:6.3f}"
                 f" {q1:5.3f}-{q3:5.3f}  >= {goal} (TFLOP/s 512 / 256)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 runs per pair instead of 7")
    parser.add_argument("--runs", type=int, help="timed rounds per pair (default 7, 3 with --quick); more rounds "
                        "narrow the median's spread on a noisy host")
    parser.add_argument("--sweeps", type=int, default=1, help="run the table this many times, each pair taking its "
                        "share of the rounds in each (default 1): a noisy phase of the host then touches every row a "
                        "little rather than one row wholly")
    parser.add_argument("--out", help="the result file (default: bench/results, or build/bench with --quick)")
    args = parser.parse_args()
    runs = args.runs if args.runs is not None else 3 if args.quick else 7
    if runs < 1:
        parser.error(f"--runs must be at least 1, got {runs}")
    sweeps = args.sweeps
    if not 1 <= sweeps <= runs:
        parser.error(f"--sweeps must be between 1 and the rounds per pair ({runs}), got {sweeps}")
    # Per row: every round's times, ratios and faults so far.
    table = {}
    rows = []
    header = (f"{'feature':8} {'dtype':5} {'pass':4} {'mask':6} {'base ms':>9} {'with ms':>9} {'ratio':>6} "
              f"{'q1-q3':>11}  goal")
    done = 0
    for sweep, rounds in enumerate(sweep_rounds(runs, sweeps)):
        last = sweep == sweeps - 1
        if sweeps > 1:
            print(f"sweep {sweep + 1}/{sweeps}: {rounds} rounds per pair", flush=True)
        if last:
            print(header, flush=True)
        for key, pair in pairs_of_the_table():
            r = table.setdefault(key, {"ta": [], "tb": [], "ratios": [], "fa": [], "fb": []})
            if isinstance(pair, str):
                r["skipped"] = pair
            else:
                pair[0](), pair[1]()  # the warm-up, uncounted
                base, with_ = FaultCount(pair[0]), FaultCount(pair[1])
                ta, tb, ratios = interleaved_rounds(base, with_, rounds, warm_up=False, start=done)
                for name, values in (("ta", ta), ("tb", tb), ("ratios", ratios), ("fa", base.faults),
                                     ("fb", with_.faults)):
                    r[name] += values
            if last:
                row, line = summary_row(key, r)
                rows.append(row)
                print(line, flush=True)
        done += rounds
    for row in rows:  # "pass" in the file, as the other topics spell it
        row["pass"] = row.pop("pass_")
    # The processor's name last: device_meta's "device" says only that no GPU is present.
    doc = {"meta": {**meta.provenance(__file__), **meta.device_meta(torch), "device": meta.cpu_description(),
                    **meta.flare_meta(), "threads": torch.get_num_threads(), "runs_per_pair": runs, "sweeps": sweeps,
                    "tokens": TOKENS, "width": WIDTH},
           "rows": rows}
    out = args.out or meta.default_result_path(REPO / "build" / "bench" if args.quick else meta.RESULTS,
                                               "cpu-features", quick=args.quick)
    meta.write_result(out, doc)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
