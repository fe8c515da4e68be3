"""The query text reward servers and reward functions receive, as OpenRLHF sends it.

OpenRLHF decodes each sample's whole token sequence, the prompt as the model saw it (chat template
and all) followed by the generated tokens, with special tokens kept: reward code written for it
finds the assistant turn by its marker (e.g. "<|im_start|>assistant") and the end of the answer by
the EOS or chat end token. Rebuilding the text from the prompt and response strings loses those
tokens, so the coordinator, which holds every sample's token ids, decodes them here.
"""

from __future__ import annotations

from collections.abc import Sequence


class QueryDecoder:
    """Decodes prompt + response token ids with the policy's tokenizer, special tokens kept."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def queries(self, sequences: Sequence) -> list[str]:
        """One text per sequence of token ids (prompt followed by response; tensors or lists).

        The tokenizer's own clean-up setting applies, as in OpenRLHF's decode call.
        """
        ids = [seq.tolist() if hasattr(seq, "tolist") else list(seq) for seq in sequences]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=False)
