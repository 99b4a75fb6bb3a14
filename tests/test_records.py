"""nvcontainer.records against dataclasses as the oracle: the same class written both ways must
construct, compare, hash, print, copy, pickle and convert alike, for what the models use."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import subprocess
import sys

import pytest

from nvcontainer import records


def pair(body: str, *, mutable: bool = False):
    """The class ``body`` declares, once as a record and once as a dataclass."""
    space = {"records": records, "dataclasses": dataclasses}
    exec(f"@records.record(mutable={mutable})\nclass Node:\n{body}", space)
    ours = space["Node"]
    exec(f"@dataclasses.dataclass(frozen={not mutable})\nclass Node:\n{body}", space)
    return ours, space["Node"]


PLAIN = """
    name: str
    size: int = 0
    tags: tuple = ()
"""


@pytest.mark.parametrize("args, kwargs", [(("a",), {}), (("a", 3), {}), ((), {"name": "b", "tags": (1, 2)}),
                                          (("a",), {"size": 7})])
def test_construction_equality_hash_and_repr_as_dataclasses(args, kwargs):
    ours, theirs = pair(PLAIN)
    mine, oracle = ours(*args, **kwargs), theirs(*args, **kwargs)
    assert repr(mine) == repr(oracle)
    assert hash(mine) == hash(oracle)
    assert mine == ours(*args, **kwargs) and mine != ours("other")
    assert (mine == oracle) is False                    # another class: never equal
    assert {mine: 1}[ours(*args, **kwargs)] == 1


@pytest.mark.parametrize("args, kwargs", [((), {}), (("a", 1, (), 4), {}), (("a",), {"name": "b"}),
                                          (("a",), {"colour": 1})])
def test_bad_arguments_are_type_errors_as_with_dataclasses(args, kwargs):
    ours, theirs = pair(PLAIN)
    with pytest.raises(TypeError):
        theirs(*args, **kwargs)
    with pytest.raises(TypeError):
        ours(*args, **kwargs)


def test_frozen_fields_refuse_assignment_and_deletion():
    ours, _ = pair(PLAIN)
    node = ours("a")
    with pytest.raises(AttributeError):
        node.size = 2
    with pytest.raises(records.FrozenInstanceError):
        del node.name
    assert node.size == 0


def test_field_options_default_factory_compare_hash_repr():
    body = """
    name: str
    cache: dict = FIELD(default_factory=dict, compare=False, hash=False, repr=False)
    items: list = FIELD(default_factory=list)
    note: str = FIELD(default=None, compare=False)
    """
    space = {"records": records, "dataclasses": dataclasses}
    exec("@records.record\nclass Node:\n" + body.replace("FIELD", "records.field"), space)
    ours = space["Node"]
    exec("@dataclasses.dataclass(frozen=True)\nclass Node:\n" + body.replace("FIELD", "dataclasses.field"), space)
    theirs = space["Node"]
    a, b = ours("x"), ours("x", {"k": 1}, note="different")
    assert a.items is not ours("x").items                   # a new list each time
    assert a == b and repr(a) == repr(theirs("x"))
    assert repr(b) == repr(theirs("x", {"k": 1}, note="different"))
    assert ours("x", items=(1,)) != ours("x")
    assert hash(ours("x", note="n", items=(1,))) == hash(theirs("x", note="n", items=(1,)))


def test_a_class_keeps_the_methods_it_writes_itself():
    space = {"records": records}
    exec("""
@records.record
class Named:
    name: str
    def __eq__(self, other):
        return isinstance(other, Named) and self.name.lower() == other.name.lower()
    def __hash__(self):
        return hash(self.name.lower())
    def __repr__(self):
        return f"<{self.name}>"
""", space)
    named = space["Named"]
    assert named("GPU") == named("gpu") and hash(named("GPU")) == hash(named("gpu")) and repr(named("a")) == "<a>"


def test_non_default_after_default_is_refused():
    with pytest.raises(TypeError, match="non-default argument 'b' follows default argument"):
        exec("@records.record\nclass Bad:\n    a: int = 0\n    b: int\n", {"records": records})


def test_replace_fields_asdict_and_inheritance():
    space = {"records": records}
    exec("""
@records.record
class Leaf:
    path: str
    size: int = 0

@records.record
class Tree:
    leaves: tuple = ()
    index: dict = records.field(default_factory=dict)
    best: Leaf | None = None

@records.record
class Bigger(Leaf):
    more: bool = True
""", space)
    leaf, tree, bigger = space["Leaf"], space["Tree"], space["Bigger"]
    t = tree((leaf("a", 1), leaf("b")), {"a": [leaf("a", 1)]}, leaf("c"))
    assert records.asdict(t) == {"leaves": ({"path": "a", "size": 1}, {"path": "b", "size": 0}),
                                 "index": {"a": [{"path": "a", "size": 1}]}, "best": {"path": "c", "size": 0}}
    assert records.replace(t, best=None) == tree(t.leaves, t.index, None)
    assert records.replace(leaf("a"), size=3) == leaf("a", 3)
    assert [(f.name, f.type) for f in records.fields(tree)] == [("leaves", "tuple"), ("index", "dict"),
                                                               ("best", "Leaf | None")]
    assert [f.name for f in records.fields(bigger("p"))] == ["path", "size", "more"]
    assert bigger("p", 1, False).more is False and bigger("p") != leaf("p")
    with pytest.raises(TypeError):
        records.replace(leaf("a"), colour=1)
    with pytest.raises(TypeError):
        records.asdict({"not": "a record"})


@records.record
class Pickled:
    name: str
    tags: tuple = ()
    index: dict = records.field(default_factory=dict)


def test_copies_and_pickles_like_dataclasses():
    """The standby worker receives its job pickled, plan records and all."""
    node = Pickled("a", (1, 2), {"k": [Pickled("b")]})
    for again in (copy.copy(node), copy.deepcopy(node), pickle.loads(pickle.dumps(node))):
        assert again == node and again is not node
        with pytest.raises(AttributeError):
            again.name = "c"
    assert copy.deepcopy(node).index is not node.index


def test_post_init_runs_and_mutable_records_are_unhashable():
    space = {"records": records}
    exec("""
@records.record(mutable=True)
class Counter:
    n: int = 0
    def __post_init__(self):
        if self.n < 0:
            raise ValueError('n must not be negative')
""", space)
    counter = space["Counter"]
    c = counter()
    c.n += 1
    assert c == counter(1)
    with pytest.raises(TypeError):
        hash(c)
    with pytest.raises(ValueError, match="negative"):
        counter(-1)


def test_the_hook_path_imports_neither_dataclasses_nor_inspect():
    """What this module is for (issue 17 item 4): the models cost no code generation at import."""
    code = ("import sys\n"
            "import nvcontainer.hook.prestart, nvcontainer.plan.gather, nvcontainer.apply.execute\n"
            "import nvcontainer.config.load, nvcontainer.inventory.cache, nvcontainer.cgroups.rules\n"
            "print(sorted(m for m in ('dataclasses', 'inspect', 'ast') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
