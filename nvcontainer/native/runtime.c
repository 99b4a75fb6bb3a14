/*
 * nvidia-container-runtime's front: the OCI runtime an engine runs, without an interpreter
 * where none is needed.
 *
 * Why it exists: the shim sits on every container's path and is run several times per
 * container (create, start, state, kill, delete). A Python interpreter per call would cost a
 * node more than the hook ever did. This program executes the low-level runtime (runc, crun)
 * at once, with the engine's argv and environment unchanged, for every command but create and
 * run, and for a create whose config.json cannot be a GPU request. Only the rest goes to the
 * Python shim (nvcontainer/runtime/prepare.py), which makes every actual decision: it runs in a
 * forked child with `python -I`, a fixed environment, "/" as working directory, /dev/null as
 * stdin and stdout and no inherited fd but stderr, edits the spec, and hands back the runtime's
 * path on fd 3; this program then executes that runtime as above.
 *
 * "Cannot be a GPU request" is a bounded byte scan, conservative by construction: the spec is
 * read without following a symlink or blocking (O_NOFOLLOW|O_NONBLOCK, regular file, at most
 * 16 MiB), its JSON string escapes are decoded, and if none of the names a GPU request needs
 * (NVIDIA_VISIBLE_DEVICES, CUDA_VERSION, nvidia-container-devices, com.nvidia.volumes.needed,
 * the configured swarm-resource variables and CDI annotation prefixes) occurs anywhere, no
 * decision of the Python shim could edit it. Anything odd (a symlink, a FIFO, a huge file, a
 * config file this scanner does not fully understand) goes to Python, which says what is wrong.
 *
 * The configuration is read as prepare.py reads it (same files, same order); only three keys
 * matter here (runtimes, swarm-resource, annotation-prefixes), and only their plain one-line
 * forms are understood: any other spelling of them makes the answer "ask Python".
 *
 * nvcontainer/native/build.py builds it, writing nvc_config.h: NVC_PYTHON, the interpreter of
 * the install ("": python3 beside this program, as a wheel builds it), and NVC_CONFIG, a configuration file to read instead of the default ones ("").
 * With NVC_SCAN_TEST defined, main() is a test driver for the scanners (tests/test_runtime_front.py).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nvc_config.h"
#include "nvc_common.h"

#define SPEC_CAP (16 << 20)
#define REPLY_FD 3
#define MAX_REQUEST (64 << 10)   /* hook/client.py's MAX_REQUEST */
#ifndef NVC_SOCKET
#define NVC_SOCKET "/run/nvcontainer/hook.sock"
#endif

/* The same tables as nvcontainer/runtime/argv.py. */
static const char *const global_valued[] = {"--log", "--log-format", "--root", "--criu", "--rootless",
                                            "--log-level", "--cgroup-manager", NULL};
static const char *const create_valued[] = {"--bundle", "--console-socket", "--pid-file", "--preserve-fds",
                                            "--config", NULL};

static const char *prog = "nvidia-container-runtime";

/* ---- argv ----------------------------------------------------------------------------------- */

static int listed(const char *const *table, const char *name, size_t len)
{
    for (; *table; table++)
        if (strlen(*table) == len && memcmp(*table, name, len) == 0)
            return 1;
    return 0;
}

/* Options at argv[i...] as argv.py reads them; the index of the first other word. The values of
 * --bundle and --config (or -b, -f) are stored when asked for. */
static int skip_options(int argc, char **argv, int i, const char *const *valued, const char **bundle,
                        const char **config)
{
    for (; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--") == 0)
            return i + 1;
        if (arg[0] != '-' || arg[1] == '\0')
            break;
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
        char name[64];
        if (len + 2 > sizeof name)
            continue;
        if (len == 2 && arg[1] == 'b')
            snprintf(name, sizeof name, "--bundle");
        else if (len == 2 && arg[1] == 'f')
            snprintf(name, sizeof name, "--config");
        else if (arg[1] != '-' && len > 2)
            snprintf(name, sizeof name, "-%.*s", (int)len, arg);
        else
            snprintf(name, sizeof name, "%.*s", (int)len, arg);
        const char *value = eq ? eq + 1 : "";
        if (!eq && listed(valued, name, strlen(name))) {
            value = i + 1 < argc ? argv[i + 1] : "";
            i++;
        }
        if (bundle && strcmp(name, "--bundle") == 0)
            *bundle = value;
        if (config && strcmp(name, "--config") == 0)
            *config = value;
    }
    return i;
}


/* ---- running things ------------------------------------------------------------------------- */

static void say(const char *what, const char *detail)
{
    dprintf(2, "%s: runtime error: %s: %s\n", prog, what, detail);
}

static int same_file(const char *a, const char *b)
{
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

static int runnable(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0 &&
           !same_file(path, "/proc/self/exe");
}

/* The first runtime found, as lowlevel.find does; NULL if none (then Python explains). */
static char *find_runtime(const struct list *names)
{
    static const char *const defaults_[] = {"runc", "crun"};
    int n = names->count ? names->count : 2;
    for (int i = 0; i < n; i++) {
        const char *name = names->count ? names->items[i] : defaults_[i];
        const char *base = strrchr(name, '/') ? strrchr(name, '/') + 1 : name;
        if (strcmp(base, "nvidia-container-runtime") == 0 || strcmp(base, "nvcontainer-runtime") == 0)
            continue;
        if (name[0] == '/') {
            if (runnable(name))
                return strdup(name);
            continue;
        }
        const char *dir = SAFE_PATH;
        while (*dir) {
            size_t dlen = strcspn(dir, ":");
            char path[PATH_MAX];
            if (dlen && snprintf(path, sizeof path, "%.*s/%s", (int)dlen, dir, name) < (int)sizeof path &&
                runnable(path))
                return strdup(path);
            dir += dlen + (dir[dlen] == ':');
        }
    }
    return NULL;
}

static int run_runtime(const char *path, int argc, char **argv)
{
    if (same_file(path, "/proc/self/exe")) {
        say(path, "is this program: set runtimes in [nvidia-container-runtime] to runc or crun");
        return 1;
    }
    char **args = calloc((size_t)argc + 1, sizeof *args);
    if (!args) {
        say("memory", strerror(errno));
        return 1;
    }
    args[0] = (char *)path;
    for (int i = 1; i < argc; i++)
        args[i] = argv[i];
    execv(path, args);
    say(path, strerror(errno));
    return 1;
}

static void close_from(int low)
{
    if (syscall(SYS_close_range, low, ~0U, 0) == 0)
        return;
    long max = sysconf(_SC_OPEN_MAX);
    for (long fd = low; fd < (max > 0 && max < 65536 ? max : 65536); fd++)
        close((int)fd);
}

/* The Python shim's argv (python ... -- ENGINE-ARGS), NULL-terminated; reply_fd: with
 * --reply-fd 3 (the child below), or without (the server's child answers on its socket). */
#define PYTHON_WORDS 5   /* shim_args' "python -I -S -c CODE", before the half's own */

static char **shim_args(int argc, char **argv, const char *python, const char *cwd, int reply_fd)
{
    char **args = calloc((size_t)argc + 16, sizeof *args);
    if (!args)
        return NULL;
    int n = 0;
    args[n++] = (char *)python;
    args[n++] = "-I";   /* as front.c starts its interpreter: python -m nvcontainer.runtime's work */
    args[n++] = "-S";
    args[n++] = "-c";
    args[n++] = NVC_BOOT "import sys;from nvcontainer.runtime.prepare import main;sys.exit(main())";
    args[n++] = "--prog";
    args[n++] = (char *)prog;
    if (*NVC_CONFIG) {
        args[n++] = "--config";
        args[n++] = (char *)NVC_CONFIG;
    }
    args[n++] = "--cwd";
    args[n++] = (char *)cwd;
    if (reply_fd) {
        args[n++] = "--reply-fd";
        args[n++] = "3";
    }
    args[n++] = "--";
    for (int i = 1; i < argc; i++)
        args[n++] = argv[i];
    return args;
}

/* The Python shim's work done by `nvcontainer serve` (serve/request.py), which has it imported
 * and the inventory parsed: the same arguments, after the interpreter's path (the server
 * declines a front of another install), "/" as working directory, no environment, /dev/null as
 * stdin and stdout, this program's stderr and umask. -1 when no server took it (then the child
 * below does the work); else the runtime's exit status, or this program becomes the runtime. */
__attribute__((unused)) static int ask_server(int argc, char **argv, const char *python, const char *cwd)
{
    char **args = shim_args(argc, argv, python, cwd, 0);
    if (!args)
        return -1;
    /* the request's words: the interpreter, then the Python half's own arguments */
    int nargs = 0;
    while (args[PYTHON_WORDS + nargs])
        nargs++;
    args[PYTHON_WORDS - 1] = (char *)python;
    static char request[MAX_REQUEST];
    long used = nvc_encode(request, sizeof request, "NVR1", args + PYTHON_WORDS - 1, nargs + 1, NULL, 0);
    free(args);
    if (used < 0)
        return -1;
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    int root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    char reply[NVC_REPLY_MAX + 1], failure[128];
    ssize_t got = -1;
    if (null >= 0 && root >= 0) {
        int fds[4] = {null, null, 2, root};
        got = nvc_ask(NVC_SOCKET, request, (size_t)used, fds, reply, failure, sizeof failure);
    }
    if (null >= 0)
        close(null);
    if (root >= 0)
        close(root);
    int status = nvc_status(reply, got);
    if (status != NVC_OTHER)
        return status;
    if (got > 9 && memcmp(reply, "runtime /", 9) == 0 && nvc_printable(reply, got))
        return run_runtime(reply + 8, argc, argv);
    dprintf(2, "%s: runtime error: nvcontainer serve at %s: %s\n", prog, NVC_SOCKET,
            nvc_printable(reply, got) ? reply : failure);
    return 1;
}

/* The Python shim in a child: clean environment, "/" as cwd, the reply on fd 3. */
__attribute__((unused)) static int ask_python(int argc, char **argv, const char *python, const char *cwd)
{
    int reply[2];
    if (pipe2(reply, O_CLOEXEC) < 0) {
        say("pipe", strerror(errno));
        return 1;
    }
    pid_t parent = getpid();
    pid_t child = fork();
    if (child < 0) {
        say("fork", strerror(errno));
        return 1;
    }
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        if (reply[1] == REPLY_FD)
            fcntl(REPLY_FD, F_SETFD, 0);
        else if (dup2(reply[1], REPLY_FD) < 0)
            _exit(1);
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0 || chdir("/") < 0) {
            dprintf(2, "%s: runtime error: cannot start the Python shim: /dev/null or /: %s\n", prog, strerror(errno));
            _exit(1);
        }
        close_from(REPLY_FD + 1);
        char **args = shim_args(argc, argv, python, cwd, 1);
        if (!args)
            _exit(1);
        char *env[] = {"PATH=" SAFE_PATH, NULL};
        execve(python, args, env);
        dprintf(2, "%s: runtime error: cannot run %s: %s\n", prog, python, strerror(errno));
        _exit(1);
    }
    close(reply[1]);
    char path[PATH_MAX + 1];
    size_t used = 0;
    for (;;) {
        ssize_t got = read(reply[0], path + used, sizeof path - 1 - used);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        used += (size_t)got;
        if (used >= sizeof path - 1)
            break;
    }
    close(reply[0]);
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) {
            say("waiting for the Python shim", strerror(errno));
            return 1;
        }
    if (!WIFEXITED(status))
        return 1;
    if (WEXITSTATUS(status) != 0)
        return WEXITSTATUS(status);
    path[used] = '\0';
    if (used < 3 || path[0] != '/' || path[used - 1] != '\n' || memchr(path, '\0', used)) {
        say("the Python shim", "no runtime in its reply");
        return 1;
    }
    path[used - 1] = '\0';
    return run_runtime(path, argc, argv);
}

/* The index of the command word (argc if none); for create and run, its bundle and spec file
 * name options (left as they are when not given). */
static int command_of(int argc, char **argv, const char **bundle, const char **config)
{
    int i = skip_options(argc, argv, 1, global_valued, NULL, NULL);
    if (i < argc && (strcmp(argv[i], "create") == 0 || strcmp(argv[i], "run") == 0))
        skip_options(argc, argv, i + 1, create_valued, bundle, config);
    return i;
}

/* 1: the engine's command can go to the low-level runtime without the Python shim. */
static int answer_alone(int argc, char **argv, const struct settings *s)
{
    const char *bundle = "", *config = "";
    int i = command_of(argc, argv, &bundle, &config);
    if (i >= argc || (strcmp(argv[i], "create") != 0 && strcmp(argv[i], "run") != 0))
        return 1;
    if (!s->swarm.certain || !s->prefixes.certain)
        return 0;
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", *bundle ? bundle : ".", *config ? config : "config.json") >=
        (int)sizeof path)
        return 0;
    size_t len;
    char *spec = read_bounded(path, SPEC_CAP, 1, &len);
    if (!spec)
        return errno == ENOENT; /* none there: the runtime says so itself */
    int alone = cannot_be_gpu(spec, len, s);
    free(spec);
    return alone;
}

#ifndef NVC_SCAN_TEST
int main(int argc, char **argv)
{
    const char *base = argc > 0 && argv[0] ? strrchr(argv[0], '/') : NULL;
    if (argc > 0 && argv[0] && *argv[0])
        prog = base ? base + 1 : argv[0];
    struct settings s;
    load_settings(&s, NVC_CONFIG);
    if (s.readable && s.runtimes.certain && answer_alone(argc, argv, &s)) {
        char *runtime = find_runtime(&s.runtimes);
        if (runtime)
            return run_runtime(runtime, argc, argv);
    }
    char cwd[PATH_MAX];
    if (!getcwd(cwd, sizeof cwd)) {
        say("working directory", strerror(errno));
        return 1;
    }
    char buf[PATH_MAX];
    const char *python = nvc_python(buf, sizeof buf);
    if (!python) {
        say("interpreter", "cannot find python3 beside this program");
        return 1;
    }
    int status = ask_server(argc, argv, python, cwd);
    return status >= 0 ? status : ask_python(argc, argv, python, cwd);
}
#else
/* Test driver. `front config`: what the configuration scan understood. `front argv ARGS...`:
 * whether the command could be answered alone (bundle scan included). `front scan`: length-
 * prefixed specs on stdin (4 bytes, little endian), one verdict byte each on stdout: 'n' cannot
 * be a GPU request, 'm' may be. */
static void show(const char *name, const struct list *l)
{
    printf("%s %d", name, l->certain);
    for (int i = 0; i < l->count; i++)
        printf(" %s", l->items[i]);
    printf("\n");
}

int main(int argc, char **argv)
{
    struct settings s;
    load_settings(&s, NVC_CONFIG);
    if (argc >= 2 && strcmp(argv[1], "config") == 0) {
        printf("readable %d\n", s.readable);
        show("runtimes", &s.runtimes);
        show("swarm", &s.swarm);
        show("prefixes", &s.prefixes);
        char *runtime = find_runtime(&s.runtimes);
        printf("found %s\n", runtime ? runtime : "-");
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "argv") == 0) {
        const char *bundle = "-", *config = "-";
        int i = command_of(argc - 1, argv + 1, &bundle, &config);
        printf("%s %s %s %d\n", i < argc - 1 ? argv[i + 1] : "-", bundle, config,
               answer_alone(argc - 1, argv + 1, &s));
        return 0;
    }
    for (;;) {
        unsigned char head[4];
        if (fread(head, 1, 4, stdin) != 4)
            return 0;
        size_t len = head[0] | head[1] << 8 | head[2] << 16 | (size_t)head[3] << 24;
        char *spec = malloc(len + 1);
        if (!spec || fread(spec, 1, len, stdin) != len)
            return 1;
        putchar(cannot_be_gpu(spec, len, &s) ? 'n' : 'm');
        free(spec);
    }
}
#endif
