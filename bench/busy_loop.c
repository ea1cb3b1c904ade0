/* A "busy" container's process for bench/scale_bench.py --busy: every <period> seconds it spins on the CPU for
 * <spin ms> of its own CPU time (CLOCK_THREAD_CPUTIME_ID, so a preempted spin still costs what was asked), then
 * sleeps until the next period. Its cgroup's CPU usage therefore moves between any two reads of the agent's
 * collectors (their intervals are >= 1 s), which turns off every idle shortcut that rests on "CPU usage did not
 * change": what the agent costs when containers run. The first period starts at a random offset so that a
 * thousand of them do not wake together.
 *
 *   busy_loop <period seconds> <spin milliseconds>
 */
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_until(double t) {
    struct timespec ts = {(time_t)t, (long)((t - (time_t)t) * 1e9)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {
    }
}

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    double period = atof(argv[1]), spin = atof(argv[2]) / 1e3;
    if (period <= 0 || spin < 0)
        return 2;
    srand((unsigned)getpid());
    double next = now(CLOCK_MONOTONIC) + period * (rand() / (RAND_MAX + 1.0));
    volatile unsigned long sink = 0;
    for (;;) {
        sleep_until(next);
        double until = now(CLOCK_THREAD_CPUTIME_ID) + spin;
        while (now(CLOCK_THREAD_CPUTIME_ID) < until)
            for (int i = 0; i < 1000; i++)
                sink += i;
        next += period;
        double t = now(CLOCK_MONOTONIC);
        while (next < t) /* fell behind (a loaded machine): skip the missed periods, do not spin back to back */
            next += period;
    }
}
