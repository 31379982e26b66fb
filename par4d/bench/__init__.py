"""Benchmarks behind ``par4d bench``: numbers for docs/, never pass/fail."""
