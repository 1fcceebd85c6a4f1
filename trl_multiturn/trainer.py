"""``MultiTurnGRPOTrainer``: TRL's ``GRPOTrainer`` with multi-turn environments, exact observation masks, group
advantages (trajectory- or turn-level) and the N_g-normalized clipped loss with mini-batch-global normalizers.

This file is the glue between TRL 1.16 and the pieces that do the work; one training step, in the order TRL calls:

    _prepare_inputs (train)          every steps_per_generation * num_iterations micro-steps:
      _generate_and_score_completions
        _run_rollout                 MultiTurnRollout.run -> list[Trajectory]          trl_multiturn.rollout
        super()                      TRL pads the trajectories (rollout_func), rewards, reference log-probs
        _replace_advantages          rollout_advantages -> (B,) or (B, C)             trl_multiturn.advantages
      shuffle_groups, [per turn: expand into one row per turn]                       trl_multiturn.turn_rows
      balanced_micro_batches, attach_normalizers                                     trl_multiturn.batching
      _score_old_logps               pi_old per micro-batch, in the training layout
    _prepare_inputs (eval)           TRL's rollout and scoring; per turn: expanded, pi_ref on the rows' contexts
    compute_loss (per micro-batch)
      _get_per_token_logps_and_entropies -> LayoutScorer.score, (b, C)                trl_multiturn.scoring
      grpo_loss                      ratio, clip, KL, aggregation                      trl_multiturn.loss
    metrics                          rollout/, env/, perf/, loss/                      trl_multiturn.metrics

Every ``GRPOConfig`` field is honored or refused at construction (``trl_multiturn.config.GRPO_FIELDS``,
``trl_multiturn.checks``); the private TRL members used here are checked by tests/test_trl_seams.py.

Departures from TRL's ``GRPOTrainer``: ``loss_aggregation`` (TRL's ``loss_type`` mapped onto it; unset, the project
default "seq-mean-token-mean" rather than TRL's "dapo") with mini-batch-global normalizers; ``advantage_eps`` (1e-6, VeRL)
replaces TRL's 1e-4; groups stay whole inside mini-batches; trajectories whose environment failed or whose reward is
not finite are dropped from the loss and from their group's baseline.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from accelerate.utils import gather_object
from trl import GRPOTrainer
from trl.distributed import DistributedBackend
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import split_tensor_dict

from . import metrics
from .activation_checkpointing import suspends_checkpointing
from .advantages import greedy_rows, rollout_advantages
from .batching import attach_normalizers, balanced_micro_batches, chunk_normalizers, chunk_tokens, shuffle_groups
from .callbacks import SkipEmptyUpdate
from .checkpointing import AtomicCheckpointMixin
from .checks import (
    check_args, check_aux_loss, check_dynamic_sampling, check_protocol, check_sharded_generation,
    dynamic_sampling_balance, ensure_pad_token, resolve_environment, reward_functions,
)
from .config import MultiTurnGRPOConfig
from .dynamic_sampling import DROP_REASONS, Selection, group_signal, merge_scored_rows, next_refill, refill_rows
from .expert_loss import expert_loss_for
from .generation import SamplingParams, TransformersGenerator, VLLMGenerator, merged_lora, sampling_params_from_config
from .loss import grpo_loss, loss_mask, loss_normalizers, sampler_learner_gap
from .host_memory import release_freed_memory
from .context import context_policy
from .protocols import Protocol
from .rollout import MultiTurnRollout, RolloutConfig
from .scoring import LayoutScorer, reference_model
from .trajectory import Trajectory, completion_tensors, rollout_fields
from .turn_rows import TurnRowRegistry, trajectory_mini_batches

logger = logging.getLogger(__name__)


def _scorer_attribute(name: str) -> property:
    """The scorer's ``name`` read and set through the trainer (tests, benchmarks and profilers read these names)."""
    return property(lambda self: getattr(self._scorer, name), lambda self, value: setattr(self._scorer, name, value))


class MultiTurnGRPOTrainer(AtomicCheckpointMixin, GRPOTrainer):
    """Multi-turn GRPO trainer.

    Args:
        model: model id, path or ``PreTrainedModel`` (as ``GRPOTrainer``).
        reward_funcs: TRL reward functions (``f(prompts, completions, completion_ids, **columns) -> list[float]``); they
            also receive the trajectory fields ``env_reward``, ``num_turns``, ``turn_rewards``, ``truncated``,
            ``final_answer``, ``stop_reason``. May be empty when the environment rewards.
        args: :class:`~trl_multiturn.config.MultiTurnGRPOConfig`.
        train_dataset / eval_dataset: rows handed to ``Environment.reset``.
        environment_factory: zero-argument callable returning a fresh environment per trajectory; either this
            package's contract (``reset(example)``/``step(action)``) or a TRL 1.16 environment class (public methods as
            tools, ``reset(**row)``, optional ``get_reward``), which is adapted and defaults to ``ChatToolProtocol``.
        protocol: how actions and observations are written (default: the environment's ``protocol`` attribute, else
            ``TagProtocol()``; ``ChatToolProtocol()`` for TRL-style environments).
        peft_config, processing_class, callbacks, optimizers, reward_processing_classes: as ``GRPOTrainer``.
        expert_dataset: expert trajectories (``trl_multiturn.sft.sft_dataset``) for ``expert_loss_coef`` > 0, whose
            teacher-forced NLL is added to the GRPO loss (``trl_multiturn.expert_loss``); refused when the coef is 0.
    """

    _packing_checked = _scorer_attribute("packed")  # pack_sequences' verdict: None until checked
    _sharing_checked = _scorer_attribute("shared")  # share_prompt_prefix's verdict: None until checked
    _in_packing_check = _scorer_attribute("checking")  # True during a one-time check's forwards

    def __init__(self, model, reward_funcs: Callable | list[Callable] | None = None,
                 args: MultiTurnGRPOConfig | None = None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 environment_factory: Callable[[], Any] | None = None, protocol: Protocol | None = None,
                 context_fn: Callable[[list[dict]], list[dict]] | None = None,
                 expert_dataset=None):
        args = check_args(args)
        factory, protocol, self._environment_name = resolve_environment(
            environment_factory, protocol, args, {"train_dataset": train_dataset, "eval_dataset": eval_dataset})
        funcs, args = reward_functions(reward_funcs, args)
        self.protocol, self._environment_factory, self._rollout_all_dropped, self._warned_budget = protocol, factory, False, False
        self._pending_trajectories: list[Trajectory] | None = None
        self._step_stats = metrics.StepStats()
        super().__init__(
            model=model, reward_funcs=funcs, args=args, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class,
            reward_processing_classes=reward_processing_classes, callbacks=callbacks, optimizers=optimizers,
            peft_config=peft_config, rollout_func=self._rollout_func,
        )
        check_sharded_generation(args, DistributedBackend(self.accelerator))
        check_aux_loss(self.aux_loss_enabled, self.model, self.router_aux_loss_coef)
        self._balance_values, self._balance_quotas = dynamic_sampling_balance(args, self.train_dataset)
        # TRL decides truncation by "last token is not EOS", wrong for tag protocols (a turn ends at </answer>)
        self._mask_truncated, self.mask_truncated_completions = bool(args.mask_truncated_completions), False
        self._scorer = LayoutScorer(self.accelerator, self.args)
        self._defer_old_logps = False  # set while TRL scores a rollout: see _get_per_token_logps_and_entropies
        ensure_pad_token(self._tokenizer)
        # validate(), then the template check (moot per turn: each turn is rendered as the template renders it)
        check_protocol(protocol, self._tokenizer, args.template_check if args.turn_layout == "sequence" else "off")
        self.rollout = MultiTurnRollout(factory, protocol, self._tokenizer, RolloutConfig(
            max_turns=args.max_turns, max_completion_length=args.max_completion_length,
            max_tokens_per_turn=args.max_tokens_per_turn, env_timeout=args.env_timeout,
            max_context_length=getattr(getattr(self.model, "config", None), "max_position_embeddings", None),
            raise_on_env_error=args.raise_on_env_error, on_long_prompt=args.on_long_prompt, turn_layout=args.turn_layout,
            context_fn=context_policy(args, self._tokenizer, context_fn), turn_reward_gate=args.turn_reward_gate))
        self._turn_rows = TurnRowRegistry() if args.turn_layout == "per_turn" else None
        self.add_callback(SkipEmptyUpdate(self))
        # One sampling stream per rank: ranks holding members of one group would otherwise sample them identically
        self._sampling_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        self._vllm_generator: VLLMGenerator | None = None
        self._expert_loss = expert_loss_for(self, expert_dataset)  # expert_loss_coef: c * L_expert, or None

    # ------------------------------------------------------------------ rollout
    def _sampling_params(self) -> SamplingParams:
        return sampling_params_from_config(self.args)

    def _run_rollout(self, inputs: list[dict]) -> list[Trajectory]:
        """Roll out one trajectory per input row with the current policy (eval mode, no gradients); in training with
        ``greedy_baseline``, each group's first row decodes greedily.

        With ``use_vllm`` the turns are sampled by TRL's vLLM engine through :class:`VLLMGenerator`, which makes
        ``max_turns`` calls on every rank (the collective-call rule). The engine gets the current weights first:
        TRL syncs them inside ``rollout_func``, which this trainer calls after the rollout.
        """
        start, on = self.accelerator.process_index * len(inputs), self.model.training and self.args.greedy_baseline
        greedy = {"greedy": greedy_rows(len(inputs), start, self.num_generations)} if on else {}  # off: the old call
        if self.use_vllm:
            if self.state.global_step != self._last_loaded_step:
                self.vllm_generation.sync_weights()
                self._last_loaded_step = self.state.global_step
            if self._vllm_generator is None:
                self._vllm_generator = VLLMGenerator.from_trl(self.vllm_generation, self._tokenizer)
            return self.rollout.run(inputs, self._vllm_generator, self._sampling_params(), **greedy)
        with unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
        ) as unwrapped, merged_lora(unwrapped, self.args.rollout_merge_adapter):  # adapter folded in when asked
            was_training = unwrapped.training
            unwrapped.eval()
            try:
                generator = TransformersGenerator(unwrapped, self._tokenizer, generator=self._sampling_generator,
                                                 max_batch_size=self.args.rollout_max_batch_size)
                return self.rollout.run(inputs, generator, self._sampling_params(), **greedy)
            finally:
                unwrapped.train(was_training)

    def _rollout_func(self, prompts, trainer) -> dict[str, list]:
        """TRL's ``rollout_func`` seam: hand over the trajectories computed for this batch."""
        trajs = self._pending_trajectories
        if trajs is None or len(trajs) != len(prompts):
            raise RuntimeError("internal: trajectories were not prepared for this batch")
        return rollout_fields(trajs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # (B_global, F), gathered over processes
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        trajs = self._run_rollout(inputs)
        release_freed_memory(collect=False)  # the rollout's K/V cache, before the training pass allocates
        inputs = [dict(x) for x in inputs]
        for x, t in zip(inputs, trajs):
            if "prompt" not in x:
                x["prompt"] = self._tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
        self._pending_trajectories = trajs
        # pi_old is scored per micro-batch in _prepare_inputs, with the training pass's own forward (TRL's pass is
        # skipped unless vLLM's importance sampling needs it); in evaluation pi_old is the loss's own forward.
        generate_every = self.args.steps_per_generation * self.num_iterations  # TRL scores pi_old when this holds:
        frozen_old = self.args.gradient_accumulation_steps % generate_every != 0
        deferred = frozen_old and not (self.use_vllm and self.vllm_importance_sampling_correction)
        self._defer_old_logps = deferred
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._pending_trajectories, self._defer_old_logps = None, False
        if deferred and mode == "eval":
            output.pop("old_per_token_logps", None)
        self._replace_advantages(output, trajs, mode)
        if self._turn_rows is not None:
            self._turn_rows.register(output, trajs)  # expanded into one row per turn in _prepare_inputs
        group = self.num_generations if mode == "train" else self.num_generations_eval
        self.last_stop_reasons = metrics.log_rollout(self._metrics[mode], trajs, self.accelerator, group)
        metrics.log_rollout_speed(self._metrics[mode], self.rollout.last_stats)
        return output

    def _replace_advantages(self, output: dict, trajs: list[Trajectory], mode: str) -> None:
        """TRL's advantages replaced by :func:`~trl_multiturn.advantages.rollout_advantages` over the gathered
        rollout; dropped (and, with ``mask_truncated_completions``, truncated) trajectories lose their loss mask."""
        acc, args, rpf = self.accelerator, self.args, self._last_rewards_per_func  # (B_global, F)
        failed = acc.gather(torch.tensor([bool(t.info.get("failed")) for t in trajs], device=acc.device))
        turn = {}
        if args.turn_advantage != "trajectory":
            width = output["completion_ids"].size(1)
            turn_ids, mask = completion_tensors(gather_object([t.turn_ids for t in trajs]),
                                                gather_object([t.action_mask for t in trajs]), width)
            turn = dict(turn_rewards=gather_object([list(t.turn_rewards) for t in trajs]), turn_ids=turn_ids,
                        action_mask=mask, gamma=args.turn_advantage_gamma, turn_weight=args.turn_advantage_weight)
        result = rollout_advantages(
            rpf, self.reward_weights, failed, self.num_generations if mode == "train" else self.num_generations_eval,
            mode=args.turn_advantage, scale=args.scale_rewards, eps=args.advantage_eps,
            greedy_baseline=mode == "train" and args.greedy_baseline, **turn)
        start = acc.process_index * len(trajs)
        local = slice(start, start + len(trajs))
        metrics.warn_dropped(trajs, result.dropped, rpf[local], list(self.reward_func_names), start,
                             self._environment_name)
        for t, r in zip(trajs, result.rewards[local].tolist()):
            t.reward = r  # NaN where dropped
        self._last_rewards = result.rewards  # (B_global,) NaN where dropped; read by dynamic sampling
        output["advantages"] = result.advantages[local].to(acc.device)  # (B_local,) or (B_local, C)
        excluded = result.dropped[local].to(acc.device).clone()  # (B_local,)
        # greedy baselines, and with mask_truncated_completions trajectories cut by a limit, carry no loss
        excluded |= torch.tensor([bool(t.info.get("greedy")) or (self._mask_truncated and t.truncated) for t in trajs],
                                 device=excluded.device)
        if excluded.any():
            output["tool_mask"] = output["tool_mask"] * (~excluded).long().unsqueeze(1)  # (B_local, C)
        trained = loss_mask(output)  # (B_local, C)
        loss_tokens = int(acc.reduce(trained.sum().to(acc.device), reduction="sum"))
        if mode == "train":  # no loss token on any rank: the update is skipped (SkipEmptyUpdate)
            self._rollout_all_dropped = loss_tokens == 0
        if loss_tokens == 0 and not bool(result.dropped.all()):
            logger.warning("No trajectory of this rollout carries loss (dropped, or masked by mask_truncated_"
                           "completions, or without a sampled token): this step's optimizer update is skipped.")
        metrics.rewrite_trained_advantages(self._logs["advantages"], output["advantages"], trained, acc)
        metrics.log_advantages(self._metrics[mode], result.dropped, result.rewards, loss_tokens,
                               self.num_generations if mode == "train" and args.greedy_baseline else None)

    # ------------------------------------------------------------------ batching
    @suspends_checkpointing  # rollouts and pi_old run without it; on again as configured (every_n_layers, policy)
    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            batch = super()._prepare_inputs(generation_batch)
            if self._turn_rows is not None:  # the per-turn objective: the rows training sees, pi_ref on their contexts
                batch = self._turn_rows.expand(batch, self._tokenizer.pad_token_id)[0]
                self._score_old_logps([batch], key="ref_per_token_logps") if self.beta != 0.0 else None
            return batch
        steps, accum = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            if self.args.dynamic_sampling:
                batch = self._dynamic_sampling_rollout(generation_batch)
            else:
                batch = self._generate_and_score_completions(generation_batch)
            batch, minis, owner = shuffle_groups(batch, self.num_generations), None, None
            if self._turn_rows is not None:  # per-turn layout: one row per turn, mini-batches of whole trajectories
                n = batch["completion_ids"].size(0)
                batch, owner = self._turn_rows.expand(batch, self._tokenizer.pad_token_id)
                minis = trajectory_mini_batches(owner, n, steps // accum)
            self._scorer.check_rollout(self.model, batch)
            if self.args.balance_micro_batches:
                budget = self.args.max_tokens_per_micro_batch
                chunks = balanced_micro_batches(batch, steps, accum, budget, self._scorer.sharing_planned(), minis,
                                                owner, self._scorer.planned_layouts()[3])
                self._warned_budget = metrics.log_micro_batches(self._metrics["train"], chunks, accum, budget,
                                                                self._warned_budget)
            else:
                chunks = split_tensor_dict(batch, steps)
            self._attach_normalizers(chunks)
            if "old_per_token_logps" in batch:  # several optimizer steps or epochs per rollout: pi_old is frozen
                self._score_old_logps(chunks)
            if self._turn_rows is not None and self.beta != 0.0:  # TRL scored the reference on whole sequences
                self._score_old_logps(chunks, key="ref_per_token_logps")
            counts = [chunk_tokens(c, *self._scorer.planned_layouts()) for c in chunks]  # (processed, real)
            metrics.log_padding(self._metrics["train"], counts, chunks, self.accelerator)
            self._buffered_inputs = chunks
        return self._buffered_inputs[self._step % steps]

    def _attach_normalizers(self, chunks: list[dict]) -> None:
        """Give each micro-batch the (sequence, token) counts of its whole mini-batch over all ranks."""
        totals = self.accelerator.reduce(chunk_normalizers(chunks, self.accelerator.device), reduction="sum")
        attach_normalizers(chunks, totals, self.args.gradient_accumulation_steps)  # totals: (chunks, 2)

    def _dynamic_sampling_rollout(self, inputs: list[dict]) -> dict:
        """``dynamic_sampling``: rounds of rollouts until every rank holds its share of groups with reward variance
        (per value of ``dynamic_sampling_balance``), at most ``max_dynamic_sampling_rounds`` refills, the same count
        on every rank; empty places get dropped groups with loss mask 0 (trl_multiturn.dynamic_sampling). Refill
        prompts are drawn with a generator seeded by (seed, global step, round, rank): a resumed run draws the same."""
        G, acc, dataset, n = self.num_generations, self.accelerator, self.train_dataset, len(inputs)
        check_dynamic_sampling(n, G, dataset)
        column, selection = self.args.dynamic_sampling_balance, Selection(quota=n // G, strata=self._balance_quotas)
        batches, rnd, sampled = [], 0, 0
        while True:
            batches.append(self._generate_and_score_completions(inputs))
            start, sampled = acc.process_index * len(inputs), sampled + len(inputs) // G
            values = None if column is None else [row[column] for row in inputs[::G]]  # each group's stratum
            selection.add_round(rnd, group_signal(self._last_rewards[start : start + len(inputs)].cpu(), G), values)
            table = acc.gather(torch.tensor([[sampled, len(selection.kept), selection.missing]], device=acc.device))
            prompts = next_refill(table, rnd, self.args.max_dynamic_sampling_rounds, n // G)  # the same on every rank
            if not prompts:
                break
            rnd += 1
            key = (self.args.seed, self.state.global_step, rnd, acc.process_index)
            index = refill_rows(key, prompts, len(dataset), self._balance_values, selection.missing_values())
            inputs = [dataset[i] for i in index for _ in range(G)]
        kept, filler = selection.rows(G)
        batch = merge_scored_rows([(batches[r], rows, True) for r, rows in kept]
                                  + [(batches[r], rows, False) for r, rows in filler], self._tokenizer.pad_token_id)
        loss_tokens = acc.reduce((batch["completion_mask"] * batch["tool_mask"]).sum(), reduction="sum")
        batch["num_items_in_batch"] = acc.reduce(batch["completion_mask"].sum(), reduction="sum")
        self._rollout_all_dropped = int(loss_tokens) == 0
        counts = [sampled, len(selection.kept), selection.surplus, sum(len(rows) for _, rows in filler) // G, rnd]
        metrics.log_dynamic_sampling(self._metrics["train"], counts + [selection.dropped[w] for w in DROP_REASONS], acc,
                                     column, {v: selection.kept_by[v] for v in selection.strata or {}})
        return batch

    def _score_old_logps(self, chunks: list[dict], key: str = "old_per_token_logps") -> None:
        """Each micro-batch's ``old_per_token_logps`` (b, C) from the call :meth:`compute_loss` makes on it (same rows,
        layout, one-time checks), before any update: a fresh ratio is exactly 1 without dropout, for one no-gradient
        forward. ``key="ref_per_token_logps"``: the reference model's, chosen as TRL does (per-turn rows are ours)."""
        with torch.no_grad(), reference_model(self, key == "ref_per_token_logps") as model:  # checkpointing is off
            for chunk in chunks:
                input_ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], dim=1)  # (b, P+C)
                attention_mask = torch.cat([chunk["prompt_mask"], chunk["completion_mask"]], dim=1)  # (b, P+C)
                chunk[key], _, _ = self._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, chunk["completion_ids"].size(1), scored_mask=loss_mask(chunk))

    # ------------------------------------------------------------------ forward and loss
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, scored_mask=None,
                                           **multimodal):
        """Per-token log-probs (and entropies) of the completion columns, (B, C), from
        :class:`~trl_multiturn.scoring.LayoutScorer` (compact, packed or shared-prompt rows); TRL's own path for rows
        it does not take (``compact_padding`` off, holes in the mask, multimodal inputs, MoE aux losses).
        ``scored_mask`` (B, C), ours: the loss's tokens; the scorer projects only those through the LM head (0 at
        the others).

        Called by TRL for pi_old over the whole rollout while ``_defer_old_logps`` is set, it returns NaN instead
        (loud if ever trained on): :meth:`_score_old_logps` scores pi_old per micro-batch."""
        if self._defer_old_logps:
            self._defer_old_logps = False  # TRL's first call in the rollout is pi_old; reference log-probs follow
            return torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device), None, None
        if not self._scorer.applies(attention_mask, logits_to_keep, compute_aux_loss, multimodal):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        logps, entropies = self._scorer.score(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                              compute_entropy, training=self.model.training, scored=scored_mask)
        return logps, entropies, None  # (B, C), (B, C) or None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("MultiTurnGRPOTrainer does not return outputs from compute_loss.")
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # (B, P+C)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)  # (B, P+C)
        mask = loss_mask(inputs)  # (B, C)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, completion_ids.size(1),
                                                              scored_mask=mask)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old  # (B, C)
        global_norm = mode == "train" and "mb_num_sequences" in inputs  # normalizers summed over all ranks
        n_seq, n_tok = ((inputs["mb_num_sequences"], inputs["mb_num_tokens"]) if global_norm
                        else loss_normalizers(mask, inputs.get("sequence_tokens")))
        loss, stats = grpo_loss(
            logps, old, inputs["advantages"], mask, ref_logprobs=inputs.get("ref_per_token_logps"),
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"), beta=self.beta,
            use_bias_correction_kl=self.args.use_bias_correction_kl, epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high, aggregation=self.args.loss_aggregation, global_num_sequences=n_seq,
            global_num_tokens=n_tok, norm_constant=float(self.args.max_completion_length), delta=self.args.delta,
            importance_sampling_level=self.args.importance_sampling_level, sequence_tokens=inputs.get("sequence_tokens"),
        )
        sampling = inputs.get("sampling_per_token_logps")  # (B, C) the generator's log-probs, NaN where unknown
        self._step_stats.add(stats, None if sampling is None else sampler_learner_gap(sampling, old, mask))
        if mode == "eval" or self.accelerator.sync_gradients:  # the mini-batch's last micro-batch
            self._step_stats.log(self._metrics[mode], self.accelerator, self.beta)
        if not global_norm:
            return loss  # evaluation: this process's own normalizers, so its own mean
        # DDP / DeepSpeed average gradients over ranks; the normalizers already span all ranks, so undo the average.
        if self._expert_loss is not None:  # a per-rank mean: the ranks' average is the intended one
            expert = self._expert_loss(model, self.state.global_step, self._metrics[mode])  # c * L_expert / accum
            return loss * self.accelerator.num_processes + expert
        return loss * self.accelerator.num_processes
