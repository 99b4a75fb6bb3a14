/* The interpreter's front in the self-contained build (scripts/bundle, docs/install.md).
 *
 * Why: the build carries Debian's python3.11 together with its own C library and its own
 * dynamic loader, so that it runs on a host whatever its glibc and whatever its Python. A
 * program whose ELF header names an interpreter (the loader) is loaded by the kernel with that
 * absolute path, which would be the host's /lib64/ld-linux-x86-64.so.2 and the host's glibc.
 * So the real interpreter (lib/python3.11-bin) is never executed directly: this static program
 * executes the tree's own loader with it, the tree's lib/ as the only library path (which the
 * loader takes instead of LD_LIBRARY_PATH), and <tree>/bin/python3 as argv[0], from which
 * Python finds its prefix (lib/python3.11/os.py one level above bin/) as if it had been
 * executed from there. The tree is found from this program's own file (/proc/self/exe), never
 * from a compiled-in path: the tree may be copied anywhere (`nvcontainer install`).
 *
 * Called as python3 (or python3.11, python) it is the interpreter, with the caller's
 * arguments and environment: the native fronts beside it execute it with their fixed
 * environment, as they executed a venv's python3. Called by any other name NAME it runs the
 * console script lib/nvcontainer-scripts/NAME with -I (bin/nvcontainer): a script's "#!" line
 * would need an absolute path to the interpreter, which a relocatable tree cannot have.
 *
 * Static (musl where the build machine has it): it must run before any C library of the tree
 * is there to load, and the host's may be too old or absent.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LOADER "lib/ld-linux-x86-64.so.2"
#define REAL_PYTHON "lib/python3.11-bin"
#define SCRIPTS "lib/nvcontainer-scripts"

static int join(char *buf, size_t size, const char *tree, const char *rest)
{
    int n = snprintf(buf, size, "%s/%s", tree, rest);
    return n > 0 && (size_t)n < size;
}

int main(int argc, char **argv)
{
    const char *name = argc > 0 && argv[0] ? argv[0] : "python3";
    const char *slash = strrchr(name, '/');
    if (slash)
        name = slash + 1;
    char tree[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", tree, sizeof tree - 1);
    if (n <= 0) {
        fprintf(stderr, "%s: error: cannot find this program's own file (/proc/self/exe; is /proc mounted?): %s\n", name,
                strerror(errno ? errno : ENOENT));
        return 127;
    }
    tree[n] = '\0';
    for (int up = 0; up < 2; up++) {   /* <tree>/bin/NAME -> <tree> */
        char *cut = strrchr(tree, '/');
        if (!cut || cut == tree) {
            fprintf(stderr, "%s: error: this program is not in the bin/ of an nvcontainer tree\n", name);
            return 127;
        }
        *cut = '\0';
    }
    char loader[PATH_MAX], libs[PATH_MAX], self[PATH_MAX], real[PATH_MAX], script[PATH_MAX];
    int python = !strncmp(name, "python", 6);
    if (!join(loader, sizeof loader, tree, LOADER) || !join(libs, sizeof libs, tree, "lib") ||
        !join(self, sizeof self, tree, "bin/python3") || !join(real, sizeof real, tree, REAL_PYTHON) ||
        (!python && !join(script, sizeof script, tree, SCRIPTS "/") ) ||
        (!python && strlen(script) + strlen(name) >= sizeof script)) {
        fprintf(stderr, "%s: error: the tree's path is too long: %s\n", name, tree);
        return 127;
    }
    if (!python)
        strcat(script, name);
    char **args = calloc((size_t)argc + 10, sizeof *args);
    if (!args) {
        fprintf(stderr, "%s: error: out of memory\n", name);
        return 127;
    }
    int i = 0;
    args[i++] = loader;
    args[i++] = "--library-path";
    args[i++] = libs;
    args[i++] = "--argv0";
    args[i++] = self;
    args[i++] = real;
    if (!python) {
        args[i++] = "-I";
        args[i++] = script;
    }
    for (int a = 1; a < argc; a++)
        args[i++] = argv[a];
    args[i] = NULL;
    extern char **environ;
    execve(loader, args, environ);
    fprintf(stderr, "%s: error: cannot run %s: %s\n", name, loader, strerror(errno));
    return 127;
}
