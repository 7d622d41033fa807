"""Quantized weights: what ``--quantization`` asks for (methods.py), the native path's int8 weight-only
layers (int8.py), and how many bytes a model's weights really hold (weight_bytes.py)."""
