"""What every rank of the learner does: the DeepSpeed actor and critic and the commands run on them.

Rank 0's gRPC servicer (server.py) decodes and checks each request, splits the work and sends each
rank its share through the RankGroupDriver; every rank, rank 0 included, runs the same command
here on its share. Commands meet in the same collectives in the same order on every rank, which
is why even a rank with no samples runs its forward passes under ZeRO-3 (parameters are gathered
collectively, layer by layer).
"""

from __future__ import annotations

import datetime
import os
import pathlib
import shutil
import socket
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from services.common import rl_math
from services.common.is_correction import is_correction_weights, rollout_kl
from services.common.crash_points import crash_point
from services.common.errors import failed_precondition
from services.common.log import get_logger, log_event
from services.common.logprobs import sequence_logprobs, token_logprobs
from services.common import ownership
from services.learner import checkpoint, entropy_metric, host_offload, logprob_head, moe_aux, universal, warmup
from services.learner.batches import MicroBatch, Sample, StepPlan, collate, ragged_rows
from services.learner.config import LearnerConfig
from services.learner.export_dtype import checkpoint_dtype, export_dtype, record_dtype
from services.learner.deepspeed_setup import (
    build_engine,
    current_lr,
    deepspeed_config,
    load_pretrained,
    trainable_parameters,
)
from services.learner.logprob_head import forward_micro_batch
from services.learner.lora import save_adapter
from services.learner.profiling import CallProfiler
from services.learner.spmd import CANCEL, RankSpec, join_process_group
from services.learner.token_values import token_values
from services.learner.weight_push import Chunk, WeightSender

log = get_logger("learner")

# A two-token stand-in for ranks with no samples left in a forward pass (ZeRO-3 needs them there).
_FILLER = Sample(torch.tensor([0, 0]), 1, {})


class LearnerRank:
    def __init__(self, config: LearnerConfig, spec: RankSpec):
        self.config = config
        self.spec = spec
        self.device = torch.device("cuda", spec.local_rank) if spec.backend == "nccl" else torch.device("cpu")
        self.actor = None
        self.critic = None
        self.vocab_size = 0
        self.max_len = 0
        self.offloaded = False
        self.weight_version = 0
        self.sender = WeightSender(spec.rank, self.device)
        self._keepalive = []
        self.profile = CallProfiler(spec.rank)  # RLMESH_PROFILE_DIR: traces of chosen calls

    # ------------------------------------------------------------------------------------------
    # Set-up

    def setup(self) -> tuple[object, Callable]:
        """Joins the process group and builds the engines (collective). Returns (control group, execute)."""
        started = time.monotonic()
        group = join_process_group(self.spec, self._store(), self.config.dist_timeout_s)
        cfg = self.config
        ds_config = deepspeed_config(cfg, self.spec.world_size)
        model, keep = load_pretrained(cfg.pretrain, cfg, ds_config, "causal_lm", adapter=cfg.lora)
        self._keepalive.append(keep)
        self.vocab_size = model.config.vocab_size
        self.max_len = cfg.max_len or int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.actor = build_engine(model, cfg, ds_config, cfg.actor_learning_rate)
        if cfg.critic_pretrain:
            critic, keep = load_pretrained(cfg.critic_pretrain, cfg, ds_config, "critic")
            self._keepalive.append(keep)
            if critic.config.vocab_size < self.vocab_size:
                raise ValueError(f"--critic_pretrain vocabulary ({critic.config.vocab_size}) is smaller than the "
                                 f"actor's ({self.vocab_size}); use a critic with the actor's tokenizer")
            self.critic = build_engine(critic, cfg, ds_config, cfg.critic_learning_rate)
        warm_s = warmup.warm_up(self) if self.device.type == "cuda" else 0.0
        warmup.freeze_heap()
        log_event(log, "rank.ready", rank=self.spec.rank, world_size=self.spec.world_size,
                  zero_stage=cfg.zero_stage, critic=bool(self.critic), seconds=round(time.monotonic() - started, 1),
                  warm_up_s=round(warm_s, 2))
        return group, self.execute

    def _store(self):
        # A connection of its own to rank 0's store server (which the driver started).
        return dist.TCPStore(self.spec.master_addr, self.spec.master_port, self.spec.world_size, is_master=False,
                             timeout=datetime.timedelta(seconds=self.config.startup_timeout_s))

    def info(self) -> dict:
        return {
            "actor_global_step": int(self.actor.global_steps),
            "critic_global_step": int(self.critic.global_steps) if self.critic else 0,
            "actor_num_parameters": trainable_parameters(self.actor),
            "critic_num_parameters": trainable_parameters(self.critic) if self.critic else 0,
            "vocab_size": self.vocab_size,
            "max_len": self.max_len,
            "weight_version": self.weight_version,
            "offloaded": self.offloaded,
            "rank0_host": socket.gethostname(),
        }

    def execute(self, name: str, payload):
        handler = {
            "info": lambda _: self.info(),
            "logprobs": self.logprobs,
            "values": self.values,
            "train_actor": self.train_actor,
            "train_critic": self.train_critic,
            "init_weight_transfer": self.init_weight_transfer,
            "push_chunk": self.push_chunk,
            "push_done": self.push_done,
            "save_checkpoint": self.save_checkpoint,
            "load_checkpoint": self.load_checkpoint,
            "export_hf": self.export_hf,
            "offload": self.offload,
            "reload": self.reload,
        }.get(name)
        if handler is None:
            raise ValueError(f"unknown command {name!r}")
        if self.offloaded and name not in ("info", "offload", "reload", "init_weight_transfer"):
            raise failed_precondition(f"the learner is offloaded (Offload was called); call Reload before {name}")
        with self.profile(name):
            return handler(payload)

    # ------------------------------------------------------------------------------------------
    # Forward passes

    @staticmethod
    def _forward_passes(micro_batches: list[list[Sample]], passes: int):
        """Yields (samples, is_filler) for `passes` forward passes over this rank's micro-batches;
        stops between passes when the caller has gone (spmd.CancelPoint)."""
        for p in range(passes):
            CANCEL.check(p, passes, "forward pass")
            yield (micro_batches[p], False) if p < len(micro_batches) else ([_FILLER], True)

    @torch.no_grad()
    def logprobs(self, payload: dict) -> list[torch.Tensor]:
        """Per sample: (response_len,) float32 log-probs under the actor. Padded micro-batches go
        through sequence_logprobs, as in the reference service (bit for bit the same); packed ones
        through the training path (actor_outputs, --logprobs_head)."""
        self.actor.eval()
        packed = payload.get("packed", False)

        def forward(mb: MicroBatch) -> torch.Tensor:
            if packed:
                return self.actor_outputs(mb, payload["temperature"], want_entropy=False)[0]
            lp = sequence_logprobs(self.actor, mb.input_ids, mb.attention_mask, payload["temperature"])
            return lp.reshape(-1)[mb.out_index]

        return self._forward_rows(payload, forward)

    @torch.no_grad()
    def values(self, payload: dict) -> list[torch.Tensor]:
        """Per sample: (response_len,) float32 critic values (value of the state before each token)."""
        self.critic.eval()
        return self._forward_rows(payload, self._critic_values)

    def _forward_rows(self, payload: dict, forward: Callable[[MicroBatch], torch.Tensor]) -> list[torch.Tensor]:
        """forward(mb) -> (B, R) over the payload's micro-batches, read back to the host once at the
        end, not after every pass."""
        results = []
        for chunk, filler in self._forward_passes(payload["micro_batches"], payload["passes"]):
            mb = collate(chunk, packed=payload.get("packed", False)).to(self.device)
            out = forward(mb)
            if not filler:
                results.append((out.float(), chunk))
        return [row for out, chunk in results for row in ragged_rows(out.cpu(), chunk)]

    def _critic_values(self, mb: MicroBatch) -> torch.Tensor:
        """(B, R) float32 values at the response positions."""
        return self._critic_values_and_aux(mb, want_aux=False)[0]

    def _critic_values_and_aux(self, mb: MicroBatch, want_aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, R) float32 values at the response positions, and the MoE router loss of the same forward
        when asked (else None)."""
        values, aux = token_values(self.critic, mb, want_aux)  # (rows, T)
        return values[:, :-1].reshape(-1)[mb.out_index].float(), aux

    def actor_outputs(self, mb: MicroBatch, temperature: float, want_entropy: bool, want_aux: bool = False,
                      measure_entropy: bool = False):
        """(B, R) log-probs of the response tokens, their entropies when asked (else None), and the
        MoE router's load-balancing loss when asked (else None). measure_entropy: the entropies as a
        metric, without a graph where the head allows (services/learner/entropy_metric.py)."""
        if self.config.logprobs_head != "full":
            return logprob_head.response_outputs(self.actor.module, mb, temperature, self.config.logprobs_head,
                                                 self.config.logprobs_chunk_tokens, want_entropy or measure_entropy,
                                                 want_aux)
        outputs = forward_micro_batch(self.actor, mb, **(moe_aux.ROUTER_KWARGS if want_aux else {}))
        aux = moe_aux.router_aux_loss(self.actor, outputs, mb.attention_mask) if want_aux else None
        logits = outputs.logits  # (rows, T, V)
        vocab = logits.shape[-1]
        # Only the response positions go through the log-softmax: prompts can be long.
        response_logits = logits[:, :-1].reshape(-1, vocab)[mb.out_index]  # (B, R, V)
        labels = mb.input_ids[:, 1:].reshape(-1)[mb.out_index]  # (B, R)
        logp = token_logprobs(response_logits, labels, temperature)
        if want_entropy:
            entropy = rl_math.entropy_from_logits(response_logits, temperature)
        else:
            entropy = entropy_metric.entropy_without_grad(response_logits, temperature) if measure_entropy else None
        return logp, entropy, aux

    # ------------------------------------------------------------------------------------------
    # Training

    def _train(self, engine, steps: list[StepPlan], micro_loss: Callable) -> dict:
        """Runs the optimizer steps of this rank's plan; micro_loss(mb, step) -> (loss, stats), the
        stats 0-d tensors on the device, read back once per optimizer step (not per micro-batch).

        The loss of a micro-batch is its share of the global mini-batch loss (the normalizer counts
        tokens or sequences over all micro-batches and ranks); DeepSpeed divides by its configured
        gradient accumulation steps and averages over ranks, so the loss is scaled back up by both.
        A step's last micro-batch is marked as the accumulation boundary, so a step may hold any
        number of micro-batches (--use_dynamic_batch), the same on every rank.
        """
        engine.train()
        world = self.spec.world_size
        timing = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        results = []
        for index, step in enumerate(steps):
            # Between optimizer steps the engine holds no partial gradients: a caller that has gone
            # (spmd.CancelPoint) leaves the model with the steps done so far.
            CANCEL.check(index, len(steps), "optimizer step")
            gas = engine.gradient_accumulation_steps()
            skipped_before = engine.skipped_steps
            lr = current_lr(engine)  # the rate this step applies (the scheduler moves after it)
            sums: dict[str, torch.Tensor] = {}
            for m, micro in enumerate(step.micro_batches):
                t0 = time.perf_counter()
                mb = collate(micro, packed=self.config.packing_samples).to(self.device)
                loss, stats = micro_loss(mb, step)
                crash_point("learner.rank.forward_done")
                t1 = time.perf_counter()
                engine.set_gradient_accumulation_boundary(m == len(step.micro_batches) - 1)
                engine.backward(loss * (gas * world))
                crash_point("learner.rank.backward_done")
                t2 = time.perf_counter()
                engine.step()
                crash_point("learner.rank.step_done")
                t3 = time.perf_counter()
                timing["forward"] += t1 - t0
                timing["backward"] += t2 - t1
                timing["optimizer"] += t3 - t2
                for key, value in stats.items():
                    value = torch.as_tensor(value, device=self.device).detach().double()
                    sums[key] = sums[key] + value if key in sums else value
            norm = engine.get_global_grad_norm()
            skipped = engine.skipped_steps > skipped_before
            values = torch.stack(list(sums.values())).tolist() if sums else []  # the step's one read-back
            results.append({"sums": dict(zip(sums, values)), "skipped": skipped, "lr": lr,
                            "grad_norm": float(norm) if norm is not None else float("nan")})
            if skipped:
                log_event(log, "train.step_skipped", rank=self.spec.rank, reason="non-finite loss or gradient",
                          level=30)
        return {"steps": results, "timing": timing, "global_step": int(engine.global_steps),
                "micro_batches": sum(len(step.micro_batches) for step in steps)}

    def train_actor(self, payload: dict) -> dict:
        loss_cfg = payload["loss"]
        level = loss_cfg["level"]
        policy_level = loss_cfg.get("policy_level", level)
        temperature = loss_cfg["temperature"]
        kl_coef, entropy_coef = loss_cfg["kl_coef"], loss_cfg["entropy_coef"]
        tis_cap, aux_coef = loss_cfg.get("tis_cap", 0.0), loss_cfg.get("aux_loss_coef", 0.0)
        measure_entropy = entropy_metric.measured(self.config.logprobs_head, entropy_coef)
        gspo = loss_cfg["ratio_type"] == "sequence"

        def micro_loss(mb: MicroBatch, step: StepPlan):
            # Each term is normalised by the global batch's count of its own unit (tokens or
            # sequences), so accumulated micro-batches equal one big batch.
            normalizer = step.tokens if level == "token" else step.sequences
            policy_normalizer = step.tokens if policy_level == "token" else step.sequences
            mask = mb.action_mask
            old = mb.fields["old_logprobs"]
            logp, entropy, aux = self.actor_outputs(mb, temperature, entropy_coef != 0, aux_coef > 0,
                                                    measure_entropy=measure_entropy)
            # Importance-sampling correction: the rollout engine's log-probs are the behaviour policy
            # (async lag, other kernels). Token weights for PPO; GSPO takes its sequence ratio from them.
            rollout = mb.fields["rollout_logprobs"] if tis_cap > 0 else None
            is_weights = (is_correction_weights(old, rollout, mask, loss_cfg["is_correction_type"],
                                                loss_cfg["tis_low"], tis_cap) if rollout is not None and not gspo
                          else None)
            out = rl_math.policy_loss(logp, old, mb.fields["advantages"], mask,
                                      eps_low=loss_cfg["eps_low"], eps_high=loss_cfg["eps_high"],
                                      dual_clip=loss_cfg["dual_clip"], ratio_type=loss_cfg["ratio_type"],
                                      level=policy_level, normalizer=policy_normalizer, is_weights=is_weights,
                                      behaviour_logp=rollout if gspo else None)
            loss = out.loss
            tokens = mask.sum()
            stats = {"policy_loss": out.loss, "clip_ratio": out.clip_ratio * tokens, "ppo_kl": out.ppo_kl * tokens,
                     "tokens": tokens}
            if rollout is not None:  # means per token once divided by the tokens
                stats["rollout_kl"] = rollout_kl(old, rollout, mask) * tokens
            if is_weights is not None:
                stats["tis_weight"] = is_weights.sum()
            if aux is not None:
                # OpenRLHF adds coef x aux_loss to every micro-batch's loss, which DeepSpeed then
                # averages: here each micro-batch's share of that mean over the step's micro-batches.
                share = aux.float() / (len(step.micro_batches) * self.spec.world_size)
                loss = loss + aux_coef * share
                stats["aux_loss"] = share.detach()
            if kl_coef > 0:
                kl = rl_math.kl_loss(logp, mb.fields["ref_logprobs"], mask, loss_cfg["kl_estimator"], level,
                                     normalizer)
                loss = loss + kl_coef * kl
                stats["kl_loss"] = kl
            if entropy_coef != 0:
                ent = rl_math.aggregate_loss(entropy, mask, level, normalizer)
                loss = loss - entropy_coef * ent
                stats["entropy"] = ent
            elif entropy is not None:  # measured only: the same aggregate, outside the loss
                stats["entropy"] = rl_math.aggregate_loss(entropy.detach(), mask, level, normalizer)
            return loss, stats

        return self._train(self.actor, payload["steps"], micro_loss)

    def train_critic(self, payload: dict) -> dict:
        level, value_clip = payload["level"], payload["value_clip"]
        aux_coef = payload.get("aux_loss_coef", 0.0)

        def micro_loss(mb: MicroBatch, step: StepPlan):
            normalizer = step.tokens if level == "token" else step.sequences
            mask = mb.action_mask
            values, aux = self._critic_values_and_aux(mb, want_aux=aux_coef > 0)
            old_values = mb.fields.get("old_values", values.detach())
            loss = rl_math.value_loss(values, old_values, mb.fields["returns"], mask, value_clip, level, normalizer)
            stats = {"value_loss": loss, "tokens": mask.sum(), "values": rl_math.masked_sum(values.detach(), mask)}
            if aux is not None:  # as the actor's: each micro-batch's share of the mean over the step's micro-batches
                share = aux.float() / (len(step.micro_batches) * self.spec.world_size)
                loss = loss + aux_coef * share
                stats["aux_loss"] = share.detach()
            if value_clip is not None:
                moved = (values.detach() - old_values).abs() > value_clip
                stats["value_clip_ratio"] = rl_math.masked_sum(moved.float(), mask)
            return loss, stats

        return self._train(self.critic, payload["steps"], micro_loss)

    # ------------------------------------------------------------------------------------------
    # Weight push

    def init_weight_transfer(self, payload: dict) -> None:
        self.sender.init(**payload)
        crash_point("learner.push.group_built")

    def push_chunk(self, payload: dict) -> tuple[dict, list[bytes]]:
        chunk: Chunk = payload["chunk"]
        sent = self.sender.send_chunk(self.actor.module, self.config.zero_stage == 3, chunk)
        crash_point("learner.push.chunk_sent")
        return sent

    def push_done(self, payload: dict) -> None:
        self.sender.release()
        if payload.get("version") is not None:
            self.weight_version = int(payload["version"])
            crash_point("learner.push.version_committed")

    # ------------------------------------------------------------------------------------------
    # Checkpoints and export

    def _engines(self) -> dict:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}

    def save_checkpoint(self, payload: dict) -> dict:
        root = pathlib.Path(payload["ckpt_path"])
        folder = checkpoint.step_dir(root, payload["global_step"])
        if self.spec.rank == 0:
            # A retried save of the same step: the old marker goes first, so the folder never looks
            # complete while it is being rewritten.
            (folder / checkpoint.MARKER).unlink(missing_ok=True)
            ownership.make_owned_dir(folder, "checkpoint")  # the server checked root and folder (ownership)
            checkpoint.write_atomic(folder / checkpoint.CLIENT_STATE, payload["client_state"])
            crash_point("learner.checkpoint.client_state_written")
        dist.barrier()
        for name, engine in self._engines().items():
            engine.save_checkpoint(str(folder), tag=name, save_latest=False)
            crash_point("learner.checkpoint.model_written")
        # Each rank fsyncs what is there (its own shards included) before rank 0 writes the marker.
        checkpoint.fsync_tree(folder)
        dist.barrier()
        removed: list[str] = []
        if self.spec.rank == 0:
            marker = checkpoint.marker_contents(self.spec.world_size, self.config.zero_stage,
                                                list(self._engines()), payload["global_step"])
            checkpoint.write_atomic(folder / checkpoint.MARKER, marker)
            crash_point("learner.checkpoint.marker_renamed")
            removed = checkpoint.prune(root, payload["max_ckpt_num"], folder)
            crash_point("learner.checkpoint.pruned")
        return {"path": str(folder), "removed": removed}

    def load_checkpoint(self, payload: dict) -> dict:
        folder = pathlib.Path(payload["path"])
        for name, engine in self._engines().items():
            if payload.get("universal"):  # saved under another layout, converted by rank 0 (server.py)
                universal.load(engine, pathlib.Path(payload["universal"]), name)
                continue
            load_path, _ = engine.load_checkpoint(
                str(folder), tag=name, load_optimizer_states=payload["load_optimizer_states"],
                load_lr_scheduler_states=payload["load_optimizer_states"], load_module_strict=True)
            if load_path is None:
                raise FileNotFoundError(f"{folder / name}: DeepSpeed found no checkpoint to load")
        state = (folder / checkpoint.CLIENT_STATE).read_bytes() if (folder / checkpoint.CLIENT_STATE).exists() else b""
        return {"client_state": state, "actor_global_step": int(self.actor.global_steps)}

    def export_hf(self, payload: dict) -> dict:
        """save_pretrained of the actor with --pretrain's tokenizer, into output_dir (which the server
        claimed, see services.learner.ownership), in the dtype services.learner.export_dtype picks
        (no wider than the checkpoint it started from): each file is written in full beside it and renamed
        into place; files of the previous export that this one does not write are removed; other
        files are never touched, and one this export would overwrite stops it."""
        engine = self.critic if payload.get("critic") else self.actor
        if self.config.zero_stage == 3:
            state = engine._zero3_consolidated_16bit_state_dict()  # collective; the dict on rank 0 only
        else:
            state = engine.module.state_dict() if self.spec.rank == 0 else None
        if self.spec.rank != 0:
            return {}
        from transformers import AutoTokenizer

        source = self.config.critic_pretrain if payload.get("critic") else self.config.pretrain
        dtype = export_dtype(payload["dtype"], checkpoint_dtype(source), self.config.dtype)
        out = pathlib.Path(payload["output_dir"])
        # A folder of its own inside output_dir: same file system (renames), never someone else's name.
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".export-", dir=out))
        try:
            state = {k: v.detach().to("cpu", dtype) for k, v in state.items()}
            module = engine.module
            adapter = None if payload.get("critic") else self.config.lora
            tokenizer = AutoTokenizer.from_pretrained(self.config.pretrain)
            saved_dtype = module.config.dtype
            module.config.dtype = dtype
            try:
                if adapter is None:
                    module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
                else:  # the PEFT adapter folder, and with --lora_merge_on_save the merged model in merged/
                    save_adapter(module, state, tmp, adapter, self.config.lora_merge_on_save)
                    if self.config.lora_merge_on_save:
                        tokenizer.save_pretrained(tmp / "merged")
            finally:
                module.config.dtype = saved_dtype
            for folder in (tmp, tmp / "merged"):  # the model's folder, and a LoRA export's merged model
                record_dtype(folder, dtype)
            tokenizer.save_pretrained(tmp)
            checkpoint.fsync_tree(tmp)
            written = sorted(p.name for p in tmp.iterdir())
            previous = set(ownership.export_files(out))
            foreign = [n for n in written if (out / n).exists() and n not in previous]
            if foreign:
                raise failed_precondition(f"output_dir {out}: the export would overwrite {foreign}, which the learner "
                                          "did not write; export into a new or empty folder, or move them away")
            for name in written:
                if (out / name).is_dir() and name in previous:  # a folder of the last export (merged/)
                    shutil.rmtree(out / name)
                os.replace(tmp / name, out / name)
            # Plain names only: a marker edited to say "../x" must not reach outside the folder.
            for name in sorted(n for n in previous - set(written) if pathlib.Path(n).name == n and n not in (".", "..")):
                stale = out / name
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
            ownership.record_export(out, written)
            checkpoint.fsync_path(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        files = [p for name in written for p in ((out / name).rglob("*") if (out / name).is_dir() else [out / name])]
        size = sum(p.stat().st_size for p in files if p.is_file())
        return {"path": str(out), "bytes": size}

    # ------------------------------------------------------------------------------------------
    # Colocation

    def offload(self, _payload) -> bool:
        if self.offloaded:
            return False
        moved = False
        if self.device.type == "cuda":
            if self.config.zero_stage == 0:
                raise failed_precondition("Offload needs --zero_stage 1, 2 or 3 (DeepSpeed moves ZeRO states only)")
            for engine in self._engines().values():
                host_offload.offload_engine(engine)
            torch.cuda.empty_cache()
            moved = True
        self.offloaded = True
        return moved

    def reload(self, _payload) -> bool:
        if not self.offloaded:
            return False
        moved = False
        if self.device.type == "cuda":
            for engine in self._engines().values():
                host_offload.reload_engine(engine)
            moved = True
        self.offloaded = False
        return moved
