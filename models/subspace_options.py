"""The subspace options as a config section: `--subspace-rank K` and `--subspace-kind fixed|learned`.

Every process that builds or names the model (`swarm peer`, `swarm train`, `swarm demo`,
`swarm eval`, `swarm export`) carries this one section, so the flags, their `SWARM_*` variables
and their help are written once. The options are part of the model (models/subspace.py: what
crosses between stages is K coefficients per token, not d_model values), so they enter the config
and with it the fingerprint peers announce: a peer or trainer with other options is refused.
"""

from __future__ import annotations

import dataclasses

from models.config import GPTConfig
from process.config import ConfigError, option

SUBSPACE_KINDS = ("fixed", "learned")


@dataclasses.dataclass(kw_only=True)
class SubspaceSettings:
    subspace_rank: int = option(
        0,
        help="K > 0: only K coefficients per token cross between stages, forward and backward (a subspace "
        "model, models/subspace.py); 0 = off. Every peer and the trainer of a swarm must use the same",
    )
    subspace_kind: str = option(
        "fixed",
        help="fixed: block outputs constrained to one shared basis (exports to transformers); learned: a trained "
        "orthonormal projection at each stage boundary with token anchors (the project's own loader only)",
        choices=SUBSPACE_KINDS,
    )

    def __post_init__(self) -> None:
        if self.subspace_rank < 0:
            raise ConfigError(f"--subspace-rank {self.subspace_rank}: use 0 (off) or a positive rank")
        if self.subspace_kind not in SUBSPACE_KINDS:
            raise ConfigError(f"--subspace-kind {self.subspace_kind!r}: use one of {', '.join(SUBSPACE_KINDS)}")

    def apply(self, config: GPTConfig) -> GPTConfig:
        """`config` with these options; ConfigError (one line) when the model cannot take them."""
        if self.subspace_rank == 0:
            return config
        try:
            return dataclasses.replace(config, subspace_rank=self.subspace_rank, subspace_kind=self.subspace_kind)
        except ValueError as e:
            raise ConfigError(
                f"--subspace-rank {self.subspace_rank} --subspace-kind {self.subspace_kind}: {e}"
            ) from None

    def args(self) -> list[str]:
        """The flags that give another process these options (what `swarm demo` passes on)."""
        if self.subspace_rank == 0:
            return []
        return ["--subspace-rank", str(self.subspace_rank), "--subspace-kind", self.subspace_kind]
