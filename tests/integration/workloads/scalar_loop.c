/* Scalar integer/double loop for argv[1] seconds: no 512-bit state. Built by the test with gcc -O2
 * -mno-avx (SSE2 scalar doubles only). */
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 10.0;
	struct timespec t0, t;
	volatile double x = 1.0;
	unsigned long n = 0;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		for (int i = 0; i < 1000000; i++) {
			x = x * 1.0000001 + 0.0000001;
			n += (unsigned long)i ^ n;
		}
		clock_gettime(CLOCK_MONOTONIC, &t);
		if ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 >= seconds)
			break;
	}
	return x > 0 && n != 1 ? 0 : 1;
}
