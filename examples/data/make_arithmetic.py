"""Regenerate examples/data/arithmetic/{train,eval}.jsonl: "What is a + b?" with a, b in 0..49.

Deterministic (seed 0); train and eval share no problem. Run from the repository root:
``python examples/data/make_arithmetic.py``.
"""

from pathlib import Path

from skyrl_envs.arithmetic import write_arithmetic_splits

if __name__ == "__main__":
    paths = write_arithmetic_splits(Path(__file__).parent / "arithmetic", train_size=1000, eval_size=100, seed=0)
    print({k: str(v) for k, v in paths.items()})
