"""``qkv view``: a self-contained HTML page of a model's attention, heads and scores."""

from .page import byte_labels, view

__all__ = ["byte_labels", "view"]
