#!/usr/bin/env python3
"""TFLOP/s against sequence length from a bench_gpu.py result (bench/results/gpu-fwd-bwd-<date>-<sha>.json):
one row of subplots per head dim, columns forward / backward x not causal / causal, one line per
implementation (flare and its peers), the run's bf16 matmul ceiling as a dashed line.

  python3 bench/gpu/plot.py RESULT.json                                           -> RESULT.png
  python3 bench/gpu/plot.py RESULT.json -o docs/img/<the result's name>.png      (a plot a doc shows)

Needs matplotlib (on the GPU machine it is installed; elsewhere plot from the committed JSON with a Python
that has it, e.g. python3 -m venv --system-site-packages build/plot-venv && build/plot-venv/bin/pip install
matplotlib). Not a test requirement.
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

STYLE = {  # impl -> (label, color, marker)
    "flare": ("flare", "#d62728", "o"),
    "torch-flash": ("FA2 (torch flash)", "#1f77b4", "s"),
    "torch-cudnn": ("cuDNN (torch)", "#2ca02c", "^"),
    "torch-efficient": ("efficient (torch)", "#7f7f7f", "v"),
}


def series(rows):
    """(pass, headdim, causal) -> impl -> [(seqlen, tflops)], timing rows only."""
    out = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if "peak_mib" in r or not r.get("tflops"):
            continue
        out[(r["pass"], r["headdim"], r["causal"])][r["impl"]].append((r["seqlen_q"], r["tflops"]))
    for impls in out.values():
        for points in impls.values():
            points.sort()
    return out


def plot(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, meta = data["rows"], data["meta"]
    lines = series(rows)
    headdims = sorted({key[1] for key in lines})
    columns = [(p, c) for p in ("fwd", "bwd") for c in (False, True) if any((p, d, c) in lines for d in headdims)]
    if not headdims or not columns:
        raise SystemExit("plot.py: no timing rows in the result")
    fig, axes = plt.subplots(len(headdims), len(columns), figsize=(4.2 * len(columns), 3.3 * len(headdims)),
                             squeeze=False, sharex=True)
    ceiling = (meta.get("ceilings") or {}).get("matmul_bf16_tflops")
    seqlens = sorted({x for impls in lines.values() for points in impls.values() for x, _ in points})
    for i, hd in enumerate(headdims):
        for j, (pass_, causal) in enumerate(columns):
            ax = axes[i][j]
            for impl, points in sorted(lines.get((pass_, hd, causal), {}).items(),
                                       key=lambda kv: list(STYLE).index(kv[0]) if kv[0] in STYLE else 99):
                label, color, marker = STYLE.get(impl, (impl, None, "x"))
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker=marker, color=color, label=label, linewidth=2 if impl == "flare" else 1.2)
            if ceiling:
                ax.axhline(ceiling, color="black", linestyle="--", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [f"{n // 1024}K" if n >= 1024 else str(n) for n in seqlens])
            ax.minorticks_off()
            ax.set_title(f"{'forward' if pass_ == 'fwd' else 'backward'}, hd {hd}, "
                         f"{'causal' if causal else 'not causal'}", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
            if i == len(headdims) - 1:
                ax.set_xlabel("sequence length")
            if j == 0:
                ax.set_ylabel("TFLOP/s")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
    dirty = " (+ local changes)" if meta.get("dirty") else ""
    fig.suptitle(f"{meta.get('device', '?')}, {meta.get('shapes', '')}; {meta.get('date', '?')} @ "
                 f"{str(meta.get('commit', '?'))[:10]}{dirty}; dashed: matmul ceiling {ceiling} TFLOP/s",
                 fontsize=9, y=0.955)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="a bench_gpu.py result JSON")
    p.add_argument("-o", "--output", type=Path, help="PNG path (default: the result's path with .png)")
    args = p.parse_args()
    with open(args.result) as f:
        data = json.load(f)
    try:
        plot(data, args.output or args.result.with_suffix(".png"))
    except ImportError:
        sys.exit("plot.py: matplotlib is not installed for this Python (see the module docstring)")


if __name__ == "__main__":
    main()
