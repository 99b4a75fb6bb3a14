"""One error type for everything a user can cause or the host can get wrong.

Every failure the user sees is a single line: ``nvcontainer: <category> error: <detail>``.
The categories follow nvidia-container-cli so that operators' log searches keep working.
Values that came from outside (image environment, files, argv) are escaped before they are
put into a message, so a hostile value cannot forge log lines or drive a terminal.
"""

from __future__ import annotations

_MAX_SHOWN = 200


def escape(value: object, limit: int = _MAX_SHOWN) -> str:
    """Printable, single-line rendering of an untrusted value, cut to ``limit`` characters."""
    if isinstance(value, bytes):
        text = value.decode("utf-8", "backslashreplace")
    else:
        text = str(value)
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif 0xD800 <= code <= 0xDFFF:  # lone surrogates from surrogateescape decoding
            out.append(f"\\x{code & 0xFF:02x}")
        elif code in (0x2028, 0x2029, 0x200E, 0x200F) or 0x202A <= code <= 0x202E or 0x2066 <= code <= 0x2069:
            out.append(f"\\u{code:04x}")  # line separators and bidi controls
        else:
            out.append(ch)
        if len(out) > limit:
            out.append("...")
            break
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
