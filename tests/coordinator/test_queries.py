"""The query text the coordinator sends with each sample: OpenRLHF's decoded sequence, special tokens kept."""

import torch

from services.common.tiny import EOS_TOKEN, IM_START, build_tokenizer
from services.coordinator.loop.queries import QueryDecoder


def test_query_is_the_whole_sequence_with_chat_template_and_eos():
    tokenizer = build_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12+7?"}], tokenize=False,
                                           add_generation_prompt=True)
    # Prompt ids as the coordinator encodes a chat-templated prompt; the response as the engine returns
    # it, ending with the EOS token that stopped generation.
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer("The answer is \\boxed{19}", add_special_tokens=False)["input_ids"]
    response_ids.append(tokenizer.eos_token_id)
    sequence = torch.tensor(prompt_ids + response_ids)
    [query] = QueryDecoder(tokenizer).queries([sequence])
    assert query == f"{IM_START}user\nWhat is 12+7?{EOS_TOKEN}\n{IM_START}assistant\nThe answer is \\boxed{{19}}{EOS_TOKEN}"
    # What the reward side rebuilt before (prompt + response text) lacks the EOS that ends the answer.
    response_text = tokenizer.decode(response_ids, skip_special_tokens=True)
    assert query == prompt + response_text + EOS_TOKEN
    # Lists of ids work too, several at once, in order.
    assert QueryDecoder(tokenizer).queries([prompt_ids, response_ids]) == [prompt, response_text + EOS_TOKEN]
