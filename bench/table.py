"""The one table writer of the benches: markdown for docs/ (make_table.py, make_train_table.py) and the
fixed-width table a benchmark prints row by row while it runs (bench_cpu.py, bench_gpu.py), plus the
"Measured ... at commit ... on ..." line every markdown table starts with.
"""

import argparse
import json
import re
import sys
from pathlib import Path

from meta import commit_text


def markdown(header, rows):
    """A markdown table: header (cells), then one line per row (cells; None prints as "-")."""
    def line(cells):
        return "| " + " | ".join("-" if c is None else str(c) for c in cells) + " |"
    return [line(header), "|" + "---|" * len(header), *(line(r) for r in rows)]


def print_tables(doc, topic, render):
    """The command line of a make_table script: `<script> RESULT.json` prints render(result, path), a list of
    markdown lines, on stdout. doc: the script's docstring (its first paragraph is --help's description)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("result", type=Path, help=f"a bench/results/{topic}-*.json file")
    args = p.parse_args()
    with open(args.result) as f:
        data = json.load(f)
    sys.stdout.write("\n".join(render(data, args.result)).rstrip() + "\n")


def fmt(x, digits=0):
    """A number for a table cell; None -> "-"."""
    return "-" if x is None else f"{x:.{digits}f}"


def measured_line(meta, software="", result=None):
    """'Measured <date> at commit `<sha>` on <device><software>. Command: `<command>`.' A results path the
    command wrote to is given as the result's name today (files are renamed to bench/README.md's scheme)."""
    dirty = " (with uncommitted changes)" if meta.get("dirty") else ""
    command = str(meta.get("command", "?"))
    if result is not None:
        command = re.sub(r"bench/results/[\w.-]+\.json", f"bench/results/{result.name}", command)
    return (f"Measured {meta.get('date', '?')} at commit `{commit_text(meta)}`{dirty} on {meta.get('device', '?')}"
            f"{software}. Command: `{command}`.")


class Console:
    """A fixed-width table printed as a run goes. columns: (title, width) pairs, a negative width aligning
    left, and "|" for a separator; the header and a rule are printed at once."""

    def __init__(self, columns):
        self.columns = columns
        header = self._line([c[0] for c in columns if c != "|"])
        print(header)
        print("-" * len(header), flush=True)

    def row(self, *cells):
        """Prints one row: a cell per column (None prints as "-")."""
        print(self._line(cells), flush=True)

    def _line(self, cells):
        cells = iter(cells)
        parts = []
        for column in self.columns:
            if column == "|":
                parts.append("|")
                continue
            width = column[1]
            cell = next(cells)
            text = "-" if cell is None else str(cell)
            parts.append(f"{text:<{-width}}" if width < 0 else f"{text:>{width}}")
        return " ".join(parts)
