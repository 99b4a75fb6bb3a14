import os

import pytest

from nvcontainer.config import model as cfg
from nvcontainer.config import load as loading
from nvcontainer.config.load import load, parse
from nvcontainer.config.model import Config
from nvcontainer.errors import NvcError


def test_defaults():
    c = Config()
    assert (c.root, c.ldcache, c.debug, c.user, c.ldconfig) == ("/", "/etc/ld.so.cache", None, None, "@/sbin/ldconfig")
    assert c.supported_driver_capabilities == ("compat32", "compute", "display", "graphics", "ngx", "utility", "video")
    assert not c.no_cgroups and not c.disable_require and not c.accept_volume_mounts
    assert c.accept_envvar_unprivileged
    assert c.swarm_resource == ()
    assert c.cuda_compat_mode == "ldconfig"
    assert c.deadline == 20


def test_empty_file_is_defaults():
    assert parse("") == Config()


def test_every_key():
    c = parse('''
root = "/run/nvidia/driver"
ldcache = "/etc/ld.so.cache.alt"
debug = "/var/log/nvcontainer.log"
user = "root:video"
ldconfig = "@/sbin/ldconfig.real"
no-cgroups = true
supported-driver-capabilities = "utility, compute,video"
disable-require = true
swarm-resource = "DOCKER_RESOURCE_GPU,OTHER_GPU"
accept-nvidia-visible-devices-envvar-when-unprivileged = false
accept-nvidia-visible-devices-as-volume-mounts = true
cuda-compat-mode = "disabled"
deadline = 2.5
''')
    assert c == Config(
        root="/run/nvidia/driver", ldcache="/etc/ld.so.cache.alt", debug="/var/log/nvcontainer.log",
        user="root:video", ldconfig="@/sbin/ldconfig.real", no_cgroups=True,
        supported_driver_capabilities=("compute", "utility", "video"), disable_require=True,
        swarm_resource=("DOCKER_RESOURCE_GPU", "OTHER_GPU"), accept_envvar_unprivileged=False,
        accept_volume_mounts=True, cuda_compat_mode="disabled", deadline=2.5,
    )


@pytest.mark.parametrize("value, expected", [
    ('"all"', ("compat32", "compute", "display", "graphics", "ngx", "utility", "video")),
    ('["video", "compute", "video"]', ("compute", "video")),
    ('"compute,all"', ("compat32", "compute", "display", "graphics", "ngx", "utility", "video")),
    ('""', ()),
])
def test_supported_capabilities_forms(value, expected):
    assert parse(f"supported-driver-capabilities = {value}").supported_driver_capabilities == expected


def test_swarm_resource_array():
    assert parse('swarm-resource = ["A", "B", "A"]').swarm_resource == ("A", "B")


@pytest.mark.parametrize("text, message", [
    ("colour = 1", "config error: config: unknown key 'colour'"),
    ("[nvidia-container-cli]\nrot = '/'", "config error: config: unknown key 'nvidia-container-cli.rot'"),
    ("[nvidia-container-cli]\nroot = 'rel'", "config error: nvidia-container-cli.root: expected an absolute path"),
    ("[device-plugins]\nx = 1", "config error: config: unknown key 'device-plugins'"),
    ("[nvidia-container-runtime.modes.bogus]\nx = 1", "unknown key 'nvidia-container-runtime.modes.bogus'"),
    ("nvidia-container-runtime = 1", "unknown key 'nvidia-container-runtime'"),
    ("[features]\nignore-imex-channel-requests = 'yes'", "features.ignore-imex-channel-requests: expected true or false"),
    ('root = "/a"\n[nvidia-container-cli]\nroot = "/b"', "nvidia-container-cli.root and root set the same setting"),
    ('deadline = 3\n[nvcontainer]\ndeadline = 4', "nvcontainer.deadline and deadline set the same setting"),
    ('[nvidia-container-runtime]\nmode = "csv"', "nvidia-container-runtime.mode: 'csv' (Tegra CSV files) is not supported"),
    ('[nvidia-container-runtime]\nmode = "fast"', "nvidia-container-runtime.mode: expected 'auto', 'legacy', 'cdi' or 'jit-cdi'"),
    ('[nvidia-container-runtime]\nruntimes = []', "nvidia-container-runtime.runtimes: expected 1 to 64 entries"),
    ('[nvidia-container-runtime]\nruntimes = ["run c"]', "runtimes: expected a program name or an absolute path, got 'run c'"),
    ('[nvidia-container-runtime]\nruntimes = ["../runc"]', "runtimes: expected a program name or an absolute path"),
    ('[nvidia-container-runtime.modes.cdi]\nspec-dirs = ["cdi"]', "spec-dirs: expected an absolute path, got 'cdi'"),
    ('[nvidia-container-runtime.modes.cdi]\ndefault-kind = "gpu"', "default-kind: expected a CDI kind"),
    ('[nvidia-container-runtime.modes.cdi]\nannotation-prefixes = ["a b/"]', "annotation-prefixes: expected annotation key prefixes"),
    ('[nvidia-container-runtime-hook]\npath = "bin/hook"', "nvidia-container-runtime-hook.path: expected a program name or an absolute path"),
    ("accept-nvidia-visible-devices-envvar-when-unpriviledged = false", "unknown key 'accept-nvidia-visible-devices-envvar-when-unpriviledged'"),
    ('no-cgroups = "false"', "config error: no-cgroups: expected true or false, got 'false'"),
    ("disable-require = 1", "config error: disable-require: expected true or false, got 1"),
    ('root = "relative"', "config error: root: expected an absolute path, got 'relative'"),
    ("root = 5", "config error: root: expected a path, got 5"),
    ('ldcache = ""', "config error: ldcache: expected a path, got ''"),
    ('debug = "log.txt"', "debug: expected an absolute path"),
    ('user = "a b"', "user: expected UID[:GID] (numbers or names), got 'a b'"),
    ('user = "1:2:3"', "user: expected UID[:GID]"),
    ('ldconfig = "/sbin/ldconfig"', "ldconfig: expected '@' followed by an absolute host path"),
    ('ldconfig = "@sbin/ldconfig"', "ldconfig: expected '@' followed by an absolute host path"),
    ('supported-driver-capabilities = "compute,none"', "unknown capability 'none'"),
    ("supported-driver-capabilities = 3", "expected a comma-separated string or an array of strings, got 3"),
    ("supported-driver-capabilities = [1]", "expected a comma-separated string or an array of strings"),
    ('swarm-resource = "A;rm -rf"', "swarm-resource: expected environment variable names, got 'A;rm -rf'"),
    ('cuda-compat-mode = "mount"', "'mount' is not supported: nvcontainer never bind-mounts files from an image"),
    ('cuda-compat-mode = "fast"', "cuda-compat-mode: expected 'ldconfig' or 'disabled', got 'fast'"),
    ("deadline = 0", "deadline: expected a number of seconds, more than 0 and at most 3600, got 0"),
    ("deadline = -1", "deadline: expected a number of seconds"),
    ("deadline = 1e9", "deadline: expected a number of seconds"),
    ("deadline = true", "deadline: expected a number of seconds"),
    ("deadline = nan", "deadline: expected a number of seconds"),
    ('deadline = "30"', "deadline: expected a number of seconds"),
    ("root = ", "config error: config: "),
    ("x = [" * 5000, "config error: config: "),
])
def test_errors(text, message):
    with pytest.raises(NvcError) as info:
        parse(text)
    assert message in str(info.value)


def test_messages_escape_values():
    with pytest.raises(NvcError) as info:
        parse('user = "a\\nb\\u001b"')
    assert "\n" not in str(info.value) and "\x1b" not in str(info.value)


def test_with_overrides():
    base = parse('root = "/drv"\nuser = "1:1"\nno-cgroups = true')
    c = base.with_overrides(root="/other", debug="log.txt")
    assert (c.root, c.debug, c.user, c.ldcache, c.no_cgroups) == ("/other", "log.txt", "1:1", "/etc/ld.so.cache", True)
    assert base.with_overrides() == base
    assert base.with_overrides(ldcache="/c", user="nobody").ldcache == "/c"
    with pytest.raises(NvcError, match="--root: expected an absolute path"):
        base.with_overrides(root="rel")
    # a bare --user (argp's optional argument left out) is the caller's identity, not an error
    assert base.with_overrides(user="").user == ""
    with pytest.raises(NvcError, match="--user"):
        base.with_overrides(user="a b")


def test_load_explicit_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('disable-require = true\n')
    assert load(str(path)).disable_require


def test_load_explicit_missing_file_is_an_error(tmp_path):
    with pytest.raises(NvcError, match="cannot open .*missing.toml: No such file or directory"):
        load(str(tmp_path / "missing.toml"))


def test_load_missing_default_is_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    assert load() == Config()


def test_load_default_file(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    path.write_text('swarm-resource = "DOCKER_RESOURCE_GPU"\n')
    monkeypatch.setattr(loading, "DEFAULT_PATH", str(path))
    assert load().swarm_resource == ("DOCKER_RESOURCE_GPU",)


def test_load_error_names_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("bogus = 1\n")
    with pytest.raises(NvcError, match=f"{path}: unknown key 'bogus'"):
        load(str(path))


def test_load_rejects_non_regular_and_oversized(tmp_path):
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(NvcError, match="not a regular file"):
        load(str(fifo))
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * loading.CONFIG_CAP)
    with pytest.raises(NvcError, match="larger than"):
        load(str(big))
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"root = \"\xff\"")
    with pytest.raises(NvcError, match="not UTF-8"):
        load(str(bad))


@pytest.mark.parametrize("value,present,expected", [
    ("@/sbin/ldconfig", True, "@/sbin/ldconfig.real"),
    ("/sbin/ldconfig", True, "/sbin/ldconfig.real"),        # a CDI hook's --ldconfig-path
    ("@/sbin/ldconfig", False, "@/sbin/ldconfig"),
    ("@/usr/sbin/ldconfig", True, "@/usr/sbin/ldconfig"),  # only the toolkit's own default name
    ("@/opt/sbin/ldconfig", True, "@/opt/sbin/ldconfig"),
])
def test_host_ldconfig_reads_sbin_ldconfig_as_the_binary_beside_it(value, present, expected):
    asked = []

    def exists(path):
        asked.append(path)
        return present

    assert cfg.host_ldconfig(value, exists) == expected
    assert asked in ([], ["/sbin/ldconfig.real"])


# nvidia-container-toolkit's config.toml as an operator has it (every key of REFERENCE §6.6 set)
TOOLKIT_FILE = '''
accept-nvidia-visible-devices-as-volume-mounts = true
accept-nvidia-visible-devices-envvar-when-unprivileged = false
disable-require = false
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"
swarm-resource = "DOCKER_RESOURCE_GPU"

[nvidia-container-cli]
debug = "/var/log/nvidia-container-toolkit.log"
environment = []
ldcache = "/etc/ld.so.cache"
ldconfig = "@/sbin/ldconfig"
load-kmods = true
no-cgroups = false
path = "/usr/bin/nvidia-container-cli"
root = "/run/nvidia/driver"
user = "root:video"
no-pivot = false

[nvidia-container-runtime]
debug = "/var/log/nvidia-container-runtime.log"
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc", "crun"]

[nvidia-container-runtime.modes.cdi]
annotation-prefixes = ["cdi.k8s.io/", "example.com/cdi/"]
default-kind = "nvidia.com/gpu"
spec-dirs = ["/etc/cdi", "/var/run/cdi"]

[nvidia-container-runtime.modes.csv]
mount-spec-path = "/etc/nvidia-container-runtime/host-files-for-container.d"

[nvidia-container-runtime.modes.legacy]
cuda-compat-mode = "ldconfig"

[nvidia-container-runtime-hook]
path = "nvidia-container-runtime-hook"
skip-mode-detection = false

[nvidia-ctk]
path = "nvidia-ctk"

[features]
allow-ldconfig-from-container = false
ignore-imex-channel-requests = true

[nvcontainer]
deadline = 20
allowed-devices = ["0"]
'''


def test_the_toolkit_file_as_is():
    c = parse(TOOLKIT_FILE, "/etc/nvidia-container-runtime/config.toml")
    assert (c.root, c.debug, c.user, c.runtime_debug) == (
        "/run/nvidia/driver", "/var/log/nvidia-container-toolkit.log", "root:video",
        "/var/log/nvidia-container-runtime.log")
    assert c.accept_volume_mounts and not c.accept_envvar_unprivileged
    assert c.swarm_resource == ("DOCKER_RESOURCE_GPU",)
    assert c.runtimes == ("docker-runc", "runc", "crun") and c.mode == "auto"
    assert c.cdi_annotation_prefixes == ("cdi.k8s.io/", "example.com/cdi/")
    assert c.cdi_spec_dirs == ("/etc/cdi", "/var/run/cdi") and c.cdi_default_kind == "nvidia.com/gpu"
    assert c.hook_path == "nvidia-container-runtime-hook"
    assert c.ignore_imex_channel_requests
    assert (c.deadline, c.allowed_devices) == (20, ("0",))
    # every upstream key without an effect here is reported, with its value and why
    inert = "\n".join(c.inert)
    for key in ("nvidia-container-cli.environment", "nvidia-container-cli.load-kmods = true",
                "nvidia-container-cli.path", "nvidia-container-cli.no-pivot", "nvidia-container-runtime.log-level",
                "nvidia-container-runtime.modes.csv.mount-spec-path", "nvidia-container-runtime-hook.skip-mode-detection",
                "nvidia-ctk.path", "features.allow-ldconfig-from-container = false"):
        assert key in inert, key
    assert len(c.inert) == 9
    assert "features.ignore-imex-channel-requests" not in inert
    report = c.report()
    assert report[0] == "configuration: /etc/nvidia-container-runtime/config.toml"
    assert "/etc/nvidia-container-runtime/config.toml: nvidia-container-cli.load-kmods = true: no effect here " \
           "(nvcontainer never loads kernel modules)" in report
    assert c.origin("root") == "/etc/nvidia-container-runtime/config.toml" and c.origin("cache_dir") == "default"


@pytest.mark.parametrize("value, mode", [('"auto"', "auto"), ('"legacy"', "legacy"), ('"cdi"', "cdi"),
                                         ('"jit-cdi"', "auto")])
def test_modes(value, mode):
    assert parse(f"[nvidia-container-runtime]\nmode = {value}").mode == mode


def test_upstream_compat_mode_hook_is_ldconfig():
    assert parse('[nvidia-container-runtime.modes.legacy]\ncuda-compat-mode = "hook"').cuda_compat_mode == "ldconfig"


def test_origins_follow_overrides():
    c = parse('root = "/drv"', "/f.toml").with_overrides(debug="/log")
    assert (c.origin("root"), c.origin("debug"), c.origin("user")) == ("/f.toml", "--debug", "default")


@pytest.fixture
def default_files(tmp_path, monkeypatch):
    ours, theirs = tmp_path / "nvcontainer.toml", tmp_path / "toolkit.toml"
    monkeypatch.setattr(loading, "DEFAULT_PATH", str(ours))
    monkeypatch.setattr(loading, "TOOLKIT_PATH", str(theirs))
    return ours, theirs


def test_the_toolkit_file_is_read_when_ours_is_absent(default_files):
    ours, theirs = default_files
    theirs.write_text('[nvidia-container-cli]\nroot = "/run/nvidia/driver"\n')
    c = load()
    assert c.root == "/run/nvidia/driver" and c.source == str(theirs) and c.note is None


def test_our_file_wins_and_says_so(default_files):
    ours, theirs = default_files
    ours.write_text('root = "/ours"\n')
    theirs.write_text('[nvidia-container-cli]\nroot = "/theirs"\n')
    c = load()
    assert c.root == "/ours" and c.source == str(ours)
    assert c.note == f"both {ours} and {theirs} exist: {ours} is read, {theirs} is not (nvcontainer's own file wins)"
    assert c.note in c.report()
    theirs.unlink()
    assert load().note is None


def test_a_broken_losing_file_is_not_read(default_files):
    ours, theirs = default_files
    ours.write_text("deadline = 5\n")
    theirs.write_text("this is not toml")
    assert load().deadline == 5


def test_neither_file_is_the_defaults(default_files):
    c = load()
    assert c == Config() and c.source is None and c.report() == ["configuration: none found, defaults"]


@pytest.mark.parametrize("text", ["", TOOLKIT_FILE, 'root = "/drv"\nno-cgroups = true\ndeadline = 2.5\n'])
def test_render_reads_back_as_the_same_settings(text):
    from nvcontainer.config import toolkit

    c = parse(text, "/f.toml")
    shown = toolkit.render(c)
    assert parse(shown) == c
    for line in shown.splitlines():
        assert line.startswith("#") or line.startswith("[") or not line or "  # from: " in line
    if c.root != "/":
        assert 'root = "/drv"  # from: /f.toml' in shown or 'root = "/run/nvidia/driver"  # from: /f.toml' in shown
    assert "# allowed-devices is unset (every device)  # from: default" in shown or c.allowed_devices


def test_nvcontainer_config_command(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "c.toml"
    path.write_text('[nvidia-container-cli]\nroot = "/drv"\nload-kmods = true\n')
    res = subprocess.run([sys.executable, "-m", "nvcontainer", "--config", str(path), "--ldcache", "/c", "config"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"# configuration: {path}\n# {path}: nvidia-container-cli.load-kmods = true: no effect")
    assert f'root = "/drv"  # from: {path}' in res.stdout
    assert 'ldcache = "/c"  # from: --ldcache' in res.stdout
    assert 'mode = "auto"  # from: default' in res.stdout
