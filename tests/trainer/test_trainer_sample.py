"""trainer.sample: the key/value cache decodes what the full forward pass computes; a trained `tiny`
continues the synthetic source with transitions the source allows; a directory without a checkpoint exits 2."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from click.testing import CliRunner
from flax import nnx

from trainer import sharding
from trainer.config import load_config
from trainer.data import make_source
from trainer.sample import make_decoder, sample_command
from trainer.train import build_trainer, step_rngs


def test_the_cache_decodes_what_the_full_forward_pass_computes():
    cfg = load_config("tiny", ["moe.eval_capacity_factor=0", "model.num_kv_heads=2"])  # dropless; grouped kv
    trainer = build_trainer(cfg, sharding.make_mesh({"data": 1, "expert": 1}, jax.devices()[:1]), 10)
    params = trainer.init_fn()["params"]
    tokens = jnp.asarray([[5, 9, 2, 31, 7, 7, 1, 30, 12, 4]], jnp.int32)
    model = nnx.merge(trainer.graphdef, trainer.codec.unflatten(params), step_rngs(trainer.rest, jnp.int32(0)))
    full_LxV = model(tokens, train=False)[0][0]
    forward, cache = make_decoder(trainer, 1, tokens.shape[1])
    forward = jax.jit(forward)
    logits, cache = forward(params, cache, tokens[:, :4], 0)  # the prompt in one pass
    np.testing.assert_allclose(logits[0], full_LxV[3], atol=1e-4)
    for position in range(4, tokens.shape[1]):  # then one token at a time
        logits, cache = forward(params, cache, tokens[:, position:position + 1], position)
        np.testing.assert_allclose(logits[0], full_LxV[position], atol=1e-4, err_msg=str(position))


def test_a_trained_tiny_continues_the_source_with_allowed_transitions(trained_tiny):
    out = trained_tiny.output_dir  # 120 steps through the command line (tests/trainer/conftest.py)
    assert json.loads((out / "config.json").read_text())["name"] == "tiny"
    assert not (out / "profile").exists()  # no trace without --profile-steps
    source = make_source(load_config("tiny"), seed=0)
    prompt = source.rows(7, [0])[0][:16]
    result = CliRunner().invoke(sample_command, ["--checkpoint", str(out), "--prompt", " ".join(map(str, prompt)),
                                                 "--tokens", "300", "--seed", "1"])
    assert result.exit_code == 0, result.output
    ids = [int(t) for t in result.stdout.split()]
    assert len(ids) == 300
    allowed = {(s, int(t)) for s in range(source.succ_VxK.shape[0]) for t in source.succ_VxK[s]}
    pairs = list(zip([int(prompt[-1]), *ids], ids, strict=False))
    share = sum(p in allowed for p in pairs) / len(pairs)
    assert share >= 0.95, share
    assert "300 tokens from the checkpoint at step 120 (tiny)" in result.stderr and "tokens/s" in result.stderr


def test_no_checkpoint_or_no_config_exits_2_naming_the_directory(tmp_path):
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    (tmp_path / "empty" / "config.json").write_text(json.dumps(load_config("tiny").to_dict()))
    for directory, needle in ((tmp_path / "empty", f"{tmp_path / 'empty' / 'checkpoints'} holds no checkpoint"),
                              (tmp_path / "none", f"--checkpoint {tmp_path / 'none'} does not exist"),
                              (tmp_path, f"{tmp_path.parent / 'config.json'} does not exist")):
        result = CliRunner().invoke(sample_command, ["--checkpoint", str(directory), "--prompt", "1 2"])
        assert result.exit_code == 2, result.output
        assert needle in result.output and "Traceback" not in result.output
