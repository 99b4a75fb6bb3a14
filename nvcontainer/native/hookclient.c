/*
 * The hook's fast path as a native program: hookclient.py's protocol, without an interpreter.
 *
 * Why it exists: a container start waits for the hook, and a Python interpreter takes about
 * 8 ms to start before hookclient.py can say a word to the server (docs/performance.md). This
 * program does the same three things in well under a millisecond: hand argv, umask, PATH and
 * CUDA_MPS_PIPE_DIRECTORY and fds 0, 1, 2 and the working directory to `nvcontainer serve`;
 * exit with the status the server answers; or, when nothing listens or the server declines,
 * exec the full Python hook (`PYTHON -I -m nvcontainer.hook ARGS`) exactly as hookclient.py does.
 * hookclient.py is the specification and tests hold the two to the same bytes and behaviour.
 *
 * `nvcontainer setup --serve` builds it (nvcontainer/nativeclient.py), writing nvc_config.h:
 * NVC_PYTHON, the interpreter of the install ("": python3 beside this program, as a wheel
 * builds it), and NVC_VALUED, hookclient.OPTIONS's options
 * that take a value, so the --socket scan reads the same table as the hook's parser.
 *
 * A container that asks for no GPU is answered here, with neither server nor interpreter: a
 * prestart run with plain options (--socket, --root, --ldcache, --user, --config) reads the
 * state as the Python hook does and scans the bundle's config.json with the runtime shim's
 * fuzzed scan (nvc_common.h); when it cannot ask, exit 0. Otherwise the state it read becomes
 * fd 0 again (a memfd), which the server or the Python hook reads as they would have read stdin.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nvc_config.h"
#include "nvc_common.h"

#define SOCKET_DEFAULT "/run/nvcontainer/hook.sock"
#define MAX_REQUEST (64 << 10)
#define PROG "nvcontainer-hook"

static const char *const valued[] = {NVC_VALUED, NULL};
static const char *const env_names[] = {"PATH", "CUDA_MPS_PIPE_DIRECTORY", NULL};

static int is_valued(const char *name, size_t len)
{
    for (const char *const *v = valued; *v; v++)
        if (strlen(*v) == len && memcmp(*v, name, len) == 0)
            return 1;
    return 0;
}

/* --socket PATH among the global options (before the stage word), else the default. */
static const char *socket_path(int argc, char **argv)
{
    const char *path = SOCKET_DEFAULT;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (arg[0] != '-')
            break;
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
        const char *value = eq ? eq + 1 : "";
        if (!eq && is_valued(arg, len)) {
            value = i + 1 < argc ? argv[i + 1] : "";
            i++;
        }
        if (len == 8 && memcmp(arg, "--socket", 8) == 0)
            path = value;
    }
    return path;
}

/* The request bytes of hookclient.encode_request; -1 if over MAX_REQUEST (the Python client
 * would have its send refused by the server's size check and run in-process: so do we). */
static long encode_request(char *buf, int argc, char **argv)
{
    const char *env[2];
    static char pair[2][MAX_REQUEST];
    int nenv = 0;
    for (const char *const *n = env_names; *n; n++) {
        const char *v = getenv(*n);
        if (!v)
            continue;
        int len = snprintf(pair[nenv], sizeof pair[nenv], "%s=%s", *n, v);
        if (len < 0 || (size_t)len >= sizeof pair[nenv])
            return -1;
        env[nenv] = pair[nenv];
        nenv++;
    }
    return nvc_encode(buf, MAX_REQUEST, "NVC1", argv + 1, argc - 1, env, nenv);
}

static void say(const char *path, const char *detail)
{
    dprintf(2, "%s: error: nvcontainer serve at %s: %s\n", PROG, path, detail);
}

/* The exit status of the run done by the server, or -1 when no server took it. */
static int forward(int argc, char **argv)
{
    const char *path = socket_path(argc, argv);
    static char request[MAX_REQUEST];
    long size = encode_request(request, argc, argv);
    if (size < 0)
        return -1;
    int cwd = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (cwd < 0)
        return -1;
    int fds[4] = {0, 1, 2, cwd};
    char reply[NVC_REPLY_MAX + 1], failure[128];
    ssize_t got = nvc_ask(path, request, (size_t)size, fds, reply, failure, sizeof failure);
    close(cwd);
    int status = nvc_status(reply, got);
    if (status != NVC_OTHER)
        return status;
    say(path, nvc_printable(reply, got) ? reply : failure);
    return 1;
}


int main(int argc, char **argv)
{
    static const char *const plain[] = {"--socket", "--root", "--ldcache", "--user", "--config", NULL};
    const char *config = plain_prestart(argc, argv, plain);
    if (config) {
        int alone = prestart_alone(PROG, config);
        if (alone >= 0)
            return alone;
    }
    int status = forward(argc, argv);
    if (status >= 0)
        return status;
    /* Nobody took it: the full hook in the install's interpreter, from a fixed environment
     * (the runtime's may be the image's: LD_PRELOAD, GCONV_PATH and the like would reach the
     * dynamic interpreter) and isolated (-I: no PYTHON* variable, nothing from the cwd), started
     * as front.c starts it (-S and the boot code: python -m nvcontainer.hook's work). */
    char *env[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", NULL};
    char **args = calloc((size_t)argc + 5, sizeof *args);
    if (!args) {
        dprintf(2, "%s: error: out of memory\n", PROG);
        return 1;
    }
    char buf[PATH_MAX];
    const char *python = nvc_python(buf, sizeof buf);
    if (!python) {
        dprintf(2, "%s: error: cannot find python3 beside this program\n", PROG);
        return 1;
    }
    args[0] = (char *)python;
    args[1] = "-I";
    args[2] = "-S";
    args[3] = "-c";
    args[4] = NVC_BOOT "import sys;from nvcontainer.hook.main import run;sys.exit(run(sys.argv[1:]))";
    for (int i = 1; i < argc; i++)
        args[i + 4] = argv[i];
    execve(python, args, env);
    dprintf(2, "%s: error: cannot run %s: %s\n", PROG, python, strerror(errno));
    return 1;
}
