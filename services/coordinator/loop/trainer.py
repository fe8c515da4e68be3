"""The training loop: one global step after another over the rollout, reward and learner services.

    step:  prompts -> Generate on every engine (streamed)
                   -> as samples arrive: Score, RefLogProbs, LogProbs, Values (sample_calls.py)
                   -> advantages, TrainActor / TrainCritic (learn.py)
                   -> push the weights to every engine and verify version + checksum (weight_sync.py)
                   -> metrics (step_metrics.py) -> checkpoint every --save_steps
    with --eval_dataset: evaluation on the engines' current weights before the first step, after
    every --eval_steps steps and after the last (evaluate.py, as `rlmesh eval`)

With --vllm_enable_sleep / --deepspeed_enable_sleep (colocated on GPUs) the phases run one
after another instead: wake -> generate -> sleep -> reload -> log-probs, train -> push -> offload,
so vLLM and DeepSpeed never hold a GPU's memory at the same time (colocation.py). With
--async_train the engines generate on GPUs of their own while the learner trains, and
--deepspeed_enable_sleep only moves the learner's states to host memory between its steps
(reload -> log-probs, train -> push -> offload, as OpenRLHF does there).

The fleet's recovery (services/coordinator/fleet/recovery.py) repairs a step after a death through
the named calls at the end of the Trainer; it reaches nothing else of the loop.
"""

from __future__ import annotations

import asyncio
import pathlib
import time

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.common.v1 import common_pb2
from rlmesh.coordinator.v1 import coordinator_pb2 as cpb
from rlmesh.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.crash_points import crash_point
from services.common.client import make_channel
from services.common.log import get_logger, log_event
from services.coordinator.config import CoordinatorConfig
from services.coordinator.loop import learn
from services.coordinator.loop import metrics as prom
from services.coordinator.loop.advantages import keep_group, update_kl_coef
from services.coordinator.loop.agent import AgentRunner
from services.coordinator.loop.async_loop import AsyncSteps, CollectedStep, admit_fresh
from services.coordinator.loop.checkpoint import CoordinatorState
from services.coordinator.loop.colocation import Colocation
from services.coordinator.loop.data import Prompt, PromptStream
from services.coordinator.loop.evaluate import evaluate_during_training
from services.coordinator.loop.experience import StepCollector
from services.coordinator.loop.generation import generate_step, progress_bar, sample_from_response
from services.coordinator.loop.members import Members
from services.coordinator.loop.metrics import MetricsLog
from services.coordinator.loop.rollout_pool import RolloutPool
from services.coordinator.loop.run_state import Endpoints, RunControl, ServiceEntry
from services.coordinator.loop.resume import RunCheckpoints, export_request
from services.coordinator.loop.sample_calls import SampleCalls
from services.coordinator.loop.samples_log import write_step_samples
from services.coordinator.loop.scoring_pool import ScoringPool
from services.coordinator.loop.step_metrics import step_metrics
from services.coordinator.loop.weight_sync import WeightSync
from services.reward.client import ReferenceClient, RewardClient

_log = get_logger("coordinator")
LEARNER_SERVICE = "rlmesh.learner.v1.LearnerService"
LEARNER_IDEMPOTENT = ("GetInfo", "LogProbs", "Values", "SaveCheckpoint", "LoadCheckpoint", "ExportHF",
                      "Offload", "Reload")


class Trainer(RunCheckpoints):
    """Runs the loop against services found at `endpoints`."""

    def __init__(self, config: CoordinatorConfig, endpoints: Endpoints, control: RunControl, stream: PromptStream,
                 metrics: MetricsLog, state: CoordinatorState, weight_sync_master: tuple[str, int] | None = None,
                 eval_prompts: list[Prompt] | None = None):
        self.config, self.endpoints, self.control = config, endpoints, control
        self.stream, self.metrics, self.state = stream, metrics, state
        self.eval_prompts = eval_prompts or []  # empty = no evaluation during training
        self.last_eval_step = -1
        cfg = config
        self.pool = RolloutPool(endpoints.rollout, cfg.rpc_timeout_s, cfg.max_message_mb)
        # The pools retry a call on another instance when its instance dies, so their channels do not.
        self.rewards = ScoringPool("reward", endpoints.reward, lambda a: RewardClient(
            a, timeout_s=cfg.rpc_timeout_s, channel_retries=False), cfg.scoring_wait_s, cfg.scoring_retries)
        self.references = ScoringPool("reference", endpoints.reference, lambda a: ReferenceClient(
            a, timeout_s=cfg.rpc_timeout_s, channel_retries=False), cfg.scoring_wait_s, cfg.scoring_retries)
        self.sequential = cfg.vllm_enable_sleep or cfg.deepspeed_enable_sleep
        self.use_ref = cfg.ref_needed and bool(endpoints.reference)
        self.use_critic = cfg.critic_needed
        self.weights = WeightSync(cfg, self.pool, weight_sync_master)
        self.colocation = Colocation(cfg, self.pool)
        self.members = Members(self.pool, self.rewards, self.references, endpoints, self.weights)  # the fleet's handle
        run_id = pathlib.PurePath(state.run_dir).name or "run"  # in request ids
        self.calls = SampleCalls(cfg, self.rewards, self.references, run_id, self.use_ref, self.use_critic)
        self.learner_info: learner_pb2.GetInfoResponse | None = None
        self.learner_channel = None
        self.connect_learner(endpoints.learner)
        self.recovery = None  # the fleet's recovery (attach_recovery); None = a failure ends the run
        self.trained_step = 0  # the last step whose TrainActor succeeded (a redo would train twice)
        self.lost_samples = 0  # samples of the last failed step attempt
        self.async_steps = AsyncSteps(self) if cfg.async_train else None  # --async_train
        # The weight version setup established (admit_fresh trains nothing older): 0 when the engines
        # started with the learner's weights, else the version of setup's push.
        self.first_version = 0
        self.agents = AgentRunner(cfg, self.pool) if cfg.agent_func_path else None  # started in setup()
        self.calls.agents = self.agents

    @property
    def query_decoder(self):
        """Decodes each sample's token ids into the query text reward servers get (set by the train command)."""
        return self.calls.query_decoder

    @query_decoder.setter
    def query_decoder(self, decoder) -> None:
        self.calls.query_decoder = decoder

    def connect_learner(self, address: str) -> grpc.aio.Channel | None:
        """Points the learner stub at `address` (at start, and after a restart moved the learner);
        returns the channel it replaced, for the caller to close."""
        cfg, old = self.config, self.learner_channel
        self.learner_channel = make_channel(address, LEARNER_SERVICE, idempotent_methods=LEARNER_IDEMPOTENT,
                                            default_timeout_s=cfg.rpc_timeout_s, max_message_mb=cfg.max_message_mb)
        self.learner = learner_pb2_grpc.LearnerServiceStub(self.learner_channel)
        self.weights.learner = self.colocation.learner = self.calls.learner = self.learner
        self.endpoints.learner = address
        return old

    async def close(self) -> None:
        if self.async_steps is not None:
            await self.async_steps.close()
        if self.agents is not None:
            await self.agents.close()
        closers = [self.pool.close(), self.learner_channel.close()]
        closers += [self.rewards.close(), self.references.close()]
        await asyncio.gather(*closers, return_exceptions=True)

    # ------------------------------------------------------------------------------------------
    # Start-up

    async def setup(self, resume: bool) -> None:
        cfg = self.config
        await self.refresh_learner_info(timeout_s=30.0)
        if self.learner_info.train_batch_size != cfg.train_batch_size:
            raise RuntimeError(f"the learner at {self.endpoints.learner} trains with --train_batch_size "
                               f"{self.learner_info.train_batch_size} but this run has --train_batch_size "
                               f"{cfg.train_batch_size}; give both the same value")
        if self.use_critic and not self.learner_info.critic_pretrain:
            raise RuntimeError(f"--advantage_estimator gae needs a critic, but the learner at {self.endpoints.learner} "
                               "has none; start it with --critic_pretrain")
        if self.agents is not None:
            await self.agents.start()  # a file that does not load stops the run here, before any step
        engines = self.pool.admitted()
        infos = await self.pool.model_infos(engines)
        self.weights.weights_dtype = infos[0].weights_dtype or common_pb2.DTYPE_FLOAT32
        for engine, info in zip(engines, infos):
            engine.weight_version = info.weight_version
            engine.tensor_parallel_size = max(1, info.tensor_parallel_size)
        if resume:
            await self._load_checkpoint()
        self.control.services = self._service_entries()
        await self.weights.build_group(self.pool.admitted())
        # Engines must hold the learner's weights before they generate. A fresh run that started
        # every service from the same --pretrain folder already has them; otherwise (a resume,
        # services started elsewhere, an engine that served another version) they are pushed.
        versions = {i.weight_version for i in infos}
        checksums = {i.weights_checksum for i in infos}
        if (resume or cfg.placement == "static" or versions != {0} or len(checksums) > 1
                or self.learner_info.weight_version):
            await self.push_weights()
        else:
            self.state.weight_version = 0
        self.first_version = self.state.weight_version
        # Each step starts with the learner offloaded and the engines asleep (both woken as the step
        # needs them), step 1 as well: what their first offload and sleep set up (page-locked host
        # buffers) is done here, before the first step.
        await self.colocation.offload_learner()
        await self.colocation.sleep_rollout()

    def _service_entries(self) -> list[ServiceEntry]:
        entries = [ServiceEntry("rollout", e.index, e.address, e.weight_version) for e in self.pool.engines]
        entries += [ServiceEntry("reward", i, a) for i, a in enumerate(self.endpoints.reward)]
        entries += [ServiceEntry("reference", i, a) for i, a in enumerate(self.endpoints.reference)]
        entries.append(ServiceEntry("learner", 0, self.endpoints.learner))
        return entries

    # ------------------------------------------------------------------------------------------
    # Weight push

    async def push_weights(self, engines: list | None = None, version: int = 0) -> dict:
        """Pushes the actor's weights to `engines` (default: the admitted ones; they must be the
        weight group's) and verifies version and checksum on each. version 0 = a new one."""
        engines = self.pool.admitted() if engines is None else engines
        version = version or max([self.state.weight_version, self.learner_info.weight_version if self.learner_info
                                  else 0] + [e.weight_version for e in self.pool.engines]) + 1
        # Only the weights: the KV cache stays freed until the next generation (colocation).
        await self.colocation.wake_rollout(("weights",))
        async with self.colocation.learner_awake():  # a catch-up push may come while the learner sleeps
            metrics = await self.weights.push(engines, version)
        self.state.weight_version = version
        self.control.weight_version = version
        prom.WEIGHT_VERSION.set(version)
        for entry in self.control.services:
            if entry.role == "rollout":
                entry.weight_version = version
        return metrics

    # ------------------------------------------------------------------------------------------
    # One step

    async def _generate(self, collector: StepCollector, step: int, progress) -> dict:
        """Generation of the step, with DAPO refill rounds; returns generation metrics ({} when the
        data is exhausted)."""
        # Async: the engines may take newer weights while this step generates; each sample says which.
        expected = None if self.config.async_train else self.state.weight_version
        new_sample = (sample_from_response if self.agents is None  # an agent episode's outcome:
                      else lambda prompt, response, _: self.agents.new_sample(prompt, response, self.state.weight_version))
        generate = self.pool.generate if self.agents is None else self.agents.generate  # episodes: agent.py
        return await generate_step(self.config, self.stream, generate, new_sample, collector, step, expected,
                                   progress)

    async def train_step(self, step: int) -> dict | None:
        """Runs global step `step`; returns its metrics, or None when the data is exhausted.

        With --async_train, async_loop.py runs collect_step of later steps while learn_step of
        this one trains (this is its special case with staleness 0)."""
        t_step, cpu_step = time.monotonic(), time.process_time()
        self.lost_samples = 0
        collected = await self.collect_step(step)
        if collected is None:
            return None
        # A failure from here on (a learner dying in training or push) loses the step's samples too.
        self.lost_samples = len(collected.collector.all_samples())
        metrics = await self.learn_step(step, collected, t_step, cpu_step)
        self.lost_samples = 0
        return metrics

    async def collect_step(self, step: int, defer_logprobs: bool = False) -> CollectedStep | None:
        """Generation and scores of step `step`, and its log-probs unless deferred to learn_step
        (async: they must come from the weights the step is trained on); None when the data is exhausted."""
        cfg = self.config
        times: dict[str, float] = {}
        self.calls.new_step(step)
        keep = None
        if cfg.dynamic_filtering:
            low, high = cfg.dynamic_filtering_reward_range
            keep = lambda rewards: bool(keep_group(torch.tensor([rewards]), low, high)[0])  # noqa: E731
        collector = StepCollector(cfg.n_samples_per_prompt, cfg.micro_rollout_batch_size, self.calls.score,
                                  self.calls.logprobs, keep_group=keep,
                                  defer_logprobs=self.sequential or defer_logprobs, merge_deferred=self.calls.packed)
        progress = progress_bar(cfg, step, self.control.total_steps)
        try:
            # ---- generate (scoring and log-probs run alongside) ----
            self.control.set_phase(cpb.PHASE_GENERATING)
            t0 = time.monotonic()
            if self.recovery is not None:
                await self.recovery.before_step()  # restarted engines get the current weights first
            await self.colocation.wake_rollout()
            gen = await self._generate(collector, step, progress)
            if not gen:
                return None
            if self.colocation.rollout_sleeps:
                times["rollout_sleep"] = await self.colocation.sleep_rollout()  # the last part of "generate"
            times["generate"] = time.monotonic() - t0
            crash_point("coordinator.step.generated")
            # ---- wait for the remaining scores and log-probs ----
            self.control.set_phase(cpb.PHASE_SCORING)
            t0 = time.monotonic()
            if not defer_logprobs:  # async: learn_step brings the learner's states back for its log-probs
                times["learner_reload"] = await self.colocation.reload_learner()  # the first part of "score"
            await (collector.wait_scores() if defer_logprobs else collector.finish())
            times["score"] = time.monotonic() - t0
            crash_point("coordinator.step.scored")
        except BaseException:
            self.lost_samples = len(collector.all_samples())
            await collector.cancel()
            raise
        finally:
            if progress is not None:
                progress.close()
        return CollectedStep(collector, gen, times, self.stream.state(), defer_logprobs)

    async def learn_step(self, step: int, collected: CollectedStep, t_step: float, cpu_step: float) -> dict:
        """Advantages, training and weight push of a collected step; returns the step's metrics.

        The learner's states stay on its GPUs throughout (--deepspeed_enable_sleep with --async_train:
        they come back here, not in collect_step, which runs beside the previous step's training)."""
        async with self.colocation.learner_in_use() as reload_s:
            if collected.logprobs_deferred and self.config.deepspeed_enable_sleep:
                collected.times["learner_reload"] = reload_s
            return await self._learn_step(step, collected, t_step, cpu_step)

    async def _learn_step(self, step: int, collected: CollectedStep, t_step: float, cpu_step: float) -> dict:
        cfg = self.config
        collector, gen, times = collected.collector, collected.gen, collected.times
        if collected.logprobs_deferred:
            t0 = time.monotonic()
            try:
                await collector.finish()  # old log-probs under the weights this step trains
            except BaseException:
                await collector.cancel()
                raise
            times["logprobs"] = time.monotonic() - t0
        t0 = time.monotonic()
        samples = collector.kept_samples(max_groups=cfg.rollout_batch_size)
        samples, staleness = admit_fresh(samples, cfg.n_samples_per_prompt, self.state.weight_version,
                                         cfg.max_staleness if cfg.async_train else 0, cfg.staleness_policy,
                                         self.first_version)
        batch = learn.training_batch(cfg, samples, self.state.kl_coef, self.use_ref, self.use_critic)
        times["advantages"] = time.monotonic() - t0
        # ---- train ----
        self.control.set_phase(cpb.PHASE_TRAINING)
        t0 = time.monotonic()
        train_metrics = await learn.train(self.learner, cfg, step, batch, self.state.kl_coef, self.use_ref,
                                          self.use_critic) if batch["count"] else {}
        self.trained_step = step
        times["train"] = time.monotonic() - t0
        crash_point("coordinator.step.trained")
        # ---- push ----
        self.control.set_phase(cpb.PHASE_PUSHING_WEIGHTS)
        t0 = time.monotonic()
        push = self.push_weights if self.recovery is None else self.recovery.push_weights
        push_metrics = await push() if batch["count"] else {}
        times["push"] = time.monotonic() - t0
        crash_point("coordinator.step.pushed")
        # ---- bookkeeping ----
        self.state.global_step = step
        # Where the data stood after this step's prompts (async: later steps have taken more since).
        self.state.episode, self.state.data_position = collected.stream_position
        self.state.prompts_consumed += gen["prompts_consumed"]
        self.state.samples_trained += batch["count"]
        step_s = time.monotonic() - t_step
        # CPU the coordinator itself used during the step (all its threads): its real cost on a
        # machine it shares with the services, whichever phase it falls in.
        times["coordinator_cpu"] = time.process_time() - cpu_step
        metrics = step_metrics(cfg, self.state, step, collector, batch, gen, times, step_s, self.calls.seconds,
                               self.calls.counts)
        metrics.update(train_metrics)
        metrics.update(push_metrics)
        if cfg.kl_target > 0 and "kl/mean" in metrics:
            self.state.kl_coef = update_kl_coef(self.state.kl_coef, metrics["kl/mean"], cfg.kl_target,
                                                cfg.kl_horizon, int(metrics["samples/generated"]))
        metrics.update(staleness)
        if self.agents is not None:
            metrics.update(self.agents.step_metrics(collector.all_samples()))
        write_step_samples(self.metrics.run_dir, step, collector.all_samples(), cfg.log_samples)
        return metrics

    # ------------------------------------------------------------------------------------------
    # Evaluation on held-out prompts (--eval_dataset)

    async def evaluate_step(self, step: int) -> dict:
        """eval/pass@1, eval/pass@n, eval/response_length (overall and per data source) of the weights
        the engines hold after `step`, computed exactly as `rlmesh eval` does; in an agent run each
        sample is a whole episode (evaluate_episodes), with the agent's extra logs as eval/<name>.

        Evaluation takes no prompts from the training stream and its generation seeds depend only on
        --seed and the prompt chunk, so a run trains on the same samples with or without it.
        """
        self.control.set_phase(cpb.PHASE_GENERATING)
        await self.colocation.wake_rollout()
        # An agent run is evaluated on whole episodes (its multi-turn success), as it trains.
        engines = self.pool if self.agents is None else self.agents
        metrics = await evaluate_during_training(self.config, engines, self.rewards, self.eval_prompts, step,
                                                 self.state.weight_version, self.query_decoder,
                                                 episodes=self.agents is not None)
        # Colocated: vLLM gives the memory back before the learner needs it again, as after generation.
        await self.colocation.sleep_rollout()
        self.last_eval_step = step
        return metrics

    # ------------------------------------------------------------------------------------------
    # The loop (saving, resuming and rewinding: resume.py)

    async def run(self) -> None:
        c = self.control
        c.state = cpb.RUN_STATE_RUNNING
        step = self.state.global_step
        if self.eval_prompts and step == 0:
            # The start of the evaluation curve; a resumed run logged it before its checkpoint.
            self.metrics.log(0, await self.evaluate_step(0))
            c.set_phase(cpb.PHASE_IDLE)
        while True:
            step = await self._steps(step)
            try:
                await self._finish(step)
                return
            except Exception as exc:  # noqa: BLE001 - e.g. the learner died before the export
                if self.recovery is None or c.stop_requested:
                    raise
                # As in a step: the learner restarts from its newest checkpoint (the steps since are
                # done again), then the end of the run is tried again.
                step = await self.recovery.recover(exc, step)
                c.state = cpb.RUN_STATE_RUNNING

    async def _steps(self, step: int) -> int:
        """Trains steps from `step` until the last one (or a stop); returns the last step done."""
        cfg = self.config
        c = self.control
        while True:
            await c.wait_while_paused()
            if c.stop_requested or (cfg.max_steps and step >= cfg.max_steps):
                return step
            try:
                steps = self if self.async_steps is None else self.async_steps
                metrics = await steps.train_step(step + 1)
                if metrics is None:
                    return step
                saving = ((cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0)
                          or (c.stop_requested and c.stop_checkpoint))
                if saving and not cfg.disable_ds_ckpt:
                    self.state.step_record = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
                    metrics.update(await self.save_checkpoint(step + 1))
            except Exception as exc:  # noqa: BLE001 - a dead service: recovery restarts it or re-raises
                if self.recovery is None:
                    raise
                step = await self.recovery.recover(exc, step)
                continue
            step += 1
            if self.recovery is not None:
                self.recovery.step_finished()
            crash_point("coordinator.step.done")
            c.global_step, c.episode = step, self.state.episode
            # The learner sleeps until the next step's log-probs (after any checkpoint). Outside the
            # step's own time/step_s, and the GPU waits for it: reported as time/learner_offload_s.
            offload_s = await self.colocation.offload_learner()
            if cfg.deepspeed_enable_sleep:
                metrics["time/learner_offload_s"] = offload_s
                prom.PHASE_SECONDS.labels("learner_offload").observe(offload_s)
            last = bool(c.total_steps and step >= c.total_steps) or bool(cfg.max_steps and step >= cfg.max_steps)
            evaluating = bool(self.eval_prompts) and not c.stop_requested and (step % cfg.eval_steps == 0 or last)
            if evaluating:
                metrics.update(await self.evaluate_step(step))
            c.set_phase(cpb.PHASE_IDLE)
            if step % cfg.logging_steps == 0 or c.stop_requested or evaluating:
                self.metrics.log(step, metrics)
                log_event(_log, "step.done", step=step, reward=f"{metrics['reward/mean']:.4f}",
                          kl=f"{metrics.get('kl/mean', 0.0):.5f}", step_s=f"{metrics['time/step_s']:.2f}",
                          version=self.state.weight_version)

    async def _finish(self, step: int) -> None:
        """The end of the run after step `step`: a last evaluation and checkpoint when due, the export."""
        cfg = self.config
        c = self.control
        c.state = cpb.RUN_STATE_STOPPING
        if self.eval_prompts and step > 0 and step != self.last_eval_step and not c.stop_requested:
            # The data ran out before the planned last step (dynamic filtering refills use prompts up).
            self.metrics.log(step, await self.evaluate_step(step))
        if step > c.last_checkpoint_step and step > 0 and not cfg.disable_ds_ckpt and \
                (cfg.save_steps < 0 or (c.stop_requested and c.stop_checkpoint)):
            await self.save_checkpoint(step)
        if cfg.save_path and step > 0 and not c.stop_requested:
            await self.colocation.reload_learner()
            await self.learner.ExportHF(export_request(cfg, cfg.save_path), timeout=cfg.rpc_timeout_s)
            log_event(_log, "model.exported", path=cfg.save_path)
            if cfg.save_value_network and self.use_critic:
                critic_path = cfg.save_path.rstrip("/") + "_critic"  # OpenRLHF's place for it
                await self.learner.ExportHF(export_request(cfg, critic_path, critic=True), timeout=cfg.rpc_timeout_s)
                log_event(_log, "model.exported", path=critic_path, model="critic")


    # ------------------------------------------------------------------------------------------
    # Named calls for the fleet (services/coordinator/fleet/recovery.py and scaling.py): the only
    # way a death, a restart or a scale request changes the loop.

    def attach_recovery(self, recovery, on_prompts_moved, on_lost_weights, on_event, refresh_services) -> None:
        """From now on a failed step goes to `recovery.recover`, a step starts with
        `recovery.before_step`, pushes go through `recovery.push_weights`, and generation with no
        engine left waits in `recovery.wait_for_engine`."""
        self.recovery = recovery
        self.pool.wait_for_engine = recovery.wait_for_engine
        self.pool.on_prompts_moved = on_prompts_moved
        self.pool.on_lost_weights = on_lost_weights
        self.rewards.on_event = self.references.on_event = on_event  # retries go to the run's events
        self.control.refresh_services = refresh_services

    def colocation_state(self):
        """Who holds the shared GPUs' memory (loop/colocation.py): restarts of colocated engines follow it."""
        return self.colocation

    def show_services(self, entries: list[ServiceEntry]) -> None:
        """The service list the control API reports (GetStatus)."""
        self.control.services = entries

    def weight_version(self) -> int:
        """The version the run's engines hold (or must hold before they generate)."""
        return self.state.weight_version

    def step_attempt(self) -> tuple[int, int]:
        """(the last step whose training succeeded, samples of the failed step attempt)."""
        return self.trained_step, self.lost_samples

    def retry_step(self) -> None:
        """Nothing of the failed step was kept: its prompts are taken again from the same position."""
        self.stream.restore(self.state.episode, self.state.data_position)

    async def refresh_learner_info(self, timeout_s: float = 60.0) -> learner_pb2.GetInfoResponse:
        """The learner's GetInfo, kept as the loop's view of it (start-up, after a rewind)."""
        self.learner_info = self.weights.learner_info = await self.learner.GetInfo(
            learner_pb2.GetInfoRequest(), timeout=timeout_s)
        return self.learner_info

    async def learner_weight_version(self) -> int:
        """The weight version the learner holds now (a check; the loop's view is not changed)."""
        return (await self.learner.GetInfo(learner_pb2.GetInfoRequest(), timeout=60.0)).weight_version

    async def learner_serving(self) -> bool:
        """Whether the learner's address answers grpc.health.v1 with SERVING."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.learner_channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5.0)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def reconnect_learner(self, address: str) -> None:
        """The learner restarted at `address` (nothing changes when it is the same address)."""
        if address == self.endpoints.learner and self.learner_channel is not None:
            return  # static placement: the same address again
        asyncio.ensure_future(self.connect_learner(address).close())
