"""The name registry every choice by name goes through: loud on unknown names, lazy imports."""

from __future__ import annotations

import pytest

from rlserve.registry import Registry, import_object


def test_unknown_name_fails_listing_the_valid_ones():
    colours = Registry("colour", {"red": 1, "blue": 2})
    assert colours.names == ("red", "blue") and colours["blue"] == 2
    with pytest.raises(ValueError, match="unknown colour 'green'; valid: red, blue"):
        colours["green"]


def test_import_object_resolves_module_colon_attribute():
    assert import_object("rlserve.registry:Registry") is Registry
    with pytest.raises(AttributeError):
        import_object("rlserve.registry:Nothing")
