"""The one bounded reader of outside JSON and TOML (nvcontainer/documents.py), and the readers
that go through it: size at the bound and one past, nesting at the bound and one past, garbage
after a valid document, and every failure one line, never RecursionError or int()'s
ValueError. Pure, but for the files its callers read."""

from __future__ import annotations

import json
import time

import pytest

from nvcontainer import documents
from nvcontainer.cdi import store
from nvcontainer.config import load
from nvcontainer.dra import checkpoint, claimspec
from nvcontainer.errors import NvcError


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_json_at_the_bounds_and_one_past():
    assert documents.json_value(nested(64), "d", cap=1000) is not None
    with pytest.raises(NvcError, match="^input error: d: JSON nested deeper than 64 levels$"):
        documents.json_value(nested(65), "d", cap=1000)
    assert documents.json_value('{"a": "' + "[" * 500 + '"}', "d", cap=1000) == {"a": "[" * 500}   # in a string
    text = json.dumps({"k": "x" * 90})
    assert documents.json_value(text, "d", cap=len(text)) == {"k": "x" * 90}
    with pytest.raises(NvcError, match=f"d: larger than {len(text) - 1} bytes"):
        documents.json_value(text, "d", cap=len(text) - 1)


@pytest.mark.parametrize("data, message", [
    (nested(100_000), "JSON nested deeper than 64 levels"),
    ('{"a": 1} {"b": 2}', "invalid JSON: Extra data"),
    ('{"a": 1}garbage', "invalid JSON: Extra data"),
    ('{"a": ' + "9" * 5000 + "}", "invalid JSON: Exceeds the limit"),
    (b'{"a": "\xff"}', "not UTF-8"),
    ("", "invalid JSON"),
    (None, "expected bytes"),
])
def test_json_failures_are_one_line(data, message):
    with pytest.raises(NvcError) as err:
        documents.json_value(data, "d", cap=1 << 20, category="kubernetes")
    assert err.value.category == "kubernetes" and message in err.value.detail and "\n" not in str(err.value)


def timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


@pytest.mark.parametrize("text, message", [
    (nested(200_000), "nested deeper than 64"),
    ("[" + ",".join([nested(65)] * 23_000) + "]", "nested deeper than 64"),
    ('{"a": "' + '\\"[' * 1_000_000, "Unterminated string"),
])
def test_deep_json_is_refused_in_little_time(text, message):
    """Refused before it is parsed, in passes linear on any text: 3 MiB of nests one level too
    deep (a pass per level took seconds, and parsing them builds a million lists), a string
    never closed over a million escaped quotes (a pattern that may fail backtracks)."""
    def refuse():
        with pytest.raises(NvcError, match=message):
            documents.json_value(text, "d", cap=3 << 20)
    assert timed(refuse) < 1.5


def test_many_brackets_none_too_deep_are_read():
    wide = "[" + ",".join([nested(60)] * 3000) + "]"
    assert len(documents.json_value(wide, "d", cap=1 << 20)) == 3000


def test_toml_at_the_bounds_and_one_past():
    at = "a = " + nested(63)         # the document's own table is a level
    assert documents.toml_value(at, "t", cap=1000)["a"] is not None
    for past in ("a = " + nested(64), "[" + ".".join(["k"] * 64) + "]\n", "a = " + "[" * 100_000):
        with pytest.raises(NvcError, match="t: nested deeper than 64 levels"):
            documents.toml_value(past, "t", cap=1 << 20, category="config")
    assert documents.toml_value("a = 12345", "t", cap=9) == {"a": 12345}
    with pytest.raises(NvcError, match="t: larger than 9 bytes"):
        documents.toml_value("a = 123456", "t", cap=9)
    with pytest.raises(NvcError, match="t: Cannot overwrite a value"):
        documents.toml_value("a = 1\na = 2\n", "t", cap=100)


def test_the_config_file_is_read_through_it(tmp_path):
    with pytest.raises(NvcError) as err:
        load.parse("[nvidia-container-cli]\nx = " + "[" * 100_000, "config.toml")
    assert err.value.category == "config" and "config.toml: nested deeper than 64 levels" in err.value.detail


def test_cdi_json_specs_are_read_through_it():
    with pytest.raises(NvcError, match="spec.json: JSON nested deeper than 64 levels"):
        store.parse_text('{"cdiVersion": ' + nested(100_000) + "}", "spec.json")
    with pytest.raises(NvcError, match="spec.json: invalid JSON: Extra data"):
        store.parse_text('{"cdiVersion": "0.5.0"} trailing', "spec.json")


def test_a_dra_checkpoint_nested_deep_is_one_line(tmp_path):
    path = tmp_path / "checkpoint.json"
    path.write_text('{"version": 1, "claims": ' + nested(100_000) + "}")
    with pytest.raises(NvcError, match="JSON nested deeper than 64 levels"):
        checkpoint._read(str(path))


def test_a_claim_record_nested_deep_is_no_record():
    text = f"# {claimspec.RECORD}" + nested(100_000) + "\n"
    assert claimspec.record_of(text) is None


def test_an_engine_toml_nested_deep_is_one_line():
    from nvcontainer.setup import tomltext

    with pytest.raises(NvcError) as err:
        tomltext.parse("a = " + "[" * 100_000, "/etc/containerd/config.toml")
    assert err.value.category == "setup"
    assert "config.toml: not valid TOML: nested deeper than 64 levels" in err.value.detail
