"""Pallas kernels for specjax: flash-decoding attention over the packed hierarchical
(QuantSpec) KV cache (`quant_attention`), and weight-only int8 / int4 matmuls for a
decode step's few rows (`quant_matmul`). Each kernel has a pure-jnp reference beside it;
on CPU they run with interpret=True (what CI tests)."""

from pallas_kernels.quant_attention import (
                                            dense_partials,
                                            merge,
                                            merge_splits,
                                            quant_attention,
                                            quant_partials,
                                            reference_partials,
)

__all__ = ["dense_partials", "merge", "merge_splits", "quant_attention", "quant_partials",
           "reference_partials"]
