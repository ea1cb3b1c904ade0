/* The floor for one collection cycle: read the same cgroup/resctrl files as the agent, with the least
 * user-space work there is (open once, pread at offset 0 every cycle, no parsing). What remains is the
 * kernel's cost of producing the files' text. Built and run by bench/scale_bench.py.
 *
 *   floor_reader <file listing one path per line> <cycles>
 * prints: "<cpu seconds per cycle pread> <cpu seconds per cycle open+read+close> <files opened>"
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
    size_t cap = 1024, n = 0;
    char **paths = malloc(cap * sizeof *paths);
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!*line)
            continue;
        if (n == cap)
            paths = realloc(paths, (cap *= 2) * sizeof *paths);
        paths[n++] = strdup(line);
    }
    fclose(f);
    int *fds = malloc(n * sizeof *fds);
    size_t opened = 0;
    for (size_t i = 0; i < n; i++) {
        fds[i] = open(paths[i], O_RDONLY | O_CLOEXEC);
        opened += fds[i] >= 0;
    }
    static char buf[8192];
    volatile long sink = 0;
    double t0 = cpu_seconds();
    for (int c = 0; c < cycles; c++)
        for (size_t i = 0; i < n; i++)
            if (fds[i] >= 0)
                sink += pread(fds[i], buf, sizeof buf, 0);
    double t1 = cpu_seconds();
    for (int c = 0; c < cycles; c++)
        for (size_t i = 0; i < n; i++) {
            int fd = open(paths[i], O_RDONLY | O_CLOEXEC);
            if (fd < 0)
                continue;
            sink += read(fd, buf, sizeof buf);
            close(fd);
        }
    double t2 = cpu_seconds();
    printf("%.9f %.9f %zu\n", (t1 - t0) / cycles, (t2 - t1) / cycles, opened);
    return 0;
}
