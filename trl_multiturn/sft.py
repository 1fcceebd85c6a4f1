"""Multi-turn supervised fine-tuning: gold trajectories as token sequences with exact masks, trained by TRL.

Single-turn SFT maximizes ``log p(answer | prompt)`` under teacher forcing. Multi-turn SFT does the same for every
assistant turn of a gold trajectory ``tau = (u_1, a_1, u_2, a_2, ..., u_K, a_K)``: the whole trajectory is forwarded
once, the history of each turn being the gold one, and the loss is the mean negative log-likelihood of the assistant
tokens ``a_k`` only::

    L_SFT = - 1/N sum_{trajectories} sum_t m_t log p_theta(x_t | x_<t)        N = sum m_t over the batch

There is no reward and no credit assignment: every assistant token is pushed up by the same weight. The mask ``m_t``
is the action mask of RL (:class:`~trl_multiturn.trajectory.Trajectory`): 1 on tokens the model must produce, 0 on
the prompt, observations, tool results and the template tokens around them. Gold data becomes ``Trajectory``
objects in three ways:

* :func:`trajectory_from_messages` -- a chat conversation (system / user / assistant / tool messages, assistant
  messages possibly with ``tool_calls``) rendered through the chat template. The ids are the template's one-shot
  rendering; the mask comes from rendering the conversation incrementally and diffing the prefixes. Each assistant
  message is mask 1 up to and including the EOS that closes it; the template tokens that open it
  (``<|im_start|>assistant\\n``) and everything after the EOS are mask 0.
* :func:`trajectory_from_tag_text` -- a Search-R1 style trajectory whose observations sit inline inside ONE
  assistant message (``<search>q</search>\\n\\n<information>...</information>\\n\\n<answer>a</answer>``). It is
  built turn by turn through the protocol, not by rendering the text once: each action is tokenized on its own and
  each observation goes through ``protocol.observation_ids``, so the ids are exactly those a rollout produces for
  the same behaviour (tokenizing the whole string at once can merge tokens across an action/observation boundary
  and give ids RL never sees). The ``<information>`` spans are mask 0 although they are inside the assistant turn.
* :func:`trajectories_from_policy` -- any scripted policy (an expert) run through an environment with the real
  :class:`~trl_multiturn.rollout.MultiTurnRollout`, so the trajectories are the ones RL would see for the same
  actions; those that do not end with the environment's answer / done are rejected.

EOS after the final answer. With :class:`~trl_multiturn.protocols.TagProtocol` a rollout stops at the stop string
``</answer>``: RL trajectories end there and never contain the token after it. The tag builders append EOS (mask 1)
after a final answer by default (``add_eos=True``), so the fine-tuned model also stops where no stop string is set
(plain ``generate``, a chat server). This is harmless for RL: generation stops at ``</answer>`` before that token
is ever sampled, and RL never trains the position after it. With ``add_eos=False`` the ids are exactly the RL ids.
Chat-template turns (and :class:`~trl_multiturn.protocols.ChatToolProtocol` turns) already end with EOS.

Training goes through TRL's ``SFTTrainer`` unchanged: :func:`sft_dataset` gives a pre-tokenized dataset with
``input_ids`` and ``assistant_masks`` (prompt zeros + action mask), from which ``SFTTrainer`` builds
``labels = input_ids`` with -100 where the mask is 0, so PEFT, logging, gradient accumulation and packing work as
usual. Departures from TRL: TRL's own multi-turn masks come from ``{% generation %}`` markers in a chat template
(``assistant_only_loss=True``), which cannot mask an observation inside an assistant message and depend on each
template marking its end-of-turn token; here the mask is built from the token ids and the protocol, so it is the
same mask RL uses. Leave ``assistant_only_loss`` off: the masks already are assistant masks.

Per-turn layout (``sft_dataset(..., turn_layout="per_turn")``, the layout of ``MultiTurnGRPOConfig.turn_layout``):
a trajectory that carries ``turn_contexts`` (collected by :func:`trajectories_from_policy` with
``RolloutConfig(turn_layout="per_turn")``, optionally with a ``context_fn``) becomes one example per row of
:func:`~trl_multiturn.turn_rows.turn_rows_of`: the context ``c_k`` the turn was generated from (mask 0), then the
row's columns of the trajectory, ids and action mask as they are (an observation inside a merged row stays mask 0).
Under a thinking template that drops earlier ``<think>`` blocks, or a context function that drops or cuts old
observations, each turn is then trained on the context the per-turn GRPO stage and the deployed model give it, not on
the single sequence. Turns whose contexts nest merge into one row, so a prefix-keeping template gives back the
single-sequence example. A trajectory without turn contexts stays one example.

Loss normalization: ``SFTTrainer`` divides the summed NLL by the number of supervised tokens of the whole
(accumulated) batch (``num_items_in_batch``): a token mean, so long trajectories weigh more than short ones. RL's
default aggregation here is a per-trajectory mean ("seq-mean-token-mean"); the SFT warm start keeps TRL's token mean.
The per-turn layout keeps it: the rows of a trajectory partition its supervised tokens (each sampled token is in
exactly one row), so every supervised token is counted once in the numerator and in ``N``, and a trajectory weighs
its number of supervised tokens whatever the number of its rows. Where the contexts nest, each token also has the
same prefix in its row as in the single sequence, so over a batch that holds all the rows of its trajectories the
loss equals the single-sequence loss (tested with the rows left unmerged; merged, they are the single sequence).
What changes is only what a step holds: ``per_device_train_batch_size`` counts examples, which are rows.

Packing: valid with ``packing_strategy="bfd"`` (TRL's default). BFD packs whole trajectories into padding-free
rows with ``position_ids`` restarting at each trajectory, the labels travel with their ids, and attention stays
inside each trajectory, so the loss equals the unpacked one (tested on CPU with SDPA attention). ``"wrapped"`` packing cuts trajectories in the
middle (later turns lose their history) and is refused by :func:`train_sft`, as is any trajectory longer than
``max_length`` (TRL would truncate it and drop the final answer).
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from .environment import Action, Step
from .generation import GenerationOutput, SamplingParams
from .host_memory import release_freed_memory
from .protocols import Protocol, TagProtocol
from .rollout import TURN_LAYOUTS, MultiTurnRollout, RolloutConfig
from .trajectory import Trajectory
from .turn_rows import turn_rows_of

logger = logging.getLogger(__name__)

#: a scripted policy: ``policy(example, observations) -> action text`` (or None to give up on the example)
PolicyFn = Callable[[dict, list], "str | None"]


# ---------------------------------------------------------------------------------------------------------------
# Conversations through the chat template
# ---------------------------------------------------------------------------------------------------------------


def _render_ids(tokenizer, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> list[int]:
    """Token ids of the chat template's rendering of ``messages`` (as ``apply_chat_template(tokenize=True)``)."""
    kwargs = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_prefix(tokenizer, prefix: list[int], full: list[int], what: str) -> None:
    """Raise when ``prefix`` is not a token prefix of ``full`` (the template is not prefix-stable)."""
    if full[: len(prefix)] == prefix:
        return
    at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
    raise ValueError(
        f"The chat template is not prefix-stable: the rendering of {what} is not a token prefix of the rendering "
        f"with more messages. They differ at token {at}: {tokenizer.decode(prefix[at : at + 12])!r} versus "
        f"{tokenizer.decode(full[at : at + 12])!r}. Exact masks need a template that renders earlier messages the "
        "same way whatever follows (templates that rewrite earlier turns, e.g. strip past reasoning, are not). Use "
        "such a template (e.g. trl_multiturn.models.tool_chat_template() for ChatML models), or build trajectories "
        "turn by turn with trajectory_from_tag_text / trajectories_from_policy."
    )


def trajectory_from_messages(messages: Sequence[dict], tokenizer, tools: list | None = None) -> Trajectory:
    """A gold conversation as a :class:`Trajectory` whose action mask is 1 exactly on the assistant tokens.

    ``prompt_ids`` is the rendering of everything before the first assistant message, generation prompt included
    (the context a rollout starts from). Each assistant message (content and tool calls) is one action, mask 1 up to
    and including the ``tokenizer.eos_token`` that closes it; what the template adds after that EOS, the following
    system / user / tool messages and the next generation prompt are one observation, mask 0.

    The ids are the one-shot rendering ``apply_chat_template(messages, tools=tools)``. The conversation is rendered
    before and after each assistant message and every rendering must be a token prefix of the next, which proves the
    concatenated segments equal the one-shot rendering; otherwise a ``ValueError`` says where they differ.

    Args:
        messages: chat messages with a ``role`` ("system", "user", "assistant", "tool") and ``content``; assistant
            messages may carry ``tool_calls``. At least one assistant message, not the first message.
        tokenizer: a tokenizer with a chat template (for tool calls, one that renders them, e.g.
            ``trl_multiturn.models.tool_chat_template()``) and an ``eos_token``.
        tools: tool schemas handed to the chat template (JSON schemas or functions).

    Raises:
        ValueError: no chat template or EOS, malformed messages, no assistant message, an assistant message first,
            a template that is not prefix-stable, an assistant message rendered without EOS, or a tool call the
            template drops.
    """
    messages = list(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "trajectory_from_messages needs a tokenizer with a chat template; this one has none. Set "
            "tokenizer.chat_template (e.g. trl_multiturn.models.tool_chat_template() for ChatML models)."
        )
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError(
            "trajectory_from_messages needs tokenizer.eos_token (the end of an assistant turn); it is None."
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with a 'role'; got {str(m)[:100]!r}.")
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        roles = [m["role"] for m in messages]
        raise ValueError(f"The conversation has no assistant message (roles {roles}); there is nothing to train on.")
    if assistant[0] == 0:
        raise ValueError(
            "The conversation starts with an assistant message; put the context it answers (a system or user "
            "message) before it."
        )

    try:
        full = _render_ids(tokenizer, messages, tools, add_generation_prompt=False)
    except Exception as exc:  # the template raised on these messages
        raise ValueError(
            f"The chat template cannot render this conversation ({type(exc).__name__}: {exc}). For tool calls and "
            "tool messages use a template that renders them, e.g. tokenizer.chat_template = "
            "trl_multiturn.models.tool_chat_template()."
        ) from exc

    traj: Trajectory | None = None
    done = 0  # tokens of `full` already placed on the trajectory
    for i in assistant:
        before = _render_ids(tokenizer, messages[:i], tools, add_generation_prompt=True)
        after = _render_ids(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
        _check_prefix(tokenizer, before, after, f"messages[:{i}] with the generation prompt")
        _check_prefix(tokenizer, after, full, f"messages[:{i + 1}]")
        if traj is None:
            traj = Trajectory(prompt_ids=before, info={"source": "messages"})
        else:
            _check_prefix(tokenizer, full[:done], before, f"messages[:{i}] with the generation prompt")
            traj.add_observation(before[done:])
        segment = after[len(before) :]  # the assistant message as rendered, plus what follows its EOS
        if eos_id not in segment:
            raise ValueError(
                f"messages[{i}] (assistant) is rendered without tokenizer.eos_token={tokenizer.eos_token!r}: "
                f"{tokenizer.decode(segment)[-80:]!r}. The mask ends each assistant turn at the EOS that closes it; "
                "set tokenizer.eos_token to the template's end-of-turn token."
            )
        end = len(segment) - segment[::-1].index(eos_id)  # one past the last EOS of the segment
        rendered = tokenizer.decode(segment[:end])
        for call in messages[i].get("tool_calls") or []:
            name = (call.get("function") or call).get("name") if isinstance(call, dict) else None
            if name and name not in rendered:
                raise ValueError(
                    f"messages[{i}] (assistant) calls the tool {name!r} but the chat template renders it without the "
                    f"call: {rendered[-80:]!r}. The model would be trained on a turn without its tool call. Use a "
                    "template that renders tool calls, e.g. tokenizer.chat_template = "
                    "trl_multiturn.models.tool_chat_template()."
                )
        traj.add_action(segment[:end])
        if end < len(segment):
            traj.add_observation(segment[end:])
        done = len(after)
    if done < len(full):
        traj.add_observation(full[done:])
    if traj.input_ids != full:  # guaranteed by the prefix checks; kept as the stated invariant
        raise ValueError("The incremental renderings do not add up to the one-shot rendering of the conversation.")
    return traj


# ---------------------------------------------------------------------------------------------------------------
# Tag-protocol text: observations inline in one assistant message
# ---------------------------------------------------------------------------------------------------------------


def _require_tag_protocol(protocol: Any, caller: str) -> None:
    if not isinstance(protocol, TagProtocol):
        raise TypeError(
            f"{caller} needs a TagProtocol (inline tags and an observation_template); got {type(protocol).__name__}. "
            "For JSON tool calls through the chat template use trajectory_from_messages."
        )


def trajectory_from_tag_text(
    prompt: str | list[dict],
    assistant_text: str,
    tokenizer,
    protocol: TagProtocol | None = None,
    add_eos: bool = True,
) -> Trajectory:
    """A tag-protocol trajectory built turn by turn, as a rollout with the same actions builds it.

    ``assistant_text`` is the assistant side with observations inline, each rendered by the protocol's
    ``observation_template`` (by default ``\\n\\n<information>{text}</information>\\n\\n``) right after the action
    it answers. It is split at the protocol's stop strings: each action (text up to and including its closing tag)
    is tokenized on its own and added with mask 1; each observation is turned into ids by
    ``protocol.observation_ids`` (sanitised and truncated exactly as in a rollout; the counts go to
    ``info["observation_sanitized"]`` / ``info["observation_truncated"]``) and added with mask 0.

    Args:
        prompt: what ``Environment.reset`` returns (a string or chat messages); rendered by ``protocol.prompt_ids``.
        assistant_text: actions and inline observations; must end with a complete action (normally the answer).
        tokenizer: the policy's tokenizer.
        protocol: the :class:`TagProtocol` of the RL run (default ``TagProtocol()``).
        add_eos: append ``tokenizer.eos_token`` (mask 1) after a final answer (see the module docstring).

    Trailing whitespace after the last action is ignored (a rollout stops at the closing tag and never samples it).
    The data may not contain invalid actions and their feedback: every turn must parse as a tool call or an answer.

    Raises:
        TypeError: a protocol other than a TagProtocol.
        ValueError: an action the protocol cannot parse, an action containing the observation's opening tag, a tool
            action not followed by an observation in the template's layout, an answer followed by more text, or text
            after the last action that is not a complete action.
    """
    protocol = TagProtocol() if protocol is None else protocol
    _require_tag_protocol(protocol, "trajectory_from_tag_text")
    if add_eos and tokenizer.eos_token_id is None:
        raise ValueError("add_eos=True needs tokenizer.eos_token; it is None. Pass add_eos=False or set the EOS token.")
    before, after = protocol.observation_template.split("{text}", 1)
    observation_re = re.compile(re.escape(before) + r"(.*?)" + re.escape(after), re.DOTALL)

    marker = before.strip()  # e.g. "<information>": only the environment writes it
    text = assistant_text.rstrip()  # a rollout stops at the closing tag: trailing whitespace is never sampled
    traj = Trajectory(prompt_ids=protocol.prompt_ids(tokenizer, prompt), info={"source": "tag_text", "actions": []})
    pos = 0
    while pos < len(text):
        ends = [i + len(s) for s in protocol.stop_strings if (i := text.find(s, pos)) >= 0]
        if not ends:
            raise ValueError(
                f"assistant_text has text after its last complete action, at character {pos}: {text[pos : pos + 80]!r}. "
                f"Every turn must end with one of the protocol's closing tags {list(protocol.stop_strings)}; a gold "
                "trajectory ends with the answer."
            )
        end = min(ends)
        action_text = text[pos:end]
        action = protocol.parse(action_text)
        if action.kind == "invalid":
            raise ValueError(
                f"Turn {traj.num_turns} of assistant_text is not a valid action ({action.error}): {action_text[-120:]!r}."
            )
        if marker and marker in action_text:
            raise ValueError(
                f"Turn {traj.num_turns} of assistant_text contains {marker!r} inside the action text: "
                f"{action_text[-120:]!r}. Observations must follow the action they answer, rendered exactly as the "
                f"protocol's observation_template {protocol.observation_template!r}; otherwise they would be trained "
                "as text the model writes."
            )
        ids = list(tokenizer(action_text, add_special_tokens=False)["input_ids"])
        pos = end
        if action.kind == "answer":
            if pos < len(text):
                raise ValueError(
                    f"assistant_text continues after the final answer (turn {traj.num_turns}): "
                    f"{text[pos : pos + 80]!r}. The answer ends the episode; remove the trailing text."
                )
            traj.add_action(ids + ([tokenizer.eos_token_id] if add_eos else []))
            traj.info["actions"].append("answer")
            traj.info["final_answer"] = action.content
            break
        traj.add_action(ids)
        traj.info["actions"].append(action.kind)
        if pos == len(text):
            break  # ends on a tool action: the environment ended the episode there
        match = observation_re.match(text, pos)
        if match is None:
            raise ValueError(
                f"After the tool action of turn {traj.num_turns - 1} assistant_text should continue with an "
                f"observation rendered as the protocol's observation_template {protocol.observation_template!r}; "
                f"found {text[pos : pos + 80]!r}. Render observations with that template, or pass a TagProtocol "
                "whose observation_template matches the data."
            )
        obs_ids, record = protocol.observation_ids(tokenizer, match.group(1), action)
        for key, flag in record.items():
            if flag:
                traj.info[key] = traj.info.get(key, 0) + 1
        traj.add_observation(obs_ids)
        pos = match.end()
    if traj.num_turns == 0:
        raise ValueError("assistant_text is empty; a gold trajectory needs at least one action (the answer).")
    return traj


# ---------------------------------------------------------------------------------------------------------------
# Scripted policies through an environment and the real rollout loop
# ---------------------------------------------------------------------------------------------------------------


class _PolicyGaveUp(Exception):
    """Raised inside the generator when the scripted policy returns None for an example."""


class _RecordingEnv:
    """Wraps one environment and records the observation of every step for the scripted policy (sync or async)."""

    def __init__(self, env: Any):
        self.env = env
        self.tools = getattr(env, "tools", None)
        self.observations: list[Any] = []
        self.reset = env.reset
        if callable(getattr(env, "close", None)):
            self.close = env.close
        if inspect.iscoroutinefunction(env.step):

            async def step(action: Action):
                return self._record(await env.step(action))

        else:

            def step(action: Action):
                result = env.step(action)
                if inspect.isawaitable(result):  # a sync method that returns a coroutine

                    async def finish():
                        return self._record(await result)

                    return finish()
                return self._record(result)

        self.step = step

    def _record(self, result: Any) -> Any:
        self.observations.append(result.observation if isinstance(result, Step) else None)
        return result


class _PolicyGenerator:
    """A generation backend for one trajectory that writes what the scripted policy returns.

    Mirrors the real backend's stopping: the turn ends at the first stop string (text after it is dropped) or,
    without one, at EOS (appended when the text does not end with it); ``max_new_tokens`` cuts it ("length").
    """

    def __init__(self, tokenizer, policy: PolicyFn, example: dict, slot: dict, protocol: Protocol, add_eos: bool):
        self.tokenizer, self.policy, self.example = tokenizer, policy, example
        self.slot = slot  # {"env": the _RecordingEnv of this example}, filled when the rollout creates it
        self.protocol, self.add_eos = protocol, add_eos

    def generate(self, contexts, max_new_tokens, params: SamplingParams) -> list[GenerationOutput]:
        if len(contexts) != 1:
            raise RuntimeError(f"_PolicyGenerator serves one trajectory; got {len(contexts)} contexts.")
        text = self.policy(self.example, list(self.slot["env"].observations))
        if text is None:
            raise _PolicyGaveUp
        if not isinstance(text, str):
            raise TypeError(
                f"The scripted policy must return the action text (str) or None; got {type(text).__name__}."
            )
        tok, eos_id = self.tokenizer, self.tokenizer.eos_token_id
        stops = [(i + len(s)) for s in params.stop_strings if (i := text.find(s)) >= 0]
        if stops:
            text = text[: min(stops)]
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
            reason = "stop"
            if self.add_eos and self.protocol.parse(text, finished_by_eos=False).kind == "answer":
                ids.append(eos_id)
        else:
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
            if not ids or ids[-1] != eos_id:
                ids.append(eos_id)
            reason = "eos"
        limit = max_new_tokens[0] if isinstance(max_new_tokens, list) else max_new_tokens
        if len(ids) > limit:
            ids, reason = ids[:limit], "length"
        return [GenerationOutput(ids=ids, logprobs=[0.0] * len(ids), finish_reason=reason)]


def trajectories_from_policy(
    examples: Sequence[dict],
    env_factory: Callable[[], Any],
    protocol: Protocol,
    tokenizer,
    policy_turns: PolicyFn,
    config: RolloutConfig | None = None,
    add_eos: bool = True,
) -> tuple[list[Trajectory], float]:
    """Run a scripted policy through the environment with the real rollout loop; keep the finished trajectories.

    For each example the environment from ``env_factory`` is reset and :class:`MultiTurnRollout` drives it as in
    RL; at each turn ``policy_turns(example, observations)`` returns the action text, where ``observations`` are the
    ``Step.observation`` values the environment returned so far (one per earlier action). The text is tokenized and
    ends where a sampled turn would: at the first of the protocol's stop strings (anything after it is dropped), or
    else with EOS. With ``add_eos=False`` the trajectories are exactly those of an RL rollout that sampled these
    texts; with ``add_eos=True`` (default) an answer that ends at a stop string is followed by EOS (mask 1, see the
    module docstring).

    Rejection: a trajectory is kept only when it ended with the policy's answer or the environment's ``done``;
    trajectories stopped by a limit (``max_turns``, tokens), by an environment error, or because the policy
    returned None (it gave up, e.g. its retrieval missed the evidence) are dropped.

    Args:
        examples: dataset rows, as handed to ``Environment.reset``.
        env_factory: zero-argument callable returning a fresh environment (TRL-style environments are adapted as
            the trainer adapts them).
        protocol: the protocol of the RL run.
        tokenizer: the policy's tokenizer.
        policy_turns: ``(example, observations) -> str | None``, the next action's text.
        config: the rollout limits of the RL run (default ``RolloutConfig()``). With ``turn_layout="per_turn"``
            (and the run's ``context_fn``, if any) each turn is rendered as the per-turn rollout renders it and the
            kept trajectories carry ``turn_contexts``, for ``sft_dataset(..., turn_layout="per_turn")``.
        add_eos: see above.

    Returns:
        ``(kept, kept_fraction)``: the kept trajectories, in example order, and ``len(kept) / len(examples)``.
    """
    from .trl_compat import TRLEnvironmentAdapter, is_trl_environment

    if add_eos and tokenizer.eos_token_id is None:
        raise ValueError("add_eos=True needs tokenizer.eos_token; it is None. Pass add_eos=False or set the EOS token.")
    current: dict[str, _RecordingEnv] = {}

    def factory() -> _RecordingEnv:
        env = env_factory()
        if is_trl_environment(env):
            env = TRLEnvironmentAdapter(env)
        current["env"] = _RecordingEnv(env)
        return current["env"]

    rollout = MultiTurnRollout(factory, protocol, tokenizer, config or RolloutConfig())
    kept: list[Trajectory] = []
    reasons: dict[str, int] = {}
    try:
        for example in examples:
            current.clear()
            generator = _PolicyGenerator(tokenizer, policy_turns, example, current, protocol, add_eos)
            try:
                (traj,) = rollout.run([example], generator, SamplingParams())
            except _PolicyGaveUp:
                close = getattr(current.get("env"), "close", None)
                if callable(close):
                    close()
                reasons["policy gave up"] = reasons.get("policy gave up", 0) + 1
                continue
            reason = traj.info.get("stop_reason")
            if reason in ("answer", "done") and not traj.truncated and not traj.info.get("failed"):
                kept.append(traj)
            else:
                reasons[str(reason)] = reasons.get(str(reason), 0) + 1
    finally:
        rollout.close()
    total = len(examples)
    if reasons:
        logger.info("trajectories_from_policy kept %d of %d; rejected: %s", len(kept), total, reasons)
    return kept, (len(kept) / total if total else 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Dataset and training through TRL's SFTTrainer
# ---------------------------------------------------------------------------------------------------------------


def _sft_examples(trajectories: Sequence[Trajectory], turn_layout: str) -> list[tuple[int, list[int], list[int]]]:
    """``(trajectory index, input_ids, assistant_masks)`` of every example, trajectories in order (see
    :func:`sft_dataset`)."""
    if turn_layout not in TURN_LAYOUTS:
        raise ValueError(
            f"turn_layout must be one of {TURN_LAYOUTS}; got {turn_layout!r}. Use 'per_turn' for trajectories "
            "collected per turn (with turn_contexts), as MultiTurnGRPOConfig.turn_layout='per_turn' trains them."
        )
    if len(trajectories) == 0:
        raise ValueError("sft_dataset got no trajectories; pass at least one.")
    examples: list[tuple[int, list[int], list[int]]] = []
    whole = 0  # per-turn layout: trajectories without turn contexts, kept as one example
    for i, traj in enumerate(trajectories):
        try:
            traj.validate()
        except ValueError as err:
            raise ValueError(f"trajectory {i}: {err}") from err
        if traj.num_action_tokens == 0:
            raise ValueError(
                f"trajectory {i} has no assistant token (action_mask is all 0), so it carries no SFT loss; drop it."
            )
        rows = turn_rows_of(traj) if turn_layout == "per_turn" else None
        if rows is None:
            whole += turn_layout == "per_turn"
            examples.append((i, list(traj.input_ids), [0] * len(traj.prompt_ids) + list(traj.action_mask)))
            continue
        for context, columns in zip(rows.contexts, rows.columns):
            ids = [traj.completion_ids[c] for c in columns]  # the row's ids, exactly as in the trajectory
            mask = [traj.action_mask[c] for c in columns]  # 1 on sampled ids, 0 on observations between them
            examples.append((i, list(context) + ids, [0] * len(context) + mask))
    if whole:
        logger.warning(
            "sft_dataset(turn_layout='per_turn'): %d of %d trajectories have no turn_contexts and are trained as one "
            "sequence. Collect them per turn with trajectories_from_policy(..., config=RolloutConfig("
            "turn_layout='per_turn', context_fn=...)).", whole, len(trajectories)
        )
    return examples


def _dataset(examples: list[tuple[int, list[int], list[int]]]):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [e[1] for e in examples], "assistant_masks": [e[2] for e in examples]})


def sft_dataset(trajectories: Sequence[Trajectory], turn_layout: str = "sequence"):
    """A pre-tokenized ``datasets.Dataset`` for ``SFTTrainer``: ``input_ids`` and ``assistant_masks``.

    ``turn_layout="sequence"`` (default): one example per trajectory, ``input_ids = prompt_ids + completion_ids`` and
    ``assistant_masks = [0] * len(prompt_ids) + action_mask``. ``"per_turn"``: a trajectory with ``turn_contexts``
    gives one example per row of :func:`~trl_multiturn.turn_rows.turn_rows_of` (turns whose contexts nest share a
    row), ``input_ids = context + the row's columns of completion_ids`` and ``assistant_masks = [0] * len(context) +
    the action mask on those columns``; a trajectory without turn contexts stays one example (a warning counts them).
    Examples are in trajectory order, a trajectory's rows in turn order.

    ``SFTTrainer`` (TRL 1.16, ``_prepare_dataset``) sees ``input_ids``, skips tokenization, and builds
    ``labels = input_ids`` with -100 wherever ``assistant_masks`` is 0, then drops the mask column.

    Raises:
        ValueError: a ``turn_layout`` other than "sequence" / "per_turn", no trajectories, an invalid trajectory, or
            one without any mask-1 token (it would carry no loss).
    """
    return _dataset(_sft_examples(trajectories, turn_layout))


def _sft_trainer_class():
    """``MultiTurnSFTTrainer``, built on first use so that importing this module does not import TRL."""
    global _SFT_TRAINER_CLASS
    if _SFT_TRAINER_CLASS is not None:
        return _SFT_TRAINER_CLASS
    import torch
    from trl import SFTTrainer

    class MultiTurnSFTTrainer(SFTTrainer):
        """TRL's ``SFTTrainer`` whose CPU loss projects only the supervised positions through the LM head.

        TRL's fused LM head scores only the positions with a label on Triton devices, and every position elsewhere
        (its log-probs are then zeroed where the label is -100). A multi-turn trajectory is mostly prompt and
        observations (the search agent's: ~20% assistant tokens), so on CPU most of the head's work, about a fifth
        of a small model's step, is thrown away. On CPU this trainer asks the model for the logits of the positions
        whose next token is supervised in any row of the batch (``logits_to_keep`` as an index tensor) and computes
        TRL's loss from them: the summed NLL over ``num_items_in_batch`` (the supervised tokens of the accumulated
        batch), with the same entropy / token-accuracy / token-count metrics. The loss and gradients equal
        ``SFTTrainer``'s (tested); every other case (GPUs, label smoothing, ``compute_loss_func``, DFT, MoE aux
        losses, sequence parallelism, ``return_outputs``) is TRL's own path.
        """

        def _compact_head_applies(self, model, inputs, return_outputs) -> bool:
            labels = inputs.get("labels")
            return (
                not return_outputs
                and labels is not None
                and labels.device.type == "cpu"
                and self.compute_loss_func is None
                and self.label_smoother is None
                and getattr(self.args, "loss_type", "nll") == "nll"
                and not self.aux_loss_enabled
                and getattr(self.accelerator, "parallelism_config", None) is None
                and hasattr(self, "_metrics")
                and self._accepts_logits_to_keep(model)
            )

        def _accepts_logits_to_keep(self, model) -> bool:
            if getattr(self, "_logits_to_keep_ok", None) is None:
                base = self.accelerator.unwrap_model(model)
                base = base.get_base_model() if hasattr(base, "get_base_model") else base
                self._logits_to_keep_ok = "logits_to_keep" in inspect.signature(type(base).forward).parameters
            return self._logits_to_keep_ok

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not self._compact_head_applies(model, inputs, return_outputs):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            mode = "train" if self.model.training else "eval"
            labels = inputs["labels"][:, 1:]  # the label of position t is the token at t + 1
            keep = (labels != -100).any(dim=0).nonzero().squeeze(1)
            model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
            outputs = model(**model_inputs, use_cache=False, logits_to_keep=keep)
            targets = labels[:, keep]
            valid = targets != -100
            logps = torch.log_softmax(outputs.logits.float(), dim=-1)
            token_logps = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
            num_tokens = valid.sum() if num_items_in_batch is None else num_items_in_batch
            loss = -token_logps.sum() / torch.as_tensor(num_tokens).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            with torch.no_grad():  # the metrics of SFTTrainer.compute_loss, on the same positions
                entropy = -(logps.exp() * logps).sum(-1) * valid
                top1 = (outputs.logits.argmax(-1) == targets) & valid
                gather = self.accelerator.gather_for_metrics
                num_valid = gather(valid.sum()).sum()
                entropy_sum, num_correct = gather(entropy.sum()).sum(), gather(top1.sum()).sum()
                self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
                self._metrics[mode]["mean_token_accuracy"].append(
                    (num_correct / num_valid).item() if num_valid > 0 else 0.0
                )
                if mode == "train":
                    if "attention_mask" in inputs:
                        in_batch = gather(inputs["attention_mask"].sum()).sum().item()
                    else:
                        in_batch = gather(torch.tensor(inputs["input_ids"].numel())).sum().item()
                    self._total_train_tokens += in_batch // self._tp_size
                self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            return loss

    _SFT_TRAINER_CLASS = MultiTurnSFTTrainer
    return MultiTurnSFTTrainer


_SFT_TRAINER_CLASS = None


def __getattr__(name: str):
    if name == "MultiTurnSFTTrainer":
        return _sft_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def train_sft(
    model, tokenizer, trajectories: Sequence[Trajectory], args, peft_config=None, turn_layout: str = "sequence",
    **trainer_kwargs,
):
    """Fine-tune ``model`` on ``trajectories`` with TRL's ``SFTTrainer``; returns the trainer after ``train()``.

    A thin wrapper: ``MultiTurnSFTTrainer(model, args=args, train_dataset=sft_dataset(trajectories, turn_layout),
    processing_class=tokenizer, peft_config=peft_config, **trainer_kwargs).train()``, after checking the settings
    that would silently change what is trained. ``MultiTurnSFTTrainer`` is TRL's ``SFTTrainer`` with, on CPU, the LM
    head applied to the supervised positions only (same loss and gradients, fewer FLOPs).

    Args:
        model: a model or a model id / path, as ``SFTTrainer`` takes it.
        tokenizer: the tokenizer the trajectories were built with (its pad token pads the batches).
        trajectories: gold trajectories (from the builders of this module).
        args: a ``trl.SFTConfig``.
        peft_config: an optional ``peft`` config (LoRA, QLoRA); the trainer then holds the adapter.
        turn_layout: "sequence" (one example per trajectory) or "per_turn" (one per turn row of the trajectories
            collected per turn; see :func:`sft_dataset`); set it to the GRPO stage's ``turn_layout``.
        trainer_kwargs: anything else ``SFTTrainer`` takes (``eval_dataset``, ``callbacks``, ...).

    Raises:
        ValueError: ``assistant_only_loss=True`` (the masks already are assistant masks), ``packing_strategy=
            "wrapped"`` with packing (it cuts trajectories), a bad ``turn_layout``, or an example (a trajectory, or
            one of its per-turn rows) longer than ``max_length`` (TRL would truncate its end, usually the answer).
    """
    if getattr(args, "assistant_only_loss", False):
        raise ValueError(
            "train_sft got assistant_only_loss=True. The dataset is pre-tokenized with its own assistant masks; TRL's "
            "assistant_only_loss re-derives masks from a chat template and rejects pre-tokenized data. Set "
            "assistant_only_loss=False."
        )
    if getattr(args, "packing", False) and getattr(args, "packing_strategy", "bfd") == "wrapped":
        raise ValueError(
            "train_sft got packing=True with packing_strategy='wrapped', which cuts trajectories in the middle so later "
            "turns lose their history. Use packing_strategy='bfd' (whole trajectories per packed row) or packing=False."
        )
    examples = _sft_examples(trajectories, turn_layout)
    max_length = getattr(args, "max_length", None)
    if max_length is not None:
        i, ids, _ = max(examples, key=lambda e: len(e[1]))
        if len(ids) > max_length:
            what = f"trajectory {i}" if turn_layout == "sequence" else f"an example of trajectory {i} (its turn row)"
            raise ValueError(
                f"{what} has {len(ids)} tokens, more than SFTConfig.max_length={max_length}; TRL would truncate its "
                "end (the final turns and the answer). Raise max_length (or set it to None), or filter long "
                "trajectories out."
            )
    trainer = _sft_trainer_class()(
        model=model,
        args=args,
        train_dataset=_dataset(examples),
        processing_class=tokenizer,
        peft_config=peft_config,
        **trainer_kwargs,
    )
    trainer.train()
    release_freed_memory()  # the activations the training freed: the next stage's peak does not start at this one's
    return trainer
