"""Drafter experiments as data: `bench/recipes/*.toml`, run by `python -m bench.recipes`."""
