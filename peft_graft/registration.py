"""Make ``graft`` a peft method.

peft's ``register_peft_method`` only accepts a name that is already a member of its ``PeftType`` enum, and a
package outside peft cannot add one through any public API. :func:`extend_peft_type` therefore inserts the
member into the enum's internal maps. This is the one place that touches peft internals for registration;
``tests/test_registration.py`` fails loudly if they change.
"""

from __future__ import annotations

from peft.utils import PeftType, register_peft_method

GRAFT_NAME = "graft"
GRAFT_PREFIX = "graft_"


def extend_peft_type(name: str) -> PeftType:
    """Return ``PeftType[name]``, adding it to the enum first if needed (idempotent)."""
    if name in PeftType.__members__:
        return PeftType[name]
    member = str.__new__(PeftType, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = PeftType
    member.__init__(name)
    PeftType._member_map_[name] = member
    PeftType._value2member_map_[name] = member
    PeftType._member_names_.append(name)
    # EnumType.__setattr__ refuses to add members; the member must still be reachable as ``PeftType.NAME``.
    type.__setattr__(PeftType, name, member)
    return member


def register() -> PeftType:
    """Register the ``graft`` method with peft: enum member, config class, tuner class and key prefix.

    Safe to call any number of times, including after ``importlib.reload`` of this package.
    """
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    from .config import GraftConfig
    from .model import GraftModel

    peft_type = extend_peft_type(GRAFT_NAME.upper())
    if peft_type in PEFT_TYPE_TO_CONFIG_MAPPING:
        # Already registered (import twice or reload): refresh the classes so a reloaded module's classes win.
        _refresh_mappings(peft_type, GraftConfig, GraftModel)
    else:
        register_peft_method(name=GRAFT_NAME, config_cls=GraftConfig, model_cls=GraftModel, prefix=GRAFT_PREFIX)
    return peft_type


def _refresh_mappings(peft_type: PeftType, config_cls: type, model_cls: type) -> None:
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = config_cls
    PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = model_cls
    PEFT_TYPE_TO_PREFIX_MAPPING[peft_type] = GRAFT_PREFIX
