"""The multi-turn rollout loop over a batch of environments.

For each dataset row: ``env.reset(row)`` gives the first prompt; then, up to ``max_turns`` times, the policy samples
one turn (stopping at the protocol's stop strings or EOS), the protocol parses it into an :class:`Action`, the
environment answers with a :class:`Step`, and the protocol turns the observation into ids that are appended with
action mask 0. Sampled ids are appended exactly as sampled; nothing the policy produced is decoded and re-encoded.

A trajectory ends when the action is a final answer, the environment says ``done``, or a limit is reached
(``max_turns``, the token budget ``max_completion_length`` counted over actions AND observations, or the model's
context); a trajectory that stops on a limit is marked ``truncated``. Environment calls of a batch run
concurrently (sync ones in a thread pool, async ones on an event loop), each bounded by ``env_timeout``; an
environment that raises or hangs ends its trajectory with the error recorded (``info["env_errors"]``,
``info["failed"]=True``) and the rest of the batch goes on, unless ``raise_on_env_error`` is set.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from .environment import Action, Step
from .generation import SamplingParams
from .protocols import Protocol
from .trajectory import Trajectory

logger = logging.getLogger(__name__)


class EnvironmentError_(RuntimeError):
    """Raised (only with ``raise_on_env_error=True``) when an environment call fails or times out."""


class _EnvRunner:
    """Runs a batch of environment calls concurrently with a timeout each, on a private event loop thread."""

    def __init__(self, max_workers: int = 64):
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="env")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="env-loop", daemon=True)
        self._thread.start()

    def run(self, calls: list[tuple[Callable, tuple]], timeout: float | None) -> list[tuple[Any, BaseException | None]]:
        """Call each ``fn(*args)``; returns ``(result, error)`` pairs in order. Never raises for a call's error."""

        async def one(fn, args):
            if inspect.iscoroutinefunction(fn):
                aw = fn(*args)
            else:
                aw = self._loop.run_in_executor(self._pool, lambda: fn(*args))
            try:
                result = await asyncio.wait_for(aw, timeout)
                if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
                    result = await asyncio.wait_for(result, timeout)
                return result, None
            except asyncio.TimeoutError:
                return None, TimeoutError(f"timed out after env_timeout={timeout} s")
            except Exception as exc:  # an environment's own failure: recorded, not fatal
                return None, exc

        async def all_calls():
            return await asyncio.gather(*(one(fn, args) for fn, args in calls))

        if not calls:
            return []
        return asyncio.run_coroutine_threadsafe(all_calls(), self._loop).result()

    def close(self):
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class RolloutConfig:
    """Limits of one rollout (filled from ``MultiTurnGRPOConfig``)."""

    max_turns: int = 4
    max_completion_length: int = 1024
    max_tokens_per_turn: int | None = None
    max_context_length: int | None = None
    env_timeout: float | None = 30.0
    raise_on_env_error: bool = False


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
        self.env_factory = env_factory
        self.protocol = protocol
        self.tokenizer = tokenizer
        self.config = config
        self._runner = _EnvRunner()

    def close(self):
        self._runner.close()

    def _fail(self, traj: Trajectory, what: str, err: BaseException, example_index: int) -> None:
        message = f"{what} failed: {type(err).__name__}: {err}"
        traj.info.setdefault("env_errors", []).append(message)
        traj.info["failed"] = True
        if self.config.raise_on_env_error:
            raise EnvironmentError_(f"Environment {what} for example {example_index} failed: {err}") from err
        logger.warning("Environment %s for example %d failed (trajectory dropped): %s", what, example_index, err)

    def run(self, examples: list[dict], generator, sampling: SamplingParams) -> list[Trajectory]:
        """Roll out one trajectory per row of ``examples`` with ``generator`` (a generation backend)."""
        cfg, tok, protocol = self.config, self.tokenizer, self.protocol
        sampling = SamplingParams(**{**sampling.__dict__, "stop_strings": tuple(protocol.stop_strings)})
        envs = [self.env_factory() for _ in examples]
        t0 = time.perf_counter()
        resets = self._runner.run([(env.reset, (ex,)) for env, ex in zip(envs, examples)], cfg.env_timeout)
        env_time = time.perf_counter() - t0

        trajs: list[Trajectory] = []
        done: list[bool] = []
        for i, ((prompt, err), env) in enumerate(zip(resets, envs)):
            if err is None:
                try:
                    ids = protocol.prompt_ids(tok, prompt, tools=getattr(env, "tools", None))
                except ValueError as exc:
                    err = exc
            if err is not None:
                traj = Trajectory(prompt_ids=[tok.eos_token_id])
                self._fail(traj, "reset", err, i)
                traj.info["stop_reason"] = "reset_error"
                trajs.append(traj)
                done.append(True)
                continue
            if cfg.max_context_length is not None and len(ids) >= cfg.max_context_length:
                raise ValueError(
                    f"Example {i}: the prompt is {len(ids)} tokens, not shorter than the model context "
                    f"max_context_length={cfg.max_context_length}. Shorten the prompt or filter the dataset."
                )
            trajs.append(Trajectory(prompt_ids=ids, info={"actions": [], "stop_reason": None}))
            done.append(False)

        prefill_tokens = 0
        for _turn in range(cfg.max_turns):
            active = [i for i, d in enumerate(done) if not d]
            if not active:
                break
            budgets = []
            for i in active:
                t = trajs[i]
                budget = cfg.max_completion_length - len(t.completion_ids)
                if cfg.max_tokens_per_turn is not None:
                    budget = min(budget, cfg.max_tokens_per_turn)
                if cfg.max_context_length is not None:
                    budget = min(budget, cfg.max_context_length - len(t.prompt_ids) - len(t.completion_ids))
                budgets.append(budget)
            # the per-turn cap ends a turn, not the trajectory: only the overall budget truncates
            turn_capped = {
                i: cfg.max_tokens_per_turn is not None and b == cfg.max_tokens_per_turn
                for i, b in zip(active, budgets)
            }
            runnable = [(i, b) for i, b in zip(active, budgets) if b > 0]
            for i, b in zip(active, budgets):
                if b <= 0:
                    trajs[i].truncated, trajs[i].info["stop_reason"], done[i] = True, "max_tokens", True
            if not runnable:
                break
            outs = generator.generate(
                [trajs[i].input_ids for i, _ in runnable], [b for _, b in runnable], sampling
            )
            stepping: list[tuple[int, Action]] = []
            for (i, _), out in zip(runnable, outs):
                t = trajs[i]
                prefill_tokens += out.prefill_tokens
                t.add_action(out.ids, out.logprobs)
                text = tok.decode(out.ids, skip_special_tokens=True)
                action = protocol.parse(text, finished_by_eos=out.finish_reason == "eos")
                t.info["actions"].append(action.kind)
                if out.finish_reason == "length" and not turn_capped[i]:
                    # The action was cut by the trajectory's token budget: nothing left to execute.
                    t.truncated, t.info["stop_reason"], done[i] = True, "max_tokens", True
                    continue
                if action.kind == "answer":
                    t.info["final_answer"] = action.content
                stepping.append((i, action))

            t0 = time.perf_counter()
            results = self._runner.run([(envs[i].step, (a,)) for i, a in stepping], cfg.env_timeout)
            env_time += time.perf_counter() - t0
            for (i, action), (step, err) in zip(stepping, results):
                t = trajs[i]
                if err is None and not isinstance(step, Step):
                    err = TypeError(f"step() must return a Step, got {type(step).__name__}")
                if err is not None:
                    self._fail(t, "step", err, i)
                    t.info["stop_reason"], done[i] = "env_error", True
                    continue
                t.turn_rewards[-1] = float(step.reward)
                if step.info:
                    t.info.setdefault("step_info", []).append(step.info)
                if action.kind == "answer" or step.done:
                    t.info["stop_reason"], done[i] = ("answer" if action.kind == "answer" else "done"), True
                    continue
                text, problem = _observation_text(step.observation)
                if problem:
                    t.info.setdefault("observation_problems", []).append(problem)
                obs_ids, record = protocol.observation_ids(tok, text, action)
                for key, flag in record.items():
                    if flag:
                        t.info[key] = t.info.get(key, 0) + 1
                if len(t.completion_ids) + len(obs_ids) >= cfg.max_completion_length:
                    t.truncated, t.info["stop_reason"], done[i] = True, "max_tokens", True
                    continue
                t.add_observation(obs_ids)

        for i, d in enumerate(done):
            if not d:
                trajs[i].truncated, trajs[i].info["stop_reason"] = True, "max_turns"
        for t in trajs:
            if not t.completion_ids:  # TRL needs at least one completion token; a masked EOS carries no loss
                t.add_observation([tok.eos_token_id])
        closers = [(env.close, ()) for env in envs if callable(getattr(env, "close", None))]
        self._runner.run(closers, cfg.env_timeout)
        for t in trajs:
            t.info["env_time_s"] = env_time / max(len(trajs), 1)
        self.last_stats = {"prefill_tokens": prefill_tokens, "env_time_s": env_time}
        return trajs
