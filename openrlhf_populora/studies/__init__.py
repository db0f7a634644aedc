"""Studies that run on top of the runner: they take finished runs' checkpoints and run more self-play through
``selfplay.runner`` (the retention study: ``retention.py``). Above the loop, below the CLI; what they write is read
back by ``analysis/``."""
