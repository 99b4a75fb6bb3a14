"""The first lines of every program the native fronts start (``python -I -S -c BOOT ENTRY``).

Why: ``site`` runs on every interpreter start before the first line of ours: it reads the
virtual environment's ``pyvenv.cfg``, lists ``site-packages``, executes the import lines of
its ``.pth`` files (an editable install's finder imports ``pathlib``, ``re``, ``urllib``...),
then looks for ``sitecustomize`` along the whole path (Ubuntu's imports apport's crash hook).
A runtime pays that on every container start of the in-process hook (3 to 6 ms on a real node,
docs/performance.md). The fronts therefore start the interpreter without ``site`` (``-S``,
still ``-I``) and run :func:`_nvc_boot` first, which gives the program the ``sys.path`` (and
``sys.prefix``, ``sys.exec_prefix``, ``sys._home``, the ``exit``/``help`` builtins) that
``site`` would give it under ``-I``, when the install is a virtual environment without the
system's site-packages whose ``.pth`` files hold only directory lines (a wheel or the package
in a venv, this project's benchmark installs). Anything else ``-S`` would drop (an ``import``
line: an editable install's finder; a file that is not plain
ASCII; an install outside a venv, but for the self-contained tree of scripts/bundle, whose
prefix is its own) makes it call ``site.main()`` itself, which is ``-I``'s start
exactly. Not run on the fast path, by design: ``sitecustomize`` (a host-wide hook; nothing of
ours needs it), the user site (``-I`` has none) and setuptools' distutils hack, the one import
line known to be harmless here (it acts only on ``import distutils`` and ``pip``).

Only the standard library is imported, nothing is read from the environment or the working
directory (every path is absolute, from the interpreter's own), and this module's text after
its docstring is embedded by ``build.py`` in each front; importing it only defines the function.
"""


def _nvc_boot():
    import os
    import site
    import sys

    before = sys.prefix, sys.exec_prefix

    def site_start():   # what -I without -S does, from where the interpreter left off
        sys.prefix, sys.exec_prefix = before
        site.main()
        return "site"

    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    prefix = os.path.dirname(exe_dir)
    for cfg in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(prefix, "pyvenv.cfg")):
        if os.path.isfile(cfg):
            break
    else:
        # the self-contained tree (scripts/bundle): an interpreter install of its own, no venv;
        # site would add exactly its prefix's site directories, as for a venv without the system's
        if not (os.path.isdir(os.path.join(prefix, "lib", "nvcontainer-scripts"))
                and sys.prefix == sys.exec_prefix == prefix):
            return site_start()
        cfg = None
    if [os.path.abspath(p) for p in sys.path] != sys.path or len(set(sys.path)) != len(sys.path):
        return site_start()
    system_site, home = ("true", None) if cfg else ("false", None)
    try:
        with open(cfg or os.devnull, encoding="utf-8") as f:
            for line in f:   # as site.venv() reads it
                if "=" in line:
                    key, _, value = line.partition("=")
                    key, value = key.strip().lower(), value.strip()
                    if key == "include-system-site-packages":
                        system_site = value.lower()
                    elif key == "home":
                        home = value
    except (OSError, ValueError):
        return site_start()
    if system_site == "true":
        return site_start()
    # setuptools' distutils hack (every venv python3.11 -m venv makes has it): its finder acts
    # only on top-level imports of distutils and pip, which none of our programs makes
    shim = ("import os; var = 'SETUPTOOLS_USE_DISTUTILS'; enabled = os.environ.get(var, 'local') == "
            "'local'; enabled and __import__('_distutils_hack').add_shim();")
    sys.prefix = sys.exec_prefix = prefix   # before getsitepackages: Debian's reads it
    known, added = set(sys.path), []
    for sitedir in site.getsitepackages([prefix]):
        if not os.path.isdir(sitedir):
            continue
        sitedir = os.path.abspath(sitedir)
        if sitedir not in known:
            added.append(sitedir)
            known.add(sitedir)
        try:
            names = sorted(name for name in os.listdir(sitedir) if name.endswith(".pth"))
        except OSError:
            continue
        for name in names:
            if name.startswith("."):   # newer Pythons skip hidden ones, older read them
                return site_start()
            try:
                with open(os.path.join(sitedir, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if not data.isascii():   # a BOM, another encoding: Pythons decode it each their way
                return site_start()
            for line in data.decode("ascii").split("\n"):
                if not line.replace("\t", " ").isprintable():   # \r, \v, \f, NUL: Pythons split
                    return site_start()                          # or refuse such lines their own ways
                if line.startswith("#") or not line.strip() or line.rstrip() == shim:
                    continue
                if line.startswith(("import ", "import\t")):
                    return site_start()
                path = os.path.abspath(os.path.join(sitedir, line.rstrip()))
                if path not in known and os.path.exists(path):
                    added.append(path)
                    known.add(path)
    sys.path.extend(added)
    sys._home = home
    site.PREFIXES, site.ENABLE_USER_SITE = [prefix], False
    site.setquit()
    site.setcopyright()
    site.sethelper()
    return "fast"
