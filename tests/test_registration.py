"""Registration with peft, including the enum extension that relies on peft internals."""

from __future__ import annotations

import importlib
import inspect

import peft
import pytest
from peft import PeftConfig
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils import PeftType

import peft_graft
from peft_graft import GraftConfig, GraftModel
from peft_graft._peft_compat import extend_peft_type


def test_peft_enum_internals_we_rely_on_are_still_there():
    # If this fails, peft changed how PeftType stores its members: update peft_graft/_peft_compat.py.
    assert isinstance(PeftType._member_map_, dict)
    assert isinstance(PeftType._value2member_map_, dict)
    assert isinstance(PeftType._member_names_, list)
    assert issubclass(PeftType, str)


def test_every_wrapped_library_method_is_wrapped_once():
    # If this fails, peft or transformers renamed or moved a method peft_graft wraps: update tuner/wrappers.py.
    from peft_graft.tuner.wrappers import method_wrappers

    importlib.reload(peft_graft)
    for owner, name, _ in method_wrappers():
        method = inspect.getattr_static(owner, name)
        function = method.__func__ if isinstance(method, classmethod) else method
        assert getattr(function, "_peft_graft_wrapper", False), f"{owner.__name__}.{name}"
        assert not getattr(function.__wrapped__, "_peft_graft_wrapper", False), f"{owner.__name__}.{name} twice"


def test_graft_is_a_full_peft_type():
    assert PeftType.GRAFT is PeftType["GRAFT"] is PeftType("GRAFT")
    assert PeftType.GRAFT.value.lower() == "graft"  # what transformers' adapter code calls
    assert "GRAFT" in list(PeftType)
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.GRAFT] is GraftConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING[PeftType.GRAFT] is GraftModel
    assert PEFT_TYPE_TO_PREFIX_MAPPING[PeftType.GRAFT] == "graft_" == GraftModel.prefix
    assert GraftConfig().peft_type is PeftType.GRAFT


def test_extending_the_enum_is_idempotent():
    name = "GRAFT_TEST_ONLY"
    try:
        first = extend_peft_type(name)
        assert extend_peft_type(name) is first
        assert PeftType(name) is first and list(PeftType).count(first) == 1
    finally:
        PeftType._member_map_.pop(name, None)
        PeftType._value2member_map_.pop(name, None)
        if name in PeftType._member_names_:
            PeftType._member_names_.remove(name)
        type.__delattr__(PeftType, name)


def test_import_twice_and_reload_are_harmless(tmp_path):
    members = len(PeftType.__members__)
    importlib.reload(peft_graft)
    importlib.reload(peft_graft)
    peft_graft.register()
    assert len(PeftType.__members__) == members
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.GRAFT] is peft_graft.GraftConfig
    GraftConfig(sparsity=1e-3).save_pretrained(tmp_path)
    assert isinstance(PeftConfig.from_pretrained(tmp_path), peft_graft.GraftConfig)


def test_saved_config_is_plain_json_without_runtime_objects(tmp_path):
    config = GraftConfig(finetuned={"weight": object()}, sparsity=1e-3)
    config.save_pretrained(tmp_path)
    text = (tmp_path / "adapter_config.json").read_text()
    assert '"peft_type": "GRAFT"' in text and 'finetuned"' not in text and "object at" not in text


def test_peft_version_is_the_tested_one():
    assert peft.__version__.startswith("0.21"), "peft_graft pins peft 0.21.x; re-test the registration on upgrade"


@pytest.mark.parametrize("name", ["graft"])
def test_registering_the_method_twice_through_peft_raises(name):
    from peft.utils import register_peft_method

    with pytest.raises(KeyError):
        register_peft_method(name=name, config_cls=GraftConfig, model_cls=GraftModel, prefix="graft_")
