"""tremula: compile and simulate transformer inference on Graphcore IPUs and IPU-like tile machines."""

__version__ = "0.1.0"
