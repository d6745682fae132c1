"""The GGUF header cache: memsvc and the frontend read a model's header at every start, and
parsing a real one takes seconds (gguf walks every vocabulary string), so `gguf_fields`
keeps it as JSON keyed by the file's path, size and mtime. What comes from the cache must be
exactly what a parse gives, a damaged cache file is parsed again, and a file that changes
gets a new entry."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvserve.model.files import gguf_fields, open_gguf, reader_fields, resolve_model


def test_cached_header_equals_the_parse_and_a_bad_entry_is_reparsed(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    shutil.copyfile(resolve_model(None), model)
    parsed = reader_fields(open_gguf(model))
    cache = tmp_path / "headers"
    assert gguf_fields(model, cache) == parsed
    (entry,) = cache.iterdir()
    assert gguf_fields(model, cache) == parsed  # from the cache now
    entry.write_text('{"general.architecture": ')  # torn
    assert gguf_fields(model, cache) == parsed
    assert gguf_fields(model, cache)["general.architecture"] == "llama"
    os.utime(model, ns=(1, 1))  # the file changed: another key
    assert gguf_fields(model, cache) == parsed
    assert len(list(cache.iterdir())) == 2
