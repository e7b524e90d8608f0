"""On a fake GCS server (gcp-storage-emulator on 127.0.0.1): a 16 MiB token object is read by range (the
bytes fetched are those of the rows the host reads plus at most the reader's read-ahead, and resident memory
stays flat: it grows by less than a quarter of the object); `data prepare` into gs:// takes a lock and
publishes a dataset whole."""

import logging
import os
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.gcs_server import fake_gcs_server

pytest.importorskip("gcp_storage_emulator")

# uint16: 16 MiB, uploaded in 4 parts. The emulator's uploads slow down faster than the object grows (64 MiB
# took 26 s on a loaded 2-core machine, 16 MiB 1-4 s), and every row read is a request of its own; a reader
# that fetched the whole object would still grow resident memory by 4 times the bound below.
TOKENS = 8 * 2**20
# 1,024 rows; the read-ahead bounded in rows, not as a share of them (measured: 48-215 rows past the last one read)
SEQ_LEN, PER_HOST, BATCHES = 255, 32, 32
PREFETCH_ROWS = 256  # trainer.datasets.read_options(remote=True)


@pytest.fixture
def fake_gcs(monkeypatch):
    with fake_gcs_server("data") as url:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)  # read as each file system is made
        assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"  # tests/conftest.py: read at import
        try:
            yield
        finally:
            logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # reads still in flight when the server goes


def test_a_large_object_is_read_by_range_with_flat_memory(fake_gcs):
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)  # not one made for another test's server
    with fs.open("data/tokens.bin", "wb", block_size=TOKENS // 2) as f:  # a resumable upload in 4 parts
        for k in range(4):
            f.write((np.arange(k * TOKENS // 4, (k + 1) * TOKENS // 4) % 30000).astype(np.uint16).tobytes())
    assert fs.size("data/tokens.bin") == 2 * TOKENS

    fetched = []
    original = gcsfs.GCSFileSystem._cat_file

    async def counting(self, path, start=None, end=None, **kw):
        out = await original(self, path, start=start, end=end, **kw)
        fetched.append(len(out))
        return out

    gcsfs.GCSFileSystem._cat_file = counting
    try:
        from trainer.config import load_config
        from trainer.data import open_data

        cfg = load_config("tiny", ["data.source=tokens", "data.path=gs://data/tokens.bin", "model.vocab_size=30000",
                                   f"data.seq_len={SEQ_LEN}", f"data.global_batch_size={PER_HOST}"])
        data, _ = open_data(cfg, seed=0)
        first = next(data)
        assert first.shape == (PER_HOST, SEQ_LEN + 1)
        assert all(np.array_equal(np.diff(r.astype(np.int64)) % 30000, np.ones(SEQ_LEN)) for r in first)
        rss = psutil.Process().memory_info().rss
        for _ in range(BATCHES - 1):
            next(data)
        growth = psutil.Process().memory_info().rss - rss
        used = BATCHES * PER_HOST * (SEQ_LEN + 1) * 2
        data.close()
        read = sum(fetched)
    finally:
        gcsfs.GCSFileSystem._cat_file = original
    row = (SEQ_LEN + 1) * 2
    assert used <= read <= used + PREFETCH_ROWS * row, (read, used)  # only rows, read ahead at most PREFETCH_ROWS
    assert growth < 2 * TOKENS // 4, growth  # a quarter of the object


# In a process of its own: gcsfs reads the emulator's address when it is imported.
REMOTE_PREPARE = r"""
import json, sys
import gcsfs
from trainer.prepare import RemoteOutput, main

def run(args):
    try:
        main(args)
    except SystemExit as e:
        return e.code
    return 0

args = [sys.argv[1], "--lines", "-o", "gs://data/ds", "--vocab-size", "260", "--quiet"]
fs = gcsfs.GCSFileSystem(token="anon")
names = lambda: sorted(p.rsplit("/", 1)[1] for p in fs.find("data/ds", withdirs=False))
out = {}
out["bad"] = run([sys.argv[2], *args[1:]])  # not UTF-8: refused while writing, before anything goes up
out["after_bad"] = names() if fs.exists("data/ds") else []
with RemoteOutput("gs://data/ds"):  # a prepare at work there: it holds the lock
    out["busy"], out["while_busy"] = run(args), names()
fs.invalidate_cache()
out["after_busy"] = names()
fs.pipe_file("data/ds/train-00000.array_record", b"left by a prepare killed halfway")
out["done"] = run(args)
fs.invalidate_cache()
out["files"], out["manifest"] = names(), json.loads(fs.cat_file("data/ds/manifest.json"))
out["shard"] = fs.cat_file("data/ds/train-00000.array_record")[:40].decode("latin-1")
out["again"] = run(args)
fs.invalidate_cache()
out["after_again"] = names()
print(json.dumps(out))
"""


def test_prepare_into_gcs_takes_a_lock_publishes_the_manifest_last_and_never_replaces_one(fake_gcs, tmp_path):
    """`data prepare` into a gs:// prefix: one that fails leaves nothing, not even its lock; a second one
    refuses while the first holds the lock (an object created only where none is); a stopped prepare's
    leftovers are overwritten; a published dataset is never replaced."""
    import json
    import os
    import subprocess

    (tmp_path / "a.txt").write_text("one line\nanother line\n")
    (tmp_path / "bad.txt").write_bytes(b"fine\n\xff\xfe not text\n")
    checkout = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", REMOTE_PREPARE, str(tmp_path / "a.txt"), str(tmp_path / "bad.txt")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": checkout})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["bad"] == 2 and out["after_bad"] == [] and "bad.txt" in done.stderr  # its lock gone too
    assert out["busy"] == 2 and out["while_busy"] == [".prepare-lock"], out
    assert "another `data prepare` is writing to gs://data/ds (its lock says host" in done.stderr
    assert out["after_busy"] == []  # the holder's lock went with it
    assert out["done"] == 0 and out["files"] == ["manifest.json", "tokenizer.json", "train-00000.array_record"]
    assert out["manifest"]["documents"] == 2 and not out["shard"].startswith("left by")  # the leftover replaced
    assert out["again"] == 2 and "gs://data/ds already holds a dataset" in done.stderr
    assert out["after_again"] == out["files"]  # no lock left behind, nothing replaced


def test_a_models_own_files_travel_with_fine_tunes_through_gcs(fake_gcs, tmp_path):
    """A fine-tune of an import written to gs:// carries the model's own files (tokenizer, configs) there; a
    reader of that run (`sample`, `serve`, `hf export`: RunDirectory.hub) finds them; a fine-tune from it takes
    them back to a local run; and a Hugging Face directory in gs:// gives its side files, not its weights."""
    from etils import epath

    from trainer import sidefiles
    from trainer.outputs import RunDirectory

    imported = tmp_path / "imported"
    (imported / "checkpoints" / "0").mkdir(parents=True)
    (imported / "hf").mkdir()
    (imported / "hf" / "tokenizer.json").write_text('{"model": "ours"}')
    (imported / "hf" / "config.json").write_text('{"eos_token_id": 7, "max_position_embeddings": 512}')
    assert sidefiles.carry(str(imported), "gs://data/tuned") == ["tokenizer.json", "config.json"]
    epath.Path("gs://data/tuned/checkpoints/20/_CHECKPOINT_METADATA").write_text("{}")  # the run's checkpoint
    run = RunDirectory.find("gs://data/tuned", "--checkpoint")
    assert open(sidefiles.tokenizer_file(run)).read() == '{"model": "ours"}'
    assert sidefiles.eos_token_id(run) == 7 and not run.hub.startswith("gs://")

    again = tmp_path / "again"
    again.mkdir()
    assert sidefiles.carry("gs://data/tuned", str(again)) == ["tokenizer.json", "config.json"]
    assert (again / "hf" / "config.json").read_text() == (imported / "hf" / "config.json").read_text()

    for name, text in (("config.json", "{}"), ("tokenizer.json", "{}"), ("model.safetensors", "weights")):
        epath.Path(f"gs://data/hub/{name}").write_text(text)
    assert sorted(os.listdir(sidefiles.of_source("gs://data/hub"))) == ["config.json", "tokenizer.json"]
    assert RunDirectory.at("gs://data/nothing").hub is None
