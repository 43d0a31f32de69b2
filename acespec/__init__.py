"""AceSpec: speculative decoding across an edge device and a cloud GPU.

The package is laid out in layers (docs/design/architecture.md); each imports only the layers above it:
models -> verify -> draft -> control -> wire -> engine -> cloud / edge -> net -> sim -> eval / bench -> cli.
"""

__version__ = "0.1.0"
