"""An expert loss next to GRPO: the teacher-forced NLL of expert trajectories added to the policy loss
(``expert_loss_coef``; InstructGPT's "PPO-ptx" adds its pretraining loss the same way).

GRPO moves the policy only where a group's rewards differ. Behaviour that every sample of a group already gets right
earns no advantage, so nothing holds it while the shared parameters move for the other groups (after a warm start,
the 1-hop "answer after the first search" of the search agent). The expert loss holds it where the expert data
shows it::

    L = L_GRPO + c * L_expert        L_expert = - 1/N sum_t m_t log p_theta(x_t | x_<t)

with ``m_t`` the action mask of the expert trajectories (the warm start's mask: prompt and observation tokens 0),
``N = sum m_t`` over one micro-batch of ``expert_micro_batch_size`` examples (SFTTrainer's token mean). Every
training micro-batch adds ``c * L_expert / gradient_accumulation_steps`` for its own expert micro-batch, so an
optimizer step adds ``c`` times the mean of its micro-batches' token means. Under DDP each rank draws other examples
and the gradients are averaged over ranks, which averages the ranks' expert losses (tests/test_multiprocess.py
recomputes the update on two ranks); DeepSpeed and FSDP are refused until checked the same way.

Examples are drawn without replacement: pass ``p`` over the dataset is a permutation seeded by ``seed`` and ``p``,
and the ``k``-th example drawn overall is position ``k mod n`` of pass ``k // n``, where ``k`` follows from the
optimizer step, the micro-batch within it and the rank. A resumed run therefore draws what the uninterrupted run
drew, and a pass sees every example once.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import selective_log_softmax


class ExpertLoss:
    """``c * L_expert / accum`` for each training micro-batch (see the module docstring).

    Args:
        dataset: rows with ``input_ids`` and ``assistant_masks`` (``trl_multiturn.sft.sft_dataset``), or a list of
            such dicts.
        coef: ``c`` (> 0).
        micro_batch_size: examples per micro-batch.
        accum: micro-batches per optimizer step (``gradient_accumulation_steps``).
        seed: seed of the passes' permutations.
        pad_token_id: the id right-padding fills in (masked out of attention and loss).
        rank, world: this process's index and the number of processes.
    """

    def __init__(self, dataset, coef: float, micro_batch_size: int, accum: int, seed: int, pad_token_id: int,
                 rank: int = 0, world: int = 1):
        rows = [(list(map(int, r["input_ids"])), list(map(int, r["assistant_masks"]))) for r in dataset]
        if not rows:
            raise ValueError("expert_dataset is empty; give expert trajectories (trl_multiturn.sft.sft_dataset) "
                             "or set expert_loss_coef=0.")
        for i, (ids, mask) in enumerate(rows):
            if len(ids) != len(mask) or sum(mask[1:]) == 0:
                raise ValueError(
                    f"expert_dataset row {i} has {len(ids)} input_ids and {len(mask)} assistant_masks with "
                    f"{sum(mask[1:])} supervised tokens after the first; every row needs equal lengths and at least "
                    "one supervised token (build it with trl_multiturn.sft.sft_dataset).")
        self.rows, self.coef, self.micro_batch_size, self.accum = rows, float(coef), micro_batch_size, accum
        self.seed, self.pad_token_id, self.rank, self.world = seed, pad_token_id, rank, world
        self._perms: dict[int, list[int]] = {}
        self._step, self._micro = None, 0

    def indices(self, step: int, micro: int) -> list[int]:
        """The examples of micro-batch ``micro`` of optimizer step ``step`` (0-based) on this rank."""
        n, b = len(self.rows), self.micro_batch_size
        first = ((step * self.accum + micro) * self.world + self.rank) * b
        return [self._permutation(k // n)[k % n] for k in range(first, first + b)]

    def _permutation(self, p: int) -> list[int]:
        if p not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + p)
            self._perms = {p: torch.randperm(len(self.rows), generator=g).tolist()}  # one pass held at a time
        return self._perms[p]

    def batch(self, index: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, loss_mask)``, each (b, L), right-padded to the longest example."""
        width = max(len(self.rows[i][0]) for i in index)
        ids = torch.full((len(index), width), self.pad_token_id, dtype=torch.long)
        attention, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
        for row, i in enumerate(index):
            tokens, mask = self.rows[i]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            attention[row, : len(tokens)] = 1
            loss_mask[row, : len(tokens)] = torch.tensor(mask)
        return ids.to(device), attention.to(device), loss_mask.to(device)

    def nll(self, model, index: list[int], device) -> torch.Tensor:
        """Token-mean negative log-likelihood of the examples ``index`` on their supervised tokens."""
        ids, attention, loss_mask = self.batch(index, device)
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]  # (b, L-1, V)
        logps = selective_log_softmax(logits.float(), ids[:, 1:])  # (b, L-1), TRL's: no second (b, L-1, V) tensor
        weights = loss_mask[:, 1:].to(logps.dtype)  # (b, L-1) the token at t+1 is predicted at t
        return -(logps * weights).sum() / weights.sum()

    def __call__(self, model, step: int, metrics: dict | None = None) -> torch.Tensor:
        """This micro-batch's ``c * L_expert / accum``; the micro-batch count restarts with each optimizer step."""
        if step != self._step:
            self._step, self._micro = step, 0
        device = next(model.parameters()).device
        nll = self.nll(model, self.indices(step, self._micro), device)
        self._micro += 1
        if metrics is not None:
            metrics.setdefault("loss/expert_nll", []).append(float(nll.detach()))
        return self.coef * nll / self.accum


def expert_loss_for(trainer, dataset) -> ExpertLoss | None:
    """The trainer's expert loss, or None when ``expert_loss_coef`` is 0; refuses a dataset it would ignore."""
    args = trainer.args
    if args.expert_loss_coef == 0.0:
        if dataset is not None:
            raise ValueError("expert_dataset was given but expert_loss_coef=0 would ignore it; set expert_loss_coef "
                             "> 0 (e.g. 0.1) or drop expert_dataset.")
        return None
    if dataset is None:
        raise ValueError(f"expert_loss_coef={args.expert_loss_coef} needs expert trajectories: pass expert_dataset= "
                         "(trl_multiturn.sft.sft_dataset of the warm start's trajectories) to MultiTurnGRPOTrainer.")
    acc = trainer.accelerator
    kind = str(acc.distributed_type).rsplit(".", 1)[-1]  # DistributedType.DEEPSPEED -> "DEEPSPEED"
    if kind in ("DEEPSPEED", "FSDP"):
        raise ValueError(f"expert_loss_coef > 0 runs on one process or under DDP (tested on two ranks); under {kind} "
                         "its second forward per micro-batch is not checked yet. Launch without DeepSpeed / FSDP "
                         "(plain `accelerate launch --multi_gpu`) or set expert_loss_coef=0.")
    return ExpertLoss(dataset, args.expert_loss_coef, args.expert_micro_batch_size,
                      args.gradient_accumulation_steps, args.seed, trainer._tokenizer.pad_token_id,
                      acc.process_index, acc.num_processes)
