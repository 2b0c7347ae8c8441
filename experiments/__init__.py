"""specjax's experiments: each module is a script run from the repository root as
`python -m experiments.NAME` (every one takes `--help`). The index, by kind, is
experiments/README.md."""
