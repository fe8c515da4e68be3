"""--use_ds_universal_ckpt: a checkpoint resumes under another layout, actor and critic.

A learner of 2 CPU ranks under ZeRO-2 trains two steps and saves; a learner of 1 rank under ZeRO-3
loads that checkpoint (converted to DeepSpeed's universal checkpoint) and trains the next steps
with the losses, learning rates and step counts of the run that saved it; it saves in turn, and the
2-rank ZeRO-2 learner resumes that one the same way. A same-layout resume replays its steps bit for
bit; a learner without the flag refuses a checkpoint of another layout, naming the flag.

Each learner is started once per module (three processes); the fixtures record what the tests
compare, so the tests do not depend on their order.
"""

import grpc
import pytest
import torch

from rlmesh.learner.v1 import learner_pb2 as pb
from services.common.tensors import ragged_from_proto, ragged_to_proto, to_proto
from services.learner import checkpoint
from tests.learner.learner_helpers import (
    experience,
    logprobs,
    random_sequences,
    response_lengths,
    signed_advantages,
    start_learner,
)

TRAIN_BATCH = 4
# Different ranks and stages sum the gradients in another order: the same numbers up to float32
# rounding. A resume without the optimizer's moments (Adam restarting at step 0) or with another
# learning rate misses these by orders of magnitude more.
CLOSE = {"rtol": 2e-5, "atol": 1e-6}


def learner_args(model_dir, critic_dir, ranks: int, zero_stage: int, universal: bool = True) -> list[str]:
    return ["--pretrain", str(model_dir), *(["--critic_pretrain", str(critic_dir)] if critic_dir else []),
            "--num_gpus", str(ranks),
            "--zero_stage", str(zero_stage), "--train_batch_size", str(TRAIN_BATCH), "--micro_train_batch_size", "1",
            "--micro_forward_batch_size", "2", "--actor_learning_rate", "2e-3", "--critic_learning_rate", "2e-3",
            "--l2", "0.1", "--lr_scheduler", "cosine_with_min_lr", "--max_steps", "8", "--lr_warmup_ratio", "0.25",
            *(["--use_ds_universal_ckpt"] if universal else [])]


def make_batches(stub, vocab: int, seed: int):
    """(actor batch, critic batch) of TRAIN_BATCH samples, their old log-probs and values from stub."""
    seqs, starts = random_sequences(TRAIN_BATCH, vocab, seed=seed)
    old = logprobs(stub, seqs, starts)
    values = ragged_from_proto(stub.Values(pb.ValuesRequest(input_ids=ragged_to_proto(seqs),
                                                            response_start=to_proto(starts)), timeout=60).values)
    returns = [torch.full((n,), 0.5) for n in response_lengths(seqs, starts)]
    return (experience(seqs, starts, old_logprobs=old, advantages=signed_advantages(seqs, starts)),
            experience(seqs, starts, returns=returns, old_values=values))


def train_steps(stub, batches, first_seed: int) -> list[dict]:
    """One actor and one critic optimizer step per batch pair; what each reported."""
    out = []
    for i, (actor_batch, critic_batch) in enumerate(batches):
        a = stub.TrainActor(pb.TrainActorRequest(batch=actor_batch, shuffle_seed=first_seed + i), timeout=300)
        c = stub.TrainCritic(pb.TrainCriticRequest(batch=critic_batch, shuffle_seed=first_seed + i), timeout=300)
        assert (a.optimizer_steps, c.optimizer_steps) == (1, 1)
        out.append({"policy_loss": a.policy_loss, "actor_grad_norm": a.grad_norm, "actor_lr": a.learning_rate,
                    "actor_step": a.actor_global_step, "value_loss": c.value_loss, "critic_grad_norm": c.grad_norm,
                    "critic_lr": c.learning_rate, "critic_step": c.critic_global_step})
    return out


def assert_continues(resumed: list[dict], original: list[dict]) -> None:
    for got, want in zip(resumed, original, strict=True):
        assert {k: got[k] for k in ("actor_lr", "actor_step", "critic_lr", "critic_step")} == \
            {k: want[k] for k in ("actor_lr", "actor_step", "critic_lr", "critic_step")}
        for key in ("policy_loss", "actor_grad_norm", "value_loss", "critic_grad_norm"):
            torch.testing.assert_close(got[key], want[key], **CLOSE, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def zero2(tmp_path_factory, tiny_model_dir, tiny_reward_model_dir):
    """2 ranks, ZeRO-2: two steps, a checkpoint at step 2, then two more steps (what a resume must redo)."""
    tmp = tmp_path_factory.mktemp("universal_z2")
    proc = start_learner(tmp, *learner_args(tiny_model_dir, tiny_reward_model_dir, ranks=2, zero_stage=2))
    vocab = proc.stub.GetInfo(pb.GetInfoRequest(), timeout=10).vocab_size
    train_steps(proc.stub, [make_batches(proc.stub, vocab, seed=s) for s in (1, 2)], first_seed=0)
    ckpt = tmp / "ckpt"
    proc.stub.SaveCheckpoint(pb.SaveCheckpointRequest(ckpt_path=str(ckpt), global_step=2, client_state=b"step 2"),
                             timeout=300)
    after = [make_batches(proc.stub, vocab, seed=s) for s in (3, 4)]
    yield {"proc": proc, "ckpt": ckpt, "after": after, "continued": train_steps(proc.stub, after, first_seed=10)}
    proc.stop()


@pytest.fixture(scope="module")
def zero3(tmp_path_factory, tiny_model_dir, tiny_reward_model_dir, zero2):
    """1 rank, ZeRO-3: resumes the 2-rank checkpoint, redoes its two steps, saves at step 4, two more steps
    (the second is where a lost optimizer state would show)."""
    tmp = tmp_path_factory.mktemp("universal_z3")
    proc = start_learner(tmp, *learner_args(tiny_model_dir, tiny_reward_model_dir, ranks=1, zero_stage=3))
    stub = proc.stub
    # What a conversion killed half-way leaves behind: removed, and the conversion done anew.
    (zero2["ckpt"] / "global_step_2" / ".universal-tmp-999999" / "actor").mkdir(parents=True)
    loaded = stub.LoadCheckpoint(pb.LoadCheckpointRequest(ckpt_path=str(zero2["ckpt"])), timeout=600)
    resumed = train_steps(stub, zero2["after"], first_seed=10)
    ckpt = tmp / "ckpt"
    stub.SaveCheckpoint(pb.SaveCheckpointRequest(ckpt_path=str(ckpt), global_step=4, client_state=b"step 4"),
                        timeout=300)
    vocab = stub.GetInfo(pb.GetInfoRequest(), timeout=10).vocab_size
    after = [make_batches(stub, vocab, seed=s) for s in (5, 6)]
    yield {"proc": proc, "loaded": loaded, "resumed": resumed, "ckpt": ckpt, "after": after,
           "continued": train_steps(stub, after, first_seed=20)}
    proc.stop()


def test_two_ranks_zero2_resume_on_one_rank_zero3(zero2, zero3):
    loaded = zero3["loaded"]
    step_folder = zero2["ckpt"] / "global_step_2"
    assert (loaded.global_step, loaded.client_state, loaded.actor_global_step) == (2, b"step 2", 2)
    # Converted once, beside the checkpoint's own files (which a same-layout resume keeps using).
    assert (step_folder / "universal" / "universal.json").is_file()
    assert sorted(p.name for p in (step_folder / "universal").iterdir()) == ["actor", "critic", "universal.json"]
    assert not list(step_folder.glob(".universal-tmp-*"))
    assert_continues(zero3["resumed"], zero2["continued"])


def test_one_rank_zero3_resumes_on_two_ranks_zero2_and_a_same_layout_resume_is_exact(zero2, zero3):
    stub = zero2["proc"].stub
    loaded = stub.LoadCheckpoint(pb.LoadCheckpointRequest(ckpt_path=str(zero3["ckpt"])), timeout=600)
    assert (loaded.global_step, loaded.client_state, loaded.actor_global_step) == (4, b"step 4", 4)
    assert_continues(train_steps(stub, zero3["after"], first_seed=20), zero3["continued"])
    # Its own checkpoint: loaded natively, the two steps after it replayed to the bit.
    stub.LoadCheckpoint(pb.LoadCheckpointRequest(ckpt_path=str(zero2["ckpt"])), timeout=600)
    assert train_steps(stub, zero2["after"], first_seed=10) == zero2["continued"]


def test_weights_only_load_of_another_layout_is_refused(zero2, zero3):
    with pytest.raises(grpc.RpcError) as info:
        zero3["proc"].stub.LoadCheckpoint(pb.LoadCheckpointRequest(ckpt_path=str(zero2["ckpt"]),
                                                                   load_optimizer_states=False), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "load_optimizer_states" in info.value.details()


def test_another_layout_without_the_flag_is_refused_naming_it(zero2, tmp_path, tiny_model_dir):
    proc = start_learner(tmp_path, *learner_args(tiny_model_dir, None, ranks=1, zero_stage=2, universal=False))
    try:
        with pytest.raises(grpc.RpcError) as info:
            proc.stub.LoadCheckpoint(pb.LoadCheckpointRequest(ckpt_path=str(zero2["ckpt"])), timeout=60)
    finally:
        proc.stop()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ZeRO stage 2 on 2 ranks" in info.value.details()
    assert "--use_ds_universal_ckpt" in info.value.details()


def test_which_layouts_convert(tmp_path):
    """The check before any rank loads: another stage or rank count needs the flag; ZeRO stage 0 has
    no partitions to convert, and loads under stage 0 on any number of ranks without it."""
    def saved(world_size: int, zero_stage: int):
        folder = tmp_path / f"global_step_{world_size}{zero_stage}"
        folder.mkdir()
        (folder / checkpoint.MARKER).write_bytes(checkpoint.marker_contents(world_size, zero_stage, ["actor"], 1))
        return folder

    z2 = saved(world_size=2, zero_stage=2)
    assert checkpoint.check_compatible(z2, 1, 3, ["actor"], universal=True)["zero_stage"] == 2
    assert checkpoint.check_compatible(z2, 2, 2, ["actor"])["world_size"] == 2
    with pytest.raises(ValueError, match="--use_ds_universal_ckpt to convert"):
        checkpoint.check_compatible(z2, 1, 2, ["actor"])
    with pytest.raises(ValueError, match="stages 1, 2 and 3 only"):
        checkpoint.check_compatible(z2, 2, 0, ["actor"], universal=True)
    z0 = saved(world_size=2, zero_stage=0)
    assert checkpoint.check_compatible(z0, 1, 0, ["actor"])["world_size"] == 2
    with pytest.raises(ValueError, match="start it with --zero_stage 0"):
        checkpoint.check_compatible(z0, 1, 2, ["actor"], universal=True)
