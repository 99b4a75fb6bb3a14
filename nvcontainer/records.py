"""Records: the models' classes (plan, inventory, request, config, ...), built without code generation.

Why not ``dataclasses``: ``@dataclass`` writes the source of five or six methods for every class
and compiles it with ``exec`` when the module is imported, and importing ``dataclasses`` itself
pulls in ``inspect``, ``ast``, ``tokenize`` and ``enum``. The hook that runs in its own
interpreter imports 26 model classes on every container start; with dataclasses that was about
15 ms of its start-up, more than planning the whole start (issue 17 item 4). Here every class
shares the same few methods, which read a field table built once per class from its
annotations: no compilation at import, a loop per instance instead (microseconds, for the few
hundred objects one start makes).

What the code uses of dataclasses, and only that: ``@record`` (frozen; ``record(mutable=True)``
for the rare class updated in place), ``field(default=, default_factory=, compare=, hash=,
repr=)``, ``__post_init__``, ``replace``, ``fields`` (objects with ``name``, ``type`` and
``default``) and ``asdict``; equality and hashing over the compared fields, dataclasses' repr,
and instances that pickle and copy as dataclasses' do (their state is their ``__dict__``).
"""

from __future__ import annotations

# For the type checker only (docs/testing.md): ``@record`` makes classes as ``@dataclass`` does
# (PEP 681). The hook's path never imports ``typing`` for it: mypy takes this name as always true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, dataclass_transform
else:
    def dataclass_transform(**_):
        return lambda decorated: decorated

MISSING = type("MISSING", (), {"__repr__": lambda self: "MISSING"})()


class FrozenInstanceError(AttributeError):
    """Assigning to a field of a frozen record."""


class Field:
    __slots__ = ("name", "type", "default", "default_factory", "compare", "hash", "repr")

    def __init__(self, default=MISSING, default_factory=MISSING, compare=True, hash=None, repr=True):
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot specify both default and default_factory")
        self.name = self.type = None
        self.default, self.default_factory = default, default_factory
        self.compare, self.hash, self.repr = compare, hash, repr

    def __repr__(self) -> str:
        return f"Field(name={self.name!r}, default={self.default!r})"


def field(*, default=MISSING, default_factory=MISSING, compare=True, hash=None, repr=True) -> Any:
    return Field(default, default_factory, compare, hash, repr)


@dataclass_transform(field_specifiers=(field, Field))
def record(cls=None, *, mutable: bool = False):
    """Make ``cls`` a record: ``@record`` or ``@record(mutable=True)``."""
    def wrap(cls):
        return _build(cls, mutable)
    return wrap if cls is None else wrap(cls)


def fields(obj) -> tuple[Field, ...]:
    try:
        return obj.__record_fields__
    except AttributeError:
        raise TypeError("must be called with a record or an instance of one") from None


def replace(obj, **changes):
    for f in obj.__record_fields__:
        if f.name not in changes:
            changes[f.name] = obj.__dict__[f.name]
    return obj.__class__(**changes)


def asdict(obj) -> dict:
    """As ``dataclasses.asdict``: records become dicts, recursively through lists, tuples and dicts."""
    if not hasattr(type(obj), "__record_fields__"):
        raise TypeError("asdict() should be called on record instances")
    return _plain(obj)


def _plain(value):
    if hasattr(type(value), "__record_fields__"):
        return {f.name: _plain(value.__dict__[f.name]) for f in value.__record_fields__}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return type(value)((_plain(k), _plain(v)) for k, v in value.items())
    return value


def _build(cls, mutable: bool):
    table: dict[str, Field] = {}
    for base in reversed(cls.__mro__[1:]):
        for f in getattr(base, "__record_fields__", ()):
            table[f.name] = f
    for name, kind in cls.__dict__.get("__annotations__", {}).items():
        if isinstance(kind, str) and kind.startswith(("ClassVar", "typing.ClassVar")):
            continue
        value = cls.__dict__.get(name, MISSING)
        f = value if isinstance(value, Field) else Field(default=value)
        f.name, f.type = name, kind
        table[name] = f
        if isinstance(value, Field):
            if f.default is MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.default)
    seen_default = None
    for f in table.values():
        if f.default is not MISSING or f.default_factory is not MISSING:
            seen_default = f.name
        elif seen_default:
            raise TypeError(f"non-default argument {f.name!r} follows default argument")
    cls.__record_fields__ = tuple(table.values())
    cls.__record_compared__ = tuple(f.name for f in table.values() if f.compare)
    cls.__record_hashed__ = tuple(f.name for f in table.values() if (f.compare if f.hash is None else f.hash))
    cls.__match_args__ = tuple(table)
    for name, method in (("__init__", _init), ("__repr__", _repr), ("__eq__", _eq)):
        if name not in cls.__dict__:
            setattr(cls, name, method)
    own_hash = cls.__dict__.get("__hash__") is not None      # a class with __eq__ alone has None there
    if not own_hash:
        cls.__hash__ = None if mutable else _hash
    if not mutable:
        cls.__setattr__ = _frozen
        cls.__delattr__ = _frozen
    return cls


def _init(self, *args, **kwargs) -> None:
    cls = self.__class__
    table = cls.__record_fields__
    if len(args) > len(table):
        raise TypeError(f"{cls.__name__}() takes {len(table)} positional arguments but {len(args)} were given")
    put = object.__setattr__
    used = 0
    for i, f in enumerate(table):
        if i < len(args):
            if f.name in kwargs:
                raise TypeError(f"{cls.__name__}() got multiple values for argument {f.name!r}")
            value = args[i]
        elif f.name in kwargs:
            value = kwargs[f.name]
            used += 1
        elif f.default is not MISSING:
            value = f.default
        elif f.default_factory is not MISSING:
            value = f.default_factory()
        else:
            raise TypeError(f"{cls.__name__}() missing required argument: {f.name!r}")
        put(self, f.name, value)
    if used != len(kwargs):
        names = {f.name for f in table}
        unknown = next(name for name in kwargs if name not in names)
        raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {unknown!r}")
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


def _repr(self) -> str:
    shown = ", ".join(f"{f.name}={self.__dict__[f.name]!r}" for f in self.__record_fields__ if f.repr)
    return f"{self.__class__.__qualname__}({shown})"


def _eq(self, other):
    if other.__class__ is not self.__class__:
        return NotImplemented
    mine, theirs = self.__dict__, other.__dict__
    return all(mine[name] == theirs[name] for name in self.__record_compared__)


def _hash(self) -> int:
    state = self.__dict__
    return hash(tuple(state[name] for name in self.__record_hashed__))


def _frozen(self, name, value=None):
    raise FrozenInstanceError(f"cannot assign to field {name!r}")
