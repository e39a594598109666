#!/usr/bin/env python3
"""Markdown for docs/ from a train_llama.py result (bench/results/train-<date>-<sha>.json).

  python3 bench/gpu/make_train_table.py bench/results/train-2026-12-02-950b581.json >> docs/performance.md

Prints: where it comes from (date, commit, device, model, command); a table per context x batch with each
attention implementation's median step time, tokens/s, speed relative to sdpa, peak memory and first/last
loss (or why it did not finish, e.g. out of memory); whether flare's loss tracks sdpa's; and the losses at a
few steps side by side.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from table import markdown, measured_line, print_tables  # noqa: E402


def source_line(meta, result):
    m = meta.get("model", {})
    t = meta.get("training", {})
    return (measured_line(meta, f", torch {meta.get('torch', '?')}, transformers {meta.get('transformers', '?')}",
                          result) +
            f" Model: randomly initialised {m.get('class', '?')}, {m.get('parameters', 0) / 1e6:.0f}M parameters "
            f"(hidden {m.get('hidden_size')}, {m.get('num_hidden_layers')} layers, {m.get('num_attention_heads')} "
            f"heads over {m.get('num_key_value_heads')} KV heads, vocab {m.get('vocab_size')}). Training: "
            f"{t.get('dtype', '?')}, {t.get('optimizer', '?')}, {t.get('steps', '?')} steps, median step time "
            f"after {t.get('warmup_steps_excluded', '?')}. Data: {meta.get('data', '?')}.")


def run_tables(rows, comparison):
    out = []
    for ctx, batch in sorted({(r["seqlen_q"], r["batch"]) for r in rows}):
        group = [r for r in rows if r["seqlen_q"] == ctx and r["batch"] == batch]
        sdpa = next((r for r in group if r["impl"] == "sdpa" and r.get("ms")), None)
        lines = []
        for r in group:
            if r.get("ms"):
                speed = f"{sdpa['ms'] / r['ms']:.2f}x" if sdpa else "-"
                loss = f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}" if r["losses"] else "-"
                peak = f"{r['peak_mib'] / 1024:.1f} GiB" if r.get("peak_mib") else "-"
                lines.append((r["impl"], f"{r['ms']:.1f}", f"{r.get('tokens_per_s', 0):,}", speed, peak, loss))
            else:
                peak = f"{r['peak_mib'] / 1024:.1f} GiB at failure" if r.get("peak_mib") else "-"
                lines.append((r["impl"], r["status"], "-", "-", peak, r.get("error", "")[:80]))
        header = ("attention", "median step ms", "tokens/s", "vs sdpa", "peak memory", "loss first -> last")
        out += [f"Context {ctx}, batch {batch}:", "", *markdown(header, lines)]
        c = comparison.get(f"{ctx}x{batch}")
        if c and c.get("tracks") is not None and "max_abs_loss_diff" in c:
            out.append("")
            out.append(f"flare {'tracks' if c['tracks'] else 'does NOT track'} sdpa: largest loss difference over "
                       f"the steps {c['max_abs_loss_diff']:.4f} (step 1: {c['first_step_loss_diff']:.4f}).")
        elif c:
            out += ["", f"flare vs sdpa: not compared ({c.get('why', '?')})."]
        out += ["", *loss_table(group), ""]
    return out


def loss_table(group):
    done = [r for r in group if r["losses"]]
    if not done:
        return []
    steps = len(max(done, key=lambda r: len(r["losses"]))["losses"])
    picks = sorted({0, 1, 2, 4, 9, 14, 19, 24, 29, steps - 1} & set(range(steps)))
    return markdown(("step", *(r["impl"] for r in done)),
                    ((s + 1, *(f"{r['losses'][s]:.4f}" if s < len(r["losses"]) else "-" for r in done))
                     for s in picks))


def render(data, path):
    return [source_line(data["meta"], path), "", *run_tables(data["rows"], data.get("comparison", {}))]


if __name__ == "__main__":
    print_tables(__doc__, "train", render)
