"""A 64 MiB token object on a fake GCS server (gcp-storage-emulator on 127.0.0.1) is read by range: the
bytes fetched stay within 1.1x those of the rows the host reads, and resident memory stays flat (it grows by
less than a quarter of the object)."""

import logging
import sys

import numpy as np
import psutil
import pytest

from tests.gcs_server import fake_gcs_server

pytest.importorskip("gcp_storage_emulator")

TOKENS = 32 * 2**20  # uint16: 64 MiB
# 3,072 rows: a tenth of them (307) is more than the reader may read ahead
SEQ_LEN, PER_HOST, BATCHES = 255, 32, 96
PREFETCH_ROWS = 256  # trainer.datasets.read_options(remote=True)


@pytest.fixture
def fake_gcs(monkeypatch):
    with fake_gcs_server("data") as url:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        # gcsfs asks a real GCS endpoint over gRPC for the bucket's type unless told not to (checked at import)
        monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        try:
            yield
        finally:
            logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # reads still in flight when the server goes


def test_a_large_object_is_read_by_range_with_flat_memory(fake_gcs):
    if "gcsfs" in sys.modules:
        pytest.skip("gcsfs was imported before the emulator settings")  # it reads them at import
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon")
    with fs.open("data/tokens.bin", "wb", block_size=16 * 2**20) as f:  # a resumable upload in 4 parts
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
    assert used <= read <= 1.1 * used, (read, used)  # only rows, read ahead at most PREFETCH_ROWS
    assert growth < 2 * TOKENS // 4, growth  # a quarter of the object
