"""eBPF programs (``*.bpf.c``, compiled by the wheel's build hook or ``make bpf`` against ``x86_64/vmlinux.h``)
and their loaders: :mod:`.libbpf` (ctypes over the
system libbpf), :mod:`.avx512` (the AVX-512 program's sources and map reader), :mod:`.probe` (what this
host can run, and why not)."""
