/* The front of every Python program a runtime or an engine executes: nvcontainer-hook (the
 * prestart hook and the CDI hooks), nvidia-container-runtime-hook and nvidia-container-cli.
 *
 * Why: whoever runs these chooses their environment and working directory, and may be handing
 * on the image's (a createContainer hook without an explicit env, CVE-2025-23266). An
 * interpreter started from that environment runs code before any check of ours: LD_PRELOAD and
 * LD_AUDIT through the dynamic loader, PYTHONPATH (sitecustomize), PYTHONHOME, PYTHONSTARTUP
 * and PYTHONINSPECT through Python, GCONV_PATH through glibc, and the working directory through
 * the script directory on sys.path. This program is static (no loader reads LD_* for it), takes
 * none of its environment along, and executes the install's interpreter isolated (-I: no
 * PYTHON* variable, no user site, no script or working directory on sys.path) with a fixed
 * environment of PATH alone. The working directory is kept (it is the hooks' bundle), but
 * nothing is imported from it. Without site (-S) either: the code runs boot.py's lines first
 * (NVC_BOOT), which give it the sys.path site would, or run site itself where the install
 * needs it (an import line in a .pth file), so a start does not pay site's work for nothing.
 *
 * One program, several names (argv[0]); the interpreter is NVC_PYTHON when the build embeds
 * it (setup, the package), else python3 beside this program's own file (a venv's bin/).
 *
 * A container that asks for no GPU costs no interpreter: a prestart run with plain options
 * (--root, --ldcache, --user, --config; anything else, --debug and --dry-run included, goes to
 * Python) reads the state as the Python hook does and, when the bundle's config.json cannot be a
 * GPU request (nvc_common.h: the runtime shim's fuzzed scan, the same configuration read), exits
 * 0 at once. Otherwise the state it read becomes fd 0 again and Python decides.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nvc_config.h"
#include "nvc_common.h"

static const struct {
    const char *name;
    const char *code;
} ENTRIES[] = {
    {"nvcontainer-hook", NVC_BOOT "import sys;from nvcontainer.hook.main import main;sys.exit(main())"},
    {"nvidia-container-runtime-hook",
     NVC_BOOT "import sys;from nvcontainer.hook.main import main_nvidia_container_runtime_hook as m;sys.exit(m())"},
    {"nvidia-container-cli",
     NVC_BOOT "import sys;from nvcontainer.cli.nvcli import main_nvidia_container_cli as m;sys.exit(m())"},
};

static int is_hook(const char *name)
{
    return !strcmp(name, "nvcontainer-hook") || !strcmp(name, "nvidia-container-runtime-hook");
}


static const char *base(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

int main(int argc, char **argv)
{
    const char *name = argc > 0 && argv[0] ? base(argv[0]) : "";
    const char *code = NULL;
    for (size_t i = 0; i < sizeof ENTRIES / sizeof ENTRIES[0]; i++)
        if (!strcmp(name, ENTRIES[i].name))
            code = ENTRIES[i].code;
    if (!code) {
        fputs("nvcontainer: error: this program runs only as nvcontainer-hook, "
              "nvidia-container-runtime-hook or nvidia-container-cli\n", stderr);
        return 1;
    }
    if (is_hook(name)) {
        static const char *const plain[] = {"--root", "--ldcache", "--user", "--config", "-config", NULL};
        const char *config = plain_prestart(argc, argv, plain);
        if (config) {
            int status = prestart_alone(name, config);
            if (status >= 0)
                return status;
        }
    }
    char buf[PATH_MAX];
    const char *python = nvc_python(buf, sizeof buf);
    if (!python) {
        fprintf(stderr, "%s: error: cannot find the interpreter beside this program: %s\n", name,
                strerror(errno ? errno : ENOENT));
        return 1;
    }
    char **args = calloc((size_t)argc + 5, sizeof *args);
    if (!args) {
        fprintf(stderr, "%s: error: out of memory\n", name);
        return 1;
    }
    args[0] = (char *)python;
    args[1] = "-I";
    args[2] = "-S";
    args[3] = "-c";
    args[4] = (char *)code;
    for (int i = 1; i < argc; i++)
        args[i + 4] = argv[i];
    char *env[] = {"PATH=" SAFE_PATH, NULL};
    execve(python, args, env);
    fprintf(stderr, "%s: error: cannot run %s: %s\n", name, python, strerror(errno));
    return 1;
}
