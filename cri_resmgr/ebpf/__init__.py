"""eBPF programs (``*.bpf.c``, built by ``make bpf``) and their loaders: :mod:`.libbpf` (ctypes over the
system libbpf), :mod:`.avx512` (the AVX-512 program's sources and map reader), :mod:`.probe` (what this
host can run, and why not)."""
