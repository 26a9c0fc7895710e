"""A Mamba-2 layer's sizes, read from a hybrid model's config.json as SGLang's config classes
read them: one reading of the keys for the pool arithmetic (:mod:`workers.engine.model_config`)
and the weights count (:mod:`workers.engine.weights`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def mamba2_params(text: Mapping[str, Any], arch: str, hidden: int) -> dict:
    """A Mamba-2 layer's sizes as each config class passes them to ``Mamba2StateShape.create``
    and ``MambaMixer2`` (``configs/falcon_h1.py``, ``configs/nemotron_h.py``,
    ``configs/granitemoehybrid.py``; the mixer's arguments in ``models/``), with the config
    classes' defaults for absent keys:

    - Falcon-H1: intermediate ``mamba_d_ssm`` (else ``mamba_expand x hidden``), heads
      ``mamba_n_heads``, head dim ``mamba_d_head`` (``auto``: intermediate / heads), groups
      ``mamba_n_groups``, state ``mamba_d_state``, kernel ``mamba_d_conv``; SSM dtype from the
      config's ``mamba_ssm_dtype`` (``mamba2_state_dtype(self)``).
    - Nemotron-H: intermediate ``mamba_num_heads x mamba_head_dim``, state groups ``n_groups``
      (the mixer's weights use ``mamba_n_groups``, default 8), state ``ssm_state_size``, kernel
      ``conv_kernel``; SSM dtype from the config.
    - Granite-4.0-H: intermediate ``mamba_expand x hidden``, ``mamba_n_heads``, ``mamba_d_head``,
      ``mamba_n_groups``, ``mamba_d_state``, ``mamba_d_conv``; its ``Mamba2CacheParams`` is built
      without the config (``dtype`` defaults to ``mamba2_state_dtype(None)``), so the SSM state is
      float32 unless ``--mamba-ssm-dtype`` / ``SGLANG_MAMBA_SSM_DTYPE`` says otherwise.
    """
    def get(key: str, default: Any) -> Any:
        value = text.get(key)
        return default if value is None else value

    if arch == "NemotronHForCausalLM":
        heads, head_dim = int(get("mamba_num_heads", 128)), int(get("mamba_head_dim", 64))
        return {"intermediate": heads * head_dim, "heads": heads, "head_dim": head_dim,
                "groups": int(get("n_groups", get("mamba_n_groups", 8))),
                "weight_groups": int(get("mamba_n_groups", 8)),
                "state": int(get("ssm_state_size", 128)), "kernel": int(get("conv_kernel", 4)),
                "conv_bias": bool(get("use_conv_bias", True)),
                "proj_bias": bool(get("use_bias", False)), "rms_norm": True,
                "ssm_dtype": str(get("mamba_ssm_dtype", "float32"))}
    if arch == "FalconH1ForCausalLM":
        inter = int(get("mamba_d_ssm", int(get("mamba_expand", 2)) * hidden))
        heads = int(get("mamba_n_heads", 128))
        head_dim = get("mamba_d_head", "auto")
        head_dim = inter // heads if head_dim == "auto" else int(head_dim)
        groups = int(get("mamba_n_groups", 1))
        return {"intermediate": inter, "groups": groups, "weight_groups": groups,
                "heads": heads, "head_dim": head_dim, "state": int(get("mamba_d_state", 256)),
                "kernel": int(get("mamba_d_conv", 4)),
                "conv_bias": bool(get("mamba_conv_bias", True)),
                "proj_bias": bool(get("mamba_proj_bias", False)),
                "rms_norm": bool(get("mamba_rms_norm", False)),
                "ssm_dtype": str(get("mamba_ssm_dtype", "float32"))}
    groups = int(get("mamba_n_groups", 1))
    return {"intermediate": int(get("mamba_expand", 2)) * hidden, "groups": groups,
            "weight_groups": groups, "heads": int(get("mamba_n_heads", 64)),
            "head_dim": int(get("mamba_d_head", 64)), "state": int(get("mamba_d_state", 128)),
            "kernel": int(get("mamba_d_conv", 4)),
            "conv_bias": bool(get("mamba_conv_bias", True)),
            "proj_bias": bool(get("mamba_proj_bias", False)), "rms_norm": True,
            "ssm_dtype": "float32"}
