/*
 * What the native fronts share (runtime.c, front.c): bounded reads of files we did not write,
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
#include <sys/stat.h>
#include <unistd.h>

#define SAFE_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
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

/* ---- reading ------------------------------------------------------------------------------ */

/* The whole file, NUL-terminated, at most cap bytes; NULL with errno set otherwise (EFBIG:
 * larger than cap, EINVAL: not a regular file). */
static char *read_bounded(const char *path, size_t cap, int nofollow, size_t *len)
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

static const char *skip_space(const char *p)
{
    while (*p == ' ' || *p == '\t')
        p++;
    return p;
}

/* The rest of a line after a value: spaces, then nothing or a comment. */
static int line_ends(const char *p, const char *end)
{
    p = skip_space(p);
    return p == end || *p == '#';
}

/* One TOML basic or literal string without escapes at *pp; its content is copied out. */
static char *string_at(const char **pp, const char *end)
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

static int add_item(struct list *l, const char *s, size_t n)
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
static int parse_value(const char *p, const char *end, struct list *l, int split)
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
static void scan_config(const char *text, size_t len, struct key *keys, int nkeys)
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

static void defaults(struct settings *s)
{
    memset(s, 0, sizeof *s);
    s->readable = 1;
    s->runtimes.certain = s->swarm.certain = s->prefixes.certain = 1;
}

/* The configuration as the Python code reads it: ``explicit`` (which must exist) or, when it is
 * empty, the first of the two default files present. Only the three keys are looked at. */
static void load_settings(struct settings *s, const char *explicit)
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

#endif
