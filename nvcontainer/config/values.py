"""The values an operator may write in the configuration, each checked by one small function that
names the key in its error.

Why strict: the hook reads these settings on every container start, as root. A value of the
wrong type or an unknown capability is an error naming the key, never silently ignored or
coerced (a misspelt policy switch would otherwise quietly reopen the hole it was meant to
close). The same checks serve the file and the global command-line options.
"""

from __future__ import annotations

from ..errors import NvcError, escape

CAPABILITIES = ("compat32", "compute", "display", "graphics", "ngx", "utility", "video")
MAX_DEADLINE = 3600
MAX_ALLOWED = 1024

# Strings, compiled by re on first use (and cached there): a start without a config file
# checks none of them.
_USER = r"[A-Za-z0-9_][A-Za-z0-9_.-]*(?::[A-Za-z0-9_][A-Za-z0-9_.-]*)?"
_ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_COMPAT_MODES = ("ldconfig", "disabled")
MODES = ("auto", "legacy", "cdi")
_PROGRAM = r"[A-Za-z0-9_.+-]{1,255}"
_CDI_KIND = r"[A-Za-z](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?/[A-Za-z](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_ANNOTATION_PREFIX = r"[A-Za-z0-9][A-Za-z0-9_./-]{0,252}"
MAX_LIST = 64
_DEVICE_TOKEN = r"[A-Za-z0-9][A-Za-z0-9:./-]{0,127}"
# what nvcontainer serve compiles before it forks (serve/server.py preload), so no request does
PATTERNS = (_USER, _ENV_NAME, _PROGRAM, _CDI_KIND, _ANNOTATION_PREFIX, _DEVICE_TOKEN)


def bad(key: str, value: object, want: str) -> NvcError:
    return NvcError("config", f"{key}: expected {want}, got {escape(repr(value), 80)}")


def path(value: object, key: str) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise bad(key, value, "a path")
    return value


def absolute(value: object, key: str) -> str:
    checked = path(value, key)
    if not checked.startswith("/"):
        raise bad(key, value, "an absolute path")
    return checked


def user(value: object, key: str) -> str:
    import re   # here: a start without a config file or --user imports no re (its milliseconds)

    if not isinstance(value, str) or not re.fullmatch(_USER, value):
        raise bad(key, value, "UID[:GID] (numbers or names)")
    return value


def boolean(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise bad(key, value, "true or false")
    return value


def str_list(value: object, key: str) -> list[str]:
    """A comma-separated string (upstream's form) or a TOML array of strings."""
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = value
    else:
        raise bad(key, value, "a comma-separated string or an array of strings")
    return [item.strip() for item in items if item.strip()]


def capabilities(value: object, key: str) -> tuple[str, ...]:
    items = str_list(value, key)
    if "all" in items:
        return CAPABILITIES
    unknown = [i for i in items if i not in CAPABILITIES]
    if unknown:
        raise NvcError("config", f"{key}: unknown capability '{escape(unknown[0], 40)}' "
                                 f"(known: {','.join(CAPABILITIES)}, all)")
    return tuple(sorted(set(items)))


def _matching(items: list[str], key: str, pattern: str, want: str) -> tuple[str, ...]:
    """``items`` once each, in order, every one matching ``pattern``."""
    import re

    for item in items:
        if not re.fullmatch(pattern, item):
            raise bad(key, item, want)
    return tuple(dict.fromkeys(items))


def env_names(value: object, key: str) -> tuple[str, ...]:
    return _matching(str_list(value, key), key, _ENV_NAME, "environment variable names")


def ldconfig(value: object, key: str) -> str:
    if not isinstance(value, str) or not value.startswith("@/") or "\0" in value:
        raise bad(key, value, "'@' followed by an absolute host path (the image's ldconfig is never run)")
    return value


def compat_mode(value: object, key: str) -> str:
    if value == "hook":
        # upstream: the CLI does nothing and a createContainer hook points the loader at the
        # image's compat directory; that is what "ldconfig" does here, from the hook itself
        return "ldconfig"
    if value == "mount":
        raise NvcError("config", f"{key}: 'mount' is not supported: nvcontainer never bind-mounts files "
                                 "from an image; 'ldconfig' uses the image's compat libraries in place")
    if value not in _COMPAT_MODES:
        raise bad(key, value, " or ".join(repr(m) for m in _COMPAT_MODES))
    return value


def deadline(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_DEADLINE:
        raise bad(key, value, f"a number of seconds, more than 0 and at most {MAX_DEADLINE}")
    return value


def wait_seconds(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_DEADLINE:
        raise bad(key, value, f"a number of seconds from 0 to {MAX_DEADLINE}")
    return value


def device_tokens(value: object, key: str) -> tuple[str, ...] | None:
    """Device tokens as in a request; they are matched against the GPUs when a container asks.
    An empty list is a node that hands out no GPU at all (the driver only)."""
    tokens = str_list(value, key)
    if len(tokens) > MAX_ALLOWED:
        raise bad(key, f"{len(tokens)} entries", f"at most {MAX_ALLOWED} device tokens")
    import re

    for token in tokens:
        if not re.fullmatch(_DEVICE_TOKEN, token):
            raise bad(key, token, "device tokens (an index, GPU-/MIG- UUID, PCI bus id, <gpu>:<mig> or all)")
    if "all" in tokens:
        return None
    return tuple(dict.fromkeys(tokens))


def _short_list(value: object, key: str) -> list[str]:
    items = str_list(value, key)
    if not items or len(items) > MAX_LIST:
        raise bad(key, value, f"1 to {MAX_LIST} entries")
    return items


def program(value: object, key: str) -> str:
    """A program: a bare name (looked up on a fixed PATH, never the caller's) or an absolute path."""
    import re

    if not isinstance(value, str) or not (re.fullmatch(_PROGRAM, value) or (value.startswith("/") and "\0" not in value)):
        raise bad(key, value, "a program name or an absolute path")
    return value


def programs(value: object, key: str) -> tuple[str, ...]:
    """Low-level runtimes, in the order they are looked for."""
    return tuple(dict.fromkeys(program(item, key) for item in _short_list(value, key)))


def mode(value: object, key: str) -> str:
    if value == "jit-cdi":
        # upstream's in-memory CDI spec from NVIDIA_VISIBLE_DEVICES: its point, devices in the
        # OCI spec, is what legacy mode does here; CDI names still resolve from spec-dirs
        return "auto"
    if value == "csv":
        raise NvcError("config", f"{key}: 'csv' (Tegra CSV files) is not supported by nvcontainer")
    if value not in MODES:
        raise bad(key, value, ", ".join(repr(m) for m in MODES) + " or 'jit-cdi'")
    return value


def absolute_list(value: object, key: str) -> tuple[str, ...]:
    items = _short_list(value, key)
    for item in items:
        absolute(item, key)
    return tuple(dict.fromkeys(items))


def cdi_kind(value: object, key: str) -> str:
    import re

    if not isinstance(value, str) or not re.fullmatch(_CDI_KIND, value):
        raise bad(key, value, "a CDI kind, vendor/class (nvidia.com/gpu)")
    return value


def annotation_prefixes(value: object, key: str) -> tuple[str, ...]:
    return _matching(_short_list(value, key), key, _ANNOTATION_PREFIX, "annotation key prefixes (cdi.k8s.io/)")
