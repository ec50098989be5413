"""Value checks of option dataclasses, run in their ``__post_init__`` (as peft's configs do).

An options dataclass inherits :class:`CheckedOptions` and declares ``rules``: field → the name of
a rule in :data:`serve_bridge.values.RULES`, or a tuple of the allowed values. Construction checks
every rule of the class and of its bases, whether the options come from Python or from Hydra
(``OmegaConf.to_object`` runs ``__post_init__``); the first broken one raises an
:class:`~serve_bridge.values.OptionError`. Hydra checks the types while composing; these are the
ranges. The rules are those every other command checks its arguments with.
"""
from __future__ import annotations

from typing import Any, ClassVar

from serve_bridge.values import check


class CheckedOptions:
    """Base of an options dataclass whose ``rules`` (with its bases') are checked on construction."""

    rules: ClassVar[dict[str, str | tuple[Any, ...]]] = {}

    def __post_init__(self) -> None:
        for cls in reversed(type(self).__mro__):
            check(self, vars(cls).get("rules", {}))
