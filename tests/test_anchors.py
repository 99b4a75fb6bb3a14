"""Every pattern that validates outside text matches the whole text (issue 35): ``^...$`` with
``re.match`` takes ``"x\\n"``, since ``$`` also matches before a final newline, and a claim UID
``"x\\n"`` became a spec file ``...claim_x\\n.yaml`` and a CDI name with a newline in it. And a
digit test is ASCII's: ``"²".isdigit()`` is True and ``int("²")`` raises. Pure: no machine."""

from __future__ import annotations

import pytest

from nvcontainer.cdi import check
from nvcontainer.deviceplugin import devices
from nvcontainer.dra import claimspec, names
from nvcontainer.errors import NvcError
from nvcontainer.inventory.model import Gpu, Inventory, MigDevice
from nvcontainer.request import selection
from nvcontainer.runtime import prepare
from nvcontainer.setup import tomltext


@pytest.mark.parametrize("uid", ["x\n", "0f3c1e9a-2b4d-4e5f-8a6b-7c8d9e0f1a2b\n", "x\n\n", "\nx"])
def test_a_claim_uid_with_a_newline_is_refused(uid):
    with pytest.raises(NvcError, match="not a UID"):
        claimspec.file_name(uid)
    assert claimspec.uid_of(f"{claimspec.PREFIX}{uid}{claimspec.SUFFIX}") is None


def test_a_claim_uid_is_still_taken():
    uid = "0f3c1e9a-2b4d-4e5f-8a6b-7c8d9e0f1a2b"
    assert claimspec.uid_of(claimspec.file_name(uid)) == uid


GPU = Gpu(index=0, minor=0, model="A100", brand="Nvidia", uuid="GPU-0a1b2c3d-0000-0000-0000-000000000000",
          bus_id="00000000:07:00.0", arch="8.0",
          migs=(MigDevice(parent=0, index=1, uuid="MIG-1", gi=1, ci=0, gi_access="", ci_access=""),))
INV = Inventory(root="/", driver_version="550.54.14", cuda_version="12.4", gpus=(GPU,))


@pytest.mark.parametrize("token", ["0:1\n", "MIG-GPU-0a1b2c3d-0000-0000-0000-000000000000/1/0\n", "07:00.0\n",
                                   "0:\u0661"])
def test_a_device_token_with_a_trailing_newline_names_no_device(token):
    with pytest.raises(NvcError, match="unknown device"):
        selection._match(INV, token)


def test_the_device_tokens_still_match():
    assert selection._match(INV, "0:1") == (GPU, GPU.migs[0])
    assert selection._match(INV, "MIG-GPU-0a1b2c3d-0000-0000-0000-000000000000/1/0") == (GPU, GPU.migs[0])
    assert selection._match(INV, "07:00.0") == (GPU, None)


def test_dra_device_names_are_ascii_digits():
    with pytest.raises(NvcError, match="not a gpu.nvidia.com device name"):
        names.parse("gpu-\u0663")                       # ARABIC-INDIC DIGIT THREE: \d, and int() takes it
    assert names.parse("gpu-0-mig-\u00b2-1-2") == (0, 1, 2)   # "²": a profile, not int()'s ValueError


def test_a_toml_key_with_a_newline_is_quoted():
    assert tomltext._key("plain") == "plain"
    assert tomltext._key("a\n") == '"a\\n"'


def test_a_mig_profile_name_ends_at_the_end():
    mig = MigDevice(parent=0, index=0, uuid="MIG-x", gi=1, ci=0, gi_access="", ci_access="", name="A100 MIG 1g.10gb\n")
    assert devices.mig_profile(mig) == ""
    assert check._LIBRARY_VERSION.search("/usr/lib/libcuda.so.550.54\n") is None


def test_reply_fd_is_ascii_digits():
    with pytest.raises(NvcError, match="--reply-fd: expected a file descriptor number"):
        prepare._own_options(["--reply-fd", "\u00b2", "--", "runc"])
