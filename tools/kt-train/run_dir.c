/* The run directory: DIR/step-NNNNNNNN/ checkpoints, each holding session.safetensors (the
 * parameters, the MoE layers' experts and adapters, and every optimizer state), program.ktp
 * and run.json (resume.c). A checkpoint is written into a temporary sibling
 * (DIR/.step-NNNNNNNN.tmp.PID), each file synced as it is committed (kt_out_commit), and
 * renamed into place in one step, the directory synced after: a step-* directory is either
 * complete or absent, whatever kill -9 or a power cut interrupts. Older checkpoints beyond
 * --keep are removed only after the new one is in place, each renamed away first so that a
 * half-removed one never looks like a checkpoint. rank 0 writes; a lock (flock) on DIR/.lock
 * keeps a second run from writing into the same directory. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tools/kt-train/trainer.h"

#define STEP_FMT "step-%08lld"

static int join(char *out, size_t size, const char *dir, const char *name)
{
    int n = snprintf(out, size, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= size)
        return train_error("path too long: %s/%s", dir, name);
    return 0;
}

/* A directory of plain files (a checkpoint, a temporary one): its files, then itself. */
static int remove_flat_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return errno == ENOENT ? 0 : -1;
    struct dirent *e;
    char path[4400];
    int rc = 0;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        if (join(path, sizeof path, dir, e->d_name) != 0 || unlink(path) != 0)
            rc = -1;
    }
    closedir(d);
    return rmdir(dir) == 0 && rc == 0 ? 0 : -1;
}

static int sync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return -1;
    int rc = fsync(fd) == 0 || errno == EINVAL ? 0 : -1;
    close(fd);
    return rc;
}

/* The step of a complete checkpoint's name ("step-00000012"), or -1. */
static int64_t step_of(const char *name)
{
    if (strncmp(name, "step-", 5) != 0 || strlen(name) != 13)
        return -1;
    int64_t v = 0;
    for (const char *c = name + 5; *c; c++) {
        if (*c < '0' || *c > '9')
            return -1;
        v = v * 10 + (*c - '0');
    }
    return v;
}

static int newest_first(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return a < b ? 1 : a > b ? -1 : 0;
}

/* The steps of the checkpoints in dir, newest first (*steps_out: free it). */
static int list_steps(const char *dir, int64_t **steps_out, int *n_out)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return train_error("cannot read the run directory %s: %s", dir, strerror(errno));
    int n = 0, cap = 0;
    int64_t *steps = NULL;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int64_t s = step_of(e->d_name);
        if (s < 0)
            continue;
        if (n == cap) {
            int64_t *grown = realloc(steps, sizeof *steps * (size_t)(cap = cap * 2 + 16));
            if (grown == NULL) {
                free(steps);
                closedir(d);
                return train_fail("out of memory", NULL);
            }
            steps = grown;
        }
        steps[n++] = s;
    }
    closedir(d);
    if (n > 0)
        qsort(steps, (size_t)n, sizeof *steps, newest_first);
    *steps_out = steps;
    *n_out = n;
    return 0;
}

int run_dir_open(trainer *t)
{
    t->run_dir_lock = -1;
    if (t->run_dir == NULL || t->r.rank != 0)
        return 0;
    if (mkdir(t->run_dir, 0777) != 0 && errno != EEXIST)
        return train_error("cannot create the run directory %s: %s", t->run_dir,
                           strerror(errno));
    struct stat st;
    if (stat(t->run_dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return train_error("--run-dir %s is not a directory", t->run_dir);
    char path[4200];
    if (join(path, sizeof path, t->run_dir, ".lock") != 0)
        return 1;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return train_error("cannot create %s: %s", path, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        close(fd);
        return train_error("the run directory %s is in use by another kt-train (it holds "
                           "%s)", t->run_dir, path);
    }
    t->run_dir_lock = fd;
    /* what a killed save or prune left: no other run can be writing (the lock) */
    DIR *d = opendir(t->run_dir);
    struct dirent *e;
    while (d != NULL && (e = readdir(d)) != NULL)
        if (strncmp(e->d_name, ".step-", 6) == 0 &&
            (strstr(e->d_name, ".tmp.") != NULL || strstr(e->d_name, ".old.") != NULL) &&
            join(path, sizeof path, t->run_dir, e->d_name) == 0)
            remove_flat_dir(path);
    if (d != NULL)
        closedir(d);
    return 0;
}

void run_dir_close(trainer *t)
{
    if (t->run_dir_lock >= 0)
        close(t->run_dir_lock); /* releases the lock */
    t->run_dir_lock = -1;
}

static int write_bytes(const char *path, const void *data, size_t n)
{
    kt_out_file *f = NULL;
    kt_status st = kt_out_open(path, &f);
    if (st == KT_OK)
        st = kt_out_write(f, data, n);
    if (st == KT_OK)
        return kt_out_commit(f) == KT_OK ? 0 : -1;
    kt_out_discard(f);
    return -1;
}

/* The size and hash of a file as it is on disk (read back: what a resume will find). */
int checkpoint_hash_file(const char *path, uint64_t *bytes, uint64_t *hash)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return -1;
    enum { CHUNK = 1 << 20 };
    unsigned char *buf = malloc(CHUNK);
    uint64_t h = HASH_START, total = 0;
    size_t n;
    while (buf != NULL && (n = fread(buf, 1, CHUNK, f)) > 0) {
        h = hash_bytes(h, buf, n); /* chunks are multiples of 8: the same as one pass */
        total += n;
    }
    int failed = buf == NULL || ferror(f);
    free(buf);
    fclose(f);
    if (failed)
        return -1;
    *bytes = total;
    *hash = h;
    return 0;
}

/* Removes the checkpoints beyond the newest `keep`, and, at a resumed run's first checkpoint
 * (`step`), every other one after the step it resumed from: a run resumed from an earlier
 * checkpoint of this directory replaces the steps that followed it (the abandoned run's),
 * which would otherwise be taken for its own by the next --resume. What cannot be removed is
 * said, not fatal (the new checkpoint is complete). */
static void prune(trainer *t, int64_t keep, int64_t step)
{
    int64_t *steps = NULL, stale_after = INT64_MAX;
    int n = 0, kept = 0;
    if (t->resumed && !t->saved_since_resume)
        stale_after = t->first_step;
    t->saved_since_resume = 1;
    if (list_steps(t->run_dir, &steps, &n) != 0)
        return;
    for (int i = 0; i < n; i++) {
        int stale = steps[i] > stale_after && steps[i] != step;
        if (!stale && kept < keep) {
            kept++;
            continue;
        }
        char name[32], from[4200], away[4200];
        snprintf(name, sizeof name, STEP_FMT, (long long)steps[i]);
        char hidden[64];
        snprintf(hidden, sizeof hidden, "." STEP_FMT ".old.%ld", (long long)steps[i],
                 (long)getpid());
        if (join(from, sizeof from, t->run_dir, name) != 0 ||
            join(away, sizeof away, t->run_dir, hidden) != 0)
            continue;
        if (rename(from, away) != 0 || remove_flat_dir(away) != 0)
            fprintf(stderr, "kt-train: warning: cannot remove the old checkpoint %s: %s\n",
                    from, strerror(errno));
    }
    free(steps);
    sync_dir(t->run_dir);
}

int run_dir_later_checkpoints(const trainer *t, int64_t step)
{
    int64_t *steps = NULL;
    int n = 0, later = 0;
    if (t->run_dir == NULL || list_steps(t->run_dir, &steps, &n) != 0) {
        kt_clear_error();
        return 0;
    }
    for (int i = 0; i < n; i++)
        later += steps[i] > step;
    free(steps);
    return later;
}

int checkpoint_write(trainer *t, const train_args *a, int64_t step, const char *why)
{
    char name[32], hidden[64], tmp[4200], final[4200], path[4400], old[4200];
    snprintf(name, sizeof name, STEP_FMT, (long long)step);
    snprintf(hidden, sizeof hidden, "." STEP_FMT ".tmp.%ld", (long long)step, (long)getpid());
    if (join(tmp, sizeof tmp, t->run_dir, hidden) != 0 ||
        join(final, sizeof final, t->run_dir, name) != 0)
        return 1;
    remove_flat_dir(tmp);
    if (mkdir(tmp, 0777) != 0)
        return train_error("cannot create the checkpoint %s: %s", tmp, strerror(errno));
    int rc = 0;
    uint64_t bytes = 0, hash = 0;
    snprintf(path, sizeof path, "%s/session.safetensors", tmp);
    if (kt_session_save(t->s, path, 1) != KT_OK)
        rc = train_error("cannot write the checkpoint's session: %s", kt_last_error());
    if (rc == 0 && checkpoint_hash_file(path, &bytes, &hash) != 0)
        rc = train_error("cannot read back %s: %s", path, strerror(errno));
    snprintf(path, sizeof path, "%s/program.ktp", tmp);
    if (rc == 0 && write_bytes(path, t->program_bytes, t->program_size) != 0)
        rc = train_error("cannot write the checkpoint's program: %s", kt_last_error());
    snprintf(path, sizeof path, "%s/run.json", tmp);
    kt_out_file *f = NULL;
    if (rc == 0 && kt_out_open(path, &f) != KT_OK)
        rc = train_error("cannot write the checkpoint's run.json: %s", kt_last_error());
    if (rc == 0) {
        resume_write_json(t, a, step, bytes, hash, f);
        if (kt_out_commit(f) != KT_OK)
            rc = train_error("cannot write the checkpoint's run.json: %s", kt_last_error());
    }
    if (rc == 0 && sync_dir(tmp) != 0)
        rc = train_error("cannot sync %s: %s", tmp, strerror(errno));
    /* a checkpoint of the same step (a run resumed from an earlier one) is replaced */
    snprintf(hidden, sizeof hidden, "." STEP_FMT ".old.%ld", (long long)step, (long)getpid());
    int replaced = 0;
    if (rc == 0 && join(old, sizeof old, t->run_dir, hidden) == 0 && rename(final, old) == 0)
        replaced = 1;
    if (rc == 0 && rename(tmp, final) != 0)
        rc = train_error("cannot rename %s to %s: %s", tmp, final, strerror(errno));
    if (rc == 0 && sync_dir(t->run_dir) != 0)
        rc = train_error("cannot sync the run directory %s: %s", t->run_dir, strerror(errno));
    if (rc != 0) {
        remove_flat_dir(tmp);
        if (replaced)
            rename(old, final);
        return 1;
    }
    if (replaced)
        remove_flat_dir(old);
    prune(t, a->keep, step);
    if (t->progress != NULL)
        progress_note(t->progress, "kt-train: %s: saved checkpoint %s", why, final);
    else
        printf("kt-train: %s: saved checkpoint %s\n", why, final);
    fflush(stdout);
    return 0;
}

int checkpoint_find(const char *path, resume_point *out)
{
    memset(out, 0, sizeof *out);
    char json[4200];
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return train_error("--resume %s: %s", path,
                           errno == ENOENT || stat(path, &st) != 0 ? "no such directory"
                                                                   : "not a directory");
    if (join(json, sizeof json, path, "run.json") != 0)
        return 1;
    if (stat(json, &st) == 0) { /* a step directory: the run directory is its parent */
        snprintf(out->dir, sizeof out->dir, "%s", path);
        snprintf(out->run_dir, sizeof out->run_dir, "%s", path);
        char *slash = strrchr(out->run_dir, '/');
        while (slash != NULL && slash > out->run_dir && slash[1] == '\0') { /* "dir/" */
            *slash = '\0';
            slash = strrchr(out->run_dir, '/');
        }
        if (slash == NULL)
            snprintf(out->run_dir, sizeof out->run_dir, ".");
        else if (slash == out->run_dir)
            slash[1] = '\0';
        else
            *slash = '\0';
    } else {
        snprintf(out->run_dir, sizeof out->run_dir, "%s", path);
        int64_t *steps = NULL, newest = 0;
        int n = 0;
        if (list_steps(path, &steps, &n) != 0)
            return 1;
        if (n > 0)
            newest = steps[0];
        free(steps);
        if (n == 0)
            return train_error("--resume %s: no checkpoint there (neither a run directory "
                               "with step-* checkpoints nor one with run.json)", path);
        char name[32];
        snprintf(name, sizeof name, STEP_FMT, (long long)newest);
        if (join(out->dir, sizeof out->dir, path, name) != 0)
            return 1;
    }
    snprintf(out->session, sizeof out->session, "%s/session.safetensors", out->dir);
    snprintf(out->program, sizeof out->program, "%s/program.ktp", out->dir);
    return 0;
}
