"""A tiny random hybrid target for the decoding tests (CPU and GPU)."""

from __future__ import annotations

import pytest
import torch


def hybrid_model() -> torch.nn.Module:
    """A tiny random Qwen3.5-shaped model: linear-attention (Gated DeltaNet) layers, whose cache
    holds conv and recurrent states, between full-attention ones."""
    pytest.importorskip("transformers.models.qwen3_5", reason="transformers without Qwen3.5")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=300, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def save_multimodal_hybrid(folder: str) -> torch.nn.Module:
    """The hybrid's text model inside a tiny image-text checkpoint, as Qwen3.5's are published
    (`text_config` nested in the config, the weights under `model.language_model`), saved to
    `folder`; returns the model as built (its `model.language_model` is the reference)."""
    pytest.importorskip("transformers.models.qwen3_5", reason="transformers without Qwen3.5")
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = hybrid_model().config.to_dict()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": text["hidden_size"]}  # fmt: skip
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.save_pretrained(folder)
    return model
