"""The runtime: the compiled step kernels and the state they own."""
