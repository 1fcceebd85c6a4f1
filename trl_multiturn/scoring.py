"""Scoring a micro-batch: the log-probs (and entropies) of its completion tokens, ``(B, C)``, in the forward layout
that computes the fewest tokens.

:class:`LayoutScorer` picks, per micro-batch, one of the layouts of ``trl_multiturn.layouts``: the prefix-tree row
(``share_prompt_prefix``, when a prompt repeats: each prompt once and, past it, every long enough prefix that rows
share, e.g. the earlier turns that the per-turn rows of a trajectory repeat), packed rows (``pack_sequences``, two
rows or more) or compact rows (``compact_padding``); TRL's own ``[left-padded prompt | right-padded completion]``
forward is the trainer's fallback when :meth:`LayoutScorer.applies` says no. Every layout gives the log-probs of the
compact rows up to float error on a model whose attention is the plain causal one; :meth:`LayoutScorer.verify_once`
checks that once per layout on the model being trained (both forwards without gradient or dropout) and turns a
layout off, with a warning, when it does not hold. The prefix tree is checked twice: as the shared-prompt row
("shared", prompts only) on the first micro-batch that repeats a prompt, and again ("tree") on the first one whose
rows share tokens past their prompt, where segments attend to more ancestors than their prompt. The verdict is
collective: every rank gathers the errors and gets the same verdict, so all ranks train with the same layout (under
ZeRO-3 or FSDP every forward gathers weights from every rank, so the checks also run at the same point on every
rank: :meth:`LayoutScorer.check_rollout`).

pi_old and the training pass go through the same scorer, so a fresh ratio ``pi / pi_old`` is exactly 1.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch

from .batching import first_fit_decreasing
from .layouts import (
    MIN_SHARED_RUN, compact_rows, pack_rows, prefix_tree_row, prompt_completion_contiguous, prompt_keys,
    read_completion_columns, read_packed, scored_labels, shares_prompts,
)
from .shared_attention import SharedAttentionUnused, SharedPromptPlan, install_shared_prompt_attention

logger = logging.getLogger(__name__)

#: the layouts with a one-time check, in the order their checks run; the scorer's attribute of each is its verdict.
#: "shared" is the prefix-tree row sharing prompts only, "tree" the same row sharing every long enough prefix.
CHECKED_LAYOUTS = ("packed", "shared", "tree")
_FALLBACK_WARNINGS = {
    "packed": "pack_sequences: packed and unpacked log-probs differ by %.2e (mean) on this model (its attention does "
              "not isolate sequences by position ids); training without packing.",
    "shared": "share_prompt_prefix: log-probs with each prompt computed once differ from the plain forward by %.2e "
              "(mean) on this model (its attention has more than a causal mask: sliding window, soft-capping, sinks, "
              "or it does not run through transformers' AttentionInterface); training without prompt sharing.",
    "tree": "share_prompt_prefix: log-probs with the prefixes that rows share past their prompt computed once differ "
            "from the plain forward by %.2e (mean) on this model; sharing prompts only.",
}


#: vocabulary columns per LM-head tile of TRL's fused log-prob forward (``trl.kernels.ChunkedLogProbFunction``) on CPU.
#: TRL tiles 4096 tokens x 32768 columns, sized for GPU kernels; on CPU that tile and the temporaries of its softmax
#: fold were the largest transient of a training step: 2.5 GiB above the step's baseline for 2000 tokens of a
#: 49k vocabulary, forward and backward, against 0.6 GiB with 4096 columns, which was not slower (measured with
#: 1 torch thread). The tiles are folded with an online softmax, so only the float rounding of the log-normalizer
#: depends on the width; pi_old and the training pass use the same width, so a fresh ratio stays exactly 1.
CPU_LOGPROB_CHUNK = 4096


@contextmanager
def lm_head_chunk(size: int | None):
    """Within the block, TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) projects at most ``size``
    vocabulary columns per tile (None: TRL's own width). The width is read when the forward is called and kept for
    its backward."""
    from trl.trainer import utils as trl_utils

    name = "_CHUNKED_LOGPROB_CHUNK_SIZE"
    original = getattr(trl_utils, name, None)
    if size is None or original is None or original <= size:
        yield
        return
    setattr(trl_utils, name, size)
    try:
        yield
    finally:
        setattr(trl_utils, name, original)


@contextmanager
def lm_head_on_labelled_positions(device: torch.device):
    """Within the block, TRL's fused LM head projects only the positions whose next-token label is not -100, on CPU
    too.

    TRL projects every position on devices without Triton (a fixed tile shape spares compilers such as Neuron's a
    recompilation per batch) and zeroes the masked ones afterwards. Here the masked positions are the prompts and the
    observations, about three quarters of a multi-turn micro-batch: on CPU their projection onto the 49k vocabulary
    (forward, the backward's recompute and its input gradient) made a SmolLM2 training micro-batch 1.15x slower
    (benchmarks/lm_head_positions.py), for values thrown away. Each position's log-prob is computed alone (a row of a
    matmul against the head's tiles), so the kept positions' values and gradients are those of TRL's path (tested).
    On Triton devices TRL already does this; other devices are left as TRL has them."""
    from trl.trainer import utils as trl_utils

    original = getattr(trl_utils, "_use_triton", None)
    if device.type != "cpu" or original is None:
        yield
        return
    trl_utils._use_triton = lambda dev: dev.type == "cpu" or original(dev)
    try:
        yield
    finally:
        trl_utils._use_triton = original


def unwrap(model):
    """The model inside DDP / DeepSpeed wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def full_attention(model) -> bool:
    """Whether every layer of ``model`` has full causal attention (no sliding-window or linear-attention layers)."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    return all(t == "full_attention" for t in layer_types)


def varlen_attention(model) -> bool:
    """Whether the model's attention runs packed sequences as variable-length ones (flash-attention kernels)."""
    implementation = str(getattr(getattr(unwrap(model), "config", None), "_attn_implementation", "") or "")
    return "flash" in implementation


class LayoutScorer:
    """Per-token log-probs of completion tokens in the cheapest layout that the one-time checks allowed.

    Attributes:
        packed, shared: the verdicts of ``pack_sequences`` and ``share_prompt_prefix`` on this model: None until
            checked, then True (used) or False (turned off).
        tree: the verdict of sharing prefixes past the prompts (``share_prompt_prefix``'s prefix tree), checked on
            the first micro-batch (or, on several processes, rollout) whose rows share one; while it is not True,
            the rows share their prompts only.
        min_shared: the prefix tree's shortest shared run past a prompt
            (``trl_multiturn.layouts.MIN_SHARED_RUN``).
        checking: True while a one-time check runs its forwards (lets profilers tell them from training).
    """

    def __init__(self, accelerator, args):
        self.accelerator, self.args = accelerator, args
        self.packed: bool | None = None
        self.shared: bool | None = None
        self.tree: bool | None = None
        self.min_shared = MIN_SHARED_RUN
        self.checking = False
        self._rows: dict = {}  # min_shared -> (input_ids, attention_mask, keys, width, its prefix-tree row)

    # ------------------------------------------------------------------ which layout
    def applies(self, attention_mask: torch.Tensor, width: int, compute_aux_loss: bool, multimodal: dict) -> bool:
        """Whether these rows go through the scorer: ``compact_padding`` is on, no MoE aux loss or multimodal input,
        and every row's mask is ``[0* 1* | 1* 0*]`` (no holes)."""
        return bool(self.args.compact_padding and not compute_aux_loss and all(v is None for v in multimodal.values())
                    and prompt_completion_contiguous(attention_mask, width))

    def sharing_planned(self) -> bool:
        """Whether micro-batches can be planned for the shared-prompt forward (on, and its check passed)."""
        return bool(self.args.share_prompt_prefix and self.args.compact_padding and self.shared)

    def planned_layouts(self) -> tuple[bool, bool, bool, int | None]:
        """``(compact, pack, share, min_shared)``: the layouts the training forward may use (not turned off by a
        check); ``min_shared`` is the prefix tree's shortest shared run past a prompt, None when it shares prompts
        only."""
        compact = bool(self.args.compact_padding)
        share = compact and self.args.share_prompt_prefix and self.shared is not False
        return (compact, compact and self.args.pack_sequences and self.packed is not False, share,
                self.min_shared if share and self.tree is not False else None)

    def _choose(self, model, input_ids, attention_mask, width, rows, keys, training) -> str:
        if keys is not None and shares_prompts(keys):
            deep = self._tree_row(input_ids, attention_mask, width, keys, self.min_shared).shares_past_prompts
            self._verify_here({"shared", "tree"} if deep else {"shared"}, model, input_ids, attention_mask, width,
                              keys, training)
            if self.shared:
                return "tree" if deep and self.tree else "shared"
        if self.args.pack_sequences and rows.ids.size(0) >= 2:
            self._verify_here({"packed"}, model, input_ids, attention_mask, width, keys, training)
            if self.packed:
                return "packed"  # a single row has nothing to pack (and pi_old and the loss must agree on every row)
        return "compact"

    def _verify_here(self, layouts, model, input_ids, attention_mask, width, keys, training) -> None:
        """Check the layouts of ``layouts`` not checked yet. A single process checks on this micro-batch (packing only
        in training), so pi_old and the training pass of a micro-batch use the same verdict; several processes
        wait for :meth:`check_rollout`."""
        unchecked = {name for name in layouts if getattr(self, name) is None and (training or name != "packed")}
        if unchecked and self.accelerator.num_processes == 1:
            self.verify_once(model, input_ids, attention_mask, width, keys, unchecked)

    def _tree_row(self, input_ids, attention_mask, width, keys, min_shared):
        """``prefix_tree_row`` of these rows, built once per micro-batch: choosing the layout needs it, and so does the
        forward that follows with the same tensors."""
        last = self._rows.get(min_shared)
        if (last is not None and last[0] is input_ids and last[1] is attention_mask and last[2] is keys
                and last[3] == width):
            return last[4]
        row = prefix_tree_row(input_ids, attention_mask, width, keys, min_shared)
        self._rows[min_shared] = (input_ids, attention_mask, keys, width, row)
        return row

    # ------------------------------------------------------------------ scoring
    def score(self, model, input_ids, attention_mask, width, batch_size=None, compute_entropy=False, training=True,
              scored=None):
        """``(log-probs (B, C), entropies (B, C) or None)`` of the completion columns of rows in TRL's layout
        (``input_ids``, ``attention_mask``: (B, P + C); ``width``: C), ``batch_size`` rows per forward; 0 where a
        completion column is padding. ``training``: whether the policy is in training mode. ``scored`` (B, C): the
        completion columns whose values are wanted (the loss's tokens: observations are context), None for all; the
        LM head projects only those, and the others are 0."""
        batch_size = batch_size or input_ids.size(0)
        on_cpu = input_ids.device.type == "cpu"
        with lm_head_chunk(CPU_LOGPROB_CHUNK if on_cpu else None), lm_head_on_labelled_positions(input_ids.device):
            return self._score(model, input_ids, attention_mask, width, batch_size, compute_entropy, training, scored)

    def _score(self, model, input_ids, attention_mask, width, batch_size, compute_entropy, training, scored):
        sharing = bool(self.args.share_prompt_prefix) and self.shared is not False and width > 0
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]  # (b, P+C)
            keys = prompt_keys(ids[:, :-width], mask[:, :-width]) if sharing else None
            rows = compact_rows(ids, mask, width)
            wanted = None if scored is None else scored[start : start + batch_size].bool() & rows.valid  # (b, C)
            layout = self._choose(model, ids, mask, width, rows, keys, training)
            try:
                lp, ent = self._forward(layout, model, ids, mask, width, rows, keys, compute_entropy, wanted)  # (b, C)
            except SharedAttentionUnused:
                self.shared = False
                logger.warning("share_prompt_prefix: the model's attention does not run through transformers' "
                               "AttentionInterface (e.g. attn_implementation='eager'; use 'sdpa'); training without "
                               "prompt sharing.")
                layout = self._choose(model, ids, mask, width, rows, None, training)
                lp, ent = self._forward(layout, model, ids, mask, width, rows, None, compute_entropy, wanted)
            logps.append(lp.masked_fill(~rows.valid, 0.0))
            entropies.append(ent.masked_fill(~rows.valid, 0.0) if compute_entropy else None)
        return torch.cat(logps, dim=0), (torch.cat(entropies, dim=0) if compute_entropy else None)

    def _forward(self, layout, model, input_ids, attention_mask, width, rows, keys, compute_entropy, scored=None):
        """(b, C) log-probs and entropies (or None) of the completion columns, forwarded in ``layout``; with
        ``scored`` (b, C), those columns only (0 elsewhere)."""
        if layout in ("shared", "tree"):
            row = self._tree_row(input_ids, attention_mask, width, keys, self.min_shared if layout == "tree" else None)
            labels = row.labels if scored is None else scored_labels(row.labels, row.cols + 1, scored)  # (1, L)
            return self._shared_forward(model, row, compute_entropy, labels)
        labels = rows.labels if scored is None else scored_labels(rows.labels, rows.index, scored)  # (b, W)
        if layout == "packed":
            lengths = rows.mask.sum(1).tolist()
            capacity = sum(lengths) if varlen_attention(model) else rows.ids.size(1)  # flash kernels: one row
            packed = pack_rows(rows.ids, labels, lengths, first_fit_decreasing(lengths, capacity))
            with self.accelerator.autocast():
                out = model(input_ids=packed.ids, position_ids=packed.positions, labels=packed.labels,
                            fused_lm_head=True)
            read = lambda values: read_completion_columns(read_packed(values, packed), rows.index)  # noqa: E731
        else:
            with self.accelerator.autocast():
                out = model(input_ids=rows.ids, attention_mask=rows.mask, labels=labels, fused_lm_head=True)
            read = lambda values: read_completion_columns(values, rows.index)  # noqa: E731
        return read(out.log_probs), (read(out.entropy) if compute_entropy else None)

    def _shared_forward(self, model, row, compute_entropy, labels=None):
        """A prefix-tree row (``trl_multiturn.layouts.PrefixTreeRow``) through the model, its attention run by
        ``trl_multiturn.shared_attention``; raises :class:`SharedAttentionUnused` when the model's layers did not call
        it. Rows that share a prefix read the same output columns: the gather adds their gradients up."""
        plan = SharedPromptPlan(row.segments)
        base = unwrap(self.accelerator.unwrap_model(model))
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        install_shared_prompt_attention(base.config.get_text_config()._attn_implementation)
        # a 4-D mask is taken as prepared by transformers' mask functions (no (L, L) mask is built); the attention
        # ignores it and uses the plan
        no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=row.ids.device)
        with self.accelerator.autocast():
            out = model(input_ids=row.ids, attention_mask=no_mask, position_ids=row.positions,
                        labels=row.labels if labels is None else labels, fused_lm_head=True, shared_prompt_plan=plan)
        if plan.calls == 0:
            raise SharedAttentionUnused
        return out.log_probs[0][row.cols], (out.entropy[0][row.cols] if compute_entropy else None)  # (b, C)

    # ------------------------------------------------------------------ the one-time checks
    def check_rollout(self, model, batch: dict) -> None:
        """The one-time checks of the layouts still unchecked, on every rank at the same point (after the first
        training rollout) with the same forwards. Each rank checks rows of its own rollout: while sharing past the
        prompts is unchecked, rows that share tokens past their prompt when it has some (:func:`deep_check_rows`);
        otherwise the first prompt that repeats (up to 4 of its rows), or its first row twice, which repeats its
        prompt too. "tree" is checked at the first rollout where some rank has such rows (the other ranks run the
        same forwards on theirs, which do not count)."""
        a = self.args
        wanted = {"packed": a.pack_sequences, "shared": a.share_prompt_prefix,
                  "tree": a.share_prompt_prefix and self.shared is not False and self.min_shared is not None}
        layouts = {name for name, on in wanted.items() if a.compact_padding and on and getattr(self, name) is None}
        if not layouts:
            return
        keys = prompt_keys(batch["prompt_ids"], batch["prompt_mask"])
        rows = None
        if "tree" in layouts:  # the same on every rank (verdicts are collective), and so is this gather
            rows = deep_check_rows(keys, batch["completion_ids"], batch["completion_mask"], self.min_shared)
            acc = self.accelerator
            if not int(acc.gather(torch.tensor([int(rows is not None)], device=acc.device)).sum()):
                layouts.discard("tree")  # no rank shares past a prompt in this rollout: no check to run yet
                if not layouts:
                    return
        if rows is None:
            repeated = next((k for k, n in Counter(keys).items() if n > 1), None)
            rows = [i for i, k in enumerate(keys) if k == repeated][:4] if repeated is not None else [0, 0]
        index = torch.tensor(rows, device=batch["prompt_ids"].device)
        input_ids = torch.cat([batch["prompt_ids"][index], batch["completion_ids"][index]], dim=1)  # (b, P+C)
        attention_mask = torch.cat([batch["prompt_mask"][index], batch["completion_mask"][index]], dim=1)  # (b, P+C)
        width = batch["completion_ids"].size(1)
        # The rollout's rows are always contiguous, so every rank runs the same forwards; elsewhere a rank agrees.
        self.verify_once(model, input_ids, attention_mask, width, [keys[i] for i in rows], layouts,
                         run=prompt_completion_contiguous(attention_mask, width))

    def verify_once(self, model, input_ids, attention_mask, width, keys, layouts: set[str], run: bool = True) -> None:
        """The equivalence check of every layout in ``layouts`` against compact rows, on these rows, and its verdict.
        Collective: every rank calls it with the same ``layouts`` (``run=False``: this rank has no rows to check and
        agrees); the verdict comes from the largest error against its tolerance over the ranks that checked it, and
        a layout that no rank could check on its rows (no completion token; "tree": rows that share nothing past
        their prompts) stays unchecked."""
        if layouts & {"shared", "tree"} and not full_attention(self.accelerator.unwrap_model(model)):
            # sliding-window / linear-attention layers: never shared (the same on every rank)
            self.shared = self.tree = False
            layouts = layouts - {"shared", "tree"}
        if not layouts:
            return
        mine = self._layout_errors(layouts if run else set(), model, input_ids, attention_mask, width, keys)
        acc = self.accelerator
        table = acc.gather(torch.tensor([mine], dtype=torch.float64, device=acc.device))  # (ranks, layouts, 3)
        worst = (table[..., 0] / table[..., 1]).max(0).values.tolist()  # (layouts,) over ranks
        error = table[..., 0].max(0).values.tolist()  # (layouts,)
        checked = table[..., 2].sum(0).tolist()  # (layouts,) ranks that ran the check
        for k, name in enumerate(CHECKED_LAYOUTS):
            if name in layouts and checked[k] > 0:
                setattr(self, name, worst[k] < 1)
                if not getattr(self, name):
                    logger.warning(_FALLBACK_WARNINGS[name], error[k])

    def _layout_errors(self, layouts, model, input_ids, attention_mask, width,
                       keys) -> list[tuple[float, float, float]]:
        """Per name of ``CHECKED_LAYOUTS``: (mean absolute log-prob difference between that layout and compact rows,
        tolerance, 1 if this check counts else 0), ``(0, 1, 0)`` for a layout not in ``layouts``; infinite when the
        shared-prompt attention did not run. "tree" counts only on rows that share tokens past their prompt (its
        forward runs anyway, so that every rank runs the same forwards). All forwards without gradient and dropout;
        the compact reference is computed once for all layouts. A leaking mask changes log-probs by O(1)."""
        rows = compact_rows(input_ids, attention_mask, width)
        out = [(0.0, 1.0, 0.0)] * len(CHECKED_LAYOUTS)
        if not layouts or not rows.valid.any():
            return out
        self.checking, was_training = True, model.training
        model.eval()  # both forwards without dropout (LoRA / attention dropout would differ between them)
        try:
            with torch.no_grad():
                plain, _ = self._forward("compact", model, input_ids, attention_mask, width, rows, keys, False)
                half = bool(self.args.bf16 or self.args.fp16) or plain.dtype != torch.float32
                for k, layout in enumerate(CHECKED_LAYOUTS):
                    if layout not in layouts:
                        continue
                    counts = 1.0
                    if layout in ("shared", "tree"):
                        if keys is None or min(len(key) for key in keys) < 2:
                            continue  # a one-token prompt is never shared (shares_prompts)
                        if layout == "tree":
                            row = self._tree_row(input_ids, attention_mask, width, keys, self.min_shared)
                            counts = float(row.shares_past_prompts)
                    try:
                        other, _ = self._forward(layout, model, input_ids, attention_mask, width, rows, keys, False)
                        error = float((plain - other)[rows.valid].abs().mean())
                    except SharedAttentionUnused:
                        error = float("inf")
                    out[k] = (error, 5e-2 if half else 1e-3, counts)
        finally:
            self.checking = False
            model.train(was_training)
        return out


def deep_check_rows(keys: list, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                    min_shared: int) -> list[int] | None:
    """Rows of a rollout on which to check sharing past the prompts, or None when no two rows of a prompt share a
    run of ``min_shared`` tokens past it or one continues the other (the prefix tree would share nothing past the
    prompts). The first such pair, with up to two other rows of its prompt: one before it, so that the pair's
    segments attend to ancestors that are not adjacent in the row, as in a real micro-batch."""
    completions = [c[m.bool()].tolist() for c, m in zip(completion_ids, completion_mask)]
    members: dict = defaultdict(list)
    for i, key in enumerate(keys):
        members[key].append(i)
    for rows in members.values():
        for b_pos, b in enumerate(rows):
            for a in rows[:b_pos]:
                k = min(min_shared, len(completions[a]), len(completions[b]))
                if k and completions[a][:k] == completions[b][:k]:
                    others = [i for i in rows if i not in (a, b)]
                    return others[:1] + [a, b] + others[1:2]
    return None


@contextmanager
def reference_model(trainer, reference: bool = True):
    """The model to score with: the policy, or (``reference``) the KL's reference as TRL picks it: ``ref_model`` when
    there is one, else the policy with its ``"ref"`` adapter (the frozen copy TRL makes of a pretrained adapter, e.g.
    a warm start) or with its adapters disabled (the base model under a new adapter)."""
    if not reference:
        yield trainer.model
        return
    if trainer.ref_model is not None:
        yield trainer.ref_model
        return
    from trl.trainer.utils import use_adapter

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    with use_adapter(unwrapped, adapter_name="ref" if "ref" in getattr(unwrapped, "peft_config", {}) else None):
        yield trainer.model
