"""Benchmarks of jaxquant against plain jnp, ONNX Runtime, PyTorch and qwix (see README.md)."""
