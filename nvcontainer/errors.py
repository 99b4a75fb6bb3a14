"""One error type for everything a user can cause or the host can get wrong.

Every failure the user sees is a single line: ``nvcontainer: <category> error: <detail>``.
The categories follow nvidia-container-cli so that operators' log searches keep working.
Values that came from outside (image environment, files, argv) are escaped before they are
put into a message, so a hostile value cannot forge log lines or drive a terminal.
"""

from __future__ import annotations

_MAX_SHOWN = 200
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
# Printable to Python but able to reorder what a terminal shows: bidi marks and embeddings.
_BIDI = frozenset([0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)])


def escape(value: object, limit: int = _MAX_SHOWN) -> str:
    """Printable, single-line rendering of an untrusted value, cut to ``limit`` characters."""
    if isinstance(value, bytes):
        text = value.decode("utf-8", "backslashreplace")
    else:
        text = str(value)
    out = []
    for shown, ch in enumerate(text):
        if shown >= limit:
            out.append("...")
            break
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        elif 0xD800 <= code <= 0xDFFF:  # lone surrogates from surrogateescape decoding
            out.append(f"\\x{code & 0xFF:02x}")
        elif ch.isprintable() and code not in _BIDI:
            out.append(ch)
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


class NvcError(Exception):
    """A failure that is reported as one line and exit status 1.

    ``category`` is the upstream word (``input``, ``initialization``, ``ldcache``, ``device``,
    ``requirement``, ``mount``, ...). ``detail`` must already be escaped where it carries
    untrusted text; use :func:`escape` when building it.
    """

    def __init__(self, category: str, detail: str):
        super().__init__(f"{category} error: {detail}")
        self.category = category
        self.detail = detail

    def line(self, prog: str = "nvcontainer") -> str:
        return f"{prog}: {self.category} error: {self.detail}"
