"""Choosing which sub-layers a draft runs: sub-layer probes against the verified cache,
the DP over sub-layers (CLaSp, KnapSpec), latency profiles and the byte-count cost
model, and Bayesian optimisation over skip bits (Self-SD, SWIFT)."""
