"""workers.engine.model_config: a model's shape from its own config.json, found without the network.

The configs under tests/fixtures/models/ are the published ones (Llama-3.1-8B, Qwen3-32B,
Qwen3-30B-A3B, Qwen3-Next-80B-A3B) and the 27B-shaped Qwen3.6 stand-in the H200 runs used. The
parameter counts below are the models' published totals, counted from SGLang's model classes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workers.engine import model_config as mc
from workers.engine.model_config import ModelConfigError, find_config, model_shape

MODELS = Path(__file__).parent / "fixtures" / "models"
GIB = 1024**3
MIB = 1024**2


def _params(shape: mc.ModelShape, rope_bytes: int) -> float:
    """bf16 parameters of the counted tensors (the rope cache is float32 bytes)."""
    return (shape.tensor_gib * GIB - rope_bytes) / 2


def test_llama_3_1_8b_dense_gqa() -> None:
    s = model_shape(str(MODELS / "llama-3.1-8b"))
    assert (s.architecture, s.hybrid, s.multimodal, s.experts) == ("LlamaForCausalLM", False,
                                                                    False, 0)
    assert s.kv_bytes_per_token == 32 * 8 * (128 + 128) * 2  # 128 KiB
    assert (s.kv_heads, s.full_attention_layers) == (8, 32)
    assert s.context_length == 131072  # llama3 rope: no factor (get_context_length)
    assert _params(s, 131072 * 128 * 4) == 8_030_261_248
    assert s.eos_token_id == 128001 and not s.tied_embeddings
    assert s.weights_source == "config" and s.draft_kv_bytes_per_token == 0


def test_qwen3_32b_dense() -> None:
    s = model_shape(str(MODELS / "qwen3-32b"))
    assert s.kv_bytes_per_token == 64 * 8 * 256 * 2  # 256 KiB
    assert s.context_length == 40960
    assert _params(s, 40960 * 128 * 4) == 32_762_123_264
    assert not s.piecewise_cuda_graph_disabled


def test_qwen3_30b_a3b_moe() -> None:
    s = model_shape(str(MODELS / "qwen3-30b-a3b"))
    assert (s.architecture, s.experts, s.hybrid) == ("Qwen3MoeForCausalLM", 128, False)
    assert s.kv_bytes_per_token == 48 * 4 * 256 * 2
    assert _params(s, 40960 * 128 * 4) == 30_532_122_624


def test_qwen3_next_80b_a3b_hybrid_moe() -> None:
    s = model_shape(str(MODELS / "qwen3-next-80b-a3b"))
    # Every 4th layer is full attention (configs/qwen3_next.py::layers_block_type).
    assert (s.full_attention_layers, s.linear_attention_layers) == (12, 36)
    assert s.kv_bytes_per_token == 12 * 2 * 512 * 2
    # Mamba2StateShape: conv (32*128 + 2*16*128) x (4 - 1) bf16, SSM 32 x 128 x 128 fp32.
    assert s.mamba_conv_bytes_per_slot == 36 * 8192 * 3 * 2
    assert s.mamba_bytes_per_slot - s.mamba_conv_bytes_per_slot == 36 * 32 * 128 * 128 * 4
    assert s.hybrid and s.piecewise_cuda_graph_disabled and s.experts == 512
    # 80 B in total (the model card), MTP not included.
    assert _params(s, 262144 * 64 * 4) == pytest.approx(80e9, rel=0.01)


def test_qwen36_27b_style_hybrid_with_vision_and_mtp() -> None:
    s = model_shape(str(MODELS / "qwen36-27b-dummy"))
    assert (s.architecture, s.model_type) == ("Qwen3_5ForConditionalGeneration", "qwen3_5")
    assert (s.full_attention_layers, s.linear_attention_layers, s.mtp_layers) == (16, 48, 1)
    assert s.kv_bytes_per_token == 32 * 1024
    assert s.mamba_bytes_per_slot == 150_994_944 + 2_949_120  # 144 MiB SSM + 2.81 MiB conv
    assert s.mamba_ssm_dtype == "float32"
    # The vision_config names its layers `depth`: SGLang's VLM factor reads 24 (its default).
    assert s.multimodal and s.vision == (24, 1152)
    # Logged by real SGLang: target `mem usage=50.89 GB`, draft 5.52 GB while loading, of
    # which 4.73 GB (its own embed_tokens and lm_head) come back.
    assert s.tensor_gib == pytest.approx(50.863, abs=0.001)  # what the allocator holds them in:
    assert s.weights_gib == pytest.approx(50.89, abs=0.005)
    assert s.draft_load_gib == pytest.approx(5.52, abs=0.01)
    assert s.draft_weights_gib == pytest.approx(5.52 - 4.73, abs=0.01)
    assert s.draft_kv_bytes_per_token == 2 * 512 * 2  # one attention layer
    assert s.context_length == 262144


def test_tiny_dense_weights_match_the_real_engine() -> None:
    s = model_shape(str(MODELS / "qwen3-tiny"))
    # 13 MiB of tensors in 44 MiB of segments: the logged mem usage=0.04 GB.
    assert s.tensor_gib * 1024 == pytest.approx(13, abs=0.5)
    assert s.weights_gib == pytest.approx(0.04, abs=0.005)
    assert s.tied_embeddings


def test_an_index_wins_only_for_a_quantization_the_config_count_does_not_model(tmp_path) -> None:
    """A GPTQ checkpoint's tensors are not the config's bf16 ones: then the index's total_size is
    the weights, less the MTP layer the draft loads, plus the rope cache, in the segments the
    config count would place them in."""
    folder = tmp_path / "quantized"
    shutil.copytree(MODELS / "qwen36-27b-dummy", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    total = 30 * GIB
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": {}}))
    s = model_shape(str(folder))
    counted = model_shape(str(MODELS / "qwen36-27b-dummy"))
    rope = 262144 * 64 * 4
    assert s.weights_source == "safetensors index" and s.index_gib == 30
    assert s.tensor_gib * GIB == pytest.approx(total + rope - s.draft_weights_gib * GIB)
    assert s.weights_gib - s.tensor_gib == pytest.approx(
        counted.weights_gib - counted.tensor_gib, abs=1e-9)


def _cache(root: Path, repo: str, revision: str, config: Path) -> Path:
    snap = root / ("models--" + repo.replace("/", "--")) / "snapshots" / revision
    snap.mkdir(parents=True)
    shutil.copy(config, snap / "config.json")
    return snap / "config.json"


def test_a_hub_id_is_found_in_the_hf_cache_by_refs_main(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    old = _cache(cache, "meta-llama/Llama-3.1-8B", "aaa", MODELS / "qwen3-tiny" / "config.json")
    new = _cache(cache, "meta-llama/Llama-3.1-8B", "bbb", MODELS / "llama-3.1-8b" / "config.json")
    env = {"HF_HUB_CACHE": str(cache), "HOME": str(tmp_path)}
    refs = cache / "models--meta-llama--Llama-3.1-8B" / "refs"
    refs.mkdir()
    (refs / "main").write_text("aaa\n")
    assert find_config("meta-llama/Llama-3.1-8B", env) == old
    (refs / "main").write_text("bbb")
    assert find_config("meta-llama/Llama-3.1-8B", env) == new
    # HF_HOME/hub and ~/.cache/huggingface/hub are the other places, in that order.
    home = tmp_path / "home"
    found = _cache(home / ".cache" / "huggingface" / "hub", "Qwen/Qwen3-32B", "c",
                   MODELS / "qwen3-32b" / "config.json")
    assert find_config("Qwen/Qwen3-32B", {"HOME": str(home)}) == found
    assert model_shape("Qwen/Qwen3-32B", {"HOME": str(home)}).kv_bytes_per_token == 262144


def test_a_local_folder_and_a_folder_name_in_the_config_dirs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert find_config(str(MODELS / "qwen3-32b"), {}) == MODELS / "qwen3-32b" / "config.json"
    env = {"HOME": str(tmp_path)}
    # The shipped profiles' hub ids resolve to config/models/ when the cache lacks them.
    assert find_config("Qwen/Qwen3-0.6B", env) == (
        mc.REPO_CONFIGS / "Qwen--Qwen3-0.6B" / "config.json")
    # A path from another node (a snapshot) is looked up by its folder name.
    monkeypatch.setattr(mc, "CONFIG_DIRS", [MODELS])
    assert find_config("/tmp/rsg/models/qwen3-tiny", env) == MODELS / "qwen3-tiny" / "config.json"


def test_a_missing_model_is_one_line_naming_the_file(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    with pytest.raises(ModelConfigError) as err:
        find_config("someone/never-downloaded", env)
    message = str(err.value)
    assert "\n" not in message and message.startswith("someone/never-downloaded/config.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match=r"empty/config.json: no such file"):
        model_shape(str(tmp_path / "empty"), env)


@pytest.mark.parametrize(("drop", "key"), [
    ("num_hidden_layers", "num_hidden_layers"),
    ("linear_num_value_heads", "linear_num_value_heads"),
    ("full_attention_interval", "full_attention_interval"),
    ("architectures", "architectures"),
])
def test_an_unreadable_config_names_the_file_and_the_key(tmp_path: Path, drop: str,
                                                          key: str) -> None:
    cfg = json.loads((MODELS / "qwen3next-tiny" / "config.json").read_text())
    del cfg[drop]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=rf"m/config.json: key '{key}' missing$"):
        model_shape(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"m/config.json: cannot read"):
        model_shape(str(tmp_path / "m"))


def test_gpt_oss_sliding_window_layers_get_their_own_pool() -> None:
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
           "hidden_size": 2880, "num_hidden_layers": 4, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 2,
           "max_position_embeddings": 131072}
    s = mc.shape_from_config(cfg, "gpt-oss/config.json")
    assert (s.full_attention_layers, s.swa_layers) == (2, 2)
    assert s.kv_bytes_per_token == s.swa_kv_bytes_per_token == 2 * 8 * 128 * 2


def test_mla_cell_is_the_latent_and_not_split_by_tp() -> None:
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
           "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "intermediate_size": 18432, "max_position_embeddings": 163840}
    # Without an index the weights are counted from the config, which must then name the MLA
    # head sizes (one line naming the key, as for every other family).
    with pytest.raises(ModelConfigError, match=r"dsv3/config.json: key 'qk_nope_head_dim'"):
        mc.shape_from_config(cfg, "dsv3/config.json")
    s = mc.shape_from_config(cfg, "dsv3/config.json", index_total=640 * GIB)
    assert s.kv_bytes_per_token == 61 * (512 + 64) * 2 and s.kv_heads == 0
    # the index's total, plus post_load_weights' w_kc/w_vc (61 x 128 x 256 x 512 bf16) and the
    # DeepSeek-YaRN rope's three [163840, 64] float32 tables
    extra = 61 * 128 * 256 * 512 * 2 + 3 * 163840 * 64 * 4
    assert s.weights_gib == pytest.approx(640 + extra / GIB, abs=1e-6)


def test_mistral_and_qwen2_dense_count_their_published_totals() -> None:
    """Mistral-7B-v0.3 (no head_dim key: hidden / heads) and Qwen2.5-7B (qkv bias)."""
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
               "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "max_position_embeddings": 32768, "sliding_window": None,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    s = mc.shape_from_config(mistral, "mistral/config.json")
    assert _params(s, 32768 * 128 * 4) == 7_248_023_552
    assert s.kv_bytes_per_token == 32 * 8 * 256 * 2 and s.swa_layers == 0
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
             "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4,
             "max_position_embeddings": 32768, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}
    s = mc.shape_from_config(qwen2, "qwen2/config.json")
    assert _params(s, 32768 * 128 * 4) == 7_615_616_512


def test_the_caching_allocators_segments_are_what_memory_shows() -> None:
    from workers.engine.allocator import reserved_bytes
    mib = 1 << 20
    assert reserved_bytes([("a", 0, 1)]) == 2 * mib  # small pool: a 2 MiB segment
    assert reserved_bytes([("a", 0, mib + 1)]) == 20 * mib  # 1-10 MiB: a 20 MiB segment
    assert reserved_bytes([("a", 0, 10 * mib + 1)]) == 12 * mib  # larger: rounded to 2 MiB
    # Best fit in a segment's free rest, and freed segments go back on empty_cache.
    events = [("a", 0, 3 * mib), ("a", 1, 9 * mib), ("a", 2, 9 * mib), ("f", 1, 0),
              ("a", 3, 64 * mib), ("f", 3, 0)]
    assert reserved_bytes(events) == 40 * mib
    assert reserved_bytes([*events, ("f", 0, 0)]) == 20 * mib


def test_issue_28_families_count_their_published_sizes_from_the_config_alone() -> None:
    """No index: DeepSeek-V2-Lite 15.7 B and Qwen3-235B-A22B 235.1 B parameters (their model
    cards), DeepSeek-V3 in fp8 with block scales, and the Mamba-2 hybrids' state and layers."""
    lite = model_shape(str(MODELS / "deepseek-v2-lite"))
    assert lite.weights_source == "config" and lite.kv_bytes_per_token == 27 * 576 * 2
    assert (lite.tensor_gib * GIB) / 2 == pytest.approx(15.7e9, rel=0.01)
    big = model_shape(str(MODELS / "qwen3-235b-a22b"))
    assert (big.tensor_gib * GIB - 40960 * 128 * 4) / 2 == pytest.approx(235.09e9, rel=0.001)
    v3 = model_shape(str(MODELS / "deepseek-v3"))
    assert 600 < v3.weights_gib < 660  # 671 B parameters, the Linear ones in fp8
    falcon = model_shape(str(MODELS / "falcon-h1-7b"))
    assert (falcon.full_attention_layers, falcon.linear_attention_layers) == (44, 44)
    # per layer: SSM 24 heads x 128 x 256 fp32, conv (3072 + 2 x 256) x 3 bf16
    assert falcon.mamba_bytes_per_slot == 44 * (24 * 128 * 256 * 4 + 3584 * 3 * 2)
    nemo = model_shape(str(MODELS / "nemotron-h-8b"))
    # hybrid_override_pattern: 24 Mamba-2, 4 attention, 24 MLP layers
    assert (nemo.full_attention_layers, nemo.linear_attention_layers) == (4, 24)
    assert nemo.kv_bytes_per_token == 4 * 8 * 256 * 2
    assert nemo.mamba_bytes_per_slot == 24 * (128 * 64 * 128 * 4 + (8192 + 2 * 8 * 128) * 3 * 2)
    # the newer spelling: layers_block_type, and num_hidden_layers left out
    text = json.loads((MODELS / "nemotron-h-8b" / "config.json").read_text())
    kinds = [mc.NEMOTRON_PATTERN[c] for c in text.pop("hybrid_override_pattern")]
    del text["num_hidden_layers"]
    listed = mc.shape_from_config({**text, "layers_block_type": kinds}, "nemo/config.json")
    assert (listed.kv_bytes_per_token, listed.mamba_bytes_per_slot) == (
        nemo.kv_bytes_per_token, nemo.mamba_bytes_per_slot)
    granite = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
               "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 8,
               "num_key_value_heads": 4, "vocab_size": 1000, "intermediate_size": 512,
               "mamba_n_heads": 32, "mamba_d_head": 64, "mamba_ssm_dtype": "bfloat16"}
    g = mc.shape_from_config(granite, "granite/config.json")
    # default layer_types: attention where (l + 1) % 6 == 0; the config's SSM dtype is not read
    assert (g.full_attention_layers, g.linear_attention_layers) == (2, 10)
    assert g.mamba_ssm_dtype == "float32"
    # A Granite-4.0-H-Small shape (not run: tests/fixtures/models/granite-4.0-h-small-shape): 36
    # Mamba-2 layers of 128 heads x 64 x 128 fp32 and (8192 + 2 x 128) x 3 bf16, 4 attention
    # layers of 8 KV heads x 128, no rope (position_embedding_type "nope"), the head tied.
    small = model_shape(str(MODELS / "granite-4.0-h-small-shape"))
    assert small.mamba_bytes_per_slot == 36 * (128 * 64 * 128 * 4 + 8448 * 3 * 2)
    assert small.kv_bytes_per_token == 4 * 8 * 256 * 2
    assert (small.tensor_gib * GIB) / 2 == pytest.approx(32.2e9, rel=0.01)


def test_gpt_oss_as_published_counts_its_mxfp4_experts_at_4_25_bits() -> None:
    """gpt-oss-20b's published config.json has ``quantization_config`` mxfp4 (the experts only):
    ``Mxfp4MoEMethod.create_weights``' uint8 weights and scales and bf16 biases, about 12.8 GiB
    (the H200 capture ran its bf16 form, 39.16 GB; the mxfp4 one was not run)."""
    cfg = json.loads((MODELS / "gpt-oss-20b" / "config.json").read_text())
    bf16 = mc.shape_from_config(cfg, "gpt-oss/config.json")
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    mx = mc.shape_from_config(cfg, "gpt-oss/config.json")
    experts = 24 * 32 * 3 * 2880 * 2880  # expert width is intermediate_size (2880)
    saved = experts * 2 - experts * (0.5 + 1 / 32)
    assert bf16.tensor_gib - mx.tensor_gib == pytest.approx(saved / GIB, rel=1e-3)
    assert 12.5 < mx.weights_gib < 13.5


FAMILIES = sorted(p.parent.name for p in MODELS.glob("*/config.json"))


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("total", ["checkpoint", "logged"])
def test_a_folder_with_an_index_gives_the_config_s_exact_answer(tmp_path, model, total) -> None:
    """Every family, with ``model.safetensors.index.json`` beside its config.json: SGLang
    allocates the parameters from the config and the checkpoint only fills them, so the
    weights, the pools and the cap are the config's to the byte, whatever ``total_size`` says
    (the checkpoint's own tensors, or the load's logged footprint as a held-out test wrote it)."""
    from workers.engine import weights as w
    from workers.engine.capacity import EngineFlags, plan_capacity

    counted = model_shape(str(MODELS / model))
    text = json.loads((MODELS / model / "config.json").read_text())
    rope_dim = int(text.get("qk_rope_head_dim") or text.get("head_dim") or 128)
    checkpoint = (counted.tensor_gib * GIB - w.rope_buffer_bytes(text, rope_dim)
                  - w.runtime_extra_bytes(counted.architecture, text))
    size = int(checkpoint if total == "checkpoint" else counted.weights_gib * GIB)
    shutil.copy(MODELS / model / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": {}}))
    indexed = model_shape(str(tmp_path))
    assert indexed.index_gib == pytest.approx(size / GIB)
    assert (indexed.weights_gib, indexed.tensor_gib, indexed.weights_source) == (
        counted.weights_gib, counted.tensor_gib, "config")
    flags = EngineFlags.from_flags({"context-length": 8192, "disable-cuda-graph": True})
    try:
        want = plan_capacity(counted, flags, 143_771)
    except (ValueError, RuntimeError):  # too big for one H200, or refused: so with the index
        with pytest.raises((ValueError, RuntimeError)):
            plan_capacity(indexed, flags, 143_771)
        return
    got = plan_capacity(indexed, flags, 143_771)
    assert (got.max_total_num_tokens, got.max_running_requests, got.max_mamba_cache_size) == (
        want.max_total_num_tokens, want.max_running_requests, want.max_mamba_cache_size)


def test_olmoe_and_gemma3_4b_count_their_published_totals() -> None:
    """OLMoE-1B-7B (expert width ``intermediate_size``, q/k norms over the hidden size): 6.92 B;
    Gemma-3-4B as published (``Gemma3ForConditionalGeneration``: the SigLIP tower and projector,
    the text model with Gemma3TextConfig's defaults, two rope bases): 4.30 B, plus its two
    [131072, 256] float32 rope caches."""
    olmoe = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048,
             "intermediate_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16,
             "num_hidden_layers": 16, "num_experts": 64, "num_experts_per_tok": 8,
             "vocab_size": 50304, "max_position_embeddings": 4096, "rope_theta": 10000,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    s = mc.shape_from_config(olmoe, "olmoe/config.json")
    assert _params(s, 4096 * 128 * 4) == pytest.approx(6.919e9, rel=1e-3)
    gemma = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                             "model_type": "gemma3_text", "num_hidden_layers": 34,
                             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024, "vocab_size": 262208},
             "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                               "model_type": "siglip_vision_model", "num_attention_heads": 16,
                               "num_hidden_layers": 27, "patch_size": 14},
             "torch_dtype": "bfloat16"}
    g = mc.shape_from_config(gemma, "gemma3-4b/config.json")
    assert _params(g, 2 * 131072 * 256 * 4) == pytest.approx(4.300e9, rel=2e-3)
    assert g.multimodal and g.kv_bytes_per_token == 34 * 4 * 512 * 2 and g.swa_layers == 0


def test_deepseek_v3_fp8_counts_its_published_index_total() -> None:
    """DeepSeek-V3's model.safetensors.index.json gives total_size 688,586,727,753: the fp8
    Linear weights with a float32 scale per 128 x 128 block, bf16 embeddings, norms and gates,
    and the MTP layer (model.layers.61, with its own embed_tokens and shared head). The config
    count of the target model plus that layer comes within 0.05 %; with an index, the MTP layer is
    taken back out, as SGLang's target model does not build it."""
    from workers.engine import weights as w

    text = json.loads((MODELS / "deepseek-v3" / "config.json").read_text())
    v3 = model_shape(str(MODELS / "deepseek-v3"))
    runtime = w.runtime_extra_bytes(v3.architecture, text) + w.rope_buffer_bytes(text, 64)
    checkpoint = v3.tensor_gib * GIB - runtime + w.deepseek_mtp_checkpoint_bytes(text, text)
    assert checkpoint == pytest.approx(688_586_727_753, rel=5e-4)
    s = mc.shape_from_config(text, "dsv3/config.json", index_total=688_586_727_753)
    assert s.weights_gib == pytest.approx(v3.tensor_gib, rel=5e-4)
