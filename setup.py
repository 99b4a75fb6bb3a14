"""The one build step pyproject.toml cannot declare: the native programs.

Runtimes and engines execute nvcontainer-hook, nvidia-container-runtime-hook and
nvidia-container-cli with an environment they chose (possibly the image's); a console script
would start the interpreter from it, so these names are the static native front of
``nvcontainer/native/front.c`` instead, compiled here when a wheel is built and installed into
the environment's ``bin/`` (it finds the interpreter beside itself). Without a C compiler they are
Python scripts run with ``-I`` (PYTHON* variables and the working directory ignored, but the
loader's LD_* variables not): and the build says so loudly.

Where the compiler is there, the same build makes the other native programs the README presents
as commands, into the same ``bin/``: the runtime shim (``nvidia-container-runtime``, also as
``nvcontainer-runtime``) and the served hook client (``nvcontainer-hook-client``), each finding
the interpreter beside itself as the fronts do. Without one they are left out, loudly, and
``nvcontainer setup ENGINE`` builds them on the node (it needs a compiler then). An editable
install does not install these files: scripts/install builds the fronts into the venv itself.
"""

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvcontainer.native import build  # noqa: E402  (the source tree's, before it is installed)

OUT = os.path.join("build", "nvcontainer-fronts")
SCRIPT = """#!python -I
import sys
from {module} import {function} as main
sys.exit(main())
"""
ENTRIES = {
    "nvcontainer-hook": ("nvcontainer.hook.main", "main"),
    "nvidia-container-runtime-hook": ("nvcontainer.hook.main", "main_nvidia_container_runtime_hook"),
    "nvidia-container-cli": ("nvcontainer.cli.nvcli", "main_nvidia_container_cli"),
}

os.makedirs(OUT, exist_ok=True)
files = [os.path.join(OUT, name) for name in build.FRONT_NAMES]
natives = []
try:
    natives = [os.path.join(OUT, name) for name in build.build_installed(OUT)]
except (build.NvcError, OSError) as exc:
    sys.stderr.write(f"WARNING: nvcontainer: {', '.join(build.RUNTIME_NAMES)} and {build.NAME} were not "
                     f"built ({exc}); `nvcontainer setup ENGINE` builds them on the node\n")
try:
    build.build_fronts(OUT)
except (build.NvcError, OSError) as exc:  # no compiler, or it failed: the -I scripts, and a warning
    sys.stderr.write(f"WARNING: nvcontainer: the native entry fronts were not built ({exc}); "
                     "nvcontainer-hook, nvidia-container-runtime-hook and nvidia-container-cli are "
                     "Python scripts with -I, which LD_PRELOAD still reaches\n")
    for name, path in zip(build.FRONT_NAMES, files):
        with open(path, "w") as f:
            f.write(SCRIPT.format(module=ENTRIES[name][0], function=ENTRIES[name][1]))
    setup(scripts=files, data_files=[("bin", natives)] if natives else [])
else:
    setup(data_files=[("bin", files + natives)])
