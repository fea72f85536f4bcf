#!/usr/bin/env bash
# Run omnilab's test suite (sets up .venv first if it is missing). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || ./scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
