#!/usr/bin/env bash
# Collect every wheel the image installs into the build context, so that building the image
# reaches no index at all (only Debian's mirror, for python3 itself):
#
#   docker/wheelhouse.sh [cpu|cuda]       (default cpu; run from anywhere, writes <repo>/wheelhouse/<variant>/)
#
#   wheelhouse/<variant>/torch/   torch (as pinned in pyproject.toml) and its own dependencies
#   wheelhouse/<variant>/deps/    the project's other dependencies, setuptools to build it, and
#                                 requirements.txt, the list the Dockerfile installs
#
# cpu:  torch as pip's configured sources resolve it; it must be a CPU build (a "+cpu" wheel), or
#       the script stops: point pip at PyTorch's CPU wheel index (PIP_EXTRA_INDEX_URL) or put the
#       CPU wheel in a --find-links folder (PIP_FIND_LINKS).
# cuda: torch from pip's default index (PyPI's Linux torch is the CUDA build; its nvidia-* wheels
#       carry the CUDA runtime, so the image needs only the host's driver), ignoring local pip config.
#
# PYTHON (default python3) must be a Python 3.11, the image's version. Reuses a wheelhouse made
# from the same requirement list: the one in the repository, else the last one made on this machine
# (kept in SWARM_WHEELHOUSE_CACHE, default ~/.cache/swarm/wheelhouse; collecting ~330 MB anew takes
# about 20 s even from pip's cache, and a fresh clone has none).
set -euo pipefail

variant="${1:-cpu}"
case "$variant" in cpu|cuda) ;; *) echo "wheelhouse.sh: variant must be cpu or cuda, not '$variant'" >&2; exit 2 ;; esac
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
out="$repo/wheelhouse/$variant"

"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
    { echo "wheelhouse.sh: $python is not Python 3.11 (the image's); set PYTHON" >&2; exit 2; }

# The project's runtime dependencies and build backend, read from pyproject.toml (one line each).
requirements=$("$python" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
for requirement in project["project"]["dependencies"] + project["build-system"]["requires"]:
    print(requirement)
PY
)
torch_requirement=$(grep -E '^torch([=<>!~ ]|$)' <<<"$requirements") ||
    { echo "wheelhouse.sh: pyproject.toml does not depend on torch" >&2; exit 2; }

if [[ -f "$out/deps/requirements.txt" ]] && [[ "$(cat "$out/deps/requirements.txt")" == "$requirements" ]]; then
    echo "wheelhouse.sh: $out is up to date"
    exit 0
fi
rm -rf "$out"
cache="${SWARM_WHEELHOUSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/swarm/wheelhouse}/$variant"
if [[ -f "$cache/deps/requirements.txt" ]] && [[ "$(cat "$cache/deps/requirements.txt")" == "$requirements" ]]; then
    mkdir -p "$(dirname "$out")"
    cp -al "$cache" "$out" 2>/dev/null || { rm -rf "$out"; cp -a "$cache" "$out"; }  # hard links where it can
    echo "wheelhouse.sh: $out from $cache (same requirements)"
    exit 0
fi
mkdir -p "$out/torch" "$out/deps"

pip_args=(--disable-pip-version-check --quiet)
[[ "$variant" == cuda ]] && pip_args=(--isolated "${pip_args[@]}")

"$python" -m pip "${pip_args[@]}" wheel --wheel-dir "$out/torch" "$torch_requirement"
torch_wheel=$(cd "$out/torch" && ls torch-*.whl)
if [[ "$variant" == cpu && "$torch_wheel" != *+cpu* ]]; then
    echo "wheelhouse.sh: pip resolved $torch_wheel, not a CPU build (+cpu); see the top of this script" >&2
    exit 1
fi
torch_version=$(cut -d- -f2 <<<"$torch_wheel")

# The rest, with torch held to the wheel just collected; files already in torch/ are not repeated.
"$python" -m pip "${pip_args[@]}" wheel --wheel-dir "$out/deps" --find-links "$out/torch" \
    --constraint <(echo "torch==$torch_version") $(grep -v -E '^torch([=<>!~ ]|$)' <<<"$requirements")
for wheel in "$out"/torch/*.whl; do
    rm -f "$out/deps/$(basename "$wheel")"
done
echo "$requirements" > "$out/deps/requirements.txt"
# Kept for the next clone; swapped in whole, so a cache is never half-written.
if mkdir -p "$(dirname "$cache")" 2>/dev/null; then
    rm -rf "$cache.partial"
    if { cp -al "$out" "$cache.partial" 2>/dev/null || { rm -rf "$cache.partial"; cp -a "$out" "$cache.partial"; }; }; then
        rm -rf "$cache" && mv "$cache.partial" "$cache"
    fi
fi
echo "wheelhouse.sh: $torch_wheel and $(ls "$out/deps" | grep -c '\.whl$') other wheels in $out ($(du -sh "$out" | cut -f1))"
