import json
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvcontainer.errors import NvcError
from nvcontainer.request.oci import PID_MAX_LIMIT, STATE_CAP, Mount, parse_spec, parse_state, read_spec, read_state


def state(**fields) -> bytes:
    return json.dumps(fields).encode()


def spec(process=None, root=None, **extra) -> bytes:
    obj = {"ociVersion": "1.0.2", "root": root if root is not None else {"path": "rootfs"}}
    if process is not None:
        obj["process"] = process
    obj.update(extra)
    return json.dumps(obj).encode()


def error(fn, *args) -> str:
    with pytest.raises(NvcError) as info:
        fn(*args)
    return str(info.value)


# --- state ---------------------------------------------------------------------------------

def test_state_fields():
    s = parse_state(state(ociVersion="1.0.2", id="c1", status="creating", pid=4242,
                          bundle="/run/b", annotations={"a": "b"}))
    assert (s.pid, s.bundle, s.root, s.annotations) == (4242, "/run/b", None, {"a": "b"})


def test_state_old_bundle_path():
    assert parse_state(state(pid=7, bundlePath="/old/b")).bundle == "/old/b"


def test_state_bundle_wins_over_bundle_path():
    assert parse_state(state(pid=7, bundle="/new", bundlePath="/old")).bundle == "/new"


@pytest.mark.parametrize("root, expected", [
    ("rootfs", "/b/rootfs"),                 # crun writes root.path verbatim: relative to bundle
    ("../x/rootfs", "/x/rootfs"),
    ("/abs/rootfs", "/abs/rootfs"),
])
def test_state_crun_root(root, expected):
    assert parse_state(state(pid=7, bundle="/b", root=root)).root == expected


@pytest.mark.parametrize("pid, shown", [
    (True, "true"), (False, "false"), (12.0, "12.0"), ("123", '"123"'), (1, "1"), (0, "0"),
    (-5, "-5"), (2 ** 40, str(2 ** 40)), (PID_MAX_LIMIT, str(PID_MAX_LIMIT)), (None, "null"),
    ([1], "a list"), ({"a": 1}, "an object"),
])
def test_state_bad_pid(pid, shown):
    msg = error(parse_state, state(pid=pid, bundle="/b"))
    assert msg == f"input error: state: pid: expected an integer > 1, got {shown}"


def test_state_pid_bounds_accepted():
    assert parse_state(state(pid=2, bundle="/b")).pid == 2
    assert parse_state(state(pid=PID_MAX_LIMIT - 1, bundle="/b")).pid == PID_MAX_LIMIT - 1


@pytest.mark.parametrize("data, fragment", [
    (b'{"pid": NaN, "bundle": "/b"}', "NaN is not valid JSON"),
    (b'{"pid": Infinity, "bundle": "/b"}', "Infinity is not valid JSON"),
    (b'{"pid": -Infinity, "bundle": "/b"}', "Infinity is not valid JSON"),
    (b'{"pid": 5, "bundle": "/b"} x', "invalid JSON"),
    (b'{"pid": 5, "bundle": "/b"}{}', "invalid JSON"),
    (b"[" * 200000 + b"]" * 200000, "nested too deeply"),
    (b"\xff\xfe{}", "invalid JSON"),
    (b"", "invalid JSON"),
    (b'{"pid": 5, "bundle": "/b"', "invalid JSON"),
    (b'"just a string"', "state: expected an object"),
    (b'{"pid": 5}', "state: bundle: missing"),
    (b'{"bundle": "/b"}', "state: pid: missing"),
    (b'{"pid": 5, "bundle": "rel"}', "not an absolute path"),
    (b'{"pid": 5, "bundle": ""}', "must not be empty"),
    (b'{"pid": 5, "bundle": 3}', "state: bundle: expected a string, got 3"),
    (b'{"pid": 5, "bundle": "/b\\u0000x"}', "NUL"),
    (b'{"pid": 5, "bundle": "/b\\ud800"}', "surrogate"),
    (b'{"pid": 5, "bundle": "/b", "root": 1}', "state: root: expected a string"),
    (b'{"pid": 5, "bundle": "/b", "annotations": []}', "state: annotations: expected an object"),
    (b'{"pid": 5, "bundle": "/b", "annotations": {"k": 1}}', "state: annotations[k]: expected a string"),
    (b'{"pid": ' + b"9" * 5000 + b', "bundle": "/b"}', "invalid JSON"),
])
def test_state_rejected(data, fragment):
    assert fragment in error(parse_state, data)


def test_state_trailing_whitespace_accepted():
    assert parse_state(state(pid=9, bundle="/b") + b" \n\t\r\n").pid == 9


def test_state_cap():
    big = state(pid=9, bundle="/b", annotations={"a": "x" * (1 << 20)})
    assert "larger than" in error(parse_state, big)


def test_state_message_escapes_control_characters():
    msg = error(parse_state, state(pid="\x1b[31m\nfake line", bundle="/b"))
    assert "\n" not in msg and "\x1b" not in msg and "\\n" in msg


def test_read_state_drains_pipe_beyond_pipe_buffer():
    payload = state(pid=31, bundle="/b", annotations={"k": "v" * 300000})
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the writer blocks until the reader drains everything, like crun
        os.close(r)
        os.write(w, payload)
        os._exit(0)
    os.close(w)
    try:
        s = read_state(r)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert s.pid == 31 and len(s.annotations["k"]) == 300000


def test_read_state_cap():
    r, w = os.pipe()
    os.write(w, b" " * 5000)
    os.close(w)
    try:
        assert "larger than 4096 bytes" in error(read_state, r, 4096)
    finally:
        os.close(r)


# --- config.json ---------------------------------------------------------------------------

def test_spec_fields():
    data = spec(
        process={"env": ["PATH=/bin", "A=1=2", "EMPTY=", "A=3"],
                 "capabilities": {"bounding": ["CAP_CHOWN", "CAP_SYS_ADMIN"]}},
        mounts=[{"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/x", "source": "/dev/null", "options": ["bind", "ro"]}],
        annotations={"io.k8s": "v"},
    )
    s = parse_spec(data, "/run/bundle")
    assert s.env == (("PATH", "/bin"), ("A", "3"), ("EMPTY", ""))   # last value wins
    assert s.environ() == {"PATH": "/bin", "A": "3", "EMPTY": ""}
    assert s.rootfs == "/run/bundle/rootfs"
    assert s.privileged
    assert s.mounts == (Mount("proc", "/proc", "proc", ()), Mount("/dev/null", "/x", "", ("bind", "ro")))
    assert s.annotations == {"io.k8s": "v"}


@pytest.mark.parametrize("path, rootfs", [
    ("rootfs", "/bundle/rootfs"), ("./r/../rootfs", "/bundle/rootfs"), ("/merged", "/merged"),
    ("//double", "/double"), ("../../..", "/"),
])
def test_spec_rootfs(path, rootfs):
    assert parse_spec(spec(root={"path": path}), "/bundle").rootfs == rootfs


@pytest.mark.parametrize("caps, privileged", [
    (None, False),
    ({}, False),
    ({"bounding": ["CAP_CHOWN"], "effective": ["CAP_SYS_ADMIN"]}, False),
    ({"bounding": ["CAP_SYS_ADMIN"]}, True),
    (["CAP_SYS_ADMIN", "CAP_NET_ADMIN"], True),   # OCI 1.0.0-rc1..rc4 flat list
    (["CAP_NET_ADMIN"], False),
])
def test_spec_privileged(caps, privileged):
    process = {"env": []} if caps is None else {"capabilities": caps}
    assert parse_spec(spec(process=process), "/b").privileged is privileged


def test_spec_without_process_has_no_env():
    s = parse_spec(spec(), "/b")
    assert s.env == () and not s.privileged


@pytest.mark.parametrize("data, fragment", [
    (spec(process={"env": ["NOEQUALS"]}), "config.json: process.env[0]: expected NAME=VALUE, got NOEQUALS"),
    (spec(process={"env": ["A=1", 5]}), "config.json: process.env[1]: expected a string, got 5"),
    (spec(process={"env": "A=1"}), "config.json: process.env: expected a list"),
    (spec(process={"env": ["A=\u0000"]}), "NUL"),
    (spec(process=[]), "config.json: process: expected an object"),
    (spec(process={"capabilities": {"bounding": "CAP_SYS_ADMIN"}}), "process.capabilities.bounding: expected a list"),
    (spec(process={"capabilities": {"bounding": [True]}}), "process.capabilities.bounding[0]: expected a string, got true"),
    (spec(process={"capabilities": 7}), "process.capabilities: expected an object"),
    (spec(root={"path": ""}), "root.path: must not be empty"),
    (spec(root={"path": 5}), "root.path: expected a string, got 5"),
    (spec(root={}), "root.path: expected a string, got null"),
    (spec(root="rootfs"), "config.json: root: expected an object"),
    (spec(mounts={}), "config.json: mounts: expected a list"),
    (spec(mounts=[{"source": "/x"}]), "mounts[0].destination: expected a string"),
    (spec(mounts=[{"destination": "/x", "options": "ro"}]), "mounts[0].options: expected a list"),
    (spec(mounts=[{"destination": "/x", "source": 1}]), "mounts[0].source: expected a string, got 1"),
    (spec(annotations={"a": None}), "config.json: annotations[a]: expected a string"),
    (json.dumps({"root": {"path": "r"}}).encode(), "ociVersion: expected a string, got null"),
    (json.dumps({"ociVersion": "", "root": {"path": "r"}}).encode(), "ociVersion: must not be empty"),
    (b'{"ociVersion": "1.0.2", "root": {"path": "r"}, "x": NaN}', "NaN is not valid JSON"),
    (b"{" * 100000, "invalid JSON"),
    (b'{"a":' * 100000 + b"1" + b"}" * 100000, "nested too deeply"),
])
def test_spec_rejected(data, fragment):
    assert fragment in error(parse_spec, data, "/b")


def test_spec_messages_are_single_line():
    msg = error(parse_spec, spec(process={"env": ["bad\nline\x1b"]}), "/b")
    assert "\n" not in msg and "\x1b" not in msg


def test_read_spec(tmp_path):
    (tmp_path / "config.json").write_bytes(spec(process={"env": ["A=1"]}))
    s = read_spec(str(tmp_path))
    assert s.env == (("A", "1"),) and s.rootfs == f"{tmp_path}/rootfs"


def test_read_spec_refuses_symlink(tmp_path):
    (tmp_path / "real.json").write_bytes(spec())
    (tmp_path / "config.json").symlink_to("real.json")
    assert "cannot open" in error(read_spec, str(tmp_path))


def test_read_spec_refuses_fifo_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    assert "not a regular file" in error(read_spec, str(tmp_path))


def test_read_spec_missing(tmp_path):
    assert "No such file" in error(read_spec, str(tmp_path))


def test_read_spec_cap(tmp_path):
    (tmp_path / "config.json").write_bytes(spec() + b" " * 100)
    assert "larger than" in error(read_spec, str(tmp_path), 50)


# --- nothing but NvcError, whatever the input -----------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
state_like = st.fixed_dictionaries({}, optional={
    "pid": json_values | st.integers(), "bundle": json_values | st.just("/b"),
    "bundlePath": json_values, "root": json_values, "annotations": json_values,
})
spec_like = st.fixed_dictionaries({}, optional={
    "ociVersion": json_values | st.just("1.0.2"),
    "root": json_values | st.fixed_dictionaries({}, optional={"path": json_values}),
    "process": json_values | st.fixed_dictionaries({}, optional={
        "env": json_values | st.lists(st.text(max_size=10) | json_values, max_size=4),
        "capabilities": json_values | st.fixed_dictionaries({}, optional={"bounding": json_values}),
    }),
    "mounts": json_values | st.lists(st.fixed_dictionaries({}, optional={
        "source": json_values, "destination": json_values, "type": json_values, "options": json_values,
    }), max_size=3),
    "annotations": json_values,
})


def _only_nvc_error(fn, *args):
    try:
        fn(*args)
    except NvcError:
        pass


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_state_bytes_never_crash(data):
    _only_nvc_error(parse_state, data)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_state_text_never_crash(text):
    _only_nvc_error(parse_state, text.encode("utf-8", "surrogatepass"))


@settings(max_examples=200, deadline=None)
@given(state_like)
def test_state_structured_never_crash(obj):
    _only_nvc_error(parse_state, json.dumps(obj).encode())


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_spec_bytes_never_crash(data):
    _only_nvc_error(parse_spec, data, "/b")


@settings(max_examples=200, deadline=None)
@given(spec_like)
def test_spec_structured_never_crash(obj):
    _only_nvc_error(parse_spec, json.dumps(obj).encode(), "/b")


# --- the state without end of file (issue 15, item 2) -------------------------------------------

def _writer(payload: bytes, then_sleep: float):
    """A pipe whose writer sends ``payload`` and then keeps the pipe open (a runtime that never
    closes the hook's stdin); returns (read end, writer pid)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, payload)
        time.sleep(then_sleep)
        os._exit(0)
    os.close(w)
    return r, pid


def _reap(r: int, pid: int) -> None:
    os.close(r)
    os.kill(pid, 9)
    os.waitpid(pid, 0)


@pytest.mark.parametrize("tail", [b"", b"\n", b" \t\r\n"])
def test_read_state_stops_at_a_complete_document(tail):
    """Before: read to EOF, so a writer that never closed hung the hook until the runtime's
    timeout. Now the first complete object (plus whitespace) ends the read at once."""
    r, pid = _writer(state(pid=31, bundle="/b", annotations={"k": "v" * 200000}) + tail, 30)
    try:
        start = time.monotonic()
        s = read_state(r)
        assert time.monotonic() - start < 1
    finally:
        _reap(r, pid)
    assert s.pid == 31 and len(s.annotations["k"]) == 200000


@pytest.mark.parametrize("payload", [b'{"pid": 31, "bundle": "/b"', b"", b'{"pid": 31} {', b'"}'])
def test_read_state_time_bound(payload):
    """An incomplete document (or trailing data) and no EOF: one line after the time bound."""
    r, pid = _writer(payload, 30)
    try:
        start = time.monotonic()
        msg = error(read_state, r, STATE_CAP, 0.3)
        assert time.monotonic() - start < 2
    finally:
        _reap(r, pid)
    assert msg == (f"input error: state: no complete JSON document on standard input within 0.3s "
                   f"({len(payload)} bytes, not closed)")


def test_read_state_from_an_endless_source_is_cut_by_the_cap():
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        assert "larger than 4096 bytes" in error(read_state, fd, 4096)
    finally:
        os.close(fd)


# --- keys runc and crun read differently (issue 15, item 3) ---------------------------------------

AMBIGUOUS = [
    ("env-and-Env", b'{"ociVersion": "1", "root": {"path": "r"}, "process": {"env": ["A=1"], "Env": ["A=2"]}}',
     'config.json: process: ambiguous keys "env" and "Env"'),
    ("env-twice", b'{"ociVersion": "1", "root": {"path": "r"}, "process": {"env": ["A=1"], "env": ["A=2"]}}',
     'config.json: process: ambiguous keys "env" and "env"'),
    ("Env-alone", b'{"ociVersion": "1", "root": {"path": "r"}, "process": {"ENV": ["A=2"]}}',
     "config.json: process: key \"ENV\" is not 'env'"),
    ("process-twice", b'{"ociVersion": "1", "root": {"path": "r"}, "process": {}, "Process": {"env": []}}',
     'config.json: ambiguous keys "process" and "Process"'),
    ("root-path-case", b'{"ociVersion": "1", "root": {"path": "r", "PATH": "/"}}',
     'config.json: root: ambiguous keys "path" and "PATH"'),
    ("mounts-long-s", '{"ociVersion": "1", "root": {"path": "r"}, "mount\u017f": []}'.encode(),
     'config.json: key "mount\u017f" is not \'mounts\''),
    ("capabilities-long-s", '{"ociVersion": "1", "root": {"path": "r"}, "process": {"capabilities": '
                            '{"bounding": []}, "capabilitie\u017f": {"bounding": ["CAP_SYS_ADMIN"]}}}'.encode(),
     'config.json: process: ambiguous keys "capabilities" and "capabilitie\u017f"'),
    ("mount-destination", b'{"ociVersion": "1", "root": {"path": "r"}, "mounts": [{"destination": "/a", '
                          b'"Destination": "/b"}]}',
     'config.json: mounts[0]: ambiguous keys "destination" and "Destination"'),
    ("annotation-twice", b'{"ociVersion": "1", "root": {"path": "r"}, "annotations": {"a": "1", "a": "2"}}',
     'config.json: annotations: duplicate key "a"'),
    ("oci-version-case", b'{"ociversion": "1", "root": {"path": "r"}}', "key \"ociversion\" is not 'ociVersion'"),
]


@pytest.mark.parametrize("data, message", [c[1:] for c in AMBIGUOUS], ids=[c[0] for c in AMBIGUOUS])
def test_ambiguous_spec_keys_are_refused(data, message):
    """Before: Python's json kept the last duplicate and matched keys exactly, so the hook
    decided on other variables than runc (case-insensitive, last wins) or crun (exact, first
    wins) gave the container. Now such a spec is refused in one line naming the keys."""
    msg = error(parse_spec, data, "/b")
    assert message in msg and "\n" not in msg


def test_annotation_keys_differing_in_case_are_distinct():
    """Map keys are matched exactly by both runtimes: "a" and "A" are two annotations."""
    s = parse_spec(b'{"ociVersion": "1", "root": {"path": "r"}, "annotations": {"a": "1", "A": "2"}}', "/b")
    assert s.annotations == {"a": "1", "A": "2"}


def test_unread_fields_may_vary():
    """Keys the hook does not read (linux, hooks, ...) are the runtime's business."""
    s = parse_spec(b'{"ociVersion": "1", "root": {"path": "r"}, "linux": {}, "Linux": {}, "hooks": {}}', "/b")
    assert s.rootfs == "/b/r"


def test_go_folding():
    """Go folds ASCII case and the long s and Kelvin sign onto s and k; nothing else."""
    from nvcontainer.request.oci import _fold

    assert _fold("ENV") == _fold("env") == "env"
    assert _fold("mount\u017f") == "mounts" and _fold("\u212aey") == "key"
    assert _fold("\u0130d") != "id" and _fold("stra\u00dfe") != "strasse"
