"""Bad Hugging Face input: each case exits 2 naming the file and the key, with no traceback, and leaves
nothing in -o (nor a half-written directory beside it). A feature the trainer lacks is refused by its key."""

import contextlib
import json
import logging
import shutil
import threading

import pytest
from hf_models import (
    VOCAB,
    hf_model,
    one_torch_thread,  # noqa: F401 - autouse: torch on one thread here
    tokenizer_json,
)

pytest.importorskip("torch")

from trainer.config import load_config  # noqa: E402
from trainer.hf.cli import main  # noqa: E402
from trainer.hf.errors import HFError  # noqa: E402
from trainer.hf.families import family_of  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Mixtral saved in shards of about 20 KB, with its index and a fitting tokenizer."""
    tmp = tmp_path_factory.mktemp("hf-bad")
    hf_model("mixtral").save_pretrained(tmp / "hub", max_shard_size="20KB")
    tokenizer_json(tmp / "hub" / "tokenizer.json", VOCAB)
    return tmp / "hub"


@pytest.fixture
def source(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "src")
    return tmp_path / "src"


@contextlib.contextmanager
def _tracebacks():
    """Collects what would print a traceback beside the CLI's message: a record logged with an exception (orbax's
    threads log each failure so, through absl) or an exception a thread left uncaught."""
    caught = []
    handler = logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage()) if record.exc_info else None
    logging.getLogger().addHandler(handler)
    hook, threading.excepthook = threading.excepthook, lambda args: caught.append(repr(args.exc_value))
    try:
        yield caught
    finally:
        logging.getLogger().removeHandler(handler)
        threading.excepthook = hook


def _import(capsys, source, tmp_path, out=None) -> str:
    """Runs `hf import`; asserts exit 2, no traceback and nothing left in or beside -o; returns stderr."""
    out = out or tmp_path / "out"
    existed = out.exists()
    with _tracebacks() as caught, pytest.raises(SystemExit) as exit_info:
        main(["import", str(source), "-o", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err and not caught
    assert (list(out.iterdir()) == [] if existed else not out.exists())  # the user's empty -o stays, empty
    assert not list(out.parent.glob(f".{out.name}.partial-*"))
    return err


def _index(source) -> dict:
    return json.loads((source / "model.safetensors.index.json").read_text())


def test_a_directory_without_config_json(capsys, source, tmp_path):
    (source / "config.json").unlink()
    assert "holds no config.json" in _import(capsys, source, tmp_path)


def test_an_unknown_model_type(capsys, source, tmp_path):
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    err = _import(capsys, source, tmp_path)
    assert f"{source / 'config.json'}: model_type 'llama'" in err


def test_a_shard_the_index_names_is_missing(capsys, source, tmp_path):
    shard = _index(source)["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    (source / shard).unlink()
    err = _import(capsys, source, tmp_path)
    assert "model.safetensors.index.json" in err and f"'{shard}', which is missing" in err


@pytest.mark.parametrize("key", ["model.embed_tokens.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight"])
def test_a_truncated_safetensors_header(capsys, source, tmp_path, key):
    """The embedding's shard is read before the checkpoint is written, layer 1's once writing began: that one
    into the user's own empty -o, which stays, empty."""
    shard = _index(source)["weight_map"][key]
    (source / shard).write_bytes((source / shard).read_bytes()[:6])
    if "layers" in key:
        (tmp_path / "out").mkdir()
    err = _import(capsys, source, tmp_path)
    assert f"{source / shard} is not a readable safetensors file" in err


def _rewrite(source, key: str, change) -> str:
    """Rewrites the shard holding `key` with change(tensors) applied; returns the shard's name."""
    from hf_models import safetensors_of
    from safetensors.numpy import save_file

    shard = _index(source)["weight_map"][key]
    tensors = {k: v for k, v in safetensors_of(source).items() if _index(source)["weight_map"][k] == shard}
    change(tensors)
    save_file(tensors, str(source / shard), metadata={"format": "pt"})
    return shard


def test_a_tensor_of_the_wrong_shape(capsys, source, tmp_path):
    key = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    shard = _rewrite(source, key, lambda t: t.update({key: t[key].T.copy()}))
    err = _import(capsys, source, tmp_path)
    assert f"{source / shard}: '{key}' has shape [24, 32]; config.json makes it [32, 24]" in err


def test_a_missing_tensor(capsys, source, tmp_path):
    key = "model.layers.0.post_attention_layernorm.weight"
    _rewrite(source, key, lambda t: t.pop(key))
    index = _index(source)
    del index["weight_map"][key]
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    assert f"the tensor '{key}' is missing from {source}" in _import(capsys, source, tmp_path)


def test_an_fp8_weight_without_its_block_scales(capsys, source, tmp_path):
    """A bfloat16 checkpoint with FP8 block scaling declared, one of layer 1's experts in FP8 without its
    `_scale_inv` (found once writing began)."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    key = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    for shard in set(_index(source)["weight_map"].values()):
        tensors = {k: v.astype(ml_dtypes.float8_e4m3fn if k == key else ml_dtypes.bfloat16)
                   for k, v in load_file(source / shard).items()}
        save_file(tensors, str(source / shard), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 8]}
    (source / "config.json").write_text(json.dumps(config))
    err = _import(capsys, source, tmp_path)
    shard = source / _index(source)["weight_map"][key]
    assert f"{shard}: '{key}' is FP8 but '{key}_scale_inv' (its block scales) is missing" in err


def test_a_tokenizer_of_another_vocabulary(capsys, source, tmp_path):
    tokenizer_json(source / "tokenizer.json", VOCAB + 50)
    err = _import(capsys, source, tmp_path)
    assert f"{source / 'tokenizer.json'} has token id {VOCAB + 49}" in err and "'vocab_size' = 128" in err


@pytest.mark.parametrize("key, value", [("sliding_window", 16), ("clip_qkv", 8.0), ("hidden_act", "gelu"),
                                        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})])
def test_a_feature_the_trainer_lacks_is_refused_by_its_key(capsys, source, tmp_path, key, value):
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, key: value}))
    err = _import(capsys, source, tmp_path)
    assert f"{source / 'config.json'}: '{key}" in err and "not supported" in err


def test_an_output_that_holds_something_is_left_alone(capsys, source, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        main(["import", str(source), "-o", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("name, overrides, feature", [
    ("tiny", ["model.moe_every=2"], "no family has this combination"),
    ("deepseek-tiny", ["moe.balance=aux_loss"], "sigmoid scores without the selection bias"),
    ("tiny", ["model.tie_embeddings=true", "model.moe_every=1"], "model.tied_head_scale=true"),
])
def test_a_model_of_no_family_is_not_exported(name, overrides, feature):
    with pytest.raises(HFError, match=feature.replace(".", r"\.").replace("*", r"\*")):
        family_of(load_config(name, overrides))


def test_export_of_a_step_the_checkpoint_lacks_names_the_steps_it_has(capsys, saved, tmp_path):
    from trainer.hf.convert import import_checkpoint

    import_checkpoint(str(saved), str(tmp_path / "imported"))
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--checkpoint", str(tmp_path / "imported"), "--step", "7", "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--step 7: {tmp_path / 'imported' / 'checkpoints'} holds steps [0]" in err
    assert not (tmp_path / "out").exists()


def test_a_gs_source_imports_as_the_local_one_and_a_missing_shard_is_named(saved, tmp_path, monkeypatch):
    """On a fake GCS server: the same parameters as from the local directory; nothing left beside -o."""
    import sys

    from hf_models import safetensors_of  # noqa: F401 - the shards' reader, imported before gcsfs starts

    from tests.gcs_server import fake_gcs_server
    from trainer.hf.convert import import_checkpoint
    from trainer.hf.orbax_io import open_run

    if "gcsfs" in sys.modules:
        pytest.skip("gcsfs was imported before the emulator settings")  # it reads them at import
    with fake_gcs_server("models") as url:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        import gcsfs

        gcsfs.GCSFileSystem(token="anon").put(str(saved), "models/mixtral", recursive=True)
        import_checkpoint("gs://models/mixtral", str(tmp_path / "remote"))
        import_checkpoint(str(saved), str(tmp_path / "local"))
        remote, local = open_run(str(tmp_path / "remote"), None), open_run(str(tmp_path / "local"), None)
        a, b = remote.read(set(remote.shapes)), local.read(set(local.shapes))
        assert sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)
        shard = _index(saved)["weight_map"]["model.norm.weight"]
        gcsfs.GCSFileSystem(token="anon").rm(f"models/mixtral/{shard}")
        with pytest.raises(HFError, match=f"names the shard '{shard}', which is missing from gs://models/mixtral"):
            import_checkpoint("gs://models/mixtral", str(tmp_path / "again"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "remote"]


FILE_SIZE_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
from trainer.hf.cli import main
main(sys.argv[1:])
"""


def test_a_write_the_disk_cannot_hold_is_said_once_naming_the_output(saved, tmp_path):
    """The checkpoint writer fails at a layer, while tensors are still read: exit 1 with one line naming -o
    (not its staging directory) and the system's reason, nothing logged with a traceback, nothing left."""
    import subprocess
    import sys

    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, "import", str(saved), "-o", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert run.stderr == f"Error: cannot write the checkpoint to {out}/checkpoints: File too large (os error 27)\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signum, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_an_import_stops_it_between_tensors_leaving_nothing(capsys, source, tmp_path, signum,
                                                                            code):
    """The signal is recorded (trainer/signals.py), never raised from its handler, and acted on at the
    importer's next tensor: the exit code of that signal, nothing in or beside -o."""
    import signal

    from trainer import signals

    out = tmp_path / "out"
    with signals.latch():  # `hf`'s own latch is this one: the signal arrives once it is installed
        signal.raise_signal(getattr(signal, signum))  # recorded: nothing is raised here
        with _tracebacks() as caught, pytest.raises(SystemExit) as exit_info:
            main(["import", str(source), "-o", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    assert "nothing was written" in err and "Traceback" not in err and not caught
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_export_of_a_checkpoint_of_random_bytes_is_one_message_naming_the_step(saved, tmp_path):
    """A read that fails part-way leaves tensorstore's other reads running, whose ends called into the event
    loop orbax had closed: as many tracebacks ("Event loop is closed") after the message, at random."""
    import os
    import subprocess
    import sys

    from trainer.hf.convert import import_checkpoint

    import_checkpoint(str(saved), str(tmp_path / "imported"))
    for path in (tmp_path / "imported" / "checkpoints" / "0" / "state").rglob("d/*"):
        path.write_bytes(os.urandom(path.stat().st_size))
    for attempt in range(2):  # the tracebacks come at random: most runs had some
        done = subprocess.run([sys.executable, "-m", "trainer.hf", "export", "--checkpoint", str(tmp_path / "imported"),
                               "-o", str(tmp_path / f"out{attempt}")], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert done.returncode == 2 and "at step 0 in" in done.stderr, done.stderr[-3000:]
        assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr[-3000:]
