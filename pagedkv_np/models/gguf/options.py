"""The options of a GGUF import, checked, and how they name a cached folder.

:func:`~pagedkv_np.models.gguf.importer.import_gguf` documents what each
option does; a cached folder's name carries :attr:`ImportOptions.tag` and
:data:`FORMAT_VERSION`, so a folder built by an older layout is rebuilt,
not served.
"""

from __future__ import annotations

import dataclasses
import os

from ...errors import ConfigError

__all__ = ["WEIGHT_MODES", "FAMILIES", "FORMAT_VERSION", "DEFAULT_MAX_CONTEXT",
           "DEFAULT_HEAD_ACCURACY_LEVEL", "ImportOptions"]

WEIGHT_MODES = ("q4", "float32", "float16")
FAMILIES = ("gqa", "optimum")
#: bump when the folder's contents for the same file change (5: num_logits_to_keep
#: a plain input, the embedding and a tied head kept in blocks; 6: the head's
#: default level 0, so that no folder of 5 named as the default is served; 7: packed
#: Q/K/V and gate/up weights, one-node RMSNorms; 8: a 5-8-bit head in lm_head.npz,
#: run by the engine; 9: the geometry in the graph's metadata, for the engine's
#: own decode step)
FORMAT_VERSION = 10
#: positions served (and RoPE table rows) unless ``max_context`` says otherwise
DEFAULT_MAX_CONTEXT = 8192
#: the LM head's MatMulNBits accuracy level unless told (see import_gguf):
#: None, the import's ``accuracy_level``
DEFAULT_HEAD_ACCURACY_LEVEL: int | None = None


@dataclasses.dataclass(frozen=True)
class ImportOptions:
    """How a GGUF file is imported (:func:`~pagedkv_np.models.gguf.importer.import_gguf`
    documents each option); checked when made."""

    weights: str
    family: str
    accuracy_level: int
    max_context: int = DEFAULT_MAX_CONTEXT
    head_accuracy_level: int | None = DEFAULT_HEAD_ACCURACY_LEVEL

    def __post_init__(self) -> None:
        if self.head_accuracy_level is None:       # the head follows the other matrices
            object.__setattr__(self, "head_accuracy_level", self.accuracy_level)
        if isinstance(self.max_context, bool) or not isinstance(self.max_context, int) \
                or self.max_context < 1:
            raise ConfigError(f"Invalid max_context: expected a positive int, "
                              f"got {self.max_context!r}")
        if self.weights not in WEIGHT_MODES:
            raise ConfigError(f"Invalid weights: expected one of {WEIGHT_MODES}, "
                              f"got {self.weights!r}")
        if self.family not in FAMILIES:
            raise ConfigError(f"Invalid family: expected one of {FAMILIES}, "
                              f"got {self.family!r}")
        for what in ("accuracy_level", "head_accuracy_level"):
            if getattr(self, what) not in (0, 4):
                raise ConfigError(f"Invalid {what}: expected 0 or 4, "
                                  f"got {getattr(self, what)!r}")

    @property
    def head_level(self) -> int:
        """The LM head's accuracy level, resolved (``head_accuracy_level``, or
        ``accuracy_level`` where that is None)."""
        level = self.head_accuracy_level
        return self.accuracy_level if level is None else level

    @property
    def tag(self) -> str:
        """How the options appear in a cache folder's name."""
        acc = f"-acc{self.accuracy_level}" if self.accuracy_level else ""
        if self.head_level != self.accuracy_level:
            acc += f"-head{self.head_level}"
        return f"{self.weights}{acc}-{self.family}-ctx{self.max_context}"

    def provenance(self, path: str) -> dict:
        return {"source": os.path.basename(path), "weights": self.weights,
                "family": self.family, "accuracy_level": self.accuracy_level,
                "head_accuracy_level": self.head_accuracy_level,
                "format_version": FORMAT_VERSION}
