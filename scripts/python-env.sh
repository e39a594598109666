#!/usr/bin/env bash
# Makes a Python that has the pinned test requirements (tests/python/requirements.txt) and prints its path.
#   - python3 already has them at the pinned versions: prints python3 and installs nothing;
#   - else pip-installs them into python3, or, where python3 is "externally managed" (PEP 668, Debian's
#     system Python), into a virtual environment build/python-venv that also sees the system packages.
# Used by scripts/test.sh; runnable on its own: py=$(scripts/python-env.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

requirements=tests/python/requirements.txt
log() { echo "python-env: $*" >&2; }

if ! command -v python3 >/dev/null 2>&1; then
  log "no python3 here: install Python 3.10+ and rerun"
  exit 1
fi

# True when the interpreter $1 has every "name==version" of the requirements file.
has_pins() {
  "$1" - "$requirements" <<'PY'
import sys
from importlib import metadata
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, version = line.split("==")
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if installed.split("+")[0] != version:  # torch reports 2.11.0+cu130 for the pin 2.11.0
        sys.exit(1)
PY
}

py=python3
if has_pins "$py"; then
  command -v "$py"
  exit 0
fi
if [[ -x build/python-venv/bin/python ]] && has_pins build/python-venv/bin/python; then
  echo build/python-venv/bin/python
  exit 0
fi
managed=$(python3 -c 'import sysconfig, os; print(int(os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))')
if [[ $managed == 1 ]]; then
  log "python3 is externally managed: using the virtual environment build/python-venv"
  [[ -x build/python-venv/bin/python ]] || python3 -m venv --system-site-packages build/python-venv >&2
  py=build/python-venv/bin/python
fi
log "installing $requirements into $py"
"$py" -m pip install -q -r "$requirements" >&2
has_pins "$py" || { log "the pins of $requirements are still not met by $py"; exit 1; }
if [[ $py == python3 ]]; then command -v python3; else echo "$py"; fi
