"""The installed software version, announced in every peer record and metric."""

from __future__ import annotations

from importlib import metadata


def software_version() -> str:
    try:
        return metadata.version("swarm-train")
    except metadata.PackageNotFoundError:
        return "dev"
