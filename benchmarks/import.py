"""Loading one stage of a Hugging Face model folder against loading the whole model (issue #28).

Makes a `gpt2-350m`-shaped GPT-2 folder with random weights (GPT-2's layout: one
`model.safetensors`, head tied to the embedding, tanh GELU; written with safetensors directly,
nothing downloaded), then measures in fresh subprocesses, one at a time:

- `stage i/N`: what a peer does at start-up: build stage i of N (`models.stages.build_stage`) and
  load its tensors from the folder (`models.hf_format.load_stage_from_folder`);
- `whole`: build the whole model in one process and load every tensor (`read_model_folder`);
- `mem i/N`: stage i of the split that balances the stages' parameters (what each holds in memory),
  `balanced_split` over parameter counts in place of seconds: the end stages, which hold the
  vocabulary matrices, get fewer blocks: what a peer gets with `--split-boundaries memory`.

Each child reports the seconds from before building to loaded, its peak RSS (VmHWM) and its
RSS after the imports (what torch alone costs). The file is read once before timing, so every run
finds it in the page cache (a cold disk read is not measured).

    .venv/bin/python benchmarks/import.py --out benchmarks/out/import.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402

MODEL = "gpt2-350m"


def _status_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process. Not ru_maxrss: Linux carries it over from the
    parent across fork and exec, so a child would report its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make_folder(folder: str) -> None:
    """A GPT-2-layout folder of MODEL's shape with random weights (tied head: no lm_head.weight)."""
    import dataclasses

    from safetensors.torch import save_file

    from models.config import get_model_config
    from models.hf_format import to_hf_config, to_hf_state_dict
    from models.stages import build_full_model

    config = dataclasses.replace(get_model_config(MODEL), activation="gelu_tanh")  # GPT-2's GELU
    model = build_full_model(config, seed=0)
    tensors = to_hf_state_dict(config, model.state_dict())
    del model
    tensors.pop("lm_head.weight")  # tied, as GPT-2 checkpoints are
    hf_config = to_hf_config(config) | {"tie_word_embeddings": True}
    os.makedirs(folder + ".tmp", exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder + ".tmp", "model.safetensors"))
    with open(os.path.join(folder + ".tmp", "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    del tensors
    os.replace(folder + ".tmp", folder)


def memory_balanced_boundaries(num_stages: int) -> tuple[int, ...]:
    """The split of MODEL a peer gets with `--split-boundaries memory` (stages holding as equal a
    share of the parameters as blocks allow)."""
    from models.balanced_split import memory_balanced_boundaries as balanced
    from models.config import get_model_config

    config = get_model_config(MODEL)
    return balanced(
        block_parameters=config.block_parameters(),
        n_layers=config.n_layers,
        embedding_parameters=config.embedding_parameters(),
        head_parameters=config.head_parameters(),
        num_stages=num_stages,
    )


def child(folder: str, what: str, num_stages: int) -> dict:
    import torch

    from models.hf_format import load_stage_from_folder, read_hf_config, read_model_folder
    from models.stages import build_stage

    torch.set_num_threads(1)
    after_imports = _status_mib("VmRSS")
    started = time.perf_counter()
    if what == "whole":
        _, module = read_model_folder(folder)
    else:
        config, _ = read_hf_config(folder)
        balanced = what.startswith("mem")
        boundaries = memory_balanced_boundaries(num_stages) if balanced else None
        module = build_stage(config, int(what.removeprefix("mem")), num_stages, boundaries=boundaries)
        load_stage_from_folder(module, folder)
    seconds = time.perf_counter() - started
    parameters = sum(p.numel() for p in module.parameters())
    peak = _status_mib("VmHWM")
    return {
        "what": what,
        "seconds": seconds,
        "peak_rss_mib": peak,
        "rss_after_imports_mib": after_imports,
        "parameters": parameters,
    }


def run_child(folder: str, what: str, num_stages: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", what, "--folder", folder, "--num-stages", str(num_stages)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default="benchmarks/out/gpt2-350m-random")
    parser.add_argument("--num-stages", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case (median time, max peak RSS)")
    parser.add_argument("--out", default="benchmarks/out/import.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.folder, args.child, args.num_stages)))
        return

    if not os.path.isdir(args.folder):
        print(f"making {args.folder} ({MODEL} shape, random weights)...", flush=True)
        make_folder(args.folder)
    weights = os.path.join(args.folder, "model.safetensors")
    with open(weights, "rb") as f:  # into the page cache: every run reads it warm
        while f.read(1 << 24):
            pass
    boundaries = memory_balanced_boundaries(args.num_stages)
    cases = ["whole", *(str(i) for i in range(args.num_stages)), *(f"mem{i}" for i in range(args.num_stages))]
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    for _ in range(args.repeats):
        for case in cases:  # interleaved, so a change in machine load spreads over every case
            result = run_child(args.folder, case, args.num_stages)
            runs[case].append(result)
            print(json.dumps(result), flush=True)
    summary = {}
    for case, results in runs.items():
        summary[case] = {
            "seconds_median": statistics.median(r["seconds"] for r in results),
            "peak_rss_mib_max": max(r["peak_rss_mib"] for r in results),
            "rss_after_imports_mib": statistics.median(r["rss_after_imports_mib"] for r in results),
            "parameters": results[0]["parameters"],
        }
    whole = summary["whole"]
    for case in cases[1:]:
        s = summary[case]
        s["seconds_ratio"] = s["seconds_median"] / whole["seconds_median"]
        s["peak_rss_ratio"] = s["peak_rss_mib_max"] / whole["peak_rss_mib_max"]
    report = {
        "model": MODEL,
        "folder_bytes": os.path.getsize(weights),
        "num_stages": args.num_stages,
        "memory_balanced_boundaries": list(boundaries),
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "summary": summary,
        "runs": runs,
    }
    write_report(args.out, report)
    print(f"memory-balanced split: --split-boundaries memory ({','.join(map(str, boundaries))})")
    print(f"{'case':>8} {'params':>8} {'seconds':>8} {'peak MiB':>9} {'time ratio':>10} {'RSS ratio':>9}")
    for case, s in summary.items():
        print(
            f"{case:>8} {s['parameters'] / 1e6:7.1f}M {s['seconds_median']:8.2f} {s['peak_rss_mib_max']:9.0f} "
            f"{s.get('seconds_ratio', 1.0):10.2f} {s.get('peak_rss_ratio', 1.0):9.2f}"
        )


if __name__ == "__main__":
    main()
