"""A Hugging Face directory used where a run is expected (`serve --checkpoint HF_DIR`, `sample`): imported once
with `hf import`'s own conversion (trainer/hf/convert.py) into a cache directory, keyed by what names the files,
and the import used from there, its tokenizer, chat template and eos with it (its `hf/` side directory).

The cache is $MOE_TPU_CACHE, else $XDG_CACHE_HOME/moe-tpu, else ~/.cache/moe-tpu; each import is
`hf/<key>` in it. An import is written to a hidden directory and renamed when whole (convert.staged), so a
cached one is complete or absent; a failed one leaves nothing.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping

from trainer.hf.errors import HFError, WriteError
from trainer.hf.safetensors_io import is_hub_directory
from trainer.outputs import CHECKPOINTS_DIR
from trainer.sidefiles import TOKENIZER_FILES

CACHE_ENV = "MOE_TPU_CACHE"

__all__ = ["CACHE_ENV", "cache_root", "imported", "is_hub_directory"]


def cache_root(env: Mapping[str, str] = os.environ) -> str:
    """Where imports are cached: $MOE_TPU_CACHE, else $XDG_CACHE_HOME/moe-tpu, else ~/.cache/moe-tpu."""
    if env.get(CACHE_ENV):
        return env[CACHE_ENV]
    return os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "moe-tpu")


def cache_key(directory: str) -> str:
    """What names a Hugging Face directory's model: its absolute path, and the name, size and modification time
    of each of its files the import reads (config.json, the weights, the tokenizer files): a file changed since
    is another key, so another import."""
    directory = os.path.abspath(directory)
    digest = hashlib.sha256(directory.encode())
    for name in sorted(os.listdir(directory)):
        if name.endswith((".safetensors", ".json")) or name in TOKENIZER_FILES:
            stat = os.stat(os.path.join(directory, name))
            digest.update(f"\0{name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def imported(directory: str, progress: Callable[[str], None], root: str | None = None) -> str:
    """The run directory of DIR's import, made on first use (saying so with `progress`) and reused after.
    HFError (the file and key named) when DIR does not import."""
    from trainer.hf.convert import import_checkpoint

    out = os.path.join(root or cache_root(), "hf", cache_key(directory))
    if os.path.isdir(os.path.join(out, CHECKPOINTS_DIR)):
        return out
    progress(f"{directory} is a Hugging Face checkpoint: importing it into {out} (once; later starts read it there)")
    try:
        import_checkpoint(directory, out)
    except (HFError, WriteError):
        if os.path.isdir(os.path.join(out, CHECKPOINTS_DIR)):  # another process imported it meanwhile
            return out
        raise
    return out
