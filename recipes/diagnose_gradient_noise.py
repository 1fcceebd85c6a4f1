"""How noisy is one GRPO step's gradient, and how many prompts does a step need for it to point somewhere?

    python recipes/diagnose_gradient_noise.py --adapter outputs/warm_start/sft_adapter \
        --num_prompts 32 --group_size 8 --output_json docs/results/gradient_noise_warm_start.json

Draws ``num_prompts`` training questions of the learning run's offline knowledge base (recipes/configs/
learning_run.yaml: 600 entities, the first 2,000 training questions; never the held-out split), rolls out
``group_size`` trajectories per question at the training temperature with the package's rollout
(``MultiTurnRollout`` + ``TransformersGenerator`` + ``SearchEnvironment``, the recipe's settings) and scores them
with ``exact_match_reward``. Then, per group g (one question's G trajectories):

    A_g      = group_advantages(r_g)                                       (G,) GRPO, std-normalized
    g_g      = grad_theta sum_{b in g} (1/N_b) sum_t -A_b rho_bt           rho = exp(logp - logp.detach()) = 1

with ``policy_loss`` (``seq-mean-token-mean``, ``global_num_sequences=1``) over the trainable (LoRA) parameters,
on-policy (the old log-probs are the detached current ones, so the ratio is exactly 1 and nothing is clipped), log-probs
under ``logits / temperature`` as the trainer takes them, dropout off (``disable_dropout``), trajectories cut by the
token budget carrying no loss (``mask_truncated_completions``, as the learning run). A step over a set S of groups
takes the gradient ``sum_{g in S} g_g / |trajectories with loss tokens|``: its direction is that of the sum.
Groups whose rewards are all equal have A = 0 and exactly zero gradient: they are counted, not differentiated.

With K the Gram matrix of the group gradients that carry signal (K_ij = <g_i, g_j>), for batch sizes
b = 1, 2, 4, ... up to half of them, ``splits`` random draws of two DISJOINT sets A, B of b groups give
``cos(sum_A, sum_B) = 1_A' K 1_B / sqrt(1_A' K 1_A * 1_B' K 1_B)`` (mean, std, fraction > 0), and the cosine of each
half with the sum over all groups. If the group gradients were independent draws with mean mu and noise of total
variance V, ``cos(b) ~ b m / (b m + d - m)`` with ``m = |mu|^2`` (the mean off-diagonal of K) and ``d - m = V``
(the mean diagonal minus m): ``b = (d - m) / m`` groups give a cosine of 0.5 (``noise_model``), an estimate beyond the measured b.

Writes the settings, the summary, the cosine table, K, and every group's record (question id, hops, rewards,
advantages, gradient norm) to ``--output_json`` and prints a short table.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from trl import ModelConfig, TrlParser

from trl_multiturn.advantages import group_advantages
from trl_multiturn.generation import SamplingParams, TransformersGenerator
from trl_multiturn.loss import policy_loss, sampler_learner_gap
from trl_multiturn.protocols import TagProtocol
from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig
from trl_multiturn.search import SearchEnvironment
from trl_multiturn.search.rewards import exact_match_reward
from trl_multiturn.trajectory import Trajectory

_spec = importlib.util.spec_from_file_location("search_agent_recipe", Path(__file__).with_name("search_agent.py"))
recipe = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("search_agent_recipe", recipe)
_spec.loader.exec_module(recipe)

# The learning run's LoRA (recipes/configs/learning_run.yaml), attached fresh when no --adapter is given.
LORA = dict(r=32, lora_alpha=64, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class DiagnoseArguments:
    """> Parameters of the gradient-noise diagnostic (defaults: recipes/configs/learning_run.yaml)."""

    model: str | None = field(default=None, metadata={"help": "Base model path (default: the offline SmolLM2-135M-Instruct)."})
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter to differentiate (e.g. outputs/warm_start/sft_adapter); without it a fresh LoRA of the learning run's shape on the base model."})
    num_prompts: int = field(default=32, metadata={"help": "Training questions drawn (one group each)."})
    group_size: int = field(default=8, metadata={"help": "Trajectories per question (num_generations)."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of the rollout; log-probs are taken under logits / temperature."})
    max_turns: int = field(default=4, metadata={"help": "Maximum actions per trajectory."})
    max_completion_length: int = field(default=1024, metadata={"help": "Token budget of a trajectory (actions and observations)."})
    max_tokens_per_turn: int = field(default=96, metadata={"help": "Token cap of one turn."})
    max_observation_tokens: int = field(default=256, metadata={"help": "Observations are cut to this many tokens."})
    topk: int = field(default=3, metadata={"help": "Documents returned per search."})
    offline_entities: int = field(default=600, metadata={"help": "People in the generated knowledge base (the learning run's 600)."})
    num_train_questions: int = field(default=2000, metadata={"help": "Training questions of the learning run the prompts are drawn from."})
    question_hops: str = field(default="all", metadata={"help": "Draw only questions with this many hops: '1', '2' or 'all'."})
    mask_truncated_completions: bool = field(default=True, metadata={"help": "Trajectories cut by the token budget carry no loss (the learning run's setting)."})
    seed: int = field(default=0, metadata={"help": "Seed of the question draw, the sampling and the splits."})
    splits: int = field(default=200, metadata={"help": "Random pairs of disjoint group sets per batch size."})
    rollout_groups: int = field(default=8, metadata={"help": "Groups rolled out together (memory: the K/V of rollout_groups x group_size trajectories)."})
    output_json: str | None = field(default=None, metadata={"help": "Write the settings, summary, cosine table, Gram matrix and per-group records here."})


# ---------------------------------------------------------------------------------------------------------------
# statistics of a Gram matrix (pure)
# ---------------------------------------------------------------------------------------------------------------
def set_cosine(gram: np.ndarray, a: Sequence[int], b: Sequence[int]) -> float:
    """Cosine between ``sum_{i in a} g_i`` and ``sum_{j in b} g_j`` from the Gram matrix ``gram`` (n, n) of the g's;
    NaN when either sum is the zero vector. Index sets may overlap (``a == b`` gives 1)."""
    u = np.zeros(gram.shape[0])  # (n,) indicator of a
    v = np.zeros(gram.shape[0])  # (n,) indicator of b
    np.add.at(u, np.asarray(a, dtype=int), 1.0)
    np.add.at(v, np.asarray(b, dtype=int), 1.0)
    dot, nu, nv = u @ gram @ v, u @ gram @ u, v @ gram @ v  # (), (), ()
    if nu <= 0 or nv <= 0:
        return float("nan")
    return float(np.clip(dot / math.sqrt(nu * nv), -1.0, 1.0))


def batch_sizes(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n // 2``, and ``n // 2`` itself when it is not a power of two."""
    sizes = [2**k for k in range(int(math.log2(n // 2)) + 1)] if n >= 2 else []
    return sizes + ([n // 2] if sizes and sizes[-1] != n // 2 else [])


def split_cosines(gram: np.ndarray, splits: int, seed: int = 0) -> list[dict]:
    """For each b of :func:`batch_sizes`: ``splits`` draws of two disjoint sets A, B of b indices; the mean, std and
    fraction > 0 of ``cos(sum_A, sum_B)``, and the mean and std of ``cos(sum_half, sum_all)`` over both halves."""
    n = gram.shape[0]
    rng = np.random.default_rng(seed)
    everything = list(range(n))
    rows = []
    for b in batch_sizes(n):
        pair, full = [], []
        for _ in range(splits):
            perm = rng.permutation(n)
            a, c = perm[:b], perm[b : 2 * b]
            pair.append(set_cosine(gram, a, c))
            full += [set_cosine(gram, a, everything), set_cosine(gram, c, everything)]
        pair_a, full_a = np.array(pair), np.array(full)  # (splits,), (2 splits,)
        rows.append({"b": b, "splits": splits, "cos_mean": float(np.nanmean(pair_a)),
                     "cos_std": float(np.nanstd(pair_a)), "frac_positive": float(np.mean(pair_a > 0)), "cos_full_mean": float(np.nanmean(full_a)),
                     "cos_full_std": float(np.nanstd(full_a))})
    return rows


def noise_model(gram: np.ndarray, sizes: Sequence[int] = ()) -> dict:
    """Independent group gradients g_i = mu + noise: ``m`` = mean off-diagonal of K (estimates |mu|^2), ``d`` = mean
    diagonal (|mu|^2 + V); the expected-value estimate ``b m / (b m + d - m)`` of the split cosine for each b of
    ``sizes`` and of 1, 2, 4, ..., 512, and the b where it reaches 0.5, ``(d - m) / m`` (None when m <= 0: no common
    direction is measurable)."""
    n = gram.shape[0]
    d = float(np.mean(np.diag(gram))) if n else float("nan")  # () |mu|^2 + V
    m = float((gram.sum() - np.trace(gram)) / (n * (n - 1))) if n >= 2 else float("nan")  # () |mu|^2
    ok = n >= 2 and m > 0
    sizes = sorted(set(sizes) | {2**k for k in range(10)})
    return {"mean_sq_norm": d, "mean_cross_dot": m, "groups": n,
            "b_for_cos_0.5": max(d - m, 0.0) / m if ok else None,
            "predicted_cos": {str(b): (b * m / (b * m + max(d - m, 0.0)) if ok else 0.0) for b in sizes}}


# ---------------------------------------------------------------------------------------------------------------
# one group's policy gradient
# ---------------------------------------------------------------------------------------------------------------
def completion_logprobs(model, traj: Trajectory, temperature: float) -> torch.Tensor:
    """(1, C) log-probs of the trajectory's completion tokens under ``log_softmax(logits / temperature)``."""
    device = next(model.parameters()).device
    ids = torch.tensor([traj.prompt_ids + traj.completion_ids], device=device)  # (1, P + C)
    c = len(traj.completion_ids)
    out = model(input_ids=ids, logits_to_keep=c + 1, use_cache=False)  # logits of the last C + 1 positions
    logits = out.logits[:, :-1].float() / temperature  # (1, C, V) position P - 1 + t predicts completion token t
    return logits.gather(-1, ids[:, -c:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (1, C)


def group_gradient(model, params: list[torch.nn.Parameter], trajs: Sequence[Trajectory], advantages: torch.Tensor,
                   temperature: float, carries_loss: Sequence[bool]) -> tuple[torch.Tensor, dict]:
    """The flattened gradient (D,) float32 of ``sum_b (1/N_b) sum_t -A_b rho_bt`` over the group's trajectories that
    carry loss (``policy_loss``, ``seq-mean-token-mean`` with ``global_num_sequences=1``, one trajectory per backward,
    so no padding), on-policy (old log-probs = detached current ones). Stats: loss tokens, the largest |ratio - 1|
    (0 on-policy) and the sampler-learner gap sums (``sampler_learner_gap``) against the rollout's log-probs."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)  # (D,)
    stats = {"loss_tokens": 0, "max_abs_ratio_minus_1": 0.0, "gap_abs_sum": 0.0, "gap_tokens": 0}
    for traj, adv, keep in zip(trajs, advantages.tolist(), carries_loss):
        if not keep or sum(traj.action_mask) == 0:
            continue
        logp = completion_logprobs(model, traj, temperature)  # (1, C)
        mask = torch.tensor([traj.action_mask], device=logp.device)  # (1, C)
        loss, st = policy_loss(logp, logp.detach(), logp.new_tensor([adv]), mask,
                               aggregation="seq-mean-token-mean", global_num_sequences=1)  # ()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        offset = 0
        for p, g in zip(params, grads):
            if g is not None:
                flat[offset : offset + p.numel()] += g.detach().reshape(-1).float().cpu()
            offset += p.numel()
        gap_abs, _, gap_n = sampler_learner_gap(torch.tensor([traj.logprobs], device=logp.device), logp.detach(), mask)
        stats["loss_tokens"] += int(st["num_tokens"])
        stats["max_abs_ratio_minus_1"] = max(stats["max_abs_ratio_minus_1"],
                                             abs(float(st["ratio_max"]) - 1), abs(float(st["ratio_min"]) - 1))
        stats["gap_abs_sum"] += float(gap_abs)
        stats["gap_tokens"] += int(gap_n)
    return flat, stats


def gram_matrix(vectors: Sequence[torch.Tensor], chunk: int = 1 << 20) -> np.ndarray:
    """(n, n) float64 Gram matrix of n flattened (D,) vectors, accumulated over column chunks."""
    n = len(vectors)
    gram = torch.zeros(n, n, dtype=torch.float64)
    if n == 0:
        return gram.numpy()
    for start in range(0, vectors[0].numel(), chunk):
        part = torch.stack([v[start : start + chunk] for v in vectors]).double()  # (n, chunk)
        gram += part @ part.T  # (n, n)
    return gram.numpy()


# ---------------------------------------------------------------------------------------------------------------
# the diagnostic
# ---------------------------------------------------------------------------------------------------------------
def load_policy(args: DiagnoseArguments):
    """Base model (+ the adapter, trainable; or a fresh LoRA of the learning run's shape), tokenizer, and the
    trainable parameters, in eval mode (dropout off)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    _, model, tokenizer = recipe.load_model(ModelConfig(model_name_or_path=args.model), None)
    if args.adapter:
        model = PeftModel.from_pretrained(model, args.adapter, is_trainable=True)
    else:
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"the adapter {args.adapter!r} has no trainable parameters; pass a LoRA adapter directory.")
    return model, tokenizer, params


def _searches(traj: Trajectory) -> int:
    """The environment's own search count (a search past the budget is an action, not a search)."""
    actions = traj.info.get("actions", [])
    return int((traj.info.get("step_info") or [{}])[-1].get("num_searches", sum(a == "tool" for a in actions)))


def _hop_fractions(groups: list[dict], key: str) -> dict:
    out = {}
    for name, hops in (("all", None), ("hops_1", 1), ("hops_2", 2)):
        gs = [g for g in groups if hops is None or g["hops"] == hops]
        if gs:
            out[name] = {"groups": len(gs), key: sum(g[key] for g in gs), "frac": sum(g[key] for g in gs) / len(gs)}
    return out


def main(args: DiagnoseArguments, reward_fn: Callable[..., list[float]] = exact_match_reward) -> dict:
    """Roll out, score, differentiate each group, measure the split cosines; returns what ``--output_json`` gets.
    ``reward_fn`` is called once with every completion (group after group) and the rows' columns as keyword lists,
    as TRL calls a reward function."""
    t_start = time.perf_counter()
    G = args.group_size
    data_args = recipe.SearchAgentArguments(dataset="offline", offline_entities=args.offline_entities,
                                            num_train_questions=args.num_train_questions,
                                            question_hops=args.question_hops, topk=args.topk)
    corpus, train_rows, _ = recipe.load_data(data_args)  # the held-out split is never used
    if args.num_prompts > len(train_rows):
        raise ValueError(f"--num_prompts {args.num_prompts} exceeds the {len(train_rows)} training questions; lower it "
                         "or raise --num_train_questions.")
    rows = random.Random(args.seed).sample(train_rows, args.num_prompts)
    retriever = recipe.build_retriever(data_args, corpus)
    model, tokenizer, params = load_policy(args)
    print(f"{len(rows)} training questions x {G} samples; {sum(p.numel() for p in params):,} trainable parameters; "
          f"torch threads {torch.get_num_threads()}", flush=True)

    # rollout: the recipe's environment, protocol and limits, sampled at the training temperature
    protocol = TagProtocol(max_observation_tokens=args.max_observation_tokens)
    protocol.validate(tokenizer)
    rollout = MultiTurnRollout(
        lambda: SearchEnvironment(retriever, topk=args.topk, max_searches=data_args.max_searches),
        protocol, tokenizer,
        RolloutConfig(max_turns=args.max_turns, max_completion_length=args.max_completion_length,
                      max_tokens_per_turn=args.max_tokens_per_turn,
                      max_context_length=getattr(model.config, "max_position_embeddings", None)),
    )
    generator = TransformersGenerator(model, tokenizer, generator=torch.Generator().manual_seed(args.seed))
    t0 = time.perf_counter()
    trajs: list[Trajectory] = []
    try:
        for start in range(0, len(rows), args.rollout_groups):
            chunk = [r for r in rows[start : start + args.rollout_groups] for _ in range(G)]
            trajs += rollout.run(chunk, generator, SamplingParams(temperature=args.temperature))
            print(f"  rollout {min(start + args.rollout_groups, len(rows))}/{len(rows)} groups "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        rollout.close()
    rollout_s = time.perf_counter() - t0

    flat_rows = [r for r in rows for _ in range(G)]
    texts = tokenizer.batch_decode([t.completion_ids for t in trajs], skip_special_tokens=True)
    columns = {k: [r.get(k) for r in flat_rows] for k in ("golden_answers", "id", "hops", "question")}
    rewards = torch.tensor(reward_fn(completions=texts, **columns), dtype=torch.float32)  # (B,)
    failed = torch.tensor([bool(t.info.get("failed")) for t in trajs])  # (B,)
    advantages = group_advantages(rewards, G, keep=~failed)  # (B,) 0 for dropped rows and equal-reward groups

    # one gradient per group with signal
    t1 = time.perf_counter()
    groups, vectors = [], []
    for g, row in enumerate(rows):
        sl = slice(g * G, (g + 1) * G)
        gt, adv = trajs[sl], advantages[sl]
        kept = [r for r, f in zip(rewards[sl].tolist(), failed[sl].tolist()) if not f]
        record = {"group": g, "id": row.get("id"), "hops": int(row.get("hops", 1) or 1),
                  "question": row.get("question"),
                  "rewards": rewards[sl].tolist(), "advantages": [round(a, 4) for a in adv.tolist()],
                  "signal": bool((adv != 0).any()), "all_correct": bool(kept) and min(kept) == max(kept) == 1.0,
                  "all_wrong": bool(kept) and min(kept) == max(kept) == 0.0,
                  "searches": [_searches(t) for t in gt], "truncated": sum(t.truncated for t in gt),
                  "failed": int(failed[sl].sum()), "grad_norm": 0.0}
        if record["signal"]:
            carries = [not f and not (args.mask_truncated_completions and t.truncated)
                       for t, f in zip(gt, failed[sl].tolist())]
            vec, stats = group_gradient(model, params, gt, adv, args.temperature, carries)
            record.update(stats, grad_norm=float(vec.double().norm()))
            if record["grad_norm"] > 0:
                record["gram_index"] = len(vectors)
                vectors.append(vec)
            print(f"  gradient {g + 1}/{len(rows)} ({record['hops']}-hop, rewards {sum(kept):.0f}/{len(kept)}): "
                  f"norm {record['grad_norm']:.3e} ({time.perf_counter() - t1:.0f} s)", flush=True)
        groups.append(record)
    gradients_s = time.perf_counter() - t1

    gram = gram_matrix(vectors)
    del vectors
    signal = [g for g in groups if "gram_index" in g]
    by_hop = {h: [g["gram_index"] for g in signal if g["hops"] == h] for h in (1, 2)}
    everything = list(range(len(signal)))
    reward_hops = {f"hops_{h}": float(np.mean([r for g in groups if g["hops"] == h for r in g["rewards"]]))
                   for h in (1, 2) if any(g["hops"] == h for g in groups)}
    gap_tokens = sum(g.get("gap_tokens", 0) for g in groups)
    summary = {
        "groups": len(groups), "trajectories": len(trajs), "reward_mean": float(rewards[~failed].mean()),
        "reward_mean_by_hops": reward_hops,
        "signal": _hop_fractions(groups, "signal"), "all_correct": _hop_fractions(groups, "all_correct"),
        "all_wrong": _hop_fractions(groups, "all_wrong"),
        "zero_variance_groups": sum(not g["signal"] for g in groups),
        "signal_groups_with_zero_gradient": sum(g["signal"] and "gram_index" not in g for g in groups),
        "groups_in_cosines": len(signal),
        "searches_per_trajectory": float(np.mean([n for g in groups for n in g["searches"]])),
        "turns_per_trajectory": float(np.mean([t.num_turns for t in trajs])),
        "truncated_frac": float(np.mean([t.truncated for t in trajs])), "failed_frac": float(failed.float().mean()),
        "max_abs_ratio_minus_1": max((g.get("max_abs_ratio_minus_1", 0.0) for g in groups), default=0.0),
        "sampler_logp_diff": (sum(g.get("gap_abs_sum", 0.0) for g in groups) / gap_tokens) if gap_tokens else None,
        "trainable_parameters": sum(p.numel() for p in params),
        "cross_hop_cosine": set_cosine(gram, by_hop[1], by_hop[2]) if by_hop[1] and by_hop[2] else None,
        "hop_cosine_with_full": {f"hops_{h}": set_cosine(gram, idx, everything) for h, idx in by_hop.items() if idx},
        "rollout_s": rollout_s, "gradients_s": gradients_s, "total_s": time.perf_counter() - t_start,
        "torch_threads": torch.get_num_threads(),
    }
    result = {"settings": asdict(args), "summary": summary,
              "cosines": split_cosines(gram, args.splits, args.seed) if len(signal) >= 2 else [],
              "noise_model": noise_model(gram, batch_sizes(len(signal))), "gram": gram.tolist(), "groups": groups}
    print_table(result)
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"written to {path}", flush=True)
    return result


def print_table(result: dict) -> str:
    s = result["summary"]
    sig = s["signal"]
    hop = lambda k: f"{sig[k]['signal']}/{sig[k]['groups']}" if k in sig else "-"  # noqa: E731
    lines = [
        f"reward {s['reward_mean']:.3f} ({', '.join(f'{k} {v:.3f}' for k, v in s['reward_mean_by_hops'].items())}); "
        f"groups with signal {hop('all')} (1-hop {hop('hops_1')}, 2-hop {hop('hops_2')}); "
        f"searches/trajectory {s['searches_per_trajectory']:.2f}",
        f"rollout {s['rollout_s']:.0f} s, gradients {s['gradients_s']:.0f} s, total {s['total_s']:.0f} s, "
        f"torch threads {s['torch_threads']}; max |ratio - 1| {s['max_abs_ratio_minus_1']:.1e}",
    ]
    if s["cross_hop_cosine"] is not None:
        lines.append(f"cos(sum 1-hop, sum 2-hop) {s['cross_hop_cosine']:.3f}")
    nm = result["noise_model"]
    half = nm["b_for_cos_0.5"]
    lines.append(f"noise model ({nm['groups']} groups): groups with signal for cos(A,B) = 0.5 ~ "
                 + (f"{half:.1f}" if half is not None else "none (no common direction measured)"))
    head = f"{'b':>4} {'cos(A,B)':>9} {'std':>6} {'P(cos>0)':>9} {'cos(A,all)':>11} {'model':>6}"
    lines += [head, "-" * len(head)]
    for r in result["cosines"]:
        pred = nm["predicted_cos"].get(str(r["b"]))
        lines.append(f"{r['b']:>4} {r['cos_mean']:>9.3f} {r['cos_std']:>6.3f} {r['frac_positive']:>9.2f} "
                     f"{r['cos_full_mean']:>11.3f} {pred if pred is not None else float('nan'):>6.3f}")
    table = "\n".join(lines)
    print("\n" + table + "\n", flush=True)
    return table


if __name__ == "__main__":
    (parsed,) = TrlParser((DiagnoseArguments,)).parse_args_and_config()
    from trl_multiturn.threads import configure_cpu_threads

    configure_cpu_threads()  # on CPU: every usable core, unless OMP_NUM_THREADS was chosen
    main(parsed)
