"""Benchmarks: standalone scripts (python bench/NAME.py) and the paper and fault benchmarks the
`hybridtrain bench` commands run (bench.paper)."""
