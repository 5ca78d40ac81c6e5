"""benchmarks/gpu.py trains `gpt2-124m` (GPT-2's 50257-token vocabulary) on the corpus's bytes; the
trainer refuses data of another vocabulary than the swarm's, so the script pads the byte tokenizer."""

from __future__ import annotations

from benchmarks.gpu import padded_byte_tokenizer
from swarm.data.tokenizer import byte_tokenizer


def test_the_padded_byte_tokenizer_has_the_models_vocabulary_and_encodes_text_to_its_bytes():
    text = "Now is the winter of our discontent — été 1592\n"
    padded = padded_byte_tokenizer(50257)
    assert padded.get_vocab_size() == 50257
    assert padded.encode(text).ids == list(text.encode("utf-8")) == byte_tokenizer().encode(text).ids
    assert padded.decode(padded.encode(text).ids) == text
