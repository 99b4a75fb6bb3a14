/*
 * What the native fronts share (runtime.c, hookclient.c, front.c): asking `nvcontainer serve`,
 * bounded reads of files we did not write,
 * and the three keys of the configuration that decide whether a container can be a GPU
 * request at all (runtimes, swarm-resource, annotation-prefixes), read as the Python code
 * reads the configuration file, in their plain one-line forms only: any other spelling makes
 * a key "uncertain", and an uncertain answer always means "ask Python".
 *
 * A header of static functions, included once per program: each front is one translation unit
 * (nvcontainer/native/build.py compiles one source file per program).
 */
#ifndef NVC_COMMON_H
#define NVC_COMMON_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define SAFE_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#ifndef NVC_PYTHON
#define NVC_PYTHON ""
#endif
#ifndef NVC_BOOT   /* the Python run before each program's own line (build.py: boot.py) */
#error "NVC_BOOT: nvc_config.h is written by nvcontainer/native/build.py"
#endif
#define DEFAULT_CONFIG "/etc/nvcontainer/config.toml"
#define TOOLKIT_CONFIG "/etc/nvidia-container-runtime/config.toml"
#define CONFIG_CAP (1 << 20)
#define MAX_NAMES 64

struct list {
    int certain;             /* 0: the file may set it in a way not understood here */
    int count;
    char *items[MAX_NAMES];
};

struct settings {
    int readable;            /* 0: the file could not be read as prepare.py would */
    struct list runtimes, swarm, prefixes;
};

/* The install's interpreter: NVC_PYTHON when the build embeds one (set-up, the package), else
 * python3 in the directory of this program's own file (/proc/self/exe, links resolved), written
 * to buf: a wheel's programs are built before anyone knows which environment installs them, and
 * land in its bin/ beside its python3. NULL when that path cannot be had. */
static inline const char *nvc_python(char *buf, size_t size)
{
    if (*NVC_PYTHON)
        return NVC_PYTHON;
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return NULL;
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (!slash)
        return NULL;
    *slash = '\0';
    int len = snprintf(buf, size, "%s/python3", self);
    return len > 0 && (size_t)len < size ? buf : NULL;
}

/* ---- asking nvcontainer serve --------------------------------------------------------------- */

#define NVC_REPLY_MAX 4096
#define NVC_REPLY_TIMEOUT_MS (600 * 1000)   /* the server bounds every run; this bounds a wedged one */

/* One request to `nvcontainer serve` (hook/client.py's wire format; the caller encodes it) with
 * four fds, and its answer. Returns -1 when no server took it (nothing listens at path, or the
 * send failed): the caller then does the work itself. Otherwise the answer's length, the answer
 * NUL-terminated in reply (NVC_REPLY_MAX + 1 bytes); 0 when none came, with why in failure. */
static inline ssize_t nvc_ask(const char *path, const char *request, size_t size, const int fds[4],
                              char *reply, char *failure, size_t failure_size)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (!*path || strlen(path) >= sizeof addr.sun_path)
        return -1;
    strcpy(addr.sun_path, path);
    int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return -1;
    if (connect(sock, (struct sockaddr *)&addr, sizeof addr) < 0) {
        close(sock);
        return -1;
    }
    union {
        char buf[CMSG_SPACE(4 * sizeof(int))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof control);
    struct iovec iov = {.iov_base = (void *)request, .iov_len = size};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(4 * sizeof(int));
    memcpy(CMSG_DATA(cmsg), fds, 4 * sizeof(int));
    if (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0) {
        close(sock);
        return -1; /* e.g. a closed stdio fd: the caller's own run reports it its own way */
    }
    snprintf(failure, failure_size, "no answer");
    ssize_t got = -1;
    struct pollfd pfd = {.fd = sock, .events = POLLIN};
    int ready;
    do
        ready = poll(&pfd, 1, NVC_REPLY_TIMEOUT_MS);
    while (ready < 0 && errno == EINTR);
    if (ready > 0) {
        do
            got = recv(sock, reply, NVC_REPLY_MAX, 0);
        while (got < 0 && errno == EINTR);
    }
    if (ready == 0)
        snprintf(failure, failure_size, "no answer (timed out)");
    else if (ready < 0 || got < 0)
        snprintf(failure, failure_size, "no answer (%s)", strerror(errno));
    close(sock);
    if (got < 0)
        got = 0;
    reply[got] = '\0';
    return got;
}

/* hook/client.py's encode_request with `magic` as its first word: "MAGIC <pid> <umask> <nwords>
 * <nenv>\n", then each word and each NAME=value pair, each ending in NUL. -1 when it would not
 * fit in cap (the server would refuse it by its size; the caller does the work itself). */
static inline long nvc_encode(char *buf, size_t cap, const char *magic, char *const *words, int nwords,
                              const char *const *env, int nenv)
{
    mode_t mask = umask(022);
    umask(mask);
    int len = snprintf(buf, cap, "%s %d %u %d %d\n", magic, (int)getpid(), (unsigned)mask, nwords, nenv);
    if (len < 0 || (size_t)len >= cap)
        return -1;
    size_t used = (size_t)len;
    for (int i = 0; i < nwords + nenv; i++) {
        const char *s = i < nwords ? words[i] : env[i - nwords];
        size_t n = strlen(s) + 1;
        if (n > cap - used)
            return -1;
        memcpy(buf + used, s, n);
        used += n;
    }
    return (long)used;
}

#define NVC_UNTAKEN (-1)   /* no server answered (got < 0), or it declined: do the work yourself */
#define NVC_OTHER (-2)     /* any other answer, left to the caller */

/* nvc_ask's outcome read as both clients read it: NVC_UNTAKEN, the exit status of "rc N", or
 * NVC_OTHER. */
static inline int nvc_status(const char *reply, ssize_t got)
{
    if (got < 0 || (got >= 9 && memcmp(reply, "declined ", 9) == 0))
        return NVC_UNTAKEN;
    if (got > 3 && got < 8 && memcmp(reply, "rc ", 3) == 0 && strspn(reply + 3, "0123456789") == (size_t)(got - 3))
        return atoi(reply + 3);
    return NVC_OTHER;
}

/* 1 if the answer is printable ASCII (then it may be shown as the server's words). */
static inline int nvc_printable(const char *reply, ssize_t len)
{
    for (ssize_t i = 0; i < len; i++)
        if (reply[i] < 0x20 || reply[i] > 0x7e)
            return 0;
    return len > 0;
}

/* ---- reading ------------------------------------------------------------------------------ */

/* The whole file, NUL-terminated, at most cap bytes; NULL with errno set otherwise (EFBIG:
 * larger than cap, EINVAL: not a regular file). */
static inline char *read_bounded(const char *path, size_t cap, int nofollow, size_t *len)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC | (nofollow ? O_NOFOLLOW : 0));
    if (fd < 0)
        return NULL;
    struct stat st;
    int bad = fstat(fd, &st) < 0 ? errno : !S_ISREG(st.st_mode) ? EINVAL : (size_t)st.st_size > cap ? EFBIG : 0;
    if (bad) {
        close(fd);
        errno = bad;
        return NULL;
    }
    char *buf = malloc(cap + 2);
    size_t used = 0;
    while (buf && used <= cap) {
        ssize_t got = read(fd, buf + used, cap + 1 - used);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            free(buf);
            buf = NULL;
            break;
        }
        if (got == 0)
            break;
        used += (size_t)got;
    }
    int e = errno;
    close(fd);
    if (buf && used > cap) {
        free(buf);
        buf = NULL;
        e = EFBIG;
    }
    if (!buf) {
        errno = e;
        return NULL;
    }
    buf[used] = '\0';
    *len = used;
    return buf;
}

/* ---- the configuration's three keys ------------------------------------------------------- */

static inline const char *skip_space(const char *p)
{
    while (*p == ' ' || *p == '\t')
        p++;
    return p;
}

/* The rest of a line after a value: spaces, then nothing or a comment. */
static inline int line_ends(const char *p, const char *end)
{
    p = skip_space(p);
    return p == end || *p == '#';
}

/* One TOML basic or literal string without escapes at *pp; its content is copied out. */
static inline char *string_at(const char **pp, const char *end)
{
    const char *p = *pp;
    char quote = *p;
    if (quote != '"' && quote != '\'')
        return NULL;
    const char *close = memchr(p + 1, quote, (size_t)(end - p - 1));
    if (!close || memchr(p + 1, '\\', (size_t)(close - p - 1)))
        return NULL;
    *pp = close + 1;
    return strndup(p + 1, (size_t)(close - p - 1));
}

static inline int add_item(struct list *l, const char *s, size_t n)
{
    while (n && (*s == ' ' || *s == '\t'))
        s++, n--;
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t'))
        n--;
    if (!n)
        return 0;
    if (l->count >= MAX_NAMES)
        return -1;
    l->items[l->count++] = strndup(s, n);
    return 0;
}

/* `= "a,b"` (split on commas when split is set) or `= ["a", 'b']` up to end; -1 if not that. */
static inline int parse_value(const char *p, const char *end, struct list *l, int split)
{
    p = skip_space(p);
    if (*p != '=')
        return -1;
    p = skip_space(p + 1);
    if (*p == '[') {
        p = skip_space(p + 1);
        while (p < end && *p != ']') {
            char *s = string_at(&p, end);
            if (!s || add_item(l, s, strlen(s)) < 0) {
                free(s);
                return -1;
            }
            free(s);
            p = skip_space(p);
            if (*p == ',')
                p = skip_space(p + 1);
            else if (*p != ']')
                return -1;
        }
        if (p >= end)
            return -1;
        return line_ends(p + 1, end) ? 0 : -1;
    }
    char *s = string_at(&p, end);
    if (!s)
        return -1;
    int ok = line_ends(p, end);
    for (char *item = s, *comma; ok && item; item = comma ? comma + 1 : NULL) {
        comma = split ? strchr(item, ',') : NULL;
        if (add_item(l, item, comma ? (size_t)(comma - item) : strlen(item)) < 0)
            ok = 0;
    }
    free(s);
    return ok ? 0 : -1;
}

struct key {
    const char *name, *table;
    struct list *list;
    int split;
};

/* Scan the file's lines for the keys: each must be defined at most once, on one line, in its
 * table, with a plain value; every other mention must be a comment line. */
static inline void scan_config(const char *text, size_t len, struct key *keys, int nkeys)
{
    if (memmem(text, len, "\\u", 2) || memmem(text, len, "\\U", 2) || memmem(text, len, "\"\"\"", 3) ||
        memmem(text, len, "'''", 3))
        return; /* escapes in key names or multi-line strings: leave every key uncertain */
    for (int k = 0; k < nkeys; k++)
        keys[k].list->certain = 1;
    int defined[8] = {0};
    char table[256] = "";
    int table_known = 1;
    for (const char *line = text; line < text + len;) {
        const char *end = memchr(line, '\n', (size_t)(text + len - line));
        if (!end)
            end = text + len;
        const char *p = skip_space(line);
        if (*p == '[') {
            const char *close = memchr(p, ']', (size_t)(end - p));
            const char *name = skip_space(p + 1), *name_end = close;
            while (name_end && name_end > name && (name_end[-1] == ' ' || name_end[-1] == '\t'))
                name_end--;
            size_t n = close ? (size_t)(name_end - name) : 0;
            int bare = n > 0 && n < sizeof table && strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                                "0123456789_.-") >= n;
            if (p[1] == '[') {
                table_known = 0; /* an array of tables: none of ours */
            } else if (bare && line_ends(close + 1, end)) {
                memcpy(table, name, n);
                table[n] = '\0';
                table_known = 1;
            } else {
                for (int k = 0; k < nkeys; k++)
                    keys[k].list->certain = 0; /* a line that may be a header we cannot read */
            }
        }
        for (int k = 0; k < nkeys; k++) {
            size_t klen = strlen(keys[k].name);
            const char *at = memmem(line, (size_t)(end - line), keys[k].name, klen);
            if (!at || *p == '#')
                continue;
            int defines = at == p && table_known && strcmp(table, keys[k].table) == 0 && !defined[k] &&
                          (p[klen] == ' ' || p[klen] == '\t' || p[klen] == '=');
            if (defines && parse_value(p + klen, end, keys[k].list, keys[k].split) == 0)
                defined[k] = 1;
            else
                keys[k].list->certain = 0;
        }
        line = end + 1;
    }
}

static inline void defaults(struct settings *s)
{
    memset(s, 0, sizeof *s);
    s->readable = 1;
    s->runtimes.certain = s->swarm.certain = s->prefixes.certain = 1;
}

/* The configuration as the Python code reads it: ``explicit`` (which must exist) or, when it is
 * empty, the first of the two default files present. Only the three keys are looked at. */
static inline void load_settings(struct settings *s, const char *explicit)
{
    defaults(s);
    const char *paths[2] = {explicit, NULL};
    if (!*explicit) {
        paths[0] = DEFAULT_CONFIG;
        paths[1] = TOOLKIT_CONFIG;
    }
    char *text = NULL;
    size_t len = 0;
    for (int i = 0; i < 2 && paths[i] && !text; i++) {
        text = read_bounded(paths[i], CONFIG_CAP, 0, &len);
        if (!text && (errno != ENOENT || *explicit)) {
            s->readable = 0; /* prepare.py will say what is wrong with it */
            return;
        }
    }
    if (!text)
        return;
    struct key keys[] = {
        {"runtimes", "nvidia-container-runtime", &s->runtimes, 0},
        {"swarm-resource", "", &s->swarm, 1},
        {"annotation-prefixes", "nvidia-container-runtime.modes.cdi", &s->prefixes, 0},
    };
    s->runtimes.certain = s->swarm.certain = s->prefixes.certain = 0;
    scan_config(text, len, keys, 3);
    free(text);
}

/* Names a GPU request cannot do without (the hook's and the shim's rules alike). */
static const char *const fixed_needles[] = {"NVIDIA_VISIBLE_DEVICES", "CUDA_VERSION", "nvidia-container-devices",
                                            "com.nvidia.volumes.needed", NULL};

/* ---- the spec scan -------------------------------------------------------------------------- */

static inline int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* The text with JSON's string escapes decoded in place: \uXXXX below 0x80 as that byte, any
 * other code unit as 0x80 (no needle has it), \n, \", \\ ... as the character. */
static inline size_t decode_escapes(char *s, size_t len)
{
    size_t out = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] != '\\' || i + 1 >= len) {
            s[out++] = s[i];
            continue;
        }
        char c = s[++i];
        if (c == 'u' && i + 4 < len && hexval(s[i + 1]) >= 0 && hexval(s[i + 2]) >= 0 && hexval(s[i + 3]) >= 0 &&
            hexval(s[i + 4]) >= 0) {
            int v = hexval(s[i + 1]) << 12 | hexval(s[i + 2]) << 8 | hexval(s[i + 3]) << 4 | hexval(s[i + 4]);
            s[out++] = v < 0x80 ? (char)v : (char)0x80;
            i += 4;
        } else {
            static const char from[] = "bfnrt", to[] = "\b\f\n\r\t";
            const char *m = memchr(from, c, 5);
            s[out++] = m ? to[m - from] : c;
        }
    }
    return out;
}

static inline int mentions(const char *text, size_t len, const struct list *l)
{
    for (int i = 0; i < l->count; i++)
        if (memmem(text, len, l->items[i], strlen(l->items[i])))
            return 1;
    return 0;
}

/* 1: the spec cannot be a GPU request; 0: it may be (or could not be read as it must be). */
static inline int cannot_be_gpu(char *spec, size_t len, const struct settings *s)
{
    len = decode_escapes(spec, len);
    for (const char *const *n = fixed_needles; *n; n++)
        if (memmem(spec, len, *n, strlen(*n)))
            return 0;
    if (mentions(spec, len, &s->swarm))
        return 0;
    if (!s->prefixes.count && s->prefixes.certain) /* the default */
        return memmem(spec, len, "cdi.k8s.io/", 11) == NULL;
    return !mentions(spec, len, &s->prefixes);
}

/* ---- the prestart hook's state, and the container that asks for nothing -------------------- */

#include <poll.h>
#include <strings.h>
#include <sys/mman.h>
#include <time.h>

#define STATE_CAP (1 << 20)   /* as nvcontainer/request/oci.py */
#define STATE_SECONDS 5
#ifndef SPEC_CAP
#define SPEC_CAP (16 << 20)
#endif

/* The state from fd 0 as oci.read_document reads it: up to the end of the first complete JSON
 * object (braces balanced outside strings), end of file, STATE_CAP bytes or STATE_SECONDS.
 * *status: 0 complete or at end of file, 1 timed out, 2 too large, 3 read error. */
static inline char *read_state(size_t *len, int *status)
{
    char *buf = malloc(STATE_CAP + 2);
    size_t used = 0;
    int depth = 0, in_string = 0, escaped = 0, started = 0;
    struct timespec t0, now;
    *status = 3;
    if (!buf)
        return NULL;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        long left = STATE_SECONDS * 1000L - ((now.tv_sec - t0.tv_sec) * 1000L + (now.tv_nsec - t0.tv_nsec) / 1000000L);
        if (left <= 0) {
            *status = 1;
            break;
        }
        struct pollfd p = {0, POLLIN, 0};
        int r = poll(&p, 1, (int)left);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            *status = r == 0 ? 1 : 3;
            break;
        }
        ssize_t n = read(0, buf + used, STATE_CAP + 1 - used);
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (n < 0)
            break;
        if (n == 0) {
            *status = 0;
            break;
        }
        int complete = 0;
        for (ssize_t i = 0; i < n; i++) {
            char c = buf[used + i];
            if (in_string) {
                if (escaped)
                    escaped = 0;
                else if (c == '\\')
                    escaped = 1;
                else if (c == '"')
                    in_string = 0;
            } else if (c == '"') {
                in_string = 1;
            } else if (c == '{' || c == '[') {
                depth++, started = 1;
            } else if (c == '}' || c == ']') {
                if (--depth == 0 && started)
                    complete = 1;
            }
        }
        used += (size_t)n;
        if (used > STATE_CAP) {
            *status = 2;
            break;
        }
        if (complete) {
            *status = 0;
            break;
        }
    }
    buf[used] = '\0';
    *len = used;
    return buf;
}

static inline int count_keys(const char *text, const char *key)
{
    int n = 0;
    size_t klen = strlen(key);
    for (const char *p = text; (p = strcasestr(p, key)) != NULL; p += klen)
        n++;
    return n;
}

/* The value after "key" (which occurs once): the text after the colon, spaces skipped. */
static inline const char *value_of(const char *text, const char *key)
{
    const char *p = strcasestr(text, key);
    if (!p || strncmp(p, key, strlen(key)) != 0)
        return NULL;   /* only a case variant: Python refuses or reads it; let it */
    p += strlen(key);
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    if (*p++ != ':')
        return NULL;
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

/* 1: a plain state (one "pid" above 1, one absolute "bundle" without escapes) whose bundle's
 * config.json cannot ask for a GPU under these settings: the hook has nothing to do. 0: the
 * Python hook decides (it says what is wrong, if anything is). Conservative like the shim's scan,
 * whose fuzzing against the Python decision covers cannot_be_gpu. */
static inline int state_cannot_be_gpu(const char *state, size_t len, const struct settings *s)
{
    if (!s->readable || !s->swarm.certain || !s->prefixes.certain || memchr(state, '\\', len) ||
        strlen(state) != len || count_keys(state, "\"pid\"") != 1 || count_keys(state, "\"bundle\"") != 1)
        return 0;
    const char *pid = value_of(state, "\"pid\""), *bundle = value_of(state, "\"bundle\"");
    if (!pid || !bundle || *bundle != '"' || bundle[1] != '/')
        return 0;
    char *end;
    errno = 0;
    long number = strtol(pid, &end, 10);
    if (errno || end == pid || number <= 1 || number > 0x3fffffff)
        return 0;
    const char *close = strchr(bundle + 1, '"');
    char path[4096];
    if (!close || close - bundle - 1 > 4000)
        return 0;
    snprintf(path, sizeof path, "%.*s/config.json", (int)(close - bundle - 1), bundle + 1);
    size_t spec_len;
    char *spec = read_bounded(path, SPEC_CAP, 1, &spec_len);
    if (!spec)
        return 0;
    int alone = cannot_be_gpu(spec, spec_len, s);
    free(spec);
    return alone;
}

/* The state read so far as fd 0 again (a memfd), for the Python hook or the server to read. */
static inline int give_back_state(const char *state, size_t len)
{
    int fd = memfd_create("nvcontainer-state", 0);
    if (fd < 0)
        return -1;
    size_t done = 0;
    while (done < len) {
        ssize_t n = write(fd, state + done, len - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            close(fd);
            return -1;
        }
        done += (size_t)n;
    }
    if (lseek(fd, 0, SEEK_SET) != 0 || dup2(fd, 0) < 0) {
        close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

/* The --config (or -config) value, "" if none, when argv is options from ``plain``, each with a
 * value (--name VALUE or --name=VALUE), and then "prestart" alone; NULL for anything else
 * (--debug, --dry-run, another stage...), which the Python hook reads. */
static inline const char *plain_prestart(int argc, char **argv, const char *const *plain)
{
    const char *config = "";
    if (argc < 2 || strcmp(argv[argc - 1], "prestart") != 0)
        return NULL;
    for (int i = 1; i < argc - 1; i++) {
        const char *arg = argv[i], *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
        int known = 0;
        for (const char *const *v = plain; *v; v++)
            if (strlen(*v) == len && !strncmp(*v, arg, len))
                known = 1;
        const char *value = eq ? eq + 1 : (i + 1 < argc - 1 ? argv[++i] : NULL);
        if (!known || !value)
            return NULL;
        if ((len == 8 && !strncmp(arg, "--config", 8)) || (len == 7 && !strncmp(arg, "-config", 7))) {
            if (*config || !*value)
                return NULL;
            config = value;
        }
    }
    return config;
}

/* What a prestart run with only plain options may be answered with before any interpreter or
 * server: -1 when it must go on (fd 0 then holds the state again), else the exit status (0: the
 * container asks for no GPU; 1: the state never arrived whole, said in oci.py's words). ``config``:
 * the --config given, or "". */
static inline int prestart_alone(const char *prog, const char *config)
{
    if (fcntl(0, F_GETFD) < 0)
        return -1;   /* closed: the Python hook says so */
    size_t len;
    int status;
    char *state = read_state(&len, &status);
    if (!state)
        return -1;
    if (status == 1 || status == 2) {
        if (status == 1)
            fprintf(stderr, "%s: input error: state: no complete JSON document on standard input within %ds "
                            "(%zu bytes, not closed)\n", prog, STATE_SECONDS, len);
        else
            fprintf(stderr, "%s: input error: state: larger than %d bytes\n", prog, STATE_CAP);
        free(state);
        return 1;
    }
    struct settings s;
    load_settings(&s, config);
    int alone = status == 0 && state_cannot_be_gpu(state, len, &s);
    if (!alone && give_back_state(state, len) < 0) {
        fprintf(stderr, "%s: internal error: cannot hand the state on: %s\n", prog, strerror(errno));
        free(state);
        return 1;
    }
    free(state);
    return alone ? 0 : -1;
}

#endif
