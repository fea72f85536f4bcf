#!/usr/bin/env bash
# Create (or repair) the reference environment `.venv-ref/` at the repo root.
#
# Contents: the official qwen-tts 0.1.1 with transformers 4.57.3 on torch 2.13.0 (CPU), plus a tiny
# `torchaudio` stub. The real torchaudio wheel that pip would pull for qwen-tts fails to load beside
# torch 2.13.0+cpu, and the 12 Hz inference path never calls it (only the 25 Hz tokenizer imports
# `torchaudio.compliance.kaldi`). The stub is installed *before* qwen-tts, with its own dist-info,
# so pip treats the requirement as satisfied and never downloads the real package.
#
# Usage:   bash scripts/reference/setup_ref_env.sh [VENV_DIR]      (default: <repo>/.venv-ref)
# Env:     PYTHON=python3.11 to choose the interpreter.
# Idempotent: re-running repairs a broken torchaudio and re-checks the pinned versions.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$REPO_ROOT/.venv-ref}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup_ref_env] creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# 1. Remove a real torchaudio (it cannot load beside torch 2.13.0+cpu); keep our stub if present.
if [ -d "$SITE/torchaudio" ] && [ ! -f "$SITE/torchaudio/_OMNILAB_STUB" ]; then
    echo "[setup_ref_env] removing the installed (broken) torchaudio"
    "$PY" -m pip uninstall -y -q torchaudio || true
    rm -rf "$SITE/torchaudio"
fi

# 2. Write the stub package and a dist-info so pip sees the requirement `torchaudio` as satisfied.
STUB_VERSION="2.13.0+omnilabstub"
rm -rf "$SITE"/torchaudio-*.dist-info
mkdir -p "$SITE/torchaudio/compliance" "$SITE/torchaudio-$STUB_VERSION.dist-info"
: > "$SITE/torchaudio/_OMNILAB_STUB"
cat > "$SITE/torchaudio/__init__.py" <<'PYEOF'
"""Stub torchaudio written by omnilab's scripts/reference/setup_ref_env.sh.

The real torchaudio fails to load beside torch 2.13.0+cpu. qwen-tts imports it only from its 25 Hz
tokenizer (`torchaudio.compliance.kaldi`), which the 12 Hz path never calls. Any use raises.
"""
__version__ = "2.13.0+omnilabstub"
from . import compliance  # noqa: E402,F401
PYEOF
cat > "$SITE/torchaudio/compliance/__init__.py" <<'PYEOF'
from . import kaldi  # noqa: F401
PYEOF
cat > "$SITE/torchaudio/compliance/kaldi.py" <<'PYEOF'
"""Stub: torchaudio.compliance.kaldi is not available in the omnilab reference env."""


def _unavailable(*args, **kwargs):
    raise NotImplementedError("torchaudio is stubbed in the omnilab reference env (12 Hz path only)")


fbank = _unavailable
mfcc = _unavailable
spectrogram = _unavailable
PYEOF
DI="$SITE/torchaudio-$STUB_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: torchaudio\nVersion: %s\nSummary: omnilab stub (see scripts/reference/setup_ref_env.sh)\n' "$STUB_VERSION" > "$DI/METADATA"
printf 'pip\n' > "$DI/INSTALLER"
{
    for f in torchaudio/__init__.py torchaudio/_OMNILAB_STUB torchaudio/compliance/__init__.py \
             torchaudio/compliance/kaldi.py "torchaudio-$STUB_VERSION.dist-info/METADATA" \
             "torchaudio-$STUB_VERSION.dist-info/INSTALLER"; do
        echo "$f,,"
    done
    echo "torchaudio-$STUB_VERSION.dist-info/RECORD,,"
} > "$DI/RECORD"

# 3. The pinned reference stack (pip takes the local torch wheel from its find-links here).
echo "[setup_ref_env] installing torch==2.13.0 qwen-tts==0.1.1 transformers==4.57.3"
"$PY" -m pip install -q torch==2.13.0 qwen-tts==0.1.1 transformers==4.57.3

# 4. Smoke check: the 12 Hz import path loads and the stub is in place.
"$PY" - <<'PYEOF'
import torch, transformers, torchaudio
import qwen_tts
from qwen_tts import Qwen3TTSModel  # noqa: F401
assert torchaudio.__version__.endswith("omnilabstub"), torchaudio.__version__
print(f"[setup_ref_env] ok: torch {torch.__version__}, transformers {transformers.__version__}, qwen_tts imported")
PYEOF
