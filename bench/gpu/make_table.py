#!/usr/bin/env python3
"""Markdown for docs/performance.md from a bench_gpu.py result (bench/results/gpu-fwd-bwd-<date>-<sha>.json).

  python3 bench/gpu/make_table.py bench/results/gpu-fwd-bwd-2026-12-04-42d0449.json >> docs/performance.md

Prints: where the figures come from (date, commit, device, ceilings, command, how they were timed); one
table per pass (forward, backward) with a line per head dim, causal and seqlen: TFLOP/s of flare, FA2 (torch
flash), cuDNN and efficient, flare/FA2 and flare/cuDNN (> 1: flare faster), and flare's share of the matmul
ceiling; the count of rows at or above 1.0x FA2 (the issue's goal) and the worst; the memory table; and any
rows that failed the accuracy check or that a peer refused.
"""

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from meta import ceiling_gflops  # noqa: E402
from table import fmt, markdown, measured_line, print_tables  # noqa: E402

PEERS = [("torch-flash", "FA2"), ("torch-cudnn", "cuDNN"), ("torch-efficient", "efficient")]


def is_memory_row(row):
    return "peak_mib" in row or "memory" in row


def source_line(meta, result):
    c = meta.get("ceilings") or {}
    text = measured_line(meta, f" (driver {meta.get('driver', '?')}), torch {meta.get('torch', '?')}, "
                               f"CUDA {meta.get('cuda', '?')}, cuDNN {meta.get('cudnn', '?')}", result)
    if c:
        text += (f" Ceilings of the run: copy {c.get('copy_tbps', '?')} TB/s, bf16 matmul "
                 f"{c.get('matmul_bf16_tflops', '?')} TFLOP/s.")
    for key in ("shapes", "layouts", "timing", "flare_via"):
        if meta.get(key):
            text += f" {key.replace('_', ' ').capitalize()}: {meta[key]}."
    if meta.get("dry_run"):
        text = "**DRY RUN: synthetic numbers, not a measurement.** " + text
    return text


def timing_tables(rows, ceiling):
    groups = defaultdict(dict)
    for r in rows:
        if not is_memory_row(r):
            groups[(r["pass"], r["headdim"], r["causal"], r["seqlen_q"], r["batch"], r["nheads"])][r["impl"]] = r
    out, ratios = [], []
    for pass_, title in (("fwd", "Forward"), ("bwd", "Backward (2.5x the forward FLOPs)")):
        keys = sorted(k for k in groups if k[0] == pass_)
        if not keys:
            continue
        lines = []
        for key in keys:
            _, hd, causal, seqlen, batch, nheads = key
            impls = groups[key]
            tf = {impl: (impls[impl].get("tflops") if impl in impls else None)
                  for impl in ["flare"] + [p for p, _ in PEERS]}
            flare = impls.get("flare", {})
            vs_fa2, vs_cudnn = flare.get("vs_fa2"), flare.get("vs_cudnn")
            if vs_fa2 is not None:
                ratios.append((vs_fa2, pass_, hd, causal, seqlen))
            share = f"{100 * tf['flare'] * 1e3 / ceiling:.0f}%" if ceiling and tf["flare"] else "-"
            mark = " **!**" if flare.get("check_failed") else ""
            lines.append((hd, "yes" if causal else "no", seqlen, f"{batch} x {nheads}", fmt(tf["flare"]) + mark,
                          fmt(tf["torch-flash"]), fmt(tf["torch-cudnn"]), fmt(tf["torch-efficient"]),
                          fmt(vs_fa2, 2), fmt(vs_cudnn, 2), share))
        header = ("hd", "causal", "seqlen", "batch x heads", "flare", "FA2", "cuDNN", "efficient", "flare/FA2",
                  "flare/cuDNN", "flare % of matmul")
        out += [f"{title}, TFLOP/s:", "", *markdown(header, lines), ""]
    if ratios:
        at_least = sum(r[0] >= 1.0 for r in ratios)
        worst = min(ratios)
        out.append(f"flare at or above 1.0x FA2 on {at_least} of {len(ratios)} rows; worst {worst[0]:.2f}x "
                   f"({worst[1]}, hd {worst[2]}, {'causal' if worst[3] else 'not causal'}, seqlen {worst[4]}).")
    return out


def memory_table(rows):
    mem = [r for r in rows if is_memory_row(r)]
    if not mem:
        return []
    lines = [(r["seqlen_q"], r["impl"],
              f"{r['peak_mib']:,.1f} MiB" if r.get("peak_mib") is not None else f"not run: {r.get('skipped', '?')}")
             for r in sorted(mem, key=lambda r: (r["seqlen_q"], r["impl"]))]
    return ["Peak memory of one forward + backward beyond the inputs (causal, bf16, batch 1 x 16 heads x hd 128):",
            "", *markdown(("seqlen", "impl", "peak extra memory"), lines)]


def notes(rows):
    out = []
    failed = [r for r in rows if r.get("check_failed") and r["impl"] == "flare"]
    if failed:
        out.append("**!** rows that failed the accuracy check (their times are not a result):")
        out += [f"- {r['pass']} hd {r['headdim']} seqlen {r['seqlen_q']} {'causal' if r['causal'] else 'full'}: "
                f"{r['check_failed']}" for r in failed]
    errors = [r for r in rows if r.get("error") and r["impl"] == "flare"]
    if errors:
        out.append("**!** rows where flare failed:")
        out += [f"- {r['pass']} hd {r['headdim']} seqlen {r['seqlen_q']} {'causal' if r['causal'] else 'full'}: "
                f"{r['error']}" for r in errors]
    refused = {}
    for r in rows:
        if r.get("skipped") and not is_memory_row(r):
            refused.setdefault((r["impl"], r["skipped"]), []).append(f"{r['pass']} hd{r['headdim']} {r['seqlen_q']}")
    for (impl, why), where in sorted(refused.items()):
        out.append(f"- {impl} refused {len(where)} rows ({', '.join(where[:4])}{', ...' if len(where) > 4 else ''}): "
                   f"{why}")
    return out


def render(data, path):
    meta, rows = data["meta"], data["rows"]
    ceiling = ceiling_gflops(meta.get("ceilings") or {}, "bf16")
    out = [source_line(meta, path), "", *timing_tables(rows, ceiling)]
    for part in (memory_table(rows), notes(rows)):
        if part:
            out += ["", *part]
    return out


if __name__ == "__main__":
    print_tables(__doc__, "gpu-fwd-bwd", render)
