"""Optional parts of the vLLM bundle (op libraries, FA3): checksums, staging across device calls, unpacking.

    python3 benchmarks/vllm_gpu/parts.py stage SRC [DEST]          # a staging call: SRC's parts -> DEST (/tmp)
    python3 benchmarks/vllm_gpu/parts.py extract SITE DIR [DIR]...  # unpack.sh: every optional part found
                                                       (JTQ_REQUIRE_PARTS="moe c": refuse when one is missing)
    python3 benchmarks/vllm_gpu/parts.py plan DIR [DIR]...          # here: each device call's bytes, checked

One device call carries at most 64 MiB (the repository tree included). vLLM's compiled op libraries do not fit
one call beside the bundle's core and wheels (``_C_stable_libtorch`` 55.8 MB with xz, ``_moe_C_stable_libtorch``
40.4 MB), so each travels in a call of its own that copies it to ``/tmp/jtq_parts`` (a warm machine keeps
``/tmp`` when the next call follows within ~30 s); the last call carries the bundle, and ``unpack.sh`` extracts
every part it finds in the bundle directory or in ``/tmp/jtq_parts``. Each part ``vllm-KEY.tar.xz`` (or its
pieces ``.partNN``) comes with ``vllm-KEY.tar.xz.sha256`` (``sha256sum`` format): a part that does not match its
checksum, or lacks one, is refused, so a stale or half-copied part never reaches vLLM. Standard library only
(runs on the GPU image's Python).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path

#: bytes one device call may carry (the files under the tree plus every carried path)
CALL_BYTES = 64 * 2**20
#: where staging calls leave their parts for the next call
STAGED = Path("/tmp/jtq_parts")
#: optional part key -> the wheel member it holds (bundle.py writes vllm-KEY.tar.xz)
MEMBERS = {
    "c": "vllm/_C_stable_libtorch.abi3.so",
    "moe": "vllm/_moe_C_stable_libtorch.abi3.so",
    "fa3": "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
}
_PIECE = re.compile(r"^vllm-(?P<key>[a-z0-9]+)\.tar\.xz(\.part\d\d)?$")


class PartError(RuntimeError):
    """An optional part that cannot be used: missing checksum, checksum mismatch, missing piece."""


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**20):
            h.update(block)
    return h.hexdigest()


def write_checksums(pieces: list[Path]) -> Path:
    """``vllm-KEY.tar.xz.sha256`` beside the pieces of one part (``sha256sum -c`` reads it too)."""
    first = pieces[0]
    name = first.name.split(".part")[0] if ".part" in first.name else first.name
    out = first.with_name(f"{name}.sha256")
    out.write_text("".join(f"{sha256(p)}  {p.name}\n" for p in sorted(pieces)))
    return out


def pieces_in(directory: Path) -> dict[str, list[Path]]:
    """key -> the pieces of each optional part in ``directory`` (sorted; a whole file is one piece)."""
    found: dict[str, list[Path]] = {}
    for p in sorted(directory.glob("vllm-*.tar.xz*")) if directory.is_dir() else []:
        m = _PIECE.match(p.name)
        if m and m["key"] in MEMBERS:
            found.setdefault(m["key"], []).append(p)
    return found


def checksums(key: str, directory: Path) -> tuple[str, dict[str, str]]:
    """(where from, piece name -> hex digest) of a part: its ``.sha256`` file, else the bundle's manifest.json
    (bundle.py records every part's digest there; bundles built before the ``.sha256`` files have only that)."""
    sums = directory / f"vllm-{key}.tar.xz.sha256"
    if sums.exists():
        lines = [line.split(maxsplit=1) for line in sums.read_text().splitlines() if line.strip()]
        return sums.name, {name.strip(): digest for digest, name in lines}
    manifest = directory / "manifest.json"
    if manifest.exists():
        import json

        listed = json.loads(manifest.read_text()).get("sha256", {})
        mine = {n: d for n, d in listed.items() if _PIECE.match(n) and _PIECE.match(n)["key"] == key}
        if mine:
            return manifest.name, mine
    raise PartError(f"{directory}: part {key!r} has no vllm-{key}.tar.xz.sha256 and no digest in manifest.json")


def verify(key: str, pieces: list[Path]) -> None:
    """Raise PartError unless the part's checksums list exactly these pieces with these hashes."""
    source, want = checksums(key, pieces[0].parent)
    have = {p.name for p in pieces}
    if set(want) != have:
        raise PartError(f"part {key!r}: {source} lists {sorted(want)}, found {sorted(have)}")
    for p in pieces:
        if sha256(p) != want[p.name]:
            raise PartError(f"part {key!r}: {p} does not match {source} (stale or cut short)")


def find(dirs: list[Path]) -> dict[str, list[Path]]:
    """key -> verified pieces of each optional part, from the first directory that has it."""
    out: dict[str, list[Path]] = {}
    for d in dirs:
        for key, pieces in pieces_in(d).items():
            if key not in out:
                verify(key, pieces)
                out[key] = pieces
    return out


def extract(site: Path, dirs: list[Path]) -> dict[str, str]:
    """Unpack every optional part found in ``dirs`` into ``site``; key -> the directory it came from."""
    done = {}
    for key, pieces in find(dirs).items():
        with _Joined(pieces) as stream, tarfile.open(fileobj=stream, mode="r|xz") as tar:
            for member in tar:
                if member.name != MEMBERS[key]:
                    raise PartError(f"part {key!r}: unexpected member {member.name!r} (expected {MEMBERS[key]!r})")
                tar.extract(member, site, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        done[key] = str(pieces[0].parent)
    return done


class _Joined:
    """The pieces of one part read as one stream (``cat piece*``) without writing the whole file."""

    def __init__(self, pieces: list[Path]) -> None:
        self.pieces, self.f = list(pieces), None

    def __enter__(self) -> _Joined:
        return self

    def __exit__(self, *exc) -> None:
        if self.f:
            self.f.close()

    def read(self, n: int = -1) -> bytes:
        out = b""
        while n < 0 or len(out) < n:
            if self.f is None:
                if not self.pieces:
                    break
                self.f = open(self.pieces.pop(0), "rb")
            chunk = self.f.read(-1 if n < 0 else n - len(out))
            if not chunk:
                self.f.close()
                self.f = None
            out += chunk
        return out


def stage(src: Path, dest: Path = STAGED) -> dict[str, int]:
    """A staging call: verify the parts in ``src``, copy them (and their checksums) to ``dest``, verify the copies."""
    found = find([src])
    if not found:
        raise PartError(f"{src}: no optional part (vllm-KEY.tar.xz with KEY in {sorted(MEMBERS)})")
    dest.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for key, pieces in found.items():
        for old in dest.glob(f"vllm-{key}.tar.xz*"):
            old.unlink()
        source, want = checksums(key, src)
        for p in pieces:
            shutil.copyfile(p, dest / p.name)
        (dest / f"vllm-{key}.tar.xz.sha256").write_text("".join(f"{want[p.name]}  {p.name}\n" for p in pieces))
        verify(key, [dest / p.name for p in pieces])
        sizes[key] = sum(p.stat().st_size for p in pieces)
    return sizes


def tree_bytes(root: Path) -> int:
    """Bytes of the files git tracks under ``root`` (what a device call sends besides the carried paths)."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (or of the file itself)."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_calls(calls: list[Path], tree: int, limit: int = CALL_BYTES) -> list[dict]:
    """Each call's carried path, its bytes with the tree, and the room left; PartError when one is over."""
    rows = []
    for path in calls:
        total = dir_bytes(path) + tree
        rows.append({"carry": str(path), "bytes": total, "left": limit - total})
        if total > limit:
            raise PartError(f"{path}: {total:,} B with the tree > one device call's {limit:,} B")
    return rows


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "stage":
        sizes = stage(Path(argv[1]), Path(argv[2]) if len(argv) > 2 else STAGED)
        free = shutil.disk_usage(argv[2] if len(argv) > 2 else STAGED).free
        print(f"parts: staged {sizes} in {argv[2] if len(argv) > 2 else STAGED} ({free / 2**30:.0f} GiB free there)")
    elif len(argv) >= 3 and argv[0] == "extract":
        dirs = [Path(a) for a in argv[2:]]
        need = [k for k in os.environ.get("JTQ_REQUIRE_PARTS", "").replace(",", " ").split() if k]
        missing = sorted(set(need) - set(find(dirs)))
        if missing:  # a staging call's /tmp did not survive: stop before a run that cannot use it
            raise PartError(f"JTQ_REQUIRE_PARTS: no {missing} in {[str(d) for d in dirs]} (stage them again)")
        done = extract(Path(argv[1]), dirs)
        print("parts: " + (", ".join(f"{k} from {v}" for k, v in done.items()) or "none found"))
    elif len(argv) >= 2 and argv[0] == "plan":
        tree = tree_bytes(Path.cwd())
        for row in check_calls([Path(a) for a in argv[1:]], tree):
            print(
                f"call carrying {row['carry']}: {row['bytes'] / 2**20:.1f} MiB with the tree, "
                f"{row['left'] / 2**20:.1f} MiB left"
            )
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except PartError as e:
        raise SystemExit(f"parts: {e}") from None
