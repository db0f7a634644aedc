"""Where the repository and the test data are, for tests at any depth under ``tests/``."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
DATA = ROOT / "tests" / "data"
EVAL_DATA = DATA / "eval"  # benchmark fixtures in their published formats
