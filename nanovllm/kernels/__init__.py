"""Compiled kernels: C++ sources built on the user's machine at first use, with their Python faces."""
