"""`swarm generate`: sample text from an exported model folder in one process (plain PyTorch, the
project's own model code; a Hugging Face folder or one in the project's format, models/project_folder.py), with the folder's tokenizer.json
(the `tokenizers` library). The text is printed as it is produced; the context the model sees is
the last `seq_len` tokens."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator

import torch

from models.hf_format import TOKENIZER_FILE
from models.project_folder import load_model_folder
from models.stages import StageModule
from process.config import ConfigError, option


class GenerateError(ValueError):
    """The model folder cannot be sampled from (no tokenizer, an empty prompt after tokenizing, ...)."""


@dataclasses.dataclass(kw_only=True)
class GenerateConfig:
    model_dir: str | None = option(None, help="an exported model folder (`swarm export --out`)")
    prompt: str = option("", help="text to continue")
    max_new_tokens: int = option(100, help="tokens to generate")
    temperature: float = option(0.8, help="sampling temperature (0 = always the most likely token)")
    top_k: int | None = option(None, help="sample among the k most likely tokens only")
    seed: int = option(0, help="seed of the sampling")

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ConfigError("--model-dir is required: the folder `swarm export` wrote")
        if self.max_new_tokens < 0 or self.temperature < 0 or (self.top_k is not None and self.top_k < 1):
            raise ConfigError("--max-new-tokens and --temperature must be >= 0, --top-k at least 1")


def load_tokenizer(folder: str):
    from tokenizers import Tokenizer

    path = os.path.join(folder, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise GenerateError(f"{folder!r} has no {TOKENIZER_FILE}; export with --data (the prepared data folder)")
    return Tokenizer.from_file(path)


@torch.no_grad()
def sample_tokens(
    model: StageModule,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
) -> Iterator[int]:
    """Yield new token ids one by one; the model sees at most its last `seq_len` tokens."""
    tokens = list(prompt)
    seq_len = model.config.seq_len
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-seq_len:]], dtype=torch.int64)
        logits = model.logits(context)[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                threshold = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        tokens.append(token)
        yield token


def generate_text(config: GenerateConfig, out=sys.stdout) -> str:
    """Print the prompt and its continuation as it is produced; returns the continuation."""
    model_config, model = load_model_folder(config.model_dir)
    model.eval()
    tokenizer = load_tokenizer(config.model_dir)
    prompt = tokenizer.encode(config.prompt).ids if config.prompt else []
    if not prompt:
        raise GenerateError("the prompt is empty: give --prompt TEXT")
    if max(prompt) >= model_config.vocab_size:
        raise GenerateError(
            f"the tokenizer gives token {max(prompt)}, beyond the model's vocabulary of {model_config.vocab_size}"
        )
    generator = torch.Generator().manual_seed(config.seed)
    out.write(config.prompt)
    out.flush()
    new: list[int] = []
    printed = ""
    for token in sample_tokens(
        model,
        prompt,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_k=config.top_k,
        generator=generator,
    ):
        new.append(token)
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd") and text.startswith(printed):  # wait for a whole UTF-8 character
            out.write(text[len(printed) :])
            out.flush()
            printed = text
    text = tokenizer.decode(new)
    out.write(text[len(printed) :] + "\n")
    out.flush()
    return text


def run_generate(config: GenerateConfig) -> int:
    generate_text(config)
    return 0
