"""Model definitions: parameter pytrees and the Llama-family forward."""

from jaxllm.models.params import LayerParams, ModelParams

__all__ = ["LayerParams", "ModelParams"]
