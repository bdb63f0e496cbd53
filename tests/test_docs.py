"""The user docs point only at things that exist: files and headings in this repository, or a short list of sites.

Checked in README.md, CHANGELOG.md, docs/*.md, benchmarks/*.md and requirements/*.md:
- every Markdown link or image with a relative target names a file or folder inside the repository, and an anchor
  (``file.md#heading``, ``#heading``) names a heading of that file (GitHub's slug rule);
- every web address (in a link or bare) is one of ``ALLOWED_URLS`` or below one: the TurboQuant paper on arXiv and the
  vLLM and Triton projects, the two pieces of software this one plugs into. Anything else (a personal machine's
  path, a notes folder beside the repository, another site) is a link a reader of a clone cannot follow;
- no text points outside the repository: a relative path that climbs out of it (``../shared/notes.md``) or a path
  on the machine the docs were written on (``/work/...``);
- every repository path written in code (inline code or a code block) that starts with one of the repository's
  source folders exists, so docs cannot keep naming deleted scripts or raw-output folders. CHANGELOG.md is exempt
  from this one check: history names files that are gone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_GLOBS = ("README.md", "CHANGELOG.md", "docs/*.md", "benchmarks/*.md", "requirements/*.md")
#: web addresses a doc may cite: the paper the format implements, and the projects it plugs into
ALLOWED_URLS = (
    "https://arxiv.org/abs/2504.19874/",
    "https://github.com/vllm-project/vllm/",
    "https://docs.vllm.ai/",
    "https://github.com/triton-lang/triton/",
    "https://triton-lang.org/",
)
#: the tracked source folders; a path in code that starts with one of them must exist
SOURCE_DIRS = ("benchmarks", "configs", "demos", "docker", "docs", "jetson_tq", "requirements", "tests", ".ci")
NO_PATH_CHECK = {"CHANGELOG.md"}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
URL = re.compile(r"https?://[^\s)\]>`'\"]+")
_DIRS = "|".join(re.escape(d) for d in SOURCE_DIRS)
PATH = re.compile(r"(?<![\w./$~-])((?:" + _DIRS + r")/(?:[^\s`'\"(),;:|{}]|\{[^{}\s]*\})*)")
PLACEHOLDER = set("<>[]$")  # <out>/x, $OUT/x, [a|b]: a placeholder, not a file name
CAPS_WORD = re.compile(r"(^|/)[A-Z][A-Z0-9_]+(\.|/|$)")  # requirements/GROUP.txt: a placeholder name
CLIMB = re.compile(r"(?<![\w./-])((?:\.\./)+[\w./-]*)")
MACHINE_PATH = re.compile(r"(?<![\w./-])(/work/[^\s`'\"(),;]*)")  # where this repository was written


def allowed_url(url: str) -> bool:
    """True when ``url`` is an allowed address or a page below one (``.../vllm`` yes, ``.../vllm-fork`` no)."""
    return (url.rstrip("/") + "/").startswith(ALLOWED_URLS)


def doc_files() -> list[Path]:
    """Every Markdown file the checks cover, sorted."""
    found = {p for g in DOC_GLOBS for p in ROOT.glob(g) if p.is_file()}
    return sorted(found)


def split_code(text: str) -> tuple[str, list[str]]:
    """The text with code blocks and inline code blanked out, and the code pieces themselves."""
    code: list[str] = []

    def keep(m: re.Match) -> str:
        code.append(m.group(0))
        return " " * len(m.group(0))

    prose = FENCE.sub(keep, text)
    prose = INLINE_CODE.sub(keep, prose)
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (duplicates numbered as GitHub numbers them)."""
    prose = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def link_problems(doc: Path, root: Path = ROOT) -> list[str]:
    """Each broken relative link, unknown anchor or disallowed web address of one doc, as a message."""
    prose, _ = split_code(doc.read_text(encoding="utf-8"))
    targets = [m.group(1) for m in LINK.finditer(prose)] + [m.group(1) for m in REF_DEF.finditer(prose)]
    problems = []
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            if not allowed_url(target):
                problems.append(f"link to {target}: not in ALLOWED_URLS")
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if root not in dest.parents and dest != root:
            problems.append(f"link to {target}: outside the repository")
        elif not dest.exists():
            problems.append(f"link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            problems.append(f"link to {target}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    linked = set(targets)
    for url in URL.findall(prose):
        url = url.rstrip(".,;:")
        if url not in linked and not allowed_url(url):
            problems.append(f"address {url}: not in ALLOWED_URLS")
    return problems


def expand_braces(path: str) -> list[str]:
    """Shell brace expansion of one path: ``f.{md,json}`` -> ``f.md``, ``f.json``."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand_braces(path[: m.start()] + alt + path[m.end() :])]


def path_problems(doc: Path, root: Path = ROOT) -> list[str]:
    """Each repository path written in the doc's code that does not exist, as a message."""
    if doc.name in NO_PATH_CHECK and doc.parent == root:
        return []
    _, code = split_code(doc.read_text(encoding="utf-8"))
    problems = []
    for piece in code:
        for m in PATH.finditer(piece):
            path = m.group(1).rstrip(".")
            if PLACEHOLDER & set(path) or "..." in path or CAPS_WORD.search(path):
                continue
            for one in expand_braces(path):  # a{b,c}: both must exist; a glob must match something
                found = any(root.glob(one)) if set("*?") & set(one) else (root / one).exists()
                if not found:
                    problems.append(f"path {one}: no such file or folder")
    return sorted(set(problems))


def outside_problems(doc: Path, root: Path = ROOT) -> list[str]:
    """Each path in the doc that leaves the repository (or names nothing in it) or names one machine's folders."""
    text = doc.read_text(encoding="utf-8")
    prose, _ = split_code(text)
    problems = []
    for m in CLIMB.finditer(prose):  # in code, "../x" is an example input (robustness.md), not a reference
        dest = (doc.parent / m.group(1)).resolve()
        if root not in dest.parents and dest != root:
            problems.append(f"path {m.group(1)}: outside the repository")
        elif not dest.exists():
            problems.append(f"path {m.group(1)}: no such file in the repository")
    problems += [f"path {m.group(1)}: a folder of one machine" for m in MACHINE_PATH.finditer(text)]
    return sorted(set(problems))


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc: Path) -> None:
    """Relative links name existing files and headings; web links stay on the allow-list."""
    problems = link_problems(doc)
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_code_paths_exist(doc: Path) -> None:
    """Paths of repository files quoted in code exist (no deleted scripts or raw-output folders)."""
    problems = path_problems(doc)
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_points_outside_the_repository(doc: Path) -> None:
    """No relative path climbs out of the clone and no path names a folder of the machine the doc was written on."""
    problems = outside_problems(doc)
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """A missing file, a bad anchor, an outside path, a foreign site and a deleted script each fail their check."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_decode.py").write_text("")
    doc = tmp_path / "docs" / "probe.md"
    doc.write_text(
        "# Real heading\n[ok](#real-heading) [bad anchor](#nope) [gone](missing.md) [out](../../elsewhere/x.md)\n"
        "[site](https://example.com/x) [paper](https://arxiv.org/abs/2504.19874) <https://example.org>\n"
        "[vllm](https://github.com/vllm-project/vllm/tree/main) [fork](https://github.com/vllm-project/vllm-fork)\n"
        "run `benchmarks/gpu_run_gone.sh`, `benchmarks/bench_{decode,api}.py`, `benchmarks/bench_*.py`, `tests/x*.py`\n"
        "```\npython benchmarks/bench_decode.py --out $OUT/benchmarks/x  # see requirements/GROUP.txt\n```\n"
        "as ../shared/NOTES.md says; clone /work/wt/x here; docs/../README.md\n",
        encoding="utf-8",
    )
    links = link_problems(doc, root=tmp_path)
    assert any("#nope" in p for p in links)
    assert any("missing.md: no such file" in p for p in links)
    assert any("elsewhere/x.md: outside the repository" in p for p in links)
    assert any("example.com" in p for p in links) and any("example.org" in p for p in links)
    assert any("vllm-fork" in p for p in links)
    assert not any("arxiv" in p or "real-heading" in p or "tree/main" in p for p in links)
    assert path_problems(doc, root=tmp_path) == [
        "path benchmarks/bench_api.py: no such file or folder",
        "path benchmarks/gpu_run_gone.sh: no such file or folder",
        "path tests/x*.py: no such file or folder",
    ]
    assert outside_problems(doc, root=tmp_path) == [
        "path ../../elsewhere/x.md: outside the repository",
        "path ../shared/NOTES.md: no such file in the repository",
        "path /work/wt/x: a folder of one machine",
    ]
    heading = "vLLM 0.26.0 on a GPU (H200, 2026-12-01): the product `path`"
    assert slug(heading) == "vllm-0260-on-a-gpu-h200-2026-12-01-the-product-path"
