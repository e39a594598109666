#!/usr/bin/env python3
"""Turns a bench_cpu.py result (bench/results/cpu-<date>-<sha>.json) into markdown for docs/performance-cpu.md.

  python3 bench/cpu/make_table.py bench/results/cpu-2026-12-04-30afeb6.json >> docs/performance-cpu.md

Prints: a line on where the figures come from (date, commit, device, ceilings), the timing table
(one line per pass, dtype, headdim, causal, seqlen; flare, torch-cpu and naive ms; torch/flare > 1 means
flare is faster; flare's and torch's share of the dtype's arithmetic ceiling, and ceiling/torch: the
ratio a kernel running at the ceiling would reach), a count of rows under 1.2x and 1.5x, and the memory
table (rows that carry peak_mib).
"""

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from meta import ceiling_gflops  # noqa: E402
from table import markdown, measured_line, print_tables  # noqa: E402

PASS_ORDER = {"fwd": 0, "bwd": 1}


def fmt_ms(row):
    if row is None:
        return "-"
    if row.get("ms") is None:
        return "skipped" if "skipped" in row else "-"
    ms = row["ms"]
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.2f}"


def is_memory_row(row):
    return "peak_mib" in row or "peak_mib_needed" in row


def shape_key(row):
    return (PASS_ORDER.get(row["pass"], 9), row["pass"], row["dtype"], row["headdim"], row["causal"],
            row["seqlen_q"], row["seqlen_k"], row["batch"], row["nheads"])


def timing_table(rows, ceilings):
    groups = defaultdict(dict)
    for row in rows:
        if not is_memory_row(row):
            groups[shape_key(row)][row["impl"]] = row
    lines = []
    under = {1.2: 0, 1.5: 0}
    compared = 0
    for key in sorted(groups):
        _, pass_, dtype, hd, causal, sq, sk, batch, nheads = key
        impls = groups[key]
        flare, torch_, naive = impls.get("flare"), impls.get("torch-cpu"), impls.get("naive")
        ratio = gflops = flare_pct = torch_pct = headroom = None
        if flare and flare.get("ms") and torch_ and torch_.get("ms"):
            r = torch_["ms"] / flare["ms"]
            ratio = f"{r:.2f}"
            compared += 1
            for limit in under:
                under[limit] += r < limit
        if flare and flare.get("tflops") is not None:
            gflops = f"{flare['tflops'] * 1e3:.1f}"
        ceiling = ceiling_gflops(ceilings, dtype)
        if ceiling:
            if flare and flare.get("tflops") is not None:
                flare_pct = f"{100 * flare['tflops'] * 1e3 / ceiling:.0f}%"
            if torch_ and torch_.get("tflops"):
                torch_pct = f"{100 * torch_['tflops'] * 1e3 / ceiling:.0f}%"
                headroom = f"{ceiling / (torch_['tflops'] * 1e3):.2f}"
        seqlen = str(sq) if sq == sk else f"{sq}/{sk}"
        lines.append((pass_, dtype, hd, "yes" if causal else "no", seqlen, f"{batch} x {nheads}", fmt_ms(flare),
                      fmt_ms(torch_), ratio, fmt_ms(naive), gflops, flare_pct, torch_pct, headroom))
    header = ("pass", "dtype", "hd", "causal", "seqlen", "batch x heads", "flare ms", "torch ms", "torch/flare",
              "naive ms", "flare GFLOP/s", "flare % ceiling", "torch % ceiling", "ceiling/torch")
    return [*markdown(header, lines), "",
            f"{compared} rows compared with torch: {under[1.2]} under 1.2x, {under[1.5]} under 1.5x."]


def memory_table(rows):
    mem = [r for r in rows if is_memory_row(r)]
    if not mem:
        return []
    lines = []
    for r in mem:
        if "peak_mib" in r:
            peak = f"{r['peak_mib']:.1f} MiB"
        else:
            peak = f"not run: {r.get('skipped', 'skipped')}"
        lines.append((r["impl"], r["pass"], r["dtype"], "yes" if r["causal"] else "no",
                      f"{r['batch']} x {r['nheads']} x {r['headdim']}", r["seqlen_q"], fmt_ms(r), peak))
    return markdown(("impl", "pass", "dtype", "causal", "batch x heads x hd", "seqlen", "ms", "peak extra memory"),
                    lines)


def source_line(meta, result):
    ceilings = meta.get("ceilings") or {}
    text = measured_line(meta, f", {meta.get('threads', '?')} threads, flare CPU ISA {meta.get('flare_cpu_isa', '?')}, "
                               f"torch {meta.get('torch', '?')}", result)
    if ceilings:
        text += " Ceilings (tools/fma_peak): " + ", ".join(f"{k} {v}" for k, v in ceilings.items()) + " GFLOP/s."
    if meta.get("shapes"):
        text += f" Shapes: {meta['shapes']}."
    return text


def render(data, path):
    ceilings = data["meta"].get("ceilings") or {}
    out = [source_line(data["meta"], path), "", *timing_table(data["rows"], ceilings)]
    mem = memory_table(data["rows"])
    return out + (["", *mem] if mem else [])


if __name__ == "__main__":
    print_tables(__doc__, "cpu", render)
