"""Decoding: prefill and autoregressive generation (`generate`), the speculative round
and its host-driven loop (`engine`), the same rounds in one jitted loop on the device
(`round_loop`), and the draft length from measured costs (`draft_length`)."""
