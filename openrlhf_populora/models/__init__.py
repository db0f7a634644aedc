"""Models the project builds or ships: the tiny random test model and the embedded SmolLM2 default."""
