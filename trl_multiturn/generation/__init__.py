"""Generation backends: sample one turn for a batch of contexts, returning exact ids and their log-probs.

Two backends share one API, ``generate(contexts, max_new_tokens, params) -> list[GenerationOutput]``:

``TransformersGenerator`` is a batched sampling loop over a Hugging Face causal LM. It is ours rather than
``model.generate`` (which TRL's own multi-turn path calls once per turn) because a multi-turn rollout needs what
``generate`` does not give:

* the sampling log-prob of every token from the very logits it was sampled from (``log_softmax(logits / T)``, the
  quantity TRL and VeRL recompute as the old policy);
* stop strings checked on the decoded tail of each row (a stop string spanning several tokens is caught) and
  nothing generated for a row after it stopped;
* **no recomputation of the history across turns.** Each trajectory owns a :class:`GenerationSession` that keeps the
  K/V of every token it has seen. At turn k+1 only the tokens appended since turn k (the last sampled token, the
  observation and its template tokens) are prefilled; TRL re-prefills the whole history at every turn;
* **shared prompt prefixes computed once.** Rows that start a trajectory together and begin with the same ids
  (the system prompt and tool schema; the G copies of a GRPO prompt) share the K/V of their common prefix;
* **rows that join and leave a running batch.** Besides the batch call ``generate``, the backend exposes
  ``submit`` / ``step``: a request joins the running batch at the next decode step (its new tokens are prefilled on
  their own and its K/V merged into the batch), and a row whose turn ended leaves the batch at once, so one slow
  trajectory never holds the others back. :class:`~trl_multiturn.rollout.MultiTurnRollout` drives this from its
  main thread while environment steps run in its thread pool.

How the K/V are kept: a running batch holds, per layer, one buffer of shape (slots, H_kv, capacity, D) with every
row left-padded so that all rows end at the same column; a decode step writes one column in place, so a step never
copies the cache (transformers' ``DynamicCache`` concatenates the whole cache at every step). The model sees the
live slots and the columns of the longest live row only (views). A row that leaves stores its own K/V, without
padding, in its session, and the batch's last row moves into its slot (one row copied, the others stay put); a
row that joins is prefilled straight into a free slot. The buffers are rebuilt (every row copied) only when a
joiner finds no free slot or is longer than the columns left of the rows' end, or the last column is used; they
are rebuilt with free columns on both sides proportional to the width, so that is a few times per rollout. Padding and position ids: each row's positions count its own tokens only
(``0 .. L_i - 1``); padding columns get attention 0. When joining rows have new chunks of different lengths, a
row with a shorter chunk re-feeds the last few tokens of its history instead of padding (same compute, and every
row's K/V stays contiguous). Models whose cache is not a transformers ``Cache`` (a scripted test model), or
whose layers are not all full attention (sliding-window, linear-attention), or ``kv_reuse=False``, take the
reference path: one batch per call, full prefill of every context, nothing kept between calls.

Sampling is reproducible per trajectory: each session draws its own seed from the generator's
``torch.Generator`` when it is created (in trajectory order) and samples from its own stream (inverse-CDF, one
uniform per token), so the ids of a trajectory do not depend on which other rows shared its batch or on when its
environment answered. (The reference path samples the batch from the shared generator.)

``VLLMGenerator`` sends each turn's token-id prompts through TRL's vLLM integration (``use_vllm=True``): an
in-process ``vllm.LLM`` (colocate mode) or ``VLLMClient`` (server mode), with the protocol's stop strings and
per-row token budgets. vLLM keeps its own prefix cache, so history is not recomputed there either.

Log-prob convention: like TRL and VeRL, the log-prob is taken under the temperature-scaled distribution before
top-k / top-p filtering (greedy decoding: under the raw logits).

The package holds one concept per module (each imports only the ones listed before it):

* ``sampling.py``: ``SamplingParams``, ``GenerationOutput``, top-k / top-p / min-p filtering, EOS ids and the stop
  check, shared by both backends;
* ``kv_buffer.py``: the K/V buffers of a running batch, built on transformers' cache internals;
* ``transformers_generator.py``: ``GenerationSession`` and ``TransformersGenerator`` (running batch, reference path);
* ``vllm_generator.py``: ``VLLMGenerator`` and the ``Collectives`` it calls across ranks;
* ``merged_lora.py``: ``merged_lora``, sampling with a LoRA adapter folded into the weights and put back after.
"""

from .sampling import GenerationOutput, SamplingParams, _filter_logits, sampling_params_from_config  # noqa: F401  (_filter_logits: for tests)
from .transformers_generator import GenerationSession, TransformersGenerator
from .vllm_generator import Collectives, VLLMGenerator
from .merged_lora import can_merge_lora, merged_lora

__all__ = [
    "Collectives",
    "GenerationOutput",
    "GenerationSession",
    "SamplingParams",
    "TransformersGenerator",
    "VLLMGenerator",
    "can_merge_lora",
    "merged_lora",
]
