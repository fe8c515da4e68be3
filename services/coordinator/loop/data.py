"""Prompts for the training loop: loaded once, tokenized once, served in resumable batches.

The order is a function of the seed and the episode only, so a checkpoint needs just
(episode, position) to continue with exactly the prompts an uninterrupted run would have used.
An episode is one pass over the data; the last incomplete batch of an episode is dropped so every
step trains on rollout_batch_size prompts.
"""

from __future__ import annotations

import dataclasses
import random

from services.common.datasets import load_prompts


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt as the loop uses it."""

    uid: str  # unique within the run: "e{episode}-{row}"
    text: str  # rendered prompt (chat / input template applied)
    token_ids: tuple[int, ...]
    label: str
    datasource: str
    extra_info: str = ""  # the row's extra_info mapping as JSON text (veRL data), for reward functions
    difficulty: str = ""  # the row's difficulty field as text ("" without one): rewards are logged per value


class PromptStream:
    """Batches of prompts over `num_episodes` passes; position is (episode, index in the episode)."""

    def __init__(self, texts: list[str], token_ids: list[list[int]], labels: list[str], datasources: list[str],
                 seed: int, num_episodes: int, extra_infos: list[str] | None = None, shuffle: bool = True,
                 difficulties: list[str] | None = None):
        if not texts:
            raise ValueError("no prompts to train on")
        self.texts, self.token_ids, self.labels, self.datasources = texts, token_ids, labels, datasources
        self.extra_infos = extra_infos or [""] * len(texts)
        self.difficulties = difficulties or [""] * len(texts)
        self.seed, self.num_episodes, self.shuffle = seed, num_episodes, shuffle
        self.episode, self.position = 1, 0
        self._order = self._episode_order(1)

    def __len__(self) -> int:
        return len(self.texts)

    def _episode_order(self, episode: int) -> list[int]:
        # Episode 1 keeps the loader's (already seeded) order; later episodes reshuffle (unless no shuffle).
        order = list(range(len(self.texts)))
        if episode > 1 and self.shuffle:
            random.Random(self.seed * 1_000_003 + episode).shuffle(order)
        return order

    def steps_per_episode(self, batch_size: int) -> int:
        return len(self.texts) // batch_size

    def total_steps(self, batch_size: int) -> int:
        return self.num_episodes * self.steps_per_episode(batch_size)

    def exhausted(self) -> bool:
        return self.episode > self.num_episodes

    def next_batch(self, size: int, whole: bool = True) -> list[Prompt]:
        """The next `size` prompts. whole=True: only full batches within an episode (the rest of an
        episode is skipped); whole=False (refills): any prompts left, crossing episodes."""
        batch: list[Prompt] = []
        while len(batch) < size and not self.exhausted():
            left = len(self._order) - self.position
            if whole and left < size - len(batch):
                self._next_episode()
                continue
            take = min(left, size - len(batch))
            for row in self._order[self.position:self.position + take]:
                batch.append(Prompt(f"e{self.episode}-{row}", self.texts[row], tuple(self.token_ids[row]),
                                    self.labels[row], self.datasources[row], self.extra_infos[row],
                                    self.difficulties[row]))
            self.position += take
            if self.position >= len(self._order):
                self._next_episode()
        return batch

    def _next_episode(self) -> None:
        self.episode += 1
        self.position = 0
        if not self.exhausted():
            self._order = self._episode_order(self.episode)

    def state(self) -> tuple[int, int]:
        return self.episode, self.position

    def restore(self, episode: int, position: int) -> None:
        self.episode, self.position = episode, position
        if not self.exhausted():
            self._order = self._episode_order(episode)
            if not 0 <= position <= len(self._order):
                raise ValueError(f"data position {position} is outside the {len(self._order)} prompts; "
                                 "was --prompt_data or --max_samples changed since the checkpoint?")


def build_prompt_stream(config, tokenizer) -> PromptStream:
    """Loads --prompt_data as the flags say and tokenizes every prompt once."""
    rows = load_prompts(config.prompt_data, probs=config.prompt_data_probs or None, input_key=config.input_key,
                        label_key=config.label_key, tokenizer=tokenizer, apply_chat_template=config.apply_chat_template,
                        input_template=config.input_template or None, max_len=config.prompt_max_len,
                        max_samples=config.max_samples, seed=config.seed, shuffle=config.shuffle_prompts)
    texts = [r.prompt for r in rows]
    # The chat template already wrote any special tokens; a plain prompt gets the tokenizer's own.
    encoded = tokenizer(texts, add_special_tokens=not config.apply_chat_template)["input_ids"]
    return PromptStream(texts, encoded, [r.label for r in rows], [r.datasource for r in rows],
                        config.seed, config.num_episodes, [r.extra_info for r in rows], config.shuffle_prompts,
                        [r.difficulty for r in rows])
