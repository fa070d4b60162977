"""What the tests and the benchmarks share: the agent conversations they replay (`data`).

Like SGLang's `sglang.test`, it ships with the package so that `tests/` and `bench/` import
it, never each other.
"""
