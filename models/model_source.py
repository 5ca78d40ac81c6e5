"""Where a process's model comes from, in one place: a named config (`--model NAME`) or a Hugging
Face model folder (`--model-dir DIR`, models/hf_format.py), whose config.json gives the
architecture, sizes and vocabulary.

The swarm knows a model by its name (the DHT keys) and by its fingerprint (models/identity.py,
announced in every peer record). With `--model-dir`, the name is `--model` when given, else the
folder's name; every peer and the trainer must give the same folder contents (same fingerprint).
"""

from __future__ import annotations

from dataclasses import replace

from models.config import GPTConfig, resolve_model_config
from models.hf_format import ModelFolderError, read_hf_config
from models.identity import model_fingerprint

DEFAULT_MODEL = "small"  # the default of every process's --model


def resolve_model(model: str, model_dir: str | None = None, vocab_size: int | None = None) -> GPTConfig:
    """The config a process serves or trains. Without `model_dir`: the named config
    (UnknownModelError), its vocabulary replaced by `vocab_size` when given (a peer's --vocab-size,
    a trainer's data). With it: the folder's config (ModelFolderError for a bad folder, or for a
    `vocab_size` other than the folder's), named `model`, or after the folder when `model` is left
    at its default."""
    if model_dir is None:
        return resolve_model_config(model, vocab_size)
    config, _ = read_hf_config(model_dir)
    if vocab_size is not None and vocab_size != config.vocab_size:
        raise ModelFolderError(
            f"the model folder {model_dir!r} has a vocabulary of {config.vocab_size} tokens, not {vocab_size} "
            f"(--vocab-size, or the data's): prepare the data with the folder's tokenizer.json"
        )
    return config if model == DEFAULT_MODEL else replace(config, name=model)


def model_hash(config: GPTConfig) -> str:
    """The fingerprint peers announce for `config` (built-in blocks: no code hash)."""
    return model_fingerprint(config)
