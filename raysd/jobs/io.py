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
complete; a re-run reads the ids already written and skips those rows.
"""

from __future__ import annotations

import glob as _glob
import json
import os
import time
import uuid
from typing import Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from raysd.jobs.config import JobError

PARQUET_EXT = (".parquet", ".pq")
JSONL_EXT = (".jsonl", ".json", ".ndjson")
_DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_JSONL_SCHEMA_ROWS = 1000  # rows of a JSON Lines input that fix its column types


def _url_to_fs(url: str):
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # unknown protocol, or its package is missing
        raise JobError(f"cannot open {url!r}: {str(exc).splitlines()[0]}") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


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

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        raise NotImplementedError

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
            raise JobError(f"cannot read Parquet file {files[0]!r}: {_one_line(exc)}") from None
        self.num_rows = None
        if len(files) <= 64:  # footers only; skipped for many (remote) files
            total, schemas = 0, []
            for path in files:
                try:
                    with fs.open(path, "rb") as f:
                        meta = pq.ParquetFile(f).metadata
                except Exception as exc:  # noqa: BLE001
                    raise JobError(f"cannot read Parquet file {path!r}: {_one_line(exc)}") from None
                total += meta.num_rows
                schemas.append(meta.schema.to_arrow_schema())
            self.num_rows = total
            try:  # a column all-null in one file and typed in another takes the type
                self.schema = pa.unify_schemas(schemas, promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                raise JobError(f"input Parquet files disagree on their columns: {_one_line(exc)}") from None

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        for path in self.files:
            with self.fs.open(path, "rb") as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size):
                    yield batch.to_pylist()

    def dataset(self):
        import ray

        if in_process(self.fs):
            return self._driver_dataset()
        return ray.data.read_parquet(self.files, filesystem=arrow_filesystem(self.fs), file_extensions=None,
                                     num_cpus=IO_TASK_CPUS)


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
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise JobError(f"{where}not valid JSON ({exc.msg}){shown}") from None
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
                type_ = pa.array(values).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
                type_ = pa.null()
            if pa.types.is_null(type_):  # mixed or all-null: JSON text (strings kept as they are)
                type_ = pa.string()
                json_columns.add(name)
            fields.append(pa.field(name, type_))
        self.schema = pa.schema(fields)
        self.json_columns = frozenset(json_columns)

    def _rows(self) -> Iterator[dict]:
        for path in self.files:
            with self.fs.open(path, "rt", encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield _json_object(line, f"{path}:{lineno}: ")

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

    def __init__(self, dataset, name: str):
        self.hf_dataset = dataset
        self.schema = dataset.data.schema
        self.num_rows = len(dataset)
        self.name = name

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
            return _files_by_kind(fs, files, url)
        if fs.isdir(path):
            if local and any(os.path.exists(os.path.join(path, m)) for m in _DATASETS_MARKERS):
                return _load_from_disk(path, split, url)
            files = [f for f in fs.find(path) if not os.path.basename(f).startswith((".", "_"))]
            return _files_by_kind(fs, files, url)
        if fs.isfile(path):
            if path.lower().endswith(PARQUET_EXT):
                return ParquetSource(fs, [path])
            if path.lower().endswith(JSONL_EXT):
                return JsonlSource(fs, [path])
            raise JobError(f"input {url!r}: unknown file type (expected {', '.join(PARQUET_EXT + JSONL_EXT)})")
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - credentials, network, permissions: one line
        raise JobError(f"cannot read input {url!r}: {_one_line(exc)}") from None
    if "://" not in url and not url.startswith(("/", ".", "~")) and url.count("/") <= 1:
        return _load_cached_dataset(url, split)
    raise JobError(f"input {url!r} does not exist")


def _load_from_disk(path: str, split: str | None, name: str) -> DatasetsSource:
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(path)
    except Exception as exc:  # noqa: BLE001
        raise JobError(f"cannot load dataset {name!r}: {_one_line(exc)}") from None
    return DatasetsSource(_pick_split(dataset, split, name), name)


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
            f"(raysd never downloads): {_one_line(exc)}"
        ) from None
    return DatasetsSource(_pick_split(dataset, None, name), name)


# ---------------------------------------------------------------------------- output

JOB_FILE, SUMMARY_FILE, TMP_DIR = "_job.json", "_summary.json", "_tmp"


class OutputStore:
    """A directory of Parquet parts plus `_job.json` (what wrote it) and `_summary.json`."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = _url_to_fs(url)
        self.root = self.root.rstrip("/") or "/"
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.local = protocol in ("file", "local")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self) -> bool:
        return self.fs.exists(self.root)

    def parts(self) -> list[str]:
        if not self.fs.isdir(self.root):
            return []
        names = [p for p in self.fs.ls(self.root, detail=False)]
        return sorted(p for p in names if os.path.basename(p).startswith("part-") and p.endswith(".parquet"))

    def read_job(self) -> dict | None:
        path = self._path(JOB_FILE)
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "rt") as f:
            return json.load(f)

    def prepare(self, job: dict, overwrite: bool) -> None:
        """Start over (--overwrite) or check that the output was written by the same job."""
        try:
            if overwrite and self.exists():
                self.fs.rm(self.root, recursive=True)
            if self.exists():
                if not self.fs.isdir(self.root):
                    raise JobError(f"output {self.url!r} is a file, not a directory")
                previous = self.read_job()
                if previous is None:
                    if self.fs.ls(self.root, detail=False):
                        raise JobError(f"output {self.url!r} exists and was not written by raysd; use --overwrite or another --output")
                elif previous.get("fingerprint") != job["fingerprint"]:
                    diff = sorted(k for k in job["fingerprint"] if previous.get("fingerprint", {}).get(k) != job["fingerprint"][k])
                    raise JobError(
                        f"output {self.url!r} was written by a job with different {', '.join(diff)}; "
                        "use --overwrite to start over, or another --output"
                    )
            self.fs.makedirs(self.root, exist_ok=True)
            if self.fs.exists(self._path(TMP_DIR)):  # leftovers of an interrupted run never count
                self.fs.rm(self._path(TMP_DIR), recursive=True)
            self._write_json(JOB_FILE, job)
        except JobError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise JobError(f"cannot write output {self.url!r}: {_one_line(exc)}") from None

    def done_ids(self, id_column: str) -> set:
        ids: set = set()
        for path in self.parts():
            with self.fs.open(path, "rb") as f:
                ids.update(pq.read_table(f, columns=[id_column]).column(0).to_pylist())
        return ids

    def write_part(self, table: pa.Table, name: str | None = None) -> str:
        """Write one part atomically: a temporary file, then a rename into place.

        The same `name` twice (a retried write task) replaces the part rather than adding one.
        """
        name = name or f"part-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:12]}.parquet"
        final = self._path(name)
        tmp_dir = self._path(TMP_DIR)
        self.fs.makedirs(tmp_dir, exist_ok=True)
        tmp = f"{tmp_dir}/{uuid.uuid4().hex[:8]}-{name}"
        with self.fs.open(tmp, "wb") as f:
            pq.write_table(table, f)
        if self.local:
            os.replace(tmp, final)  # atomic on one filesystem
        else:
            self.fs.mv(tmp, final)  # object stores: the object appears whole or not at all
        return final

    def value_counts(self, column: str) -> tuple[int, dict]:
        """(rows, {value: count}) of one column over every part, one part's column in memory at a time."""
        rows, counts = 0, {}
        for path in self.parts():
            with self.fs.open(path, "rb") as f:
                values = pq.read_table(f, columns=[column]).column(0).to_pylist()
            rows += len(values)
            for v in values:
                counts[v] = counts.get(v, 0) + 1
        return rows, counts

    def _write_json(self, name: str, obj: dict) -> None:
        with self.fs.open(self._path(name), "wt") as f:
            json.dump(obj, f, indent=2, default=str)
            f.write("\n")

    def write_summary(self, summary: dict) -> None:
        self._write_json(SUMMARY_FILE, summary)
        if self.fs.exists(self._path(TMP_DIR)):
            self.fs.rm(self._path(TMP_DIR), recursive=True)
