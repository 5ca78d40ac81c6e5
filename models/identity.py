"""What makes two peers' models the same model: a short fingerprint of the resolved config (sizes,
vocabulary, architecture) and, for a user-defined architecture, of the code that builds it.

Peers announce it with their stage records (dht/records.py `PeerRecord.model_hash`); a peer or
trainer whose fingerprint differs from the swarm's is refused in one line, so that peers of
different models never mix under one model name.
"""

from __future__ import annotations

import hashlib
import json

from models.config import GPTConfig

FINGERPRINT_CHARS = 16


def model_fingerprint(config: GPTConfig, *, code_hash: str = "") -> str:
    """Hex digest of everything that changes what the model computes: every field of `config`
    except its display name, plus `code_hash` (the hash of a user architecture's definition). The
    subspace options (rank, kind) enter only when compression is on."""
    fields = {k: v for k, v in config.to_dict().items() if k != "name"}
    if not config.subspace_rank:  # off: the fingerprint of a model from before the option existed
        del fields["subspace_rank"], fields["subspace_kind"]
    payload = json.dumps({"config": fields, "code": code_hash}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:FINGERPRINT_CHARS]
