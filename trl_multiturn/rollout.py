"""The multi-turn rollout loop over a batch of environments.

For each dataset row: ``env.reset(row)`` gives the first prompt; then, up to ``max_turns`` times, the policy samples
one turn (stopping at the protocol's stop strings or EOS), the protocol parses it into an :class:`Action`, the
environment answers with a :class:`Step`, and the protocol turns the observation into ids that are appended with
action mask 0. Sampled ids are appended exactly as sampled; nothing the policy produced is decoded and re-encoded.

A trajectory ends when the action is a final answer, the environment says ``done``, or a limit is reached
(``max_turns``, the token budget ``max_completion_length`` counted over actions AND observations, or the model's
context). ``truncated`` has one meaning (see :class:`~trl_multiturn.trajectory.Trajectory`): a token limit cut the
trajectory (``stop_reason="max_tokens"``). Using up ``max_turns`` is not truncation (``stop_reason="max_turns"``): the
policy chose to keep acting, every action it took was complete, and the reward says what that was worth. Environment calls run concurrently (sync ones
in a thread pool, async ones on an event loop), each bounded by ``env_timeout``; an environment that raises or
hangs ends its trajectory with the error recorded (``info["env_errors"]``, ``info["failed"]=True``) and the rest
of the batch goes on, unless ``raise_on_env_error`` is set.

Two turn layouts (``RolloutConfig.turn_layout``). ``"sequence"``: turn k+1 is generated from the single sequence
so far (``Trajectory.input_ids``: the prompt, every sampled id and every observation's ids). ``"per_turn"``: the
rollout keeps each trajectory's message history (the prompt messages, then per turn an ``assistant`` message with the
sampled text and ids and a ``tool`` message with the environment's answer), and turn k is generated from
``protocol.render_context(tokenizer, context_fn(history) if context_fn else history, tools)``: the conversation as
the deployed model sees it (a thinking chat template drops earlier ``<think>`` blocks; a context function from
:mod:`trl_multiturn.context` drops or cuts old observations). That id list is what the generator gets, and it is
recorded in ``Trajectory.turn_contexts`` for the trainer's per-turn rows; the single-sequence fields are built as in
the sequence layout (reward functions and logging read them). Limits in the per-turn layout: ``max_context_length``
bounds the rendered context plus the turn; ``max_completion_length`` keeps its meaning (the single sequence's
completion: actions and observations). A context function that raises ends its trajectory as a recorded failure
(``stop_reason="context_error"``), as an environment error does.

Trajectories advance independently. With a streaming backend (``TransformersGenerator``: ``submit`` / ``step``) the
main thread steps generation token by token; a trajectory whose turn ended leaves the batch and its ``env.step``
starts at once in the environment pool, while the others keep generating; when its observation is ready it rejoins
the batch at the next token, with only the new tokens prefilled (its K/V stay in its ``GenerationSession``).
Departure from TRL 1.16, whose tool loop runs turns in lock step: every trajectory of a turn waits for the slowest
generation, then the tools run one after the other, then the next turn re-prefills every history. Backends without
``submit`` (vLLM, scripted test backends) get one ``generate`` call per turn for the trajectories still running,
with the environment steps of a turn run concurrently; a backend that sets ``requires_collective_calls`` (vLLM
across ranks) gets exactly ``max_turns`` calls, with an empty batch once this rank has no trajectory left.

Sampling is per trajectory (each ``GenerationSession`` has its own seed, drawn in trajectory order), so neither
the order in which environments answer nor the batch a row shares changes the ids of a trajectory; with greedy
decoding the ids equal those of the reference loop (``TransformersGenerator(kv_reuse=False)``), which tests prove.

``last_stats`` after ``run``: ``prefill_tokens`` (context tokens computed before sampling, all turns; of which
``first_turn_prefill_tokens`` for the prompts), ``cached_tokens`` (context tokens whose K/V were reused), ``generated_tokens``, ``observation_tokens``,
``turns``, ``env_time_s`` (wall time the loop was blocked on environments: resets, and steps while nothing could
be generated), ``env_busy_s`` (sum of the durations of every environment call), ``generation_s`` and ``wall_s``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from .environment import Action, Step
from .generation import SamplingParams
from .protocols import Protocol, prompt_messages
from .trajectory import Trajectory

logger = logging.getLogger(__name__)


class EnvironmentError_(RuntimeError):
    """Raised (only with ``raise_on_env_error=True``) when an environment call fails or times out."""


class _EnvRunner:
    """Runs environment calls concurrently with a timeout each, on a private event loop thread.

    ``submit`` starts one call and returns a ``concurrent.futures.Future`` of ``(result, error, seconds)``; ``run``
    starts a batch and waits for all of it. A call's own exception or timeout is returned as ``error``, never raised.
    """

    def __init__(self, max_workers: int = 64):
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="env")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="env-loop", daemon=True)
        self._thread.start()

    async def _call(self, fn: Callable, args: tuple, timeout: float | None):
        start = time.perf_counter()
        if inspect.iscoroutinefunction(fn):
            aw = fn(*args)
        else:
            aw = self._loop.run_in_executor(self._pool, lambda: fn(*args))
        try:
            result = await asyncio.wait_for(aw, timeout)
            if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
                result = await asyncio.wait_for(result, timeout)
            return result, None, time.perf_counter() - start
        except asyncio.TimeoutError:
            return None, TimeoutError(f"timed out after env_timeout={timeout} s"), time.perf_counter() - start
        except Exception as exc:  # an environment's own failure: recorded, not fatal
            return None, exc, time.perf_counter() - start

    def submit(self, fn: Callable, args: tuple, timeout: float | None) -> Future:
        """Start ``fn(*args)`` now; the future resolves to ``(result, error, seconds)``."""
        return asyncio.run_coroutine_threadsafe(self._call(fn, args, timeout), self._loop)

    def run_timed(self, calls: list[tuple[Callable, tuple]], timeout: float | None) -> list[tuple[Any, BaseException | None, float]]:
        """Call each ``fn(*args)`` concurrently; returns ``(result, error, seconds)`` in order."""
        if not calls:
            return []

        async def all_calls():
            return await asyncio.gather(*(self._call(fn, args, timeout) for fn, args in calls))

        return asyncio.run_coroutine_threadsafe(all_calls(), self._loop).result()

    def run(self, calls: list[tuple[Callable, tuple]], timeout: float | None) -> list[tuple[Any, BaseException | None]]:
        """Call each ``fn(*args)``; returns ``(result, error)`` pairs in order. Never raises for a call's error."""
        return [(result, err) for result, err, _ in self.run_timed(calls, timeout)]

    def close(self):
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._pool.shutdown(wait=False, cancel_futures=True)


TURN_LAYOUTS = ("sequence", "per_turn")


#: ``RolloutConfig.turn_reward_gate`` values; the stop reasons of a trajectory that finished.
TURN_REWARD_GATES = ("none", "finished")
FINISHED = ("answer", "done")


@dataclass
class RolloutConfig:
    """Limits of one rollout (filled from ``MultiTurnGRPOConfig``).

    ``turn_layout`` is ``"sequence"`` (each turn generated from the single sequence so far) or ``"per_turn"`` (each
    turn generated from its own rendered context, recorded in ``Trajectory.turn_contexts``); ``context_fn`` (per-turn
    only) maps the message history to the messages the next turn sees (:mod:`trl_multiturn.context`).
    ``turn_reward_gate`` is ``"none"`` (every per-turn reward kept) or ``"finished"``: a trajectory that did not end
    by answering or by the environment's ``done`` (out of turns, out of tokens) has its positive per-turn rewards
    (credits) set to 0, the rewards it earned kept in ``info["gated_turn_rewards"]``; its negative ones (costs, e.g. a
    redundant search's) stay, so a trajectory cannot shed a cost by never answering.
    """

    max_turns: int = 4
    max_completion_length: int = 1024
    max_tokens_per_turn: int | None = None
    max_context_length: int | None = None
    env_timeout: float | None = 30.0
    raise_on_env_error: bool = False
    on_long_prompt: str = "error"
    turn_layout: str = "sequence"
    context_fn: Callable[[list[dict]], list[dict]] | None = None
    turn_reward_gate: str = "none"

    def __post_init__(self):
        if self.turn_layout not in TURN_LAYOUTS:
            raise ValueError(f"turn_layout must be one of {TURN_LAYOUTS}; got {self.turn_layout!r}.")
        if self.turn_reward_gate not in TURN_REWARD_GATES:
            raise ValueError(f"turn_reward_gate must be one of {TURN_REWARD_GATES}; got {self.turn_reward_gate!r}.")
        if self.context_fn is not None and not callable(self.context_fn):
            raise ValueError(
                f"context_fn must be a callable (messages -> messages) or None; got {type(self.context_fn).__name__}."
            )
        if self.context_fn is not None and self.turn_layout != "per_turn":
            raise ValueError(
                "context_fn is set with turn_layout='sequence': it would change what the model sees at each turn but "
                "not what is trained (the single sequence). Set turn_layout='per_turn', or drop context_fn."
            )


def _preview(example: Any, limit: int = 120) -> str:
    """A short one-line ``repr`` of a dataset row, for messages that must say which example was at fault."""
    text = repr(example)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _observation_text(obs: Any) -> tuple[str, str | None]:
    """Coerce an observation to text; returns (text, problem or None)."""
    if obs is None:
        return "", "empty observation"
    if isinstance(obs, str):
        return obs, ("empty observation" if obs == "" else None)
    try:
        text = json.dumps(obs) if isinstance(obs, (dict, list)) else str(obs)
    except (TypeError, ValueError):
        text = repr(obs)
    return text, f"observation is not a string (got {type(obs).__name__}); converted to text"


@dataclass
class _Run:
    """The state of one ``run`` call: trajectories, environments and counters."""

    trajs: list[Trajectory]
    envs: list[Any]
    done: list[bool]
    turn_capped: dict[int, bool] = field(default_factory=dict)
    env_s: list[float] = field(default_factory=list)  # per trajectory: seconds in its environment calls
    prefill_tokens: int = 0
    first_turn_prefill_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    env_blocked_s: float = 0.0
    generation_s: float = 0.0
    histories: list[list[dict]] = field(default_factory=list)  # per trajectory, per-turn layout only
    greedy: list[bool] = field(default_factory=list)  # per trajectory: decoded greedily


def _sessions(generator, st: _Run) -> list:
    """One generation session per trajectory, seeds drawn in trajectory order (a greedy row draws its seed too, so
    the sampled rows' streams do not depend on which rows are greedy), greedy rows flagged."""
    sessions = [generator.new_session() for _ in st.trajs]
    for session, greedy in zip(sessions, st.greedy):
        if greedy:
            session.greedy = True
    return sessions


class MultiTurnRollout:
    """Runs trajectories for a batch of dataset rows.

    Args:
        env_factory: zero-argument callable returning a fresh environment (one per trajectory).
        protocol: the :class:`~trl_multiturn.protocols.Protocol` for actions and observations.
        tokenizer: the policy's tokenizer.
        config: :class:`RolloutConfig` limits.
    """

    def __init__(self, env_factory: Callable[[], Any], protocol: Protocol, tokenizer, config: RolloutConfig):
        if config.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1; got {config.max_turns}. Set max_turns=1 for single-turn.")
        if config.turn_layout == "per_turn" and type(protocol).render_context is Protocol.render_context:
            raise ValueError(
                f"turn_layout='per_turn' needs a protocol that renders a turn's context; {type(protocol).__name__} "
                "does not implement render_context. Use turn_layout='sequence', or implement "
                "render_context(tokenizer, messages, tools)."
            )
        self.env_factory = env_factory
        self.protocol = protocol
        self.tokenizer = tokenizer
        self.config = config
        self._runner = _EnvRunner()
        self.last_stats: dict[str, float] = {}

    def close(self):
        self._runner.close()

    def _fail(self, traj: Trajectory, what: str, err: BaseException, example_index: int, env: Any = None,
              name: str | None = None) -> None:
        message = f"{what} failed: {type(err).__name__}: {err}"
        traj.info.setdefault("env_errors", []).append(message)
        traj.info["failed"] = True
        name = name or (type(env).__name__ if env is not None else "environment")
        example = traj.info.get("example", "")
        if self.config.raise_on_env_error:
            raise EnvironmentError_(f"{name}.{what} for example {example_index} {example} failed: {err}") from err
        logger.warning(
            "%s.%s for example %d %s failed (trajectory dropped): %s", name, what, example_index, example, err
        )

    # ------------------------------------------------------------------ entry point
    def run(self, examples: list[dict], generator, sampling: SamplingParams,
            greedy: Sequence[bool] | None = None) -> list[Trajectory]:
        """Roll out one trajectory per row of ``examples`` with ``generator`` (a generation backend).

        ``greedy[i]`` (optional): row i takes the argmax token at every step while the others sample (a greedy member
        of a group, ``MultiTurnGRPOConfig.greedy_baseline``); its trajectory is marked ``info["greedy"]``. Needs a
        generator with per-trajectory sessions (the Transformers generator); the sampled rows draw exactly what they
        would draw without it.
        """
        cfg, tok, protocol = self.config, self.tokenizer, self.protocol
        greedy = [bool(g) for g in greedy] if greedy is not None else [False] * len(examples)
        if len(greedy) != len(examples):
            raise ValueError(f"greedy has {len(greedy)} flags for {len(examples)} examples; give one per example.")
        if any(greedy) and not callable(getattr(generator, "new_session", None)):
            raise ValueError(
                f"greedy rows need a generator with per-trajectory sessions; {type(generator).__name__} samples every "
                "row with one setting. Use the Transformers generator (use_vllm=False) or greedy_baseline=False."
            )
        sampling = SamplingParams(**{**sampling.__dict__, "stop_strings": tuple(protocol.stop_strings)})
        wall0 = time.perf_counter()
        envs = [self.env_factory() for _ in examples]
        t0 = time.perf_counter()
        resets = self._runner.run_timed([(env.reset, (ex,)) for env, ex in zip(envs, examples)], cfg.env_timeout)
        st = _Run(trajs=[], envs=envs, done=[], env_blocked_s=time.perf_counter() - t0)
        st.env_s = [seconds for _, _, seconds in resets]

        for i, ((prompt, err, _), env) in enumerate(zip(resets, envs)):
            if err is None:
                try:
                    ids = protocol.prompt_ids(tok, prompt, tools=getattr(env, "tools", None))
                except ValueError as exc:
                    err = exc
            if err is not None:
                traj = Trajectory(prompt_ids=[tok.eos_token_id], info={"example": _preview(examples[i])})
                self._fail(traj, "reset", err, i, env)
                traj.info["stop_reason"] = "reset_error"
                st.trajs.append(traj)
                st.done.append(True)
                st.histories.append([])
                continue
            if cfg.max_context_length is not None and len(ids) >= cfg.max_context_length:
                message = (
                    f"Example {i} {_preview(examples[i])}: the prompt is {len(ids)} tokens, not shorter than the model "
                    f"context max_context_length={cfg.max_context_length}."
                )
                if cfg.on_long_prompt != "skip":
                    raise ValueError(
                        f"{message} Shorten the prompt, filter the dataset, or set on_long_prompt='skip' to drop such "
                        "examples with a count (rollout/skipped_prompts)."
                    )
                logger.warning("%s Skipped (on_long_prompt='skip'): dropped from the loss.", message)
                info = {"failed": True, "skipped": "prompt_too_long", "stop_reason": "prompt_too_long",
                        "example": _preview(examples[i])}
                st.trajs.append(Trajectory(prompt_ids=[tok.eos_token_id], info=info))
                st.done.append(True)
                st.histories.append([])
                continue
            st.trajs.append(
                Trajectory(prompt_ids=ids, info={"actions": [], "stop_reason": None, "example": _preview(examples[i])})
            )
            st.done.append(False)
            st.histories.append(prompt_messages(prompt) if cfg.turn_layout == "per_turn" else [])

        for t, g in zip(st.trajs, greedy):
            if g:
                t.info["greedy"] = True
        st.greedy = greedy
        if getattr(generator, "supports_streaming", False) and callable(getattr(generator, "submit", None)):
            self._run_streaming(st, generator, sampling)
        else:
            self._run_lockstep(st, generator, sampling)

        trajs = st.trajs
        for i, d in enumerate(st.done):
            if not d:
                trajs[i].info["stop_reason"] = "max_turns"
        if cfg.turn_reward_gate == "finished":
            for t in trajs:
                if t.info.get("stop_reason") not in FINISHED and any(r > 0 for r in t.turn_rewards):
                    t.info["gated_turn_rewards"] = list(t.turn_rewards)
                    t.turn_rewards = [min(r, 0.0) for r in t.turn_rewards]  # credits dropped, costs kept
        for t in trajs:
            if not t.completion_ids:  # TRL needs at least one completion token; a masked EOS carries no loss
                t.add_observation([tok.eos_token_id])
        closers = [(env.close, ()) for env in envs if callable(getattr(env, "close", None))]
        self._runner.run(closers, cfg.env_timeout)
        for t, seconds in zip(trajs, st.env_s):
            t.info["env_time_s"] = seconds
        self.last_stats = {
            "prefill_tokens": st.prefill_tokens,
            "first_turn_prefill_tokens": st.first_turn_prefill_tokens,
            "cached_tokens": st.cached_tokens,
            "generated_tokens": st.generated_tokens,
            "observation_tokens": sum(t.num_observation_tokens for t in trajs),
            "turns": sum(t.num_turns for t in trajs),
            "env_time_s": st.env_blocked_s,
            "env_busy_s": sum(st.env_s),
            "generation_s": st.generation_s,
            "wall_s": time.perf_counter() - wall0,
        }
        return trajs

    # ------------------------------------------------------------------ one trajectory's turn
    def _next_turn(self, st: _Run, i: int) -> tuple[list[int], int] | None:
        """The context ids and token budget of trajectory i's next turn, or None when it ends (marked on the
        trajectory). In the per-turn layout the context is recorded in ``turn_contexts``."""
        cfg, t = self.config, st.trajs[i]
        if t.num_turns >= cfg.max_turns:
            st.done[i], t.info["stop_reason"] = True, "max_turns"
            return None
        context = t.input_ids if cfg.turn_layout == "sequence" else self._render_context(st, i)  # (T,)
        if context is None:
            return None
        budget = self._turn_budget(st, i, len(context))
        if budget is None:
            return None
        if cfg.turn_layout == "per_turn":
            t.turn_contexts.append(context)
        return context, budget

    def _render_context(self, st: _Run, i: int) -> list[int] | None:
        """Trajectory i's per-turn context: its history, through the context function, rendered by the protocol. A
        context function that raises ends the trajectory as a recorded failure (None); a protocol or chat template
        that cannot render the messages raises (a set-up error, as in ``observation_ids``)."""
        history, context_fn = st.histories[i], self.config.context_fn
        try:
            messages = context_fn(history) if context_fn is not None else history
        except Exception as exc:  # a user function's failure: recorded on its trajectory, not fatal
            self._fail(st.trajs[i], "context_fn", exc, i, name="RolloutConfig")
            st.trajs[i].info["stop_reason"], st.done[i] = "context_error", True
            return None
        return self.protocol.render_context(self.tokenizer, messages, getattr(st.envs[i], "tools", None))

    def _turn_budget(self, st: _Run, i: int, context_length: int) -> int | None:
        """Token budget of trajectory i's next turn from a ``context_length``-token context, or None when a limit
        ends it (marked on the trajectory)."""
        cfg, t = self.config, st.trajs[i]
        budget = cfg.max_completion_length - len(t.completion_ids)
        if cfg.max_tokens_per_turn is not None:
            budget = min(budget, cfg.max_tokens_per_turn)
        if cfg.max_context_length is not None:
            budget = min(budget, cfg.max_context_length - context_length)
        # the per-turn cap ends a turn, not the trajectory (the protocol parses the cut turn as an invalid action):
        # only the overall budget truncates
        st.turn_capped[i] = cfg.max_tokens_per_turn is not None and budget == cfg.max_tokens_per_turn
        if budget <= 0:
            st.done[i], t.truncated, t.info["stop_reason"] = True, True, "max_tokens"
            return None
        return budget

    def _end_turn(self, st: _Run, i: int, out) -> Action | None:
        """Append a sampled turn; returns the action for the environment, or None when the trajectory ended."""
        t = st.trajs[i]
        st.prefill_tokens += out.prefill_tokens
        if t.num_turns == 0:
            st.first_turn_prefill_tokens += out.prefill_tokens
        st.cached_tokens += getattr(out, "cached_tokens", 0)
        st.generated_tokens += len(out.ids)
        t.add_action(out.ids, out.logprobs)
        text = self.tokenizer.decode(out.ids, skip_special_tokens=True)
        if self.config.turn_layout == "per_turn":
            st.histories[i].append({"role": "assistant", "content": text, "ids": list(out.ids)})
        action = self.protocol.parse(text, finished_by_eos=out.finish_reason == "eos")
        if out.finish_reason == "length" and not st.turn_capped[i]:
            # The action was cut by the trajectory's token budget: nothing left to execute.
            t.info["actions"].append(action.kind)
            t.truncated, t.info["stop_reason"], st.done[i] = True, "max_tokens", True
            return None
        if out.finish_reason == "length":
            # Cut by max_tokens_per_turn before the protocol's end of turn: whatever it parses as, it is not a
            # finished action (a chat message without EOS is not a final answer). The environment answers it as an
            # invalid action and the trajectory goes on.
            if action.kind == "invalid":
                action.cut = True
            else:
                action = Action(kind="invalid", text=text, cut=True, error="turn cut by max_tokens_per_turn")
        t.info["actions"].append(action.kind)
        if action.kind == "answer":
            t.info["final_answer"] = action.content
        return action

    def _apply_step(self, st: _Run, i: int, action: Action, step: Any, err: BaseException | None) -> bool:
        """Record the environment's answer to trajectory i's action; True when the trajectory goes on."""
        t, cfg = st.trajs[i], self.config
        if err is None and not isinstance(step, Step):
            err = TypeError(f"step() must return a Step, got {type(step).__name__}")
        if err is not None:
            self._fail(t, "step", err, i, st.envs[i])
            t.info["stop_reason"], st.done[i] = "env_error", True
            return False
        t.turn_rewards[-1] = float(step.reward)
        if step.info:
            t.info.setdefault("step_info", []).append(step.info)
        if action.kind == "answer" or step.done:
            t.info["stop_reason"], st.done[i] = ("answer" if action.kind == "answer" else "done"), True
            return False
        text, problem = _observation_text(step.observation)
        if problem:
            t.info.setdefault("observation_problems", []).append(problem)
        obs_ids, record = self.protocol.observation_ids(self.tokenizer, text, action)
        for key, flag in record.items():
            if flag:
                t.info[key] = t.info.get(key, 0) + 1
        if len(t.completion_ids) + len(obs_ids) >= cfg.max_completion_length:
            t.truncated, t.info["stop_reason"], st.done[i] = True, "max_tokens", True
            return False
        t.add_observation(obs_ids)
        if cfg.turn_layout == "per_turn":  # the environment's text: the protocol sanitizes and cuts it when rendering
            name = {"name": action.name} if action.name else {}
            st.histories[i].append({"role": "tool", "content": text, "action": action, **name})
        return True

    # ------------------------------------------------------------------ loops
    def _run_streaming(self, st: _Run, generator, sampling: SamplingParams) -> None:
        """Independent trajectories: generation steps token by token in this thread; finished turns' environment
        steps run in the pool meanwhile; a trajectory rejoins generation as soon as its observation is appended."""
        cfg = self.config
        sessions = _sessions(generator, st)  # seeds drawn in trajectory order
        pending: dict[Future, tuple[int, Action]] = {}

        def start_turn(i: int) -> None:
            turn = self._next_turn(st, i)
            if turn is None:
                sessions[i].drop()
            else:
                generator.submit(i, turn[0], turn[1], sampling, session=sessions[i])

        try:
            for i, d in enumerate(st.done):
                if not d:
                    start_turn(i)
            while True:
                for future in [f for f in pending if f.done()]:
                    i, action = pending.pop(future)
                    step, err, seconds = future.result()
                    st.env_s[i] += seconds
                    if self._apply_step(st, i, action, step, err):
                        start_turn(i)
                    else:
                        sessions[i].drop()
                if generator.has_work:
                    t0 = time.perf_counter()
                    finished = generator.step()
                    st.generation_s += time.perf_counter() - t0
                    for i, out in finished:
                        action = self._end_turn(st, i, out)
                        if action is None:
                            sessions[i].drop()
                        else:
                            pending[self._runner.submit(st.envs[i].step, (action,), cfg.env_timeout)] = (i, action)
                    continue
                if not pending:
                    break
                t0 = time.perf_counter()
                wait(list(pending), return_when=FIRST_COMPLETED)
                st.env_blocked_s += time.perf_counter() - t0
        finally:
            if generator.has_work:
                generator.cancel()
            for session in sessions:
                session.drop()

    def _run_lockstep(self, st: _Run, generator, sampling: SamplingParams) -> None:
        """One ``generate`` call per turn for the trajectories still running, then their environment steps together."""
        cfg = self.config
        collective = bool(getattr(generator, "requires_collective_calls", False))
        params = inspect.signature(generator.generate).parameters
        sessions = None
        if "sessions" in params and callable(getattr(generator, "new_session", None)):
            sessions = _sessions(generator, st)
        elif any(st.greedy):
            raise ValueError(f"greedy rows need a generator whose generate takes sessions; {type(generator).__name__} "
                             "does not.")
        for _turn in range(cfg.max_turns):
            runnable: list[tuple[int, list[int], int]] = []  # (trajectory, context ids, token budget)
            for i, d in enumerate(st.done):
                if not d and (turn := self._next_turn(st, i)) is not None:
                    runnable.append((i, *turn))
            if not runnable and not collective:
                break
            kwargs = {"sessions": [sessions[i] for i, _, _ in runnable]} if sessions is not None else {}
            t0 = time.perf_counter()
            outs = generator.generate([c for _, c, _ in runnable], [b for _, _, b in runnable], sampling, **kwargs)
            st.generation_s += time.perf_counter() - t0
            stepping: list[tuple[int, Action]] = []
            for (i, _, _), out in zip(runnable, outs):
                action = self._end_turn(st, i, out)
                if action is not None:
                    stepping.append((i, action))
            t0 = time.perf_counter()
            results = self._runner.run_timed([(st.envs[i].step, (a,)) for i, a in stepping], cfg.env_timeout)
            st.env_blocked_s += time.perf_counter() - t0
            for (i, action), (step, err, seconds) in zip(stepping, results):
                st.env_s[i] += seconds
                self._apply_step(st, i, action, step, err)
        if sessions is not None:
            for session in sessions:
                session.drop()
