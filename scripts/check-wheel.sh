#!/usr/bin/env bash
# Builds the Python wheel, checks it (scripts/wheel_check.py), installs it into a fresh virtual environment
# and runs a smoke test there from another directory, as a user would. Exits non-zero on any failure.
#   scripts/check-wheel.sh                      package build/release/src/libflare.so (what scripts/test.sh has
#                                               just built and tested: nothing is compiled again), or, when that
#                                               library is missing, build a CPU-only wheel from scratch
#   scripts/check-wheel.sh --library PATH       package the library at PATH
#   scripts/check-wheel.sh --build              build from scratch (FLARE_CUDA from the environment, else OFF)
#   scripts/check-wheel.sh --wheel FILE         check an existing wheel (scripts/build-wheel.sh uses this)
# The fresh environment sees torch (and transformers) from the Python of scripts/python-env.sh through a .pth
# file, so nothing is downloaded into it; the wheel is installed with --no-index, so its torch>=2.4
# requirement must be met by that torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
library=build/release/src/libflare.so
mode=auto
wheel=
while [[ $# -gt 0 ]]; do
  case $1 in
    --library) library=$2; mode=library; shift 2 ;;
    --build) mode=build; shift ;;
    --wheel) wheel=$2; mode=wheel; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check-wheel: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ $mode == auto ]]; then
  if [[ -f $library ]]; then mode=library; else mode=build; fi
fi

work=build/wheel-check
py=$(scripts/python-env.sh)
log() { echo "check-wheel: $*" >&2; }

if [[ $mode != wheel ]]; then
  rm -rf "$work/dist"
  if [[ $mode == library ]]; then
    [[ -f $library ]] || { log "no library at $library"; exit 1; }
    log "packaging $library (built and tested already: no compile)"
    export FLARE_WHEEL_LIBRARY FLARE_CUDA=OFF  # OFF: the build environment needs nothing for CUDA either
    FLARE_WHEEL_LIBRARY=$(realpath "$library")
  else
    export FLARE_CUDA=${FLARE_CUDA:-OFF}
    log "building the library from scratch (FLARE_CUDA=$FLARE_CUDA)"
  fi
  "$py" -m pip wheel . --no-deps -q -w "$work/dist" -Cbuild-dir="$work/build"
  wheel=$(ls "$work"/dist/flare_attention-*.whl)
fi
[[ -f $wheel ]] || { log "no wheel at $wheel"; exit 1; }

log "inspecting $(basename "$wheel")"
"$py" scripts/wheel_check.py "$wheel" --json "$work/report.json"

log "installing it into a fresh virtual environment ($work/venv)"
rm -rf "$work/venv"
"$py" -m venv "$work/venv"
venv_py=$PWD/$work/venv/bin/python
# torch from the test Python, appended to sys.path after the venv's own site-packages
torch_site=$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
"$venv_py" -c 'import site, sys; print(site.getsitepackages()[0])' | {
  read -r site_dir
  echo "$torch_site" > "$site_dir/test-python-torch.pth"
}
"$venv_py" -m pip install -q --no-index "$wheel"

smoke=$(mktemp -d)
trap 'rm -rf "$smoke"' EXIT
log "smoke test from $smoke"
(
  cd "$smoke"
  unset FLARE_LIBRARY PYTHONPATH
  "$venv_py" - "$PWD" <<'PY'
import importlib.metadata, os, sys
import flare
venv = sys.prefix
assert flare.__file__.startswith(venv), f"flare imported from {flare.__file__}, not from the wheel in {venv}"
assert flare.library().path.startswith(venv), f"libflare loaded from {flare.library().path}"
assert importlib.metadata.version("flare-attention") == flare.__version__ == flare.version()
import torch
out = flare.flash_attn_func(torch.randn(1, 65, 4, 32), torch.randn(1, 65, 2, 32), torch.randn(1, 65, 2, 32),
                            causal=True)
assert out.shape == (1, 65, 4, 32) and bool(out.isfinite().all())
import flare.flash_attn_compat
flare.flash_attn_compat.install()
from flash_attn import flash_attn_func
from flash_attn.bert_padding import index_first_axis, unpad_input
from flash_attn.layers.rotary import apply_rotary_emb
assert torch.equal(flash_attn_func(torch.ones(1, 3, 1, 8), torch.ones(1, 3, 1, 8), torch.ones(1, 3, 1, 8)),
                   torch.ones(1, 3, 1, 8))
print("smoke test: import, library, versions, flash_attn_func, flash_attn drop-in: ok")
PY
  "$venv_py" -m flare
)
log "ok: $(basename "$wheel")"
