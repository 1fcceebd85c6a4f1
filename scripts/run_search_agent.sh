#!/usr/bin/env bash
# Train the search agent on its offline default from a fresh clone: sets up .venv when needed (scripts/env.sh), then
# `accelerate launch recipes/search_agent.py` with any arguments given here, e.g.
#     bash scripts/run_search_agent.sh --max_steps 10 --output_dir outputs/longer
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec accelerate launch recipes/search_agent.py "$@"
