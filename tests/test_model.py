"""The model room: a transformers Llama built from the config, started from a local folder, or sized on meta."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from rank_support import tiny_config
from trainer.config import Config
from trainer.config.choices import compile_enabled
from trainer.config.sizes import parameter_count
from trainer.errors import UserError
from trainer.model.build import (
    attention_backend,
    build_model,
    compile_layers,
    count_parameters,
    enable_gradient_checkpointing,
    shape_signature,
    use_maskless_causal_attention,
)
from trainer.model.estimate import model_shape

CPU = torch.device("cpu")


def cfg_for(tmp_path: Path, **model: object) -> Config:
    return tiny_config(tmp_path, tmp_path / "cache", model=dict(model))


def test_built_from_the_config_fields(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, num_layers=2, init_std=0.05, tie_word_embeddings=False)
    model = build_model(cfg, vocab_size=300, eos_id=0, device=CPU)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config._attn_implementation == "sdpa"
    assert model.config.vocab_size == 300  # model.vocab_size null: the tokenizer's vocabulary
    assert model.config.num_key_value_heads == 2 and model.config.intermediate_size == 64
    assert model.config.eos_token_id == 0 and model.config.use_cache is False
    assert count_parameters(model) == parameter_count(cfg)  # data.vocab_size is 300 too
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.04 < std < 0.06  # model.init_std reaches initializer_range


def test_same_seed_same_weights(tmp_path: Path) -> None:
    """Every rank seeds, then builds: identical initial weights without a broadcast (what FSDP relies on)."""
    cfg = cfg_for(tmp_path)
    torch.manual_seed(7)
    a = build_model(cfg, 300, 0, CPU)
    torch.manual_seed(7)
    b = build_model(cfg, 300, 0, CPU)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_starts_from_a_local_folder_with_weights(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    source = build_model(cfg, 320, 0, CPU)
    source.save_pretrained(tmp_path / "pretrained")
    cfg.model.name_or_path = str(tmp_path / "pretrained")
    cfg.model.hidden_size = 64  # ignored: the folder defines the architecture
    loaded = build_model(cfg, vocab_size=300, eos_id=0, device=CPU)
    assert loaded.config.vocab_size == 320 and loaded.config.hidden_size == 32
    assert all(torch.equal(x, y) for x, y in zip(source.state_dict().values(), loaded.state_dict().values()))


def test_a_folder_with_only_an_architecture_starts_fresh(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, num_layers=2)
    build_model(cfg, 300, 0, CPU).config.save_pretrained(tmp_path / "arch")
    cfg.model.name_or_path = str(tmp_path / "arch")
    model = build_model(cfg, 300, 0, CPU)
    assert model.config.num_hidden_layers == 2 and count_parameters(model) > 0


def test_a_model_smaller_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, vocab_size=256)
    with pytest.raises(UserError, match="smaller than the tokenizer"):
        build_model(cfg, vocab_size=300, eos_id=0, device=CPU)


def test_meta_sizes_of_the_production_preset_allocate_nothing() -> None:
    from trainer.config import apply_layer
    from trainer.config.resolve import preset_layer

    cfg = Config()
    apply_layer(cfg, preset_layer("production"), "production")
    shape = model_shape(cfg)  # 7B parameters on the meta device: instant, no memory
    assert shape.parameters == parameter_count(cfg) > 7_000_000_000
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (32, 4096, 8)


def test_shape_signature_names_every_parameter(tmp_path: Path) -> None:
    model = build_model(cfg_for(tmp_path), 300, 0, CPU)
    signature = shape_signature(model)
    assert signature["model.embed_tokens.weight"] == [300, 32]
    assert len(signature) == len(list(model.parameters()))


def test_maskless_causal_attention_is_sdpa_without_host_reads(tmp_path: Path) -> None:
    from trainer.diagnosis.host_sync import HostSyncCounter

    model = build_model(cfg_for(tmp_path, num_layers=2), 300, 0, CPU)
    batch = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with HostSyncCounter() as counter:
        expected = model(input_ids=batch).logits
    assert counter.count > 0  # transformers' mask builder reads the position ids back every forward
    use_maskless_causal_attention(model)
    with HostSyncCounter() as counter:
        got = model(input_ids=batch).logits
    assert counter.count == 0 and torch.equal(got, expected)
    model.save_pretrained(tmp_path / "saved")
    assert "sdpa_causal_no_mask" not in (tmp_path / "saved" / "config.json").read_text()


def test_gradient_checkpointing_switch(tmp_path: Path) -> None:
    model = build_model(cfg_for(tmp_path, num_layers=2), 300, 0, CPU)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
    enable_gradient_checkpointing(model, "none")
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
    enable_gradient_checkpointing(model, "full")
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    selective = build_model(cfg_for(tmp_path, num_layers=4), 300, 0, CPU)
    enable_gradient_checkpointing(selective, "selective")  # every other layer, from the first
    assert [layer.gradient_checkpointing for layer in selective.model.layers] == [True, False, True, False]


def test_compile_auto_means_cuda_only_and_never_while_tracing(tmp_path: Path) -> None:
    def enabled(cuda: bool, compile: object = "auto", **debug: object) -> bool:
        cfg = tiny_config(tmp_path, tmp_path / "cache", system={"compile": compile}, debug=dict(debug))
        return compile_enabled(cfg, cuda)

    assert enabled(cuda=True) and not enabled(cuda=False)
    assert not enabled(cuda=True, nan_localize=True)
    assert not enabled(cuda=True, inject_nan_module="model.norm", inject_nan_step=1)
    assert enabled(cuda=False, compile=True) and not enabled(cuda=True, compile=False)


def test_attention_backend_on_cpu_ranks(tmp_path: Path) -> None:
    """auto and math apply on a CPU rank (math pins SDPA's reference kernel: the same numbers); the CUDA kernels fall
    back to auto and say so."""
    def backend(name: str):  # noqa: ANN202
        return attention_backend(tiny_config(tmp_path, tmp_path / "cache", model={"attention_backend": name},
                                             training={"use_amp": True, "precision": "bf16"}), CPU)

    assert backend("auto")[0] == "auto" and backend("flash")[0] == "auto (flash needs CUDA)"
    name, context = backend("math")
    model = build_model(cfg_for(tmp_path, num_layers=2), 300, 0, CPU)
    use_maskless_causal_attention(model)
    batch = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=batch).logits
        with context():
            got = model(input_ids=batch).logits
    assert name == "math" and torch.allclose(got, expected, atol=1e-5)


def test_compiled_layers_keep_their_names(tmp_path: Path) -> None:
    """nn.Module.compile in place: no `_orig_mod` in parameter names (checkpoints, hooks and save_pretrained see the
    same model); compilation itself happens at the first call, on GPUs."""
    model = build_model(cfg_for(tmp_path, num_layers=2), 300, 0, CPU)
    names = list(shape_signature(model))
    compile_layers(model)
    assert list(shape_signature(model)) == names
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
