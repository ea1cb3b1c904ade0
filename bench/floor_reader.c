/* The floor for one collection cycle: read the same cgroup/resctrl files as the agent, with the least
 * user-space work there is (open once, pread at offset 0 every cycle, no parsing). What remains is the
 * kernel's cost of producing the files' text. Built and run by bench/scale_bench.py.
 *
 *   floor_reader <file listing one path per line> <cycles>
 * prints: "<cpu seconds per cycle pread> <cpu seconds per cycle open+read+close> <distinct files opened>"
 *
 * A collector that reads different files in different cycles (the cgroup collector reads most files only
 * of containers that changed) logs each cycle's list; the lists are then given one after the other,
 * separated by a line "%%", and the reader's cycle k reads list k modulo their number: the same files, in
 * the same mix, as the collector's cycles.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static char **sorted_paths;

static int by_path(const void *a, const void *b) {
    return strcmp(sorted_paths[*(const size_t *)a], sorted_paths[*(const size_t *)b]);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s LIST CYCLES\n", argv[0]);
        return 2;
    }
    FILE *f = fopen(argv[1], "r");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    int cycles = atoi(argv[2]);
    size_t cap = 1024, n = 0, gcap = 16, ngroups = 0;
    char **paths = malloc(cap * sizeof *paths);
    size_t *group_end = malloc(gcap * sizeof *group_end); /* list g is paths[group_end[g-1] .. group_end[g]) */
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!strcmp(line, "%%")) {
            if (ngroups == gcap)
                group_end = realloc(group_end, (gcap *= 2) * sizeof *group_end);
            group_end[ngroups++] = n;
            continue;
        }
        if (!*line)
            continue;
        if (n == cap)
            paths = realloc(paths, (cap *= 2) * sizeof *paths);
        paths[n++] = strdup(line);
    }
    fclose(f);
    if (ngroups == 0 || group_end[ngroups - 1] != n) {
        if (ngroups == gcap)
            group_end = realloc(group_end, (gcap *= 2) * sizeof *group_end);
        group_end[ngroups++] = n;
    }
    /* One descriptor per distinct file, as the collector keeps (a file listed in several cycles is opened
     * once): sort the listing's indices by path, open each path once, share its descriptor. */
    size_t *order = malloc((n ? n : 1) * sizeof *order);
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    sorted_paths = paths;
    qsort(order, n, sizeof *order, by_path);
    int *fds = malloc((n ? n : 1) * sizeof *fds);
    size_t opened = 0;
    for (size_t k = 0; k < n; k++) {
        size_t i = order[k];
        if (k && !strcmp(paths[i], paths[order[k - 1]])) {
            fds[i] = fds[order[k - 1]];
            continue;
        }
        fds[i] = open(paths[i], O_RDONLY | O_CLOEXEC);
        opened += fds[i] >= 0;
    }
    static char buf[8192];
    volatile long sink = 0;
    double t0 = cpu_seconds();
    for (int c = 0; c < cycles; c++) {
        size_t g = (size_t)c % ngroups, lo = g ? group_end[g - 1] : 0, hi = group_end[g];
        for (size_t i = lo; i < hi; i++)
            if (fds[i] >= 0)
                sink += pread(fds[i], buf, sizeof buf, 0);
    }
    double t1 = cpu_seconds();
    for (int c = 0; c < cycles; c++) {
        size_t g = (size_t)c % ngroups, lo = g ? group_end[g - 1] : 0, hi = group_end[g];
        for (size_t i = lo; i < hi; i++) {
            int fd = open(paths[i], O_RDONLY | O_CLOEXEC);
            if (fd < 0)
                continue;
            sink += read(fd, buf, sizeof buf);
            close(fd);
        }
    }
    double t2 = cpu_seconds();
    printf("%.9f %.9f %zu\n", (t1 - t0) / cycles, (t2 - t1) / cycles, opened);
    return 0;
}
