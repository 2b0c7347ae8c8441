"""Measuring: prompt sets, the drafter factory, the per-prompt harness, the resumable
results store, metrics, `specjax bench` (`runner`), `specjax sweep`, plots and the
generated sections of docs/BENCHMARKS.md."""
