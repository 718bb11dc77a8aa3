"""Where cartridge files come from: a local path, Hugging Face, S3 or Weights & Biases, cached on disk.

Each source returns a local file (and the manifest beside it when the source has one). Remote files are cached
under `cache_dir/<source>/<sanitised id>/`; a cached copy is reused unless `force_redownload`. Ids never become
paths as given: they are reduced to a safe name plus a short hash, so `../../etc` cannot escape the cache.
The remote clients are optional extras, imported only when their source is used.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from final.cartridges.manifest import MANIFEST_SUFFIX
from final.errors import CartridgeError
from final.protocol.bodies import CARTRIDGE_SOURCES

SOURCES = CARTRIDGE_SOURCES  # final.protocol.bodies: the sources a request may name
# Hugging Face repos are searched for these names (in order) when no `path` names the file.
HF_DEFAULT_FILES = ("cartridge.pt", "cartridge.safetensors", "cache_last.pt")
_EXTRAS = {"boto3": "s3", "huggingface_hub": "hf", "wandb": "wandb"}


@dataclass(frozen=True)
class Fetched:
    path: Path
    manifest: Path | None


def default_cache_dir() -> Path:
    return Path(os.environ.get("FINAL_CACHE", "~/.cache/final")).expanduser() / "cartridges"


def safe_name(text: str, max_len: int = 80) -> str:
    """A file-name-safe form of an id: only [A-Za-z0-9._-], no leading dot, plus a hash of the original."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")[:max_len] or "cartridge"
    return f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def fetch(source: str, cartridge_id: str, path: str | None = None, *, cache_dir: str | Path | None = None,
          force_redownload: bool = False) -> Fetched:
    """Return the local cartridge file for `{id, source, path}` (downloading into the cache if needed)."""
    if source not in SOURCES:
        raise CartridgeError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}", file=cartridge_id,
                             field="source")
    if source == "local":
        return _local(path or cartridge_id)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return {"huggingface": _huggingface, "s3": _s3, "wandb": _wandb}[source](cartridge_id, path, root,
                                                                           force_redownload)


def _import(module: str, source: str, cid: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CartridgeError(f"source {source!r} needs the {module} package: pip install 'final[{_EXTRAS[module]}]' "
                             f"(or pip install {module})", file=cid, field="source") from None


def _local(path: str) -> Fetched:
    p = Path(path).expanduser()
    if not p.is_file():
        raise CartridgeError("file does not exist" if not p.exists() else "is not a regular file", file=str(p),
                             field="path")
    m = p.with_name(p.name + MANIFEST_SUFFIX)
    return Fetched(p, m if m.is_file() else None)


def _cached(root: Path, source: str, cid: str, filename: str, force: bool,
            download: Callable[[Path], None]) -> tuple[Path, bool]:
    """Download once into root/source/safe(id)/safe(filename), atomically (temp file + rename).

    Returns the file and whether it was downloaded now (False: a cache hit, no network used).
    """
    folder = root / source / safe_name(cid)
    target = folder / re.sub(r"[^A-Za-z0-9._-]+", "_", Path(filename).name).lstrip(".")
    if target.is_file() and not force:
        return target, False
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=folder)
    os.close(fd)
    try:
        download(Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target, True


# ---- S3 ------------------------------------------------------------------------------------------------
def parse_s3(uri: str, cid: str) -> tuple[str, str]:
    m = re.match(r"^s3://([^/]+)/(.+)$", uri)
    if not m:
        raise CartridgeError(f"expected s3://bucket/key, got {uri!r}", file=cid, field="id")
    return m.group(1), m.group(2)


def _s3(cid: str, path: str | None, root: Path, force: bool) -> Fetched:
    boto3 = _import("boto3", "s3", cid)
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, key = parse_s3(path or cid, cid)
    client = boto3.client("s3")  # endpoint, region and credentials from the usual AWS env/config

    def get(k: str) -> Callable[[Path], None]:
        return lambda tmp: client.download_file(bucket, k, str(tmp))

    where = f"{bucket}/{key}"
    try:
        file, fresh = _cached(root, "s3", where, key, force, get(key))
        manifest = file.with_name(file.name + MANIFEST_SUFFIX)
        if fresh:  # the manifest travels with the file: refresh it (or learn it is gone) on every download
            manifest.unlink(missing_ok=True)
            try:
                _cached(root, "s3", where, manifest.name, True, get(key + MANIFEST_SUFFIX))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code", "") not in ("404", "NoSuchKey"):
                    file.unlink()  # never leave a cached file whose manifest we could not check
                    raise
            except BaseException:
                file.unlink()
                raise
    except NoCredentialsError:
        raise CartridgeError("no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)",
                             file=cid, field="source") from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        what = "does not exist" if code in ("404", "NoSuchKey", "NoSuchBucket") else f"cannot be read ({code})"
        raise CartridgeError(f"s3://{bucket}/{key} {what}: {exc}", file=cid, field="id") from None
    except BotoCoreError as exc:
        raise CartridgeError(f"S3 download failed: {exc}", file=cid, field="source") from None
    return Fetched(file, manifest if manifest.is_file() else None)


# ---- Hugging Face ----------------------------------------------------------------------------------------
def _huggingface(cid: str, path: str | None, root: Path, force: bool) -> Fetched:
    hub = _import("huggingface_hub", "huggingface", cid)
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.errors import RepositoryNotFoundError

    repo, parts = cid, cid.split("/")
    if len(parts) > 2 and path is None:  # "org/name/file/in/repo.pt": repo ids have exactly one slash
        repo, path = "/".join(parts[:2]), "/".join(parts[2:])
    cache = root / "huggingface"  # huggingface_hub's own cache layout (models--org--name/...)
    unreachable = []

    def download(filename: str) -> Path | None:
        try:
            return Path(hub.hf_hub_download(repo, filename, cache_dir=str(cache), force_download=force))
        except LocalEntryNotFoundError:  # offline (or hub unreachable) and not cached
            unreachable.append(filename)
            return None
        except EntryNotFoundError:
            return None
        except HFValidationError as exc:
            raise CartridgeError(f"not a valid Hugging Face repo id: {exc}", file=cid, field="id") from None
        except RepositoryNotFoundError:
            raise CartridgeError("Hugging Face repository not found (or private without a token)", file=cid,
                                 field="id") from None
        except OSError as exc:  # HTTP and connection errors subclass OSError
            raise CartridgeError(f"Hugging Face download failed: {exc}", file=cid, field="source") from None

    names = [path] if path else list(HF_DEFAULT_FILES)
    for filename in names:
        file = download(filename)
        if file is not None:
            return Fetched(file, download(filename + MANIFEST_SUFFIX))
    why = (" in the local Hugging Face cache, and the hub is offline (HF_HUB_OFFLINE) or unreachable"
           if unreachable else " in the Hugging Face repo")
    raise CartridgeError(f"none of {names} found{why}", file=cid,
                         field="path" if path else "id")


# ---- Weights & Biases --------------------------------------------------------------------------------------
def latest_wandb_cache_file(names: list[str]) -> str | None:
    """The cartridges repo saves `cache-step{N}.pt` / `cache-epoch{N}.pt` to the run; pick the highest N."""
    found = [(int(m.group(2)), n) for n in names if (m := re.fullmatch(r"cache-(epoch|step)(\d+)\.pt", n))]
    if found:
        return max(found)[1]
    return "cache_last.pt" if "cache_last.pt" in names else None


def _wandb(cid: str, path: str | None, root: Path, force: bool) -> Fetched:
    wandb = _import("wandb", "wandb", cid)
    parts = cid.split("/")
    run_path = cid
    if len(parts) > 3 and path is None:  # "entity/project/run_id/file.pt"
        run_path, path = "/".join(parts[:3]), "/".join(parts[3:])
    try:
        run = wandb.Api().run(run_path)
        files = {f.name: f for f in run.files()}
    except Exception as exc:  # wandb raises its own CommError/ValueError family
        raise CartridgeError(f"cannot open the W&B run: {type(exc).__name__}: {exc}", file=cid,
                             field="id") from None
    name = path or latest_wandb_cache_file(sorted(files))
    if name is None or name not in files:
        raise CartridgeError(f"no cartridge file {name or 'cache-step*.pt'} in the run's files", file=cid,
                             field="path" if path else "id")

    def download(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(dir=tmp.parent) as d:
            files[name].download(root=d, replace=True)
            os.replace(Path(d) / name, tmp)

    file, _ = _cached(root, "wandb", cid, name, force, download)
    return Fetched(file, None)
