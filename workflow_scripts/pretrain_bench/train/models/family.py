"""The interface every model family implements (`ModelFamily`): what the rest of the pipeline asks of a model without
knowing its architecture. A family owns its shape type and presets, its parameter count, its FLOPs per token (with
the formula's text for the report, from the same place as its value), its HF config and class for the export, and how
a rank builds it. Families are registered by name in registry.py; `model_family(shape)` finds a shape's family by the
shape's type, so no caller branches on an architecture.
"""
from __future__ import annotations


class ModelFamily:
    """One model architecture family. Subclasses set the class attributes and implement the methods."""

    name: str = ""
    shape_type: type = object  # the dataclass of this family's shapes (a shape's type names its family)
    presets: dict = {}  # model.preset name → shape (the schema's model.preset enum lists every family's)
    hf_architecture: str = ""  # the transformers class an export is saved as and loads back with
    flops_formula: str = ""  # flops_per_token's formula, as the report prints it

    def count_parameters(self, shape) -> dict[str, int]:
        """Parameter counts: at least `total`, `non_embedding` and `matmul` (those in matrix multiplies, for FLOPs)."""
        raise NotImplementedError

    def flops_per_token(self, shape, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at sequence length `seq_len` (flops_formula)."""
        raise NotImplementedError

    def hf_config(self, shape, seq_len: int, attn_implementation: str | None = None):
        """The transformers config of this shape (the export's config.json)."""
        raise NotImplementedError

    def hf_class(self):
        """The transformers model class of hf_architecture, imported when asked."""
        import transformers

        return getattr(transformers, self.hf_architecture)

    def build(self, shape, seq_len: int, seed: int, precision: str = "fp32", device: str = "cpu",
              attn_implementation: str | None = None, implementation: str = "transformers"):
        """A freshly initialised model of this shape on `device`, in the training precision."""
        raise NotImplementedError
