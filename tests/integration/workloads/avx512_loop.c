/* 512-bit FMA loop on zmm0-15 for argv[1] seconds: keeps ZMM_Hi256 (XSAVE component 6) in use, so every
 * context switch away from it saves live AVX-512 state. Built by the test with gcc -O2 -mavx512f. */
#include <immintrin.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 10.0;
	struct timespec t0, t;
	__m512d a = _mm512_set1_pd(1.0000001), b = _mm512_set1_pd(0.9999999);
	__m512d c0 = _mm512_set1_pd(1.0), c1 = _mm512_set1_pd(2.0), c2 = _mm512_set1_pd(3.0), c3 = _mm512_set1_pd(4.0);

	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		for (int i = 0; i < 1000000; i++) {
			c0 = _mm512_fmadd_pd(a, c0, b);
			c1 = _mm512_fmadd_pd(a, c1, b);
			c2 = _mm512_fmadd_pd(a, c2, b);
			c3 = _mm512_fmadd_pd(a, c3, b);
			/* keep the accumulators in registers and the loop from being optimised away */
			__asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3));
		}
		clock_gettime(CLOCK_MONOTONIC, &t);
		if ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 >= seconds)
			break;
	}
	return _mm512_reduce_add_pd(c0) + _mm512_reduce_add_pd(c1) + _mm512_reduce_add_pd(c2) +
	       _mm512_reduce_add_pd(c3) > 0 ? 0 : 1;
}
