/* ENOSPC at the OS boundary, for tests (LD_PRELOAD): every call that can need new disk space
   (write, pwrite, writev, pwritev, fallocate, posix_fallocate, ftruncate, fsync, fdatasync) on a
   file under an armed directory is counted, and the calls numbered [first, first + count) fail
   with ENOSPC -- whoever makes them: our Python code, SQLite, the kernel's view of both.
   Controlled through ctypes: enospc_arm(prefix, first, count), enospc_calls(). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>
#include <fcntl.h>

static char prefix[4096];
static size_t prefix_len;
static long first_fail, fail_count, calls;

void enospc_arm(const char *p, long first, long count) {
    strncpy(prefix, p, sizeof prefix - 1);
    prefix_len = strlen(prefix);
    first_fail = first;
    fail_count = count;
    calls = 0;
}

long enospc_calls(void) { return calls; }

static int fail_(int fd, const char *fn) {
    char link[64], path[4096];
    ssize_t n;
    if (!prefix_len)
        return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    n = readlink(link, path, sizeof path - 1);
    if (n < (ssize_t)prefix_len || memcmp(path, prefix, prefix_len) != 0)
        return 0;
    calls++;
    if (calls >= first_fail && calls < first_fail + fail_count) {
        if (getenv("ENOSPC_LOG"))
            fprintf(stderr, "ENOSPC: %s of %.*s (call %ld)\n", fn, (int)n, path, calls);
        errno = ENOSPC;
        return 1;
    }
    return 0;
}

#define fail(fd) fail_(fd, __func__)
#define REAL(name) static __typeof__(name) *real; if (!real) real = dlsym(RTLD_NEXT, #name)

ssize_t write(int fd, const void *b, size_t n) { REAL(write); return fail(fd) ? -1 : real(fd, b, n); }
ssize_t pwrite(int fd, const void *b, size_t n, off_t o) { REAL(pwrite); return fail(fd) ? -1 : real(fd, b, n, o); }
ssize_t pwrite64(int fd, const void *b, size_t n, off_t o) { REAL(pwrite64); return fail(fd) ? -1 : real(fd, b, n, o); }
ssize_t writev(int fd, const struct iovec *v, int c) { REAL(writev); return fail(fd) ? -1 : real(fd, v, c); }
ssize_t pwritev(int fd, const struct iovec *v, int c, off_t o) { REAL(pwritev); return fail(fd) ? -1 : real(fd, v, c, o); }
ssize_t pwritev64(int fd, const struct iovec *v, int c, off_t o) { REAL(pwritev64); return fail(fd) ? -1 : real(fd, v, c, o); }
ssize_t pwritev2(int fd, const struct iovec *v, int c, off_t o, int f) { REAL(pwritev2); return fail(fd) ? -1 : real(fd, v, c, o, f); }
ssize_t pwritev64v2(int fd, const struct iovec *v, int c, off_t o, int f) { REAL(pwritev64v2); return fail(fd) ? -1 : real(fd, v, c, o, f); }
int fallocate(int fd, int m, off_t o, off_t n) { REAL(fallocate); return fail(fd) ? -1 : real(fd, m, o, n); }
int fallocate64(int fd, int m, off_t o, off_t n) { REAL(fallocate64); return fail(fd) ? -1 : real(fd, m, o, n); }
int posix_fallocate(int fd, off_t o, off_t n) { REAL(posix_fallocate); return fail(fd) ? ENOSPC : real(fd, o, n); }
int posix_fallocate64(int fd, off_t o, off_t n) { REAL(posix_fallocate64); return fail(fd) ? ENOSPC : real(fd, o, n); }
int ftruncate(int fd, off_t n) { REAL(ftruncate); return fail(fd) ? -1 : real(fd, n); }
int ftruncate64(int fd, off_t n) { REAL(ftruncate64); return fail(fd) ? -1 : real(fd, n); }
int fsync(int fd) { REAL(fsync); return fail(fd) ? -1 : real(fd); }
int fdatasync(int fd) { REAL(fdatasync); return fail(fd) ? -1 : real(fd); }
