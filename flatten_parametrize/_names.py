"""Names the library adds to modules and state dicts, in one place."""

from __future__ import annotations

#: Attribute (in ``module.__dict__``) of the module that owns a storage.
STORAGE_ATTR = "_flat_storage"
#: Attribute (in ``module.__dict__``) of every module the library changed.
MODULE_STATE_ATTR = "_flat_parametrize"
#: Prefix of the flat parameters registered on the module.
FLAT_PARAM_PREFIX = "flat_param_"
#: Prefix of the layout records in a flat state dict.
FLAT_LAYOUT_PREFIX = "flat_layout_"


def flat_param_name(group: str) -> str:
    """Return the attribute name of ``group``'s flat parameter."""
    return FLAT_PARAM_PREFIX + group


def flat_layout_name(group: str) -> str:
    """Return the state-dict key of ``group``'s layout record."""
    return FLAT_LAYOUT_PREFIX + group
