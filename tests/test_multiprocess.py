"""Multi-process semantics, proved on two real gloo ranks on CPU.

One ``torchrun --standalone --nproc_per_node 2`` launch of tests/multiprocess_worker.py (a module-scoped fixture,
about a minute on 2 busy cores) runs ``main`` of recipes/search_agent.py on a tiny random model in the
configurations below, plus the vLLM backend's call pattern over the real collectives; the tests read what each rank
recorded:

    run      B (prompts) x G   mini   micro/device   grad. accumulation = mini / (micro x 2 ranks)   groups
    whole    4 x 2 = 8         8      2              2                                                whole on a rank
    split    1 x 4 = 4         4      1              2                                                split over ranks
    vllm     2 x 2 = 4         4      1              2         use_vllm (server mode, stand-in engine)
    layout   as vllm, with a token budget that fits rank 0's two short trajectories in one micro-batch only
    fsdp     as whole, with FSDP declared (accelerate leaves it off on CPU): construction must refuse
    expert   as whole, one step, expert_loss_coef 0.5 with no test-only reward (advantages 0) and plain SGD: the
             update is the expert loss's alone, recomputed by the test from the draws both ranks recorded

Each run makes 2 optimizer steps (one rollout each). The recipe runs with ``--use_cpu true``: on a machine without
GPUs, accelerate only joins the torchrun processes into one gloo group when told it runs on CPU (without it every
process believes it is alone, and ``MultiTurnGRPOConfig`` refuses the batch plan computed for ``WORLD_SIZE=2``).

A test-only reward that varies with the sampled ids (tests/multiprocess_worker.py) makes the advantages non-zero on
a random model, so that "sums to zero over the group" and "the logged mean covers both ranks" can fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_multiturn.advantages import group_advantages

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
EPS = 1e-6  # MultiTurnGRPOConfig.advantage_eps

COMMON = [
    "--warm_start", "off", "--eval_before", "false", "--use_cpu", "true", "--seed", "0",
    "--offline_entities", "20", "--num_train_questions", "8", "--num_eval_questions", "4", "--eval_batch_size", "4",
    "--eval_max_tokens_per_turn", "16", "--max_steps", "2", "--max_turns", "2", "--max_completion_length", "256",
    "--max_tokens_per_turn", "16", "--max_observation_tokens", "64",
    # a random model runs every trajectory into the token budget; the recipe's default masks such trajectories out
    # of the loss, which here would leave nothing to train on
    "--mask_truncated_completions", "false",
]
RUNS = {
    "whole": {"prompts_per_rollout": 4, "num_generations": 2, "mini_batch_size": 8, "micro_batch_size": 2},
    "split": {"prompts_per_rollout": 1, "num_generations": 4, "mini_batch_size": 4, "micro_batch_size": 1},
    "vllm": {"prompts_per_rollout": 2, "num_generations": 2, "mini_batch_size": 4, "micro_batch_size": 1,
             "max_turns": 3},
    # rank 0's trajectories answer at once (~170 tokens), rank 1's search first (~260): with this budget rank 0's
    # two fit one micro-batch, rank 1's do not
    "layout": {"prompts_per_rollout": 2, "num_generations": 2, "mini_batch_size": 4, "micro_batch_size": 1,
               "max_turns": 3, "max_tokens_per_micro_batch": 400, "share_prompt_prefix": "false"},
    "fsdp": {"prompts_per_rollout": 4, "num_generations": 2, "mini_batch_size": 8, "micro_batch_size": 2,
             "fsdp": "full_shard"},
    # as whole, with the expert loss alone (no test-only reward: every advantage is 0) and plain SGD without clipping,
    # so that the update is -lr x the ranks' mean expert gradient and the test can recompute it
    "expert": {"prompts_per_rollout": 4, "num_generations": 2, "mini_batch_size": 8, "micro_batch_size": 2,
               "expert_loss_coef": 0.5, "optim": "sgd", "learning_rate": 0.1, "max_grad_norm": 0, "max_steps": 1},
}
NO_SIGNAL = ("expert",)
VLLM_RUNS = ("vllm", "layout")
VLLM_PATTERN = {
    # searches per trajectory, per rank: a trajectory with s searches takes s + 1 turns
    "uneven": {"max_turns": 4, "searches": [[0], [2, 1]]},
    "empty_rank": {"max_turns": 3, "searches": [[], [1]]},
}



class TwoRanks:
    """What the two ranks recorded: ``rank[r]["phases"][name]``, the parameter files and the output directories."""

    def __init__(self, out: Path):
        self.out = out
        self.rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]

    def phase(self, name: str, rank: int) -> dict:
        record = self.rank[rank]["phases"][name]
        assert "error" not in record, f"rank {rank} failed in {name}:\n{record['error']}"
        return record

    def both(self, name: str) -> list[dict]:
        return [self.phase(name, r) for r in range(WORLD)]

    def params(self, name: str, rank: int) -> dict:
        return torch.load(self.out / f"{name}_rank{rank}_params.pt")

    def log_history(self, name: str) -> list[dict]:
        return json.loads((self.out / name / "log_history.json").read_text())


def _argv(name: str, out: Path, model: Path) -> list[str]:
    argv = ["--model_name_or_path", str(model), "--output_dir", str(out / name), *COMMON]
    for key, value in RUNS[name].items():
        argv += [f"--{key}", str(value)]
    if name in VLLM_RUNS:
        argv += ["--use_vllm", "true", "--vllm_mode", "server"]
    return argv


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, smollm2_tokenizer) -> TwoRanks:
    from trl_multiturn.models import tiny_random_model

    root = tmp_path_factory.mktemp("multiprocess")
    model = root / "tiny"
    tiny_random_model(smollm2_tokenizer, hidden_size=32, num_layers=2).save_pretrained(model)
    smollm2_tokenizer.save_pretrained(model)
    out = root / "out"
    out.mkdir()
    spec = {
        "model": str(model),
        "out": str(out),
        "vllm_pattern": VLLM_PATTERN,
        "runs": {name: {"argv": _argv(name, out, model), "vllm": name in VLLM_RUNS, "fsdp": name == "fsdp",
                        "signal": name not in NO_SIGNAL} for name in RUNS},
    }
    (root / "spec.json").write_text(json.dumps(spec, indent=1))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               str(REPO / "tests" / "multiprocess_worker.py"), "--spec", str(root / "spec.json")]
    # its own session, so that a hang (a rank that skipped a collective call waits for ever) ends with every rank
    proc = subprocess.Popen(command, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the two ranks did not finish in 480 s:\n{stderr[-6000:]}")
    if proc.returncode != 0 or not all((out / f"rank{r}.json").exists() for r in range(WORLD)):
        pytest.fail(f"torchrun exited with {proc.returncode}:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return TwoRanks(out)


def _rollouts(ranks: TwoRanks, name: str) -> list[list[dict]]:
    """Per training rollout, the records of rank 0 and rank 1 (in rank order: TRL's gather order)."""
    r0, r1 = (p["rollouts"] for p in ranks.both(name))
    assert len(r0) == len(r1) == 2  # 2 optimizer steps, one rollout each
    return [[a, b] for a, b in zip(r0, r1)]


# ---------------------------------------------------------------------------------------------------------------
# training on two ranks
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["whole", "split"])
def test_both_ranks_trained_the_same_parameters(two_ranks, name):
    p0, p1 = two_ranks.params(name, 0), two_ranks.params(name, 1)
    assert p0["final"].keys() == p1["final"].keys() and len(p0["final"]) > 0  # the LoRA matrices
    assert all(torch.equal(p0["final"][k], p1["final"][k]) for k in p0["final"])  # bit-identical after 2 steps
    changed = [k for k in p0["final"] if not torch.equal(p0["final"][k], p0["initial"][k])]
    assert len(changed) == len(p0["final"])  # and every trainable tensor was trained


@pytest.mark.slow
def test_expert_loss_update_is_the_ranks_mean_expert_gradient(two_ranks, smollm2_tokenizer):
    """The expert loss under DDP (its second forward per micro-batch goes through the wrapped model): the ranks draw
    different expert examples (one pass between them), end with the same parameters, and the update is -lr x c x the
    mean over ranks and micro-batches of the expert NLL gradients, recomputed here from the recorded draws."""
    from peft import get_peft_model
    from trl import ModelConfig, TrlParser, get_peft_config

    from trl_multiturn import MultiTurnGRPOConfig
    from trl_multiturn.expert_loss import ExpertLoss

    knobs, ranks = RUNS["expert"], two_ranks.both("expert")
    assert all(a == 0.0 for rank in ranks for r in rank["rollouts"] for a in r["advantages"])  # no policy gradient
    draws = [[d["index"] for d in rank["expert"]["draws"] if d["step"] == 0] for rank in ranks]
    accum = ranks[0]["expert"]["accum"]
    assert accum == knobs["mini_batch_size"] // (knobs["micro_batch_size"] * WORLD) and len(draws[0]) == accum
    rows = ranks[0]["expert"]["rows"]
    drawn = [i for rank in draws for index in rank for i in index]
    assert len(set(drawn)) == min(len(drawn), len(rows))  # no example twice in one pass, across the ranks
    p0, p1 = two_ranks.params("expert", 0), two_ranks.params("expert", 1)
    assert all(torch.equal(p0["final"][k], p1["final"][k]) for k in p0["final"])

    from repo_scripts import load_recipe

    recipe = load_recipe()
    parser = TrlParser((recipe.SearchAgentArguments, MultiTurnGRPOConfig, ModelConfig))
    parser.set_defaults(**recipe.DEFAULTS)
    argv = _argv("expert", two_ranks.out, two_ranks.out.parent / "tiny")
    _, training_args, model_args = parser.parse_args_and_config(args=argv)
    _, model, _ = recipe.load_model(model_args, training_args)
    model = get_peft_model(model, get_peft_config(model_args))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in p0["initial"].items():
            params[name].copy_(value)
    model.train()
    expert = ExpertLoss([{"input_ids": i, "assistant_masks": m} for i, m in rows], 1.0, 1, accum, 0,
                        smollm2_tokenizer.pad_token_id)
    model.zero_grad()
    for rank in draws:
        for index in rank:
            (expert.nll(model, index, "cpu") / (accum * WORLD)).backward()
    step = knobs["learning_rate"] * knobs["expert_loss_coef"]
    want = {name: -step * params[name].grad for name in p0["initial"]}  # SGD without clipping: -lr x c x mean grad
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 0
    for name, value in p0["initial"].items():
        assert torch.allclose(p0["final"][name] - value, want[name], rtol=1e-3, atol=1e-3 * scale), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["whole", "split"])
def test_batch_plan_counts_the_world_size(two_ranks, name):
    knobs = RUNS[name]
    rollout = knobs["prompts_per_rollout"] * knobs["num_generations"]  # B * G, global
    accumulation = knobs["mini_batch_size"] // (knobs["micro_batch_size"] * WORLD)
    for rank in two_ranks.both(name):
        args = rank["args"]
        assert rank["num_processes"] == args["world_size"] == args["plan_world_size"] == WORLD
        assert args["per_device_train_batch_size"] == knobs["micro_batch_size"]  # micro-batch: per device
        assert args["gradient_accumulation_steps"] == args["plan_gradient_accumulation_steps"] == accumulation
        assert args["generation_batch_size"] == rollout  # the rollout: global
        for record in rank["rollouts"]:
            assert len(record["rewards"]) == rollout // WORLD  # each rank rolled out its share ...
            assert record["global_rows"] == rollout  # ... and the rewards were gathered over both
    # Every micro-batch carries the counts of its whole mini-batch over both ranks: 2 accumulation steps x 2 ranks.
    for step_chunks in zip(*(rank["chunks"] for rank in two_ranks.both(name))):
        local = [c for chunks in step_chunks for c in chunks]
        assert len(local) == WORLD * accumulation
        assert sum(c["rows"] for c in local) == knobs["mini_batch_size"]  # mini-batch: global
        assert {c["mb_num_sequences"] for c in local} == {sum(c["sequences"] for c in local)}
        assert sum(c["sequences"] for c in local) == knobs["mini_batch_size"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["whole", "split"])
def test_logged_metrics_cover_both_ranks(two_ranks, name):
    logged = [h for h in two_ranks.log_history(name) if "reward" in h]
    assert [h["step"] for h in logged] == [1, 2]
    for entry, (r0, r1) in zip(logged, _rollouts(two_ranks, name)):
        rewards = r0["rewards"] + r1["rewards"]  # B * G trajectories, both ranks
        assert entry["reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert entry["rollout/reward_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        if name == "whole":  # (in "split" rank 1 repeats rank 0's samples while ranks share one seed, see below)
            assert entry["reward"] != pytest.approx(sum(r0["rewards"]) / len(r0["rewards"]), abs=1e-4)
        tokens = r0["action_tokens"] + r1["action_tokens"]
        assert entry["rollout/assistant_tokens_mean"] == pytest.approx(sum(tokens) / len(tokens))
        turns = r0["turns"] + r1["turns"]
        assert entry["rollout/turns_mean"] == pytest.approx(sum(turns) / len(turns))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["whole", "split"])
def test_only_the_main_process_writes_the_output_directory(two_ranks, name):
    main, other = (rank["writes"] for rank in two_ranks.both(name))
    assert other == []  # rank 1 neither created nor wrote anything under output_dir
    written = {w.split(" ", 1)[1] for w in main if w.startswith("open ")}
    assert {"metrics.json", "log_history.json", "training_curves.png", "adapter/adapter_config.json",
            "adapter/README.md"} <= written
    assert (two_ranks.out / name / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_evaluation_is_sharded_and_merged(two_ranks):
    num_questions = 4
    for rank in two_ranks.both("whole"):
        assert rank["eval_rows"] == [num_questions // WORLD]  # each rank rolled out its own shard ...
        assert rank["eval_summary_n"] == num_questions  # ... and both report the merged set


# ---------------------------------------------------------------------------------------------------------------
# GRPO groups across ranks
# ---------------------------------------------------------------------------------------------------------------


def _groups(keys: list[int], size: int) -> list[list[int]]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]


@pytest.mark.slow
def test_whole_groups_stay_on_their_rank_and_are_shuffled_within_it(two_ranks):
    G = RUNS["whole"]["num_generations"]
    for r0, r1 in _rollouts(two_ranks, "whole"):
        for record in (r0, r1):
            groups = _groups(record["prompt_keys"], G)
            assert all(len(set(g)) == 1 for g in groups)  # consecutive G rows share one prompt ...
            advantages = torch.tensor(record["advantages"])
            expected = group_advantages(torch.tensor(record["rewards"]), G, eps=EPS)
            torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)  # ... complete on this rank
            assert all(abs(float(s)) < 1e-5 for s in advantages.view(-1, G).sum(1))
        assert not set(r0["prompt_keys"]) & set(r1["prompt_keys"])  # no prompt on both ranks
    for rank in two_ranks.both("whole"):
        for shuffle in rank["shuffles"]:
            perm, n = shuffle["perm"], shuffle["n"]
            assert sorted(perm) == list(range(n))  # a permutation of this rank's rows only
            for block in _groups(perm, G):  # whole groups move, members in order
                assert block[0] % G == 0 and block == list(range(block[0], block[0] + G))


@pytest.mark.slow
def test_split_groups_are_gathered_before_the_advantages(two_ranks):
    G = RUNS["split"]["num_generations"]
    for r0, r1 in _rollouts(two_ranks, "split"):
        assert len(set(r0["prompt_keys"] + r1["prompt_keys"])) == 1  # one group, half on each rank
        rewards = torch.tensor(r0["rewards"] + r1["rewards"])  # (G,) in gather order
        advantages = torch.tensor(r0["advantages"] + r1["advantages"])  # (G,)
        torch.testing.assert_close(advantages, group_advantages(rewards, G, eps=EPS), atol=1e-5, rtol=0)
        assert abs(float(advantages.sum())) < 1e-5  # zero over the group, not over each rank's share
        # what rank 0 would have computed from its own share: different numbers
        share = group_advantages(torch.tensor(r0["rewards"]), G // WORLD, eps=EPS)
        assert (share - torch.tensor(r0["advantages"])).abs().max() > 1e-3
    for rank in two_ranks.both("split"):  # no whole group on a rank: the shuffle permutes the rank's rows only
        assert all(sorted(s["perm"]) == list(range(s["n"])) for s in rank["shuffles"])


@pytest.mark.slow
def test_members_of_a_split_group_are_sampled_independently_on_each_rank(two_ranks):
    """Rank 0 holds members 0-1 of the group and rank 1 members 2-3, with the same prompt: with one sampling seed
    for every rank, member 2 repeats member 0 token for token (and 3 repeats 1), halving the group."""
    for r0, r1 in _rollouts(two_ranks, "split"):
        keys = r0["completion_keys"] + r1["completion_keys"]
        assert len(set(keys)) == len(keys)


# ---------------------------------------------------------------------------------------------------------------
# vLLM: the collective-call rule
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_vllm_generator_call_pattern_over_real_collectives(two_ranks):
    """Server mode over gloo: rank 0's trajectory ends after 1 turn, rank 1's after 3 and 2 (or rank 0 holds
    none): both ranks still make max_turns generate calls, and only the main process calls the server, with the
    rows of every rank, and only while some rank has rows."""
    for name, case in VLLM_PATTERN.items():
        r0, r1 = (two_ranks.phase("vllm_pattern", r)[name] for r in range(WORLD))
        assert r0["generate_calls"] == r1["generate_calls"] == case["max_turns"]
        assert [r0["turns"], r1["turns"]] == [[s + 1 for s in ranks] for ranks in case["searches"]]
        expected = []
        for turn in range(case["max_turns"]):
            rows = sum(1 for ranks in case["searches"] for s in ranks if s >= turn)
            if rows:
                expected.append(rows)
        assert r0["client_rows"] == expected and r1["client_rows"] == []
    assert two_ranks.phase("vllm_pattern", 0)["uneven"]["client_rows"] == [3, 2, 1]


@pytest.mark.slow
def test_trainer_with_use_vllm_rolls_out_through_vllm_generator(two_ranks):
    """With ``use_vllm=True`` (a stand-in for TRL's ``VLLMGeneration`` in server mode) the training rollouts go
    through ``VLLMGenerator``: per rollout, the weights are synced first, then every rank makes ``max_turns`` calls
    (rank 0's rows answer at once, so it has none left at turns 2 and 3), and only rank 0 calls the server."""
    max_turns = RUNS["vllm"]["max_turns"]
    per_rank = RUNS["vllm"]["prompts_per_rollout"] * RUNS["vllm"]["num_generations"] // WORLD
    expected_rows = [[per_rank, 0, 0], [per_rank, per_rank, 0]]  # rank 0 answers at turn 1, rank 1 searches once
    for rank, record in enumerate(two_ranks.both("vllm")):
        events = record["events"]
        assert not any(e["event"] == "transformers_generator" for e in events)
        rollouts = _split_at(events, "rollout")
        assert len(rollouts) == 2
        for rollout in rollouts:
            kinds = [e["event"] for e in rollout]
            assert kinds[0] == "sync_weights" and kinds.count("sync_weights") == 1  # the engine has this step's weights
            calls = [e["rows"] for e in rollout if e["event"] == "vllm_generator_call"]
            assert calls == expected_rows[rank] and len(calls) == max_turns
            server = [e["rows"] for e in rollout if e["event"] == "generate"]
            assert server == ([2 * per_rank, per_rank] if rank == 0 else [])


def _split_at(events: list[dict], marker: str) -> list[list[dict]]:
    """The events after each ``marker`` event, up to the next one."""
    out: list[list[dict]] = []
    for e in events:
        if e["event"] == marker:
            out.append([])
        elif out:
            out[-1].append(e)
    return out



# ---------------------------------------------------------------------------------------------------------------
# collective layout checks; sharded weights with the Transformers generator
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_layout_checks_reach_one_verdict_on_every_rank(two_ranks):
    """pack_sequences is checked once on a micro-batch of two rows or more. In the layout run only rank 0's first
    micro-batches hold two rows (its trajectories are short): a check on the ranks whose micro-batch qualifies would
    leave rank 1 unchecked (and deadlock under ZeRO-3 / FSDP, whose forwards are collective). Every rank checks at
    the same point and all take the same verdict; in every run the ranks agree on both layouts."""
    first = [rank["chunks"][0] for rank in two_ranks.both("layout")]  # first step's micro-batches, per rank
    assert max(c["rows"] for c in first[0]) >= 2 and max(c["rows"] for c in first[1]) == 1, first
    for name in ("layout", "whole", "split", "vllm"):
        verdicts = [rank["layouts"] for rank in two_ranks.both(name)]
        assert verdicts[0] == verdicts[1], (name, verdicts)
        assert verdicts[0]["packing"] is True, (name, verdicts)  # a random Llama isolates packed sequences
    assert two_ranks.phase("whole", 0)["layouts"]["sharing"] is True
    assert two_ranks.phase("layout", 0)["layouts"]["sharing"] is None  # share_prompt_prefix=False: never checked


@pytest.mark.slow
def test_fsdp_with_the_transformers_generator_is_refused_on_every_rank(two_ranks):
    """The Transformers generator makes a different number of forwards on each rank, and an FSDP forward gathers
    the weights from every rank: construction refuses, on both ranks, naming the fix."""
    for rank in range(WORLD):
        error = two_ranks.rank[rank]["phases"]["fsdp"].get("error", "")
        assert "ValueError: FSDP (fsdp_version=2) with use_vllm=False" in error, error[-2000:]
        assert "Set use_vllm=True" in error and "ZeRO-2" in error


def test_sharded_generation_check():
    """What each sharding allows with each generator: ZeRO-3 gathers the weights once around the rollout when
    ds3_gather_for_generation is on; FSDP cannot; the vLLM engine holds its own weights."""
    from types import SimpleNamespace

    from trl_multiturn.checks import check_sharded_generation as _check_sharded_generation

    def backend(fsdp=None, zero=0):
        return SimpleNamespace(is_fsdp=fsdp is not None, fsdp_version=fsdp, is_zero3=zero == 3)

    def args(use_vllm=False, gather=True):
        return SimpleNamespace(use_vllm=use_vllm, ds3_gather_for_generation=gather)

    for ok_args, ok_backend in [(args(), backend()), (args(), backend(zero=3)), (args(use_vllm=True), backend(fsdp=2)),
                                (args(use_vllm=True, gather=False), backend(zero=3)), (args(gather=False), backend())]:
        _check_sharded_generation(ok_args, ok_backend)
    for version in (1, 2):
        with pytest.raises(ValueError, match=f"FSDP \\(fsdp_version={version}\\) with use_vllm=False.*use_vllm=True"):
            _check_sharded_generation(args(), backend(fsdp=version))
    with pytest.raises(ValueError, match="ds3_gather_for_generation=False.*Set ds3_gather_for_generation=True"):
        _check_sharded_generation(args(gather=False), backend(zero=3))
