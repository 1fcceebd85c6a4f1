"""One rank of the multi-process tests: launched by ``torchrun --standalone --nproc_per_node 2`` from
tests/test_multiprocess.py, it runs the phases named in a JSON spec and writes what it saw to ``rank{r}.json``.

Phases (each rank runs all of them, in order):

* ``vllm_pattern``: :class:`~trl_multiturn.generation.VLLMGenerator` in server mode with a stand-in for TRL's
  ``VLLMClient``, over the real gloo collectives (``Collectives.for_server``), driven by
  :class:`~trl_multiturn.rollout.MultiTurnRollout`; the ranks hold different numbers of trajectories that end after
  different numbers of turns (one rank may hold none). Records every rank's generate calls and the client's calls.
* recipe runs (``spec["runs"]``): ``main`` of recipes/search_agent.py with the spec's arguments, through a recording
  subclass of ``MultiTurnGRPOTrainer`` (it only observes: the rollouts' rewards, advantages and sampled ids, the
  group shuffle, the mini-batch normalizers, the batch plan, the trainable parameters before and after) and one
  test-only reward that varies with the sampled ids, so that advantages are not all zero on a random model. An audit
  hook records every file this rank opened for writing (or directory it made) under the run's output directory.
  A run may set ``"vllm": true``: then TRL's ``VLLMGeneration`` is replaced by a stand-in (server mode, no vLLM
  needed) whose client answers or searches by a fixed rule, and the recording shows which backend the rollouts used
  and when the weights were synced. A run may set ``"fsdp": true``: FSDP (from its ``--fsdp`` args) is then declared
  in the accelerator's state as accelerate does on GPUs (on CPU accelerate leaves FSDP off). A run may set
  ``"signal": false``: then the test-only reward is left out, every reward of a random model is 0 and so is every
  advantage, and the update is the expert loss's alone (with ``--expert_loss_coef``); the expert examples each
  micro-batch drew (step, indices) and the expert rows are recorded.

Nothing here changes what the trainer computes except the added reward; the assertions live in the test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import zlib
from pathlib import Path

import torch

from repo_scripts import load_recipe


def _key(ids) -> int:
    """A short fingerprint of a token-id sequence (compares sampled ids across ranks without shipping them)."""
    return zlib.crc32(json.dumps([int(i) for i in ids]).encode())


def sampled_ids_reward(completions, completion_ids, **kwargs) -> list[float]:
    """Test-only reward in [0, 1) that differs between almost any two sampled sequences."""
    return [(_key(ids) % 1000) / 1000.0 for ids in completion_ids]


# ---------------------------------------------------------------------------------------------------------------
# stand-ins for vLLM
# ---------------------------------------------------------------------------------------------------------------


class ScriptedClient:
    """Stand-in for TRL's ``VLLMClient`` (server mode). Each prompt continues with ``reply(prompt_text, first)``,
    where ``first`` says whether the prompt is the first one of the call; every call is recorded in ``events``."""

    def __init__(self, tokenizer, reply, events: list):
        self.tokenizer, self.reply, self.events = tokenizer, reply, events

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, logprobs=0,
                 generation_kwargs=None):
        self.events.append({"event": "generate", "rows": len(prompts), "max_tokens": max_tokens})
        completions = []
        for ids in prompts:
            text = self.reply(self.tokenizer.decode(ids), prompts[0] == ids)
            completions.append(self.tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens])
        return {
            "prompt_ids": prompts,
            "completion_ids": completions,
            "logprobs": [[[-1.0] for _ in c] for c in completions],
            "logprob_token_ids": [[[t] for t in c] for c in completions],
        }


def search_then_answer(prompt: str, first: bool) -> str:
    """Answer at once for the rows that share the call's first prompt, search once for the others, then answer."""
    if "<information>" in prompt or first:
        return "<answer>nobody</answer>"
    return "<search>who</search>"


def make_fake_vllm_generation(events: list):
    """A stand-in for ``trl.generation.vllm_generation.VLLMGeneration`` in server mode (TRL builds it in
    ``GRPOTrainer.__init__`` when ``use_vllm=True``); ``sync_weights`` is recorded in ``events``."""

    class FakeVLLMGeneration:
        def __init__(self, model, accelerator, processing_class, mode="server", generation_kwargs=None, **kwargs):
            if mode != "server":
                raise ValueError("the stand-in only serves vllm_mode='server'")
            self.model, self.accelerator, self.mode = model, accelerator, mode
            self.generation_kwargs = dict(generation_kwargs or {})
            self.tensor_parallel_size = 1
            tokenizer = getattr(processing_class, "tokenizer", processing_class)
            self.vllm_client = ScriptedClient(tokenizer, search_then_answer, events)

        def sync_weights(self):
            events.append({"event": "sync_weights"})

    return FakeVLLMGeneration


# ---------------------------------------------------------------------------------------------------------------
# phases
# ---------------------------------------------------------------------------------------------------------------


def run_vllm_pattern(spec: dict, state) -> dict:
    """Every rank rolls out its own examples through one server-mode ``VLLMGenerator`` per case."""
    from transformers import AutoTokenizer

    from trl_multiturn.generation import Collectives, SamplingParams, VLLMGenerator
    from trl_multiturn.protocols import TagProtocol
    from trl_multiturn.rollout import MultiTurnRollout, RolloutConfig

    from scripted import OneShotEnv  # tests/ is sys.path[0]: torchrun runs this file as a script

    tok = AutoTokenizer.from_pretrained(spec["model"])
    out = {}
    for name, case in spec["vllm_pattern"].items():
        events: list = []
        client = ScriptedClient(tok, lambda prompt, first: "<search>x</search>", events)
        gen = VLLMGenerator(tok, "server", client=client, collectives=Collectives.for_server(state))
        rollout = MultiTurnRollout(OneShotEnv, TagProtocol(use_chat_template=False), tok,
                                   RolloutConfig(max_turns=case["max_turns"], env_timeout=10.0))
        try:
            examples = [{"searches": s} for s in case["searches"][state.process_index]]
            trajs = rollout.run(examples, gen, SamplingParams())
        finally:
            rollout.close()
        out[name] = {"generate_calls": gen.calls, "turns": [t.num_turns for t in trajs],
                     "client_rows": [e["rows"] for e in events]}
    return out


class _WriteAudit:
    """Records the files this process opens for writing, and the directories it makes, under ``root``."""

    def __init__(self):
        self.root: str | None = None
        self.paths: list[str] = []
        sys.addaudithook(self)

    def __call__(self, event, args):
        if self.root is None or event not in ("open", "os.mkdir", "os.rename", "os.replace"):
            return
        path = args[0]
        if not isinstance(path, (str, bytes, os.PathLike)):
            return
        if event == "open":
            mode, flags = args[1], args[2]
            writes = (any(c in mode for c in "wax+") if isinstance(mode, str)
                      else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND)))
            if not writes:
                return
        path = os.path.abspath(os.fsdecode(path))
        if path == self.root or path.startswith(self.root + os.sep):
            self.paths.append(f"{event} {os.path.relpath(path, self.root)}")


def _recording_trainer(base, record: dict, signal: bool = True):
    """A subclass of the trainer that records what it computes (see the module docstring) and, with ``signal``, adds
    one reward."""
    import trl_multiturn.trainer as trainer_module

    original_shuffle = trainer_module.shuffle_groups

    def recording_shuffle(batch, group_size):
        n = batch["prompt_ids"].size(0)
        out = original_shuffle({**batch, "_row": torch.arange(n)}, group_size)
        record["shuffles"].append({"n": n, "group_size": group_size, "perm": out.pop("_row").tolist()})
        return out

    trainer_module.shuffle_groups = recording_shuffle

    class RecordingTrainer(base):
        def __init__(self, *args, reward_funcs=None, **kwargs):
            extra = [sampled_ids_reward] if signal else []
            super().__init__(*args, reward_funcs=list(reward_funcs or []) + extra, **kwargs)
            record["initial"] = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
            record["trainer"] = self
            if self._expert_loss is not None:
                expert, nll = self._expert_loss, self._expert_loss.nll
                record["expert"] = {"rows": expert.rows, "accum": expert.accum, "coef": expert.coef, "draws": []}

                def recording_nll(model, index, device):
                    record["expert"]["draws"].append({"step": self.state.global_step, "index": list(index)})
                    return nll(model, index, device)

                expert.nll = recording_nll

        def _run_rollout(self, inputs):
            record["events"].append({"event": "rollout", "rows": len(inputs)})
            record["in_rollout"] = True
            try:
                return super()._run_rollout(inputs)
            finally:
                record["in_rollout"] = False

        def _replace_advantages(self, output, trajs, mode):
            super()._replace_advantages(output, trajs, mode)
            record["rollouts"].append({
                "mode": mode,
                "global_rows": int(self._last_rewards_per_func.shape[0]),
                "prompt_keys": [_key(t.prompt_ids) for t in trajs],
                "completion_keys": [_key(t.completion_ids) for t in trajs],
                "action_tokens": [t.num_action_tokens for t in trajs],
                "turns": [t.num_turns for t in trajs],
                "rewards": [t.reward for t in trajs],
                "advantages": output["advantages"].float().tolist(),
            })

        def _attach_normalizers(self, chunks):
            super()._attach_normalizers(chunks)
            record["chunks"].append([
                {"rows": int(c["prompt_ids"].size(0)),
                 "lengths": (c["prompt_mask"].sum(1) + c["completion_mask"].sum(1)).tolist(),
                 "sequences": int((c["completion_mask"] * c["tool_mask"]).bool().any(dim=-1).sum()),
                 "mb_num_sequences": float(c["mb_num_sequences"]), "mb_num_tokens": float(c["mb_num_tokens"])}
                for c in chunks
            ])

    return RecordingTrainer, (lambda: setattr(trainer_module, "shuffle_groups", original_shuffle))


def run_recipe(name: str, run: dict, spec: dict, state, audit: _WriteAudit, out_dir: Path) -> dict:
    """``main`` of the recipe, recorded (see the module docstring)."""
    from trl import ModelConfig, TrlParser

    import trl_multiturn.search.evaluation as evaluation_module
    from trl_multiturn import MultiTurnGRPOConfig, MultiTurnGRPOTrainer
    from trl_multiturn.generation import TransformersGenerator, VLLMGenerator

    recipe = load_recipe()
    parser = TrlParser((recipe.SearchAgentArguments, MultiTurnGRPOConfig, ModelConfig))
    parser.set_defaults(**recipe.DEFAULTS)
    script_args, training_args, model_args = parser.parse_args_and_config(args=run["argv"])

    record = {"shuffles": [], "rollouts": [], "chunks": [], "events": [], "in_rollout": False}
    trainer_cls, restore = _recording_trainer(MultiTurnGRPOTrainer, record, signal=run.get("signal", True))
    recipe.MultiTurnGRPOTrainer = trainer_cls

    # which backend the training rollouts used: both are recorded in the event log while a rollout runs
    original_init, original_generate = TransformersGenerator.__init__, VLLMGenerator.generate

    def init(self, *args, **kwargs):
        if record["in_rollout"]:
            record["events"].append({"event": "transformers_generator"})
        original_init(self, *args, **kwargs)

    def generate(self, contexts, *args, **kwargs):
        if record["in_rollout"]:
            record["events"].append({"event": "vllm_generator_call", "rows": len(contexts)})
        return original_generate(self, contexts, *args, **kwargs)

    TransformersGenerator.__init__, VLLMGenerator.generate = init, generate

    eval_rows: list[int] = []

    class CountingRollout(evaluation_module.MultiTurnRollout):
        def run(self, examples, generator, sampling):
            eval_rows.append(len(examples))
            return super().run(examples, generator, sampling)

    original_rollout = evaluation_module.MultiTurnRollout
    evaluation_module.MultiTurnRollout = CountingRollout

    import trl.trainer.grpo_trainer as grpo_module
    from transformers import Trainer

    original_vllm = grpo_module.VLLMGeneration
    if run.get("vllm"):
        grpo_module.VLLMGeneration = make_fake_vllm_generation(record["events"])
    original_accelerator, declared = Trainer.create_accelerator_and_postprocess, []
    if run.get("fsdp"):
        def create_accelerator_and_postprocess(self):
            """accelerate turns FSDP on only on accelerator devices (on CPU the ranks would silently run plain data
            parallel): declare it in the accelerator's state as accelerate does there, from the run's FSDP args."""
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            original_accelerator(self)
            state = self.accelerator.state
            declared.append((state, getattr(state, "fsdp_plugin", None), state.distributed_type))
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.distributed_type = DistributedType.FSDP

        Trainer.create_accelerator_and_postprocess = create_accelerator_and_postprocess

    audit.root = os.path.abspath(training_args.output_dir)
    audit.paths = []
    try:
        results = recipe.main(script_args, training_args, model_args)
    finally:
        audit.root = None
        restore()
        evaluation_module.MultiTurnRollout = original_rollout
        grpo_module.VLLMGeneration = original_vllm
        Trainer.create_accelerator_and_postprocess = original_accelerator
        for state, plugin, kind in declared:
            state.fsdp_plugin, state.distributed_type = plugin, kind
        TransformersGenerator.__init__, VLLMGenerator.generate = original_init, original_generate

    trainer = record.pop("trainer")
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    torch.save({"initial": record.pop("initial"), "final": final}, out_dir / f"{name}_rank{state.process_index}_params.pt")
    plan = training_args.batch_plan
    return {
        **record,
        "writes": list(audit.paths),
        "eval_rows": eval_rows,
        "eval_summary_n": results["grpo"]["summary"]["all"]["n"] if "grpo" in results else None,
        "args": {
            "world_size": training_args.world_size,
            "per_device_train_batch_size": training_args.per_device_train_batch_size,
            "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
            "steps_per_generation": training_args.steps_per_generation,
            "generation_batch_size": training_args.generation_batch_size,
            "plan_world_size": plan.world_size,
            "plan_gradient_accumulation_steps": plan.gradient_accumulation_steps,
        },
        "num_processes": trainer.accelerator.num_processes,
        # the one-time layout checks' verdicts (None: not checked)
        "layouts": {"packing": trainer._packing_checked, "sharing": trainer._sharing_checked},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON spec written by tests/test_multiprocess.py")
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    out_dir = Path(spec["out"])

    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # on CPU, accelerate joins the ranks only when told
    audit = _WriteAudit()
    report: dict = {"rank": state.process_index, "world": state.num_processes, "phases": {}}
    phases = [("vllm_pattern", lambda: run_vllm_pattern(spec, state))]
    phases += [(name, lambda name=name, run=run: run_recipe(name, run, spec, state, audit, out_dir))
               for name, run in spec["runs"].items()]
    for name, phase in phases:
        try:
            report["phases"][name] = phase()
        except Exception:  # recorded for the test to show; the other phases still run
            report["phases"][name] = {"error": traceback.format_exc()}
            print(report["phases"][name]["error"], file=sys.stderr, flush=True)
        (out_dir / f"rank{state.process_index}.json").write_text(json.dumps(report, indent=1, default=str))
    state.wait_for_everyone()


if __name__ == "__main__":
    main()
