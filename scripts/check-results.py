#!/usr/bin/env python3
"""Checks that bench/results and docs/img keep to bench/README.md's results policy; scripts/test.sh runs it
(so CI does). Exit status 1 with one line per broken rule, else 0.

  1. bench/results holds INDEX.md and result files named <topic>-<date>-<short sha>.json (bench/meta.py's
     RESULT_NAME), nothing else: no raw logs (*.log).
  2. At most two files per topic and device (the device a file's meta records).
  3. Every PNG in docs/img is shown by a document (README.md, docs/*.md, bench/README.md).
  4. Every result file or plot that the docs, README and code cite exists. docs/tuning-*.md, which hold the
     measurement history, may also cite a retired file by its name when bench/results/INDEX.md lists it.
  5. No file that INDEX.md lists as retired is back in the tree.
"""

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from meta import RESULT_NAME  # noqa: E402

RESULTS = REPO / "bench" / "results"
IMAGES = REPO / "docs" / "img"
INDEX = RESULTS / "INDEX.md"
MAX_PER_TOPIC_AND_DEVICE = 2

# Where citations are looked for, and where history may name retired files.
CITING = ["README.md", "bench/README.md", "docs/*.md", "bench/**/*.py", "bench/**/*.sh", "scripts/*",
          "src/**/*", "tools/**/*", "python/**/*.py", "tests/**/*", "include/**/*"]
HISTORY = ["docs/tuning-*.md"]
DOCS = ["README.md", "bench/README.md", "docs/*.md"]
# A dated file name (a result or its plot), with the path before it if any.
CITATION = re.compile(r"(?P<path>[\w./-]*/)?(?P<name>[\w.-]*\d{4}-\d\d-\d\d[\w.-]*\.(?:json|log|png))")


def files(patterns):
    found = set()
    for pattern in patterns:
        found.update(p for p in REPO.glob(pattern) if p.is_file() and RESULTS not in p.parents)
    return sorted(found)


def retired_names():
    """The file names INDEX.md's tables of retired files list (first column)."""
    if not INDEX.is_file():
        return set()
    names, section = set(), ""
    for line in INDEX.read_text().splitlines():
        if line.startswith("## "):
            section = line
        elif "Retired" in section and line.startswith("| ") and not line.startswith("| file"):
            names.add(line.split("|")[1].strip())
    return names


def check_results(problems):
    groups = defaultdict(list)
    for path in sorted(RESULTS.iterdir()):
        if path == INDEX:
            continue
        if path.suffix == ".log":
            problems.append(f"{path.relative_to(REPO)}: a raw log; a summary JSON carries what it shows")
            continue
        match = RESULT_NAME.match(path.name)
        if not match:
            problems.append(f"{path.relative_to(REPO)}: not named <topic>-<date>-<short sha>.json")
            continue
        try:
            meta = json.loads(path.read_text()).get("meta") or {}
        except (ValueError, AttributeError) as e:
            problems.append(f"{path.relative_to(REPO)}: not a JSON object ({e})")
            continue
        groups[(match["topic"], meta.get("device", "(no device recorded)"))].append(path.name)
    for (topic, device), names in sorted(groups.items()):
        if len(names) > MAX_PER_TOPIC_AND_DEVICE:
            problems.append(f"bench/results: {len(names)} files of topic {topic} on {device} (at most "
                            f"{MAX_PER_TOPIC_AND_DEVICE}: retire the older ones into INDEX.md): {', '.join(names)}")


def check_citations(problems, retired):
    history = set(files(HISTORY))
    for path in files(CITING):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for match in CITATION.finditer(text):
            name, where = match["name"], match["path"] or ""
            folder = IMAGES if name.endswith(".png") else RESULTS
            if (folder / name).is_file():
                continue
            line = text.count("\n", 0, match.start()) + 1
            if path in history and name in retired and not where:
                continue
            why = "retired (bench/results/INDEX.md)" if name in retired else "not in the tree"
            problems.append(f"{path.relative_to(REPO)}:{line}: cites {where}{name}, {why}")


def check_images(problems):
    shown = "\n".join(p.read_text() for p in files(DOCS))
    for image in sorted(IMAGES.glob("*.png")):
        if image.name not in shown:
            problems.append(f"{image.relative_to(REPO)}: no document shows it (remove it, or show it)")


def check_index(problems, retired):
    for name in sorted(retired):
        for folder in (RESULTS, IMAGES):
            if (folder / name).exists():
                problems.append(f"{(folder / name).relative_to(REPO)}: INDEX.md lists it as retired")


def main():
    problems = []
    retired = retired_names()
    check_results(problems)
    check_citations(problems, retired)
    check_images(problems)
    check_index(problems, retired)
    for p in problems:
        print(f"check-results: {p}")
    if not problems:
        count = sum(1 for p in RESULTS.iterdir() if p != INDEX)
        print(f"check-results: bench/results ({count} files) and docs/img keep to bench/README.md's policy")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
