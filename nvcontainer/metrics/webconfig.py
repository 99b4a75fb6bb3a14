"""The web configuration file (``--web-config-file``), in the Prometheus exporter-toolkit's
format, so a node's exporters share one file: TLS and basic authentication.

    tls_server_config:
      cert_file: /etc/nvcontainer/tls.crt
      key_file: /etc/nvcontainer/tls.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default), RequireAnyClientCert,
      client_ca_file: /etc/nvcontainer/ca.crt        #    VerifyClientCertIfGiven
      min_version: TLS12                             # or TLS13
    basic_auth_users:
      prometheus: $2y$10$...                         # bcrypt hashes, as the toolkit's

What is not supported (``http_server_config``, cipher suites, curve preferences) is an error
naming the key, never ignored: an operator who asked for a protection must not get less. Basic
authentication needs the ``bcrypt`` module (the toolkit's hashes are bcrypt); without it such a
file is refused with that reason. Parsed with the CDI specs' YAML subset reader; checked key by
key here (pure: :func:`parse`); :func:`ssl_context` and :class:`Users` are the shell.
"""

from __future__ import annotations

import base64
import hmac
import ssl
import threading

from ..cdi import yamltext
from ..errors import NvcError, escape
from ..records import record, field

MAX_FILE = 1 << 16
AUTH_TYPES = {"NoClientCert": ssl.CERT_NONE, "RequireAnyClientCert": ssl.CERT_OPTIONAL,
              "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL, "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version")


@record
class WebConfig:
    cert_file: str = ""
    key_file: str = ""
    client_auth_type: str = "NoClientCert"
    client_ca_file: str = ""
    min_version: str = "TLS12"
    max_version: str = ""
    users: dict = field(default_factory=dict)     # name → bcrypt hash

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)


def _fail(where: str, what: str) -> NvcError:
    return NvcError("input", f"{where}: {what}")


def _text(where: str, key: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"{key} must be a non-empty string")
    return value


def parse(text: str, where: str) -> WebConfig:
    try:
        doc = yamltext.load(text, where)
    except NvcError as exc:
        raise NvcError("input", exc.detail) from None
    if doc is None:
        return WebConfig()
    if not isinstance(doc, dict):
        raise _fail(where, "expected a mapping")
    for key in doc:
        if key not in ("tls_server_config", "basic_auth_users"):
            raise _fail(where, f"{escape(str(key), 60)} is not supported (tls_server_config and "
                               "basic_auth_users are)")
    tls = doc.get("tls_server_config") or {}
    if not isinstance(tls, dict):
        raise _fail(where, "tls_server_config must be a mapping")
    values = {}
    for key, value in tls.items():
        if key not in TLS_KEYS:
            raise _fail(where, f"tls_server_config.{escape(str(key), 60)} is not supported")
        values[key] = _text(where, f"tls_server_config.{key}", value)
    if tls and not ("cert_file" in values and "key_file" in values):
        raise _fail(where, "tls_server_config needs both cert_file and key_file")
    auth = values.get("client_auth_type", "NoClientCert")
    if auth not in AUTH_TYPES:
        raise _fail(where, f"client_auth_type {escape(auth, 60)}: not one of {', '.join(AUTH_TYPES)}")
    if auth in ("RequireAndVerifyClientCert", "VerifyClientCertIfGiven") and "client_ca_file" not in values:
        raise _fail(where, f"client_auth_type {auth} needs client_ca_file")
    for key in ("min_version", "max_version"):
        if key in values and values[key] not in VERSIONS:
            raise _fail(where, f"tls_server_config.{key} {escape(values[key], 20)}: not TLS12 or TLS13")
    users = doc.get("basic_auth_users") or {}
    if not isinstance(users, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in users.items()):
        raise _fail(where, "basic_auth_users must map user names to bcrypt hashes")
    for name, hashed in users.items():
        if not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise _fail(where, f"basic_auth_users.{escape(name, 60)}: not a bcrypt hash")
    if users:
        try:
            import bcrypt  # noqa: F401
        except ImportError:
            raise _fail(where, "basic_auth_users needs the Python bcrypt module, which is not installed "
                               "(pip install bcrypt; docs/metrics.md)") from None
    return WebConfig(**values, users=dict(users))


def load(path: str) -> WebConfig:
    from .files import read_text

    return parse(read_text(path, MAX_FILE, "web config file"), f"web config file {escape(path)}")


def ssl_context(config: WebConfig) -> ssl.SSLContext:
    """The server's TLS context; an unreadable certificate or key is one line naming it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = VERSIONS[config.min_version]
    if config.max_version:
        ctx.maximum_version = VERSIONS[config.max_version]
    try:
        ctx.load_cert_chain(config.cert_file, config.key_file)
        if config.client_ca_file:
            ctx.load_verify_locations(config.client_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise NvcError("input", f"web config file: certificate or key: {escape(exc)}") from None
    ctx.verify_mode = AUTH_TYPES[config.client_auth_type]
    return ctx


class Users:
    """``check(header)``: whether an ``Authorization`` header names a user with the right
    password. bcrypt is slow by design, so a header once verified is remembered (by its HMAC
    under a per-process key, never in clear) and the cache is bounded."""

    MAX_CACHE = 256

    def __init__(self, users: dict):
        import os

        self.users = users
        self.key = os.urandom(32)
        self.good: set[bytes] = set()
        self.lock = threading.Lock()

    def check(self, header: str | None) -> bool:
        if not self.users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        digest = hmac.new(self.key, header.encode("utf-8", "replace"), "sha256").digest()
        with self.lock:
            if digest in self.good:
                return True
        try:
            name, _, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self.users.get(name)
        if hashed is None:
            return False
        import bcrypt

        if not bcrypt.checkpw(password.encode(), hashed.encode()):
            return False
        with self.lock:
            if len(self.good) >= self.MAX_CACHE:
                self.good.clear()
            self.good.add(digest)
        return True
