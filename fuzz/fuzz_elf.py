"""Coverage-guided fuzzing of the ELF readers in ``nvcontainer.inventory.elfinfo``.

Every reader has one contract: ``None`` for "not ELF" (and, for the SONAME reader, "no
SONAME"), ``NvcError("elf", ...)`` for a damaged file, nothing else, and never more work or
memory than the file's size allows. Each input goes through all three readers: the two for
image files (on bytes) and the host reader (``read_elf``, through ``pread`` on a memfd).

    python fuzz/fuzz_elf.py [libFuzzer flags] [CORPUS_DIR ...]

See fuzz/README.md for the bounded run the tests do and the long run.
"""

import os
import sys

import atheris

with atheris.instrument_imports():
    from nvcontainer.errors import NvcError
    from nvcontainer.inventory import elfinfo

_FD = os.memfd_create("fuzz-elf", os.MFD_CLOEXEC)


def _contract(call, *args):
    try:
        return call(*args)
    except NvcError as exc:
        line = str(exc)
        assert exc.category == "elf" and "\n" not in line and line.isprintable(), repr(line)
        return None


def test_one_input(data: bytes) -> None:
    header = _contract(elfinfo.read_untrusted_elf_header, data)
    if header is not None:
        assert header[0] in (32, 64) and header[1].startswith("EM_")
    soname = _contract(elfinfo.read_untrusted_soname, data)
    if soname is not None:
        assert "\0" not in soname and len(soname) <= len(data)
    os.ftruncate(_FD, 0)
    os.pwrite(_FD, data, 0)
    facts = _contract(elfinfo.read_elf, _FD)
    if facts is not None:
        assert facts.elf_class in (32, 64)
        for name in (facts.soname, *facts.needed):
            raw = os.fsencode(name)
            assert b"\0" not in raw and len(raw) <= 255 and raw in data, raw[:80]


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
