/* The output writer (kt_out_*) and the input opener (kt_in_open): what they refuse, what a
 * failed or killed writer leaves behind (the old file, byte for byte, and nothing else), and
 * the permissions of what they create. */
#include <dirent.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "lib/io/out_file.h"
#include "kt/io.h"
#include "tests/support/test_util.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    assert_non_null(p);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static void put_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
}

/* The whole file (NUL-terminated), or NULL when it cannot be read. */
static char *get_file(const char *path, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    assert_non_null(buf);
    for (size_t got; (got = fread(buf + len, 1, cap - len, f)) > 0;) {
        len += got;
        if (len == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
            assert_non_null(buf);
        }
    }
    fclose(f);
    buf[len] = '\0';
    if (len_out != NULL)
        *len_out = len;
    return buf;
}

static void expect_file(const char *path, const char *text)
{
    char *got = get_file(path, NULL);
    assert_non_null(got);
    assert_string_equal(got, text);
    free(got);
}

/* The names in dir (but . and ..), sorted and joined by spaces. */
static char *listing(const char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    char *names[64];
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        assert_true(n < 64);
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    char *out = calloc(1, 64 * 300);
    assert_non_null(out);
    for (int i = 0; i < n; i++) {
        if (i)
            strcat(out, " ");
        strcat(out, names[i]);
        free(names[i]);
    }
    return out;
}

static void expect_listing(const char *dir, const char *expected)
{
    char *got = listing(dir);
    assert_string_equal(got, expected);
    free(got);
}

static void remove_tree(const char *dir)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

static void write_whole(const char *path, const char *text)
{
    kt_out_file *f = NULL;
    assert_int_equal(kt_out_open(path, &f), KT_OK);
    assert_int_equal(kt_out_write(f, text, strlen(text)), KT_OK);
    assert_int_equal(kt_out_commit(f), KT_OK);
}

/* ---- writing --------------------------------------------------------------------------------- */

static void test_write_and_replace(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_out_test"), *path = join(dir, "out.bin");
    write_whole(path, "first");
    expect_file(path, "first");
    write_whole(path, "second, longer");
    expect_file(path, "second, longer");
    expect_listing(dir, "out.bin");

    /* text larger than the writer's buffer, and writes around it, arrive in order */
    size_t big = 200000;
    char *text = malloc(big + 1);
    assert_non_null(text);
    for (size_t i = 0; i < big; i++)
        text[i] = (char)('a' + i % 26);
    text[big] = '\0';
    kt_out_file *f = NULL;
    assert_int_equal(kt_out_open(path, &f), KT_OK);
    assert_int_equal(kt_out_printf(f, "<%d>", 42), KT_OK);
    assert_int_equal(kt_out_printf(f, "%s", text), KT_OK);
    assert_int_equal(kt_out_write(f, text, big), KT_OK);
    assert_int_equal(kt_out_printf(f, "%s", "."), KT_OK);
    /* until the commit the old file is what readers see */
    expect_file(path, "second, longer");
    assert_int_equal(kt_out_commit(f), KT_OK);
    size_t len;
    char *got = get_file(path, &len);
    assert_int_equal(len, 4 + 2 * big + 1);
    assert_memory_equal(got, "<42>", 4);
    assert_memory_equal(got + 4, text, big);
    assert_memory_equal(got + 4 + big, text, big);
    assert_int_equal(got[len - 1], '.');
    free(got);
    free(text);

    /* discarding leaves the old file and nothing else */
    assert_int_equal(kt_out_open(path, &f), KT_OK);
    assert_int_equal(kt_out_write(f, "x", 1), KT_OK);
    kt_out_discard(f);
    kt_out_discard(NULL);
    got = get_file(path, &len);
    assert_non_null(got);
    assert_int_equal(len, 4 + 2 * big + 1);
    free(got);
    expect_listing(dir, "out.bin");

    /* a relative path (no directory part) works too */
    char *cwd = getcwd(NULL, 0);
    assert_non_null(cwd);
    assert_int_equal(chdir(dir), 0);
    write_whole("rel.txt", "relative");
    assert_int_equal(chdir(cwd), 0);
    free(cwd);
    char *rel = join(dir, "rel.txt");
    expect_file(rel, "relative");
    free(rel);
    remove_tree(dir);
    free(path);
    free(dir);
}

static void test_permissions(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_out_test"), *path = join(dir, "new.txt");
    mode_t old = umask(027);
    write_whole(path, "x");
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0640);
    /* a replaced file keeps its permissions */
    assert_int_equal(chmod(path, 0604), 0);
    write_whole(path, "y");
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0604);
    umask(002);
    assert_int_equal(unlink(path), 0);
    write_whole(path, "z");
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0664);
    umask(old);
    remove_tree(dir);
    free(path);
    free(dir);
}

/* ---- refusing -------------------------------------------------------------------------------- */

static void test_refuses_non_regular(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_out_test");
    char *target = join(dir, "target"), *link = join(dir, "link"), *dangling = join(dir, "dang");
    char *fifo = join(dir, "fifo"), *sub = join(dir, "sub");
    put_file(target, "keep me");
    assert_int_equal(symlink("target", link), 0);
    assert_int_equal(symlink("nowhere", dangling), 0);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(mkdir(sub, 0700), 0);
    kt_out_file *f = NULL;

    TU_EXPECT_ERROR(kt_out_open(link, &f), KT_EINVAL, link, "symbolic link");
    TU_EXPECT_ERROR(kt_out_open(dangling, &f), KT_EINVAL, dangling, "symbolic link");
    TU_EXPECT_ERROR(kt_out_open(fifo, &f), KT_EINVAL, fifo, "FIFO");
    TU_EXPECT_ERROR(kt_out_open(sub, &f), KT_EINVAL, sub, "directory");
    TU_EXPECT_ERROR(kt_out_open("/dev/null", &f), KT_EINVAL, "/dev/null", "character device");
    assert_null(f);
    char *slash = join(dir, "sub/");
    TU_EXPECT_ERROR(kt_out_open(slash, &f), KT_EINVAL, slash, "directory");
    free(slash);
    char *missing = join(dir, "nodir/out.bin");
    TU_EXPECT_ERROR(kt_out_open(missing, &f), KT_EIO, missing, "nodir",
                    "No such file or directory");
    free(missing);

    /* all of them as they were */
    char buf[64];
    ssize_t n = readlink(link, buf, sizeof buf);
    assert_int_equal(n, 6);
    assert_memory_equal(buf, "target", 6);
    expect_file(target, "keep me");
    struct stat st;
    assert_int_equal(lstat(fifo, &st), 0);
    assert_true(S_ISFIFO(st.st_mode));
    assert_int_equal(lstat(dangling, &st), 0);
    assert_true(S_ISLNK(st.st_mode));
    assert_int_equal(stat("/dev/null", &st), 0);
    assert_true(S_ISCHR(st.st_mode));
    expect_listing(dir, "dang fifo link sub target");
    expect_listing(sub, "");
    remove_tree(dir);
    free(target);
    free(link);
    free(dangling);
    free(fifo);
    free(sub);
    free(dir);
}

/* ---- failing and dying ----------------------------------------------------------------------- */

/* In a child limited to 64 KiB per file, writes 1 MiB over path: the write (or the commit)
 * fails with "File too large" and the child exits 0 when every call said so. */
static void child_full_disk(const char *path)
{
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {65536, 65536};
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
        _exit(3);
    static char mb[1 << 20];
    memset(mb, 'n', sizeof mb);
    kt_out_file *f = NULL;
    if (kt_out_open(path, &f) != KT_OK)
        _exit(4);
    kt_status w = kt_out_write(f, mb, sizeof mb);
    kt_status w2 = kt_out_printf(f, "%s", "more");
    kt_status c = kt_out_commit(f);
    int ok = w == KT_EIO && w2 == KT_EIO && c == KT_EIO &&
             strstr(kt_last_error(), "File too large") != NULL &&
             strstr(kt_last_error(), path) != NULL;
    _exit(ok ? 0 : 5);
}

/* A write that runs into RLIMIT_FSIZE (a full disk) in a child: the writer reports it. */
static void expect_full_disk_fails(const char *path)
{
    fflush(NULL);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0)
        child_full_disk(path);
    int ws;
    assert_int_equal(waitpid(child, &ws, 0), child);
    assert_true(WIFEXITED(ws));
    assert_int_equal(WEXITSTATUS(ws), 0);
}

static void test_failed_write_keeps_old(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_out_test"), *path = join(dir, "prog.ktp");
    put_file(path, "the previous good file");
    expect_full_disk_fails(path);
    expect_file(path, "the previous good file");
    expect_listing(dir, "prog.ktp");
    remove_tree(dir);
    free(path);
    free(dir);
}

/* A writer of `path` (mib MiB, or a few bytes for 0) killed with SIGKILL mid-write, the
 * file not committed. */
static void kill_mid_write(const char *path, int mib)
{
    int ready[2], ws;
    assert_int_equal(pipe(ready), 0);
    fflush(NULL);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        close(ready[0]);
        static char mb[1 << 20];
        memset(mb, 'w', sizeof mb);
        kt_out_file *f = NULL;
        if (kt_out_open(path, &f) != KT_OK)
            _exit(4);
        for (int i = 0; i < (mib > 0 ? mib : 1); i++)
            if (kt_out_write(f, mb, mib > 0 ? sizeof mb : 7) != KT_OK)
                _exit(5);
        if (write(ready[1], "r", 1) != 1)
            _exit(6);
        for (;;) /* killed here, the file half written */
            pause();
    }
    close(ready[1]);
    char c;
    assert_int_equal(read(ready[0], &c, 1), 1);
    close(ready[0]);
    assert_int_equal(kill(child, SIGKILL), 0);
    assert_int_equal(waitpid(child, &ws, 0), child);
    assert_true(WIFSIGNALED(ws));
}

static void test_kill_during_write(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_out_test"), *path = join(dir, "model.st");
    put_file(path, "old weights");
    kill_mid_write(path, 8);
    expect_file(path, "old weights");
    /* whatever the dead writer left (a named temporary, where unnamed ones are not to be had),
     * the next writer of the path removes */
    kt_out_file *f = NULL;
    assert_int_equal(kt_out_open(path, &f), KT_OK);
    kt_out_discard(f);
    expect_file(path, "old weights");
    expect_listing(dir, "model.st");
    remove_tree(dir);
    free(path);
    free(dir);
}

/* The fallback's named temporaries: one of a dead process is removed by the next open of the
 * same target, one of a live process (this one) and one of another target are kept. */
static void test_stale_temporaries(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_out_test"), *path = join(dir, "a.bin");
    fflush(NULL);
    pid_t dead = fork();
    assert_true(dead >= 0);
    if (dead == 0)
        _exit(0);
    assert_int_equal(waitpid(dead, NULL, 0), dead);
    char name[128];
    snprintf(name, sizeof name, ".a.bin.kt-tmp.%ld.0", (long)dead);
    char *stale = join(dir, name);
    snprintf(name, sizeof name, ".a.bin.kt-tmp.%ld.0", (long)getpid());
    char *live = join(dir, name);
    snprintf(name, sizeof name, ".b.bin.kt-tmp.%ld.0", (long)dead);
    char *other = join(dir, name);
    put_file(stale, "x");
    put_file(live, "x");
    put_file(other, "x");
    write_whole(path, "new");
    assert_int_equal(access(stale, F_OK), -1);
    assert_int_equal(access(live, F_OK), 0);
    assert_int_equal(access(other, F_OK), 0);
    expect_file(path, "new");
    remove_tree(dir);
    free(stale);
    free(live);
    free(other);
    free(path);
    free(dir);
}

/* The fallback for filesystems without unnamed temporaries: a hidden named one, present
 * while writing, gone after a commit, a discard or a failed write, and after a kill -9
 * removed by the next open of the same path. */
static void test_named_fallback(void **state)
{
    (void)state;
    kt__out_force_named = 1;
    char *dir = tu_temp_dir("kt_out_test"), *path = join(dir, "f.bin");
    put_file(path, "old");
    kt_out_file *f = NULL;
    assert_int_equal(kt_out_open(path, &f), KT_OK);
    char *names = listing(dir);
    assert_true(strncmp(names, ".f.bin.kt-tmp.", 14) == 0);
    free(names);
    assert_int_equal(kt_out_write(f, "new", 3), KT_OK);
    expect_file(path, "old");
    assert_int_equal(kt_out_commit(f), KT_OK);
    expect_file(path, "new");
    expect_listing(dir, "f.bin");
    assert_int_equal(kt_out_open(path, &f), KT_OK);
    kt_out_discard(f);
    expect_listing(dir, "f.bin");

    expect_full_disk_fails(path);
    expect_file(path, "new");
    expect_listing(dir, "f.bin");

    kill_mid_write(path, 0);
    names = listing(dir);
    assert_non_null(strstr(names, ".f.bin.kt-tmp.")); /* what the dead writer left */
    free(names);
    expect_file(path, "new");
    write_whole(path, "newer");
    expect_file(path, "newer");
    expect_listing(dir, "f.bin");
    /* permissions as with unnamed temporaries */
    mode_t old = umask(027);
    assert_int_equal(chmod(path, 0604), 0);
    write_whole(path, "newest");
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0604);
    assert_int_equal(unlink(path), 0);
    write_whole(path, "new file");
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0640);
    umask(old);
    kt__out_force_named = 0;
    remove_tree(dir);
    free(path);
    free(dir);
}

/* ---- inputs ---------------------------------------------------------------------------------- */

static void test_in_open(void **state)
{
    (void)state;
    char *dir = tu_temp_dir("kt_out_test"), *file = join(dir, "in.bin"), *fifo = join(dir, "fifo");
    put_file(file, "data");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    int fd = -1, reg = -1;
    assert_int_equal(kt_in_open(file, &fd, &reg), KT_OK);
    assert_int_equal(reg, 1);
    assert_int_equal(fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
    close(fd);

    /* a FIFO nobody writes is refused at once (it used to block in open()) */
    fd = -1;
    time_t t0 = time(NULL);
    TU_EXPECT_ERROR(kt_in_open(fifo, &fd, &reg), KT_EINVAL, fifo, "FIFO");
    assert_true(time(NULL) - t0 < 5);
    assert_int_equal(fd, -1);
    TU_EXPECT_ERROR(kt_in_open(dir, &fd, NULL), KT_EIO, dir, "Is a directory");
    TU_EXPECT_ERROR(kt_in_open("/dev/zero", &fd, NULL), KT_EINVAL, "/dev/zero",
                    "character device");
    char *missing = join(dir, "missing");
    TU_EXPECT_ERROR(kt_in_open(missing, &fd, NULL), KT_EIO, missing,
                    "No such file or directory");
    free(missing);

    /* an anonymous pipe (a shell's <(...)) is read as a stream, blocking */
    int p[2];
    assert_int_equal(pipe(p), 0);
    assert_int_equal(write(p[1], "abc", 3), 3);
    close(p[1]);
    char path[64];
    snprintf(path, sizeof path, "/dev/fd/%d", p[0]);
    assert_int_equal(kt_in_open(path, &fd, &reg), KT_OK);
    assert_int_equal(reg, 0);
    assert_int_equal(fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
    char buf[4];
    assert_int_equal(read(fd, buf, sizeof buf), 3);
    close(fd);
    close(p[0]);
    remove_tree(dir);
    free(file);
    free(fifo);
    free(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_and_replace),
        cmocka_unit_test(test_permissions),
        cmocka_unit_test(test_refuses_non_regular),
        cmocka_unit_test(test_failed_write_keeps_old),
        cmocka_unit_test(test_kill_during_write),
        cmocka_unit_test(test_stale_temporaries),
        cmocka_unit_test(test_named_fallback),
        cmocka_unit_test(test_in_open),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
