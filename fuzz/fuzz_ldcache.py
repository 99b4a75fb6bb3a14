"""Coverage-guided fuzzing of the ld.so.cache parser (``nvcontainer.inventory.ldcache.parse``).

The cache is host data, trusted but fragile: a truncated or hostile file must come out as one
``NvcError("ldcache", ...)`` line or as entries whose strings really lie in the file, never as
any other exception, a hang, or memory growing with a count the file merely claims.

    python fuzz/fuzz_ldcache.py [libFuzzer flags] [CORPUS_DIR ...]

See fuzz/README.md for the bounded run the tests do and the long run.
"""

import os
import sys

import atheris

with atheris.instrument_imports():
    from nvcontainer.errors import NvcError
    from nvcontainer.inventory import ldcache


def test_one_input(data: bytes) -> None:
    try:
        entries = ldcache.parse(data, "fuzz.cache")
    except NvcError as exc:
        line = str(exc)
        assert exc.category == "ldcache" and "\n" not in line and line.isprintable(), repr(line)
        return
    # every string is a NUL-terminated run of the file's own bytes
    for text in {s for e in entries for s in (e.key, e.value)}:
        raw = os.fsencode(text)
        assert b"\0" not in raw and raw + b"\0" in data, raw[:80]
    for arch in ldcache.native_arches("x86_64"):
        if arch is not None:
            ldcache.entries_for_arch(entries, arch)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
