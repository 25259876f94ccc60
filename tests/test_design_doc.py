"""docs/design.md names the code of every forward path and every piece of a graft's state as `file:name` (issue 58):
each name must exist there, so the page cannot silently point at code that was renamed or removed."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
REFERENCE = re.compile(r"`(peft_graft/[\w/]+\.py):([\w.]+)`")


def references() -> list[tuple[str, str]]:
    return sorted(set(REFERENCE.findall(DESIGN.read_text())))


def resolves(path: str, name: str) -> bool:
    """Whether ``name`` (``Class.method``, ``function``, ``CONSTANT`` or ``Class.attribute``) exists in the module at
    ``path``. An attribute counts when the class has it, declares it as a dataclass field, or sets it on ``self``
    in its own source, or registers it as a buffer or parameter (instance attributes made in ``__init__``)."""
    owner = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    *parents, last = name.split(".")
    for part in parents:
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    if hasattr(owner, last):
        return True
    if not inspect.isclass(owner):
        return False
    if dataclasses.is_dataclass(owner) and last in {field.name for field in dataclasses.fields(owner)}:
        return True
    source = inspect.getsource(owner)
    assigned = re.search(rf"\bself\.{re.escape(last)}\s*(:[^=]*)?=", source)
    registered = re.search(rf"self\.register_(buffer|parameter)\(\s*[\"']{re.escape(last)}[\"']", source)
    return assigned is not None or registered is not None


def test_the_design_page_names_code():
    assert len(references()) >= 40, "docs/design.md should name the code of each path and piece of state"


@pytest.mark.parametrize(("path", "name"), references(), ids=lambda value: str(value))
def test_every_named_function_exists(path, name):
    assert (ROOT / path).is_file(), f"docs/design.md names {path}, which does not exist"
    assert resolves(path, name), f"docs/design.md names {path}:{name}, which {path} does not define"


def test_a_wrong_name_is_caught():
    assert not resolves("peft_graft/tuner/layer.py", "GraftLayer.no_such_method")
    assert not resolves("peft_graft/tuner/layer.py", "no_such_function")
    assert resolves("peft_graft/tuner/layer.py", "GraftLayer.graft_indices")  # set in __init__
