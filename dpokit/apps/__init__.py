"""Applications over the library: rounds from a plan (iterate), multi-GPU and multi-node runs (scaleout), the container launcher (launcher)."""
