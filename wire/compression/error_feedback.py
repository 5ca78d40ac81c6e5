"""Error feedback: what a lossy codec dropped from a gradient is added to the next one.

For each key (e.g. ``(link, micro_batch_slot)``) the compressor keeps the residual
``r = (x + r_prev) - decode(encode(x + r_prev))``. Over many steps the sum of what was sent tracks
the sum of the true gradients (the error stays bounded by one residual instead of growing), which
is what lets top-k with a small fraction still converge.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from wire.compression import registry
from wire.compression.base import Codec, EncodedTensor


class ErrorFeedback:
    """Residuals per key. Residuals are dropped (not applied) when the shape changes or when they
    become non-finite, so a single nan gradient cannot poison every later step."""

    def __init__(self) -> None:
        self._residuals: dict[Hashable, torch.Tensor] = {}
        self._lock = threading.Lock()  # guards the dict; one key is compressed by one caller at a time

    def compress(self, key: Hashable, tensor: torch.Tensor, codec: Codec) -> EncodedTensor:
        """Encode ``tensor`` plus the stored residual for ``key``, and store the new residual."""
        if not tensor.is_floating_point():
            return codec.encode(tensor)
        with self._lock:
            residual = self._residuals.pop(key, None)
        compute_dtype = torch.promote_types(tensor.dtype, torch.float32)
        corrected = tensor.detach().cpu().to(compute_dtype, copy=True)  # never alias the caller's tensor
        if residual is not None and residual.shape == corrected.shape:
            corrected += residual
        encoded = codec.encode(corrected.to(tensor.dtype))
        new_residual = corrected.sub_(registry.decode(encoded).to(compute_dtype))
        if bool(torch.isfinite(new_residual).all()):
            with self._lock:
                self._residuals[key] = new_residual
        return encoded

    def restore(self, key: Hashable, undelivered: torch.Tensor) -> None:
        """Add ``undelivered`` (what ``compress`` encoded for ``key`` but never reached its receivers,
        decoded) back into the residual, so that the next ``compress`` of ``key`` sends it."""
        if not undelivered.is_floating_point():
            return
        compute_dtype = torch.promote_types(undelivered.dtype, torch.float32)
        with self._lock:
            residual = self._residuals.get(key)
            added = undelivered.detach().cpu().to(compute_dtype, copy=True)
            if residual is not None and residual.shape == added.shape:
                added += residual
            if bool(torch.isfinite(added).all()):
                self._residuals[key] = added

    def residual_norm(self, key: Hashable) -> float:
        """L2 norm of the stored residual for ``key`` (0.0 when there is none)."""
        with self._lock:
            residual = self._residuals.get(key)
        return 0.0 if residual is None else float(residual.norm())

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of ``key``, or every residual when ``key`` is None."""
        with self._lock:
            if key is None:
                self._residuals.clear()
            else:
                self._residuals.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._residuals)
