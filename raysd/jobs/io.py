"""Where a job's rows come from and where they go, on any fsspec filesystem.

Inputs: Parquet (a file, a directory or a glob), JSON Lines (the same), or a
`datasets` dataset saved with `save_to_disk` (or one already in the local cache,
named; nothing is ever downloaded). `open_input` resolves --input on the driver
(files, schema, row count: footers and a few lines only) and `InputSource.dataset()`
turns it into a Ray Data reader: `read_parquet`, `read_json` (Arrow's reader: JSON Lines; or
`read_text` plus a parsing stage when a column mixes JSON types), or a streaming
read of a `datasets` dataset's Arrow files. `memory://` exists only in this process,
so it is read here and handed over with `ray.data.from_arrow` (tests, small data).

Output: a directory of `part-*.parquet` files (see `raysd.jobs.pipeline.PartsSink`).
Each is written under `_tmp/` and renamed into place, so a part that is there is
complete; a re-run reads the ids already written and skips those rows. `OutputStore`
writes only into a new or empty directory or its own output, deletes only the names it
writes, and records in `_job.json` the input's identity (`input_identity`), which a resume
must match.
"""

from __future__ import annotations

import contextlib
import glob as _glob
import hashlib
import json
import os
import posixpath
import re
import time
import uuid
from collections import Counter
from typing import Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.utils import glob_translate

from raysd.jobs.config import JobError, one_line
from raysd.jobs.schema import TOTALS_COLUMNS, row_totals

PARQUET_EXT = (".parquet", ".pq")
JSONL_EXT = (".jsonl", ".json", ".ndjson")
_DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_JSONL_SCHEMA_ROWS = 1000  # rows of a JSON Lines input that fix its column types
_DIGEST_BATCH = 4096  # rows per batch of the input check's pass over the rows


# raysd's extras that install a protocol's fsspec package (pyproject.toml): `pip install 'raysd[s3]'`.
PROTOCOL_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def _url_to_fs(url: str):
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # unknown protocol, or its package is missing
        extra = PROTOCOL_EXTRAS.get(url.split("://", 1)[0].lower()) if isinstance(exc, ImportError) and "://" in url else None
        hint = f" (pip install 'raysd[{extra}]')" if extra else ""
        raise JobError(f"cannot open {url!r}: {str(exc).splitlines()[0]}{hint}") from None


# Ray Data's read (and parse) tasks ask for no CPU: the model actors' placement groups may hold
# every CPU of a small node, and a read task waiting for one would stall the whole pipeline.
IO_TASK_CPUS = 0


def _protocol(fs) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def in_process(fs) -> bool:
    """A filesystem only this process can see (fsspec `memory://`): Ray workers cannot read or write it."""
    return _protocol(fs) == "memory"


def arrow_filesystem(fs):
    """The pyarrow filesystem Ray Data reads through: local files natively, any other fsspec one wrapped."""
    import pyarrow.fs as pafs

    if _protocol(fs) in ("file", "local"):
        return pafs.LocalFileSystem()
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


class InputSource:
    """Rows of a prompt dataset, in a stable order: as a Ray Data dataset (`dataset()`), or read
    here batch by batch (`batches()`, for `memory://` and the tests)."""

    kind: str
    schema: pa.Schema  # the input's columns; JSON Lines: inferred from its first rows
    num_rows: int | None = None  # when cheap to know
    json_columns: frozenset[str] = frozenset()  # JSON Lines columns of mixed type, carried as JSON text
    fs = None  # the filesystem of `files` and `named`
    files: list[str] = []  # the files read, in order
    named: str | None = None  # what --input resolved to on `fs`: a file, a directory or a glob pattern
    is_glob: bool = False

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        raise NotImplementedError

    def row_digest(self, id_column: str) -> tuple[int, str]:
        """(rows, digest of every row, all columns, in input order): one streaming pass, here.
        Refuses (JobError) what would fail the job later, naming where it is."""
        digest, rows, last, first_row = hashlib.blake2b(digest_size=16), 0, None, 0
        for where, table in self._tables():
            if where != last:  # rows are numbered from 1 in each file
                last, first_row = where, rows
            _digest_rows(digest, table, id_column, where, rows - first_row)
            rows += table.num_rows
        return rows, digest.hexdigest()

    def _tables(self) -> Iterator[tuple[str, pa.Table]]:
        raise NotImplementedError

    def file_stamps(self) -> list[dict]:
        """Each input file's resolved path, size and modification time (or version tag)."""
        try:
            return [_stamp(self.fs, path) for path in self.files]
        except OSError as exc:
            raise JobError(f"cannot read input {self.named or self.files[0]!r}: {one_line(exc)}") from None

    def dataset(self):
        """A lazy Ray Data dataset of the input's rows, in input order (with preserve_order)."""
        raise NotImplementedError

    def _driver_dataset(self, batch_size: int = 4096):
        """Read here, hand the tables to Ray Data: for filesystems Ray workers cannot see (memory://).
        The whole input is then held in the object store: for tests and small data only."""
        import ray

        tables = [self.encode(rows) for rows in self.batches(batch_size)]
        return ray.data.from_arrow(tables or [self.schema.empty_table()])

    def encode(self, rows: list[dict]) -> pa.Table:
        return pa.Table.from_pylist(rows, schema=self.schema)


class ParquetSource(InputSource):
    kind = "parquet"

    def __init__(self, fs, files: list[str]):
        self.fs, self.files = fs, files
        try:
            with fs.open(files[0], "rb") as f:
                self.schema = pq.read_schema(f)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
            raise JobError(f"cannot read Parquet file {files[0]!r}: {one_line(exc)}") from None
        self.num_rows = None
        if len(files) <= 64:  # footers only; skipped for many (remote) files
            total, schemas = 0, []
            for path in files:
                try:
                    with fs.open(path, "rb") as f:
                        meta = pq.ParquetFile(f).metadata
                except Exception as exc:  # noqa: BLE001
                    raise JobError(f"cannot read Parquet file {path!r}: {one_line(exc)}") from None
                total += meta.num_rows
                schemas.append(meta.schema.to_arrow_schema())
            self.num_rows = total
            try:  # a column all-null in one file and typed in another takes the type
                self.schema = pa.unify_schemas(schemas, promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                raise JobError(f"input Parquet files disagree on their columns: {one_line(exc)}") from None

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        for path in self.files:
            with self.fs.open(path, "rb") as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size):
                    yield batch.to_pylist()

    def _tables(self) -> Iterator[tuple[str, pa.Table]]:
        for path in self.files:
            with self.fs.open(path, "rb") as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=_DIGEST_BATCH):
                    yield path, pa.Table.from_batches([batch])

    def dataset(self):
        import ray

        if in_process(self.fs):
            return self._driver_dataset()
        with _footer_readers(len(self.files)):
            return ray.data.read_parquet(self.files, filesystem=arrow_filesystem(self.fs), file_extensions=None,
                                         num_cpus=IO_TASK_CPUS)


_FOOTERS_PER_READER = 10  # Ray Data's files per footer-reading call (RAY_DATA_PARQUET_FOOTER_BATCH_SIZE)
_MAX_FOOTER_READERS = 32  # Ray Data's default pool


@contextlib.contextmanager
def _footer_readers(num_files: int):
    """Ray Data's Parquet reader lists its files through a pool of FooterReader actors, 32 by
    default whatever the input: 32 Python processes started (and each importing Ray Data) per job,
    a second of CPU or so apiece, for an input of one or two files. The pool is sized to the input here, one
    actor per batch of footers, through the only knob Ray Data has for it (an environment
    variable, read when `read_parquet` builds its file indexer on the driver), set for that call
    alone. A value the user set is left as it is."""
    key = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
    if key in os.environ:
        yield
        return
    try:  # its module reads the variable for its own default when first imported: not while it is set here
        import ray.data._internal.datasource_v2.formats.parquet.footer_file_indexer  # noqa: F401
    except ImportError:  # another Ray Data layout: the variable is all there is to go by
        pass
    os.environ[key] = str(min(_MAX_FOOTER_READERS, max(1, -(-num_files // _FOOTERS_PER_READER))))
    try:
        yield
    finally:
        os.environ.pop(key, None)


def encode_json_value(value):
    """A value of a mixed-type JSON Lines column as carried through the pipeline: its JSON text."""
    return None if value is None else json.dumps(value)


def decode_json_value(text):
    return None if text is None else json.loads(text)


def output_json_value(text):
    """The output value of a mixed-type column: strings as they are, anything else as JSON text."""
    value = decode_json_value(text)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): keep its JSON text
            return text
        return value
    return None if value is None else text


def parse_json_lines(lines: list[str], schema: pa.Schema, json_columns: frozenset[str], where: str = "") -> pa.Table:
    rows = [_json_object(line, where, f": {line[:80]!r}") for line in lines if line.strip()]
    return _encode_json_rows(rows, schema, json_columns)


def _json_object(line: str, where: str, shown: str = "") -> dict:
    """One JSON Lines row, or a one-line JobError naming where it is."""
    line = line.rstrip("\r\n")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        # exc.msg lacks the position ("Invalid control character at"); its str() counts lines within the line.
        at = "" if exc.msg.endswith(" at") else " at"
        raise JobError(f"{where}not valid JSON: {exc.msg}{at} column {exc.pos + 1}{shown}") from None
    if not isinstance(row, dict):
        raise JobError(f"{where}each line must be a JSON object{shown}")
    return row


def _encode_json_rows(rows: list[dict], schema: pa.Schema, json_columns: frozenset[str]) -> pa.Table:
    if json_columns:
        rows = [{k: encode_json_value(v) if k in json_columns else v for k, v in row.items()} for row in rows]
    return pa.Table.from_pylist(rows, schema=schema)


def _parse_json_batch(batch: pa.Table, schema: pa.Schema, json_columns: frozenset[str]) -> pa.Table:
    """The parsing stage after `read_text`, for JSON Lines with a mixed-type column."""
    return parse_json_lines(batch.column("text").to_pylist(), schema, json_columns)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_surrogate(value) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    return False


def _without_surrogates(value):
    if isinstance(value, str):
        return "".join(c for c in value if not "\ud800" <= c <= "\udfff")
    if isinstance(value, list):
        return [_without_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {k: _without_surrogates(v) for k, v in value.items()}
    return value


def _arrow_type(values: list):
    """The Arrow type of a JSON Lines column's first values. A lone surrogate does not decide it
    (Arrow cannot encode one): such a value in a plain-string column is refused, with its line,
    by the input check (JsonlSource.row_digest)."""
    try:
        return pa.array(values).type
    except UnicodeEncodeError:
        return pa.array([_without_surrogates(v) for v in values]).type


class JsonlSource(InputSource):
    kind = "jsonl"

    def __init__(self, fs, files: list[str]):
        self.fs, self.files = fs, files
        head = []
        for row in self._rows():
            head.append(row)
            if len(head) >= _JSONL_SCHEMA_ROWS:
                break
        if not head:
            raise JobError(f"input {files[0]!r} has no rows")
        names = list(dict.fromkeys(k for row in head for k in row))
        fields, json_columns = [], set()
        for name in names:
            values = [row.get(name) for row in head]
            try:
                type_ = _arrow_type(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
                type_ = pa.null()
            if pa.types.is_null(type_):  # mixed or all-null: JSON text (strings kept as they are)
                type_ = pa.string()
                json_columns.add(name)
            fields.append(pa.field(name, type_))
        self.schema = pa.schema(fields)
        self.json_columns = frozenset(json_columns)

    def _lines(self) -> Iterator[tuple[str, int, str]]:
        """(file, line number, text) of every non-blank line. Lines end at "\\n" only, as for
        Arrow's reader; a line that is not UTF-8 is a JobError naming it."""
        for path in self.files:
            with self.fs.open(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise JobError(f"{path}:{lineno}: not valid UTF-8 (byte {exc.start + 1} of the line)") from None
                    if line.strip():
                        yield path, lineno, line

    def _rows(self) -> Iterator[dict]:
        for path, lineno, line in self._lines():
            yield _json_object(line, f"{path}:{lineno}: ")

    def row_digest(self, id_column: str) -> tuple[int, str]:
        """Every line parsed (a bad one anywhere is a JobError naming its file and line); the
        digest is of the lines' text."""
        digest, rows = hashlib.blake2b(digest_size=16), 0
        for path, lineno, line in self._lines():
            row = _json_object(line, f"{path}:{lineno}: ")
            if _SURROGATE_ESCAPE.search(line):
                for name, value in row.items():
                    if name not in self.json_columns and _has_surrogate(value):
                        raise JobError(f"{path}:{lineno}: column {name!r} holds a lone surrogate escape (\\ud800-\\udfff "
                                       "without its pair), which is not valid text")
            digest.update(line.strip().encode("utf-8"))
            digest.update(b"\n")
            rows += 1
        return rows, digest.hexdigest()

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        batch = []
        for row in self._rows():
            batch.append(row)
            if len(batch) >= batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def encode(self, rows: list[dict]) -> pa.Table:
        return _encode_json_rows(rows, self.schema, self.json_columns)

    def dataset(self):
        import ray

        if in_process(self.fs):
            return self._driver_dataset()
        filesystem = arrow_filesystem(self.fs)
        if not self.json_columns:
            # Consistent types: Arrow's JSON reader, which reads newline-delimited JSON (JSON Lines).
            # (`lines=True` would switch to pandas' reader, which takes no `filesystem`.)
            return ray.data.read_json(self.files, filesystem=filesystem, file_extensions=None, num_cpus=IO_TASK_CPUS)
        # A column mixes JSON types (strings and lists, say), which Arrow's reader rejects:
        # read the lines, parse them in a stateless stage, carry that column as JSON text.
        lines = ray.data.read_text(self.files, filesystem=filesystem, file_extensions=None, num_cpus=IO_TASK_CPUS)
        return lines.map_batches(_parse_json_batch, fn_args=(self.schema, self.json_columns), batch_format="pyarrow",
                                 batch_size=None, num_cpus=IO_TASK_CPUS)


def _arrow_stream_datasource(files: list[str]):
    """A `datasets` dataset's Arrow (IPC stream) files, read as a stream of record batches."""
    from ray.data.datasource import FileBasedDatasource

    class ArrowStreamDatasource(FileBasedDatasource):
        def _read_stream(self, f, path):
            reader = pa.ipc.open_stream(f)
            for batch in reader:
                yield pa.Table.from_batches([batch], schema=reader.schema)

    return ArrowStreamDatasource(files, file_extensions=None)


class DatasetsSource(InputSource):
    kind = "datasets"

    def __init__(self, dataset, name: str, named: str | None = None):
        self.hf_dataset = dataset
        self.schema = dataset.data.schema
        self.num_rows = len(dataset)
        self.name = name
        self.fs = fsspec.filesystem("file")
        self.files = [c["filename"] for c in dataset.cache_files]
        self.named = named  # a save_to_disk directory; None for a name in the cache

    def _tables(self) -> Iterator[tuple[str, pa.Table]]:
        for table in self.hf_dataset.with_format("arrow").iter(batch_size=_DIGEST_BATCH):
            yield self.name, table

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        for table in self.hf_dataset.with_format("arrow").iter(batch_size=batch_size):
            yield table.to_pylist()

    def dataset(self):
        import ray

        files = [c["filename"] for c in self.hf_dataset.cache_files]
        if files and self.hf_dataset._indices is None:
            # Its Arrow files as they are on disk, streamed: never loaded whole.
            return ray.data.read_datasource(_arrow_stream_datasource(files), num_cpus=IO_TASK_CPUS)
        # In memory, or with an indices mapping (select, shuffle): one table made here.
        return ray.data.from_arrow(self.hf_dataset.with_format("arrow")[:])


def _pick_split(dataset, split: str | None, name: str):
    from datasets import DatasetDict

    if not isinstance(dataset, DatasetDict):
        if split is not None:
            raise JobError(f"--split {split!r} given but {name!r} has no splits")
        return dataset
    splits = sorted(dataset)
    if split is None:
        if len(splits) == 1:
            return dataset[splits[0]]
        if "train" in dataset:
            return dataset["train"]
        raise JobError(f"{name!r} has splits {splits}; choose one with --split")
    if split not in dataset:
        raise JobError(f"{name!r} has no split {split!r} (splits: {splits})")
    return dataset[split]


def _files_by_kind(fs, files: list[str], where: str):
    parquet = sorted(f for f in files if f.lower().endswith(PARQUET_EXT))
    jsonl = sorted(f for f in files if f.lower().endswith(JSONL_EXT))
    if parquet and jsonl:
        raise JobError(f"{where} mixes Parquet and JSON Lines files; point --input at one kind")
    if parquet:
        return ParquetSource(fs, parquet)
    if jsonl:
        return JsonlSource(fs, jsonl)
    raise JobError(f"no .parquet or .jsonl files in {where!r}")


def _named(source: InputSource, path: str, is_glob: bool = False) -> InputSource:
    source.named, source.is_glob = path, is_glob
    return source


def open_input(url: str, split: str | None = None) -> InputSource:
    """Resolve --input; fails with a JobError (one line) on anything unreadable."""
    fs, path = _url_to_fs(url)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    local = protocol in ("file", "local")
    try:
        if _glob.has_magic(path):
            files = [f for f in fs.glob(path) if fs.isfile(f)]
            if not files:
                raise JobError(f"no files match {url!r}")
            return _named(_files_by_kind(fs, files, url), path, is_glob=True)
        if fs.isdir(path):
            if local and any(os.path.exists(os.path.join(path, m)) for m in _DATASETS_MARKERS):
                return _load_from_disk(path, split, url)
            files = [f for f in fs.find(path) if not os.path.basename(f).startswith((".", "_"))]
            return _named(_files_by_kind(fs, files, url), path)
        if fs.isfile(path):
            if path.lower().endswith(PARQUET_EXT):
                return _named(ParquetSource(fs, [path]), path)
            if path.lower().endswith(JSONL_EXT):
                return _named(JsonlSource(fs, [path]), path)
            raise JobError(f"input {url!r}: unknown file type (expected {', '.join(PARQUET_EXT + JSONL_EXT)})")
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - credentials, network, permissions: one line
        raise JobError(f"cannot read input {url!r}: {one_line(exc)}") from None
    if "://" not in url and not url.startswith(("/", ".", "~")) and url.count("/") <= 1:
        return _load_cached_dataset(url, split)
    raise JobError(f"input {url!r} does not exist")


def _load_from_disk(path: str, split: str | None, name: str) -> DatasetsSource:
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(path)
    except Exception as exc:  # noqa: BLE001
        raise JobError(f"cannot load dataset {name!r}: {one_line(exc)}") from None
    return DatasetsSource(_pick_split(dataset, split, name), name, named=path)


def _load_cached_dataset(name: str, split: str | None) -> DatasetsSource:
    """A `datasets` dataset by name, from the local cache only: raysd never downloads."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets

        datasets.config.HF_DATASETS_OFFLINE = True
        datasets.config.HF_HUB_OFFLINE = True
        dataset = datasets.load_dataset(name, split=split)
    except Exception as exc:  # noqa: BLE001
        raise JobError(
            f"input {name!r} is not a file, directory or URL, nor a `datasets` dataset in the local cache "
            f"(raysd never downloads): {one_line(exc)}"
        ) from None
    return DatasetsSource(_pick_split(dataset, None, name), name)


# ---------------------------------------------------------------------------- input identity
# What an output's `_job.json` records of the input that made its rows, so that a resume with
# another input, or with an input that changed, is refused (OutputStore.check_resume).

_MODIFIED_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created", "ETag", "etag", "md5Hash")


def _stamp(fs, path: str) -> dict:
    if _protocol(fs) in ("file", "local"):
        real = os.path.realpath(path)
        st = os.stat(real)
        return {"path": real, "size": st.st_size, "modified": st.st_mtime_ns}
    info = fs.info(path)
    when = next((info[k] for k in _MODIFIED_KEYS if info.get(k) is not None), None)
    return {"path": fs.unstrip_protocol(path), "size": info.get("size"), "modified": None if when is None else str(when)}


def _json_default(value):
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    return {"$" + type(value).__name__: str(value)}  # dates, times, decimals: their text


def _digest_rows(digest, table: pa.Table, id_column: str, where: str, first: int) -> None:
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:
        rows = _rows_with_bad_utf8(table, id_column, where, first)
    for row in rows:
        digest.update(json.dumps(row, ensure_ascii=True, separators=(",", ":"), default=_json_default).encode())
        digest.update(b"\n")


def _rows_with_bad_utf8(table: pa.Table, id_column: str, where: str, first: int) -> list[dict]:
    """The rows of a table holding a string that is not UTF-8 (possible in Parquet). The job makes
    such a row an error row, but a row whose id is not UTF-8 cannot be one: refused here."""
    rows = []
    for i in range(table.num_rows):
        row = {}
        for name in table.column_names:
            column = table.column(name)
            try:
                row[name] = column[i].as_py()
            except UnicodeDecodeError:
                if name == id_column:
                    raise JobError(f"{where}: row {first + i + 1}: its id ({name!r}) is not valid UTF-8") from None
                raw = column.slice(i, 1)
                plain = pa.types.is_string(raw.type) or pa.types.is_large_string(raw.type)
                row[name] = {"$invalid_utf8": raw.cast(pa.large_binary()).to_pylist()[0].hex() if plain else None}
        rows.append(row)
    return rows


def input_identity(source: InputSource, id_column: str, previous: dict | None = None) -> dict:
    """The input's identity for `_job.json`: kind, columns, files (resolved path, size, modified
    time) and a digest of every row. The digest is one pass over the input here; when every file is
    as `previous` recorded it (an output's resume), the recorded digest stands and nothing is read."""
    identity = {"kind": source.kind, "columns": source.schema.to_string(show_schema_metadata=False),
                "files": source.file_stamps()}
    files = identity["files"]
    unchanged = (previous is not None and bool(files) and "digest" in previous and "rows" in previous
                 and all(f["size"] is not None and f["modified"] is not None for f in files)
                 and all(previous.get(k) == identity[k] for k in ("kind", "columns", "files")))
    if unchanged:
        identity.update(rows=previous["rows"], digest=previous["digest"])
    else:
        identity["rows"], identity["digest"] = source.row_digest(id_column)
    return identity


def _some(paths: list[str], most: int = 3) -> str:
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def input_changes(previous: dict, current: dict) -> str | None:
    """What differs between the input an output was started from and this one (one line); None
    when the rows are the same (the files may have moved, or been touched)."""
    if previous.get("digest") == current["digest"] and previous.get("columns") == current["columns"]:
        return None
    before = {f["path"]: f for f in previous.get("files", [])}
    now = {f["path"]: f for f in current["files"]}
    what = []
    gone, new = [p for p in before if p not in now], [p for p in now if p not in before]
    if gone:
        what.append(f"files it was made from that this input lacks: {_some(gone)}")
    if new:
        what.append(f"files new in this input: {_some(new)}")
    for path in [p for p in now if p in before and before[p] != now[p]][:3]:
        size_then, size_now = before[path]["size"], now[path]["size"]
        what.append(f"{path} changed since (size {size_then} -> {size_now} bytes)" if size_then != size_now
                    else f"{path} was modified since")
    if previous.get("columns") != current["columns"]:
        what.append("its columns differ")
    if previous.get("rows") != current["rows"]:
        what.append(f"{current['rows']} rows now, {previous.get('rows')} then")
    else:
        what.append(f"the contents of its {current['rows']} rows differ")
    return "; ".join(what)


# ---------------------------------------------------------------------------- output

JOB_FILE, SUMMARY_FILE, TMP_DIR = "_job.json", "_summary.json", "_tmp"


def _fs_kind(fs) -> str:
    return "file" if _protocol(fs) in ("file", "local") else _protocol(fs)


def is_part(name: str) -> bool:
    return name.startswith("part-") and name.endswith(".parquet")


def _within(path: str, parent: str) -> bool:
    """`path` is strictly inside the directory `parent` (both canonical)."""
    return path.startswith(parent.rstrip("/") + "/") and path != parent


class OutputStore:
    """A directory of Parquet parts plus `_job.json` (the job and the input that wrote it) and
    `_summary.json`. raysd writes only into a new or empty directory or one holding its own
    `_job.json`, and deletes only the names it writes there: parts, `_job.json`, `_summary.json`
    and `_tmp/`. Any other file in the output is left alone."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = _url_to_fs(url)
        self.root = self.root.rstrip("/") or "/"
        self.local = _protocol(self.fs) in ("file", "local")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self) -> bool:
        return self.fs.exists(self.root)

    def _entries(self) -> dict[str, str]:
        """{name: type ("file", "directory")} of what the output directory holds."""
        if not self.fs.isdir(self.root):
            return {}
        return {os.path.basename(e["name"].rstrip("/")): e["type"] for e in self.fs.ls(self.root, detail=True)}

    def parts(self) -> list[str]:
        return sorted(self._path(n) for n, kind in self._entries().items() if is_part(n) and kind == "file")

    def read_job(self) -> dict | None:
        path = self._path(JOB_FILE)
        if not self.fs.exists(path):
            return None
        try:
            with self.fs.open(path, "rt") as f:
                job = json.load(f)
            if not isinstance(job, dict):
                raise ValueError("not a JSON object")
            return job
        except (ValueError, UnicodeDecodeError) as exc:
            raise JobError(f"output {self.url!r} has an unreadable {JOB_FILE} ({one_line(exc)}); "
                           "--overwrite starts over") from None

    # -- checks (read only; `raysd.jobs.runner.check_job` runs them before Ray or a model starts)

    def check(self, source: InputSource, overwrite: bool) -> dict | None:
        """Refuse (JobError, one line) an output raysd must not write into; return the output's job
        record when it is raysd's and will be resumed, else None."""
        try:
            self._refuse_special_directory()
            self._refuse_overlap(source)
            if not self.exists():
                return None
            if not self.fs.isdir(self.root):
                raise JobError(f"output {self.url!r} is a file; raysd writes a directory and never replaces a file: "
                               "choose another --output")
            entries = self._entries()
            if JOB_FILE not in entries:
                if entries:
                    raise JobError(f"output {self.url!r} exists, is not empty and was not written by raysd (it has no "
                                   f"{JOB_FILE}); raysd writes only into a new or empty directory or its own output: "
                                   "choose another --output")
                return None
            return None if overwrite else self.read_job()
        except JobError:
            raise
        except Exception as exc:  # noqa: BLE001 - permissions, network: one line
            raise JobError(f"cannot check output {self.url!r}: {one_line(exc)}") from None

    def _canonical(self, path: str) -> str:
        return os.path.realpath(path) if self.local else posixpath.normpath("/" + path.lstrip("/"))

    def _refuse_special_directory(self) -> None:
        out = self._canonical(self.root)
        if not self.local:
            if out == "/":
                raise JobError(f"output {self.url!r} is the root of its filesystem; choose a directory of its own")
            return
        for what, path in (("the filesystem root", "/"), ("your home directory", os.path.expanduser("~")),
                           ("the working directory", os.getcwd())):
            path = os.path.realpath(path)
            if out == path or _within(path, out):
                raise JobError(f"output {self.url!r} is {what}{'' if out == path else ' or holds it'}; raysd writes its "
                               f"output into a directory of its own: choose one, e.g. {os.path.join(self.url, 'raysd-out')!r}")

    def _refuse_overlap(self, source: InputSource) -> None:
        """An output that holds the input (raysd would write beside it, and `--overwrite` once
        deleted it), or lies where the input is read from (a later run would read its parts)."""
        if source.fs is None or _fs_kind(source.fs) != _fs_kind(self.fs):
            return
        out = self._canonical(self.root)
        for path in source.files:
            if self._canonical(path) == out or _within(self._canonical(path), out):
                raise JobError(f"output {self.url!r} holds the input file {path!r}; raysd never writes beside its "
                               "input: choose another --output")
        if source.named is None:
            return
        if source.is_glob:
            parts = source.named.split("/")
            fixed = next(i for i, part in enumerate(parts) if _glob.has_magic(part))
            pattern = self._canonical("/".join(parts[:fixed]) or "/").rstrip("/") + "/" + "/".join(parts[fixed:])
            reads = re.compile(glob_translate(pattern))
            if any(reads.match(f"{out}/{name}") for name in ("part-0.parquet", f"{TMP_DIR}/0-part-0.parquet")):
                raise JobError(f"output {self.url!r} lies where the input {source.named!r} reads: a later run would "
                               "read its parts as input; choose an --output outside it")
            return
        named = self._canonical(source.named)
        if named == out or _within(named, out):
            raise JobError(f"output {self.url!r} holds the input {source.named!r}; raysd never writes beside its "
                           "input: choose another --output")
        if _within(out, named):
            raise JobError(f"output {self.url!r} lies inside the input {source.named!r}: a later run would read its "
                           "parts as input; choose an --output outside it")

    def check_resume(self, previous: dict, job: dict) -> None:
        """Refuse to resume an output written by another job or from another input, naming what differs."""
        before, now = previous.get("fingerprint") or {}, job["fingerprint"]
        if before != now:
            diff = sorted(k for k in {*before, *now} if before.get(k) != now.get(k))
            raise JobError(f"output {self.url!r} was written by a job with different {', '.join(diff)}; "
                           "use --overwrite to start over, or another --output")
        recorded = previous.get("input")
        if recorded is None:  # written by a raysd that recorded only the --input it was given
            then, given = (previous.get("config") or {}).get("input"), job["config"]["input"]
            if then != given:
                raise JobError(f"output {self.url!r} was started from --input {then!r}, not {given!r} (its {JOB_FILE} "
                               "predates input checks, so only the name can be compared): resume it with that input, "
                               "or choose another --output")
            return
        changes = input_changes(recorded, job["input"])
        if changes:
            raise JobError(f"output {self.url!r} was started from another input ({changes}): resume it with the input "
                           "it was started from, or choose another --output (--overwrite deletes its rows and starts over)")

    # -- writes

    def prepare(self, job: dict, overwrite: bool) -> None:
        """Start or resume the output (after `check`): with --overwrite, first delete what raysd wrote
        there; drop an interrupted run's `_tmp/`; record the job in `_job.json`."""
        try:
            if overwrite:
                self.remove_own_files()
            self.fs.makedirs(self.root, exist_ok=True)
            self._remove_tmp()
            self._write_json(JOB_FILE, job)
        except JobError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise JobError(f"cannot write output {self.url!r}: {one_line(exc)}") from None

    def remove_own_files(self) -> None:
        """Delete the parts, `_summary.json`, `_tmp/` and, last (so that an interrupted deletion is
        still recognised as raysd's), `_job.json` of a raysd output. A directory without `_job.json`
        is not raysd's: nothing in it is touched. Other names are never deleted."""
        entries = self._entries()
        if entries.get(JOB_FILE) != "file":
            return
        for name, kind in entries.items():
            if kind == "file" and (is_part(name) or name == SUMMARY_FILE):
                self.fs.rm_file(self._path(name))
        self._remove_tmp()
        self.fs.rm_file(self._path(JOB_FILE))

    def _remove_tmp(self) -> None:
        if self.fs.exists(self._path(TMP_DIR)):  # leftovers of an interrupted run never count
            self.fs.rm(self._path(TMP_DIR), recursive=True)

    def done_samples(self, id_column: str) -> dict:
        """{id: frozenset of the sample indices in the parts}: what a resume skips (the id stage,
        raysd.jobs.pipeline.AssignIds). Reads the id and sample_index columns only; a part written
        before sample_index existed holds sample 0. Equal sets are one object (N samples per id:
        one set for all ids), so this costs about a set of the ids."""
        found: dict = {}
        for path in self.parts():
            with self.fs.open(path, "rb") as f:
                parquet = pq.ParquetFile(f)
                has_index = "sample_index" in parquet.schema_arrow.names
                table = parquet.read(columns=[id_column, "sample_index"] if has_index else [id_column])
            ids = table.column(0).to_pylist()
            indices = table.column(1).to_pylist() if has_index else [0] * len(ids)
            for row_id, index in zip(ids, indices):
                found.setdefault(row_id, set()).add(0 if index is None else index)
        interned: dict = {}
        return {row_id: interned.setdefault(frozenset(s), frozenset(s)) for row_id, s in found.items()}

    def _put(self, name: str, write) -> str:
        """Write a file atomically: `write(f)` into `_tmp/`, then a rename into place."""
        final = self._path(name)
        tmp_dir = self._path(TMP_DIR)
        self.fs.makedirs(tmp_dir, exist_ok=True)
        tmp = f"{tmp_dir}/{uuid.uuid4().hex[:8]}-{name}"
        with self.fs.open(tmp, "wb") as f:
            write(f)
        if self.local:
            os.replace(tmp, final)  # atomic on one filesystem
        else:
            self.fs.mv(tmp, final)  # object stores: the object appears whole or not at all
        return final

    def write_part(self, table: pa.Table, name: str | None = None) -> str:
        """Write one part atomically: a temporary file, then a rename into place.

        The same `name` twice (a retried write task) replaces the part rather than adding one.
        """
        name = name or f"part-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:12]}.parquet"
        return self._put(name, lambda f: pq.write_table(table, f))

    def totals(self) -> dict:
        """Counts over every row on disk (`raysd.jobs.schema.row_totals`) plus `finish_reasons`,
        read part by part, a few columns at a time."""
        totals = row_totals(None)
        reasons: dict = {}
        for path in self.parts():
            with self.fs.open(path, "rb") as f:
                parquet = pq.ParquetFile(f)
                table = parquet.read(columns=[c for c in TOTALS_COLUMNS if c in parquet.schema_arrow.names])
            for k, v in row_totals(table).items():
                totals[k] += v
            for reason, count in Counter(table.column("finish_reason").to_pylist()).items():
                reasons[reason] = reasons.get(reason, 0) + count
        return {**totals, "finish_reasons": reasons}

    def _write_json(self, name: str, obj: dict) -> None:
        text = json.dumps(obj, indent=2, default=str) + "\n"
        self._put(name, lambda f: f.write(text.encode("utf-8")))

    def write_summary(self, summary: dict) -> None:
        self._write_json(SUMMARY_FILE, summary)
        self._remove_tmp()
