"""Training and evaluation rows from local files.

Formats: JSONL (or a JSON array), Parquet, Arrow / Feather, CSV, `datasets.save_to_disk` folders,
and folders of such files. Several files can be blended with probabilities (the user's
`--prompt_data a.jsonl,b.jsonl --prompt_data_probs 0.7,0.3`). Prompts are rendered with the
tokenizer's chat template (with the generation prompt) or an `--input_template "...{}..."`.

Three loaders, one per use:

    load_prompts     -> PromptRow        prompts and labels for RL and evaluation
    load_sft         -> SFTExample       token ids with a loss mask on responses / assistant turns
    load_preferences -> PreferenceExample  chosen and rejected token ids with their loss masks

Bad rows (missing keys, wrong types, empty text, longer than max_len tokens, malformed JSON) are
skipped; each file's count and first row numbers per reason go to the log. With strict=True the
first bad row raises DatasetError instead. Row numbers count from 0; in JSONL files the row number
is the line number minus one.

Order and sampling are deterministic given the seed, so every data-parallel rank that loads the
same files with the same arguments gets the same list.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from services.common.log import get_logger, log_event

_log = get_logger("datasets")

T = TypeVar("T")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".feather", ".csv")
FIRST_ROWS_LOGGED = 5  # row numbers named per reason in the log
DATASOURCE_KEYS = ("datasource", "data_source")  # a row's own source name, when it carries one


class DatasetError(ValueError):
    """A data problem; the message names the file, the row and what to change."""


@dataclass(frozen=True)
class PromptRow:
    """One RL / evaluation prompt, rendered as the model will see it."""

    prompt: str  # rendered text: chat template with generation prompt, or input template applied
    label: str  # reference answer for rule rewards ("" when the data has none)
    datasource: str  # the row's own datasource field, else the file's name without suffix
    index: int  # row number in its file
    extra_info: str = ""  # the row's extra_info mapping (veRL data) as JSON text; "" without one
    difficulty: str = ""  # the row's own difficulty field (a level or a name) as text; "" without one


@dataclass(frozen=True)
class SFTExample:
    """One supervised example as token ids; the loss covers tokens where loss_mask is 1."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 on response / assistant-turn tokens, 0 on prompt tokens
    datasource: str
    index: int


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt with a chosen and a rejected response, each as full token ids with a loss mask."""

    chosen_ids: tuple[int, ...]
    chosen_mask: tuple[int, ...]  # 1 on the chosen response tokens
    rejected_ids: tuple[int, ...]
    rejected_mask: tuple[int, ...]  # 1 on the rejected response tokens
    margin: float  # how much better chosen is, from margin_key (0.0 without one)
    datasource: str
    index: int


class BadRow(Exception):
    """Raised by a row converter: the row is skipped (or fatal with strict=True)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason  # short, groups rows in the log, e.g. "missing key 'prompt'"
        self.detail = detail  # extra words for the strict error, e.g. the measured length


# ----------------------------------------------------------------------------------------------
# Reading files


def split_list(value: str | Path | Sequence | None) -> list:
    """"a,b" or ["a", "b"] or a Path or None -> list (the comma form is how the flags arrive)."""
    if value is None or value == "":
        return []
    if isinstance(value, Path):
        return [value]
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return list(value)


def _is_save_to_disk_folder(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """(row number, parsed object) per non-blank line; lines that are not UTF-8 or not JSON carry
    a BadRow instead (each line is decoded on its own, so one bad byte costs one row)."""
    data = path.read_bytes()
    if path.suffix == ".json" and data.lstrip().startswith(b"["):
        try:
            return list(enumerate(json.loads(data.decode("utf-8"))))
        except UnicodeDecodeError as exc:
            line = data[:exc.start].count(b"\n") + 1
            raise DatasetError(f"{path} line {line}: byte 0x{data[exc.start]:02x} is not UTF-8; save the file "
                               "as UTF-8") from None
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path} line {exc.lineno} column {exc.colno}: malformed JSON ({exc.msg}); fix "
                               "the file, or write one JSON object per line (JSONL) to skip bad rows") from None
    rows = []
    for number, raw in enumerate(data.split(b"\n")):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            rows.append((number, BadRow("not UTF-8", f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1} "
                                        f"of line {number + 1}; save the file as UTF-8")))
            continue
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            rows.append((number, BadRow("malformed JSON", str(exc))))
    return rows


def _read_arrow(path: Path):
    import pyarrow as pa
    import pyarrow.ipc

    # `datasets` writes the IPC stream format; Feather v2 and other writers the file format.
    try:
        with pa.memory_map(str(path)) as source:
            return pyarrow.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as source:
            return pyarrow.ipc.open_stream(source).read_all()


def _read_save_to_disk(path: Path, split: str):
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{path}: no split {split!r} in this DatasetDict (it has {sorted(loaded)}); "
                               f"pass split= one of those")
        loaded = loaded[split]
    return loaded.with_format("arrow")[:]  # respects an indices mapping, unlike the raw table


def read_rows(path: str | Path, split: str = "train") -> list[tuple[int, Any]]:
    """All rows of one local file or folder as (row number, dict); malformed rows as BadRow.

    A folder is a `datasets.save_to_disk` folder (its `split` when it holds a DatasetDict) or a
    folder of data files, read in name order and numbered on continuously.
    """
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file or folder; rlmesh reads local files only "
                           f"({', '.join(FILE_SUFFIXES)} or a datasets.save_to_disk folder): "
                           f"fetch the data set elsewhere and pass its local path")
    if path.is_dir():
        if _is_save_to_disk_folder(path):
            return list(enumerate(_read_save_to_disk(path, split).to_pylist()))
        files = sorted(p for p in path.iterdir() if p.suffix in FILE_SUFFIXES)
        if not files:
            raise DatasetError(f"{path}: folder holds no data files ({', '.join(FILE_SUFFIXES)}) and is not a "
                               f"datasets.save_to_disk folder")
        rows: list[tuple[int, Any]] = []
        for file in files:
            rows += [(len(rows) + i, row) for i, (_, row) in enumerate(read_rows(file, split))]
        return rows
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    if suffix == ".parquet":
        import pyarrow.parquet

        return list(enumerate(pyarrow.parquet.read_table(str(path)).to_pylist()))
    if suffix in (".arrow", ".feather"):
        return list(enumerate(_read_arrow(path).to_pylist()))
    if suffix == ".csv":
        import pyarrow.csv

        return list(enumerate(pyarrow.csv.read_csv(str(path)).to_pylist()))
    raise DatasetError(f"{path}: unknown file type {suffix!r}; use one of {', '.join(FILE_SUFFIXES)} "
                       f"or a datasets.save_to_disk folder")


# ----------------------------------------------------------------------------------------------
# Blending


def blend_counts(sizes: Sequence[int], probs: Sequence[float] | None, total: int) -> list[int]:
    """How many rows each source contributes to a blend of `total` rows.

    Without probs every row is used once (cut to `total` in proportion to size). With probs the
    counts follow them exactly up to rounding (largest remainder), so a small source is repeated
    and a large one subsampled as the probabilities say.
    """
    if probs is None:
        probs = sizes
    weights = [float(p) if n > 0 else 0.0 for p, n in zip(probs, sizes)]
    norm = sum(weights)
    if norm <= 0:
        return [0] * len(sizes)
    exact = [total * w / norm for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def blend(sources: Sequence[Sequence[T]], probs: Sequence[float] | None, total: int, seed: int,
          shuffle: bool = True) -> list[T]:
    """Draws blend_counts(...) rows from each source and returns them in one list.

    Each source is walked in a seeded permutation, starting a new permutation when it runs out,
    so a row repeats only after every row of its source has been used. With shuffle the result
    is permuted once more (seeded); without, sources follow each other in file order.
    """
    rng = random.Random(seed)
    counts = blend_counts([len(s) for s in sources], probs, total)
    out: list[T] = []
    for rows, count in zip(sources, counts):
        taken = 0
        while taken < count:
            order = list(range(len(rows)))
            if shuffle:
                rng.shuffle(order)
            out += [rows[i] for i in order[: count - taken]]
            taken += min(len(rows), count - taken)
    if shuffle:
        rng.shuffle(out)
    return out


# ----------------------------------------------------------------------------------------------
# Bad rows


class _Problems:
    """Counts bad rows of one file by reason; raises at the first one when strict."""

    def __init__(self, path: Path, strict: bool):
        self.path, self.strict = path, strict
        self.rows: dict[str, list[int]] = defaultdict(list)

    def add(self, index: int, problem: BadRow) -> None:
        if self.strict:
            detail = f" ({problem.detail})" if problem.detail else ""
            raise DatasetError(f"{self.path} row {index}: {problem.reason}{detail}; fix or remove the row, "
                               f"or run without --strict to skip bad rows")
        self.rows[problem.reason].append(index)

    def reasons(self) -> str:
        """'missing key 'prompt': 3 (rows 0, 1, 2); ...' over every reason, first rows of each."""
        return "; ".join(f"{reason}: {len(rows)} (rows {', '.join(map(str, rows[:FIRST_ROWS_LOGGED]))}"
                         f"{', ...' if len(rows) > FIRST_ROWS_LOGGED else ''})" for reason, rows in self.rows.items())

    def log(self, kept: int) -> None:
        skipped = sum(len(v) for v in self.rows.values())
        if not skipped:
            return
        reasons = self.reasons()
        log_event(_log, "dataset_bad_rows_skipped", level=logging.WARNING, file=str(self.path), skipped=skipped,
                  kept=kept, reasons=reasons)


def _load(paths, probs, max_samples: int | None, seed: int, shuffle: bool, strict: bool, split: str,
          convert: Callable[[dict, str, int], T]) -> list[T]:
    """Reads every file, converts each row (skipping bad ones), then blends."""
    path_list = [Path(p) for p in split_list(paths)]
    prob_list = [float(p) for p in split_list(probs)] or None
    if not path_list:
        raise DatasetError("no data files given; pass one or more paths (comma-separated)")
    if prob_list is not None:
        if len(prob_list) != len(path_list):
            raise DatasetError(f"{len(prob_list)} probabilities for {len(path_list)} files; give one per file "
                               f"(e.g. --prompt_data a.jsonl,b.jsonl --prompt_data_probs 0.7,0.3)")
        if any(p < 0 or not math.isfinite(p) for p in prob_list) or sum(prob_list) <= 0:
            raise DatasetError(f"probabilities {prob_list} must be >= 0 with a positive sum")
    sources: list[list[T]] = []
    for path in path_list:
        problems = _Problems(path, strict)
        kept: list[T] = []
        for index, row in read_rows(path, split):
            try:
                if isinstance(row, BadRow):
                    raise row
                if not isinstance(row, dict):
                    raise BadRow("row is not an object", f"got {type(row).__name__}")
                kept.append(convert(row, _datasource(row, path), index))
            except BadRow as problem:
                problems.add(index, problem)
        problems.log(len(kept))
        if not kept:
            jsonl = path.suffix in (".jsonl", ".json")
            where = " (row numbers count from 0: in JSONL files line = row + 1)" if jsonl else ""
            raise DatasetError(f"{path}: no usable rows: {problems.reasons() or 'the file is empty'}{where}; "
                               "fix the rows or the --*_key flags that name their fields")
        sources.append(kept)
    available = sum(len(s) for s in sources)
    total = available if not max_samples or max_samples <= 0 else min(max_samples, available)
    rows = blend(sources, prob_list, total, seed, shuffle)
    log_event(_log, "dataset_loaded", files=",".join(map(str, path_list)), rows=len(rows), available=available)
    return rows


def _datasource(row: dict, path: Path) -> str:
    for key in DATASOURCE_KEYS:
        if isinstance(row.get(key), str) and row[key]:
            return row[key]
    return path.stem if path.is_file() else path.name


# ----------------------------------------------------------------------------------------------
# Rendering text


Messages = list[dict]


def _field(row: dict, key: str) -> Any:
    """row[key]; a dotted key that is not a column itself reaches into nested objects, as veRL's
    `reward_model.ground_truth` does."""
    if key in row and row[key] is not None:
        return row[key]
    if key not in row and "." in key:
        value: Any = row
        for part in key.split("."):
            if not isinstance(value, dict) or value.get(part) is None:
                have = sorted(value) if isinstance(value, dict) else type(value).__name__
                raise BadRow(f"missing key {key!r}", f"no {part!r} under it (found {have})")
            value = value[part]
        return value
    raise BadRow(f"missing key {key!r}", f"the row has keys {sorted(row)}")


def _messages(value: Any, key: str) -> Messages:
    """A chat message list, checked: every item {"role": str, "content": str}."""
    if not isinstance(value, list) or not value:
        raise BadRow(f"{key!r} is not a non-empty message list")
    for message in value:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise BadRow(f"malformed message in {key!r}", "each message needs string 'role' and 'content'")
    if not any(m["content"].strip() for m in value):
        raise BadRow(f"empty text in {key!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise BadRow(f"{key!r} is not a string", f"got {type(value).__name__}")
    if not value.strip():
        raise BadRow(f"empty text in {key!r}")
    return value


def check_input_template(input_template: str | None) -> None:
    """Raises DatasetError unless the template formats one value ("...{}..."; literal braces doubled)."""
    if not input_template:
        return
    try:
        formatted = input_template.format("\x00")
    except (IndexError, KeyError, ValueError) as exc:
        raise DatasetError(f"--input_template {input_template!r} does not format: {exc}; it takes one '{{}}' "
                           f"where the prompt goes, with literal braces doubled ('{{{{' and '}}}}')") from exc
    if "\x00" not in formatted:
        raise DatasetError(f"--input_template {input_template!r} has no '{{}}' for the prompt")


def _chat(tokenizer, messages: Messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_prompt(value: Any, key: str, tokenizer, apply_chat_template: bool, input_template: str | None) -> str:
    """A prompt field (string or message list) as the text the model sees before its response.

    The input template formats a string prompt; the chat template then wraps it as a user turn
    and adds the generation prompt. A message list needs the chat template.
    """
    if isinstance(value, list):
        messages = _messages(value, key)
        if not apply_chat_template:
            raise BadRow(f"{key!r} is a message list", "pass --apply_chat_template to render message lists")
        return _chat(tokenizer, messages, add_generation_prompt=True)
    text = _text(value, key)
    if input_template:
        text = input_template.format(text)
    if apply_chat_template:
        return _chat(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    return text


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"] if text else []


def _check_length(length: int, max_len: int | None, what: str) -> None:
    if max_len and max_len > 0 and length > max_len:
        raise BadRow("over-long", f"{what} has {length} tokens > max_len {max_len}; raise max_len or shorten it")


def _require_tokenizer(tokenizer, why: str) -> None:
    if tokenizer is None:
        raise DatasetError(f"a tokenizer is needed {why}; pass tokenizer=")
    if why == "for the chat template" and not getattr(tokenizer, "chat_template", None):
        raise DatasetError("--apply_chat_template: the tokenizer has no chat template; set one in its "
                           "tokenizer_config.json or use --input_template instead")


# ----------------------------------------------------------------------------------------------
# Prompts (RL and evaluation)


def _extra_info(row: dict) -> str:
    """veRL data's per-row `extra_info` mapping (split, index, the original question, ...), which
    veRL hands to reward functions, as JSON text; "" for a row without one."""
    value = row.get("extra_info")
    if value is None:
        return ""
    if not isinstance(value, dict):
        raise BadRow("extra_info is not a mapping", f"got {type(value).__name__}; veRL reward functions get a dict "
                     "per row: store an object there, or drop the column")
    return json.dumps(value, ensure_ascii=False, default=str)


def _difficulty(row: dict) -> str:
    """A row's own `difficulty` (a level such as 3, or a name such as "hard") as text, by which the
    training metrics group rewards; "" for a row without one."""
    value = row.get("difficulty")
    if value is None or value == "":
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise BadRow("difficulty is not a number or a name", f"got {type(value).__name__}; store a level (3) or a "
                     "name (\"hard\") per row, or drop the column")
    return str(value)


def load_prompts(paths, probs=None, input_key: str = "prompt", label_key: str = "label", tokenizer=None,
                 apply_chat_template: bool = False, input_template: str | None = None, max_len: int | None = None,
                 max_samples: int | None = None, seed: int = 42, strict: bool = False, shuffle: bool = True,
                 split: str = "train") -> list[PromptRow]:
    """Prompts with labels for RL and evaluation.

    paths: "a.jsonl,b.parquet" or a list; probs: "0.7,0.3" or a list, one per path (None: each row
    once). input_key holds a string or a chat message list; label_key ("" for none) any scalar,
    kept as text. max_len bounds the rendered prompt's token count (needs the tokenizer).
    max_samples caps the number of rows (blends are cut in proportion).
    """
    check_input_template(input_template)
    if apply_chat_template:
        _require_tokenizer(tokenizer, "for the chat template")
    if max_len and max_len > 0:
        _require_tokenizer(tokenizer, "to check max_len")

    def convert(row: dict, datasource: str, index: int) -> PromptRow:
        prompt = render_prompt(_field(row, input_key), input_key, tokenizer, apply_chat_template, input_template)
        label = ""
        if label_key:
            value = _field(row, label_key)
            label = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if max_len and max_len > 0:
            _check_length(len(_encode(tokenizer, prompt, not apply_chat_template)), max_len, "prompt")
        return PromptRow(prompt=prompt, label=label, datasource=datasource, index=index,
                         extra_info=_extra_info(row), difficulty=_difficulty(row))

    return _load(paths, probs, max_samples, seed, shuffle, strict, split, convert)


# ----------------------------------------------------------------------------------------------
# Token ids with loss masks (SFT and preferences)


def _segments_to_ids(tokenizer, segments: list[tuple[str, bool]], first_special: bool) -> tuple[list[int], list[int]]:
    """[(text, trained)] -> (ids, loss mask). Each piece is tokenized on its own, as the rollout
    engine tokenizes the prompt alone and then generates the response after it."""
    ids: list[int] = []
    mask: list[int] = []
    for i, (text, trained) in enumerate(segments):
        piece = _encode(tokenizer, text, add_special_tokens=first_special and i == 0)
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask


def conversation_segments(tokenizer, messages: Messages) -> list[tuple[str, bool]]:
    """A multi-turn conversation as [(text, trained)] pieces: trained on every assistant turn.

    Each assistant turn's text is what the chat template adds after the generation prompt, found
    by rendering the conversation up to and including that turn; a template whose renderings are
    not prefixes of each other cannot be split this way and makes the row bad.
    """
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _chat(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = _chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (before.startswith(done) and through.startswith(before)):
            raise BadRow("chat template not prefix-stable", f"cannot isolate assistant turn {i}")
        if before[len(done):]:
            segments.append((before[len(done):], False))
        segments.append((through[len(before):], True))
        done = through
    if not any(trained for _, trained in segments):
        raise BadRow("no assistant turn", "multi-turn rows need at least one message with role 'assistant'")
    return segments


def _prompt_messages(prompt: Any, key: str, input_template: str | None) -> Messages:
    if isinstance(prompt, list):
        return _messages(prompt, key)
    return [{"role": "user", "content": _apply_template(_text(prompt, key), input_template)}]


def _prompt_response_segments(prompt: Any, response: Any, prompt_key: str, response_key: str, tokenizer,
                              apply_chat_template: bool, input_template: str | None) -> list[tuple[str, bool]]:
    """A prompt and a response (strings or message lists) as [(prompt text, False), (response, True)].

    With a message-list response and no prompt (prompt is None) the conversation is the response
    list itself: everything before its last assistant message is the prompt.
    """
    if not apply_chat_template:
        if isinstance(response, list):
            raise BadRow(f"{response_key!r} is a message list", "pass --apply_chat_template to render message lists")
        if prompt is None:
            raise BadRow(f"missing key {prompt_key!r}", "string responses need a prompt")
        prompt_text = render_prompt(prompt, prompt_key, tokenizer, False, input_template)
        # The response ends with eos so the model learns to stop (and a reward model reads its
        # score at a well-defined last token).
        return [(prompt_text, False), (_text(response, response_key) + (tokenizer.eos_token or ""), True)]
    if isinstance(response, list):
        reply = _messages(response, response_key)
        if prompt is None:
            last = max((i for i, m in enumerate(reply) if m["role"] == "assistant"), default=-1)
            if last <= 0:
                raise BadRow(f"no prompt in {response_key!r}",
                             "a conversation needs messages before its last assistant message, or give prompt_key")
            prompt_messages, reply = reply[:last], reply[last:]
        else:
            prompt_messages = _prompt_messages(prompt, prompt_key, input_template)
    else:
        if prompt is None:
            raise BadRow(f"missing key {prompt_key!r}", "string responses need a prompt")
        prompt_messages = _prompt_messages(prompt, prompt_key, input_template)
        reply = [{"role": "assistant", "content": _text(response, response_key)}]
    before = _chat(tokenizer, prompt_messages, add_generation_prompt=True)
    through = _chat(tokenizer, prompt_messages + reply, add_generation_prompt=False)
    if not through.startswith(before):
        raise BadRow("chat template not prefix-stable", "the prompt's rendering is not a prefix of the full one")
    return [(before, False), (through[len(before):], True)]


def _apply_template(text: str, input_template: str | None) -> str:
    return input_template.format(text) if input_template else text


def end_turns_at_eos(segments: list[tuple[str, bool]], eos_token: str | None) -> list[tuple[str, bool]]:
    """Moves whatever a chat template writes after a turn's eos (e.g. a newline) out of the
    trained piece, and drops it at the very end: generation stops at eos, so the trained text and
    the last token a reward model scores are the same as on sampled responses."""
    if not eos_token:
        return segments
    out: list[tuple[str, bool]] = []
    for text, trained in segments:
        cut = text.rfind(eos_token) + len(eos_token) if trained and eos_token in text else len(text)
        out += [(piece, flag) for piece, flag in ((text[:cut], trained), (text[cut:], False)) if piece]
    while out and not out[-1][1]:
        out.pop()
    return out


def _tokenize_segments(tokenizer, segments, apply_chat_template: bool, max_len: int | None, what: str):
    segments = end_turns_at_eos(segments, tokenizer.eos_token)
    ids, mask = _segments_to_ids(tokenizer, segments, first_special=not apply_chat_template)
    if not any(mask):
        raise BadRow("empty response", f"{what} has no response tokens")
    _check_length(len(ids), max_len, what)
    return tuple(ids), tuple(mask)


def openrlhf_sft_pair(tokenizer, prompt: str, response: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A plain-text SFT pair (no chat template) as OpenRLHF 0.11's SFT dataset builds it: the text
    prompt + response, trailing newlines stripped, then " " + eos unless it already ends with eos,
    tokenized as one piece without special tokens; the loss covers every token after the first
    len(tokenize(prompt)) (the response and the eos). prompt: already formatted by the input template.
    Returns (ids, loss mask)."""
    text = (prompt + response).rstrip("\n")
    eos = tokenizer.eos_token
    if eos and not text.endswith(eos):
        text += " " + eos
    ids = _encode(tokenizer, text, add_special_tokens=False)
    prompt_len = len(_encode(tokenizer, prompt, add_special_tokens=False))
    if prompt_len >= len(ids):
        raise BadRow("empty response", "the response adds no tokens after the prompt")
    return tuple(ids), tuple(int(i >= prompt_len) for i in range(len(ids)))


def load_sft(paths, probs=None, tokenizer=None, input_key: str = "input", output_key: str = "output",
             multiturn: bool = False, apply_chat_template: bool = False, input_template: str | None = None,
             max_len: int | None = 2048, max_samples: int | None = None, seed: int = 42, strict: bool = False,
             shuffle: bool = True, split: str = "train") -> list[SFTExample]:
    """Supervised examples as token ids with the loss on responses only.

    Pair rows: input_key holds the prompt (string or message list), output_key the response
    (string, or a message list of the assistant's reply). multiturn=True: input_key holds a whole
    conversation (message list) and the loss covers every assistant turn; output_key is unused.
    Plain-text pairs without the chat template are OpenRLHF's text (openrlhf_sft_pair), so the same
    row trains the same tokens; with the chat template the prompt's ids are those the rollout
    engine gets for the rendered prompt alone.
    Rows longer than max_len tokens are bad rows (skipped, or an error with strict).
    """
    check_input_template(input_template)
    _require_tokenizer(tokenizer, "to tokenize SFT data")
    if apply_chat_template or multiturn:
        _require_tokenizer(tokenizer, "for the chat template")

    def convert(row: dict, datasource: str, index: int) -> SFTExample:
        if multiturn:
            segments = conversation_segments(tokenizer, _messages(_field(row, input_key), input_key))
            chat = True
        elif not apply_chat_template and not isinstance(row.get(output_key), list):
            prompt = render_prompt(_field(row, input_key), input_key, tokenizer, False, input_template)
            ids, mask = openrlhf_sft_pair(tokenizer, prompt, _text(_field(row, output_key), output_key))
            _check_length(len(ids), max_len, "example")
            return SFTExample(input_ids=ids, loss_mask=mask, datasource=datasource, index=index)
        else:
            segments = _prompt_response_segments(_field(row, input_key), _field(row, output_key), input_key,
                                                 output_key, tokenizer, apply_chat_template, input_template)
            chat = apply_chat_template
        ids, mask = _tokenize_segments(tokenizer, segments, chat, max_len, "example")
        return SFTExample(input_ids=ids, loss_mask=mask, datasource=datasource, index=index)

    return _load(paths, probs, max_samples, seed, shuffle, strict, split, convert)


def load_preferences(paths, probs=None, tokenizer=None, prompt_key: str = "prompt", chosen_key: str = "chosen",
                     rejected_key: str = "rejected", margin_key: str = "", apply_chat_template: bool = False,
                     input_template: str | None = None, max_len: int | None = 2048, max_samples: int | None = None,
                     seed: int = 42, strict: bool = False, shuffle: bool = True,
                     split: str = "train") -> list[PreferenceExample]:
    """Preference pairs as token ids, for reward-model and DPO training.

    chosen and rejected are strings (then prompt_key must hold the prompt) or message lists: the
    assistant's reply after prompt_key's prompt, or, when the row has no prompt_key (or
    prompt_key is ""), whole conversations whose last assistant message is the response.
    margin_key (optional) holds a number: how much better chosen is, for the margin loss.
    """
    check_input_template(input_template)
    _require_tokenizer(tokenizer, "to tokenize preference data")
    if apply_chat_template:
        _require_tokenizer(tokenizer, "for the chat template")

    def convert(row: dict, datasource: str, index: int) -> PreferenceExample:
        prompt = row.get(prompt_key) if prompt_key else None
        sides = []
        for key in (chosen_key, rejected_key):
            segments = _prompt_response_segments(prompt, _field(row, key), prompt_key or "prompt", key, tokenizer,
                                                 apply_chat_template, input_template)
            sides.append(_tokenize_segments(tokenizer, segments, apply_chat_template, max_len, key))
        margin = 0.0
        if margin_key:
            value = _field(row, margin_key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise BadRow(f"{margin_key!r} is not a finite number", f"got {value!r}")
            margin = float(value)
        (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = sides
        return PreferenceExample(chosen_ids=chosen_ids, chosen_mask=chosen_mask, rejected_ids=rejected_ids,
                                 rejected_mask=rejected_mask, margin=margin, datasource=datasource, index=index)

    return _load(paths, probs, max_samples, seed, shuffle, strict, split, convert)
