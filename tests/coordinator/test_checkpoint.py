"""coordinator.json + `latest`: atomic, resumable, pruned; the data stream resumes at its position."""

import json

import pytest

from services.coordinator.loop import checkpoint
from services.coordinator.loop.checkpoint import CoordinatorState
from services.coordinator.loop.data import PromptStream


def learner_files(root, step):
    folder = checkpoint.step_dir(root, step)
    (folder / "actor").mkdir(parents=True)
    (folder / "learner.json").write_text("{}")


def test_commit_load_and_prune(tmp_path):
    assert checkpoint.load_latest(tmp_path) is None
    for step in (1, 2, 3, 4):
        learner_files(tmp_path, step)
        checkpoint.commit(tmp_path, CoordinatorState(global_step=step, episode=1, data_position=8 * step), 2)
    assert (tmp_path / "latest").read_text().strip() == "global_step_4"
    assert checkpoint.list_steps(tmp_path) == [3, 4]
    state = checkpoint.load_latest(tmp_path)
    assert (state.global_step, state.data_position) == (4, 32)
    assert not list(tmp_path.glob("*.tmp"))


def test_crash_before_latest_keeps_the_previous_checkpoint(tmp_path):
    learner_files(tmp_path, 1)
    checkpoint.commit(tmp_path, CoordinatorState(global_step=1), 3)
    # Step 2: the learner finished, the coordinator died before writing coordinator.json / latest.
    learner_files(tmp_path, 2)
    assert checkpoint.load_latest(tmp_path).global_step == 1
    # A hand-edited folder is reported with what to do.
    (tmp_path / "latest").write_text("global_step_2\n")
    with pytest.raises(FileNotFoundError, match="coordinator.json is missing"):
        checkpoint.load_latest(tmp_path)


def test_state_round_trips_and_rejects_other_formats(tmp_path):
    state = CoordinatorState(global_step=7, episode=2, data_position=3, kl_coef=0.02, seed=5, weight_version=9)
    assert CoordinatorState.from_json(state.to_json()) == state
    raw = json.loads(state.to_json())
    raw["format_version"] = 99
    with pytest.raises(ValueError, match="another rlmesh version"):
        CoordinatorState.from_json(json.dumps(raw))


def make_stream(n=10, episodes=2):
    return PromptStream([f"p{i}" for i in range(n)], [[i] for i in range(n)], [""] * n, ["d"] * n, seed=3,
                        num_episodes=episodes)


def test_stream_resumes_where_it_stopped():
    whole = make_stream()
    uids = [[p.uid for p in whole.next_batch(4)] for _ in range(4)]
    assert whole.next_batch(4) == []  # 2 episodes x 2 full batches; the remainder of 2 is skipped
    again = make_stream()
    again.next_batch(4)
    again.next_batch(4)
    episode, position = again.state()
    resumed = make_stream()
    resumed.restore(episode, position)
    assert [[p.uid for p in resumed.next_batch(4)] for _ in range(2)] == uids[2:]
    # Later episodes reshuffle.
    assert [u.split("-")[1] for u in uids[2]] != [u.split("-")[1] for u in uids[0]]


def test_stream_refills_cross_episodes():
    stream = make_stream(episodes=2)
    stream.next_batch(8)
    extra = stream.next_batch(5, whole=False)
    assert len(extra) == 5 and extra[-1].uid.startswith("e2-")


def test_prompts_in_file_order_without_shuffle(tiny_model_dir, tmp_path):
    """--no-shuffle_prompts (veRL's data.shuffle=False): every episode takes the prompts in the order of
    the data; the default shuffles them by the seed, episode 1 and the later ones."""
    import transformers

    from services.common.config import build_parser, config_from_args
    from services.coordinator.config import CoordinatorConfig
    from services.coordinator.loop.data import build_prompt_stream

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(12)))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)

    def labels(*flags) -> list[list[str]]:
        argv = ["--placement", "local", "--device", "cpu", "--pretrain", str(tiny_model_dir), "--prompt_data",
                str(data), "--reward_func", "math", "--label_key", "label", "--rollout_batch_size", "4",
                "--n_samples_per_prompt", "2", "--train_batch_size", "8", "--micro_train_batch_size", "2",
                "--advantage_estimator", "group_norm", "--num_episodes", "2", "--input_key", "prompt", *flags]
        config = config_from_args(CoordinatorConfig, build_parser(CoordinatorConfig).parse_args(argv))
        stream = build_prompt_stream(config, tokenizer)
        return [[p.label for p in stream.next_batch(4)] for _ in range(6)]

    in_order = [str(i + 1) for i in range(12)]
    batches = labels("--no-shuffle_prompts")
    assert sum(batches[:3], []) == in_order and sum(batches[3:], []) == in_order
    shuffled = labels()
    assert sorted(sum(shuffled[:3], []), key=int) == in_order
    assert sum(shuffled[:3], []) != in_order and sum(shuffled[3:], []) != sum(shuffled[:3], [])
