"""--aux_loss_coef (OpenRLHF's --model.aux_loss_coef / --actor.aux_loss_coef): the MoE router's
load-balancing loss, times the coefficient, added to each micro-batch's loss, on a tiny random
Mixtral (4 experts, 2 per token) built here.

The reference is the Switch-Transformer balancing loss written out from its definition: over the
non-padding tokens of every layer, f[k, e] = share of tokens whose k-th choice is expert e, P[e] =
mean router probability of e, loss = E x sum over k, e of f[k, e] x P[e]. It is checked against the
model's own aux_loss, then against what the SFT, DPO and reward-model micro-batches, the RL learner's
log-prob heads and critic values, a real SFT run (LoRA, packed, as OpenRLHF's Mixtral script) and the
learner service (actor and critic) add."""

from __future__ import annotations

import json
import sys
import types

import grpc

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.learner.v1 import learner_pb2 as pb
from services.common.config import parse_config
from services.common.tensors import ragged_from_proto
from services.learner.batches import Sample, collate
from services.learner.logprob_head import response_outputs
from services.learner.moe_aux import ROUTER_KWARGS, router_aux_loss
from services.learner.server import LearnerServicer
from services.learner.token_values import token_values
from services.learner.train_dpo import DPOConfig, DPOTrainer
from services.learner.train_rm import RMConfig, RMTrainer
from services.learner.train_sft import SFTConfig, SFTTrainer
from services.common.errors import ServiceError
from tests.learner.learner_helpers import experience, logprobs, random_sequences, response_lengths, start_learner
from tests.learner.test_offline_trainers import read_metrics, run_trainer

EXPERTS, TOP_K = 4, 2


def balancing_loss(router_logits, mask: torch.Tensor | None) -> float:
    """The reference, from the definition (module docstring). router_logits: per layer (B*T, E)."""
    probs = torch.softmax(torch.cat(router_logits).float(), -1)
    keep = (mask.reshape(-1).float().repeat(len(router_logits)) if mask is not None
            else torch.ones(probs.shape[0]))
    top = probs.topk(TOP_K, -1).indices
    share = torch.stack([(torch.nn.functional.one_hot(top[:, k], EXPERTS).float() * keep[:, None]).sum(0)
                         for k in range(TOP_K)]) / keep.sum()
    mean_prob = (probs * keep[:, None]).sum(0) / keep.sum()
    return float(EXPERTS * (share * mean_prob[None]).sum())


@pytest.fixture(scope="module")
def moe(tiny_moe_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).eval()
    assert model.config.num_local_experts == EXPERTS and model.config.num_experts_per_tok == TOP_K
    return model


def reference(model, ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None = None) -> float:
    with torch.no_grad():
        out = model.base_model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                               **ROUTER_KWARGS)
    return balancing_loss(out.router_logits, mask)


def padded_pair() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, 600, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


def test_the_router_loss_is_the_switch_balancing_loss(moe):
    ids, mask = padded_pair()
    expected = reference(moe, ids, mask)
    with torch.no_grad():
        full = moe(input_ids=ids, attention_mask=mask, **ROUTER_KWARGS)  # a causal LM's own aux_loss
        backbone = moe.base_model(input_ids=ids, attention_mask=mask, **ROUTER_KWARGS)  # from router logits
    assert float(router_aux_loss(moe, full, mask)) == pytest.approx(expected, rel=1e-5)
    assert float(router_aux_loss(moe, backbone, mask)) == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(reference(moe, ids, None), rel=1e-3)  # padding is left out
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        router_aux_loss(moe, type(backbone)(last_hidden_state=backbone.last_hidden_state), mask)


@pytest.mark.parametrize("head", ["chunked", "fused"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_learners_logprob_heads_return_the_router_loss(moe, head, packed):
    ids, mask = padded_pair()
    samples = [Sample(ids[i, :int(mask[i].sum())], 3, {}) for i in range(2)]
    mb = collate(samples, packed=packed)
    logp, _, aux = response_outputs(moe, mb, 1.0, head, chunk_tokens=4, want_entropy=False, want_aux=True)
    # A packed row has no padding; its positions restart at each sample, as the learner gives them.
    expected = reference(moe, mb.input_ids, mb.attention_mask, mb.position_ids if packed else None)
    assert float(aux) == pytest.approx(expected, rel=1e-5)
    assert response_outputs(moe, mb, 1.0, head, 4, False)[2] is None


def test_sft_and_dpo_micro_batches_add_coef_times_the_router_loss(tiny_moe_model_dir, moe, tmp_path):
    prompts = ["3+4=", "12+30=", "7-2="]
    answers = ["The answer is \\boxed{7}", "42", "The answer is \\boxed{5}"]
    sft_file = tmp_path / "sft.jsonl"
    sft_file.write_text("".join(json.dumps({"input": p, "output": a}) + "\n" for p, a in zip(prompts, answers)))
    prefs_file = tmp_path / "prefs.jsonl"
    prefs_file.write_text("".join(json.dumps({"prompt": p, "chosen": a, "rejected": "no"}) + "\n"
                                  for p, a in zip(prompts, answers)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_model_dir)

    def step(cls, config_cls, data, coef: float):
        trainer = cls(parse_config(config_cls, ["--pretrain", str(tiny_moe_model_dir), "--dataset", str(data),
                                                "--aux_loss_coef", str(coef)]))
        trainer.tokenizer = tokenizer
        trainer.reference = moe  # DPO's frozen reference
        rows = trainer.load_rows(tokenizer, str(data), "")
        return trainer.micro_batch(moe, rows, train=True), rows

    (sft0, _), _ = step(SFTTrainer, SFTConfig, sft_file, 0.0)
    (sft, ratios), rows = step(SFTTrainer, SFTConfig, sft_file, 0.5)
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r.input_ids) for r in rows], batch_first=True,
                                          padding_value=tokenizer.pad_token_id)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r.input_ids), dtype=torch.long) for r in rows],
                                           batch_first=True)
    expected = reference(moe, ids, mask)
    assert float(sft - sft0) == pytest.approx(0.5 * expected, rel=1e-4)
    assert ratios["aux_loss"] == pytest.approx((expected, 1.0), rel=1e-5)
    (dpo0, _), _ = step(DPOTrainer, DPOConfig, prefs_file, 0.0)
    (dpo, ratios), _ = step(DPOTrainer, DPOConfig, prefs_file, 0.5)
    # The policy's one forward over the chosen and rejected sequences together.
    assert float(dpo - dpo0) == pytest.approx(0.5 * ratios["aux_loss"][0], rel=1e-4) and ratios["aux_loss"][0] > 0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_critic_and_reward_model_values_come_with_the_router_loss(tiny_moe_model_dir, moe, packed):
    """A token-classification MoE model (the critic's and the reward model's kind): the same values with
    and without the router loss, and the loss is the backbone's balancing loss."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(tiny_moe_model_dir, num_labels=1, dtype=torch.float32)
    model.eval()
    ids, mask = padded_pair()
    mb = collate([Sample(ids[i, :int(mask[i].sum())], 3, {}) for i in range(2)], packed=packed)
    with torch.no_grad():
        plain, none = token_values(model, mb)
        values, aux = token_values(model, mb, want_aux=True)
    assert none is None and torch.equal(plain, values) and values.shape == mb.input_ids.shape
    assert float(aux) == pytest.approx(reference(moe, mb.input_ids, mb.attention_mask,
                                                 mb.position_ids if packed else None), rel=1e-5)


def test_the_reward_model_micro_batch_adds_coef_times_the_router_loss(tiny_moe_model_dir, moe, tmp_path):
    """OpenRLHF's train_rm: the pairwise loss plus coef x the router loss of the one forward over the
    chosen and rejected sequences together; the scores themselves do not change."""
    prefs_file = tmp_path / "prefs.jsonl"
    prefs_file.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in
                                  (("3+4=", "7", "8"), ("12+30=", "42", "The answer is 40"), ("7-2=", "5", "no"))))
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_model_dir)

    def step(coef: float):
        trainer = RMTrainer(parse_config(RMConfig, ["--pretrain", str(tiny_moe_model_dir), "--dataset",
                                                    str(prefs_file), "--aux_loss_coef", str(coef)]))
        trainer.tokenizer = tokenizer
        model, _ = trainer.load_model({})  # the same seed: the same new head `score`
        rows = trainer.load_rows(tokenizer, str(prefs_file), "")
        return trainer.micro_batch(model.eval(), rows, train=True), rows

    (loss0, ratios0), rows = step(0.0)
    (loss, ratios), _ = step(0.5)
    sequences = [r.chosen_ids for r in rows] + [r.rejected_ids for r in rows]
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in sequences], batch_first=True,
                                          padding_value=tokenizer.pad_token_id)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(x), dtype=torch.long) for x in sequences],
                                           batch_first=True)
    expected = reference(moe, ids, mask)
    assert float(loss - loss0) == pytest.approx(0.5 * expected, rel=1e-4)
    assert ratios["aux_loss"] == pytest.approx((expected, 1.0), rel=1e-5) and "aux_loss" not in ratios0
    assert ratios["loss"] == pytest.approx(ratios0["loss"]) and ratios["acc"] == ratios0["acc"]


def test_the_mixtral_lora_sft_script_trains_with_the_router_loss(tiny_moe_model_dir, tiny_data_dir, tmp_path):
    """OpenRLHF's train_sft_mixtral_lora.sh options at tiny sizes, run as a real process."""
    out = tmp_path / "sft"
    run_trainer([sys.executable, "-m", "services.learner.train_sft", "--model.model_name_or_path",
                 str(tiny_moe_model_dir), "--data.dataset", str(tiny_data_dir / "sft.jsonl"), "--data.input_key",
                 "prompt", "--data.output_key", "response", "--data.max_samples", "32", "--train.batch_size", "16",
                 "--train.micro_batch_size", "8", "--ds.zero_stage", "3", "--ds.lora.rank", "8", "--ds.lora.alpha",
                 "8", "--ds.packing_samples", "--model.aux_loss_coef", "0.001", "--adam.lr", "1e-3",
                 "--ckpt.output_dir", str(out), "--ds.attn_implementation", "flash_attention_2"])
    metrics = [m for m in read_metrics(out) if "train/loss" in m]
    assert len(metrics) == 2 and all(m["train/aux_loss"] >= 1.0 for m in metrics), metrics  # at least 1 (balanced)


def test_the_learner_adds_the_router_loss_to_the_actor_loss(tiny_moe_model_dir, moe, tmp_path):
    """One rank, packed log-probs from the hidden states (the fused head). With zero advantages the policy
    term has no gradient, so only the router loss moves the weights: not at all with coefficient 0."""
    learner = start_learner(tmp_path, "--pretrain", str(tiny_moe_model_dir), "--num_gpus", "1", "--zero_stage", "2",
                            "--train_batch_size", "2", "--micro_train_batch_size", "1", "--actor_learning_rate",
                            "1e-2", "--critic_pretrain", str(tiny_moe_model_dir), "--critic_learning_rate", "1e-2",
                            "--metrics_port", "0", "--logprobs_head", "fused")
    try:
        seqs, starts = random_sequences(2, moe.config.vocab_size, seed=5)
        zero = [torch.zeros(n) for n in response_lengths(seqs, starts)]
        expected = sum(reference(moe, s[None], torch.ones(1, len(s), dtype=torch.long)) for s in seqs) / 2

        def train(coef: float) -> pb.TrainActorResponse:
            batch = experience(seqs, starts, old_logprobs=logprobs(learner.stub, seqs, starts), advantages=zero)
            return learner.stub.TrainActor(pb.TrainActorRequest(batch=batch, loss=pb.ActorLoss(aux_loss_coef=coef)),
                                           timeout=300)

        before = logprobs(learner.stub, seqs, starts)
        assert train(0.0).aux_loss == 0.0
        unmoved = logprobs(learner.stub, seqs, starts)
        assert all(torch.equal(a, b) for a, b in zip(before, unmoved))
        r = train(1.0)
        # The mean over the step's two micro-batches (one sample each) of each one's router loss.
        assert r.aux_loss == pytest.approx(expected, rel=1e-4) and r.optimizer_steps == 1
        moved = logprobs(learner.stub, seqs, starts)
        assert not all(torch.equal(a, b) for a, b in zip(before, moved))

        # The critic (OpenRLHF adds the actor's coefficient to its loss too): old values far from the values
        # put every token on the clipped side of the value loss, which has no gradient there, so again
        # only the router loss moves the weights.
        def values() -> list[torch.Tensor]:
            request = pb.ValuesRequest(input_ids=experience(seqs, starts).input_ids,
                                       response_start=experience(seqs, starts).response_start)
            return ragged_from_proto(learner.stub.Values(request, timeout=120).values)

        def train_critic(coef: float) -> pb.TrainCriticResponse:
            now = values()
            batch = experience(seqs, starts, returns=now, old_values=[v + 100.0 for v in now])
            return learner.stub.TrainCritic(pb.TrainCriticRequest(batch=batch, value_clip=0.5, aux_loss_coef=coef),
                                            timeout=300)

        before = values()
        assert train_critic(0.0).aux_loss == 0.0
        assert all(torch.equal(a, b) for a, b in zip(before, values()))
        r = train_critic(1.0)
        # The critic's backbone is the checkpoint's, untouched by the actor's steps: the same router loss.
        assert r.aux_loss == pytest.approx(expected, rel=1e-4) and r.optimizer_steps == 1
        assert not all(torch.equal(a, b) for a, b in zip(before, values()))
    finally:
        learner.stop()


def test_the_learner_refuses_a_router_coefficient_for_a_dense_critic(tiny_model_dir, moe):
    dense = types.SimpleNamespace(module=types.SimpleNamespace(config=types.SimpleNamespace()))
    servicer = types.SimpleNamespace(rank0=types.SimpleNamespace(critic=dense),
                                     config=types.SimpleNamespace(critic_pretrain=str(tiny_model_dir)))
    with pytest.raises(ServiceError) as err:
        LearnerServicer._critic_aux_loss_coef(servicer, 0.5)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "aux_loss_coef: 0.5: the critic" in str(err.value) and "not a mixture-of-experts model" in str(err.value)
    assert LearnerServicer._critic_aux_loss_coef(servicer, 0.0) == 0.0
    servicer.rank0.critic = types.SimpleNamespace(module=moe)
    assert LearnerServicer._critic_aux_loss_coef(servicer, 0.5) == 0.5
