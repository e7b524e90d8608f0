"""The named configs of the open models (mixtral-8x7b, qwen3-30b-a3b, qwen2-57b-a14b, olmoe-1b-7b,
deepseek-v3-671b, deepseek-v2-lite, gpt-oss-20b, gpt-oss-120b) are the shapes transformers builds from their
config.json: the same parameter count, parameter for parameter, and an import of that config.json gives the named
config's model back."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer.config import load_config  # noqa: E402
from trainer.flops import counts_of  # noqa: E402
from trainer.hf.families import family_of, hub_config, trainer_config  # noqa: E402

# name -> (family, the total parameters the model's card publishes, in billions)
NAMED = {"mixtral-8x7b": ("mixtral", 46.7), "qwen3-30b-a3b": ("qwen3_moe", 30.5),
         "qwen2-57b-a14b": ("qwen2_moe", 57.4), "olmoe-1b-7b": ("olmoe", 6.9),
         "deepseek-v3-671b": ("deepseek_v3", 671.0), "deepseek-v2-lite": ("deepseek_v2", 15.7),
         "gpt-oss-20b": ("gpt_oss", 20.9), "gpt-oss-120b": ("gpt_oss", 116.8)}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_a_named_config_is_the_model_transformers_builds(name):
    cfg = load_config(name)
    family = family_of(cfg)
    assert family.model_type == NAMED[name][0]
    hub = hub_config(cfg, family)
    config = transformers.AutoConfig.for_model(**hub)
    with torch.device("meta"):  # shapes only: no memory for 47B parameters
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    assert counts_of(cfg).total == total
    assert round(total / 1e9, 1) == NAMED[name][1]
    back = trainer_config(hub, "config.json", cfg.param_dtype)
    assert back.model.model_dump(exclude={"remat"}) == cfg.model.model_dump(exclude={"remat"})
    shape = ("num_experts", "top_k", "d_ff", "renormalize", "num_shared_experts", "shared_d_ff", "shared_gate")
    assert {k: getattr(back.moe, k) for k in shape} == {k: getattr(cfg.moe, k) for k in shape}
