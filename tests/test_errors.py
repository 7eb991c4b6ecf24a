"""paratrain's errors end with the address of their family's troubleshooting section, and every
such section exists on the page."""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import paratrain
from paratrain import errors
from paratrain.errors import DOCS_URL, ParatrainError, RemoteError, troubleshooting_url

PAGE = Path(__file__).parent.parent / "docs" / "troubleshooting.md"


def _families() -> list[type[ParatrainError]]:
    """Every ParatrainError subclass, once every module of the package (wherever a layer defines its
    family) is imported; a module whose optional dependency is missing is skipped."""
    for module in pkgutil.walk_packages(paratrain.__path__, "paratrain."):
        with contextlib.suppress(ImportError):
            importlib.import_module(module.name)
    found, todo = [], [ParatrainError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_anchor_errors_point_to_is_a_section_of_the_troubleshooting_page():
    anchors = set(re.findall(r"\{#([a-z-]+)\}", PAGE.read_text()))
    assert set(errors.ANCHORS.values()) <= anchors, set(errors.ANCHORS.values()) - anchors
    named = {cls.__name__ for cls in _families()}
    assert set(errors.ANCHORS) <= named, set(errors.ANCHORS) - named  # no stale class names


@pytest.mark.parametrize("cls", _families(), ids=lambda cls: cls.__name__)
def test_every_error_family_ends_with_its_troubleshooting_link(cls):
    if cls is errors.MissingExtraError:
        error = cls("ray", "ray", "paratrain launch --backend ray")
    else:
        error = cls.__new__(cls)
        Exception.__init__(error, "what went wrong")
    text = str(error)
    assert text.endswith(f"(see {troubleshooting_url(cls)})"), text
    assert "#" in troubleshooting_url(cls), f"{cls.__name__} has no section of its own"
    assert text.startswith("what went wrong") or cls is errors.MissingExtraError


def test_a_peers_error_keeps_its_own_link_once_and_an_empty_message_is_the_link():
    carried = RemoteError(str(errors.KVStoreError("unknown key 'w'")))
    assert str(carried).count(DOCS_URL) == 1 and str(carried).endswith("#kvstore)")
    assert str(errors.TransportError()) == f"see {DOCS_URL}troubleshooting/#transport"


def test_the_link_is_on_the_messages_one_line_so_the_launchers_report_keeps_it():
    # The launcher reports an exception by its last traceback line: the link must not start a new one.
    assert "\n" not in str(errors.JobAbortedError("worker 1 died"))
