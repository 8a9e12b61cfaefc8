"""The construction probe's comparison: the dtype's tolerance, widened by the model's own
rounding noise up to a cap; and an attention the service does not compute is refused
however noisy the model's own implementations are."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

pytest.importorskip("transformers")

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from cache_service.client import KVCacheClient
from cache_service.integrations.model_probe import (
    MAX_NOISE_TOLERANCE,
    NOISE_FACTOR,
    compare_generations,
    rounding_noise,
)
from cache_service.integrations.transformers import ServiceModel
from tests.test_transformers_refusals import _service
from tests.transformers_families import tiny_model


def _generation(logits: list[list[float]], tokens: list[int], prompt: int = 2) -> Any:
    """A generate() output of one row: its logits per step and the tokens it chose."""
    sequences = torch.tensor([[1] * prompt + tokens])
    return SimpleNamespace(sequences=sequences, logits=[torch.tensor([row]) for row in logits])


def test_the_tolerance_is_the_dtypes_unless_the_models_own_noise_is_larger() -> None:
    ref = _generation([[10.0, 0.0]], [0])  # largest |logit| 10: bf16 tolerance 0.3
    base = compare_generations(ref, ref, torch.bfloat16).tolerance
    assert base == pytest.approx(0.3)
    assert compare_generations(ref, ref, torch.bfloat16, noise=0.1).tolerance == base
    widened = compare_generations(ref, ref, torch.bfloat16, noise=0.2).tolerance
    assert widened == pytest.approx(NOISE_FACTOR * 0.2)
    capped = compare_generations(ref, ref, torch.bfloat16, noise=100.0).tolerance
    assert capped == pytest.approx(MAX_NOISE_TOLERANCE * base)
    # A difference past the widened tolerance is still refused, within it accepted.
    ours = _generation([[10.0, 0.45]], [0])
    assert compare_generations(ours, ref, torch.bfloat16).step == 0
    assert compare_generations(ours, ref, torch.bfloat16, noise=0.25).step is None
    assert compare_generations(ours, ref, torch.bfloat16, noise=0.2).step == 0


def test_rounding_noise_reads_the_steps_while_the_tokens_agree() -> None:
    ref = _generation([[5.0, 1.0], [5.0, 1.0], [5.0, 1.0]], [0, 0, 0])
    other = _generation([[5.0, 1.1], [5.3, 1.0], [9.0, 1.0]], [0, 1, 0])
    # The second step chose another token: the third (other inputs) is not read.
    assert rounding_noise(ref, other) == pytest.approx(0.3)
    assert rounding_noise(ref, ref) == 0.0


def _tempered_sdpa(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
    """sdpa at twice the model's softmax temperature: an attention the service does not
    compute, which no config field names."""
    kwargs["scaling"] = 0.5 * float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def test_an_attention_the_service_does_not_compute_is_refused_whatever_its_noise() -> None:
    # The model's own implementation and eager disagree by far more than rounding: the
    # tolerance grows to its cap only, and the service path is refused.
    AttentionInterface.register("tempered_sdpa_test", _tempered_sdpa)
    model = tiny_model("llama", seed=3)
    model.set_attn_implementation("tempered_sdpa_test")
    with _service(2) as svc, KVCacheClient(svc.address, timeout_s=30) as client:
        with pytest.raises(ValueError, match=r"logits differ by .* own sdpa and eager"):
            ServiceModel(model, client)
        assert model.config._attn_implementation == "tempered_sdpa_test"
        model.set_attn_implementation("sdpa")
        served = ServiceModel(model, client)  # the same weights, plain attention: accepted
        served.detach()
