"""The figures of the docs are drawn from the committed results by the committed scripts, and the pages show them.

docs/scripts/plot_learning_curves.py runs on the JSON files of docs/results/ (the numbers it plots are checked against
those files), docs/scripts/draw_trainer_data_flow.py draws the six stages of a training step, and the committed
images under docs/images/ are the ones docs/search_agent.md and docs/trainer.md link.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import struct
from pathlib import Path

import pytest

from repo_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib")


def _load(name: str):
    return load_script(DOCS / "scripts" / f"{name}.py")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG file"
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def test_learning_curves_match_the_committed_results(tmp_path):
    script = _load("plot_learning_curves")
    written = script.main(["--out", str(tmp_path)])
    for name in ("learning_curves", "heldout_em"):
        width, height = _png_size(written[name])
        assert width > 800 and height > 300, (name, width, height)

    curves, levels = script.load_runs()
    two_hop = json.loads((DOCS / "results" / "learning_run_grpo_2hop.json").read_text())
    logged = [h for h in two_hop["log_history"] if "reward" in h]
    assert curves[0].source == "learning_run_grpo_2hop.json"
    assert curves[0].steps == list(range(1, 9))  # the final summary entry (train_runtime, no reward) is left out
    assert curves[0].reward == [h["reward"] for h in logged]
    assert curves[0].reward[4] == pytest.approx(0.5625) and curves[0].exact_match[4] == pytest.approx(0.25)
    assert curves[1].source == "learning_run_grpo_mix.json" and max(curves[1].reward) == pytest.approx(1.1875)

    by_key = {(level.run, level.questions): level for level in levels}
    two = by_key[("GRPO on two-hop questions", "two-hop")]
    assert (two.n, two.warm_start, two.grpo) == (129, 0.349, pytest.approx(58 / 129))
    one = by_key[("GRPO on two-hop questions", "one-hop")]
    assert (one.n, one.warm_start, one.grpo) == (127, 0.898, pytest.approx(61 / 127))
    mix = by_key[("GRPO on the one- and two-hop mix", "all")]
    assert (mix.n, mix.warm_start, mix.grpo) == (256, 0.621, pytest.approx(0.55859375))
    # +-1 standard error of 58/129: sqrt(p (1 - p) / n) = 0.0438
    assert script.standard_error(58 / 129, 129) == pytest.approx(math.sqrt(58 / 129 * 71 / 129 / 129))
    assert script.standard_error(58 / 129, 129) == pytest.approx(0.0438, abs=1e-4)


def test_learning_curves_name_the_broken_file(tmp_path):
    script = _load("plot_learning_curves")
    for name in (script.TWO_HOP, script.TWO_HOP_EVAL_ONE_HOP, script.MIX):
        shutil.copy(DOCS / "results" / name, tmp_path / name)
    broken = json.loads((tmp_path / script.MIX).read_text())
    del broken["log_history"]
    (tmp_path / script.MIX).write_text(json.dumps(broken))
    with pytest.raises(KeyError, match="learning_run_grpo_mix.json has no log_history"):
        script.load_runs(tmp_path)
    (tmp_path / script.TWO_HOP).unlink()
    with pytest.raises(FileNotFoundError, match="learning_run_grpo_2hop.json is missing"):
        script.load_runs(tmp_path)


def test_data_flow_diagram_has_every_stage(tmp_path):
    script = _load("draw_trainer_data_flow")
    svg = script.main(["--out", str(tmp_path / "flow.svg")]).read_text()
    stages = [stage for stage, _, _ in script.STAGES]
    assert stages == ["rollout", "trajectories", "advantages", "micro-batches", "scored log-probs", "loss"]
    positions = [svg.index(f">{i + 1}. {stage}") for i, stage in enumerate(stages)]  # text kept as SVG text
    assert positions == sorted(positions)
    for _, module, _ in script.STAGES:
        assert module in svg and importlib.util.find_spec(module) is not None, module
    assert len(script.EDGES) == len(stages) - 1
    # stable output: drawing twice gives the same file, so the committed SVG only changes with the picture
    again = script.main(["--out", str(tmp_path / "again.svg")]).read_text()
    assert again == svg
    assert _png_size(script.main(["--out", str(tmp_path / "flow.png")]))[0] > 600


def test_pages_show_the_committed_figures():
    pages = {
        "search_agent.md": ["images/learning_curves.png", "images/heldout_em.png"],
        "trainer.md": ["images/trainer_data_flow.svg"],
    }
    for page, images in pages.items():
        text = (DOCS / page).read_text()
        for image in images:
            assert f"]({image})" in text, f"docs/{page} does not show {image}"
            assert (DOCS / image).is_file(), f"docs/{image} is not committed: run the script in docs/scripts/"
    assert _png_size(DOCS / "images" / "learning_curves.png")[0] > 800
    committed = (DOCS / "images" / "trainer_data_flow.svg").read_text()
    stages = _load("draw_trainer_data_flow").STAGES
    assert all(f"{i + 1}. {stage}" in committed for i, (stage, _, _) in enumerate(stages))
    # where users look for the offline default's plot
    search_agent = (DOCS / "search_agent.md").read_text()
    assert "`training_curves.png` has the GRPO optimizer step on its x axis" in search_agent


def test_learning_proof_curve_matches_the_committed_records(tmp_path):
    script = _load("plot_learning_proof")
    assert _png_size(script.main(["--out", str(tmp_path)]))[0] > 800
    seeds = script.load_points()
    warm = json.loads((DOCS / "results" / "learning_proof" / "eval_warm_start.json").read_text())
    for points in seeds.values():
        assert points[0]["step"] == 0 and points[0]["summary"] == warm["summary"]
        for p in points[1:]:
            for key in ("all", "hops_1", "hops_2"):
                q = p["paired"][key]
                assert q["n"] == warm["summary"][key]["n"]  # paired on the same questions
                assert q["b"] == pytest.approx(p["summary"][key]["exact_match"])
                assert q["ci_low"] <= q["diff"] <= q["ci_high"]
    assert seeds[0][1]["step"] == 4 and seeds[0][1]["paired"]["hops_2"]["diff"] == pytest.approx(-21 / 128)
    assert "](images/learning_proof.png)" in (DOCS / "search_agent.md").read_text()


def test_groups_figure_pairs_each_run_with_the_warm_start(tmp_path):
    script = _load("plot_learning_proof")
    script.main(["--out", str(tmp_path)])
    assert _png_size(tmp_path / "learning_proof_groups.png")[0] > 800
    runs = script.load_group_runs()
    labels = [label for label, *_ in script.GROUP_RUNS]
    for seed in (0, 1):  # the 12- and 24-group runs of both seeds are committed
        got = [p["label"] for p in runs[seed]]
        assert got[:2] == labels[:2] and got == sorted(got, key=labels.index)
    # the 24-group seed-1 run: 0.656 against 0.605 on the same 256 questions, 13 more solved
    q = runs[1][1]["paired"]["all"]
    assert q["n"] == 256 and q["diff"] == pytest.approx(13 / 256) and q["ci_low"] <= q["diff"] <= q["ci_high"]
    # the 64-group runs are paired with the warm start they started from, not the committed one
    start = json.loads((script.RESULTS / "eval_warm_start_step64_start.json").read_text())
    assert runs[0][-1]["label"] == "64 groups x 1 step"
    assert runs[0][-1]["paired"]["all"]["a"] == pytest.approx(start["summary"]["all"]["exact_match"])
    assert "](images/learning_proof_groups.png)" in (DOCS / "search_agent.md").read_text()
