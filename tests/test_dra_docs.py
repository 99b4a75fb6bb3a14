"""The DRA driver's documentation describes the code as it is: every attribute and capacity the
slices publish (for a plain and a MIG fake machine) is in docs/engines/kubernetes-dra.md's table
and in the man page, every ``dra-driver`` option is in the man page's OPTIONS, every file the
guide lists is in deploy/kubernetes/dra, and the page renders without warnings."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvcontainer.dra import publish, slices
from nvcontainer.inventory.build import build
from tests.fixtures.fakegpu import FakeSpec
from tests.test_docs import assert_documented, help_options, man_warnings, mentions, section

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "man" / "nvcontainer-dra-driver.1"
GUIDE = ROOT / "docs" / "engines" / "kubernetes-dra.md"
DEPLOY = ROOT / "deploy" / "kubernetes" / "dra"


def published_names(machine) -> tuple[set, set]:
    inv = build(str(machine.root), proc=str(machine.proc))
    devices = slices.build(inv, "n", roots=publish.pcie_roots(str(machine.sysfs), inv))[0]["spec"]["devices"]
    attributes = {a for d in devices for a in d["attributes"]}
    capacity = {re.sub(r"\d+$", "", c) for d in devices for c in d.get("capacity", {})}
    return attributes, capacity


def test_every_published_name_is_documented(fake_machine_factory):
    attributes, capacity = set(), set()
    for spec in (FakeSpec(gpus=2), FakeSpec(gpus=2, mig=True)):
        a, c = published_names(fake_machine_factory(spec))
        attributes |= a
        capacity |= c
    assert {"type", "profile", "parentUUID", "resource.kubernetes.io/pcieRoot"} <= attributes
    assert capacity == {"memory", "memorySlice", "multiprocessors", "copyEngines", "decoders", "encoders",
                        "jpegEngines", "ofaEngines"}
    guide, page = GUIDE.read_text(), PAGE.read_text()
    table = guide[guide.index("Attributes (domain"):guide.index("### Where we differ")]
    for name in attributes:
        assert f"`{name}`" in table, f"attribute {name} is not in the guide's table"
        assert mentions(page, name), f"attribute {name} is not in man/nvcontainer-dra-driver.1"
    for name in capacity:
        assert f"`{name}" in table, f"capacity {name} is not in the guide"
        assert name.replace("-", "\\-") in page


def test_the_guide_lists_the_deploy_files():
    listed = set(re.findall(r"^\| `((?:[\w.-]+/)*[\w.-]+\.yaml)` \|", GUIDE.read_text(), re.M))
    present = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.yaml")}
    assert listed == present
    assert "(kubernetes-dra-node.md)" in GUIDE.read_text()


def has_command(name: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "nvcontainer", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60).stdout
    return re.search(rf"^\s+{re.escape(name)}\s", out, re.M) is not None


@pytest.mark.skipif(not has_command("dra-driver"), reason="the dra-driver command is not on this branch yet")
def test_every_option_is_in_the_options_section():
    text = section(PAGE.read_text(), ".SH OPTIONS")
    assert_documented(help_options("dra-driver"), text, "man/nvcontainer-dra-driver.1 (OPTIONS)")


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
def test_page_renders_without_warnings():
    assert man_warnings(PAGE) == ""
