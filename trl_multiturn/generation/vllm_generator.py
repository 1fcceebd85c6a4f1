"""The vLLM backend: :class:`VLLMGenerator` sends each turn's token-id prompts through TRL's vLLM integration
(colocate or server mode), and :class:`Collectives` are the gather / broadcast it calls across the ranks that share
one engine.
"""

from __future__ import annotations

from .sampling import GenerationOutput, SamplingParams, _eos_ids, _StopChecker


class Collectives:
    """The collective operations :class:`VLLMGenerator` needs, over the ranks that share one vLLM engine.

    ``all_gather(obj)`` returns the objects of every rank in rank order, ``broadcast(obj)`` returns rank 0's object
    on every rank; ``rank`` and ``is_main`` say where this process stands. The default for one process is the
    identity; :meth:`for_server` uses ``accelerate`` over all processes (server mode), :meth:`for_group` uses
    ``torch.distributed`` on a tensor-parallel group (colocate mode). Tests pass a stand-in with the same methods.
    """

    rank = 0
    is_main = True

    def all_gather(self, obj) -> list:
        return [obj]

    def broadcast(self, obj):
        return obj

    @staticmethod
    def for_server(accelerator) -> Collectives:
        if accelerator is None or accelerator.num_processes == 1:
            return Collectives()
        return _AccelerateCollectives(accelerator)

    @staticmethod
    def for_group(group) -> Collectives:
        return Collectives() if group is None else _GroupCollectives(group)


class _AccelerateCollectives(Collectives):
    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.rank, self.is_main = accelerator.process_index, accelerator.is_main_process

    def all_gather(self, obj) -> list:
        from accelerate.utils import gather_object

        return gather_object([obj])

    def broadcast(self, obj):
        from accelerate.utils import broadcast_object_list

        box = [obj]
        broadcast_object_list(box, from_process=0)
        return box[0]


class _GroupCollectives(Collectives):
    def __init__(self, group):
        import torch.distributed as dist

        self.group, self.dist = group, dist
        self.rank = dist.get_rank(group=group)
        self.is_main = self.rank == 0

    def all_gather(self, obj) -> list:
        out = [None] * self.dist.get_world_size(group=self.group)
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, group_src=0, group=self.group)
        return box[0]


class VLLMGenerator:
    """One turn for a batch of token-id contexts through TRL's vLLM integration (``use_vllm=True``).

    Departures from TRL's ``VLLMGeneration.generate``, which serves single-turn prompts: each row has its own token
    budget and the protocol's stop strings (vLLM ``stop`` with ``include_stop_str_in_output=True``, so a turn never
    runs past ``</search>``), ranks may hold different numbers of rows (each rank's rows are gathered as one list),
    and the sampled ids come back with their log-probs and a finish reason. Prompts are token ids, never re-encoded
    text; vLLM's prefix cache keeps the history of a trajectory from being recomputed at the next turn.

    Collective-call rule: in server mode every rank gathers its rows to the main process, which calls the server,
    and receives the results by broadcast; in colocate mode with tensor parallelism the ranks of a group gather
    their rows and all call the engine. Both are collective, so **every rank must call** :meth:`generate` **the
    same number of times**, also with no rows. This backend sets ``requires_collective_calls = True``, and
    :class:`~trl_multiturn.rollout.MultiTurnRollout` then makes exactly ``max_turns`` calls per rollout on every
    rank, with an empty list once its own trajectories are done (the engine is not called when no rank has a row).

    Args:
        tokenizer: the policy's tokenizer (stop-string checks and EOS ids).
        mode: "colocate" (``llm`` is an in-process ``vllm.LLM``) or "server" (``client`` is TRL's ``VLLMClient``).
        llm: the ``vllm.LLM`` of colocate mode (TRL's ``trainer.vllm_generation.llm``).
        client: the ``VLLMClient`` of server mode (TRL's ``trainer.vllm_generation.vllm_client``).
        collectives: a :class:`Collectives` (default: one process; :meth:`from_trl` picks the right one).
        sampling_params_cls: vLLM's ``SamplingParams`` (imported from ``vllm`` when not given; tests pass a stand-in).
        generation_kwargs: extra vLLM sampling parameters (``seed``, ``repetition_penalty``, ...), as TRL's
            ``generation_kwargs``.
    """

    supports_streaming = False
    requires_collective_calls = True

    def __init__(
        self,
        tokenizer,
        mode: str,
        llm=None,
        client=None,
        collectives: Collectives | None = None,
        sampling_params_cls=None,
        generation_kwargs: dict | None = None,
    ):
        if mode not in ("colocate", "server"):
            raise ValueError(f"VLLMGenerator mode must be 'colocate' or 'server'; got {mode!r} (TRL's vllm_mode).")
        if mode == "colocate" and llm is None:
            raise ValueError("VLLMGenerator(mode='colocate') needs llm (TRL's trainer.vllm_generation.llm).")
        if mode == "server" and client is None:
            raise ValueError("VLLMGenerator(mode='server') needs client (TRL's trainer.vllm_generation.vllm_client).")
        self.tokenizer = tokenizer
        self.mode = mode
        self.llm = llm
        self.client = client
        self.collectives = collectives or Collectives()
        self._sampling_params_cls = sampling_params_cls
        self.generation_kwargs = dict(generation_kwargs or {})
        self.eos_token_ids = _eos_ids(tokenizer)
        self.calls = 0

    @classmethod
    def from_trl(cls, vllm_generation, tokenizer, generation_kwargs: dict | None = None) -> VLLMGenerator:
        """Build from TRL's ``trainer.vllm_generation`` (``trl.generation.vllm_generation.VLLMGeneration``)."""
        mode = vllm_generation.mode
        kwargs = dict(vllm_generation.generation_kwargs or {})
        kwargs.update(generation_kwargs or {})
        if mode == "server":
            collectives = Collectives.for_server(vllm_generation.accelerator)
        else:
            tp = getattr(vllm_generation, "tensor_parallel_size", 1)
            collectives = Collectives.for_group(vllm_generation.tp_group if tp > 1 else None)
        return cls(
            tokenizer,
            mode,
            llm=getattr(vllm_generation, "llm", None) if mode == "colocate" else None,
            client=getattr(vllm_generation, "vllm_client", None) if mode == "server" else None,
            collectives=collectives,
            generation_kwargs=kwargs,
        )

    def _sampling_kwargs(self, params: SamplingParams, max_tokens: int) -> dict:
        kwargs = {
            "n": 1,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_tokens": max_tokens,
            "logprobs": 0,
            "skip_special_tokens": False,
        }
        stops = [s for s in params.stop_strings if s]
        if stops:
            kwargs["stop"] = stops
            kwargs["include_stop_str_in_output"] = True
        kwargs.update(self.generation_kwargs)
        return kwargs

    def generate(
        self, contexts: list[list[int]], max_new_tokens: list[int] | int, params: SamplingParams
    ) -> list[GenerationOutput]:
        """Sample one turn for each context (collective: see the class docstring)."""
        n = len(contexts)
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * n
        self.calls += 1
        stop = _StopChecker(self.tokenizer, self.eos_token_ids, tuple(params.stop_strings))
        rows = [(list(c), int(b)) for c, b in zip(contexts, max_new_tokens) if b > 0]
        gathered = self.collectives.all_gather(rows)  # one list of (ids, budget) per rank
        flat = [row for part in gathered for row in part]
        if self.mode == "colocate":
            results = self._generate_colocate(flat, params) if flat else []
        else:
            results = self._generate_server(flat, params) if self.collectives.is_main and flat else None
            results = self.collectives.broadcast(results) or []
        start = sum(len(part) for part in gathered[: self.collectives.rank])
        mine = iter(results[start : start + len(rows)])
        outputs = []
        for ctx, budget in zip(contexts, max_new_tokens):
            if budget <= 0:
                outputs.append(GenerationOutput())
                continue
            ids, logprobs = next(mine)
            ids, logprobs = list(ids)[:budget], list(logprobs)[:budget]  # server mode asks for the largest budget
            reason = (stop(ids, budget) or "length") if ids else "length"
            outputs.append(GenerationOutput(ids=ids, logprobs=logprobs, finish_reason=reason, prefill_tokens=len(ctx)))
        return outputs

    def _generate_colocate(self, rows, params) -> list[tuple[list[int], list[float]]]:
        cls = self._sampling_params_cls
        if cls is None:
            from vllm import SamplingParams as cls  # noqa: N813
        sampling = [cls(**self._sampling_kwargs(params, budget)) for _, budget in rows]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids, _ in rows], sampling_params=sampling, use_tqdm=False)
        results = []
        for request in outs:
            o = request.outputs[0]
            ids = list(o.token_ids)
            logprobs = [float(step[t].logprob) for step, t in zip(o.logprobs or [], ids)]
            if len(logprobs) != len(ids):
                raise RuntimeError(
                    f"vLLM returned {len(ids)} ids but {len(logprobs)} log-probs; the sampling parameters must ask for "
                    "logprobs=0 (the sampled token's log-prob)."
                )
            results.append((ids, logprobs))
        return results

    def _generate_server(self, rows, params) -> list[tuple[list[int], list[float]]]:
        """One request to the server for every rank's rows (main process only); ``max_tokens`` is the largest
        budget and each row is cut to its own afterwards."""
        kwargs = self._sampling_kwargs(params, max(b for _, b in rows))
        direct = {k: kwargs.pop(k) for k in ("temperature", "top_p", "top_k", "max_tokens", "logprobs")}
        kwargs.pop("n")
        out = self.client.generate(prompts=[ids for ids, _ in rows], n=1, generation_kwargs=kwargs, **direct)
        token_lists = out.get("logprob_token_ids") or [None] * len(rows)
        results = []
        for ids, steps, step_ids in zip(out["completion_ids"], out["logprobs"], token_lists):
            picked = []
            for t, (token, step) in enumerate(zip(ids, steps)):
                k = step_ids[t].index(token) if step_ids is not None and token in step_ids[t] else 0
                picked.append(float("nan") if step[k] is None else float(step[k]))
            results.append((list(ids), picked))
        return results
