"""`--help` works for every script a user runs: the recipes, the benchmarks, the retrieval server and the docs scripts.

argparse formats each help string with ``%`` (``%(default)s``), so a bare ``%`` in a dataclass field's ``help``
metadata ("~25% more compute") makes ``--help`` crash with ``ValueError: unsupported format character``. The fast
check walks the help strings of every dataclass given to ``TrlParser`` and names the field; the subprocess checks run
each script's ``--help`` as a user would. Last, the README's two commands (scripts/run_search_agent.sh,
scripts/test.sh) reuse an installed .venv and pass their arguments on.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repo_scripts import load_recipe, load_script

REPO = Path(__file__).resolve().parents[1]


def _has_cli(path: Path) -> bool:
    text = path.read_text(encoding="utf-8")
    return "__main__" in text and ("ArgumentParser" in text or "TrlParser" in text)


SCRIPTS = [  # every command-line script under recipes/, benchmarks/, docs/scripts/, and the retrieval server
    *sorted(str(p.relative_to(REPO)) for folder in ("recipes", "benchmarks", "docs/scripts")
            for p in (REPO / folder).glob("*.py") if _has_cli(p)),
    "-m trl_multiturn.search.server",
]
assert "recipes/search_agent.py" in SCRIPTS and "recipes/evaluate_search_agent.py" in SCRIPTS


class _AnyKey(dict):
    """What argparse formats a help string with, for any key (``%(default)s``, ``%(type)s``, ...)."""

    def __missing__(self, key):
        return ""


def parsed_dataclasses():
    """Every dataclass the recipes give to TrlParser."""
    from trl import ModelConfig

    from trl_multiturn import MultiTurnGRPOConfig

    search = load_recipe()
    evaluate = load_script("recipes/evaluate_search_agent.py", "evaluate_search_agent_recipe")
    return [search.SearchAgentArguments, evaluate.EvalArguments, MultiTurnGRPOConfig, ModelConfig]


def unformattable_help(cls) -> list[str]:
    """Fields of ``cls`` whose help string argparse cannot format, with the error."""
    bad = []
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help")
        if not text:
            continue
        try:
            text % _AnyKey()
        except (ValueError, TypeError) as exc:
            bad.append(f"{cls.__name__}.{f.name}: {exc} in {text!r} (write %% for a literal %)")
    return bad


def test_the_help_walk_catches_a_bare_percent():
    @dataclasses.dataclass
    class Bad:
        x: int = dataclasses.field(default=0, metadata={"help": "~25% more compute"})
        y: int = dataclasses.field(default=0, metadata={"help": "25%% of it, default %(default)s"})

    (problem,) = unformattable_help(Bad)
    assert problem.startswith("Bad.x: unsupported format character")


def test_every_parsed_help_string_formats():
    from trl import TrlParser

    classes = parsed_dataclasses()
    problems = [p for cls in classes for p in unformattable_help(cls)]
    assert not problems, "\n".join(problems)
    for types in ((classes[0], classes[2], classes[3]), (classes[1], classes[3])):  # the recipes' two parsers
        assert "usage:" in TrlParser(types).format_help()


def _run_help(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *script.split(), "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def help_runs(request):
    """The ``--help`` of every script this session selected, run as a user runs it, one subprocess per core at a
    time (each one mostly imports torch and TRL, so a pool as wide as the machine finishes them in about 1/cores of
    the time)."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_script_help"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(selected, pool.map(_run_help, selected)))


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help(script, help_runs):
    proc = help_runs[script]
    assert proc.returncode == 0, f"{script} --help exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert proc.stdout.lstrip().startswith("usage:"), proc.stdout[:500]


def _stamp_is_current() -> bool:
    """Whether the running interpreter is the repository's .venv, installed by scripts/env.sh for this checkout."""
    venv = REPO / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve():
        return False
    stamp = subprocess.run(["bash", "-c", 'cat pyproject.toml scripts/env.sh | sha256sum | cut -d" " -f1'], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    stamp_file = venv / ".trl_multiturn-installed"
    return stamp_file.exists() and stamp_file.read_text().strip() == stamp


@pytest.mark.slow
@pytest.mark.parametrize("command, expected", [
    (["bash", "scripts/test.sh", "--collect-only", "tests/test_threads.py"], "test_a_bad_value_is_named"),
    (["bash", "scripts/run_search_agent.sh", "--help"], "--sft_num_examples"),
])
def test_the_two_commands_reuse_the_environment_and_pass_arguments_on(command, expected):
    """Run as CI runs them (from the README, on a clean clone), the commands find .venv installed for this
    pyproject.toml, reuse it without installing, and hand their arguments to pytest / the recipe."""
    if not _stamp_is_current():
        pytest.skip("the tests do not run in a .venv that scripts/env.sh installed for this checkout")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "TRL_MULTITURN_VENV")}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Reusing" in proc.stderr and "Installing" not in proc.stderr, proc.stderr[-2000:]
    assert expected in proc.stdout, proc.stdout[-2000:]
