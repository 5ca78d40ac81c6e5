"""Hugging Face model folders, both directions, with safetensors alone (no transformers, no hub).

A folder holds `config.json`, the weights (`model.safetensors`, or shards listed by
`model.safetensors.index.json`) and usually `tokenizer.json`. Supported families: GPT-2
(`GPT2LMHeadModel`, model_type "gpt2") and Llama (`LlamaForCausalLM`, model_type "llama", multi-head
or grouped-query attention, no rope scaling). The project's blocks compute exactly what those classes compute
(models/gpt.py, models/llama.py); this module only maps names and layouts:

- GPT-2 keeps its projections in `Conv1D` layers whose weight is (in, out): transposed here.
- Llama's separate q/k/v projections are the rows of the project's fused `attn.qkv`.
- Tied embeddings. GPT-2 folders usually tie the head to the token embedding
  (`tie_word_embeddings`, true by default for GPT-2) and store no `lm_head.weight`. Here the
  embedding lives on the first stage and the head on the last, so they are two tensors: the last
  stage reads the embedding's tensor (`transformer.wte.weight`) as its head weight, and the two
  train apart from then on. A folder written by `write_model_folder` is therefore always untied
  (`tie_word_embeddings: false` and an explicit `lm_head.weight`), which transformers loads as is.

One stage reads only its own tensors (`load_stage_from_folder`), lazily: the float32 tensors it
needs are read from the files straight into its parameters (transposed through a small buffer), so
a peer serving a quarter of a model never reads the rest and holds no second copy of any tensor.
Everything is checked before any parameter is touched: bad input raises `ModelFolderError` with a
one-line message, and the module is left as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from dataclasses import replace

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from models.config import GPTConfig
from models.hf_config import (  # noqa: F401  (re-exported: the public names of this module)
    SUPPORTED_MODEL_TYPES,
    ModelFolderError,
    from_hf_config,
    is_tied,
    to_hf_config,
)
from models.init_weights import global_name
from models.stages import StageModule, build_full_model

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
SWARM_META_FILE = "swarm.json"  # what a swarm export adds: the exact GPTConfig and the caller's metadata

# --- tensor names ---------------------------------------------------------------------------------

_COPY, _TRANSPOSE, _CONCAT = "copy", "transpose", "concat"


def _hf_sources(config: GPTConfig, name: str, *, tied: bool = False) -> tuple[tuple[str, ...], str]:
    """The HF tensors a full-model project tensor is made of, and how: copied, transposed (GPT-2's
    Conv1D), or concatenated along rows (Llama's q, k, v into `attn.qkv`)."""
    if config.arch == "gpt":
        fixed = {
            "embedding.tok.weight": "transformer.wte.weight",
            "embedding.pos.weight": "transformer.wpe.weight",
            "head.ln_f.weight": "transformer.ln_f.weight",
            "head.ln_f.bias": "transformer.ln_f.bias",
            "head.out.weight": "transformer.wte.weight" if tied else "lm_head.weight",
        }
        if name in fixed:
            return (fixed[name],), _COPY
        _, index, rest = name.split(".", 2)
        module, _, kind = rest.rpartition(".")
        hf_module = {
            "ln_1": "ln_1",
            "ln_2": "ln_2",
            "attn.qkv": "attn.c_attn",
            "attn.proj": "attn.c_proj",
            "mlp.up": "mlp.c_fc",
            "mlp.down": "mlp.c_proj",
        }[module]
        how = _TRANSPOSE if kind == "weight" and not module.startswith("ln_") else _COPY
        return (f"transformer.h.{index}.{hf_module}.{kind}",), how
    fixed = {
        "embedding.tok.weight": "model.embed_tokens.weight",
        "head.norm.weight": "model.norm.weight",
        "head.out.weight": "model.embed_tokens.weight" if tied else "lm_head.weight",
    }
    if name in fixed:
        return (fixed[name],), _COPY
    _, index, rest = name.split(".", 2)
    prefix = f"model.layers.{index}."
    if rest == "attn.qkv.weight":
        return tuple(f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"), _CONCAT
    hf_rest = {
        "norm_1.weight": "input_layernorm.weight",
        "norm_2.weight": "post_attention_layernorm.weight",
        "attn.proj.weight": "self_attn.o_proj.weight",
        "mlp.gate.weight": "mlp.gate_proj.weight",
        "mlp.up.weight": "mlp.up_proj.weight",
        "mlp.down.weight": "mlp.down_proj.weight",
    }[rest]
    return (prefix + hf_rest,), _COPY


def to_hf_state_dict(config: GPTConfig, project_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full-model project tensors (`embedding.*`, `blocks.<i>.*`, `head.*`) -> HF names and layouts
    (always with an explicit `lm_head.weight`)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in project_state.items():
        hf_names, how = _hf_sources(config, name)
        t = tensor.detach().cpu()
        if how == _TRANSPOSE:
            out[hf_names[0]] = t.t().contiguous()
        elif how == _CONCAT:
            kv_rows = config.kv_heads * config.head_dim
            for hf_name, part in zip(hf_names, t.split([config.d_model, kv_rows, kv_rows], dim=0)):
                out[hf_name] = part.contiguous()
        else:
            out[hf_names[0]] = t.contiguous()
    return out


def from_hf_tensors(how: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """One project tensor from the HF tensors `_hf_sources` names (the inverse of one entry of
    `to_hf_state_dict`)."""
    if how == _TRANSPOSE:
        return tensors[0].t()
    if how == _CONCAT:
        return torch.cat(tensors, dim=0)
    return tensors[0]


# --- reading a folder -----------------------------------------------------------------------------


def read_hf_config(folder: str) -> tuple[GPTConfig, dict]:
    """The GPTConfig of a model folder and its raw config.json. The config's name is the folder's."""
    if not os.path.isdir(folder):
        raise ModelFolderError(f"--model-dir {folder!r}: no such folder")
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ModelFolderError(f"--model-dir {folder!r} is not a model folder: it has no {CONFIG_FILE}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelFolderError(f"--model-dir {folder!r}: {CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"--model-dir {folder!r}: {CONFIG_FILE} is not a JSON object")
    name = os.path.basename(os.path.normpath(folder)) or "model"
    config = from_hf_config(data, name=name)
    return config, data


def weight_files(folder: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file (path) holding it, from the index or the single file."""
    index_path, single = os.path.join(folder, INDEX_FILE), os.path.join(folder, WEIGHTS_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelFolderError(f"--model-dir {folder!r}: {INDEX_FILE} is unreadable ({e})") from None
        files = {name: os.path.join(folder, str(file)) for name, file in weight_map.items()}
    elif os.path.isfile(single):
        try:
            with safe_open(single, framework="pt", device="cpu") as f:
                files = dict.fromkeys(f.keys(), single)
        except (SafetensorError, OSError) as e:
            raise ModelFolderError(
                f"--model-dir {folder!r}: {WEIGHTS_FILE} is not readable safetensors ({e})"
            ) from None
    else:
        others = [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth"))]
        hint = f" (found {others[0]}: only safetensors weights are read)" if others else ""
        raise ModelFolderError(f"--model-dir {folder!r} has no {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")
    return files


def _shapes(folder: str, wanted: dict[str, str], files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """The shapes of the HF tensors `wanted` (HF name -> the project tensor that needs it, for
    messages), read from the headers of the shards that hold them: every tensor is present and
    every shard readable and complete before any weight is read."""
    by_file: dict[str, list[str]] = {}
    for hf_name, needed_by in wanted.items():
        if hf_name not in files:
            raise ModelFolderError(f"--model-dir {folder!r} has no tensor {hf_name!r} (needed for {needed_by})")
        by_file.setdefault(files[hf_name], []).append(hf_name)
    shapes: dict[str, tuple[int, ...]] = {}
    for path, names in by_file.items():
        shard = os.path.basename(path)
        if not os.path.isfile(path):
            raise ModelFolderError(f"--model-dir {folder!r}: shard {shard} is missing (it holds {names[0]!r})")
        try:
            with safe_open(path, framework="pt", device="cpu") as f:  # checks the header against the file size
                present = set(f.keys())
                for hf_name in names:
                    if hf_name not in present:
                        raise ModelFolderError(f"--model-dir {folder!r}: shard {shard} has no tensor {hf_name!r}")
                    shapes[hf_name] = tuple(f.get_slice(hf_name).get_shape())
        except (SafetensorError, OSError) as e:
            raise ModelFolderError(
                f"--model-dir {folder!r}: shard {shard} is truncated or not safetensors ({e})"
            ) from None
    return shapes


def _stored_name(name: str, files: dict[str, str]) -> str:
    """`name` as the folder stores it: the original GPT-2 checkpoints were saved from the base model,
    so their tensors have no `transformer.` prefix (`h.0.attn.c_attn.weight`, `wte.weight`)."""
    prefix = "transformer."
    if name not in files and name.startswith(prefix) and name[len(prefix) :] in files:
        return name[len(prefix) :]
    return name


def _combined_shape(how: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if how == _TRANSPOSE:
        return tuple(reversed(shapes[0]))
    if how == _CONCAT:
        return (sum(s[0] for s in shapes), *shapes[0][1:]) if len({s[1:] for s in shapes}) == 1 else ()
    return shapes[0]


def load_stage_from_folder(module: StageModule, folder: str) -> int:
    """Copy this stage's tensors from the HF model folder into `module` (in place), reading only
    the tensors the stage needs; returns how many project tensors were loaded. The folder's
    config must describe `module.config` (same sizes). A tied folder gives the last stage the
    token embedding as its head weight.

    Every check (a missing shard or tensor, a truncated shard, a shape that does not fit the
    config) runs on the files' headers before any weight is read, and raises ModelFolderError with
    the module untouched. Then tensors are read and copied one at a time, each shard opened only
    for that tensor, so the memory a load needs beyond the stage's own parameters is one tensor."""
    folder_config, data = read_hf_config(folder)
    if replace(folder_config, name=module.config.name) != module.config:
        raise ModelFolderError(
            f"--model-dir {folder!r} describes another model than the stage was built for "
            f"({_sizes(folder_config)} vs {_sizes(module.config)})"
        )
    tied = is_tied(data)
    targets = module.state_dict()
    plan = {}  # local project name -> (hf names, how)
    for local in targets:
        plan[local] = _hf_sources(module.config, global_name(local, module.spec.first_layer), tied=tied)
    files = weight_files(folder)
    plan = {local: (tuple(_stored_name(n, files) for n in names), how) for local, (names, how) in plan.items()}
    wanted = {hf: local for local, (names, _) in plan.items() for hf in names}
    shapes = _shapes(folder, wanted, files)
    for local, (names, how) in plan.items():
        if _combined_shape(how, [shapes[n] for n in names]) != tuple(targets[local].shape):
            found = ", ".join(f"{n} {shapes[n]}" for n in names)
            raise ModelFolderError(
                f"--model-dir {folder!r}: {found} does not fit the sizes of its config.json "
                f"({global_name(local, module.spec.first_layer)} needs {tuple(targets[local].shape)})"
            )
    headers: dict[str, tuple[int, dict]] = {}
    with torch.no_grad():
        for local, (names, how) in plan.items():
            target = targets[local]
            try:
                if _read_stage_tensor(how, [(files[n], n) for n in names], target, headers):
                    continue
                parts = []
                for hf_name in names:
                    with safe_open(files[hf_name], framework="pt", device="cpu") as f:
                        parts.append(f.get_tensor(hf_name))
                target.copy_(from_hf_tensors(how, parts))
                del parts
            except (SafetensorError, OSError, ValueError) as e:  # checked above: only a file changed meanwhile
                raise ModelFolderError(f"--model-dir {folder!r}: reading {names[0]!r} failed ({e})") from None
    return len(plan)


_CHUNK_BYTES = 1 << 18  # what a transposed read holds at once besides the parameter


def _read_stage_tensor(
    how: str, sources: list[tuple[str, str]], target: torch.Tensor, headers: dict[str, tuple[int, dict]]
) -> bool:
    """Read one project tensor from its float32 HF tensors (`sources`: (path, name) each) straight
    into `target` (contiguous float32 on the CPU): copied whole, concatenated part by part into
    its rows, or transposed through a 256 KiB buffer, so no whole-tensor temporary is ever made
    (on `gpt2-350m` a temporary of the largest matrix, 16 MiB, set the peak). False when a source
    is another dtype or the layout is unexpected (the caller converts through a temporary)."""
    if target.dtype != torch.float32 or target.device.type != "cpu" or not target.is_contiguous():
        return False
    entries = [_f32_entry(path, name, headers) for path, name in sources]
    if any(e is None for e in entries):
        return False
    if how == _COPY:
        (path, _), (offset, nbytes) = sources[0], entries[0]
        if nbytes != target.numel() * 4:
            return False
        _read_bytes(path, offset, target)
        return True
    if how == _CONCAT:
        row_bytes = target[0].numel() * 4
        if any(nbytes % row_bytes for _, nbytes in entries) or sum(n for _, n in entries) != target.numel() * 4:
            return False
        row = 0
        for (path, _), (offset, nbytes) in zip(sources, entries):
            _read_bytes(path, offset, target[row : row + nbytes // row_bytes])
            row += nbytes // row_bytes
        return True
    # _TRANSPOSE: the file holds (in, out) row-major, `target` is (out, in)
    (path, _), (offset, nbytes) = sources[0], entries[0]
    if target.dim() != 2 or nbytes != target.numel() * 4:
        return False
    out_features, in_features = target.shape
    rows = max(1, _CHUNK_BYTES // (4 * out_features))
    buffer = torch.empty(rows, out_features)
    for first in range(0, in_features, rows):
        count = min(rows, in_features - first)
        chunk = buffer[:count]
        _read_bytes(path, offset + first * out_features * 4, chunk)
        target[:, first : first + count].copy_(chunk.t())
    return True


def _f32_entry(path: str, name: str, headers: dict[str, tuple[int, dict]]) -> tuple[int, int] | None:
    """(offset in the file, bytes) of a float32 tensor from its shard's header (read once per
    shard into `headers`); None for another dtype."""
    if path not in headers:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            headers[path] = (8 + size, json.loads(f.read(size)))
    data_start, header = headers[path]
    entry = header[name]
    begin, end = entry["data_offsets"]
    return None if entry["dtype"] != "F32" else (data_start + begin, end - begin)


def _read_bytes(path: str, offset: int, target: torch.Tensor) -> None:
    """Fill the contiguous float32 `target` with the bytes of `path` from `offset` on."""
    view = memoryview(target.numpy()).cast("B")
    with open(path, "rb") as f:
        f.seek(offset)
        if f.readinto(view) != len(view):
            raise ValueError(f"{os.path.basename(path)} ended early")


def _sizes(config: GPTConfig) -> str:
    return (
        f"{config.arch} vocab={config.vocab_size} seq_len={config.seq_len} layers={config.n_layers} "
        f"d_model={config.d_model} heads={config.n_heads} hidden={config.hidden_size}"
    )


def read_model_folder(folder: str) -> tuple[GPTConfig, StageModule]:
    """The config and the whole model (one stage holding everything) of a model folder."""
    config, _ = read_hf_config(folder)
    model = build_full_model(config)
    load_stage_from_folder(model, folder)
    return config, model


# --- writing a folder -----------------------------------------------------------------------------


def write_model_folder(
    config: GPTConfig,
    project_state: dict[str, torch.Tensor],
    out_dir: str,
    *,
    tokenizer_json: str | None = None,
    extra_meta: dict | None = None,
    overwrite: bool = False,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> str:
    """Write a Hugging Face model folder: `model.safetensors` (HF names, float32, explicit
    `lm_head.weight`), `config.json`, `generation_config.json`, `swarm.json` (the exact GPTConfig
    and `extra_meta`) and, given its path, a copy of `tokenizer.json`. Written into a temporary
    folder beside `out_dir` and renamed, so `out_dir` is complete or absent; an existing `out_dir`
    is refused unless `overwrite`. Returns `out_dir`."""
    out_dir = os.path.normpath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise ModelFolderError(f"{out_dir!r} already exists; choose another folder or pass --overwrite")
    if tokenizer_json is not None and not os.path.isfile(tokenizer_json):
        raise ModelFolderError(f"tokenizer {tokenizer_json!r}: no such file")
    expected = set(build_full_model_names(config))
    if set(project_state) != expected:
        missing = sorted(expected - set(project_state))[:3]
        extra = sorted(set(project_state) - expected)[:3]
        raise ModelFolderError(f"the state is not a whole {config.name} model (missing {missing}, unexpected {extra})")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
    try:
        tensors = {n: t.float() for n, t in to_hf_state_dict(config, project_state).items()}
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        hf_config = to_hf_config(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
        _write_json(os.path.join(tmp, CONFIG_FILE), hf_config)
        generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
        _write_json(os.path.join(tmp, "generation_config.json"), {k: v for k, v in generation.items() if v is not None})
        _write_json(os.path.join(tmp, SWARM_META_FILE), {"config": config.to_dict(), **(extra_meta or {})})
        if tokenizer_json is not None:
            shutil.copyfile(tokenizer_json, os.path.join(tmp, TOKENIZER_FILE))
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old.", dir=parent)
            os.replace(out_dir, os.path.join(old, "x"))
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def build_full_model_names(config: GPTConfig) -> list[str]:
    """The tensor names of the whole model (`build_full_model(config).state_dict()`), from a
    miniature of the same architecture and depth (names depend on nothing else)."""
    miniature = replace(config, vocab_size=2, seq_len=2, d_model=2 * config.n_heads, mlp_hidden=2)
    return list(build_full_model(miniature).state_dict())


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
