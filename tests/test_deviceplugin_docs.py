"""The device plugin's documentation describes the code as it is: every option of
``nvcontainer device-plugin --help`` and every ``[device-plugin]`` key is in its man page, the
DaemonSet manifest in docs/engines/kubernetes.md is the file in deploy/, and the configuration
it carries is one the plugin accepts."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from nvcontainer.deviceplugin import settings
from tests.fixtures.docs import assert_documented, help_options, man_warnings, mentions, section

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "man" / "nvcontainer-device-plugin.1"
MANIFEST = ROOT / "deploy" / "kubernetes" / "base" / "device-plugin.yaml"
GUIDE = ROOT / "docs" / "engines" / "kubernetes.md"


def test_every_option_is_in_the_options_section():
    text = section(PAGE.read_text(), ".SH OPTIONS")
    assert_documented(help_options("device-plugin"), text, "man/nvcontainer-device-plugin.1 (OPTIONS)")


def test_every_setting_is_documented_and_nothing_else():
    text = section(PAGE.read_text(), ".SH SETTINGS")
    documented = {m.replace("\\-", "-") for m in re.findall(r"^\\fB([a-z\\-]+)\\fR = ", text, re.M)}
    assert documented == set(settings.KEYS)
    toml_page = (ROOT / "man" / "nvcontainer.toml.5").read_text()
    for key in settings.KEYS:
        assert mentions(toml_page, key), f"{key} is not listed in nvcontainer.toml(5)"
        assert f"`{key}`" in GUIDE.read_text(), f"{key} is not in docs/engines/kubernetes.md"


def test_the_guide_shows_the_manifest_file():
    manifest = MANIFEST.read_text()
    assert f"```yaml\n{manifest}```" in GUIDE.read_text()


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
def test_page_renders_without_warnings():
    assert man_warnings(PAGE) == ""
