"""Capture: any nn.Module and an example input -> a layer graph with shapes and bytes."""

from .graph import Layer, LayerGraph, Saved, Storage, Value
from .kinds import Kind
from .entry import capture
from .trace import trace

__all__ = ["capture", "trace", "Kind", "Layer", "LayerGraph", "Saved", "Storage", "Value"]
