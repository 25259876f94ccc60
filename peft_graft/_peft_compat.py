"""The places where peft_graft touches peft and transformers internals: peft's ``PeftType`` enum, and methods.

peft's ``register_peft_method`` only accepts a name that is already a member of its ``PeftType`` enum, and a package
outside peft cannot add one through any public API: :func:`extend_peft_type` inserts the member into the enum's
internal maps. Neither library offers a hook around saving, loading or uploading an adapter, or around reading a saved
config: :func:`wrap_method` replaces a method or class method by a wrapper of it, once (the list:
``tuner/wrappers.py``). Nothing here knows about grafts: the package passes its classes and wrappers in.
``tests/test_registration.py`` fails loudly if these internals change.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from peft.utils import PeftType
from peft.utils import register_peft_method as _peft_register_peft_method

_WRAPPED = "_peft_graft_wrapper"


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


def register_peft_method(name: str, config_cls: type, model_cls: type, prefix: str) -> PeftType:
    """Register a method outside peft: enum member, config class, tuner class and key prefix.

    Safe to call any number of times, including after ``importlib.reload``: the classes given last win.
    """
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    peft_type = extend_peft_type(name.upper())
    if peft_type in PEFT_TYPE_TO_CONFIG_MAPPING:
        PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = config_cls
        PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = model_cls
        PEFT_TYPE_TO_PREFIX_MAPPING[peft_type] = prefix
    else:
        _peft_register_peft_method(name=name, config_cls=config_cls, model_cls=model_cls, prefix=prefix)
    return peft_type


def wrap_method(owner: type | ModuleType, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.<name>`` (a method or class method, where ``owner`` or a base class defines it; or a module's
    function) by ``make_wrapper(original function)`` unless a wrapper is already installed."""
    defining = owner if isinstance(owner, ModuleType) else next(cls for cls in owner.__mro__ if name in vars(cls))
    attribute = vars(defining)[name]
    is_classmethod = isinstance(attribute, classmethod)
    original = attribute.__func__ if is_classmethod else attribute
    if getattr(original, _WRAPPED, False):
        return
    wrapper = make_wrapper(original)
    setattr(wrapper, _WRAPPED, True)
    setattr(defining, name, classmethod(wrapper) if is_classmethod else wrapper)
