"""Measuring: prompt sets, the drafter factory, the per-prompt harness, the resumable
results store, metrics, `specjax bench` (`runner`), `specjax sweep`, plots and the
generated results pages under docs/results/ (`docs`, the Spec-Bench `leaderboard`, the
`verdict_page`)."""
