"""Where a process's model comes from, in one place: a named config (`--model NAME`) or a Hugging
Face model folder (`--model-dir DIR`, models/hf_format.py), whose config.json gives the
architecture, sizes and vocabulary.

The swarm knows a model by its name (the DHT keys) and by its fingerprint (models/identity.py,
announced in every peer record). With `--model-dir`, the name is `--model` when given, else the
folder's name; every peer and the trainer must give the same folder contents (same fingerprint).
"""

from __future__ import annotations

from dataclasses import replace

from models.config import GPTConfig, get_model_config
from models.hf_format import read_hf_config
from models.identity import model_fingerprint

DEFAULT_MODEL = "small"  # the default of every process's --model


class VocabularyError(ValueError):
    """A vocabulary size that does not fit the model (a folder's own, or a bad number)."""


def resolve_model(model: str, model_dir: str | None = None, vocab_size: int | None = None) -> GPTConfig:
    """The config a process serves or trains. Without `model_dir`: the named config
    (UnknownModelError), with its vocabulary replaced by `vocab_size` when given (the vocabulary is
    the data's: `swarm peer --vocab-size`). With it: the folder's config (ModelFolderError for a bad
    folder), named `model`, or after the folder when `model` is left at its default; its vocabulary
    is the folder's, and a different `vocab_size` is refused."""
    if vocab_size is not None and vocab_size < 1:
        raise VocabularyError(f"--vocab-size {vocab_size}: a vocabulary needs at least one token")
    if model_dir is None:
        config = get_model_config(model)
        return config if vocab_size in (None, config.vocab_size) else replace(config, vocab_size=vocab_size)
    config, _ = read_hf_config(model_dir)
    if vocab_size is not None and vocab_size != config.vocab_size:
        raise VocabularyError(
            f"the model in {model_dir} has a vocabulary of {config.vocab_size} tokens, not {vocab_size}: "
            "prepare the data with its tokenizer (swarm data prepare --tokenizer DIR/tokenizer.json)"
        )
    return config if model == DEFAULT_MODEL else replace(config, name=model)


def model_hash(config: GPTConfig) -> str:
    """The fingerprint peers announce for `config` (built-in blocks: no code hash)."""
    return model_fingerprint(config)
