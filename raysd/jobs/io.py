"""Reading prompts and writing results as streams, on any fsspec filesystem.

Inputs: Parquet (a file, a directory or a glob), JSON Lines (the same), or a
`datasets` dataset saved with `save_to_disk` (or one already in the local cache,
named; nothing is ever downloaded). Each is read lazily in batches of rows, so an
input larger than memory is never loaded whole.

Output: a directory of `part-*.parquet` files. Each is written under a temporary
name and renamed into place, so a file that is there is complete; a re-run reads
the ids already written and skips those rows.
"""

from __future__ import annotations

import glob as _glob
import json
import os
import time
import uuid
from dataclasses import dataclass
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


class InputSource:
    """Rows of a prompt dataset, read lazily, in a stable order."""

    kind: str
    schema: pa.Schema  # the input's columns; JSON Lines: inferred from its first rows
    num_rows: int | None = None  # when cheap to know (progress bar total)
    json_columns: frozenset[str] = frozenset()  # JSON Lines columns of mixed type, written as JSON text

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        raise NotImplementedError


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
            total = 0
            for path in files:
                with fs.open(path, "rb") as f:
                    total += pq.ParquetFile(f).metadata.num_rows
            self.num_rows = total

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        for path in self.files:
            with self.fs.open(path, "rb") as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size):
                    yield batch.to_pylist()


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
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise JobError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                    if not isinstance(row, dict):
                        raise JobError(f"{path}:{lineno}: each line must be a JSON object")
                    yield row

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        batch = []
        for row in self._rows():
            batch.append(row)
            if len(batch) >= batch_size:
                yield batch
                batch = []
        if batch:
            yield batch


class DatasetsSource(InputSource):
    kind = "datasets"

    def __init__(self, dataset, name: str):
        self.dataset = dataset
        self.schema = dataset.data.schema
        self.num_rows = len(dataset)
        self.name = name

    def batches(self, batch_size: int) -> Iterator[list[dict]]:
        for table in self.dataset.with_format("arrow").iter(batch_size=batch_size):
            yield table.to_pylist()


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

    def write_part(self, table: pa.Table) -> str:
        """Write one part atomically: a temporary file, then a rename into place."""
        name = f"part-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:12]}.parquet"
        final = self._path(name)
        tmp_dir = self._path(TMP_DIR)
        self.fs.makedirs(tmp_dir, exist_ok=True)
        tmp = f"{tmp_dir}/{name}"
        with self.fs.open(tmp, "wb") as f:
            pq.write_table(table, f)
        if self.local:
            os.replace(tmp, final)  # atomic on one filesystem
        else:
            self.fs.mv(tmp, final)  # object stores: the object appears whole or not at all
        return final

    def read_columns(self, columns: list[str]) -> pa.Table | None:
        tables = []
        for path in self.parts():
            with self.fs.open(path, "rb") as f:
                tables.append(pq.read_table(f, columns=columns))
        return pa.concat_tables(tables) if tables else None

    def _write_json(self, name: str, obj: dict) -> None:
        with self.fs.open(self._path(name), "wt") as f:
            json.dump(obj, f, indent=2, default=str)
            f.write("\n")

    def write_summary(self, summary: dict) -> None:
        self._write_json(SUMMARY_FILE, summary)
        if self.fs.exists(self._path(TMP_DIR)):
            self.fs.rm(self._path(TMP_DIR), recursive=True)


@dataclass
class RowBuffer:
    """Completed rows waiting to be written as one part."""

    rows: list[dict]
    since: float

    @staticmethod
    def empty() -> "RowBuffer":
        return RowBuffer([], time.monotonic())
