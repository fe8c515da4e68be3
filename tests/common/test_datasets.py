"""Datasets from real local files of every supported format, blending, templates and bad rows."""

import json
from collections import Counter

import datasets
import pyarrow as pa
import pyarrow.csv
import pyarrow.feather
import pyarrow.parquet
import pytest

from services.common.datasets import (
    DatasetError,
    blend,
    blend_counts,
    load_preferences,
    load_prompts,
    load_sft,
    read_rows,
)
from services.common.tiny import build_tokenizer

ROWS = [{"prompt": f"{i}+1=", "label": i + 1} for i in range(6)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path):
    """The same six rows in every format."""
    table = pa.Table.from_pylist(ROWS)
    out = {"jsonl": write_jsonl(tmp_path / "a.jsonl", ROWS)}
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    out["json"] = tmp_path / "a.json"
    pyarrow.parquet.write_table(table, tmp_path / "a.parquet")
    out["parquet"] = tmp_path / "a.parquet"
    pyarrow.feather.write_feather(table, tmp_path / "a.feather")
    out["feather"] = tmp_path / "a.feather"
    pyarrow.csv.write_csv(table, tmp_path / "a.csv")
    out["csv"] = tmp_path / "a.csv"
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "disk"))
    out["save_to_disk"] = tmp_path / "disk"
    # A DatasetDict, and a dataset whose on-disk order differs from its logical one.
    datasets.DatasetDict({"train": ds.select([5, 4, 3, 2, 1, 0]), "test": ds.select([0])}).save_to_disk(
        str(tmp_path / "dict"))
    out["save_to_disk_dict"] = tmp_path / "dict"
    arrow_files = sorted((tmp_path / "disk").glob("*.arrow"))
    assert arrow_files, "save_to_disk wrote no .arrow file"
    out["arrow"] = arrow_files[0]  # the IPC stream format that `datasets` writes
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "part-0.jsonl", ROWS[:3])
    pyarrow.parquet.write_table(pa.Table.from_pylist(ROWS[3:]), shards / "part-1.parquet")
    out["folder"] = shards
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "feather", "csv", "arrow", "save_to_disk", "folder"])
def test_every_format_reads_the_same_rows(files, fmt):
    rows = load_prompts(files[fmt], shuffle=False)
    assert [(r.prompt, r.label, r.index) for r in rows] == [(f"{i}+1=", str(i + 1), i) for i in range(6)]


def test_dataset_dict_split_and_logical_order(files):
    rows = load_prompts(files["save_to_disk_dict"], shuffle=False)
    assert [r.prompt for r in rows] == [f"{i}+1=" for i in (5, 4, 3, 2, 1, 0)]
    assert [r.prompt for r in load_prompts(files["save_to_disk_dict"], split="test")] == ["0+1="]
    with pytest.raises(DatasetError, match="no split 'dev'"):
        load_prompts(files["save_to_disk_dict"], split="dev")


def test_missing_file_says_local_only(tmp_path):
    with pytest.raises(DatasetError, match="local files only"):
        read_rows(tmp_path / "OpenRLHF-prompts")


def test_chat_template_input_template_and_datasource(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "math.jsonl", [{"q": "2+2=", "a": "4"},
                                                 {"q": [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "3+3="}], "a": "6",
                                                  "data_source": "gsm"}])
    rows = load_prompts(path, input_key="q", label_key="a", tokenizer=tokenizer, apply_chat_template=True,
                        shuffle=False)
    assert rows[0].prompt == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    assert rows[1].prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3+3=")
    assert [r.datasource for r in rows] == ["math", "gsm"]
    templated = load_prompts(path, input_key="q", label_key="a", input_template="Q: {} A: \\boxed{{}}",
                             shuffle=False)
    assert [r.prompt for r in templated] == ["Q: 2+2= A: \\boxed{}"]  # the message list needs the chat template
    both = load_prompts(path, input_key="q", label_key="a", tokenizer=tokenizer, apply_chat_template=True,
                        input_template="Q: {}", shuffle=False)
    assert both[0].prompt.startswith("<|im_start|>user\nQ: 2+2=<|im_end|>")
    with pytest.raises(DatasetError, match="--input_template"):
        load_prompts(path, input_key="q", input_template="no placeholder")


def test_bad_rows_are_skipped_and_logged_or_fatal_when_strict(tmp_path, tokenizer, caplog):
    good = [{"prompt": "1+1=", "label": "2"}] * 3
    bad = [{"label": "1"}, {"prompt": "  ", "label": "1"}, {"prompt": "9" * 300, "label": "1"},
           {"prompt": "1+2="}, {"prompt": 5, "label": "1"}]
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(r) for r in good[:1] + bad + good[1:]]
    lines.insert(3, "{not json")
    path.write_text("\n".join(lines) + "\n")
    rows = load_prompts(path, tokenizer=tokenizer, max_len=64, shuffle=False)
    assert [r.index for r in rows] == [0, 7, 8]
    err = caplog.text
    assert "dataset_bad_rows_skipped" in err and "skipped=6" in err
    for reason in ("missing key 'prompt': 1 (rows 1)", "empty text in 'prompt': 1 (rows 2)",
                   "malformed JSON: 1 (rows 3)", "over-long: 1 (rows 4)", "missing key 'label': 1 (rows 5)",
                   "'prompt' is not a string: 1 (rows 6)"):
        assert reason in err, reason
    with pytest.raises(DatasetError, match=r"mixed.jsonl row 1: missing key 'prompt'.*--strict"):
        load_prompts(path, tokenizer=tokenizer, max_len=64, strict=True)
    with pytest.raises(DatasetError, match="no usable rows"):
        load_prompts(write_jsonl(tmp_path / "allbad.jsonl", bad[:2]))


def test_extra_info_travels_as_json_text_and_a_non_mapping_is_a_bad_row(tmp_path):
    """veRL data's extra_info column (a dict per row) is kept for reward functions; a row without
    one has none; one that is not a mapping is skipped like any bad row (fatal with strict)."""
    path = write_jsonl(tmp_path / "verl.jsonl", [
        {"prompt": "1+1=", "label": "2", "extra_info": {"split": "train", "index": 0, "question": "1+1"}},
        {"prompt": "2+2=", "label": "4"},
        {"prompt": "3+3=", "label": "6", "extra_info": "not a mapping"}])
    rows = load_prompts(path, shuffle=False)
    assert [json.loads(r.extra_info) if r.extra_info else None for r in rows] == [
        {"split": "train", "index": 0, "question": "1+1"}, None]
    with pytest.raises(DatasetError, match="row 2: extra_info is not a mapping"):
        load_prompts(path, strict=True)


def test_difficulty_is_kept_as_text_and_a_non_scalar_is_a_bad_row(tmp_path):
    """A row's difficulty (rlmesh make-task writes one; rewards are logged per value) as text; a row
    without one has ""; a list or a mapping there is a bad row."""
    path = write_jsonl(tmp_path / "tasks.jsonl", [
        {"prompt": "1+1=", "label": "2", "difficulty": 1}, {"prompt": "12*7=", "label": "84", "difficulty": "hard"},
        {"prompt": "2+2=", "label": "4"}, {"prompt": "3+3=", "label": "6", "difficulty": [1, 2]}])
    assert [r.difficulty for r in load_prompts(path, shuffle=False)] == ["1", "hard", ""]
    with pytest.raises(DatasetError, match="row 3: difficulty is not a number or a name"):
        load_prompts(path, strict=True)


def test_no_usable_rows_and_bad_bytes_name_the_file_line_and_key(tmp_path, tokenizer):
    wrong_key = write_jsonl(tmp_path / "wrong_key.jsonl", [{"question": "1+1=", "label": "2"}] * 2)
    with pytest.raises(DatasetError) as err:
        load_prompts(wrong_key, tokenizer=tokenizer)
    message = str(err.value)
    assert str(wrong_key) in message and "missing key 'prompt': 2 (rows 0, 1)" in message
    # A non-UTF-8 byte costs its line only; a file of nothing else is an error naming the line.
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9", "label": "1"}\n{"prompt": "1+1=", "label": "2"}\n')
    rows = load_prompts(latin, tokenizer=tokenizer, shuffle=False)
    assert [r.index for r in rows] == [1]
    with pytest.raises(DatasetError, match=r"latin1.jsonl row 0: not UTF-8 \(byte 0xe9 at column 16 of line 1"):
        load_prompts(latin, tokenizer=tokenizer, strict=True)
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match=r"only_bad.jsonl: no usable rows: not UTF-8: 1 \(rows 0\).*line = row \+ 1"):
        load_prompts(only_bad, tokenizer=tokenizer)
    array = tmp_path / "array.json"
    array.write_bytes(b'[\n{"prompt": "1+1="},\n{"prompt": "\xff"}]')
    with pytest.raises(DatasetError, match=r"array.json line 3: byte 0xff is not UTF-8"):
        load_prompts(array, tokenizer=tokenizer)


def test_max_samples_and_seeded_shuffle(files):
    a = load_prompts(files["jsonl"], seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in load_prompts(files["jsonl"], seed=3)]
    assert sorted(r.index for r in a) == list(range(6))
    assert [r.index for r in a] != list(range(6)) or [r.index for r in load_prompts(files["jsonl"], seed=4)] != [
        r.index for r in a]
    assert len(load_prompts(files["jsonl"], max_samples=4)) == 4
    assert [r.index for r in load_prompts(files["jsonl"], max_samples=2, shuffle=False)] == [0, 1]


def test_blending_follows_probabilities(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "label": ""} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "label": ""} for i in range(100)])
    rows = load_prompts(f"{a},{b}", "0.7,0.3", max_samples=100, seed=0)
    counts = Counter(r.datasource for r in rows)
    assert counts == {"a": 70, "b": 30}
    a_counts = Counter(r.prompt for r in rows if r.datasource == "a")
    assert set(a_counts.values()) == {7}  # the small source is repeated evenly, every row 7 times
    assert Counter(r.datasource for r in load_prompts([a, b])) == {"a": 10, "b": 100}  # no probs: each row once
    with pytest.raises(DatasetError, match="one per file"):
        load_prompts([a, b], [1.0])


def test_blend_counts_and_blend_are_exact():
    assert blend_counts([10, 100], [0.7, 0.3], 11) == [8, 3]
    assert blend_counts([10, 0], [0.5, 0.5], 4) == [4, 0]
    assert blend([[1, 2, 3]], None, 3, seed=0, shuffle=False) == [1, 2, 3]
    out = blend([[1, 2, 3], [9]], [0.5, 0.5], 4, seed=0)
    assert out.count(9) == 2 and len({x for x in out if x != 9}) == 2  # two distinct rows of the first


def masked_text(tokenizer, ids, mask, want=1):
    return tokenizer.decode([i for i, m in zip(ids, mask) if m == want])


def test_sft_pairs_train_on_the_response_only(tmp_path, tokenizer, tiny_data_dir):
    rows = load_sft(tiny_data_dir / "sft.jsonl", tokenizer=tokenizer, input_key="prompt", output_key="response",
                    apply_chat_template=True, max_len=64, shuffle=False)
    first = json.loads((tiny_data_dir / "sft.jsonl").read_text().splitlines()[0])
    ex = rows[0]
    assert masked_text(tokenizer, ex.input_ids, ex.loss_mask) == first["response"] + "<|im_end|>"
    assert tokenizer.decode(ex.input_ids) == (f"<|im_start|>user\n{first['prompt']}<|im_end|>\n"
                                              f"<|im_start|>assistant\n{first['response']}<|im_end|>")
    # The prompt's ids are exactly what the rollout engine gets for the rendered prompt alone.
    prompt = load_prompts(tiny_data_dir / "sft.jsonl", label_key="", tokenizer=tokenizer,
                          apply_chat_template=True, shuffle=False)[0].prompt
    n_prompt = ex.loss_mask.index(1)
    assert list(ex.input_ids[:n_prompt]) == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # Without the chat template: OpenRLHF's text, prompt + response + " " + eos (tests/common/test_sft_template.py).
    plain = load_sft(tiny_data_dir / "sft.jsonl", tokenizer=tokenizer, input_key="prompt", output_key="response",
                     max_samples=3, shuffle=False)[0]
    assert masked_text(tokenizer, plain.input_ids, plain.loss_mask) == first["response"] + " " + tokenizer.eos_token
    assert masked_text(tokenizer, plain.input_ids, plain.loss_mask, want=0) == first["prompt"]


def test_sft_multiturn_trains_on_every_assistant_turn(tmp_path, tokenizer):
    conversation = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="},
                    {"role": "assistant", "content": "2"}, {"role": "user", "content": "and +1?"},
                    {"role": "assistant", "content": "3"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation},
                                                 {"messages": conversation[:2]},  # no assistant turn
                                                 {"messages": conversation * 20}])  # over-long
    rows = load_sft(path, tokenizer=tokenizer, input_key="messages", multiturn=True, max_len=128, shuffle=False)
    assert len(rows) == 1
    ex = rows[0]
    assert masked_text(tokenizer, ex.input_ids, ex.loss_mask) == "2<|im_end|>3<|im_end|>"
    assert tokenizer.decode(ex.input_ids) == tokenizer.apply_chat_template(conversation, tokenize=False).rstrip("\n")
    with pytest.raises(DatasetError, match="row 1: no assistant turn"):
        load_sft(path, tokenizer=tokenizer, input_key="messages", multiturn=True, max_len=128, strict=True)


def test_preferences_strings_and_message_lists(tmp_path, tokenizer):
    prompt = [{"role": "user", "content": "2+2="}]
    rows = [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": 2},
        {"chosen": prompt + [{"role": "assistant", "content": "4"}],  # whole conversations, no prompt key
         "rejected": prompt + [{"role": "assistant", "content": "5"}], "margin": 1.5},
        {"prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "5"}], "margin": 0},
        {"prompt": "2+2=", "chosen": "4", "rejected": "", "margin": 1},  # empty rejected
        {"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": "big"},  # bad margin
    ]
    path = write_jsonl(tmp_path / "prefs.jsonl", rows)
    pairs = load_preferences(path, tokenizer=tokenizer, margin_key="margin", apply_chat_template=True,
                             shuffle=False)
    assert [p.index for p in pairs] == [0, 1, 2]
    assert [p.margin for p in pairs] == [2.0, 1.5, 0.0]
    full = "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>"
    for p in pairs:  # all three spellings give the same token ids
        assert tokenizer.decode(p.chosen_ids) == full.format("4")
        assert tokenizer.decode(p.rejected_ids) == full.format("5")
        assert masked_text(tokenizer, p.chosen_ids, p.chosen_mask) == "4<|im_end|>"
        assert masked_text(tokenizer, p.rejected_ids, p.rejected_mask) == "5<|im_end|>"
    plain = load_preferences(path, tokenizer=tokenizer, max_samples=1, shuffle=False)[0]
    assert tokenizer.decode(plain.chosen_ids) == "2+2=4" + tokenizer.eos_token


def test_verl_parquet_rows_with_a_nested_ground_truth(tmp_path, tokenizer):
    """veRL's preprocessed datasets: the prompt is a message list, the label sits at
    reward_model.ground_truth, data_source is a column; a dotted --label_key reaches into the object."""
    import pyarrow as pa

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2+2="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"split": "train", "index": 0}},
            {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "3+3="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "6"}, "extra_info": {"split": "train", "index": 1}},
            {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1="}], "ability": "math",
             "reward_model": {"style": "rule"}, "extra_info": {"split": "train", "index": 2}}]
    pyarrow.parquet.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    loaded = load_prompts(tmp_path / "train.parquet", input_key="prompt", label_key="reward_model.ground_truth",
                          tokenizer=tokenizer, apply_chat_template=True, shuffle=False)
    assert [(r.label, r.datasource) for r in loaded] == [("4", "openai/gsm8k"), ("6", "openai/gsm8k")]
    assert loaded[0].prompt == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    # The row without a ground truth is skipped (fatal with strict), with the reason and what was there.
    with pytest.raises(DatasetError, match=r"missing key 'reward_model.ground_truth'.*no 'ground_truth' under it"):
        load_prompts(tmp_path / "train.parquet", input_key="prompt", label_key="reward_model.ground_truth",
                     tokenizer=tokenizer, apply_chat_template=True, shuffle=False, strict=True)
    # The whole object is still there under its own name.
    whole = load_prompts(tmp_path / "train.parquet", input_key="prompt", label_key="reward_model",
                         tokenizer=tokenizer, apply_chat_template=True, shuffle=False)
    assert json.loads(whole[0].label) == {"style": "rule", "ground_truth": "4"}
