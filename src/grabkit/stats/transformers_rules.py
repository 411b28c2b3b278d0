"""Rules for Hugging Face transformers' RMSNorm layers and Gemma's scaled word embedding.

Like transformers' ``Conv1D`` (``grabkit.stats.rules``), these are registered as
``"module.qualname"`` strings, looked up when such a layer is first seen, so importing grabkit
never imports transformers.

The RMSNorm classes compute xhat = x / sqrt(mean(x^2) + eps) over the last dim in float32, in
one of three forms:

* Llama's (and the Qwen, Mistral, Mixtral, Phi-3, Granite, DeepSeek-V3, SmolLM3 and Ministral
  copies): ``weight * xhat.to(input dtype)``;
* Gemma's (Gemma 1-3): ``(xhat * (1 + weight)).to(input dtype)``, weight initialised at zero;
  d/dweight is xhat here too;
* T5's (T5, mT5, UMT5, LongT5 ``*LayerNorm``): ``weight * (x * rsqrt(mean(x^2) + eps))``, the
  variance in float32, the product in the input's dtype promoted with float32 (cast to a half
  precision weight's dtype).

The weight's per-example gradient is sum over positions of D_i * xhat_i, with xhat formed exactly
as the layer formed it (in float32 where it did). Gemma's ``*TextScaledWordEmbedding`` is an
``nn.Embedding`` whose output is multiplied by ``embed_scale``: the Embedding rule on the output
gradient times that scale. A class is listed only where its ``forward`` in transformers is one of
these forms; ``tests/stats/test_transformers_rules.py`` checks every listed class against
per-example autograd in float64. A subclass that overrides ``forward`` gets no rule
(``find_rule``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from grabkit.stats.factors import ParameterFactor
from grabkit.stats.rules import _LAZY_RULES, EmbeddingRule, LayerRule, _AffineNormRule

__all__ = [
    "TRANSFORMERS_RULES",
    "GemmaRMSNormRule",
    "LlamaRMSNormRule",
    "ScaledEmbeddingRule",
    "T5LayerNormRule",
]


def _inverse_rms(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) over the last dim, of a float32 tensor, as transformers writes it."""
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class _LastDimNormRule(_AffineNormRule):
    """Normalised over the last dim: the per-example sums run over every other dim after 0."""

    def reduce_dims(self, module: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(1, x.dim() - 1))


class LlamaRMSNormRule(_LastDimNormRule):
    """``weight * xhat.to(input dtype)``, xhat in float32 (``variance_epsilon``)."""

    def normalised(self, module: nn.Module, captured: Any, dtype: torch.dtype) -> torch.Tensor:
        x32 = captured.to(torch.float32)
        xhat = (x32 * _inverse_rms(x32, module.variance_epsilon)).to(captured.dtype)
        return xhat.to(dtype)


class GemmaRMSNormRule(_LastDimNormRule):
    """``(xhat * (1 + weight)).to(input dtype)``, xhat in float32 (``eps``).

    The layer forms its weight's gradient in float32 whatever the parameters' dtype: the input
    is kept in float32 where the parameters are wider (float64), so that the precision the
    statistics were rounded to is read from the call.
    """

    def capture(self, module: nn.Module, layer_input: torch.Tensor) -> torch.Tensor:
        if module.weight.dtype == torch.float64:
            return layer_input.float()
        return layer_input

    def normalised(self, module: nn.Module, captured: Any, dtype: torch.dtype) -> torch.Tensor:
        x32 = captured.float()
        return (x32 * _inverse_rms(x32, module.eps)).to(dtype)


class T5LayerNormRule(_LastDimNormRule):
    """``weight * (x * rsqrt(variance))``, the variance in float32 (``variance_epsilon``)."""

    def normalised(self, module: nn.Module, captured: Any, dtype: torch.dtype) -> torch.Tensor:
        xhat = captured * _inverse_rms(captured.to(torch.float32), module.variance_epsilon)
        if module.weight.dtype in (torch.float16, torch.bfloat16):
            xhat = xhat.to(module.weight.dtype)
        return xhat.to(dtype)


class ScaledEmbeddingRule(EmbeddingRule):
    """``nn.Embedding`` output times the ``embed_scale`` buffer (Gemma's word embedding)."""

    def factors(
        self,
        module: nn.Module,
        layer_input: torch.Tensor,
        output_grad: torch.Tensor,
        wanted: Any,
    ) -> dict[str, ParameterFactor]:
        scale = module.embed_scale.to(module.weight.dtype).to(output_grad.dtype)
        return super().factors(module, layer_input, output_grad * scale, wanted)


_FORMS: dict[type[LayerRule], dict[str, list[str]]] = {
    LlamaRMSNormRule: {
        "llama": ["LlamaRMSNorm"],
        "qwen2": ["Qwen2RMSNorm"],
        "qwen3": ["Qwen3RMSNorm"],
        "qwen2_moe": ["Qwen2MoeRMSNorm"],
        "qwen3_moe": ["Qwen3MoeRMSNorm"],
        "mistral": ["MistralRMSNorm"],
        "mixtral": ["MixtralRMSNorm"],
        "ministral": ["MinistralRMSNorm"],
        "phi3": ["Phi3RMSNorm"],
        "granite": ["GraniteRMSNorm"],
        "deepseek_v3": ["DeepseekV3RMSNorm"],
        "smollm3": ["SmolLM3RMSNorm"],
    },
    GemmaRMSNormRule: {
        "gemma": ["GemmaRMSNorm"],
        "gemma2": ["Gemma2RMSNorm"],
        "gemma3": ["Gemma3RMSNorm"],
    },
    T5LayerNormRule: {
        "t5": ["T5LayerNorm"],
        "mt5": ["MT5LayerNorm"],
        "umt5": ["UMT5LayerNorm"],
        "longt5": ["LongT5LayerNorm"],
    },
    ScaledEmbeddingRule: {
        "gemma": ["GemmaTextScaledWordEmbedding"],
        "gemma2": ["Gemma2TextScaledWordEmbedding"],
        "gemma3": ["Gemma3TextScaledWordEmbedding"],
    },
}

#: "module.qualname" of every transformers class given a rule here -> its rule's class
TRANSFORMERS_RULES: dict[str, type[LayerRule]] = {
    f"transformers.models.{model}.modeling_{model}.{name}": rule
    for rule, models in _FORMS.items()
    for model, names in models.items()
    for name in names
}
_LAZY_RULES.update(TRANSFORMERS_RULES)
