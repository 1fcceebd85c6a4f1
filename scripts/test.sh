#!/usr/bin/env bash
# Run the tests from a fresh clone: sets up .venv when needed (scripts/env.sh), then `python -m pytest -q` with any
# arguments given here, e.g.
#     bash scripts/test.sh -m "not slow"            # skip the tests that load SmolLM2 or start subprocesses
#     bash scripts/test.sh tests/test_loss.py -x
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest -q "$@"
