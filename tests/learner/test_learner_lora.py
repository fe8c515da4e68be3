"""The learner service with a LoRA actor (--lora_rank): two CPU ranks, ZeRO-3, gradient checkpointing,
and a critic that trains in full.

One service process serves the module. What is checked: only the adapter trains (the base weights
come back bit-equal, the critic keeps all its parameters trainable); ExportHF writes the PEFT adapter
folder and, with --lora_merge_on_save, the merged model, and both give the learner's own log-probs
(vLLM serves the merged model: a real rollout service's greedy tokens equal transformers');
a checkpoint brings back the adapter and its optimizer state (the step after a load repeats the step
after the save).
"""

import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file

from rlmesh.learner.v1 import learner_pb2 as pb
from services.learner.lora import LoraOptions, adapter_state, apply_lora
from tests.rollout.helpers import VLLM_ARGS, greedy_ids, hf_greedy, start_rollout, stop_rollout
from tests.learner.learner_helpers import (
    experience,
    logprobs,
    random_sequences,
    signed_advantages,
    start_learner,
)

RANK, ALPHA = 4, 8
TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module")
def learner(tmp_path_factory, tiny_model_dir, tiny_reward_model_dir):
    proc = start_learner(
        tmp_path_factory.mktemp("learner_lora"), "--pretrain", str(tiny_model_dir), "--critic_pretrain",
        str(tiny_reward_model_dir), "--num_gpus", "2", "--zero_stage", "3", "--train_batch_size", "4",
        "--micro_train_batch_size", "1", "--actor_learning_rate", "5e-3", "--gradient_checkpointing",
        "--lr_scheduler", "constant_with_warmup", "--lr_warmup_ratio", "0", "--metrics_port", "0",
        "--lora_rank", str(RANK), "--lora_alpha", str(ALPHA), "--target_modules", *TARGETS, "--lora_merge_on_save")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def train(stub, seqs, starts, calls: int, seed: int = 0) -> list[float]:
    old = logprobs(stub, seqs, starts)
    batch = experience(seqs, starts, old_logprobs=old, advantages=signed_advantages(seqs, starts))
    return [stub.TrainActor(pb.TrainActorRequest(batch=batch, shuffle_seed=seed + c,
                                                 loss=pb.ActorLoss(eps_clip_low=10.0)), timeout=300).policy_loss
            for c in range(calls)]


def export(stub, folder):
    stub.ExportHF(pb.ExportHFRequest(output_dir=str(folder)), timeout=300)
    return load_file(str(folder / "adapter_model.safetensors")), load_file(str(folder / "merged" / "model.safetensors"))


def test_only_the_adapter_trains_and_the_exports_agree(learner, base, tiny_model_dir, tiny_reward_model_dir,
                                                       tmp_path):
    stub = learner.stub
    info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    expected = apply_lora(transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                          LoraOptions(RANK, ALPHA, TARGETS))
    assert info.actor_num_parameters == sum(p.numel() for _, p in adapter_state(expected))
    critic = transformers.AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir)
    assert info.critic_num_parameters == sum(p.numel() for p in critic.parameters())  # the critic stays full

    seqs, starts = random_sequences(8, base.config.vocab_size, seed=5)
    losses = train(stub, seqs, starts, calls=4)
    assert losses[-1] < losses[0] - 0.05, losses
    adapter, merged = export(stub, tmp_path / "export")
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert merged.keys() == initial.keys()
    for name, weight in initial.items():
        adapted = name.endswith(tuple(f"{t}.weight" for t in TARGETS))
        assert torch.equal(merged[name], weight) != adapted, name  # the base stays; adapted layers merged
    assert len(adapter) == 2 * len(TARGETS) * base.config.num_hidden_layers
    assert all(name.startswith("base_model.model.model.layers.") for name in adapter)

    # The adapter over the base (PEFT), the merged model (transformers) and the learner agree.
    ids = torch.cat([seqs[0], seqs[1]])[None]
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, tmp_path / "export").eval()(input_ids=ids).logits
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "merged",
                                                                     dtype=torch.float32).eval()
        torch.testing.assert_close(reloaded(input_ids=ids).logits, peft_logits, rtol=1e-4, atol=1e-4)
        served = logprobs(stub, seqs[:1], starts[:1])[0]
        served_packed = logprobs(stub, seqs[:3], starts[:3], packed=True)[0]  # with two others in its pass
        logits = reloaded(input_ids=seqs[0][None]).logits[0, starts[0] - 1:-1]
        own = torch.log_softmax(logits, -1).gather(-1, seqs[0][starts[0]:, None]).squeeze(-1)
    torch.testing.assert_close(served, own, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(served_packed, own, rtol=1e-4, atol=1e-4)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "export" / "merged").pad_token is not None

    # vLLM serves the merged folder as it is (a real rollout service): greedy as transformers.
    engine = start_rollout(tmp_path / "export" / "merged", tmp_path / "vllm", *VLLM_ARGS)
    try:
        with engine.channel() as channel:
            prompts = [seqs[0][:starts[0] + 2].tolist(), seqs[1][:starts[1] + 2].tolist()]
            got = greedy_ids(engine.stub(channel), prompts, max_tokens=8)
    finally:
        stop_rollout(engine.proc)
    assert got == [hf_greedy(reloaded, p, 8) for p in prompts]


def test_a_checkpoint_restores_the_adapter_and_its_optimizer(learner, base, tmp_path):
    stub = learner.stub
    seqs, starts = random_sequences(8, base.config.vocab_size, seed=6)
    train(stub, seqs, starts, calls=1, seed=10)  # Adam has moments to save
    step = stub.GetInfo(pb.GetInfoRequest(), timeout=10).actor_global_step
    ckpt = tmp_path / "ckpt"
    stub.SaveCheckpoint(pb.SaveCheckpointRequest(ckpt_path=str(ckpt), global_step=step, max_ckpt_num=2), timeout=300)
    saved, _ = export(stub, tmp_path / "saved")
    after_save = train(stub, seqs, starts, calls=2, seed=20)
    moved, _ = export(stub, tmp_path / "moved")
    assert any(not torch.equal(saved[n], moved[n]) for n in saved)

    stub.LoadCheckpoint(pb.LoadCheckpointRequest(ckpt_path=str(ckpt)), timeout=300)
    loaded, _ = export(stub, tmp_path / "loaded")
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name
    # Same batches from the same weights and Adam moments: the same losses (a fresh optimizer would
    # take a different second step).
    assert train(stub, seqs, starts, calls=2, seed=20) == pytest.approx(after_save, abs=1e-6)
    again, _ = export(stub, tmp_path / "again")
    for name in moved:
        torch.testing.assert_close(again[name], moved[name], rtol=0, atol=1e-7)
