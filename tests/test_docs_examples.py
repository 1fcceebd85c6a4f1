"""The documentation runs: the quickstart notebook, the pg_loss script, the configuration reference and every
code block of docs/*.md that is marked as runnable.

Convention for runnable blocks in docs/*.md: a fenced ```python block whose previous non-blank line is exactly
``<!-- runnable -->``. The runnable blocks of one page run in order in one namespace (a later block may use what an
earlier one defined), in a temporary working directory. A runnable block may be followed by a fenced ```text block
whose previous non-blank line is ``<!-- expected-output -->``: the block's printed output must then equal it
(trailing whitespace ignored), so that numbers quoted in the docs are the numbers the code prints.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

from repo_scripts import load_script

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"
RUNNABLE = "<!-- runnable -->"
EXPECTED = "<!-- expected-output -->"
_FENCE = re.compile(r"^```(\w*)\s*$")


def _load_script(name: str):
    return load_script(DOCS / "scripts" / f"{name}.py", f"docs_script_{name}")


def parse_blocks(text: str) -> list[dict]:
    """Fenced blocks of a Markdown text: ``{"lang", "code", "line", "marker"}`` (marker: the previous non-blank line)."""
    lines = text.splitlines()
    blocks, i, previous = [], 0, ""
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        blocks.append({"lang": match.group(1), "code": "\n".join(body) + "\n", "line": start + 1, "marker": previous})
        previous = "```"
        i += 1
    return blocks


def runnable_blocks(path: Path) -> list[dict]:
    """The runnable python blocks of a page, each with the expected output that follows it (or None)."""
    blocks = parse_blocks(path.read_text(encoding="utf-8"))
    out = []
    for k, block in enumerate(blocks):
        if block["lang"] != "python" or block["marker"] != RUNNABLE:
            continue
        nxt = blocks[k + 1] if k + 1 < len(blocks) else None
        expected = nxt["code"] if nxt is not None and nxt["marker"] == EXPECTED and nxt["lang"] == "text" else None
        out.append({**block, "expected": expected})
    return out


PAGES_WITH_RUNNABLE_BLOCKS = sorted(p.name for p in DOCS.glob("*.md") if runnable_blocks(p))


def test_the_runnable_convention_is_used():
    assert len(PAGES_WITH_RUNNABLE_BLOCKS) >= 3, PAGES_WITH_RUNNABLE_BLOCKS
    sample = "text\n\n<!-- runnable -->\n```python\nprint(1)\n```\n<!-- expected-output -->\n```text\n1\n```\n"
    (block,) = [b for b in parse_blocks(sample) if b["lang"] == "python"]
    assert block["marker"] == RUNNABLE and block["code"] == "print(1)\n"


@pytest.mark.parametrize("page", PAGES_WITH_RUNNABLE_BLOCKS)
def test_runnable_blocks(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.removesuffix('.md')}"}
    for block in runnable_blocks(DOCS / page):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            try:
                exec(compile(block["code"], f"docs/{page}:{block['line']}", "exec"), namespace)  # noqa: S102
            except Exception as exc:  # name the block in the failure
                raise AssertionError(f"docs/{page}, block at line {block['line']} raised {exc!r}") from exc
        if block["expected"] is not None:
            got = [line.rstrip() for line in stdout.getvalue().rstrip().splitlines()]
            want = [line.rstrip() for line in block["expected"].rstrip().splitlines()]
            assert got == want, f"docs/{page}, block at line {block['line']}: printed output differs from the page"


def test_configuration_reference_is_up_to_date():
    gen = _load_script("gen_config_reference")
    current = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert current == gen.render(), "docs/configuration.md is stale: run python docs/scripts/gen_config_reference.py"
    for name in ("max_turns", "loss_aggregation", "prompts_per_rollout", "mini_batch_size", "num_generations"):
        assert f"| `{name}` |" in current


def test_learning_proof_table_is_up_to_date():
    """The page's table of learning-proof runs is what docs/scripts/learning_proof_table.py renders from the JSON."""
    script = _load_script("learning_proof_table")
    assert script.on_page() == script.render(), "run python docs/scripts/learning_proof_table.py --write"
    rows = script.rows()
    assert len(rows) == sum(len(run[-1]) for run in script.RUNS)
    for row in rows:  # the verdict column follows the rule from the intervals, not from a label
        em = row["em"]
        assert row["target"] == (em["all"]["ci_low"] > 0 and em["hops_1"]["ci_high"] >= 0 and em["hops_2"]["ci_high"] >= 0)
        assert em["all"]["ci_low"] <= em["all"]["diff"] <= em["all"]["ci_high"]


def test_pg_loss_zero_script_fast(tmp_path):
    """docs/scripts/pg_loss_zero.py in its fast mode: its own checks pass, and the claims of the page hold."""
    import torch

    script = _load_script("pg_loss_zero")
    threads = torch.get_num_threads()
    try:
        results = script.main(["--fast", "--out", str(tmp_path / "pg.png"), "--json", str(tmp_path / "pg.json")])
    finally:
        torch.set_num_threads(threads)
    one, several = results[script.ONE], results[script.SEVERAL]
    # one mini-batch per rollout: pg_loss is 0 (float32 rounding) at every step, ratio 1, gradient not 0
    assert all(abs(r["pg_loss"]) < 1e-5 and abs(r["ratio_mean"] - 1) < 1e-6 for r in one), one
    assert all(r["grad_norm"] > 1e-3 for r in one), one
    # several mini-batches: the first step of a rollout is on-policy (0), the later ones are not
    assert abs(several[0]["pg_loss"]) < 1e-5 and several[0]["step_in_rollout"] == 1
    assert any(abs(r["pg_loss"]) > 1e-4 for r in several[1:]), several
    assert (tmp_path / "pg.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "pg.json").read_text())[script.ONE][0]["step"] == 1


@pytest.mark.slow  # runs the notebook in a kernel subprocess: ~15 s
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nb, outputs = _execute_notebook("quickstart.ipynb", tmp_path, monkeypatch)
    assert any("MultiTurnGRPOTrainer" in cell.source for cell in nb.cells if cell.cell_type == "code")
    assert "loss/pg_loss" in outputs and "grad_norm" in outputs  # the metrics table was shown
    assert "policy (mask 1)" in outputs and "env    (mask 0)" in outputs  # and a trajectory with its mask


# The README's Python example, shortened: each key (text of the README's block) is replaced by its value, and must
# occur exactly once, so that a README edit the shortening no longer follows fails here instead of running in full.
README_SHORTER = {"num_entities=300": "num_entities=20", "data.train_rows[:64]": "data.train_rows[:4]",
                  "max_steps=3": "max_steps=1"}
README_TINY = {"max_completion_length=1024": "max_completion_length=256", "max_tokens_per_turn=96": "max_tokens_per_turn=16"}


def readme_example(replacements: dict[str, str]) -> str:
    """The one python block of README.md, with ``replacements`` applied (each must occur exactly once)."""
    (block,) = [b for b in parse_blocks((REPO_ROOT / "README.md").read_text(encoding="utf-8")) if b["lang"] == "python"]
    code = block["code"]
    for old, new in replacements.items():
        assert code.count(old) == 1, f"README.md's Python example no longer has {old!r} exactly once: update the test"
        code = code.replace(old, new)
    return code


def _run_readme_example(code: str) -> dict:
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, "README.md (python example)", "exec"), namespace)  # noqa: S102
    trainer = namespace["trainer"]
    assert namespace["stats"]["kept"] == len(namespace["trajectories"]) > 0  # the warm start trained on experts
    assert trainer.state.global_step == 1  # one GRPO optimizer step, from the warm-start adapter
    assert any("loss/pg_loss" in h for h in trainer.state.log_history)
    assert type(trainer.model).__name__.startswith("Peft")
    return namespace


def test_readme_example_runs_tiny_model(tmp_path, monkeypatch, smollm2_tokenizer, tiny_model_factory):
    """The README's example on a tiny random model (same code and settings; shorter run and token budgets)."""
    model_dir = tmp_path / "tiny"
    tiny_model_factory(hidden_size=32, num_layers=2).save_pretrained(model_dir)
    smollm2_tokenizer.save_pretrained(model_dir)
    monkeypatch.chdir(tmp_path)
    code = readme_example({**README_SHORTER, **README_TINY, "str(smollm2_path())": repr(str(model_dir))})
    _run_readme_example(code)


@pytest.mark.slow
def test_readme_example_runs_smollm2(tmp_path, monkeypatch):
    """The README's example on SmolLM2-135M-Instruct, with 4 warm-start examples, one GRPO step and the shorter
    token budgets (a model warm-started on 4 examples writes until the budget: the full one costs minutes)."""
    monkeypatch.chdir(tmp_path)
    _run_readme_example(readme_example({**README_SHORTER, **README_TINY}))


def _execute_notebook(name: str, tmp_path, monkeypatch):
    """Run docs/notebooks/<name> in a python3 kernel of this interpreter; returns (the notebook, its text outputs)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.skip("no 'python3' Jupyter kernel is installed (pip install ipykernel)")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    nb = nbformat.read(DOCS / "notebooks" / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=1200, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    return nb, _text_outputs(nb)


def _text_outputs(nb) -> str:
    return "".join(
        out.get("text", "") + str(out.get("data", {}).get("text/plain", "")) + str(out.get("data", {}).get("text/html", ""))
        for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )


@pytest.mark.slow  # SmolLM2 in a kernel subprocess, shortened: warm start on 8 experts, 4 questions, 1 GRPO step
def test_search_agent_notebook_executes_on_smollm2(tmp_path, monkeypatch, smollm2_dir):
    import nbformat

    committed = _text_outputs(nbformat.read(DOCS / "notebooks" / "search_agent_smollm2.ipynb", as_version=4))
    assert "setting: full" in committed and "after GRPO" in committed  # the committed outputs are the full run's
    monkeypatch.setenv("TRL_MULTITURN_NOTEBOOK_SMALL", "1")
    _, outputs = _execute_notebook("search_agent_smollm2.ipynb", tmp_path, monkeypatch)
    assert "setting: small" in outputs
    assert "warm start" in outputs and "after GRPO" in outputs and "ci_low" in outputs  # the tables
    assert "policy (mask 1)" in outputs and "env    (mask 0)" in outputs and "background:#c8f7c5" in outputs
